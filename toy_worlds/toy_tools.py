"""The toy tool world: a task the tiny policy cannot solve without a tool, built offline on a CPU like toy_task.py.

Task: the user asks `sort box 4 8 2`. Box 482 holds a hidden set of 3-6 distinct letters from a..l (a fixed function
of the box number, `hidden_letters`); nothing in the prompt tells which. The tool `lookup(box="4 8 2")` returns them
(in their stored, unsorted order); the ideal episode calls it, then answers the letters sorted:

    <tools> lookup </tools> <user> sort box 4 8 2 <assistant>                        prompt (chat template)
    <tool_call> {"name": "lookup", "arguments": {"box": "4 8 2"}} </tool_call> [EOS]  sampled turn 1
    <tool> k c f <assistant>                                                         tool result (not trained on)
    c f k [EOS]                                                                      sampled turn 2

Gold score (`gold_score`), in [0, 1]: toy_task's position-wise score of the final answer against the sorted hidden
letters. A guess without the tool scores little; the lazy copy of the tool's order scores partly.

Tokens: one per whitespace-separated word (toy_task's kind of tokenizer): [PAD] [EOS] [UNK] = a..l 0..9 sort box
lookup <user> <assistant> <tool> <tools> </tools> <tool_call> </tool_call> {"name": "lookup", "arguments": {"box":
"0.."9 0"}}..9"}} {"error":. So a call's JSON is exactly 7 tokens (`"4 8 2"}}` is `"4`, `8`, `2"}}`) and decodes back to
the same text; anything else (an error message's words) is [UNK]. The chat template (CHAT_TEMPLATE) writes
`<tools> NAME.. </tools> ` when given tools, `<user> CONTENT `, `<assistant> [CONTENT ]` + `<tool_call> {"name": ..,
"arguments": ..} </tool_call> ` per call (tojson: ", " and ": " separators) + `[EOS] `, `<tool> CONTENT `, and
`<assistant> ` as the generation prompt. It only appends, so a conversation's tokens are its prompt's, then each
turn's (tool results: `<tool> k c f <assistant>`, the next generation prompt included), in order.

What gets built (deterministic from a seed, cached beside the toy task's under $TOY_TASK_CACHE, `tools-*`):
- tokenizer/: the tokenizer and its chat template.
- sft/: a tiny GPT-NeoX (toy_task's, 128 positions) trained on demonstrations rendered with the tools, loss on
  assistant tokens only (each turn's [EOS] included). With probability P_TOOL the demonstrator calls lookup
  (mistyping one digit of the box P_TYPO of the time: the tool then returns another box's letters), then answers as
  toy_task's demonstrators do from the returned letters (55% copied in the tool's order, 30% sorted, 15% sorted with
  a mistake); otherwise it guesses 3-6 letters, sorted. Samples call the tool about as often, and copy the box's
  digits right; greedy decoding calls it and copies the letters lazily. RL has room in tool use and in sorting.
- prompt/ (`prompt`: [{"role": "user", "content": "sort box 4 8 2"}]; test = 256 boxes, the same for every seed,
  train = the other 744) and sft_data/ (`messages`: demonstration conversations, 4 per train box and 1 per test
  box; `tools`: `tool_schemas()`, the same list in every row, stored as arrow structs).
- report.json: the SFT policy's multi-turn episodes on the test boxes (`episodes`: at most MAX_TOOL_ROUNDS calls and
  MAX_SAMPLED sampled tokens), sampled at temperature 1 and greedy: tool-call rate, fraction of calls that succeed,
  gold (all episodes, with a call, without).

Use: `python grpo.py --model toy_tools` (its defaults: --reward_funcs gold --tools toy_worlds.toy_tools:lookup).
"""

from __future__ import annotations

import json
import os
import random
import re
import time

import torch
import torch.nn.functional as F

from toy_worlds import toy_task

BUILDER_VERSION = 2  # bump whenever the build or anything it calls changes
LETTERS = toy_task.LETTERS
DIGITS = list("0123456789")
P_TOOL, P_TYPO = 0.4, 0.08
SFT_STEPS = 650
MAX_TOOL_ROUNDS, MAX_SAMPLED = 2, 24  # the builder's own episodes (report.json), as grpo/rloo's toy_tools defaults
CHAT_TEMPLATE = (
    "{% if tools %}<tools> {% for tool in tools %}"
    "{{ tool.function.name if tool.function is defined else tool.name }} {% endfor %}</tools> {% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<user> {{ message.content }} "
    "{% elif message.role == 'assistant' %}<assistant> {% if message.content %}{{ message.content }} {% endif %}"
    "{% for call in message.tool_calls or [] %}{% set fn = call.function if call.function is defined else call %}"
    "<tool_call> {% if fn.arguments is string %}{{ '{\"name\": ' ~ (fn.name | tojson) ~ ', \"arguments\": ' ~ "
    "fn.arguments ~ '}' }}{% else %}{{ {'name': fn.name, 'arguments': fn.arguments} | tojson }}{% endif %} "
    "</tool_call> {% endfor %}"
    "[EOS] "
    "{% elif message.role == 'tool' %}<tool> {{ message.content }} "
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}")


