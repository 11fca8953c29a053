"""Does each script learn from what it sees? Every script that takes images, on the toy vision world (toy_vision.py:
a tiny LLaVA answers "what color is the shape ?" / "where is the shape ?" about 28 x 28 pictures), at its
`--model toy_vision` defaults, seeds 1 2 3; one table.

    python benchmark/toy_vision.py                          # 6 scripts x 3 seeds, ~15 min on 2 cores
    python benchmark/toy_vision.py --scripts dpo --seeds 1  # one row (the others kept from RESULTS/toy_vision.json)

Each run is `python <script>.py --model toy_vision --seed S --num_eval_prompts 256` (the whole held-out split), alone.
The table (RESULTS/toy_vision.md) gives the held-out greedy gold at the start (the SFT policy: the same for every
script and seed) and at the end, and the end's blind control (the same prompts with blank grey pictures: a policy
that reads the pictures falls to about chance there), mean +- std over seeds and each seed's; the steps of a
run (the seconds of each run are in RESULTS/toy_vision.json).
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
sys.path.insert(0, ROOT)

from toy import fmt, machine, run_child  # noqa: E402

SCRIPTS = ("sft", "dpo", "kto", "rloo", "grpo", "distill")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=SCRIPTS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run (OMP_NUM_THREADS)")
    parser.add_argument("--runs", default=os.path.join(ROOT, "runs", "bench_toy_vision"))
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    saved = os.path.join(args.results, "toy_vision.json")
    table = {}
    if os.path.exists(saved):  # the scripts not rerun keep their rows
        with open(saved) as f:
            table = {k: v for k, v in json.load(f).items() if k not in args.scripts}
    for script in args.scripts:
        for seed in args.seeds:
            out = os.path.join(args.runs, script, f"seed{seed}")
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            timing = run_child([sys.executable, os.path.join(ROOT, f"{script}.py"), "--model", "toy_vision", "--seed",
                                str(seed), "--num_eval_prompts", "256", "--output_dir", out], out + ".log",
                               threads=args.threads)
            if timing["returncode"] != 0:
                raise SystemExit(f"{script} seed {seed} failed: see {out}.log")
            with open(os.path.join(out, "metrics.jsonl")) as f:
                rows = [r for r in map(json.loads, filter(str.strip, f)) if "eval/gold_score" in r]
            table.setdefault(script, []).append(dict(
                start=rows[0]["eval/gold_score"], end=rows[-1]["eval/gold_score"],
                blind=rows[-1]["eval/gold_score_blind"], steps=rows[-1]["step"], seconds=timing["wall_time_s"]))
            print(f"{script} seed {seed}: {table[script][-1]}", flush=True)
    from toy_worlds import toy_vision

    with open(os.path.join(toy_vision.build(verbose=False)["root"], "report.json")) as f:
        chance = json.load(f)["chance"]
    lines = [f"# Images: each script on the toy vision world ({datetime.date.today()})", "",
             f"`python benchmark/toy_vision.py`; {machine()}; {args.threads} torch threads per run, one run at a time. "
             "Seeds " + " ".join(map(str, args.seeds)) + ", each script at its `--model toy_vision` defaults, the "
             "held-out split's 256 pictures. Gold: greedy answers scored against the picture's answer; blind: the "
             f"same prompts with blank grey pictures (chance is {chance}: 1/4 for colours, 1/2 for sides).", "",
             "| script | steps | start gold | end gold | end gold per seed | end blind |",
             "| --- | ---: | ---: | ---: | --- | ---: |"]
    for script, runs in sorted(table.items(), key=lambda item: SCRIPTS.index(item[0])):
        lines.append(f"| {script} | {runs[0]['steps']} | {fmt([r['start'] for r in runs])} | "
                     f"{fmt([r['end'] for r in runs])} | {' / '.join(format(r['end'], '.3f') for r in runs)} | "
                     f"{fmt([r['blind'] for r in runs])} |")
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "toy_vision.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(saved, "w") as f:
        json.dump(table, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
