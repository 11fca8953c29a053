"""The scripts' CUDA paths on one GPU, in a few minutes: every script for a few steps on the toy world in bfloat16
(and rloo.py in float32), plus the variants whose code differs on a device: a sampler running ahead (importance
weights of stale samples), the chunked output layer with reused batches, multi-turn tool episodes, a LoRA reference,
precomputed reference log-probs, fp16 with loss scaling and the float32 output layer (precision.py). Each run is a
child process, one at a time; the table says whether it finished, on which device, whether every logged number is
finite, and the held-out metric from step 0 to the last step. CI has no GPU: this is run by hand on a machine that
has one (benchmark/README.md). It runs on a CPU too (bfloat16 natively where the CPU has AVX512-BF16, float16
emulated), which checks the code paths but not the GPU's kernels.

The sampler-trainer mismatch on a GPU: `python benchmark/precision_mismatch.py --out DIR` there (vLLM's GPU build
installed) gives the table of benchmark/results/precision_mismatch.md for that GPU.

    python benchmark/gpu_smoke.py --out /tmp/gpu_smoke        # writes /tmp/gpu_smoke/gpu_smoke.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--max_steps", "2", "--eval_steps", "1", "--num_eval_prompts", "32", "--seed", "1"]
RUNS = {  # name -> (script, flags)
    "rloo_fp32": ("rloo.py", []),
    **{f"{script}_bf16": (f"{script}.py", ["--bf16"])
       for script in ("sft", "reward", "rloo", "ppo", "grpo", "dpo", "kto", "distill")},
    "rloo_async_bf16": ("rloo.py", ["--bf16", "--max_staleness", "1", "--max_steps", "3"]),
    "grpo_iter2_chunked_bf16": ("grpo.py", ["--bf16", "--num_iterations", "2", "--logprob_chunk_tokens", "4"]),
    "grpo_tools_bf16": ("grpo.py", ["--bf16", "--model", "toy_tools"]),
    "rloo_peft_bf16": ("rloo.py", ["--bf16", "--use_peft", "--lora_r", "4"]),
    "dpo_precomputed_bf16": ("dpo.py", ["--bf16", "--precompute_ref_logprobs"]),
    # precision.py: fp16 with loss scaling (ppo: a trained value model too), the float32 output layer on the paths
    # that apply it apart from the model (chunked, packed)
    **{f"{script}_fp16": (f"{script}.py", ["--fp16"]) for script in ("rloo", "ppo", "dpo")},
    "grpo_fp16_fp32head_chunked": ("grpo.py", ["--fp16", "--cast_lm_head_to_fp32", "--logprob_chunk_tokens", "4"]),
    "rloo_bf16_fp32head_packed": ("rloo.py", ["--bf16", "--cast_lm_head_to_fp32", "--padding_free"]),
}


def summary(name: str, folder: str, proc, seconds: float) -> str:
    """One table row: exit code, device, finite metrics, the held-out metric first -> last."""
    device = next((line.split("device ")[-1] for line in proc.stdout.splitlines() if line.startswith("[accelerate]")),
                  "?")
    rows = []
    if os.path.exists(os.path.join(folder, "metrics.jsonl")):
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    numbers = [v for row in rows for v in row.values() if isinstance(v, (int, float))]
    finite = all(math.isfinite(v) for v in numbers)
    key = "eval/accuracy" if name.startswith("reward") else "eval/gold_score"
    values = [row[key] for row in rows if key in row]
    metric = f"{values[0]:.3f} -> {values[-1]:.3f}" if values else "-"
    error = "" if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1][:100] if proc.stderr.strip() else ""
    return (f"| {name} | {proc.returncode} | {device} | {len(rows)} | {'yes' if finite else 'NO'} | {metric} | "
            f"{seconds:.0f} | {error} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_smoke"))
    parser.add_argument("--only", nargs="*", default=None, help="run these names only")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    lines = ["| run | exit | device | rows | finite | held-out metric | seconds | error |",
             "| --- | ---: | --- | ---: | --- | --- | ---: | --- |"]
    for name, (script, flags) in RUNS.items():
        if args.only and name not in args.only:
            continue
        folder = os.path.join(args.out, name)
        start = time.time()
        short = [{"--num_eval_prompts": "--max_eval_pairs"}.get(f, f) for f in SHORT] if script == "reward.py" \
            else SHORT  # reward.py evaluates on held-out pairs
        proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *short, *flags, "--output_dir", folder],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        with open(folder + ".log", "w") as f:
            f.write(proc.stdout + proc.stderr)
        lines.append(summary(name, folder, proc, time.time() - start))
        print(lines[-1], flush=True)
    with open(os.path.join(args.out, "gpu_smoke.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
