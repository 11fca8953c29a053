#!/usr/bin/env bash
# Reward model on TL;DR preference pairs (trl-lib/tldr-preference: 92,858 train pairs; its `validation` split held
# out, all of it), from the TL;DR SFT checkpoint (--model pythia-$SIZE), with reward.py's defaults, the real-scale
# values in its Args after Huang et al. 2024 (https://arxiv.org/abs/2403.17031; summarize_from_feedback_details/
# reward.py + sbatches/reward.sbatch): lr 3e-6, one epoch, 64 pairs per optimizer step (there: 1 pair per GPU x 8
# accumulation steps x 8 GPUs; here the accumulation is set so that any NUM_GPUS dividing 64 gives 64), AdamW eps
# 1e-5, weight decay 0.01, a new scalar head ~ Normal(0, 1/sqrt(hidden_size + 1)), prompt + summary + EOS scored at
# the EOS (--reward_model_input tokens, recorded in the saved config.json). Differences from theirs: a linear instead
# of a cosine schedule, no reward normalisation (bias) after training.
#
# What to compare with: held-out pairwise accuracy (eval/accuracy, printed at the end and in $RUN/metrics.jsonl) of
# the released reward models cleanrl/EleutherAI_pythia-$SIZE-deduped__reward__tldr on the TL;DR preference validation
# set: about 0.63 (1B), 0.67 (2.8B) and 0.69 (6.9B) (Huang et al. 2024, reward-model section; SfFD reports the
# accuracy on `validation` and, apart, on its CNN/DM pairs, which trl-lib/tldr-preference leaves out). The saved model
# can then replace the released one in the RL scripts: --reward_model $RUN/model.
#   SIZE=1b NUM_GPUS=8 bash benchmark/tldr/reward.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if (( 64 % NUM_GPUS != 0 )); then
  echo "NUM_GPUS must divide 64 (64 pairs per optimizer step; got $NUM_GPUS)" >&2
  exit 2
fi
RUN=$OUT/reward_pythia-${SIZE}_seed$SEED
"${LAUNCH[@]}" reward.py --model "$MODEL" --bf16 --seed "$SEED" --output_dir "$RUN" \
  --dataset tldr --eval_split validation --max_eval_pairs 0 --eval_steps 0 \
  --learning_rate 3e-6 --num_train_epochs 1 --per_device_train_batch_size 1 \
  --gradient_accumulation_steps $((64 / NUM_GPUS)) --reward_model_input tokens
python - "$RUN/metrics.jsonl" "$SIZE" <<'PY'
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
evals = [r for r in rows if "eval/accuracy" in r]
published = {"1b": 0.63, "2.8b": 0.67, "6.9b": 0.69}[sys.argv[2]]
print(f"held-out pairwise accuracy: {evals[0]['eval/accuracy']:.3f} (step 0) -> {evals[-1]['eval/accuracy']:.3f} "
      f"(step {evals[-1]['step']}); Huang et al. 2024, Pythia {sys.argv[2]}: about {published:.2f}")
PY
