"""Padding-free forwards (--padding_free, plumbing/packing.py) against padded ones, on a world whose lengths spread.

    python benchmark/padding_free.py           # rloo, grpo, dpo at TL;DR-like shapes -> results/padding_free.md
    python benchmark/padding_free.py --rounds 1 --steps 2 --algos dpo     # quicker
    python benchmark/padding_free.py --algos rloo grpo --flags="--use_vllm" \
        --out benchmark/results/padding_free_vllm.md
    python benchmark/padding_free.py --flags="--per_device_train_batch_size 2 --gradient_accumulation_steps 2" \
        --packed_flags="--token_budget 1200" --algos dpo --out benchmark/results/padding_free_budget.md
    python benchmark/padding_free.py --size 12 768 12288 --rounds 5 --steps 3 --warmup 1 --algos rloo grpo dpo \
        --out benchmark/results/padding_free_104m.md   # a 104M-parameter policy: Pythia-160M's layers and width

The world: speed_settings' TL;DR stand-ins (random-weight GPT-NeoX policy and reward model, 8 layers, width 256,
vocabulary 3072; the scripts' TL;DR hyper-parameters: RLOO k=4 and GRPO 4 completions per prompt, 16 completions a
step, DPO 4 pairs, completions of at most 53 tokens), with lengths that spread instead of fixed ones:
  - prompts of 64 to 448 tokens, uniformly (TL;DR's queries are cut at 512 with its format around them);
  - the policy's EOS made likely: about 4% a token at the sampling temperature, so completions end after a
    geometric number of tokens (a mean of about 19 in these runs, cut at 53), a summary-like spread;
  - DPO's chosen and rejected completions of 8 to 53 tokens, uniformly, each drawn apart.
Each round runs every script padded, then packed, each run alone; a run's step time is the mean over its steps
after the warm-up (speed_settings.seconds_per_step). The report gives each script's median over the rounds, the
packed / padded ratio of each round and their median, the same ratio for the step without its sampling (HF
generate, which packing leaves as it is: the step minus time/generate_seconds), the padding fraction of the padded
batches (rloo, grpo: the sampled batch's perf/padding_fraction; dpo: the micro-batches as the script collates
them), and each run's peak resident memory. The multi-turn row (grpo on the toy tool world, its toy defaults) shows
the same on episodes whose tool results make some rows several times others; its model is tiny, so the step is
mostly overhead there. --flags are added to both runs of a round (--use_vllm: vLLM samples, which pads nothing),
--packed_flags to the packed run only (--token_budget); the report's first lines name them. --size LAYERS WIDTH
VOCAB draws the policy and reward model at another shape (the same recipe, the EOS lift worked out for that
vocabulary): the stand-ins are so small that a step's sampling is mostly per-call overhead, which a larger model
shrinks relative to the forwards and backward.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from speed import machine, run_measured  # noqa: E402
from speed_settings import (  # noqa: E402
    TLDR,
    build_tldr_shaped,
    ours_flags,
    save_policy_and_reward,
    seconds_per_step,
    tldr_model_config,
    word_tokenizer,
)

PROMPT_TOKENS = (64, 448)  # uniform
COMPLETION_TOKENS = (8, TLDR["response_length"])  # DPO's chosen and rejected, uniform
EOS_PER_TOKEN = 0.04  # the policy's chance of EOS at each sampled token, at the TL;DR temperature
SMALL = (TLDR["layers"], TLDR["width"], TLDR["vocab"])  # speed_settings' TL;DR stand-ins
TARGET = 0.7  # packed / padded step time, at most (issue 49), for rloo, grpo, dpo


def build_spread_world(root: str, size: tuple = SMALL) -> dict:
    """The TL;DR stand-ins with spread lengths (module docstring), built once into `root`; seeded. `size`: (layers,
    width, vocabulary) of the policy and reward model; other than SMALL they are drawn here (seed 0)."""
    import random

    import torch
    from transformers import AutoTokenizer, GPTNeoXForCausalLM

    from toy_worlds.toy_task import save_dataset

    if size == SMALL:
        base = build_tldr_shaped(os.path.join(tempfile.gettempdir(), "policy_rlhf_speed_tldr_v2"))
    else:
        base = {k: os.path.join(root, f"{k}_random") for k in ("policy", "reward")}
    out = dict(reward=base["reward"], **{k: os.path.join(root, k) for k in ("policy", "prompt_dataset",
                                                                            "preference_dataset")})
    if os.path.exists(os.path.join(root, "done")):
        return out
    if size != SMALL:
        torch.manual_seed(0)
        save_policy_and_reward(base, word_tokenizer(size[2]), tldr_model_config(*size))
    vocab = size[2]
    policy = GPTNeoXForCausalLM.from_pretrained(base["policy"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base["policy"])
    eos = tokenizer.eos_token_id
    # hidden dimension 0 after the final layer norm is made a constant 1, read by the EOS row of the output layer
    # only: EOS's logit rises by `lift` everywhere, the others lose one random dimension of the width
    lift = TLDR["temperature"] * math.log((vocab - 1) * EOS_PER_TOKEN / (1 - EOS_PER_TOKEN))
    with torch.no_grad():
        norm, head = policy.gpt_neox.final_layer_norm, policy.get_output_embeddings()
        norm.weight[0], norm.bias[0] = 0.0, 1.0
        head.weight[:, 0] = 0.0
        head.weight[eos, 0] = lift
    policy.save_pretrained(out["policy"])
    tokenizer.save_pretrained(out["policy"])
    rng = random.Random(0)
    words = [w for w in tokenizer.get_vocab() if w.startswith("w")]
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    prompts = {split: [text(rng.randint(*PROMPT_TOKENS)) for _ in range(n)] for split, n in (("train", 256),
                                                                                             ("test", 8))}
    save_dataset({s: [{"prompt": p} for p in ps] for s, ps in prompts.items()}, out["prompt_dataset"])
    completion = lambda: " " + text(rng.randint(*COMPLETION_TOKENS) - 1)  # noqa: E731  (+ EOS)
    save_dataset({s: [{"prompt": p, "chosen": completion(), "rejected": completion()} for p in ps]
                  for s, ps in prompts.items()}, out["preference_dataset"])
    open(os.path.join(root, "done"), "w").close()
    return out


def world_folder(size: tuple = SMALL) -> str:
    """Where `build_spread_world` keeps the world of `size` between runs (a temporary folder)."""
    return os.path.join(tempfile.gettempdir(), "policy_rlhf_padding_free_v1" + (
        "" if size == SMALL else "_{}x{}_v{}".format(*size)))


def dpo_padding_fraction(paths: dict, batch: int) -> float:
    """The padding share of DPO's micro-batches as dpo.py collates them (chosen and rejected rows, the prompt left-
    padded and the completions right-padded to the micro-batch's longest), over the training pairs in order."""
    import dpo
    from plumbing import data_utils as du
    from plumbing import models

    tokenizer = models.load_tokenizer(paths["policy"])
    data = du.load_preference_dataset(paths["preference_dataset"], "train")
    rows, _ = dpo.tokenize_preferences(tokenizer, data, 448, 512, paths["preference_dataset"])
    positions = tokens = 0
    for i in range(0, len(rows) - batch + 1, batch):
        built, _ = du.concatenated_inputs(rows[i:i + batch], tokenizer.pad_token_id)
        positions += built.numel()
        tokens += int((built != tokenizer.pad_token_id).sum())
    return 1 - tokens / positions