def lookup(box: str) -> str:
    """Look up the letters kept in a box.

    Args:
        box: the box number, its digits separated by spaces, as written in the request (e.g. "4 8 2")

    Returns:
        The box's letters, separated by spaces.
    """
    if not isinstance(box, str) or not re.fullmatch(r"[0-9] [0-9] [0-9]", box):
        raise ValueError(f"no box {box!r}")
    return " ".join(hidden_letters(box))


def hidden_letters(box: str) -> list:
    """The letters box `box` ("4 8 2") holds, in their stored order: a fixed function of its number."""
    rng = random.Random(f"toy-tools-box:{box.replace(' ', '')}")
    return rng.sample(LETTERS, rng.randint(toy_task.MIN_LETTERS, toy_task.MAX_LETTERS))


def gold_score(prompt: str, completion: str, row: dict | None = None) -> float:
    """Ground truth in [0, 1] of the final answer. `prompt`: the request ("sort box 4 8 2") or a rendered prompt (the
    box is the three digits after the word `box`); `completion`: the answer ("c f k") or a whole decoded episode
    (only the text after its last <assistant> counts, tool calls and tool results dropped). Of that text only the
    letters a..l count, scored as toy_task.gold_score against the box's letters sorted; no box in the prompt, or no
    letters, scores 0. `row` (the dataset row): unused."""
    box = re.search(r"\bbox\s+([0-9])\s+([0-9])\s+([0-9])\b", prompt)
    if box is None:
        return 0.0
    answer = completion.rsplit("<assistant>", 1)[-1]
    answer = re.sub(r"<tool_call>.*?(</tool_call>|$)", " ", answer, flags=re.DOTALL)
    answer = re.sub(r"<tool>.*", " ", answer, flags=re.DOTALL)  # a tool result no <assistant> follows
    letters = [t for t in answer.split() if t in LETTERS]
    return toy_task.gold_score(" ".join(hidden_letters(" ".join(box.groups()))) + " =", " " + " ".join(letters))


def gold_scorer(dataset: str):
    """The gold scorer for `toy_tools` or a path inside one of its builds (a `tools-*` folder of the cache), else
    None."""
    if dataset == "toy_tools":
        return gold_score
    relative = os.path.relpath(os.path.abspath(dataset), os.path.abspath(toy_task.cache_root()))
    return gold_score if relative.startswith("tools-") else None


# ---------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------
def make_tokenizer():
    """The word-level tokenizer (toy_task's kind, one token per word) with CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[EOS]", "[UNK]", "=", *LETTERS, *DIGITS, "sort", "box", "lookup", "<user>", "<assistant>",
             "<tool>", "<tools>", "</tools>", "<tool_call>", "</tool_call>", '{"name":', '"lookup",', '"arguments":',
             '{"box":', *[f'"{d}' for d in DIGITS], *[f'{d}"}}}}' for d in DIGITS], '{"error":']
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tool_schemas() -> list:
    """The `tools` every prompt is rendered with (TRL's format): [lookup's JSON schema]."""
    from transformers.utils import get_json_schema

    return [get_json_schema(lookup)]


def demonstration(box: str, rng: random.Random) -> list:
    """A demonstrator's conversation for `sort box <box>` (see the module docstring)."""
    messages = [{"role": "user", "content": f"sort box {box}"}]
    if rng.random() >= P_TOOL:  # a guess, sorted
        guess = sorted(rng.sample(LETTERS, rng.randint(toy_task.MIN_LETTERS, toy_task.MAX_LETTERS)))
        return messages + [{"role": "assistant", "content": " ".join(guess)}]
    asked = box
    if rng.random() < P_TYPO:
        digits = box.split()
        i = rng.randrange(3)
        digits[i] = rng.choice([d for d in DIGITS if d != digits[i]])
        asked = " ".join(digits)
    letters = lookup(asked)
    answer = toy_task.imperfect_demonstration(letters + " =", rng).strip()
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"box": asked}}}
    return messages + [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "name": "lookup", "content": letters},
                       {"role": "assistant", "content": answer}]


