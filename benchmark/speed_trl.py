"""TRL's side of benchmark/speed.py: one trainer (RLOOTrainer, DPOTrainer or KTOTrainer; TRL 1.16 has no
PPOTrainer) on the same SFT policy, reward model, data and hyper-parameters as ours, for --warmup + --steps
optimizer steps. A step ends at TRL's `on_step_end` callback; the result (seconds per step over the --steps steps
after --warmup) is written as JSON to --out. Run by speed.py in a child process of its own (peak memory is that
process's); by hand:

    python benchmark/speed_trl.py rloo --setting toy --steps 5 --warmup 1 --out /tmp/trl_rloo.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.dirname(HERE), HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import speed_settings as settings  # noqa: E402


def trainer_for(algo: str, setting: str, common: dict, callbacks: list):
    """(TRL trainer with our hyper-parameters for `algo` in `setting`, settings that could not be matched)."""
    import datasets
    import trl

    import policy_common as pc

    paths, d = settings.setting_paths(setting), settings.hyper(setting, algo)
    tokenizer = pc.load_tokenizer(paths["policy"])
    model = pc.load_causal_lm(paths["policy"], tokenizer)
    common = dict(common, per_device_train_batch_size=d["per_device_train_batch_size"], gradient_accumulation_steps=1,
                  learning_rate=d["learning_rate"])
    if algo == "rloo":
        import rloo

        config = trl.RLOOConfig(**common, num_generations=d["rloo_k"], max_completion_length=d["response_length"],
                                temperature=d["temperature"], top_p=1.0, top_k=0, beta=d["kl_coef"], num_iterations=1,
                                epsilon=rloo.Args.cliprange, normalize_advantages=False, adam_epsilon=1e-5,
                                warmup_steps=0, steps_per_generation=1, log_completions=False)
        dataset = datasets.load_from_disk(paths["prompt_dataset"], keep_in_memory=True)["train"]
        trainer = trl.RLOOTrainer(model=model, reward_funcs=paths["reward"], args=config, train_dataset=dataset,
                                  processing_class=tokenizer, callbacks=callbacks)
        return trainer, ["missing-EOS penalty (ours: score - 1.0 without EOS; TRL has no such option)",
                         "TRL scores completions by decoding them to text and re-tokenizing for the reward model "
                         "(same ids with the word-level tokenizers used here)"]
    if algo == "dpo":
        config = trl.DPOConfig(**common, beta=d["beta"], loss_type=["sigmoid"], max_length=d["max_length"],
                               warmup_steps=d["warmup_ratio"], precompute_ref_log_probs=False)
        dataset = datasets.load_from_disk(paths["preference_dataset"], keep_in_memory=True)["train"]
        return trl.DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                              callbacks=callbacks), []
    if algo == "kto":
        import kto

        config = trl.KTOConfig(**common, beta=d["beta"], desirable_weight=d["desirable_weight"],
                               undesirable_weight=d["undesirable_weight"], max_length=d["max_length"],
                               warmup_steps=kto.Args.warmup_ratio, precompute_ref_log_probs=False)
        dataset = datasets.load_from_disk(paths["unpaired_dataset"], keep_in_memory=True)["train"]
        return trl.KTOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                              callbacks=callbacks), []
    raise ValueError(f"TRL has no trainer for {algo} here")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("algo", choices=settings.TRL_ALGOS)
    parser.add_argument("--setting", default="toy", choices=("toy", "tldr"))
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
    parser.add_argument("--out", required=True, help="where the result JSON goes")
    args = parser.parse_args()
    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"), ("WANDB_MODE", "disabled")):
        os.environ.setdefault(key, value)
    import torch
    import transformers
    import trl

    step_ends = {}

    class StepEnds(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends[state.global_step] = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        common = dict(output_dir=tmp, max_steps=args.warmup + args.steps, report_to="none", save_strategy="no",
                      logging_steps=10**6, bf16=False, gradient_checkpointing=False, use_cpu=True, seed=1,
                      disable_tqdm=True, dataloader_num_workers=0, lr_scheduler_type="linear", max_grad_norm=1.0,
                      weight_decay=0.0)
        trainer, unmatched = trainer_for(args.algo, args.setting, common, [StepEnds()])
        torch.manual_seed(0)
        with contextlib.redirect_stdout(sys.stderr):
            trainer.train()
    result = dict(step=settings.seconds_per_step(step_ends, args.warmup, args.steps), steps_measured=args.steps,
                  trl_version=trl.__version__, unmatched=unmatched)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
