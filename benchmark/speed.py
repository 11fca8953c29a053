"""Speed and memory benchmark: seconds per training step and peak memory of each algorithm script, next to TRL on
the identical setting (when installed), and micro-benchmarks of the shared helpers against plain code.

    python benchmark/speed.py                    # ours (rloo ppo dpo kto grpo distill) + baselines + TRL if installed
    python benchmark/speed.py --no_trl --steps 5 --rounds 1   # quicker: ours and the baselines only
    python benchmark/speed.py --setting tldr --algos rloo dpo kto grpo --no_baselines --steps 4 --warmup 1 \
        --out benchmark/results/speed_tldr.md    # TL;DR shapes (400-token prompts) on random-weight stand-ins
    pip install --no-deps -r benchmark/requirements-bench.txt   # TRL, benchmark-only (never imported by the scripts)

Every measurement is a child process of its own, run alone, so that its peak memory (the child's VmHWM, polled
from /proc) is that measurement's only:
  ours       the unmodified script, `python <algo>.py ... --max_steps warmup+steps+1 --eval_steps 0`. Nothing in it
             is wrapped: this process watches its metrics.jsonl and a step ends when the step's first row appears.
             Seconds per step = (end of step warmup+steps - end of step warmup) / steps; the extra last step is
             not timed (the final evaluation and saving come with it).
  trl        benchmark/speed_trl.py: TRL's trainer on the same model, data and hyper-parameters; a step ends at
             its `on_step_end` callback (GRPO: a step is one generated batch and its num_iterations optimizer
             steps, as grpo.py counts steps; 1 in both settings).
  baselines  benchmark/speed_baselines.py: generation, shared prompts and log-probs against plain code, timed
             around the calls.
  floor      (--floor) benchmark/floor.py: the model calls one step of ours makes, timed bare at the same shapes;
             run in the same rounds as ours and TRL, so floor / TRL is paired as ours / TRL is (rloo grpo dpo kto).
Step times on a shared machine move by 20-30% from run to run, so every training measurement runs --rounds times,
ours and TRL alternating; the run with the median step time is reported, with the range of the paired
(back-to-back) ratios. Results: benchmark/results/speed.md (and speed.json); speed_tldr.md for --setting tldr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from speed_settings import BASELINES, SETTING_TEXT, TRL_ALGOS, ours_flags, seconds_per_step, setting_paths  # noqa: E402
from toy import child_env, wait_measuring  # noqa: E402  (child environment and peak memory, as the toy harness)

ALGOS = ("rloo", "ppo", "dpo", "kto", "grpo", "distill")
# our step time / TRL's, at most, by setting (issues 20 and 31; peak memory at most TRL's in every cell)
TARGET = {"toy": {"rloo": 0.65, "grpo": 0.65, "dpo": 0.75, "kto": 0.75, "distill": 0.6},
          "tldr": {"rloo": 0.27, "grpo": 0.30, "dpo": 0.38, "kto": 0.50, "distill": 0.6}}
LOAD0 = os.getloadavg()[0]


# ---------------------------------------------------------------------------------------------------------
# Measurements (each a child process, one at a time)
# ---------------------------------------------------------------------------------------------------------
def run_measured(cmd: list, threads: int, watch: str | None = None) -> dict:
    """Run `cmd` alone. Returns its exit code, wall seconds, peak RSS (MiB) and, when `watch` names a
    metrics.jsonl, `step_ends` {step: perf_counter time its first row appeared}, the file polled every 5 ms."""
    step_ends, offset = {}, 0

    def read_new_rows():
        nonlocal offset
        if watch is None or not os.path.exists(watch) or os.path.getsize(watch) == offset:
            return
        now = time.perf_counter()
        with open(watch) as f:
            f.seek(offset)
            text = f.read()
        complete = text[:text.rfind("\n") + 1]  # a row being written is read on the next poll
        offset += len(complete.encode())
        for line in complete.splitlines():
            step_ends.setdefault(json.loads(line)["step"], now)

    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(threads), stdout=log, stderr=subprocess.STDOUT)
        code, peak, _ = wait_measuring(proc, on_poll=read_new_rows, interval=0.005 if watch else 0.05)
        log.seek(0)
        tail = log.read()[-3000:]
    read_new_rows()
    if code != 0:
        print(f"[speed] {os.path.basename(cmd[1])} failed (exit {code}):\n{tail}", file=sys.stderr, flush=True)
    return dict(peak_rss_mib=peak, wall_s=time.perf_counter() - start, step_ends=step_ends,
                error=f"exit {code}: " + (tail.strip().splitlines() or ["?"])[-1][:300] if code else None)


def measure_ours(algo: str, args, extra: tuple = ()) -> dict:
    """The real `<algo>.py`, unmodified, for warmup + steps + 1 optimizer steps (`extra`: more flags)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        cmd = [sys.executable, os.path.join(ROOT, f"{algo}.py"), "--output_dir", run_dir, "--seed", "1",
               "--max_steps", str(args.warmup + args.steps + 1), "--eval_steps", "0",
               *ours_flags(args.setting, algo, setting_paths(args.setting)), *extra]
        run = run_measured(cmd, args.threads, watch=os.path.join(run_dir, "metrics.jsonl"))
    try:
        step = None if run["error"] else seconds_per_step(run["step_ends"], args.warmup, args.steps)
    except RuntimeError as e:  # the run ended early (a short dataset): no end time for the last measured step
        run["error"] = str(e)
    if run["error"]:
        return {"error": run["error"]}
    return dict(step=step, steps_measured=args.steps, peak_rss_mib=run["peak_rss_mib"], wall_s=run["wall_s"],
                command=" ".join(cmd[1:]))


