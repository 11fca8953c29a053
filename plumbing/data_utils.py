"""Data for the scripts: dataset aliases and loading (local folders and files, hub ids) with one-line errors,
required columns, chat templates, prompt and completion tokenisation, and the data order (the seeded permutation
every script visits its data in, and positions in that endless stream, all a checkpoint needs to resume it).
Nothing here computes with a model or talks to other processes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

import torch

import policy_common as pc
from plumbing import models, vision
from plumbing.errors import UserError, require_positive


@dataclass
class DataFlags:
    """The data: which dataset, the held-out split, the longest prompt (every script)."""
    dataset: Optional[str] = None
    """training data (columns: see the docstring): alias (toy|tldr), hub id, folder or json/parquet; None = --model's"""
    eval_split: str = "test"
    """split of the dataset held out for evaluation"""
    max_prompt_length: Optional[int] = None
    """longest prompt in tokens (None = the longest in the data); RL refuses longer prompts, DPO/KTO cut them left"""

    def check(self) -> None:
        require_positive(self, "max_prompt_length")

# Dataset aliases: the public TL;DR datasets behind the published RLOO/PPO/DPO runs (Huang et al. 2024; TRL's
# documentation), and the toy task (built offline by toy_task.py the first time it is named).
TOY_ALIAS = "toy"
TOY_HARD_ALIAS = "toy_hard"  # the harder toy world (toy_task.SETTINGS): longer prompts, repeats, an exploitable RM
TOY_WORLDS = (TOY_ALIAS, TOY_HARD_ALIAS)  # the aliases toy_task.build builds, each a world of its own
TOY_TOOLS_ALIAS = "toy_tools"  # the toy tool world (toy_tools.py): multi-turn episodes with a lookup tool
TOY_VISION_ALIAS = "toy_vision"  # the toy vision world (toy_vision.py): questions about a picture, a tiny LLaVA
DATASET_ALIASES = {  # alias -> (prompts, preference pairs, unpaired examples)
    "tldr": ("trl-lib/tldr", "trl-lib/tldr-preference", "trl-lib/tldr-preference"),  # kto.py unpairs the pairs
}


@dataclass
class HeldOut:
    """A script's held-out data, what its `evaluate` reads: `rows` (the examples its loss or reward is measured on:
    pairs, demonstrations, unpaired examples; the RL scripts' prompt rows, which reward functions read), `prompts`
    (token ids of held-out prompts completed greedily: eval/gold_score and the sample table), `tokenizer` (the one
    that encoded them, which decodes the completions) and `gold` (the task's ground-truth scorer
    `(prompt text, completion text, row) -> float`, or None)."""
    rows: Sequence
    prompts: List[List[int]]
    tokenizer: object
    gold: Optional[Callable[[str, str], float]] = None
    images: Optional[Sequence] = None  # offline scripts: the held-out prompts' vision.ImageSource, None for text


def toy_world(setting: str = TOY_ALIAS) -> dict:
    """The paths of the toy world `setting` (`toy`, `toy_hard`; built offline on first use: toy_task.build)."""
    from toy_worlds import toy_task

    return toy_task.build(setting=setting)


def toy_tools_world() -> dict:
    """The toy tool world's paths (built offline on first use: toy_tools.build)."""
    from toy_worlds import toy_tools

    return toy_tools.build()


def toy_vision_world() -> dict:
    """The toy vision world's paths (built offline on first use: toy_vision.build)."""
    from toy_worlds import toy_vision

    return toy_vision.build()


def toy_teacher(setting: str = TOY_ALIAS) -> str:
    """The teacher of the toy world `setting` (`toy`, `toy_hard`: toy_task.build_teacher; `toy_vision`:
    `toy_vision_teacher`; built offline on first use), the folder distill.py loads."""
    from toy_worlds import toy_task

    if setting == TOY_VISION_ALIAS:
        return toy_vision_teacher()
    return toy_task.build_teacher(setting=setting)["teacher"]


def toy_vision_teacher() -> str:
    """The toy vision world's teacher folder (built offline on first use: toy_vision.build_teacher): a tiny LLaVA with
    the student's processor, trained on the right answers."""
    from toy_worlds import toy_vision

    return toy_vision.build_teacher()["teacher"]


