"""Micro-batches sized by a token budget (--token_budget, plumbing/accumulation.py) against micro-batches of a fixed
row count, on the length-spread world of benchmark/padding_free.py, every run packed (--padding_free).

    python benchmark/token_budget.py           # rloo, grpo, dpo -> results/token_budget.md
    python benchmark/token_budget.py --rounds 1 --steps 2 --algos dpo     # quicker

Each script's step holds the same rows in every mode (TL;DR's: 16 completions, 4 per prompt; DPO 4 pairs):
  - one: a single micro-batch of all of them (the most memory a step's forward can take);
  - rows: 2 micro-batches of half the rows each (--gradient_accumulation_steps 2), whatever their lengths;
  - budget: micro-batches of at most --token_budget real tokens, about the mean size of a `rows` micro-batch
    (RL: two prompt groups of 4 rows of a 256-token mean prompt and about 19 sampled tokens: 2 x 4 x 275 = 2200,
    set to 2400; DPO: two pairs of chosen and rejected rows of about 256 + 30 tokens each: 1200).
Within a budget, long rows go in small micro-batches and short ones in large, so the largest forward is bounded by
the budget instead of by the longest rows times the row count. Each round runs every mode of every script alone;
the report gives the median step time and the largest peak resident memory of each, and each mode's step time
over `rows`'.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from padding_free import build_spread_world, measure  # noqa: E402
from speed import machine  # noqa: E402
from speed_settings import TLDR  # noqa: E402

BUDGET = {"rloo": 2400, "grpo": 2400, "dpo": 1200}
BATCH = {"rloo": TLDR["rloo_batch"], "grpo": TLDR["grpo_batch"], "dpo": TLDR["dpo_batch"]}


def mode_flags(algo: str, mode: str) -> list:
    """The flags of `mode` (module docstring), added after the setting's (which has one micro-batch a step)."""
    if mode == "one":
        return []
    flags = ["--per_device_train_batch_size", str(BATCH[algo] // 2), "--gradient_accumulation_steps", "2"]
    return flags + (["--token_budget", str(BUDGET[algo])] if mode == "budget" else [])


def report(results: dict, args) -> list:
    lines = [f"# Token-budget micro-batches against fixed row counts (benchmark/token_budget.py, "
             f"{datetime.date.today()})", "",
             f"Machine: {machine()}; {args.threads} threads; {args.rounds} rounds; {args.steps} timed steps after "
             f"{args.warmup} warm-up; every run --padding_free.", "", __doc__.split("\n\n")[2].strip(), "",
             "| script | mode | s/step (median) | / rows | peak RSS MiB |", "| --- | --- | --- | --- | --- |"]
    for algo, modes in results.items():
        base = statistics.median(r["step"] for r in modes["rows"] if "error" not in r) if all(
            "error" not in r for r in modes["rows"]) else None
        for mode, runs in modes.items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                lines.append(f"| {algo} | {mode} | failed: {runs[-1]['error']} | | |")
                continue
            step = statistics.median(r["step"] for r in ok)
            flags = " ".join(mode_flags(algo, mode)) or "one micro-batch"
            lines.append(f"| {algo} | {mode} (`{flags}`) | {step:.3f} | "
                         f"{'' if base is None else f'{step / base:.2f}'} | "
                         f"{max(r['peak_rss_mib'] for r in ok):.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["rloo", "grpo", "dpo"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "token_budget.md"))
    args = parser.parse_args()
    paths = build_spread_world(os.path.join(tempfile.gettempdir(), "policy_rlhf_padding_free_v1"))
    results = {algo: {mode: [] for mode in ("one", "rows", "budget")} for algo in args.algos}
    for round_ in range(args.rounds):
        for algo in args.algos:
            for mode in results[algo]:
                result = measure(algo, True, paths, args, tuple(mode_flags(algo, mode)))
                results[algo][mode].append(result)
                print(f"[token_budget] round {round_ + 1} {algo} {mode}: {json.dumps(result)}", flush=True)
    lines = report(results, args)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
