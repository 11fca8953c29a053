"""TRL 1.16's KTOTrainer on exactly what `python kto.py --model <setting>` trains on, scored by the uniform evaluation
(benchmark/uniform_eval.py: greedy gold and reward-model score, sampled KL to the SFT policy, EOS rate), so that its
numbers sit beside ours in benchmark/results/toy.md. Written for the question of benchmark/results/kto_toy_hard.md:
is kto.py's drift on toy_hard the data, the defaults or our loss?

    pip install --no-deps --target /tmp/trlpkg trl==1.16.0     # TRL outside the main environment
    PYTHONPATH=/tmp/trlpkg python benchmark/kto_trl_compare.py --setting toy_hard --seeds 1 2 3 --out /tmp/kto_trl
    PYTHONPATH=/tmp/trlpkg python benchmark/kto_trl_compare.py --seeds 1 --beta 0.5    # any kto.py flag after ours

What is the same as kto.py (built with kto.py's own functions and flags: `ru.parse_args(kto.Args, ALIAS_DEFAULTS)`):
- the SFT policy, its tokenizer (models.load_tokenizer / load_causal_lm: fp32, dropout off) and a separate frozen copy
  as the reference model;
- the unpaired examples (the world's unpaired/ train split) in kto.py's order for that --seed: its micro-batches
  (make_kl_groups) visited in its step order (tl.EpochLoop), handed to TRL as one sequential dataset (TRL's
  default `train_sampling_strategy="sequential"`), so every TRL batch is one of ours;
- the mismatched pairs of the KL reference point: TRL rotates the completions by one inside each batch of
  per_device_train_batch_size ((x_k, y_{k-1}), k = 0 takes the last), as make_kl_groups does; checked below;
- token ids: TRL tokenises prompt + completion + EOS text itself; the script checks that its prompt, completion
  and KL completion ids equal kto.py's for every example (and stops if not);
- loss_type "kto", beta, the class weights (kto.loss_weights of the counts, as kto.py logs them), max_length (no
  example is truncated at the toy lengths), no precomputed reference log-probs;
- batch 32 x 1 accumulation x 1 process, the step count, and the optimizer and schedule passed in as kto.py builds
  them: torch AdamW over every parameter (weight decay on all of them, where transformers' default would exempt
  biases and norms), linear warmup over ceil(warmup_ratio x steps) then linear decay (transformers'
  get_scheduler("linear")), gradient clipping at max_grad_norm.
What differs: TRL right-pads prompt + completion in one row (kto.py left-pads prompts), which changes no log-prob
beyond float rounding; TRL scores the own and mismatched completions in separate forwards.

Per seed it writes OUT/seed<S>/model (TRL's final policy), OUT/seed<S>/log_history.json (TRL's logged loss, kl,
rewards/*, logps/* per step) and OUT/results.json: {seed: uniform evaluation}, and "sft" for the starting point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # TRL's telemetry at trainer start
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402

import kto  # noqa: E402
from plumbing import data_utils as du  # noqa: E402
from plumbing import models  # noqa: E402
from plumbing import run_utils as ru  # noqa: E402
from plumbing import train_loop as tl  # noqa: E402


def our_run(setting: str, seed: int, extra_flags: list):
    """kto.py's arguments, tokenizer, policy path and training examples in its visiting order for this seed: a list of
    (example, its micro-batch's step) with kto.py's prompt_ids, completion_ids, kl_completion_ids and label, plus
    the class weights it derives."""
    args = ru.parse_args(kto.Args, kto.ALIAS_DEFAULTS, argv=["--model", setting, "--seed", str(seed), *extra_flags])
    dataset_name, policy_path = args.dataset or ru.default_dataset(args.model), ru.resolve_model(args.model)
    tokenizer = models.load_tokenizer(policy_path)
    train_data = du.to_unpaired(du.load_unpaired_dataset(dataset_name, "train"), dataset_name)
    eval_data = du.to_unpaired(du.load_unpaired_dataset(dataset_name, args.eval_split), dataset_name)
    eval_prompts = du.load_held_out_prompts(dataset_name, args.eval_split, args.num_eval_prompts)
    tl.fit_lengths(args, tokenizer, policy_path, [*train_data["prompt"], *eval_data["prompt"]], eval_prompts,
                   cut_held_out=True)
    examples, _ = du.tokenize_unpaired(train_data, tokenizer, args.max_prompt_length, args.max_length, dataset_name)
    groups = kto.make_kl_groups(examples, args.per_device_train_batch_size, args.seed, args.max_length)
    loop = tl.EpochLoop(args, len(groups), args.gradient_accumulation_steps, "samples",
                        rows_per_item=args.per_device_train_batch_size)
    n_desirable = sum(e["label"] for e in examples)
    args.desirable_weight, args.undesirable_weight = kto.loss_weights(
        n_desirable, len(examples) - n_desirable, args.desirable_weight, args.undesirable_weight)
    ordered = [example for step in range(1, loop.total_steps + 1) for g in loop.batch_index(step)
               for example in groups[g]]
    rows = [dict(prompt=train_data[e["index"]]["prompt"], completion=train_data[e["index"]]["completion"],
                 label=e["label"]) for e in ordered]
    return args, tokenizer, policy_path, ordered, rows, loop


def train_trl(setting: str, seed: int, out_dir: str, extra_flags: list) -> str:
    """One TRL KTOTrainer run on kto.py's data and settings for `seed`; returns the saved model folder."""
    import trl
    from datasets import Dataset
    from transformers import get_scheduler

    args, tokenizer, policy_path, ordered, rows, loop = our_run(setting, seed, extra_flags)
    if args.gradient_accumulation_steps != 1:
        raise SystemExit("this comparison hands TRL one micro-batch per step (gradient_accumulation_steps 1)")
    print(f"[kto_trl] {setting} seed {seed}: {len(rows)} examples, {loop.total_steps} steps, beta {args.beta}, lr "
          f"{args.learning_rate}, weights desirable {args.desirable_weight:.4g} undesirable "
          f"{args.undesirable_weight:.4g}", flush=True)
    policy = models.load_causal_lm(policy_path, tokenizer)
    reference = models.load_causal_lm(policy_path, tokenizer)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate,
                                  weight_decay=args.weight_decay)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=loop.warmup_steps,
                              num_training_steps=loop.total_steps)
    config = trl.KTOConfig(
        output_dir=out_dir, max_steps=loop.total_steps, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=1, learning_rate=args.learning_rate, max_grad_norm=args.max_grad_norm,
        beta=args.beta, desirable_weight=args.desirable_weight, undesirable_weight=args.undesirable_weight,
        loss_type="kto", max_length=args.max_length, precompute_ref_log_probs=False, disable_dropout=True,
        train_sampling_strategy="sequential", bf16=False, gradient_checkpointing=False, use_cpu=True, seed=seed,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    trainer = trl.KTOTrainer(model=policy, ref_model=reference, args=config, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer, optimizers=(optimizer, scheduler))
    # the same token ids and the same mismatched pairs as kto.py, example by example
    prepared = trainer.train_dataset
    for i, e in enumerate(ordered):
        theirs = prepared[i]
        ours = (e["prompt_ids"], e["completion_ids"], e["kl_completion_ids"], e["label"])
        if (theirs["prompt_ids"], theirs["completion_ids"], theirs["KL_completion_ids"], theirs["label"]) != ours:
            raise SystemExit(f"example {i}: TRL's tokens differ from kto.py's: {theirs} vs {ours}")
    trainer.train()
    model_dir = os.path.join(out_dir, "model")
    trainer.save_model(model_dir)
    tokenizer.save_pretrained(model_dir)
    with open(os.path.join(out_dir, "log_history.json"), "w") as f:
        json.dump(trainer.state.log_history, f)
    return model_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", default="toy_hard", help="toy world (--model alias of kto.py)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", default="/tmp/kto_trl", help="output folder")
    parser.add_argument("--threads", type=int, default=2)
    args, extra_flags = parser.parse_known_args()  # the rest: kto.py flags (--beta 0.5, --learning_rate 5e-5, ...)
    torch.set_num_threads(args.threads)
    from uniform_eval import ToyEvaluator

    evaluator = ToyEvaluator(setting=args.setting)
    results = {"setting": args.setting, "kto_flags": extra_flags, "sft": evaluator.evaluate_sft()}
    for seed in args.seeds:
        model_dir = train_trl(args.setting, seed, os.path.join(args.out, f"seed{seed}"), extra_flags)
        results[str(seed)] = evaluator.evaluate_path(model_dir)
        r = results[str(seed)]
        print(f"[kto_trl] seed {seed}: gold {r['gold_score']:.3f} rm {r['rm_score']:.3f} kl {r['kl']:.3f} "
              f"eos {r['eos_rate']:.2f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
