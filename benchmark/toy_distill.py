"""Which divergence should distill.py default to? The toy teacher (toy_task.build_teacher) distilled into the toy SFT
policy with each loss x seeds, at a short budget where they still differ; one table.

    python benchmark/toy_distill.py                  # forward KL, JSD, reverse KL, pg x seeds 1 2 3, ~3 min on 2 cores

Each run is `python distill.py --seed S --total_episodes 512 --eval_steps 2 <loss flags>` (8 steps of 64 on-policy
completions, the toy alias's other defaults), alone. The table (RESULTS/toy_distill.md) gives the held-out greedy
gold after 2, 4 and 8 steps (mean +- std over seeds; the student starts at 0.466, the teacher scores 1.0) and the
per-token reverse KL to the teacher on the last step's samples.
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
sys.path.insert(0, HERE)

from toy import fmt, machine, run_child  # noqa: E402

LOSSES = {"forward KL (beta 0)": ["--beta", "0"], "JSD (beta 0.5)": ["--beta", "0.5"],
          "reverse KL (beta 1)": ["--beta", "1"], "pg (REINFORCE on log p_T - log p_S)": ["--loss", "pg"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--total_episodes", type=int, default=512)
    parser.add_argument("--runs", default=os.path.join(ROOT, "runs", "bench_toy_distill"))
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    table = {}
    for name, flags in LOSSES.items():
        for seed in args.seeds:
            out = os.path.join(args.runs, name.split()[0] + ("" if "beta" not in name else name.split()[-1][:-1]),
                               f"seed{seed}")
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            timing = run_child([sys.executable, os.path.join(ROOT, "distill.py"), "--seed", str(seed),
                                "--total_episodes", str(args.total_episodes), "--eval_steps", "2",
                                "--output_dir", out, *flags],
                               out + ".log", threads=2)
            if timing["returncode"] != 0:
                raise SystemExit(f"{name} seed {seed} failed: see {out}.log")
            with open(os.path.join(out, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            gold = {r["step"]: r["eval/gold_score"] for r in rows if "eval/gold_score" in r}
            last = [r for r in rows if "objective/teacher_kl" in r][-1]
            table.setdefault(name, []).append(dict(gold=gold, kl=last["objective/teacher_kl"]))
            print(f"{name} seed {seed}: {gold}", flush=True)
    steps = sorted(next(iter(table.values()))[0]["gold"])
    shown = [s for s in (2, 4, steps[-1]) if s in steps]
    lines = [f"# distill.py on the toy task: which divergence ({datetime.date.today()})", "",
             f"`python benchmark/toy_distill.py`; {machine()}. Seeds {' '.join(map(str, args.seeds))}, "
             f"{args.total_episodes} on-policy episodes (batches of 64); mean +- std. Held-out greedy gold of the "
             "student (toy SFT policy, 0.466 at step 0; the teacher: 1.0), and the per-token reverse KL to the "
             "teacher on the last step's samples.", "",
             "| loss | " + " | ".join(f"gold after step {s}" for s in shown) + " | KL(student || teacher) per token |",
             "|" + "---|" * (len(shown) + 2)]
    for name, runs in table.items():
        lines.append(f"| {name} | " + " | ".join(fmt([r["gold"][s] for r in runs]) for s in shown) +
                     f" | {fmt([r['kl'] for r in runs])} |")
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, "toy_distill.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