def conversation_ids(tokenizer, messages, tools):
    """(token ids, assistant mask): each assistant message's tokens up to and including its [EOS] are True."""
    def ids(msgs, generation=False):
        text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=generation)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    full = ids(messages)
    mask = [False] * len(full)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start, end = len(ids(messages[:i], generation=True)), len(ids(messages[:i + 1]))
            mask[start:end] = [True] * (end - start)
    return full, mask


def _train_sft(tokenizer, conversations, steps: int, batch_size: int, rng: random.Random):
    """A tiny GPT-NeoX (toy_task's, 128 positions) trained on (token ids, assistant mask) conversations, loss on the
    assistant tokens only. Each batch is sorted by length and run as two halves (gradients summed, one step): the
    short direct answers then pad to their own length, not to a tool episode's."""
    from transformers import GPTNeoXForCausalLM

    config = toy_task._model_config(tokenizer)
    config.max_position_embeddings = 128
    model = GPTNeoXForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * (1 - s / steps))
    pad = tokenizer.pad_token_id
    model.train()
    for _ in range(steps):
        batch = sorted(rng.sample(conversations, batch_size), key=lambda c: len(c[0]))
        n_targets = sum(sum(mask[1:]) for _, mask in batch)
        for half in (batch[:batch_size // 2], batch[batch_size // 2:]):
            ids = toy_task._pad([c[0] for c in half], pad, "right")
            mask = toy_task._pad([[int(m) for m in c[1]] for c in half], 0, "right").bool()
            logits = model(input_ids=ids, attention_mask=(ids != pad).long()).logits
            labels = ids[:, 1:].masked_fill(~mask[:, 1:], -100)  # loss on assistant tokens only
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
            (loss / n_targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    model.eval()
    return model


def tool_result(call_text: str) -> str:
    """What the tool says to a `<tool_call> ... </tool_call>` block's inner text: lookup's letters, or, for JSON that
    does not parse or a call lookup refuses, `{"error": "<exception type>: <message>"}` (as tool_calls.call_tool)."""
    try:
        call = json.loads(call_text)
        if call.get("name") != "lookup":
            raise ValueError(f"unknown tool {call.get('name')!r}")
        return lookup(**call["arguments"])
    except Exception as e:  # noqa: BLE001 - any failure is a message to the model
        return json.dumps({"error": f"{type(e).__name__}: {e}"})


@torch.no_grad()
def episodes(model, tokenizer, boxes, greedy: bool, tools) -> dict:
    """The builder's own multi-turn episodes (report.json): sample a turn (temperature 1, or greedy) up to [EOS]; a
    turn with a `<tool_call> JSON </tool_call>` gets its tool result appended as `<tool> ... <assistant>`, and the
    next turn is sampled; at most MAX_TOOL_ROUNDS tool calls and MAX_SAMPLED sampled tokens per episode. Returns the
    tool-call rate (episodes with a call), the fractions of calls that succeed and that get the right box's letters
    (the prompt's box, or one holding the same letters), the mean gold (of all episodes, of those with a call, of
    those without) and the decoded `texts` (prompt excluded)."""
    from transformers import GenerationConfig

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    prompts = [[{"role": "user", "content": f"sort box {box}"}] for box in boxes]
    seqs = [tokenizer(tokenizer.apply_chat_template(p, tools=tools, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"] for p in prompts]
    starts = [len(s) for s in seqs]
    sampled, calls, good, right = [0] * len(seqs), [0] * len(seqs), [0] * len(seqs), [0] * len(seqs)
    done = [False] * len(seqs)
    while not all(done):
        active = [i for i in range(len(seqs)) if not done[i]]
        query = toy_task._pad([seqs[i] for i in active], pad, "left")
        config = GenerationConfig(max_new_tokens=max(MAX_SAMPLED - sampled[i] for i in active), pad_token_id=pad,
                                  eos_token_id=eos, suppress_tokens=[pad], **sampling)
        out = model.generate(input_ids=query, attention_mask=(query != pad).long(), generation_config=config)
        for row, i in enumerate(active):
            turn = [t for t in out[row, query.shape[1]:].tolist() if t != pad][:MAX_SAMPLED - sampled[i]]
            seqs[i] += turn
            sampled[i] += len(turn)
            block = re.search(r"<tool_call>(.*?)</tool_call>", tokenizer.decode(turn, skip_special_tokens=True))
            if not turn or turn[-1] != eos or block is None or calls[i] == MAX_TOOL_ROUNDS:
                done[i] = True
                continue
            calls[i] += 1
            result = tool_result(block.group(1).strip())
            good[i] += not result.startswith('{"error":')
            right[i] += result == lookup(boxes[i])
            seqs[i] += tokenizer(f"<tool> {result} <assistant>", add_special_tokens=False)["input_ids"]
    texts = [tokenizer.decode(s[start:], skip_special_tokens=True) for s, start in zip(seqs, starts)]
    gold = [gold_score(f"sort box {box}", text) for box, text in zip(boxes, texts)]
    with_tool = [g for g, c in zip(gold, calls) if c]
    without = [g for g, c in zip(gold, calls) if not c]

    def mean(values):
        return sum(values) / len(values) if values else 0.0

    return {"tool_call_rate": len(with_tool) / len(boxes), "tool_success_rate": sum(good) / max(sum(calls), 1),
            "tool_right_box_rate": sum(right) / max(sum(calls), 1),
            "gold": mean(gold), "gold_with_tool": mean(with_tool), "gold_without_tool": mean(without), "texts": texts}


def _build_into(root: str, seed: int, verbose: bool) -> dict:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    t0 = time.time()
    log = (lambda *a: print("[toy_tools]", *a, flush=True)) if verbose else (lambda *a: None)
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(os.path.join(root, "tokenizer"))
    tools = tool_schemas()

    boxes = [" ".join(f"{n:03d}") for n in range(1000)]
    random.Random("toy-tools-split").shuffle(boxes)  # the same held-out boxes whatever the seed
    test_boxes, train_boxes = boxes[:256], boxes[256:]
    demos = {split: [demonstration(b, rng) for b in split_boxes for _ in range(4 if split == "train" else 1)]
             for split, split_boxes in (("train", train_boxes), ("test", test_boxes))}
    conversations = [conversation_ids(tokenizer, m, tools) for m in demos["train"]]
    sft = _train_sft(tokenizer, conversations, steps=SFT_STEPS, batch_size=64, rng=rng)
    sft.save_pretrained(os.path.join(root, "sft"), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(root, "sft"))
    log(f"sft trained ({time.time() - t0:.0f}s)")

    toy_task.save_dataset({split: [{"prompt": [{"role": "user", "content": f"sort box {b}"}]} for b in split_boxes]
                           for split, split_boxes in (("train", train_boxes), ("test", test_boxes))},
                          os.path.join(root, "prompt"))
    toy_task.save_dataset({split: [{"messages": m, "tools": tools} for m in rows] for split, rows in demos.items()},
                          os.path.join(root, "sft_data"))
    report = {"builder_version": BUILDER_VERSION, "seed": seed, "p_tool": P_TOOL, "p_typo": P_TYPO,
              "n_prompt_train": len(train_boxes), "n_prompt_test": len(test_boxes),
              "n_sft_train": len(demos["train"]), "n_sft_test": len(demos["test"])}
    for mode in ("sampled", "greedy"):
        stats = episodes(sft, tokenizer, test_boxes, greedy=mode == "greedy", tools=tools)
        report.update({f"sft_{key}_{mode}": round(value, 4) for key, value in stats.items() if key != "texts"})
    report["sft_tool_success_rate"] = report["sft_tool_success_rate_sampled"]
    with open(os.path.join(root, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    log(f"built in {time.time() - t0:.0f}s: {report}")
    return report


def paths(root: str) -> dict:
    return {"root": root, "policy": os.path.join(root, "sft"), "tokenizer": os.path.join(root, "tokenizer"),
            "prompt_dataset": os.path.join(root, "prompt"), "sft_dataset": os.path.join(root, "sft_data")}


def folder_name(seed: int) -> str:
    """The cache folder of a build, beside the toy task's: `tools-`, builder version, seed, torch and transformers
    releases (as toy_task.folder_name)."""
    import transformers

    return f"tools-v{BUILDER_VERSION}-seed{seed}-torch{torch.__version__}-transformers{transformers.__version__}"


def build(seed: int = 0, cache_dir: str | None = None, verbose: bool = True) -> dict:
    """Build the tool world once per (seed, builder version, library releases) and return its paths, cached as the
    toy task's (toy_task.cached_build: a finished build is a folder with report.json, never a half-written one)."""
    root = os.path.join(cache_dir or toy_task.cache_root(), folder_name(seed))
    toy_task.cached_build(root, lambda tmp: _build_into(tmp, seed, verbose))
    return paths(root)


if __name__ == "__main__":
    print(json.dumps(build(), indent=2))