def gold_scorer(dataset: str) -> Optional[Callable[[str, str, dict], float]]:
    """A ground-truth scorer `(prompt_text, completion_text, row) -> float` (`row`: the dataset row, which the toy
    vision world's answer is read from) if the dataset has one (the toy worlds do), else None. Evaluation reports
    `eval/gold_score` whenever one exists."""
    from toy_worlds import toy_task, toy_tools, toy_vision

    return toy_vision.gold_scorer(dataset) or toy_tools.gold_scorer(dataset) or toy_task.gold_scorer(dataset)


def _load_split(name: str, split: str):
    """Load one split of a local `save_to_disk` folder, local .json/.jsonl/.parquet file(s) (comma-separated),
    or hub dataset. An empty split is a UserError."""
    import datasets

    files = [f for f in name.split(",") if f]
    try:
        if os.path.isdir(name) and (os.path.exists(os.path.join(name, "dataset_dict.json"))
                                    or os.path.exists(os.path.join(name, "state.json"))):
            ds = _load_saved(name, split)
        elif files and all(f.endswith((".json", ".jsonl", ".parquet")) for f in files):
            missing = [f for f in files if not os.path.exists(f)]
            if missing:
                raise UserError(f"dataset file(s) not found: {', '.join(missing)}")
            empty = [f for f in files if os.path.getsize(f) == 0]
            if empty:
                raise UserError(f"dataset file(s) are empty: {', '.join(empty)}")
            try:
                ds = datasets.load_dataset("parquet" if files[0].endswith(".parquet") else "json", data_files=files)
            except Exception as e:  # malformed files surface as assorted pyarrow/datasets errors
                raise UserError(f"could not read dataset file(s) {name!r}: {type(e).__name__}: "
                                f"{models.first_line(e)}") from None
        elif os.path.exists(name) or name.startswith((".", "/", "~")):
            raise UserError(f"dataset {name!r}: not a save_to_disk folder nor .json/.jsonl/.parquet file(s)")
        else:
            if not models.hub_reachable() and not _in_datasets_cache(name):
                raise UserError(f"could not load dataset {name!r}: not a local path, and the hub is unreachable "
                                f"(offline); known aliases: {', '.join([*TOY_WORLDS, *DATASET_ALIASES])}")
            ds = datasets.load_dataset(name)
    except (FileNotFoundError, ConnectionError, OSError) as e:
        raise UserError(f"could not load dataset {name!r}: {models.first_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"dataset {name!r} has no split {split!r} (has: {', '.join(ds.keys())})")
        ds = ds[split]
    if len(ds) == 0:
        raise UserError(f"dataset {name!r} split {split!r} is empty")
    return ds


def _load_saved(name: str, split: str):
    """`split` of a save_to_disk folder (a DatasetDict's, or a single Dataset's). datasets cannot load a split
    saved with no rows (it has no data files: load_from_disk raises IndexError), so that split is the
    empty-split UserError here; the other splits are never read."""
    import datasets

    path = name
    if os.path.exists(os.path.join(name, "dataset_dict.json")):
        with open(os.path.join(name, "dataset_dict.json")) as f:
            splits = json.load(f)["splits"]
        if split not in splits:
            raise UserError(f"dataset {name!r} has no split {split!r} (has: {', '.join(splits)})")
        path = os.path.join(name, split)
    with open(os.path.join(path, "state.json")) as f:
        if not json.load(f)["_data_files"]:
            raise UserError(f"dataset {name!r} split {split!r} is empty")
    return datasets.load_from_disk(path, keep_in_memory=True)  # later .map() writes no cache files here


def load_prompt_dataset(name: str, split: str):
    """`split` of a prompt dataset (column `prompt`): alias (`toy`, `tldr`), local folder/files or hub id."""
    if name in TOY_WORLDS:
        return _load_split(toy_world(name)["prompt_dataset"], split)
    if name == TOY_TOOLS_ALIAS:
        return _load_split(toy_tools_world()["prompt_dataset"], split)
    if name == TOY_VISION_ALIAS:
        return _load_split(toy_vision_world()["prompt_dataset"], split)
    return _load_split(DATASET_ALIASES[name][0] if name in DATASET_ALIASES else name, split)


def load_preference_dataset(name: str, split: str):
    """`split` of a preference dataset (`prompt`, `chosen`, `rejected`; an image column with them where the prompts
    show images): alias, local folder/files or hub id."""
    if name in TOY_WORLDS:
        return _load_split(toy_world(name)["preference_dataset"], split)
    if name == TOY_VISION_ALIAS:
        return _load_split(toy_vision_world()["preference_dataset"], split)
    return _load_split(DATASET_ALIASES[name][1] if name in DATASET_ALIASES else name, split)


def load_unpaired_dataset(name: str, split: str):
    """`split` of unpaired feedback (`prompt`, `completion`, `label`, or pairs to unpair; an image column with them
    where the prompts show images): alias, folder, hub id."""
    if name in TOY_WORLDS:
        return _load_split(toy_world(name)["unpaired_dataset"], split)
    if name == TOY_VISION_ALIAS:
        return _load_split(toy_vision_world()["unpaired_dataset"], split)
    return _load_split(DATASET_ALIASES[name][2] if name in DATASET_ALIASES else name, split)


def text_only(data, name: str):
    """`data`, refused in one line when it has an image column: the script reading it does not take images yet (its
    images would be dropped and the model trained blind)."""
    column = vision.image_column(data.column_names)
    if column is not None:
        raise UserError(f"dataset {name!r} has an {column!r} column: this script does not take images (sft, dpo, "
                        "kto, rloo, grpo and distill do)")
    return data


def with_images(data, images: Optional[vision.Vision]):
    """The offline scripts' examples: `data` as it is for text (`images` None), else its rows as dicts, each with its
    prompt's images under `images` (vision.ImageSource; the pictures read undecoded, encoded when a batch needs them),
    which the tokenisers and `prompts_of` read."""
    if images is None:
        return data
    return [{**row, "images": images.source(row)} for row in images.undecoded(data)]


def prompts_of(*datasets) -> list:
    """The prompts of `with_images` examples (of each of `datasets`, one after another), as tl.fit_lengths measures
    them: the `prompt` column for text, each example's vision.ImageSource (its prompt with the image tokens) where the
    prompts have images."""
    return [p for examples in datasets for p in ([example["images"] for example in examples]
                                                 if isinstance(examples, list) else examples["prompt"])]


def _in_datasets_cache(name: str) -> bool:
    import datasets

    cache = os.environ.get("HF_DATASETS_CACHE", datasets.config.HF_DATASETS_CACHE)
    return os.path.isdir(os.path.join(str(cache), name.replace("/", "___")))


def require_columns(dataset, columns: Iterable[str], name: str) -> None:
    """UserError naming every required column the dataset lacks."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise UserError(f"dataset {name!r} is missing column(s) {missing}; it has {dataset.column_names}")


def is_conversational(value) -> bool:
    """True for a list of {"role", "content"} messages (the conversational dataset form)."""
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]


def render_prompt(tokenizer, prompt, tools: Optional[list] = None) -> str:
    """Text of a prompt: unchanged if already text; messages are rendered with the chat template and the
    generation prompt appended (`tools`: JSON schemas or functions the template exposes to the model)."""
    if is_conversational(prompt):
        if tokenizer.chat_template is None:
            raise UserError("conversational data needs a tokenizer with a chat template")
        return tokenizer.apply_chat_template(prompt, tools=tools or None, tokenize=False, add_generation_prompt=True)
    return prompt


def render_completion(tokenizer, prompt, completion) -> str:
    """Text of a completion: unchanged if text; for messages, the chat-template rendering of prompt+completion
    minus the rendering of the prompt (so that the two concatenate back to the full conversation)."""
    if is_conversational(completion):
        full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        head = render_prompt(tokenizer, prompt)
        if not full.startswith(head):
            raise UserError("chat template does not render the prompt as a prefix of prompt+completion")
        return full[len(head):]
    return completion


def _drop_nones(message: dict) -> dict:
    """A message without the None fields a datasets column adds to every row (`tool_calls: None`, `name: None`, and
    absent call arguments), which some chat templates would render."""
    message = {k: v for k, v in message.items() if v is not None}
    calls = []
    for call in message.get("tool_calls") or []:
        arguments = call.get("function", {}).get("arguments")
        if isinstance(arguments, dict):
            arguments = {k: v for k, v in arguments.items() if v is not None}
            call = {**call, "function": {**call["function"], "arguments": arguments}}
        calls.append(call)
    if calls:
        message["tool_calls"] = calls
    return message


def tokenize_conversation(tokenizer, messages: list, tools: Optional[list] = None):
    """A conversation with assistant turns (tool calls and tool messages allowed) -> (prompt_ids, completion_ids,
    completion_mask), laid out as episodes.py samples it: the prompt is the messages before the first assistant
    message rendered with the generation prompt (and `tools`); then each assistant turn's text up to and including
    its EOS (completion_mask True: what the policy samples), and between turns the rest of the template's text (what
    it writes after the EOS, the tool messages, the next generation prompt: False, as episodes.tool_suffix_ids). Each
    piece is tokenised on its own, so token boundaries fall where sampling puts them; the text after the last EOS is
    dropped (an episode ends at it). A template that rewrites earlier turns (not prefix-preserving), or that ends an
    assistant turn without the EOS token, is a UserError."""
    if tokenizer.chat_template is None:
        raise UserError("conversational data needs a tokenizer with a chat template")
    messages = [_drop_nones(m) for m in messages]
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if not first:
        raise UserError("a conversation needs an assistant message and a message before the first one")

    def text(upto: int, generation: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation)

    full, eos = text(len(messages), False), tokenizer.eos_token
    pieces, offset = [], 0  # (text, trained)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head, upto = text(i, True), text(i + 1, False)  # before turn i (its generation prompt included); through it
        if not (full.startswith(head) and full.startswith(upto) and offset <= len(head) <= len(upto)):
            raise UserError("the chat template does not render a conversation as a prefix of its continuation (at "
                            f"message {i}): sampled episodes could not be trained token-in/token-out")
        cut = upto.rfind(eos, len(head))
        if cut < 0:
            raise UserError(f"the chat template ends assistant message {i} without the EOS token {eos!r}: an "
                            "episode's turn ends at EOS")
        pieces += [(full[offset:len(head)], False), (full[len(head):cut + len(eos)], True)]
        offset = cut + len(eos)
    prompt_ids, completion_ids, completion_mask = tokenizer(pieces[0][0], add_special_tokens=False)["input_ids"], [], []
    for piece, trained in pieces[1:]:
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        completion_ids += ids
        completion_mask += [trained] * len(ids)
    return prompt_ids, completion_ids, completion_mask


def tokenize_completion(tokenizer, prompt, completion) -> List[int]:
    """Token ids of a completion ending with the EOS token, where the policy stops sampling. The rule:
    - text: its tokens + EOS, always.
    - messages (rendered after `prompt`: render_completion): the rendered text's tokens. If they contain EOS and the
      tokens after the last one decode to whitespace or nothing (a template that ends the assistant turn with EOS,
      e.g. "<|im_end|>\\n" with eos "<|im_end|>"), they are cut right after that EOS and nothing is appended: one
      EOS, where the RL policy stops sampling and where tokenize_conversation cuts a turn, never
      "<|im_end|>\\n<|im_end|>". Else (a template that ends turns with another token, or with none) EOS is appended,
      as to text.
    TRL 1.16 (trl/trainer/sft_trainer.py and reward_trainer.py, `_prepare_dataset`; its DPO and KTO trainers alike)
    appends the EOS text to a text completion unless the text already ends with it (`add_eos`), and nothing to
    messages: it trains on the template's tokens past the prompt, the whitespace after the turn's EOS included, and
    RewardTrainer scores a conversation at that last token."""
    ids = tokenizer(render_completion(tokenizer, prompt, completion), add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if is_conversational(completion) and eos in ids:
        end = len(ids) - ids[::-1].index(eos)  # just after the last EOS
        if not tokenizer.decode(ids[end:]).strip():
            return ids[:end]
    return ids + [eos]


def tokenize_prompt_completion(tokenizer, prompt, completion, max_prompt_length: int, max_length: int,
                               end_with_eos: bool = True, images: Optional[vision.ImageSource] = None):
    """Token ids of (prompt, completion), each text or a list of messages (rendered here: render_prompt,
    render_completion), under the documented truncation rule:
    1. the prompt keeps its LAST `max_prompt_length` tokens (truncated from the left);
    2. the completion, ending with EOS by tokenize_completion's rule (end_with_eos=False: its rendered tokens, nothing
       appended nor cut: reward.py's text mode), keeps its FIRST `max_length - len(prompt)` tokens (truncated from
       the right), so a truncated completion has no EOS. Returns (prompt_ids, completion_ids); completion_ids is
       empty when truncation removed all of it (callers drop and count).
    `images`: the prompt's (vision.ImageSource): its ids come from the model's processor, each image placeholder
    expanded, and are never cut (one longer than max_prompt_length is a UserError)."""
    if images is not None:
        prompt_ids = images.prompt_ids(max_prompt_length)
    else:
        prompt_ids = tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
        prompt_ids = prompt_ids[-max_prompt_length:] if max_prompt_length > 0 else []
    if end_with_eos:
        completion_ids = tokenize_completion(tokenizer, prompt, completion)
    else:
        text = render_completion(tokenizer, prompt, completion)
        completion_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return prompt_ids, completion_ids[:max(0, max_length - len(prompt_ids))]


def tokenize_prompts(tokenizer, prompts: Sequence, max_prompt_length: Optional[int] = None,
                     tools: Optional[list] = None) -> List[List[int]]:
    """Token ids of each prompt (rendered with the chat template, and `tools`, if conversational), checked by
    `check_prompt_lengths`."""
    out = [tokenizer(render_prompt(tokenizer, prompt, tools), add_special_tokens=False)["input_ids"]
           for prompt in prompts]
    check_prompt_lengths(out, max_prompt_length)
    return out


def check_prompt_lengths(prompts: Sequence[List[int]], max_prompt_length: Optional[int]) -> None:
    """A prompt longer than `max_prompt_length` (None = no limit), or empty, is a UserError naming its row: RL scripts
    refuse rather than silently cut the task."""
    for i, ids in enumerate(prompts):
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            raise UserError(f"prompt {i} has {len(ids)} tokens, more than --max_prompt_length {max_prompt_length}; "
                            "raise the limit or filter the dataset")
        if len(ids) == 0:
            raise UserError(f"prompt {i} is empty")


# ---------------------------------------------------------------------------------------------------------
# The data order
# ---------------------------------------------------------------------------------------------------------
def epoch_permutation(num_items: int, seed: int, epoch: int) -> List[int]:
    """The data order of every script: pass `epoch` over `num_items` items visits them in this seeded
    permutation, the same on every process. A data position (epoch, offset) is all a checkpoint needs to
    resume the same order."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_items, generator=generator).tolist()


