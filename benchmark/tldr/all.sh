#!/usr/bin/env bash
# Every TL;DR reproduction in a row (about a GPU-day per size on 8 GPUs); then the SFT baseline's own win rate.
#   SIZE=1b NUM_GPUS=8 JUDGE_BASE_URL=https://api.openai.com/v1 OPENAI_API_KEY=... bash benchmark/tldr/all.sh
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for script in rloo_k2 rloo_k4 ppo dpo kto; do
  bash "$HERE/$script.sh"
done
source "$HERE/common.sh"
judge=()
if [[ -n "${JUDGE_BASE_URL:-}" ]]; then
  judge=(--judge_base_url "$JUDGE_BASE_URL" --judge_model "${JUDGE_MODEL:-gpt-4o-mini}")
fi
python benchmark/judge.py --model "$MODEL" --num_examples 1000 --bf16 "${judge[@]}" --output "$OUT/sft_pythia-${SIZE}_judge"
published
