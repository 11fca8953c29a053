"""Turn runs' metrics.jsonl files into PNG figures.

    python benchmark/plot.py RUNS_DIR [--out benchmark/results]

RUNS_DIR is searched recursively for run folders (a folder holding metrics.jsonl). A run's algorithm is its
args.json `exp_name` (else the parent folder's name), its seed args.json `seed`. Runs of one algorithm are
averaged over seeds (line: mean, band: +- one std).

Writes:
  toy_curves.png    gold score and reward-model score of held-out greedy completions against training
                    samples seen, all algorithms on one figure
  toy_frontier.png  gold score against KL to the reference: the over-optimisation frontier

Data source, per run: if the run folder holds bench_eval.json (written by benchmark/toy.py: one uniform
evaluation of every saved checkpoint, see benchmark/uniform_eval.py) its points are used, so that all
algorithms are measured the same way; otherwise the run's own eval/gold_score, eval/scores and eval/kl rows.
The x-axis counts samples: episodes (sampled completions) for RL scripts (`episode` in metrics.jsonl); for
offline scripts step x batch size from args.json: preference pairs (DPO) or labelled examples (KTO).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import numpy as np

OFFLINE_UNIT = {"dpo": "pairs", "kto": "examples"}
COLORS = {"sft": "gold", "distill": "lime", "rloo": "tab:blue", "ppo": "tab:orange", "grpo": "tab:cyan",
          "dpo": "tab:green", "kto": "tab:red", "rloo-gold": "tab:purple", "ppo-gold": "tab:brown",
          "grpo-gold": "tab:olive", "grpo-grpo": "tab:gray", "grpo-bnpo": "tab:pink", "grpo-dr_grpo": "black"}


def find_runs(root: str) -> list:
    runs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("model",) and not d.startswith("checkpoint"))
        if "metrics.jsonl" in filenames:
            runs.append(dirpath)
    return sorted(runs)


def read_jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_run(path: str) -> dict:
    """{algo, seed, rows, args, bench} of one run folder."""
    args = {}
    if os.path.exists(os.path.join(path, "args.json")):
        with open(os.path.join(path, "args.json")) as f:
            args = json.load(f)
    bench = None
    if os.path.exists(os.path.join(path, "bench_eval.json")):
        with open(os.path.join(path, "bench_eval.json")) as f:
            bench = json.load(f)
    algo = args.get("exp_name") or os.path.basename(os.path.dirname(path.rstrip("/")))
    return dict(path=path, algo=algo, seed=args.get("seed"), args=args,
                rows=read_jsonl(os.path.join(path, "metrics.jsonl")), bench=bench)


def samples_per_step(run: dict):
    """Samples one optimizer step consumes for an offline script (None for RL scripts, which log `episode`)."""
    a = run["args"]
    if "per_device_train_batch_size" not in a:
        return None
    return a["per_device_train_batch_size"] * a.get("gradient_accumulation_steps", 1) * a.get("num_processes", 1)


def step_to_samples(run: dict):
    """A function step -> samples seen."""
    episodes = {r["step"]: r["episode"] for r in run["rows"] if "episode" in r}
    if episodes:
        known = sorted(episodes.items())
        per_step = next((e / s for s, e in known if s > 0), 0.0)
        return lambda step: episodes.get(step, step * per_step)
    per_step = samples_per_step(run) or 1
    return lambda step: step * per_step


def run_points(run: dict) -> dict:
    """{"x": [...], "gold": [...], "rm": [...], "kl": [...], "source": str} sorted by step (NaN where missing)."""
    to_x = step_to_samples(run)
    if run["bench"] and run["bench"].get("points"):
        pts = sorted(run["bench"]["points"], key=lambda p: p["step"])
        return dict(x=[to_x(p["step"]) for p in pts], gold=[p["gold_score"] for p in pts],
                    rm=[p["rm_score"] for p in pts], kl=[p["kl"] for p in pts], source="uniform")
    rows = sorted((r for r in run["rows"] if "eval/gold_score" in r or "eval/scores" in r), key=lambda r: r["step"])
    return dict(x=[to_x(r["step"]) for r in rows], gold=[r.get("eval/gold_score", np.nan) for r in rows],
                rm=[r.get("eval/scores", np.nan) for r in rows], kl=[r.get("eval/kl", np.nan) for r in rows],
                source="metrics")


def mean_std(curves: list):
    """Curves (x, y) of several seeds -> (x, mean, std) on the union of x (each seed interpolated)."""
    xs = np.unique(np.concatenate([np.asarray(x, float) for x, _ in curves]))
    ys = []
    for x, y in curves:
        x, y = np.asarray(x, float), np.asarray(y, float)
        ok = ~np.isnan(y)
        if ok.sum() == 0:
            continue
        ys.append(np.interp(xs, x[ok], y[ok], left=np.nan, right=np.nan) if ok.sum() > 1 else
                  np.where(xs == x[ok][0], y[ok][0], np.nan))
    if not ys:
        return xs, np.full_like(xs, np.nan), np.zeros_like(xs)
    ys = np.asarray(ys)
    with np.errstate(all="ignore"), __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore")
        return xs, np.nanmean(ys, 0), np.nan_to_num(np.nanstd(ys, 0))


def group(runs: list) -> dict:
    by_algo = defaultdict(list)
    for run in runs:
        by_algo[run["algo"]].append(run)
    order = [a for a in COLORS if a in by_algo] + sorted(a for a in by_algo if a not in COLORS)
    return {a: by_algo[a] for a in order}


def plot_curves(by_algo: dict, path: str, title: str = "toy task") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    sources = set()
    for algo, runs in by_algo.items():
        points = [run_points(r) for r in runs]
        sources |= {p["source"] for p in points}
        unit = OFFLINE_UNIT.get(algo, "episodes")
        for ax, key in zip(axes, ("gold", "rm")):
            curves = [(p["x"], p[key]) for p in points
                      if len(p["x"]) and not np.all(np.isnan(np.asarray(p[key], float)))]
            if not curves:
                continue
            x, mean, std = mean_std(curves)
            ok = ~np.isnan(mean)
            label = f"{algo} (x = {unit}, n={len(curves)})"
            ax.plot(x[ok], mean[ok], marker="o", ms=3, color=COLORS.get(algo), label=label)
            ax.fill_between(x[ok], (mean - std)[ok], (mean + std)[ok], color=COLORS.get(algo), alpha=0.2)
    axes[0].set_ylabel("gold score of greedy completions (held-out)")
    axes[1].set_ylabel("reward-model score of greedy completions (held-out)")
    for ax in axes:
        ax.set_xlabel("samples seen: episodes (RL) / pairs (DPO) / examples (KTO)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    src = "uniform evaluation (benchmark/uniform_eval.py)" if sources == {"uniform"} else "runs' own eval metrics"
    fig.suptitle(f"{title}: mean +- std over seeds; {src}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(by_algo: dict, path: str, title: str = "toy task") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    sources = set()
    for algo, runs in by_algo.items():
        first = True
        for run in runs:
            p = run_points(run)
            sources.add(p["source"])
            kl, gold = np.asarray(p["kl"], float), np.asarray(p["gold"], float)
            ok = ~np.isnan(kl) & ~np.isnan(gold)
            if not ok.any():
                continue
            ax.plot(kl[ok], gold[ok], "-", color=COLORS.get(algo), alpha=0.35, lw=1)
            ax.scatter(kl[ok][:-1], gold[ok][:-1], s=10, color=COLORS.get(algo), alpha=0.5)
            ax.scatter(kl[ok][-1:], gold[ok][-1:], s=60, marker="*", color=COLORS.get(algo),
                       label=f"{algo} (star: end of run)" if first else None)
            first = False
    kl_name = ("sequence KL to the SFT policy, sampled at T=1 (uniform eval)" if sources == {"uniform"}
               else "KL to the reference (runs' eval/kl)")
    ax.set_xlabel(kl_name, fontsize=9)
    ax.set_ylabel("gold score of greedy completions (held-out)")
    ax.set_title(f"{title}: gold score against KL (each line one seed)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_plots(runs_dir: str, out_dir: str, prefix: str = "toy") -> list:
    runs = [run for run in map(load_run, find_runs(runs_dir)) if run_points(run)["x"]]  # reward.py's: no curve
    if not runs:
        raise SystemExit(f"no run folders (with metrics.jsonl) under {runs_dir!r}")
    os.makedirs(out_dir, exist_ok=True)
    by_algo = group(runs)
    paths = [os.path.join(out_dir, f"{prefix}_curves.png"), os.path.join(out_dir, f"{prefix}_frontier.png")]
    title = "toy task" if prefix == "toy" else prefix  # toy_hard, toy_tools: the setting's name
    plot_curves(by_algo, paths[0], title)
    plot_frontier(by_algo, paths[1], title)
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_dir", help="folder searched recursively for run folders holding metrics.jsonl")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="where the PNGs go")
    parser.add_argument("--prefix", default="toy", help="file name prefix of the figures")
    args = parser.parse_args()
    for p in make_plots(args.runs_dir, args.out, args.prefix):
        print(p)


if __name__ == "__main__":
    main()
