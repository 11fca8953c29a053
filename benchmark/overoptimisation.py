"""Holding the gain: RL against the toy task's learned reward model for 10x the default budget, with a fixed KL
coefficient and with the adaptive KL controller (--kl_target, Ziegler et al. 2019), several seeds.

    python benchmark/overoptimisation.py                      # rloo, 10x budget, fixed vs adaptive, seeds 1 2 3
    python benchmark/overoptimisation.py --scale 0.05 --seeds 1   # a smoke run
    python benchmark/overoptimisation.py --setting toy_hard --scale 4   # the hard toy world, 4x: its reward model
                                                                         # is exploited, gold falls as its score rises

Each run is the script itself (`python rloo.py --total_episodes <10x> --eval_steps N ...`), alone; the curves are its
own held-out evaluations (eval/gold_score: the ground truth; eval/scores: the reward model being optimised; eval/kl:
sequence KL to the reference). Writes RESULTS/overoptimisation.md and overoptimisation.png (gold, reward-model score
and KL against steps, mean +- std over seeds; `--setting toy_hard`: overoptimisation_toy_hard.md / .png). A proxy
reward model is over-optimised when its score keeps rising while gold falls; a KL held near a target keeps the policy
where the reward model is still right.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
from toy import machine, run_child  # noqa: E402

KEYS = {"eval/gold_score": "gold (held-out, greedy)", "eval/scores": "reward-model score", "eval/kl": "KL to SFT"}


def read_eval_rows(run_dir: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "eval/gold_score" in row]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default="rloo", choices=["rloo", "grpo"])
    parser.add_argument("--setting", default="toy", choices=["toy", "toy_hard"], help="which toy world (--model)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--scale", type=float, default=10.0, help="budget as a multiple of the toy default (8192)")
    parser.add_argument("--kl_target", type=float, default=1.5, help="sequence KL the adaptive runs hold (nats)")
    parser.add_argument("--kl_horizon", type=int, default=1000, help="episodes; ~16 steps of 64 on the toy task")
    parser.add_argument("--evaluations", type=int, default=20, help="held-out evaluations per run")
    parser.add_argument("--runs_dir", default=os.path.join(HERE, "runs", "overoptimisation"))
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    episodes = int(8192 * args.scale)
    steps = episodes // 64
    eval_steps = max(1, steps // args.evaluations)
    settings = {"fixed": [], "adaptive": ["--kl_target", str(args.kl_target), "--kl_horizon", str(args.kl_horizon)]}
    suffix = "" if args.setting == "toy" else f"_{args.setting}"
    curves, usage = {}, {}
    for name, flags in settings.items():
        for seed in args.seeds:
            run_dir = os.path.join(args.runs_dir, args.setting, args.script, name, f"seed{seed}")
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(os.path.dirname(run_dir), exist_ok=True)
            cmd = [sys.executable, os.path.join(ROOT, f"{args.script}.py"), "--output_dir", run_dir,
                   "--seed", str(seed), "--model", args.setting, "--total_episodes", str(episodes),
                   "--eval_steps", str(eval_steps), *flags]
            print(f"[overopt] {' '.join(cmd[1:])}", flush=True)
            result = run_child(cmd, run_dir + ".log", args.threads)
            if result["returncode"] != 0:
                raise SystemExit(f"{name} seed {seed} failed; see {run_dir}.log")
            rows = read_eval_rows(run_dir)
            curves.setdefault(name, []).append(rows)
            usage.setdefault(name, []).append(result["wall_time_s"])
            print(f"[overopt] {name} seed {seed}: gold {rows[0]['eval/gold_score']:.3f} -> peak "
                  f"{max(r['eval/gold_score'] for r in rows):.3f} -> end {rows[-1]['eval/gold_score']:.3f}, KL "
                  f"{rows[-1]['eval/kl']:.2f} ({result['wall_time_s']:.0f}s)", flush=True)

    # table: start, peak and end of each curve, mean +- std over seeds
    def stat(name, key, pick):
        values = [pick([r[key] for r in rows]) for rows in curves[name]]
        return f"{np.mean(values):.3f} +- {np.std(values):.3f}"

    lines = [f"# Over-optimisation on {args.setting}: fixed vs adaptive KL", "",
             f"Written by `python benchmark/overoptimisation.py {' '.join(sys.argv[1:] if argv is None else argv)}`; "
             f"machine: {machine()}.", "",
             f"`{args.script}.py --model {args.setting}` with its defaults there, {episodes} episodes ({steps} steps "
             f"of 64, {args.scale:g}x the default budget), seeds {args.seeds}; "
             f"held-out evaluation every {eval_steps} steps "
             "(the script's own: 256 prompts, greedy). Adaptive: "
             f"`--kl_target {args.kl_target} --kl_horizon {args.kl_horizon}` from the same starting coefficient.", "",
             "| KL coefficient | gold peak | gold at the end | RM score at the end | KL at the end | wall (s) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in settings:
        lines.append(f"| {name} | {stat(name, 'eval/gold_score', max)} | "
                     f"{stat(name, 'eval/gold_score', lambda v: v[-1])}"
                     f" | {stat(name, 'eval/scores', lambda v: v[-1])} | {stat(name, 'eval/kl', lambda v: v[-1])} | "
                     f"{np.mean(usage[name]):.0f} |")
    lines += ["", f"![gold, reward-model score and KL against steps](overoptimisation{suffix}.png)", ""]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"overoptimisation{suffix}.md"), "w") as f:
        f.write("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, label) in zip(axes, KEYS.items()):
        for name, color in (("fixed", "tab:red"), ("adaptive", "tab:blue")):
            x = np.array([r["step"] for r in curves[name][0]])
            y = np.array([[r[key] for r in rows] for rows in curves[name]])
            ax.plot(x, y.mean(0), color=color, label=f"{name} (n={len(y)})")
            ax.fill_between(x, y.mean(0) - y.std(0), y.mean(0) + y.std(0), color=color, alpha=0.2)
        ax.set_xlabel("step (64 episodes)")
        ax.set_title(label)
        ax.legend()
    fig.suptitle(f"{args.script}.py --model {args.setting}, {args.scale:g}x budget: fixed vs adaptive KL")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"overoptimisation{suffix}.png"), dpi=100)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