def measure_child(script: str, *script_args: str, threads: int) -> dict:
    """A benchmark child (speed_trl.py, speed_baselines.py) that writes its result as JSON to --out."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        run = run_measured([sys.executable, os.path.join(HERE, script), *script_args, "--out", out], threads)
        if run["error"]:
            return {"error": run["error"]}
        with open(out) as f:
            return dict(json.load(f), peak_rss_mib=run["peak_rss_mib"], wall_s=run["wall_s"])


def measure(kind: str, args) -> dict:
    """kind: ours:ALGO, trl:ALGO or a baseline (see BASELINES)."""
    if kind.startswith("ours:"):
        result = measure_ours(kind[5:], args)
    elif kind.startswith("floor:"):
        result = measure_child("floor.py", "--setting", args.setting, "--algos", kind[6:], threads=args.threads)
        if "error" not in result:
            result = dict(result[args.setting][kind[6:]], wall_s=result["wall_s"])
    elif kind.startswith("trl:"):
        result = measure_child("speed_trl.py", kind[4:], "--setting", args.setting, "--steps", str(args.steps),
                               "--warmup", str(args.warmup), threads=args.threads)
    else:
        result = measure_child("speed_baselines.py", kind, "--repeats", str(args.repeats), threads=args.threads)
    print(f"[speed] {kind}: {json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, list))})}",
          flush=True)
    return result


def median_run(runs: list) -> dict:
    """The run with the median step time (failed runs dropped), with every run's step time and, as
    `round_steps`, the step times in round order (None for a failed run) for paired ratios."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["step"])
    if not ok:
        return runs[-1]
    return dict(ok[(len(ok) - 1) // 2], round_steps=[r.get("step") for r in runs])


def paired_ratios(ours: dict, theirs: dict) -> list:
    """ours / TRL step time per round (the two ran back to back)."""
    pairs = zip(ours.get("round_steps", [ours["step"]]), theirs.get("round_steps", [theirs["step"]]))
    return [a / b for a, b in pairs if a and b]


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------
def _version(name: str):
    """The installed version of a package, or None."""
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def machine() -> str:
    import torch

    cpu = platform.machine()
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 2**20
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} logical CPUs, {mem:.0f} GiB RAM, {gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, transformers {_version('transformers')}, accelerate {_version('accelerate')}; "
            f"{platform.system()} {platform.release()}")


def ms(x) -> str:
    return "n/a" if x is None else f"{1000 * x:.1f}"


def ratio(a, b) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def step_lines(results: dict, args, trl_version) -> list:
    lines = ["## Milliseconds per training step", "",
             "| algorithm | implementation | step (ms) | peak memory (MiB) |", "| --- | --- | --- | --- |"]
    for algo in args.algos:
        for impl in ("ours", "trl", "floor"):
            r = results.get(f"{impl}:{algo}")
            if r is None:
                continue
            name = {"ours": "ours", "floor": "floor: ours' model calls, bare"}.get(
                impl, f"TRL {r.get('trl_version', '')}".strip())
            if "error" in r:
                lines.append(f"| {algo} | {name} | failed: {r['error']} | |")
            elif impl == "floor":  # its passes instead of a peak memory (timed in one process, not alone)
                passes = ", ".join(f"{k} {ms(v)}" for k, v in r["passes"].items())
                lines.append(f"| {algo} | {name} | {ms(r['step'])} ({passes}) | - |")
            else:
                lines.append(f"| {algo} | {name} | {ms(r['step'])} | {r['peak_rss_mib']:.0f} |")
    lines.append("")
    if trl_version is None or args.no_trl:
        return lines + ["TRL comparison skipped: " + ("`--no_trl` given." if args.no_trl else "trl is not installed "
                        "(`pip install --no-deps -r benchmark/requirements-bench.txt`)."), ""]
    floor_cols = args.floor and any(f"floor:{algo}" in results for algo in args.algos)
    lines += ["## Ours over TRL (same run)", "",
              "| algorithm | step time ratio | range over rounds | target | peak memory ratio | target met |"
              + (" floor / TRL | range over rounds |" if floor_cols else ""),
              "| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if floor_cols else "")]
    for algo in args.algos:
        ours, theirs = results.get(f"ours:{algo}"), results.get(f"trl:{algo}")
        if algo not in TRL_ALGOS:
            lines.append(f"| {algo} | n/a | | | | TRL {trl_version} has no {algo.upper()} trainer |")
        elif not ours or not theirs or "error" in ours or "error" in theirs:
            lines.append(f"| {algo} | n/a | | | | a measurement failed (see above) |")
        else:
            rounds = paired_ratios(ours, theirs)
            spread = f"{min(rounds):.2f}-{max(rounds):.2f}x" if len(rounds) > 1 else "-"
            step_ratio, mem_ratio = ours["step"] / theirs["step"], ours["peak_rss_mib"] / theirs["peak_rss_mib"]
            target = TARGET[args.setting].get(algo)
            met = "no target set" if target is None else "yes" if step_ratio <= target and mem_ratio <= 1.0 else "no"
            floor = results.get(f"floor:{algo}")
            floor_cells = ""
            if floor_cols and floor and "error" not in floor:
                floor_rounds = paired_ratios(floor, theirs)
                floor_cells = (f" {floor['step'] / theirs['step']:.2f}x | {min(floor_rounds):.2f}-"
                               f"{max(floor_rounds):.2f}x |")
            elif floor_cols:
                floor_cells = " n/a | |"
            lines.append(f"| {algo} | {step_ratio:.2f}x | {spread} | {'-' if target is None else f'<= {target}x'} | "
                         f"{mem_ratio:.2f}x | {met} |" + floor_cells)
    notes = [f"- {algo}: " + "; ".join(results[f"trl:{algo}"]["unmatched"])
             for algo in TRL_ALGOS if results.get(f"trl:{algo}", {}).get("unmatched")]
    return lines + ["", "Settings that could not be matched exactly:", *notes,
                    "- The LR schedule: ours decays to 0 over its --max_steps (warm-up + measured + the untimed last "
                    "step), TRL's over warm-up + measured steps; this changes learning rates, not step cost.",
                    "- TRL tokenizes text itself (prompt and completion tokenized separately, EOS appended); with the "
                    "word-level tokenizers used here this gives the same token ids.", ""]


def baseline_lines(results: dict) -> list:
    lines = ["## Baselines measured in the same run", ""] if any(k in results for k in BASELINES) else []
    gen = results.get("generation")
    if gen and "error" not in gen:
        b, n = gen["batch_generation"], gen["naive_loop"]
        lines += [f"Generation ({gen['batch']}):", "",
                  "| method | tokens / s | s per batch | speed-up |", "| --- | --- | --- | --- |",
                  f"| `pc.batch_generation` (one batched call) | {b['tokens_per_s']:.0f} | "
                  f"{b['seconds_per_batch']:.3f} | "
                  f"{b['tokens_per_s'] / n['tokens_per_s']:.1f}x |",
                  f"| naive per-example `model.generate` loop | {n['tokens_per_s']:.0f} | "
                  f"{n['seconds_per_batch']:.3f} | "
                  "1.0x |", ""]
    for shape in ("toy", "tldr"):
        share = results.get(f"sharing:{shape}")
        if share and "error" not in share:
            lines += [f"Shared prompts ({share['what']}; each distinct query encoded once, its cache reused; "
                      f"`worth_sharing` says {'yes' if share['worth_sharing'] else 'no'}):", "",
                      "| pass | SharedPromptForward (ms) | plain Forward (ms) | time ratio |",
                      "| --- | --- | --- | --- |"]
            lines += [f"| {name} | {1000 * t['shared']:.1f} | {1000 * t['plain']:.1f} | "
                      f"{t['shared'] / t['plain']:.2f}x |"
                      for name, t in share["passes"].items()] + [""]
    for shape in ("toy", "pythia"):
        sel, full = results.get(f"logprobs:selective:{shape}"), results.get(f"logprobs:full:{shape}")
        if sel and full and "error" not in sel and "error" not in full:
            lines += [f"Response log-probs, {sel['what']}:", "",
                      "| method | ms | peak extra memory (MiB) | time ratio | memory ratio |",
                      "| --- | --- | --- | --- | --- |",
                      f"| `pc.{'Forward.logprobs' if shape == 'toy' else 'selective_logprobs'}` (logsumexp in row "
                      f"chunks) | {1000 * sel['seconds']:.1f} | {sel['peak_extra_mib']:.0f} | "
                      f"{sel['seconds'] / full['seconds']:.2f}x | "
                      f"{ratio(sel['peak_extra_mib'], full['peak_extra_mib'])} |",
                      f"| plain full `log_softmax` + gather | {1000 * full['seconds']:.1f} | "
                      f"{full['peak_extra_mib']:.0f} | "
                      "1.00x | 1.00x |", ""]
    return lines


def write_report(results: dict, args, path: str, trl_version) -> None:
    lines = ["# Speed and memory benchmark", "",
             f"Written by `python benchmark/speed.py {' '.join(sys.argv[1:])}` on {datetime.date.today().isoformat()}.",
             f"Machine: {machine()}. Each measurement in its own process, one at a time, {args.threads} threads; "
             f"a run's step time is the mean over {args.steps} steps after {args.warmup} warm-up steps; every "
             f"training measurement ran {args.rounds} times, ours and TRL alternating"
             + (" (and the floor, benchmark/floor.py, after them in each round)" if args.floor else "")
             + ", and the run with the median step time is shown"
             + (" (floor / TRL: the medians' ratio, and each round's)" if args.floor else "")
             + f"; 1-min load average {LOAD0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end "
             "(other work on the machine inflates times).", "",
             SETTING_TEXT[args.setting] + " Peak memory = peak resident set size of the measuring process (whole "
             "process: Python, libraries, models, optimizer, activations).", "",
             *step_lines(results, args, trl_version), *baseline_lines(results)]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump({"machine": machine(), "argv": sys.argv[1:], "results": results}, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", choices=ALGOS,
                        help="default: all six (toy), rloo dpo kto grpo distill (tldr)")
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps per algorithm")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before measuring (at least 1)")
    parser.add_argument("--repeats", type=int, default=10, help="repeats of each baseline micro-benchmark")
    parser.add_argument("--setting", default="toy", choices=("toy", "tldr"),
                        help="toy: each script's toy defaults; tldr: TL;DR shapes on random-weight stand-ins "
                             "(rloo dpo kto grpo distill)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating runs of every step measurement (ours, TRL, ours, ...); "
                             "the median is reported")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of every measuring process")
    parser.add_argument("--no_trl", action="store_true", help="skip TRL even when it is installed")
    parser.add_argument("--floor", action="store_true",
                        help="also time the floor (benchmark/floor.py) in every round, after ours and TRL")
    parser.add_argument("--no_baselines", action="store_true",
                        help="skip the generation / sharing / log-prob baselines")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "speed.md"))
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup, --steps and --rounds must be >= 1")
    args.algos = args.algos or list(ALGOS if args.setting == "toy" else TRL_ALGOS)
    if args.setting == "tldr" and "ppo" in args.algos:
        parser.error(f"--setting tldr measures {' '.join(TRL_ALGOS)}")

    trl_version = None if args.no_trl else _version("trl")
    if not args.no_trl and trl_version is None:
        print("[speed] trl is not installed: TRL comparison skipped (pip install --no-deps -r "
              "benchmark/requirements-bench.txt)", flush=True)
    step_kinds = [f"{impl}:{algo}" for algo in args.algos for impl in ("ours", "trl", "floor")
                  if impl == "ours" or (impl == "trl" and trl_version and algo in TRL_ALGOS)
                  or (impl == "floor" and args.floor and algo in TRL_ALGOS)]
    runs = {kind: [] for kind in step_kinds}
    for _ in range(args.rounds):  # ours and TRL alternate, so slow spells of the machine hit both
        for kind in step_kinds:
            runs[kind].append(measure(kind, args))
    results = {kind: median_run(runs[kind]) for kind in step_kinds}
    for kind in () if args.no_baselines else BASELINES:
        results[kind] = measure(kind, args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_report(results, args, args.out, trl_version)
    print(f"[speed] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
