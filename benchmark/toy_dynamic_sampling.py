"""Does DAPO's dynamic sampling (grpo.py --dynamic_sampling) help where rewards are often flat? GRPO on the toy task
with a strict exact-match reward (1 when the completion is exactly the sorted letters, else 0: most groups of 4 are
all 0 at first, all 1 later), with and without dynamic sampling, x seeds; one table of held-out gold per step.

    python benchmark/toy_dynamic_sampling.py          # 2 settings x seeds 1 2 3, ~10 min on 2 cores

Each run is `python grpo.py --seed S --reward_funcs benchmark/toy_dynamic_sampling.py:exact_match --max_steps N
--eval_steps E [--dynamic_sampling]` (the toy alias's other defaults: 16 prompts x 4 completions per step, beta 0.2),
alone. Per step both settings train on the same number of completions; with dynamic sampling some steps sample
more prompts (dynamic_sampling/rounds) to replace the flat groups. The table (RESULTS/toy_dynamic_sampling.md):
held-out greedy gold (the toy's graded score) after each evaluation, the fraction of flat groups in the trained
batch, the rounds per step and the seconds per run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

SETTINGS = {"without": [], "--dynamic_sampling": ["--dynamic_sampling"]}


def exact_match(prompts, completions, **columns):
    """1.0 when the toy gold scorer gives full marks (the exact sorted answer), else 0.0."""
    from toy_worlds import toy_task

    scorer = toy_task.gold_scorer("toy")
    return [float(scorer(p, c) == 1.0) for p, c in zip(prompts, completions)]


def main() -> None:
    from toy import fmt, machine, run_child

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--max_steps", type=int, default=48)
    parser.add_argument("--eval_steps", type=int, default=16)
    parser.add_argument("--runs", default=os.path.join(ROOT, "runs", "bench_toy_dynamic_sampling"))
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    table = {}
    for name, flags in SETTINGS.items():
        for seed in args.seeds:
            out = os.path.join(args.runs, name.strip("-"), f"seed{seed}")
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            timing = run_child([sys.executable, os.path.join(ROOT, "grpo.py"), "--seed", str(seed), "--reward_funcs",
                                f"{os.path.abspath(__file__)}:exact_match", "--max_steps", str(args.max_steps),
                                "--eval_steps", str(args.eval_steps), "--output_dir", out, *flags],
                               out + ".log", threads=2)
            if timing["returncode"] != 0:
                raise SystemExit(f"{name} seed {seed} failed: see {out}.log")
            with open(os.path.join(out, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            train = [r for r in rows if r["step"] > 0]
            table.setdefault(name, []).append(dict(
                gold={r["step"]: r["eval/gold_score"] for r in rows if "eval/gold_score" in r},
                flat=sum(r["objective/frac_reward_zero_std"] for r in train) / len(train),
                flat_sampled=sum(r.get("dynamic_sampling/frac_flat_sampled", r["objective/frac_reward_zero_std"])
                                 for r in train) / len(train),
                rounds=sum(r.get("dynamic_sampling/rounds", 1.0) for r in train) / len(train),
                seconds=timing["wall_time_s"]))
            print(f"{name} seed {seed}: {table[name][-1]}", flush=True)
    steps = sorted(next(iter(table.values()))[0]["gold"])
    lines = [f"# grpo.py --dynamic_sampling on the toy task ({datetime.date.today()})", "",
             f"`python benchmark/toy_dynamic_sampling.py`; {machine()}. Reward: exact match of the sorted letters "
             f"(0/1); seeds {' '.join(map(str, args.seeds))}, {args.max_steps} steps of 64 trained completions; mean "
             "+- std over seeds. Gold: the toy's graded held-out score, greedy.", "",
             "| setting | " + " | ".join(f"gold at step {s}" for s in steps) + " | flat groups sampled | flat groups "
             "trained | rollouts per step | seconds per run |", "|" + "---|" * (len(steps) + 5)]
    for name, runs in table.items():
        lines.append(f"| {name} | " + " | ".join(fmt([r["gold"][s] for r in runs]) for s in steps) + " | "
                     + " | ".join(fmt([r[key] for r in runs], 2) for key in ("flat_sampled", "flat", "rounds"))
                     + f" | {fmt([r['seconds'] for r in runs], 0)} |")
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, "toy_dynamic_sampling.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