def measure(algo: str, packed: bool, paths: dict, args, extra: tuple = ()) -> dict:
    """One run of `<algo>.py`, alone (`extra`: flags added last): mean seconds per step after the warm-up, peak RSS,
    mean padding fraction."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        if algo == "grpo_tools":
            flags = ["grpo.py", "--model", "toy_tools", "--num_eval_prompts", "8"]
        else:
            flags = [f"{algo}.py", *ours_flags("tldr", algo, paths)]
        cmd = [sys.executable, os.path.join(ROOT, flags[0]), *flags[1:], "--output_dir", run_dir, "--seed", "1",
               "--max_steps", str(args.warmup + args.steps + 1), "--eval_steps", "0",
               *(["--padding_free"] if packed else []), *extra]
        metrics = os.path.join(run_dir, "metrics.jsonl")
        run = run_measured(cmd, args.threads, watch=metrics)
        rows = []
        if os.path.exists(metrics):
            with open(metrics) as f:
                rows = [json.loads(line) for line in f]
    if run["error"]:
        return {"error": run["error"]}
    fractions = [r["perf/padding_fraction"] for r in rows if "perf/padding_fraction" in r]
    timed = [r for r in rows if args.warmup < r.get("step", 0) <= args.warmup + args.steps]
    sampling = statistics.mean([r.get("time/generate_seconds", 0.0) for r in timed] or [0.0])
    step = seconds_per_step(run["step_ends"], args.warmup, args.steps)
    return dict(step=step, rest=step - sampling, peak_rss_mib=run["peak_rss_mib"],
                padding_fraction=statistics.mean(fractions) if fractions else None,
                response_length=statistics.mean([r["val/response_length"] for r in rows if "val/response_length" in r]
                                                or [math.nan]))


def report(results: dict, args, paths: dict) -> list:
    lines = [f"# Padding-free forwards: packed vs padded step time (benchmark/padding_free.py, "
             f"{datetime.date.today()})",
             "", f"Machine: {machine()}; {args.threads} threads; {args.rounds} rounds, padded then packed in each, "
             f"{args.steps} timed steps after {args.warmup} warm-up; flags added to both runs: "
             f"`{args.flags or 'none'}`, to the packed run only: `{args.packed_flags or 'none'}`; policy and reward "
             "model: {} layers, width {}, vocabulary {}{}.".format(*args.size, "" if tuple(args.size) == SMALL else
                                                                   " (`--size`: drawn for this run, not the "
                                                                   "stand-ins below)"), "",
             __doc__.split("\n\n")[2].strip(), "",
             "| script | padded s/step | packed s/step | packed / padded (median; rounds) | the step without its "
             "sampling: packed / padded | padding fraction of the padded batch | peak RSS MiB padded / packed | "
             "target |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for algo, runs in results.items():
        ok = [(a, b) for a, b in zip(runs["padded"], runs["packed"]) if "error" not in a and "error" not in b]
        if not ok:
            lines.append(f"| {algo} | failed: {(runs['padded'] + runs['packed'])[-1].get('error')} | | | | | | |")
            continue
        ratios = [b["step"] / a["step"] for a, b in ok]
        rest = statistics.median(b["rest"] / a["rest"] for a, b in ok)
        fraction = ok[0][0]["padding_fraction"]
        if fraction is None and algo == "dpo":  # the padded run's micro-batches, of --per_device_train_batch_size
            flags = shlex.split(args.flags)
            rows = "--per_device_train_batch_size"
            fraction = dpo_padding_fraction(paths, int(flags[flags.index(rows) + 1]) if rows in flags else
                                            TLDR["dpo_batch"])
        median = statistics.median(ratios)
        target = f"<= {TARGET}: {'met' if median <= TARGET else 'not met'}" if algo in ("rloo", "grpo", "dpo") else ""
        lines.append(f"| {algo} | {statistics.median(a['step'] for a, _ in ok):.3f} | "
                     f"{statistics.median(b['step'] for _, b in ok):.3f} | **{median:.2f}** "
                     f"({', '.join(f'{r:.2f}' for r in ratios)}) | {rest:.2f} | "
                     f"{'' if fraction is None else f'{fraction:.2f}'} | "
                     f"{max(a['peak_rss_mib'] for a, _ in ok):.0f} / {max(b['peak_rss_mib'] for _, b in ok):.0f} | "
                     f"{target} |")
    lines += ["", "Sampled completion length (rloo, grpo; mean tokens): " + ", ".join(
        f"{algo} {runs['padded'][0].get('response_length', math.nan):.1f}" for algo, runs in results.items()
        if algo in ("rloo", "grpo") and "error" not in runs["padded"][0])]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["rloo", "grpo", "dpo", "grpo_tools"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flags", default="", help="flags added to both runs of a round, e.g. --flags=--use_vllm")
    parser.add_argument("--packed_flags", default="", help="flags added to the packed run only, e.g. --token_budget")
    parser.add_argument("--size", nargs=3, type=int, default=list(SMALL), metavar=("LAYERS", "WIDTH", "VOCAB"),
                        help="the policy and reward model's layers, width and vocabulary (default: speed_settings' "
                        "TL;DR stand-ins)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "padding_free.md"))
    args = parser.parse_args()
    paths = build_spread_world(world_folder(tuple(args.size)), tuple(args.size))
    results = {algo: {"padded": [], "packed": []} for algo in args.algos}
    for round_ in range(args.rounds):
        for algo in args.algos:
            for mode in ("padded", "packed"):
                extra = shlex.split(args.flags) + (shlex.split(args.packed_flags) if mode == "packed" else [])
                result = measure(algo, mode == "packed", paths, args, tuple(extra))
                results[algo][mode].append(result)
                print(f"[padding_free] round {round_ + 1} {algo} {mode}: {json.dumps(result)}", flush=True)
    lines = report(results, args, paths)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
