#!/usr/bin/env bash
# RLOO, k=4, on TL;DR: the RLOO k=2 setting (rloo_k2.sh) with 4 completions per prompt; the number of
# completions per step stays 16 x 16 x 2 per GPU, so each step covers half as many prompts. No published
# number is known to us for k=4; compare with k=2 (51.2%) and SFT (33.0%) for Pythia 1B.
#   SIZE=1b NUM_GPUS=8 bash benchmark/tldr/rloo_k4.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
RUN=$OUT/rloo_k4_pythia-${SIZE}_seed$SEED
"${LAUNCH[@]}" rloo.py --model "$MODEL" --bf16 --seed "$SEED" --output_dir "$RUN" \
  --rloo_k 4 --num_ppo_epochs 2 --num_mini_batches 2 --learning_rate 3e-6 \
  --per_device_train_batch_size 16 --gradient_accumulation_steps 16 --total_episodes 1000000 \
  --local_rollout_forward_batch_size 16 --missing_eos_penalty 1.0 --kl_coef 0.03 \
  --response_length 53 --temperature 0.7
evaluate "$RUN"
published
