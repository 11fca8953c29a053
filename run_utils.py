"""Run plumbing shared by the algorithm scripts: arguments and aliases, data, data order, the run folder,
metrics, checkpoints, and agreement between processes. Nothing here is algorithm logic, and nothing here
computes with a model (that is policy_common.py). Imports go one way: scripts -> run_utils -> policy_common.

Collectives (work that every process must do together) happen only in the functions that say so, each called
once per step by every process, never a number of times that depends on one process's data.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, is_dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

import policy_common as pc
from policy_common import UserError

# ---------------------------------------------------------------------------------------------------------
# Aliases: short names for the public TL;DR checkpoints and datasets behind the published RLOO/PPO/DPO runs
# (Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO"; TRL documentation), and the toy task
# (built offline by toy_task.py the first time it is named).
# ---------------------------------------------------------------------------------------------------------
TOY_ALIAS = "toy"
MODEL_ALIASES = {  # alias -> (SFT policy, reward model, dataset alias)
    f"pythia-{size}": (f"cleanrl/EleutherAI_pythia-{size}-deduped__sft__tldr",
                       f"cleanrl/EleutherAI_pythia-{size}-deduped__reward__tldr", "tldr")
    for size in ("1b", "2.8b", "6.9b")
}
DATASET_ALIASES = {  # alias -> (prompts, preference pairs, unpaired examples)
    "tldr": ("trl-lib/tldr", "trl-lib/tldr-preference", "trl-lib/tldr-preference"),  # kto.py unpairs the pairs
}


def _toy_world() -> dict:
    import toy_task

    return toy_task.build()


def resolve_model(name: str) -> str:
    """`--model` / `--ref_model` -> a hub id or local folder: `toy` builds (or reuses) the toy task's SFT policy,
    `pythia-1b|2.8b|6.9b` name the TL;DR SFT checkpoints; anything else is returned unchanged."""
    if name == TOY_ALIAS:
        return _toy_world()["policy"]
    return MODEL_ALIASES[name][0] if name in MODEL_ALIASES else name


def resolve_reward_model(name: str) -> str:
    """`--reward_model` -> a hub id or local folder (`toy`: the toy reward model; `pythia-*`: TL;DR's)."""
    if name == TOY_ALIAS:
        return _toy_world()["reward"]
    return MODEL_ALIASES[name][1] if name in MODEL_ALIASES else name


def default_reward_model(model: str) -> str:
    """The reward model paired with a `--model` alias (toy -> toy RM, pythia-1b -> its TL;DR RM)."""
    if model == TOY_ALIAS or model in MODEL_ALIASES:
        return model
    raise UserError(f"--reward_model is required when --model is {model!r} (no paired reward model is known)")


def default_dataset(model: str) -> str:
    """The dataset paired with a `--model` alias (toy -> toy, pythia-* -> tldr)."""
    if model == TOY_ALIAS:
        return TOY_ALIAS
    if model in MODEL_ALIASES:
        return MODEL_ALIASES[model][2]
    raise UserError(f"--dataset is required when --model is {model!r} (no paired dataset is known)")


def gold_scorer(dataset: str) -> Optional[Callable[[str, str], float]]:
    """A ground-truth scorer `(prompt_text, completion_text) -> float` if the dataset has one (the toy task
    does), else None. Evaluation reports `eval/gold_score` whenever one exists."""
    import toy_task

    return toy_task.gold_scorer(dataset)


def parse_args(args_cls, alias_defaults: Optional[Dict[str, dict]] = None, argv: Optional[List[str]] = None):
    """tyro CLI with `--snake_case` flags. `alias_defaults` maps a `--model` alias (e.g. "toy") to tuned
    defaults for that alias; each applies only where the flag was not given on the command line, so the
    dataclass defaults stay those of the real-scale path. The flags given on the command line are kept in
    `args.given_flags` (not a field: not saved with the config) for `fit_length`."""
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    args = tyro.cli(args_cls, args=argv, use_underscores=True)
    given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    given |= {name[3:] for name in given if name.startswith("no_")}
    for field, value in (alias_defaults or {}).get(getattr(args, "model", None), {}).items():
        if field not in given:
            setattr(args, field, value)
    args.given_flags = frozenset(given)
    quiet_libraries(getattr(args, "verbose", True))
    return args


def quiet_libraries(verbose: bool) -> None:
    """Unless `verbose`: transformers, datasets, huggingface_hub, accelerate and DeepSpeed log errors only and show no
    progress bars of their own (the run's own lines and bar say what happens). DeepSpeed, which accelerate imports
    anyway, is imported here with logging off: its import warns "Setting accelerator to CPU" on every CPU run."""
    if verbose:
        return
    import logging

    import datasets
    import huggingface_hub
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    logging.disable(logging.WARNING)
    try:
        from deepspeed.accelerator import get_accelerator

        get_accelerator()
    except Exception:  # DeepSpeed is optional at run time
        pass
    finally:
        logging.disable(logging.NOTSET)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def main_guard(main: Callable[[], None]) -> None:
    """Run `main()`; a `UserError` becomes a one-line message on stderr and exit code 2 (no traceback).
    A process of a multi-process run leaves with os._exit after running the exit handlers, skipping C++ teardown: DDP
    keeps the gloo group and its threads alive past destroy_process_group (torch 2.13), and tearing them down at
    exit aborted finished 2-process CPU runs now and then ("terminate called without an active exception", exit -6)
    after every file was written. A finished run first waits for every process and destroys the group; after a
    usage error, which may be this process's alone, no collective call is made."""
    code = 0
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        if code:
            sys.exit(code)
        return
    if code == 0:
        torch.distributed.barrier()  # the main process saves last; no process leaves before it is done
        torch.distributed.destroy_process_group()
    atexit._run_exitfuncs()  # e.g. wandb's and vLLM's clean-ups, which os._exit would skip
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fit_length(args, flag: str, room: Optional[int], why: str) -> int:
    """Fit the length flag `args.<flag>` into `room` positions (None = no limit) and return it. A default (or
    an alias's default) is lowered to fit, with a note; a value given on the command line that does not fit
    is a UserError naming the flag, the limit and `why` it is that."""
    value = getattr(args, flag)
    if room is None or value <= room:
        return value
    if room < 1 or flag in getattr(args, "given_flags", ()):
        raise UserError(f"--{flag} {value} does not fit: {why} leaves {max(room, 0)} positions")
    print(f"note: --{flag} lowered from {value} to {room} ({why})", flush=True)
    setattr(args, flag, room)
    return room


def model_config(name: str, trust_remote_code: bool = False):
    """The config of the model `name` (hub id or folder), without loading weights."""
    from transformers import AutoConfig

    return pc._from_pretrained(AutoConfig, name, trust_remote_code=trust_remote_code)


def model_positions(name: str, trust_remote_code: bool = False) -> Optional[int]:
    """How many positions the model `name` (hub id or folder) attends to, from its config (no weights loaded):
    max_position_embeddings, or None when the config sets no limit."""
    return getattr(model_config(name, trust_remote_code), "max_position_embeddings", None)


# ---------------------------------------------------------------------------------------------------------
# Data: loading, columns, chat templates, prompt/completion tokenisation
# ---------------------------------------------------------------------------------------------------------
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
                raise UserError(f"could not read dataset file(s) {name!r}: {type(e).__name__}: {pc._first_line(e)}") from None
        elif os.path.exists(name) or name.startswith((".", "/", "~")):
            raise UserError(f"dataset {name!r}: not a save_to_disk folder nor .json/.jsonl/.parquet file(s)")
        else:
            if not pc.hub_reachable() and not _in_datasets_cache(name):
                raise UserError(f"could not load dataset {name!r}: not a local path, and the hub is unreachable "
                                f"(offline); known aliases: {', '.join([TOY_ALIAS, *DATASET_ALIASES])}")
            ds = datasets.load_dataset(name)
    except (FileNotFoundError, ConnectionError, OSError) as e:
        raise UserError(f"could not load dataset {name!r}: {pc._first_line(e)}") from None
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
    if name == TOY_ALIAS:
        return _load_split(_toy_world()["prompt_dataset"], split)
    return _load_split(DATASET_ALIASES[name][0] if name in DATASET_ALIASES else name, split)


def load_preference_dataset(name: str, split: str):
    """`split` of a preference dataset (`prompt`, `chosen`, `rejected`): alias, local folder/files or hub id."""
    if name == TOY_ALIAS:
        return _load_split(_toy_world()["preference_dataset"], split)
    return _load_split(DATASET_ALIASES[name][1] if name in DATASET_ALIASES else name, split)


def load_unpaired_dataset(name: str, split: str):
    """`split` of unpaired feedback (`prompt`, `completion`, `label`, or pairs to unpair): alias, folder, hub id."""
    if name == TOY_ALIAS:
        return _load_split(_toy_world()["unpaired_dataset"], split)
    return _load_split(DATASET_ALIASES[name][2] if name in DATASET_ALIASES else name, split)


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


def render_prompt(tokenizer, prompt) -> str:
    """Text of a prompt: unchanged if already text; messages are rendered with the chat template and the
    generation prompt appended."""
    if is_conversational(prompt):
        if tokenizer.chat_template is None:
            raise UserError("conversational data needs a tokenizer with a chat template")
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
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


def tokenize_prompt_completion(tokenizer, prompt: str, completion: str, max_prompt_length: int,
                               max_length: int):
    """Token ids of (prompt, completion + EOS) under the documented truncation rule:
    1. the prompt keeps its LAST `max_prompt_length` tokens (truncated from the left);
    2. the completion keeps its FIRST `max_length - len(prompt)` tokens (truncated from the right);
    EOS is appended before truncation, so a truncated completion has no EOS. Returns (prompt_ids,
    completion_ids); completion_ids is empty when truncation removed all of it (callers drop and count)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-max_prompt_length:] if max_prompt_length > 0 else []
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids, completion_ids[:max(0, max_length - len(prompt_ids))]


def tokenize_prompts(tokenizer, prompts: Sequence, max_prompt_length: Optional[int] = None) -> List[List[int]]:
    """Token ids of each prompt (rendered with the chat template if conversational). A prompt longer than
    `max_prompt_length` (None = no limit) is a UserError: RL scripts refuse rather than silently cut the task."""
    out = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            raise UserError(f"prompt {i} has {len(ids)} tokens, more than --max_prompt_length {max_prompt_length}; "
                            "raise the limit or filter the dataset")
        if len(ids) == 0:
            raise UserError(f"prompt {i} is empty")
        out.append(ids)
    return out


# ---------------------------------------------------------------------------------------------------------
# Runs: seeding, run folder, metrics, saving, checkpoints
# ---------------------------------------------------------------------------------------------------------
def make_accelerator(gradient_accumulation_steps: int, **kwargs):
    """The run's Accelerator. On a machine without a GPU, a multi-process launch (torchrun or accelerate launch)
    runs real ranks over gloo; a DeepSpeed launch keeps its engine (ZeRO code paths run on a CPU too)."""
    from accelerate import Accelerator

    use_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    accelerator = Accelerator(gradient_accumulation_steps=gradient_accumulation_steps,
                              cpu=not torch.cuda.is_available() and not use_deepspeed, **kwargs)
    accelerator.print(f"[accelerate] {accelerator.distributed_type.value}, {accelerator.num_processes} process(es), "
                      f"device {accelerator.device}")
    return accelerator


def seed_everything(seed: int, process_index: int = 0) -> int:
    """Seed python, numpy and torch with seed + process_index (each process samples differently, runs
    repeat exactly). Returns the per-process seed."""
    local_seed = seed + process_index
    random.seed(local_seed)
    np.random.seed(local_seed % 2**32)
    torch.manual_seed(local_seed)
    return local_seed


def run_name(script: str, dataset: str, seed: int) -> str:
    """`<dataset>__<script>__<seed>__<unix time>`, as in CleanRL."""
    return f"{os.path.basename(dataset.rstrip('/'))}__{script}__{seed}__{int(time.time())}"


def output_dir(args, dataset: str, accelerator) -> str:
    """The run folder, the same on every process: `--output_dir` if given; else the folder that holds
    `--resume_from` (a resumed run continues in place); else runs/<run_name> with the main process's clock.
    A fresh run refuses a folder that already holds a run (metrics.jsonl) on every process together, before any
    process writes: the main process looks and tells the others (broadcasts: every process calls this once, at the
    same point)."""
    from accelerate.utils import broadcast_object_list

    if args.resume_from:
        return args.output_dir or os.path.dirname(os.path.abspath(args.resume_from))
    if args.output_dir:
        folder = args.output_dir
    else:
        folder = os.path.join("runs", broadcast_object_list([run_name(args.exp_name, dataset, args.seed)])[0])
    used = os.path.exists(os.path.join(folder, "metrics.jsonl")) if accelerator.process_index == 0 else None
    if broadcast_object_list([used])[0]:
        raise used_folder_error(folder)
    return folder


def used_folder_error(folder: str) -> UserError:
    """The one refusal of a fresh run's folder that already holds a run (output_dir's, and MetricsLogger's for
    direct users)."""
    return UserError(f"{folder!r} already holds a run (metrics.jsonl); choose another --output_dir or pass "
                     "--resume_from")


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


# ---------------------------------------------------------------------------------------------------------
# Processes: even shares, global means, agreement. Each function here is called by every process the same
# number of times (once per step or evaluation), so the collectives inside always match.
# ---------------------------------------------------------------------------------------------------------
def even_share(items: Sequence, accelerator):
    """This process's share of `items` (every num_processes-th item, from its index), padded by repeating an
    item so that every process gets the same number: they then make the same model calls (DDP syncs buffers
    and ZeRO-3 gathers weights in every forward). Returns (share, n_real): only share[:n_real] count."""
    world, rank = accelerator.num_processes, accelerator.process_index
    share = list(items[rank::world])
    n_real, size = len(share), -(-len(items) // world)
    return share + [items[0]] * (size - n_real), n_real


@torch.no_grad()
def greedy_completions(policy, tokenizer, prompts: Sequence[List[int]], response_length: int, batch_size: int,
                       accelerator):
    """This process's even share of `prompts` (token-id lists) completed greedily, `batch_size` rows per generate
    call (every process makes the same calls). Returns (prompt texts, completion texts) of its real rows, special
    tokens skipped; the padding rows of the share are dropped."""
    share, n_real = even_share(prompts, accelerator)
    pad = tokenizer.pad_token_id
    queries = pc.pad_sequences(share, pad, "left").to(accelerator.device)  # (n, Lq)
    config = pc.make_generation_config(tokenizer, response_length, greedy=True)
    query_responses, _ = pc.batch_generation(policy, queries, pad, tokenizer.eos_token_id, config, batch_size,
                                             accelerator)
    return (tokenizer.batch_decode(queries[:n_real], skip_special_tokens=True),
            tokenizer.batch_decode(query_responses[:n_real, queries.shape[1]:], skip_special_tokens=True))


def global_means(accelerator, sums: Dict[str, float], count: float) -> Dict[str, float]:
    """{name: sum over this process's items}, item count -> {name: sum over all processes / total count}
    (one all-reduce)."""
    keys = sorted(sums)
    totals = torch.tensor([float(sums[k]) for k in keys] + [float(count)], dtype=torch.float64,
                          device=accelerator.device)
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    return {k: v / max(totals[-1].item(), 1.0) for k, v in zip(keys, totals[:-1].tolist())}


def global_sum(accelerator, value: float) -> float:
    """The sum of `value` over all processes (one all-reduce)."""
    total = torch.tensor([float(value)], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, reduction="sum")
    return total.item()


def all_finite(accelerator, *values) -> bool:
    """True when every value (numbers, tensors, or None for a grad norm DeepSpeed keeps to itself) is finite on
    every process (one all-reduce): all processes then skip or stop together."""
    bad = torch.tensor([float(not all(pc.is_finite(v) for v in values))], device=accelerator.device)
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, reduction="max")
    return not bad.item()


def config_dict(args) -> dict:
    """Args dataclass (or namespace, or dict) -> plain dict for args.json and wandb."""
    if isinstance(args, dict):
        return dict(args)
    return asdict(args) if is_dataclass(args) else dict(vars(args))


class MetricsLogger:
    """Append one JSON object per `log` call to `<output_dir>/metrics.jsonl` (always), and send the same
    metrics to wandb when `track` is on. Only the main process writes; others are no-ops. Nothing is written
    before the first row (args.json and the folder come with it), so a run that fails before its first
    evaluation leaves no run folder. The wandb API key is never written anywhere by this class."""

    def __init__(self, output_dir: str, args, is_main_process: bool = True, track: bool = False,
                 wandb_project: str = "policy-rlhf", run_name: Optional[str] = None,
                 resume_step: Optional[int] = None):
        """A fresh run refuses an output folder that already holds metrics (it is never overwritten); a
        resumed run (`resume_step` = the checkpoint's step) keeps the rows up to that step."""
        self.active, self.track = is_main_process, track and is_main_process
        self.output_dir, self.path, self.started = output_dir, os.path.join(output_dir, "metrics.jsonl"), False
        self.bar, self.samples_shown = None, 0
        self.config, self.wandb_project, self.run_name = config_dict(args), wandb_project, run_name
        if self.active and os.path.exists(self.path):
            if resume_step is None:
                raise used_folder_error(output_dir)
            with open(self.path) as f:
                rows = [line for line in f if json.loads(line)["step"] <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(rows)

    def _start(self) -> None:
        """Create the folder, write args.json, start wandb: once, at the first row."""
        if self.started:
            return
        self.started = True
        os.makedirs(self.output_dir, exist_ok=True)
        with open(os.path.join(self.output_dir, "args.json"), "w") as f:
            json.dump(self.config, f, indent=2, default=str)
        if self.track:
            import wandb

            wandb.init(project=self.wandb_project, name=self.run_name, config=self.config, dir=self.output_dir)
            wandb.run.log_code(".", include_fn=lambda p: p.endswith(".py"))

    def progress(self, total: int, done: int, items_per_step: int, items: str, keys: Sequence[str]) -> None:
        """Show the run's progress from now on: steps done / `total`, `items`/s (e.g. episodes), and the latest
        values of `keys` (e.g. objective/scores, eval/gold_score). A bar updated in place on a terminal; elsewhere
        (CI, a redirected log) a plain line at every tenth of the run."""
        if self.active:
            self.bar = Progress(total, done, items_per_step, items, keys)

    def _print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def log(self, metrics: Dict[str, float], step: int) -> None:
        if not self.active:
            return
        self._start()
        row = {"step": step, **{k: _to_float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.track:
            import wandb

            wandb.log(row, step=step)
        shown = {k[5:]: v for k, v in row.items() if k.startswith("eval/") and not k.endswith("/std")
                 and isinstance(v, (int, float))}
        if shown:  # one line per evaluation
            self._print(f"eval @ step {step}: " + "  ".join(f"{k} {_short_number(v)}" for k, v in shown.items()))
        if self.bar is not None and step > 0:
            self.bar.update(step, row)

    def log_samples(self, name: str, rows: List[Dict[str, object]], step: int, count: int = 4) -> None:
        """`count` of `rows` (prompt/completion/score... dicts) as a compact table, printed, and a wandb Table when
        tracking. Each call shows the next `count` rows (rotating through them), so successive evaluations of the
        same held-out set show different prompts."""
        if not self.active or not rows or count < 1:
            return
        start = self.samples_shown % len(rows)
        rows = (rows[start:] + rows[:start])[:count]
        self.samples_shown += count
        widths = {k: 36 if isinstance(rows[0][k], str) else 8 for k in rows[0]}

        def cell(value, width: int) -> str:
            return (_short_number(value) if isinstance(value, (int, float)) else str(value).replace("\n", " "))[:width]

        self._print(("  " + " | ".join(k[:w].ljust(w) for k, w in widths.items())).rstrip())
        for row in rows:
            self._print(("  " + " | ".join(cell(row[k], w).ljust(w) for k, w in widths.items())).rstrip())
        if self.track and rows:
            import wandb

            self._start()
            wandb.log({name: wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}, step=step)

    def close(self, model_path: Optional[str] = None) -> None:
        """End the run: close the bar, print the summary (the first and last evaluation of metrics.jsonl, steps, wall
        time, where the model and metrics are, how to plot them), finish wandb."""
        if self.bar is not None:
            self.bar.close()
        if self.active and os.path.exists(self.path):
            print(self._summary(model_path), flush=True)
        if self.track and self.started:
            import wandb

            wandb.finish()

    def _summary(self, model_path: Optional[str]) -> str:
        with open(self.path) as f:
            rows = [json.loads(line) for line in f]
        evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
        lines = [f"summary: step {rows[-1]['step']}, {time.time() - PROCESS_START:.0f} s since the run started"]
        if evals:
            first, last = evals[0], evals[-1]
            keys = [k for k in SUMMARY_KEYS if k in first and k in last] or \
                [k for k in first if k.startswith("eval/") and k in last and not k.endswith("/std")][:5]
            width = max(len(k) for k in keys) if keys else 0
            lines += [f"  {k.ljust(width)}  {_short_number(first[k])} -> {_short_number(last[k])}   "
                      f"(step {first['step']} -> {last['step']})" for k in keys]
        if model_path:
            lines.append(f"  model:   {model_path}")
        lines += [f"  metrics: {self.path}", f"  plot:    python benchmark/plot.py {self.output_dir}"]
        return "\n".join(lines)


PROCESS_START = time.time()  # the summary's wall time counts from here (run_utils is imported at start-up)
SUMMARY_KEYS = ("eval/gold_score", "eval/scores", "eval/kl", "eval/loss", "eval/accuracy", "eval/rewards/accuracies",
                "eval/rewards/margins")


def _short_number(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"


class Progress:
    """Steps done / total with a rate and a few metrics: a tqdm bar on a terminal, else a plain line at every tenth of
    the run (no carriage returns in a log file)."""

    def __init__(self, total: int, done: int, items_per_step: int, items: str, keys: Sequence[str]):
        self.total, self.done, self.items_per_step, self.items, self.keys = total, done, items_per_step, items, keys
        self.start, self.start_step, self.latest = time.time(), done, {}
        self.every = max(1, total // 10)
        self.bar = None
        if sys.stdout.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=done, unit="step", dynamic_ncols=True)

    def update(self, step: int, row: dict) -> None:
        self.latest.update({k if k.startswith("eval/") else k.split("/")[-1]: row[k] for k in self.keys if k in row})
        rate = (step - self.start_step) * self.items_per_step / max(time.time() - self.start, 1e-9)
        shown = {self.items + "/s": f"{rate:.0f}", **{k: _short_number(v) for k, v in self.latest.items()}}
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(step - self.done)
        elif step % self.every == 0 or step == self.total:
            print(f"step {step}/{self.total} ({100 * step // self.total}%)  " +
                  "  ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
        self.done = step

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _to_float(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


def reduce_metrics(accelerator, metrics: Dict[str, float]) -> Dict[str, float]:
    """Average a dict of scalars across processes (one all-reduce for the whole dict)."""
    if accelerator is None or accelerator.num_processes == 1:
        return {k: _to_float(v) for k, v in metrics.items()}
    keys = sorted(metrics)
    values = torch.tensor([float(_to_float(metrics[k])) for k in keys], device=accelerator.device)
    values = accelerator.reduce(values, reduction="mean")
    return dict(zip(keys, values.tolist()))


@contextlib.contextmanager
def atomic_dir(path: str):
    """Yield a temporary sibling folder to write into; on success it replaces `path` in one rename, so a
    reader never sees a half-written folder. On failure the temporary folder is removed."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = f"{path}.old-{os.getpid()}"
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save_model(accelerator, model: nn.Module, tokenizer, path: str, merge_peft: bool = False,
               submodule: Optional[str] = None) -> None:
    """Save `model` (+ tokenizer) to `path` atomically, safetensors, loadable by `from_pretrained`.
    `model` is the object given to `accelerator.prepare` (under ZeRO-3 its shards are gathered); `submodule`
    names a child to save on its own (e.g. "policy" of a policy+value wrapper). A PEFT model saves its adapter;
    with `merge_peft` the merged full weights are saved instead."""
    if accelerator is not None:
        accelerator.wait_for_everyone()
        state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards on the main process
        is_main = accelerator.is_main_process
    else:
        state_dict, is_main = None, True
    if not is_main:
        return
    base = pc.unwrap(model)
    if submodule is not None:
        base = getattr(base, submodule)
        if state_dict is not None:
            state_dict = {k[len(submodule) + 1:]: v for k, v in state_dict.items() if k.startswith(submodule + ".")}
    with atomic_dir(path) as tmp:
        if merge_peft and hasattr(base, "merge_and_unload"):
            merged = copy.deepcopy(base).merge_and_unload()
            merged.save_pretrained(tmp, safe_serialization=True)
        else:
            base.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def save_checkpoint(accelerator, path: str, extra_state: dict, scheduler=None) -> None:
    """Atomically write a resumable checkpoint: accelerate state (model weights as safetensors, optimizer, RNG
    states of every process) plus `extra_state` (step, data position, ...) and the LR scheduler's state as
    JSON in trainer_state.json (JSON, not pickle: resuming never unpickles objects)."""
    if scheduler is not None:
        extra_state = {**extra_state, "_scheduler": _jsonable(scheduler.state_dict())}
    accelerator.wait_for_everyone()
    path = os.path.abspath(path)
    tmp = f"{path}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp, safe_serialization=True)
    accelerator.wait_for_everyone()  # every rank's RNG file is in tmp before the rename
    if accelerator.is_main_process:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(extra_state, f)
        old = f"{path}.old"
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def stop_on_nonfinite(accelerator, output_dir: str, step: int, state: dict, scheduler=None, **values) -> None:
    """Write `state` (the one before this step) to <output_dir>/checkpoint-nonfinite and stop with one line naming
    the step and `values` (e.g. loss, grad norm). Every process calls it together, after `all_finite` said no."""
    save_checkpoint(accelerator, os.path.join(output_dir, "checkpoint-nonfinite"), state, scheduler)
    shown = ", ".join(f"{name.replace('_', ' ')} {_to_float(value)}" for name, value in values.items())
    raise UserError(f"non-finite {shown} at step {step}; the state before it is in {output_dir}/checkpoint-nonfinite "
                    "(--skip_nonfinite skips such steps)")


@contextlib.contextmanager
def checkpoint_on_error(error_type, accelerator, output_dir: str, state: dict, scheduler=None):
    """Run the block; if it raises `error_type` (an error every process raises together, e.g. a reward function's),
    first keep the finished steps: `state` (that of the last finished step, `state["step"]` > 0) goes to
    <output_dir>/checkpoint-<step>, named in a note, then the error propagates."""
    try:
        yield
    except error_type:
        if state["step"] > 0:
            path = os.path.join(output_dir, f"checkpoint-{state['step']}")
            save_checkpoint(accelerator, path, state, scheduler)
            accelerator.print(f"note: the {state['step']} finished step(s) are in {path} (--resume_from it)")
        raise


def load_checkpoint(accelerator, path: str, scheduler=None) -> dict:
    """Restore what `save_checkpoint` wrote (into the prepared model/optimizer and `scheduler`); returns its
    `extra_state`. Tensors load through safetensors / torch.load(weights_only=True) inside accelerate."""
    state_file = os.path.join(path, "trainer_state.json")
    if not os.path.exists(state_file):
        raise UserError(f"--resume_from {path!r} is not a checkpoint (no trainer_state.json)")
    accelerator.load_state(path)
    with open(state_file) as f:
        state = json.load(f)
    scheduler_state = state.pop("_scheduler", None)
    if scheduler is not None:
        if scheduler_state is None:
            raise UserError(f"checkpoint {path!r} holds no LR scheduler state")
        scheduler.load_state_dict(scheduler_state)
    return state


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else None


class StopSignal:
    """Turn SIGTERM / Ctrl-C into a flag the training loop checks between steps (`agreed`), so it can write a
    checkpoint and exit cleanly instead of dying mid-step."""

    def __init__(self):
        self.received = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def agreed(self, accelerator) -> bool:
        """True when any process received a signal (one all-reduce, every process once per step): all processes
        then write the (collective) checkpoint and stop together."""
        flag = torch.tensor([float(self.received is not None)], device=accelerator.device)
        if accelerator.num_processes > 1:
            flag = accelerator.reduce(flag, reduction="max")
        return bool(flag.item())
