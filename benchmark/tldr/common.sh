#!/usr/bin/env bash
# Shared settings of the TL;DR reproduction scripts (sourced by them; not run directly).
#
#   SIZE=1b|2.8b|6.9b    Pythia size (default 1b): --model pythia-$SIZE = cleanrl/EleutherAI_pythia-$SIZE-deduped__sft__tldr,
#                        its reward model cleanrl/EleutherAI_pythia-$SIZE-deduped__reward__tldr, data trl-lib/tldr
#                        (prompts) and trl-lib/tldr-preference (pairs; unpaired automatically for KTO)
#   NUM_GPUS=8           processes (one per GPU); the published runs used one node of 8 GPUs
#   CONFIG=...           accelerate config (default: configs/deepspeed_zero2.yaml, zero3 for 6.9b)
#   OUT=runs/tldr        where runs go; SEED=1
#   JUDGE_BASE_URL, JUDGE_MODEL (default gpt-4o-mini), OPENAI_API_KEY: the OpenAI-compatible judge used by
#                        benchmark/judge.py after training; without JUDGE_BASE_URL it reports reward-model scores.
#
# Never run on this project's machines (no GPU); checked with `bash -n` in tests/test_benchmark.py.
set -euo pipefail

SIZE=${SIZE:-1b}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
case "$SIZE" in
  1b|2.8b) CONFIG=${CONFIG:-$REPO/configs/deepspeed_zero2.yaml} ;;
  6.9b) CONFIG=${CONFIG:-$REPO/configs/deepspeed_zero3.yaml} ;;
  *) echo "SIZE must be 1b, 2.8b or 6.9b (got $SIZE)" >&2; exit 2 ;;
esac
NUM_GPUS=${NUM_GPUS:-8}
OUT=${OUT:-$REPO/runs/tldr}
SEED=${SEED:-1}
MODEL=pythia-$SIZE
LAUNCH=(accelerate launch --config_file "$CONFIG" --num_processes "$NUM_GPUS")
mkdir -p "$OUT"
cd "$REPO"

# evaluate RUN_DIR: GPT-judged win rate against the reference summaries (1000 examples of trl-lib/tldr
# validation, greedy), or reward-model scores without a judge.
evaluate() {
  local run=$1
  local judge=()
  if [[ -n "${JUDGE_BASE_URL:-}" ]]; then
    judge=(--judge_base_url "$JUDGE_BASE_URL" --judge_model "${JUDGE_MODEL:-gpt-4o-mini}")
  fi
  python benchmark/judge.py --model "$run/model" --reward_model "$MODEL" --num_examples 1000 \
    --bf16 "${judge[@]}" --output "$run/judge"
}

# published: print the numbers to compare against
published() {
  cat <<'TXT'
Published TL;DR win rates against the reference summaries (GPT-4o-mini judge, 1000 validation examples,
greedy), TRL documentation, RLOO and PPO trainer pages, "Benchmark experiments" (Pythia 1B deduped,
SFT/RM checkpoints of Huang et al. 2024, https://huggingface.co/papers/2403.17031):
  SFT  cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr   33.0%
  RLOO (k=2) vwxyzjn/rloo_tldr                            51.2%
  PPO  vwxyzjn/ppo_tldr                                   64.7%
Huang et al. 2024 (the N+ implementation details) report PPO and DPO win rates for 1B, 2.8B and 6.9B with a
GPT-3.5 judge in their scaling figure (PPO improves with size; 2.8B and 6.9B beat OpenAI's 1.3B checkpoint);
read them from that figure, the judge differs from the one above. No published TL;DR number is known to us
for RLOO k=4 or for KTO with these checkpoints: compare those with the SFT and RLOO k=2 rows.
TXT
}
