"""Toy tool world benchmark: grpo.py and rloo.py on `--model toy_tools` (multi-turn episodes with a lookup tool,
toy_tools.py), 1 and 2 processes x seeds, one table.

    python benchmark/toy_tool_world.py                     # grpo, rloo x 1, 2 processes x seeds 1 2 3,
                                                           # ~11 min on 2 cores
    python benchmark/toy_tool_world.py --algos grpo --procs 1 --seeds 1 --max_steps 2    # a smoke run
    python benchmark/toy_tool_world.py --procs 1 --variants env_class env_factory async_tool trl_reward
                                                           # the world as TRL users write it -> toy_tools_variants.md

Each run is `python <algo>.py --model toy_tools --seed S` (2 processes: torch.distributed.run, one thread each, and
--per_device_train_batch_size halved so that the global batch, and so the number of steps, is the 1-process one),
alone, with its alias defaults. Read back from its metrics.jsonl:
- held-out gold (eval/gold_score: greedy episodes of 256 held-out prompts, the tool called by the policy) before
  training and after the last step;
- sampled tool calls per episode (tools/call_frequency of the training episodes) at the first step (the SFT policy's
  samples) and over the last 10% of the steps, with the sampled gold (objective/scores, the gold reward) likewise;
- tool failures per call over the run, and the wall time.
The table goes to RESULTS/toy_tools.md (mean +- std over seeds). `--variants` other than `alias` train the same
world through the pieces a TRL user writes (benchmark/toy_environment.py, VARIANTS) -> RESULTS/toy_tools_variants.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from toy import fmt, machine, run_child  # noqa: E402

ENV = "benchmark/toy_environment.py"
VARIANTS = {  # name -> the flags a TRL user passes on top of --model toy_tools
    "alias": [],  # the alias's own lookup tool and gold reward function
    "env_class": ["--environment", f"{ENV}:LookupBox"],  # plus its get_reward: a bonus for looking up
    "env_factory": ["--environment", f"{ENV}:make_lookup_box"],
    "async_tool": ["--environment", f"{ENV}:AsyncLookupBox"],
    "trl_reward": ["--reward_funcs", f"{ENV}:gold_with_trl_arguments"],  # the gold score, TRL's extra arguments
}


def summarise(run_dir: str) -> dict:
    """The run's before/after numbers from metrics.jsonl (see the module docstring)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    evals = [r for r in rows if "eval/gold_score" in r]
    train = [r for r in rows if "tools/call_frequency" in r and r["step"] > 0]
    tail = train[-max(1, len(train) // 10):]

    def mean(key, rs):
        return sum(r[key] for r in rs) / len(rs)

    return dict(steps=train[-1]["step"], gold_before=evals[0]["eval/gold_score"],
                gold_after=evals[-1]["eval/gold_score"],
                calls_before=train[0]["tools/call_frequency"], calls_after=mean("tools/call_frequency", tail),
                sampled_gold_before=train[0]["objective/scores"], sampled_gold_after=mean("objective/scores", tail),
                failures=mean("tools/failure_frequency", train),
                eval_calls_after=evals[-1]["eval/tools/call_frequency"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["grpo", "rloo"])
    parser.add_argument("--procs", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--variants", nargs="+", default=["alias"], choices=list(VARIANTS))
    parser.add_argument("--max_steps", type=int, default=None, help="cap each run (smoke runs)")
    parser.add_argument("--runs", default=os.path.join(ROOT, "runs", "bench_toy_tools"))
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    args = parser.parse_args()

    import torch

    import grpo
    import rloo

    if not torch.cuda.is_available():
        os.environ.setdefault("ACCELERATE_USE_CPU", "1")  # torch.distributed.run's processes on the CPU (gloo)

    batch = {"grpo": grpo.ALIAS_DEFAULTS["toy_tools"]["per_device_train_batch_size"],
             "rloo": rloo.ALIAS_DEFAULTS["toy_tools"]["per_device_train_batch_size"]}
    results = {}
    runs = [(algo, variant, procs) for algo in args.algos for variant in args.variants for procs in args.procs]
    for algo, variant, procs in runs:
        for seed in args.seeds:
            name = f"{algo}-{procs}p" + ("" if variant == "alias" else f"-{variant}")
            out = os.path.join(args.runs, name, f"seed{seed}")
            done = os.path.exists(os.path.join(out, "model", "config.json"))
            timing_path = os.path.join(out, "bench_timing.json")
            if args.force or not done:
                if os.path.exists(out):
                    import shutil

                    shutil.rmtree(out)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                flags = ["--model", "toy_tools", "--seed", str(seed), "--output_dir", out,
                         "--per_device_train_batch_size", str(batch[algo] // procs), *VARIANTS[variant]]
                flags += ["--max_steps", str(args.max_steps)] if args.max_steps else []
                launcher = [sys.executable] if procs == 1 else [
                    sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
                print(f"{algo} {variant} x {procs} process(es), seed {seed} ...", flush=True)
                timing = run_child([*launcher, os.path.join(ROOT, f"{algo}.py"), *flags], out + ".log",
                                   threads=2 // procs or 1)
                if timing["returncode"] != 0:
                    raise SystemExit(f"{algo} seed {seed} ({procs} processes) failed: see {out}.log")
                with open(timing_path, "w") as f:
                    json.dump(timing, f)
            with open(timing_path) as f:
                timing = json.load(f)
            results.setdefault((algo, variant, procs), []).append({**summarise(out), **timing})
            print(f"  {results[(algo, variant, procs)][-1]}", flush=True)

    lines = [f"# Toy tool world: grpo.py and rloo.py, `--model toy_tools` ({datetime.date.today()})", "",
             f"`python benchmark/toy_tool_world.py`; {machine()}. Seeds {' '.join(map(str, args.seeds))}; mean +- std.",
             "Held-out gold: greedy episodes of 256 held-out prompts (the policy calls the tool itself), before "
             "training -> after the last step. Sampled: the training episodes at the first step (the SFT policy) "
             "-> the mean of the last 10% of the steps. Two processes keep the global batch (64 episodes per step).",
             "", "| algo | variant | processes | steps | held-out gold before | held-out gold after | gain | "
             "sampled tool calls / episode | sampled reward | tool failures / call | wall time (s) |",
             "|" + "---|" * 11]
    for (algo, variant, procs), rs in results.items():
        lines.append(
            f"| {algo} | {variant} | {procs} | {rs[0]['steps']} | {fmt([r['gold_before'] for r in rs])} | "
            f"{fmt([r['gold_after'] for r in rs])} | {fmt([r['gold_after'] - r['gold_before'] for r in rs])} | "
            f"{fmt([r['calls_before'] for r in rs], 2)} -> {fmt([r['calls_after'] for r in rs], 2)} | "
            f"{fmt([r['sampled_gold_before'] for r in rs], 2)} -> {fmt([r['sampled_gold_after'] for r in rs], 2)} | "
            f"{fmt([r['failures'] for r in rs], 3)} | {fmt([r['wall_time_s'] for r in rs], 0)} |")
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, "toy_tools.md" if args.variants == ["alias"] else "toy_tools_variants.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {path} ({time.strftime('%H:%M')})")


if __name__ == "__main__":
    main()
