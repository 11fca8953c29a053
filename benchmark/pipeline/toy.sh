#!/usr/bin/env bash
# The whole pipeline on the toy task with local paths: sft.py -> reward.py -> rloo.py, each stage reading the
# previous stage's folder. About a minute per stage on 2 CPU cores.
#   bash benchmark/pipeline/toy.sh            # runs go to runs/pipeline (OUT=... to change)
# Models given as folders get no `toy` alias defaults, so the toy task's tuned values (each script's
# ALIAS_DEFAULTS["toy"]) are passed explicitly below.
set -euo pipefail
OUT=${OUT:-runs/pipeline}

# 1. SFT: the toy SFT policy fine-tuned on the toy world's own imperfect demonstrations (room left for RL)
python sft.py --model toy --dataset toy --toy_demonstrations imperfect --output_dir "$OUT/sft" "$@"

# 2. reward model: Bradley-Terry on the toy preference pairs, started from the new SFT policy; it records
#    reward_model_input=tokens in its config.json, which rloo.py follows
python reward.py --model "$OUT/sft/model" --dataset toy --output_dir "$OUT/reward" \
  --learning_rate 1e-3 --warmup_ratio 0.1 --per_device_train_batch_size 32 --gradient_accumulation_steps 1 \
  --per_device_eval_batch_size 64 --num_train_epochs 6 --eval_steps 100 --max_prompt_length 8 --max_length 18 \
  --max_eval_pairs 0

# 3. RL: RLOO from the new SFT policy against the new reward model
python rloo.py --model "$OUT/sft/model" --reward_model "$OUT/reward/model" --dataset toy --output_dir "$OUT/rloo" \
  --total_episodes 8192 --learning_rate 1e-4 --per_device_train_batch_size 64 --gradient_accumulation_steps 1 \
  --rloo_k 4 --kl_coef 0.2 --temperature 1.0 --response_length 8 --max_prompt_length 8 --eval_steps 16 \
  --num_eval_prompts 256 --missing_eos_penalty 1.0 --local_rollout_forward_batch_size 256
