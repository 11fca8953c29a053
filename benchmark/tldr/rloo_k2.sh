#!/usr/bin/env bash
# RLOO, k=2, on TL;DR: the setting of TRL's published RLOO run (TRL docs, RLOO trainer, "Benchmark experiments":
# accelerate launch --config_file examples/accelerate_configs/deepspeed_zero2.yaml ... --num_ppo_epochs 2
# --num_mini_batches 2 --learning_rate 3e-6 --per_device_train_batch_size 16 --gradient_accumulation_steps 16
# --total_episodes 1000000 --local_rollout_forward_batch_size 16 --missing_eos_penalty 1.0 --kl_coef 0.03,
# rloo_k 2). Published win rate for Pythia 1B: 51.2% (SFT: 33.0%).
#   SIZE=1b NUM_GPUS=8 bash benchmark/tldr/rloo_k2.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
RUN=$OUT/rloo_k2_pythia-${SIZE}_seed$SEED
"${LAUNCH[@]}" rloo.py --model "$MODEL" --bf16 --seed "$SEED" --output_dir "$RUN" \
  --rloo_k 2 --num_ppo_epochs 2 --num_mini_batches 2 --learning_rate 3e-6 \
  --per_device_train_batch_size 16 --gradient_accumulation_steps 16 --total_episodes 1000000 \
  --local_rollout_forward_batch_size 16 --missing_eos_penalty 1.0 --kl_coef 0.03 \
  --response_length 53 --temperature 0.7
evaluate "$RUN"
published
