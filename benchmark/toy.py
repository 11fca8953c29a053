"""Toy-task benchmark: every algorithm x several seeds at a fixed budget, one uniform evaluation, one table.

    python benchmark/toy.py                       # every algorithm and variant x seeds 1 2 3, ~15 min
    python benchmark/toy.py --algos rloo dpo --seeds 1 --max_steps 2 --num_eval_prompts 32   # a smoke run

For each (algorithm, seed) it runs `python <algo>.py --output_dir RUNS/<algo>/seed<S> --seed S --save_steps N
[budget flags]` as a child process, alone (one at a time), and records the child's wall time and peak
resident memory (its own VmHWM, so only that child is counted). Each script uses its toy-tuned defaults;
the budget is those defaults (one pass over the toy data for DPO/KTO, the toy total_episodes for RL) unless
--max_steps caps it. Then every saved checkpoint and the final model are evaluated the same way
(benchmark/uniform_eval.py: greedy held-out gold score and reward-model score, sampled KL to the SFT
policy), written to RUNS/<algo>/seed<S>/bench_eval.json, summarised in RESULTS/toy.md (mean +- std over seeds)
and plotted (benchmark/plot.py). Finished runs are reused unless --force; checkpoints are deleted after
evaluation unless --keep_checkpoints.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402

# Variants: a script run with other flags, tabled as an algorithm of its own (its --exp_name is the variant's name).
# `-gold`: RL on the toy task's verifiable gold reward (--reward_funcs gold), no reward model: proxy reward model
# and verifier side by side.
# `grpo-<loss>`: grpo.py's other token aggregations (its default is dapo).
VARIANTS = {"rloo-gold": ("rloo", ["--reward_funcs", "gold"]), "ppo-gold": ("ppo", ["--reward_funcs", "gold"]),
            "grpo-gold": ("grpo", ["--reward_funcs", "gold"]), "grpo-grpo": ("grpo", ["--loss_type", "grpo"]),
            "grpo-bnpo": ("grpo", ["--loss_type", "bnpo"]), "grpo-dr_grpo": ("grpo", ["--loss_type", "dr_grpo"])}
ALGOS = ("rloo", "ppo", "grpo", "dpo", "kto", *VARIANTS)
# Checkpoint cadence (optimizer steps) of the uniform-evaluation curve: about 8 points over each default budget
# (rloo 128 steps of 64 episodes, ppo 60 updates of 64 episodes, dpo 82 steps of 32 pairs, kto 256 steps of 32
# examples on toy seed 0).
SAVE_STEPS = {"rloo": 16, "ppo": 8, "grpo": 16, "dpo": 10, "kto": 32}
# What one step consumes, for the table (read back from args.json after the run).
UNIT = {"rloo": "episodes", "ppo": "episodes", "grpo": "episodes", "dpo": "pairs", "kto": "examples"}


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    return env


def vm_hwm_mib(pid: int):
    """Peak resident set size (VmHWM) of a running process, MiB; None when /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def wait_measuring(proc, on_poll=None, interval: float = 0.05) -> tuple:
    """Wait for a child, polling every `interval` seconds (and calling `on_poll()` if given); returns (exit code,
    peak RSS MiB, cpu seconds). The peak is the child's own VmHWM, polled until it exits: rusage ru_maxrss is not
    used because a forked child inherits the parent's resident size as its starting maximum (the harness holds
    models of its own)."""
    peak = 0.0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        peak = max(peak, vm_hwm_mib(proc.pid) or 0.0)
        if on_poll is not None:
            on_poll()
        time.sleep(interval)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, peak or usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def run_child(cmd: list, log_path: str, threads: int) -> dict:
    """Run cmd to completion; returns wall time (s), peak RSS of that child (MiB) and the exit code."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(threads), stdout=log, stderr=subprocess.STDOUT)
        code, peak, cpu = wait_measuring(proc)
    return dict(wall_time_s=time.perf_counter() - start, peak_rss_mib=peak, returncode=code, cpu_time_s=cpu)


def final_step(run_dir: str) -> int:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return max(json.loads(line)["step"] for line in f if line.strip())


def evaluate_run(evaluator, run_dir: str, sft: dict, keep_checkpoints: bool) -> list:
    """Uniform-eval points of a finished run: step 0 (SFT), every checkpoint-N, and the final model."""
    points = [dict(step=0, **sft)]
    checkpoints = sorted((d for d in os.listdir(run_dir) if d.startswith("checkpoint-") and d[11:].isdigit()),
                         key=lambda d: int(d[11:]))
    last = final_step(run_dir)
    for d in checkpoints:
        if int(d[11:]) < last:
            try:
                points.append(dict(step=int(d[11:]), **evaluator.evaluate_path(os.path.join(run_dir, d))))
            except (KeyError, FileNotFoundError) as e:  # an unloadable checkpoint costs a point, not the run
                print(f"  skipped {d}: {e}", flush=True)
        if not keep_checkpoints:
            shutil.rmtree(os.path.join(run_dir, d), ignore_errors=True)
    points.append(dict(step=last, **evaluator.evaluate_path(os.path.join(run_dir, "model"))))
    return points


def fmt(values, digits=3) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{np.mean(values):.{digits}f} +- {np.std(values):.{digits}f}"


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}, torch {torch.__version__}, "
            f"{platform.system()} {platform.release()}")


def write_table(results: dict, sft: dict, out_path: str, budget_note: str, threads: int, argv: list,
                load: str = "") -> None:
    lines = [
        "# Toy-task benchmark",
        "",
        f"Written by `python benchmark/{' '.join(['toy.py', *argv])}` on {datetime.date.today().isoformat()}.",
        f"Machine: {machine()}; each run alone, {threads} threads{load}.",
        "",
        f"Held-out evaluation, the same for every algorithm (`benchmark/uniform_eval.py`): {sft['num_prompts']} "
        "held-out toy prompts, "
        "greedy completions scored by the gold scorer and by the toy reward model; KL = sequence KL(pi || SFT), "
        "estimated from 4 completions per prompt sampled at temperature 1 (k1 estimator, fixed seed). "
        f"Before = the SFT policy (the same model for every seed, so its std is 0): gold {sft['gold_score']:.3f}, "
        f"RM score {sft['rm_score']:.3f}. Wall time and peak memory (peak resident set size of the training "
        "process, its VmHWM) cover the whole script: loading, training, its own evaluations and saving.",
        "",
        f"Budget: {budget_note}",
        "",
        "| algorithm | seeds | budget | gold before | gold after | RM score before | RM score after | KL to SFT after | "
        "wall time (s) | peak memory (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for algo, runs in results.items():
        finals = [r["final"] for r in runs]
        budget = sorted({r["budget"] for r in runs})
        lines.append(
            f"| {algo} | {len(runs)} | {'; '.join(budget)} | {sft['gold_score']:.3f} | "
            f"{fmt([f['gold_score'] for f in finals])} | {sft['rm_score']:.3f} | {fmt([f['rm_score'] for f in finals])} | "
            f"{fmt([f['kl'] for f in finals])} | {fmt([r['wall_time_s'] for r in runs], 0)} | "
            f"{fmt([r['peak_rss_mib'] for r in runs], 0)} |")
    lines += ["", "Per run (the script's own last `eval/gold_score` shown for comparison with the uniform one):", "",
              "| algorithm | seed | steps | gold | RM score | KL | EOS rate | script's eval/gold_score | wall (s) | "
              "peak MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for algo, runs in results.items():
        for r in runs:
            f = r["final"]
            own = r.get("script_gold")
            lines.append(f"| {algo} | {r['seed']} | {r['steps']} | {f['gold_score']:.3f} | {f['rm_score']:.3f} | "
                         f"{f['kl']:.3f} | {f['eos_rate']:.2f} | {'n/a' if own is None else f'{own:.3f}'} | "
                         f"{r['wall_time_s']:.0f} | {r['peak_rss_mib']:.0f} |")
    lines += ["", "Figures (`python benchmark/plot.py <runs dir>`):", "",
              "![gold and reward-model score against samples seen](toy_curves.png)", "",
              "![gold score against KL](toy_frontier.png)", ""]
    with open(out_path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--runs_dir", default=os.path.join(HERE, "runs", "toy"), help="where the runs go")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="where toy.md and the PNGs go")
    parser.add_argument("--max_steps", type=int, default=None, help="cap every run at this many optimizer steps")
    parser.add_argument("--save_steps", type=int, default=None,
                        help="checkpoint (= uniform-eval point) cadence; default per algorithm, about 8 per run")
    parser.add_argument("--num_eval_prompts", type=int, default=256, help="held-out prompts of the uniform evaluation")
    parser.add_argument("--script_eval_prompts", type=int, default=None,
                        help="--num_eval_prompts passed to the scripts (their own evaluation); default theirs")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of each training process")
    parser.add_argument("--force", action="store_true", help="rerun runs that already finished")
    parser.add_argument("--keep_checkpoints", action="store_true")
    parser.add_argument("--extra", action="append", default=[], metavar="ALGO:FLAGS",
                        help="extra flags for one algorithm, e.g. --extra 'rloo:--kl_coef 0.05' (repeatable)")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = {}
    for item in args.extra:
        algo, _, flags = item.partition(":")
        extra.setdefault(algo, []).extend(flags.split())

    from uniform_eval import ToyEvaluator

    import plot

    os.makedirs(args.out, exist_ok=True)
    evaluator = ToyEvaluator(num_prompts=args.num_eval_prompts)
    sft = evaluator.evaluate_sft()
    results, t0, load0 = {}, time.time(), os.getloadavg()[0]
    for algo in args.algos:
        results[algo] = []
        for seed in args.seeds:
            run_dir = os.path.join(args.runs_dir, algo, f"seed{seed}")
            record_path = os.path.join(run_dir, "bench_eval.json")
            if os.path.exists(record_path) and not args.force:
                with open(record_path) as f:
                    record = json.load(f)
                if record.get("num_eval_prompts") == args.num_eval_prompts:
                    print(f"[toy] {algo} seed {seed}: reusing {run_dir}", flush=True)
                    results[algo].append(record)
                    continue
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(os.path.dirname(run_dir), exist_ok=True)
            script, variant_flags = VARIANTS.get(algo, (algo, []))
            cmd = [sys.executable, os.path.join(ROOT, f"{script}.py"), "--output_dir", run_dir, "--seed", str(seed),
                   "--save_steps", str(args.save_steps or SAVE_STEPS[script])]
            if algo in VARIANTS:
                cmd += ["--exp_name", algo, *variant_flags]
            if args.max_steps:
                cmd += ["--max_steps", str(args.max_steps)]
            if args.script_eval_prompts:
                cmd += ["--num_eval_prompts", str(args.script_eval_prompts)]
            cmd += extra.get(algo, [])
            print(f"[toy] {algo} seed {seed}: {' '.join(cmd[1:])}", flush=True)
            usage = run_child(cmd, os.path.join(args.runs_dir, algo, f"seed{seed}.log"), args.threads)
            if usage["returncode"] != 0:
                raise SystemExit(f"{algo} seed {seed} failed (exit {usage['returncode']}); see "
                                 f"{os.path.join(args.runs_dir, algo, f'seed{seed}.log')}")
            with open(os.path.join(run_dir, "args.json")) as f:
                run_args = json.load(f)
            points = evaluate_run(evaluator, run_dir, sft, args.keep_checkpoints)
            steps = points[-1]["step"]
            per_step = run_args["per_device_train_batch_size"] * run_args.get("gradient_accumulation_steps", 1)
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            if script in ("rloo", "ppo", "grpo"):
                episodes = max((r.get("episode", 0) for r in rows), default=0)
                budget = f"{steps} steps, {int(episodes)} {UNIT[script]}"
            else:
                budget = f"{steps} steps x {per_step} {UNIT[script]}"
            gold_rows = [r["eval/gold_score"] for r in rows if "eval/gold_score" in r]
            record = dict(algo=algo, seed=seed, command=" ".join(cmd[1:]), steps=steps, budget=budget,
                          num_eval_prompts=args.num_eval_prompts, points=points, final=points[-1], sft=sft,
                          script_gold=gold_rows[-1] if gold_rows else None, **usage)
            with open(record_path, "w") as f:
                json.dump(record, f, indent=2)
            print(f"[toy] {algo} seed {seed}: {usage['wall_time_s']:.0f}s, peak {usage['peak_rss_mib']:.0f} MiB, gold "
                  f"{sft['gold_score']:.3f} -> {points[-1]['gold_score']:.3f}, KL {points[-1]['kl']:.3f}", flush=True)
            results[algo].append(record)
    budget_note = ("each script's toy-tuned defaults (`ALIAS_DEFAULTS['toy']` in the script: the RL scripts' "
                   "`total_episodes`, one epoch of the toy preference / unpaired data for DPO / KTO)"
                   + (f", capped at --max_steps {args.max_steps}" if args.max_steps else "")
                   + "; checkpoints for the curves every " +
                   ", ".join(f"{a} {args.save_steps or SAVE_STEPS[VARIANTS.get(a, (a,))[0]]}" for a in args.algos)
                   + " steps." + "".join(f" {name}: {script}.py {' '.join(flags)}." for name, (script, flags)
                                         in VARIANTS.items() if name in args.algos)
                   + (f" Extra flags: {extra}." if extra else ""))
    table = os.path.join(args.out, "toy.md")
    load = (f"; 1-min load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (other work on the "
            f"machine slows runs); whole benchmark {time.time() - t0:.0f} s")
    write_table(results, sft, table, budget_note, args.threads, argv, load)
    figures = plot.make_plots(args.runs_dir, args.out, "toy")
    print(f"[toy] done in {time.time() - t0:.0f}s: {table}, {', '.join(figures)}", flush=True)
    return table, figures


if __name__ == "__main__":
    main()
