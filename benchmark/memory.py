"""Peak memory and step time at long completions (issue 33): rloo, grpo, dpo, sft and distill, ours with the output
layer in chunks (the default), ours with --logprob_chunk_tokens 0 (full logits), and TRL 1.16 at the same settings,
at completions of 512, 1,024 and 2,048 tokens, so that a reader sees how each grows with length.

    python benchmark/memory.py                  # everything (about 30 min on 2 CPU cores)
    python benchmark/memory.py --algos grpo --lengths 1024 --rounds 3

Setting (speed_settings.LONG): a random-weight GPT-NeoX of 2 layers and width 64 with Pythia's 50,304-word vocabulary
(so the output layer and what is computed from its logits dominate, as at long completions of any model), 32-token
prompts; GRPO 4 generations x 2 prompts, beta 0 (the issue's setting); RLOO k=4, 8 completions; DPO 2 pairs; SFT 8
examples; distillation 8 on-policy completions from a 2-layer, width-128 teacher; fp32, one optimizer step per step.
Each measurement is a child process of its own, run alone (benchmark/speed.py's measure_ours and speed_trl.py):
peak memory is the child's peak resident set size (VmHWM). At --timed_lengths (1,024) ours, ours unchunked and TRL
run --warmup steps and --steps timed ones (step time: their mean); at the other lengths ours and TRL run one step,
for peak memory only (every step has the same shapes, so the first reaches the peak).
Results: benchmark/results/memory.md and memory.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import speed  # noqa: E402
from speed_settings import LONG, ours_flags, setting_paths  # noqa: E402

ALGOS = ("grpo", "rloo", "dpo", "sft", "distill")
KINDS = ("ours", "unchunked", "trl")  # ours: the default (chunked); unchunked: --logprob_chunk_tokens 0
TARGET = dict(memory=0.5, slope=0.5, step=1.1, algos=("grpo", "rloo", "dpo"), at=1024)  # the "done when"


def measure(kind: str, algo: str, length: int, args) -> dict:
    """One run of `kind` (ours, unchunked, trl). At --timed_lengths: --warmup steps, then --steps timed ones; at the
    other lengths one step, peak memory only (no step time)."""
    timed = length in args.timed_lengths
    run = SimpleNamespace(setting=f"long{length}", warmup=args.warmup, steps=args.steps, threads=args.threads)
    extra = ("--logprob_chunk_tokens", "0") if kind == "unchunked" else ()
    if kind == "trl":
        result = speed.measure_child("speed_trl.py", algo, "--setting", run.setting,
                                     "--steps", str(args.steps if timed else 1),
                                     "--warmup", str(args.warmup if timed else 0), threads=args.threads)
    elif timed:
        result = speed.measure_ours(algo, run, extra)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, os.path.join(ROOT, f"{algo}.py"), "--output_dir", os.path.join(tmp, "run"),
                   "--seed", "1", "--max_steps", "1", "--eval_steps", "0",
                   *ours_flags(run.setting, algo, setting_paths(run.setting)), *extra]
            out = speed.run_measured(cmd, args.threads)
        result = {"error": out["error"]} if out["error"] else dict(step=None, peak_rss_mib=out["peak_rss_mib"],
                                                                   wall_s=out["wall_s"])
    print(f"[memory] {kind}:{algo}:{length}: "
          f"{json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, list))})}", flush=True)
    return result


def slope(results: dict, kind: str, algo: str, lengths: list):
    """Peak-memory growth, MiB per 1,000 completion tokens, between the shortest and longest length measured."""
    lo, hi = (results.get(f"{kind}:{algo}:{L}", {}) for L in (lengths[0], lengths[-1]))
    if len(lengths) < 2 or "peak_rss_mib" not in lo or "peak_rss_mib" not in hi:
        return None
    return (hi["peak_rss_mib"] - lo["peak_rss_mib"]) / ((lengths[-1] - lengths[0]) / 1000)


def report(results: dict, args) -> list:
    def cell(kind, algo, L, key, fmt):
        r = results.get(f"{kind}:{algo}:{L}")
        return "-" if r is None else "failed" if "error" in r else "-" if r.get(key) is None else fmt.format(r[key])

    def ratio(a, b, algo, L, key):
        ra, rb = (results.get(f"{k}:{algo}:{L}") for k in (a, b))
        ok = ra and rb and ra.get(key) is not None and rb.get(key) is not None
        return f"{ra[key] / rb[key]:.2f}x" if ok else "-"

    lines = ["# Memory at long completions", "",
             f"Written by `python benchmark/memory.py {' '.join(sys.argv[1:])}` "
             f"on {datetime.date.today().isoformat()}.",
             f"Machine: {speed.machine()}. Each measurement in its own process, one at a time, {args.threads} "
             f"threads; step time = the mean over {args.steps} step(s) after {args.warmup} warm-up step(s)"
             + (f", the median of {args.rounds} rounds" if args.rounds > 1 else "") + ".", "",
             f"Setting: a random-weight GPT-NeoX, {LONG['layers']} layers, width {LONG['width']}, vocabulary "
             f"{LONG['vocab']:,}; {LONG['prompt_tokens']}-token prompts; GRPO {LONG['grpo_generations']} generations "
             f"x {LONG['grpo_batch'] // LONG['grpo_generations']} prompts, beta 0; RLOO k={LONG['rloo_k']}, "
             f"{LONG['rloo_batch']} completions; DPO {LONG['dpo_batch']} pairs; SFT {LONG['sft_batch']} examples; "
             f"distillation {LONG['distill_batch']} on-policy completions from a {LONG['teacher_layers']}-layer, "
             f"width-{LONG['teacher_width']} teacher; fp32. RL and distillation sample their completions (a random "
             "model rarely stops early: about the full length); DPO and SFT completions are that long. Peak memory = "
             "peak resident set size of the process (Python, libraries, models, optimizer, activations). ours = the "
             "default (`--logprob_chunk_tokens` None: the output layer on 2**26 / 50,304 = 1,334 positions at a "
             "time); unchunked = `--logprob_chunk_tokens 0`.", "",
             "| algorithm | completion tokens | ours (MiB) | unchunked (MiB) | TRL (MiB) | ours / TRL | "
             "ours / unchunked | ours step (s) | unchunked step (s) | TRL step (s) | step ours / unchunked |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for algo in args.algos:
        for L in args.lengths:
            lines.append(f"| {algo} | {L:,} | " + " | ".join(cell(k, algo, L, "peak_rss_mib", "{:,.0f}") for k in KINDS)
                         + f" | {ratio('ours', 'trl', algo, L, 'peak_rss_mib')} | "
                         + f"{ratio('ours', 'unchunked', algo, L, 'peak_rss_mib')} | "
                         + " | ".join(cell(k, algo, L, "step", "{:.2f}") for k in KINDS)
                         + f" | {ratio('ours', 'unchunked', algo, L, 'step')} |")
    lines += ["", f"Growth of peak memory with completion length, {args.lengths[0]:,} to {args.lengths[-1]:,} tokens "
              "(MiB per 1,000 tokens):", "",
              "| algorithm | ours | TRL | ours / TRL |", "| --- | --- | --- | --- |"]
    for algo in args.algos:
        s = {k: slope(results, k, algo, args.lengths) for k in ("ours", "trl")}
        lines.append(f"| {algo} | " + " | ".join("n/a" if s[k] is None else f"{s[k]:,.0f}" for k in s) + " | "
                     + ("n/a" if s["ours"] is None or not s["trl"] else f"{s['ours'] / s['trl']:.2f}x") + " |")
    L = TARGET["at"]
    lines += ["", f"Targets (issue 33): at {L:,} tokens ours' peak memory <= {TARGET['memory']}x TRL's and its growth "
              f"<= {TARGET['slope']}x TRL's for {', '.join(TARGET['algos'])}; step time <= {TARGET['step']}x unchunked "
              "(every algorithm).", "", "| algorithm | memory / TRL | growth / TRL | step / unchunked | met |",
              "| --- | --- | --- | --- | --- |"]
    for algo in args.algos:
        r = {k: results.get(f"{k}:{algo}:{L}", {}) for k in KINDS}
        s = {k: slope(results, k, algo, args.lengths) for k in KINDS}
        both = lambda key, a, b: (r[a][key] / r[b][key]  # noqa: E731
                                  if r[a].get(key) is not None and r[b].get(key) is not None else None)
        mem, step = both("peak_rss_mib", "ours", "trl"), both("step", "ours", "unchunked")
        grow = s["ours"] / s["trl"] if s["ours"] is not None and s["trl"] else None
        checks = [step is not None and step <= TARGET["step"]]
        if algo in TARGET["algos"]:
            checks += [mem is not None and mem <= TARGET["memory"], grow is not None and grow <= TARGET["slope"]]
        fmt = lambda x: "n/a" if x is None else f"{x:.2f}x"  # noqa: E731
        lines.append(f"| {algo} | {fmt(mem)} | {fmt(grow)} | {fmt(step)} | {'yes' if all(checks) else 'no'} |")
    notes = sorted({n for k, r in results.items() if k.startswith("trl:") for n in r.get("unmatched", [])})
    return lines + ["", "Settings that could not be matched exactly (TRL):", *[f"- {n}" for n in notes], ""]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", choices=ALGOS, default=list(ALGOS))
    parser.add_argument("--lengths", nargs="+", type=int, choices=LONG["lengths"], default=list(LONG["lengths"]))
    parser.add_argument("--timed_lengths", nargs="+", type=int, default=[1024],
                        help="lengths with step times (ours, unchunked and TRL); "
                             "the others: peak memory of ours and TRL")
    parser.add_argument("--steps", type=int, default=1, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before measuring (at least 1)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every measurement; the median step is kept")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of every measuring process")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "memory.md"))
    parser.add_argument("--report_from", nargs="+", metavar="JSON",
                        help="measure nothing: the report from saved memory.json files (a later file's rows replace "
                             "an earlier's, e.g. one algorithm measured again after a fix)")
    args = parser.parse_args()
    args.lengths = sorted(args.lengths)
    if args.report_from:
        results = {}
        for path in args.report_from:
            with open(path) as f:
                results.update(json.load(f)["results"])
        write(results, args)
        return
    runs = {}
    for L in args.lengths:
        # the kinds alternate within a round, so slow spells of the machine hit all of them
        for _ in range(args.rounds if L in args.timed_lengths else 1):
            for algo in args.algos:
                for kind in KINDS if L in args.timed_lengths else ("ours", "trl"):
                    runs.setdefault(f"{kind}:{algo}:{L}", []).append(measure(kind, algo, L, args))
    write({key: speed.median_run(r) for key, r in runs.items()}, args)


def write(results: dict, args) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(report(results, args)))
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"machine": speed.machine(), "argv": sys.argv[1:], "results": results}, f, indent=2)
    print(f"[memory] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
