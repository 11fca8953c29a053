#!/usr/bin/env bash
# SFT on TL;DR demonstrations, from the pretrained (not yet fine-tuned) Pythia base model: trl-lib/tldr (the
# `tldr` alias; columns prompt = the Reddit post formatted as "SUBREDDIT: ... TITLE: ... POST: ... TL;DR:",
# completion = the reference summary; EOS appended), with sft.py's defaults, the real-scale values in its Args after
# Huang et al. 2024 (https://arxiv.org/abs/2403.17031; summarize_from_feedback_details/sft.py + sbatches/sft.sbatch):
# lr 3e-6, one epoch, 128 examples per optimizer step (4 per GPU x 4 accumulation steps x 8 GPUs), AdamW eps 1e-5,
# weight decay 0.01. Differences from theirs: prompt tokens carry no loss, a linear instead of a cosine schedule.
#
# What to compare with: the released SFT checkpoints of that paper, cleanrl/EleutherAI_pythia-$SIZE-deduped__sft__tldr
# (the `pythia-$SIZE` alias, which every other script here starts from), judged by the same command:
#   python benchmark/judge.py --model pythia-$SIZE --num_examples 1000 --bf16 [--judge_base_url ...]
# (all.sh runs it as the SFT baseline). Published for 1B: 33.0% win rate against the reference summaries (TRL
# documentation, GPT-4o-mini judge; printed below). Huang et al. 2024 plot their SFT models' ROUGE and judged win
# rates per size in their figures (no table of numbers); their logged SFT loss also counts the query tokens, so it
# is not comparable with eval/loss here (completion tokens only).
#   SIZE=1b NUM_GPUS=8 bash benchmark/tldr/sft.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
BASE=EleutherAI/pythia-${SIZE}-deduped
RUN=$OUT/sft_pythia-${SIZE}_seed$SEED
"${LAUNCH[@]}" sft.py --model "$BASE" --bf16 --seed "$SEED" --output_dir "$RUN" \
  --dataset tldr --num_train_epochs 1 --learning_rate 3e-6 --response_length 53
evaluate "$RUN"
published
