#!/usr/bin/env bash
# DPO on TL;DR preference pairs (trl-lib/tldr-preference), starting from the same SFT checkpoint, with dpo.py's
# defaults (the real-scale values in its Args: beta 0.1, lr 1e-6, 8 pairs x 8 accumulation steps per GPU,
# one epoch). Huang et al. 2024 report DPO next to PPO in their scaling figure (GPT-3.5 judge); no
# GPT-4o-mini-judged number is published in the TRL docs for this setting.
# trl-lib/tldr-preference has train and validation splits only (no test): held-out pairs come from validation.
#   SIZE=1b NUM_GPUS=8 bash benchmark/tldr/dpo.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
RUN=$OUT/dpo_pythia-${SIZE}_seed$SEED
"${LAUNCH[@]}" dpo.py --model "$MODEL" --bf16 --seed "$SEED" --output_dir "$RUN" \
  --dataset tldr --eval_split validation --num_train_epochs 1 --response_length 53
evaluate "$RUN"
published
