#!/usr/bin/env bash
# KTO on TL;DR feedback: kto.py splits each trl-lib/tldr-preference pair into a desirable (chosen) and an
# undesirable (rejected) example; kto.py's real-scale defaults (beta 0.1, lr 5e-7, one epoch). No published
# TL;DR number is known to us for KTO with these checkpoints: compare with SFT (33.0%) and DPO.
# trl-lib/tldr-preference has train and validation splits only (no test): held-out pairs come from validation.
#   SIZE=1b NUM_GPUS=8 bash benchmark/tldr/kto.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
RUN=$OUT/kto_pythia-${SIZE}_seed$SEED
"${LAUNCH[@]}" kto.py --model "$MODEL" --bf16 --seed "$SEED" --output_dir "$RUN" \
  --dataset tldr --eval_split validation --num_train_epochs 1 --response_length 53
evaluate "$RUN"
published