def data_positions(num_items: int, seed: int, start: int, count: int) -> List[int]:
    """Item indices at positions start..start+count of the endless stream that visits the data pass after pass,
    each pass in `epoch_permutation` order. A position is all a checkpoint needs to resume the same order."""
    epochs = range(start // num_items, (start + count - 1) // num_items + 1)  # the passes these positions touch
    stream = [i for epoch in epochs for i in epoch_permutation(num_items, seed, epoch)]
    return stream[start - epochs[0] * num_items:][:count]


def to_unpaired(dataset, name: str):
    """kto.py's data: an unpaired dataset (prompt, completion, label: bool, true = desirable) as is; a paired one
    (prompt, chosen, rejected) becomes two rows per pair: (prompt, chosen, True) and (prompt, rejected, False)."""
    from datasets import Dataset

    if "completion" not in dataset.column_names and {"chosen", "rejected"} <= set(dataset.column_names):
        require_columns(dataset, ["prompt", "chosen", "rejected"], name)
        column = vision.image_column(dataset.column_names)  # a pair's images go with both its rows
        rows = {"prompt": [], "completion": [], "label": [], **({column: []} if column else {})}
        images = dataset[column] if column else [None] * len(dataset)
        for prompt, chosen, rejected, image in zip(dataset["prompt"], dataset["chosen"], dataset["rejected"], images):
            rows["prompt"] += [prompt, prompt]
            rows["completion"] += [chosen, rejected]
            rows["label"] += [True, False]
            if column:
                rows[column] += [image, image]
        return Dataset.from_dict(rows)
    require_columns(dataset, ["prompt", "completion", "label"], name)
    dtype = getattr(dataset.features["label"], "dtype", type(dataset.features["label"]).__name__)
    if dtype != "bool":
        raise UserError(f"dataset {name!r}: column 'label' must be boolean (true = desirable), got {dtype}")
    return dataset


def tokenize_unpaired(dataset, tokenizer, max_prompt_length: int, max_length: int, name: str):
    """kto.py's unpaired rows (`to_unpaired`, then `with_images`) -> (examples, dropped). Each example: index,
    prompt_ids, completion_ids (ending with one EOS: tokenize_completion), label, and the prompt's `images` where it
    has them. Rows whose prompt or completion is emptied by truncation are dropped and counted."""
    examples, dropped = [], 0
    for row in dataset:
        prompt_ids, completion_ids = tokenize_prompt_completion(tokenizer, row["prompt"], row["completion"],
                                                                   max_prompt_length, max_length,
                                                                   images=row.get("images"))
        if not prompt_ids or not completion_ids:
            dropped += 1
            continue
        examples.append(dict(index=len(examples), prompt_ids=prompt_ids, completion_ids=completion_ids,
                             label=bool(row["label"]), **({"images": row["images"]} if row.get("images") else {})))
    if not examples:
        raise UserError(f"dataset {name!r}: every row was emptied by truncation (max_length {max_length})")
    return examples, dropped


def require_text_or_messages(values: dict, name: str, row: int) -> None:
    """A UserError naming the dataset `name`, the row and the column of the first of `values` ({column: value}) that
    is neither text nor a list of {role, content} messages (what the offline scripts tokenise)."""
    for column, value in values.items():
        if not (isinstance(value, str) or is_conversational(value)):
            raise UserError(f"dataset {name!r} row {row} column {column!r}: expected text or a list of "
                            f"{{role, content}} messages, got {type(value).__name__}")


def load_held_out_prompts(name: str, split: str, count: int, images: Optional[vision.Vision] = None) -> list:
    """The first `count` prompts of `split` of the prompt dataset `name` (load_prompt_dataset, its `prompt` column
    checked): what dpo.py and kto.py complete greedily at each evaluation; with `images` (the run's, vision.py), each
    an ImageSource (its row's images and columns, which a gold scorer reads). [] when `count` is 0 (nothing loaded)."""
    if count <= 0:
        return []
    data = load_prompt_dataset(name, split)
    require_columns(data, ["prompt"], name)
    return prompts_of(with_images(data.select(range(min(count, len(data)))), images))


# ---------------------------------------------------------------------------------------------------------
# Batches of token-id rows (the offline scripts)
# ---------------------------------------------------------------------------------------------------------
def concatenated_inputs(rows: Sequence[dict], pad_token_id: int, completions: Sequence[str] = ("chosen", "rejected"),
                        prompt: str = "prompt"):
    """b rows -> (query_responses (k b, Lq + R), context_length Lq): each row's `prompt` token ids with each of its
    k `completions` (keys of token-id lists), all in one batch for one forward pass. Prompts are LEFT-padded to Lq and
    repeated k times, completions RIGHT-padded to R, so every completion starts at position Lq (the layout of
    policy_common.Forward.logits); the rows' first completions come first (rows 0..b-1), then their second ones
    (rows b..2b-1), and so on. dpo.py and reward.py: chosen then rejected; kto.py: each example's own completion, then
    its mismatched one; sft.py: its one completion."""
    prompts = pc.pad_sequences([row[prompt] for row in rows], pad_token_id, "left")  # (b, Lq)
    responses = pc.pad_sequences([row[key] for key in completions for row in rows], pad_token_id, "right")  # (k b, R)
    return torch.cat([prompts.repeat(len(completions), 1), responses], 1), prompts.shape[1]


def row_tokens(row: dict, completions: Sequence[str] = ("chosen", "rejected"), prompt: str = "prompt") -> int:
    """The tokens of the sequences `concatenated_inputs` makes of `row` (padding left out): its prompt once per
    completion, and the completions."""
    return len(row[prompt]) * len(completions) + sum(len(row[key]) for key in completions)
