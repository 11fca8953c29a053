#!/usr/bin/env bash
# PPO on TL;DR: the setting of TRL's published PPO run (TRL docs, PPO trainer, "Benchmark experiments":
# --learning_rate 3e-6 --per_device_train_batch_size 16 --gradient_accumulation_steps 4 --total_episodes 1000000
# --local_rollout_forward_batch_size 16 --missing_eos_penalty 1.0, with the default 4 PPO epochs and
# kl_coef 0.05 of Huang et al. 2024). Published win rate for Pythia 1B: 64.7% (SFT: 33.0%); 2.8B / 6.9B: see
# the scaling figure of Huang et al. 2024 (zero3 config is picked for 6.9b).
#   SIZE=1b NUM_GPUS=8 bash benchmark/tldr/ppo.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
RUN=$OUT/ppo_pythia-${SIZE}_seed$SEED
"${LAUNCH[@]}" ppo.py --model "$MODEL" --bf16 --seed "$SEED" --output_dir "$RUN" \
  --learning_rate 3e-6 --per_device_train_batch_size 16 --gradient_accumulation_steps 4 \
  --total_episodes 1000000 --local_rollout_forward_batch_size 16 --missing_eos_penalty 1.0 \
  --num_ppo_epochs 4 --kl_coef 0.05 --response_length 53
evaluate "$RUN"
published
