#!/usr/bin/env bash
# GRPO on GSM8K, Qwen2.5-0.5B-Instruct, one node of 8 GPUs (DeepSpeed ZeRO-2); the same run as grpo_1gpu.sh with the
# same global batch (see benchmark/gsm8k/README.md). Not run by this project yet.
#   bash benchmark/gsm8k/grpo_8gpu.sh [more grpo.py flags, e.g. --track]
#   OUT=runs/gsm8k   where the run goes
#
# Batch: 8 processes x 8 completions per micro-batch x 1 accumulated = 64 completions (8 prompts x 8 generations)
# per optimizer step, as on one GPU (8 x 8); 200k completions = 3125 steps. Evaluation: the 1319 test questions,
# greedy, before training, every 50 steps and after the last.
#
# Published GSM8K test accuracy (%) to compare with (verl docs/algo/baseline.md; verl reads only a "#### n" answer):
#   Qwen2.5-0.5B-Instruct as released   36.4 in verl's table (49.6 is also quoted; see the README)
#   GRPO with LoRA (rank 32)            54.3
#   PPO                                 56.7
# Never run on this project's CPU machines; checked with `bash -n` in tests/test_gsm8k_reward.py.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$REPO/runs/gsm8k}
cd "$REPO"

[[ -f data/gsm8k/dataset_dict.json ]] || python benchmark/gsm8k/prepare_data.py --out data/gsm8k
accelerate launch --config_file configs/deepspeed_zero2.yaml --num_processes 8 grpo.py \
  --model Qwen/Qwen2.5-0.5B-Instruct --dataset data/gsm8k \
  --reward_funcs benchmark/gsm8k/gsm8k_reward.py:gsm8k_accuracy --bf16 \
  --response_length 512 --num_generations 8 --learning_rate 1e-6 --beta 0.0 --loss_type dapo \
  --per_device_train_batch_size 8 --gradient_accumulation_steps 1 --total_episodes 200000 \
  --eval_steps 50 --num_eval_prompts 1319 --output_dir "$OUT/grpo_qwen2.5-0.5b-instruct_8gpu" "$@"
