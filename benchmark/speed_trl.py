"""TRL's side of benchmark/speed.py: one trainer (RLOOTrainer, DPOTrainer, KTOTrainer, GRPOTrainer or
DistillationTrainer; TRL 1.16 has no PPOTrainer) on the same SFT policy, reward model (or teacher), data and
hyper-parameters as ours, for --warmup + --steps steps: optimizer steps, or for GRPO generated batches of
num_iterations optimizer steps each, as grpo.py counts them. A step ends at TRL's `on_step_end` callback (GRPO:
that of its batch's last optimizer step); the result (seconds per step over the --steps steps after --warmup) is
written as JSON to --out. Run by speed.py in a child process of its own (peak memory is that process's); by hand:

    python benchmark/speed_trl.py rloo --setting toy --steps 5 --warmup 1 --out /tmp/trl_rloo.json
    python benchmark/speed_trl.py grpo --setting tldr --steps 2 --warmup 1 --out /tmp/trl_grpo.json
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

from plumbing import models  # noqa: E402


def common_fields(output_dir: str, max_steps: int) -> dict:
    """The TrainingArguments every trainer here gets (ours: fp32 on CPU, AdamW without weight decay, linear decay,
    gradient clipping at 1.0, no checkpointing, no saving, no logging in the timed steps)."""
    return dict(output_dir=output_dir, max_steps=max_steps, report_to="none", save_strategy="no", logging_steps=10**6,
                bf16=False, gradient_checkpointing=False, use_cpu=True, seed=1, disable_tqdm=True,
                dataloader_num_workers=0, lr_scheduler_type="linear", max_grad_norm=1.0, weight_decay=0.0)


def grpo_config(setting: str, common: dict):
    """trl.GRPOConfig with grpo.py's values in `setting` (the setting's, else grpo.py's defaults): one generation of
    per_device_train_batch_size x gradient_accumulation_steps completions per optimizer step, as grpo.py on one
    process, num_iterations optimizer steps on each."""
    import trl

    d, g = settings.hyper(setting, "grpo"), lambda key: settings.grpo_value(setting, key)  # noqa: E731
    accumulation = d["gradient_accumulation_steps"]
    config = trl.GRPOConfig(**dict(common, per_device_train_batch_size=d["per_device_train_batch_size"],
                                   gradient_accumulation_steps=accumulation, learning_rate=d["learning_rate"]),
                            num_generations=g("num_generations"), max_completion_length=d["response_length"],
                            temperature=g("temperature"), top_p=1.0, top_k=0, beta=g("beta"), epsilon=g("epsilon"),
                            epsilon_high=g("epsilon_high"), loss_type=g("loss_type"), scale_rewards=g("scale_rewards"),
                            importance_sampling_level=g("importance_sampling_level"),
                            num_iterations=g("num_iterations"),
                            mask_truncated_completions=g("mask_truncated_completions"), adam_epsilon=1e-5,
                            warmup_steps=0, steps_per_generation=accumulation, log_completions=False)
    assert config.generation_batch_size == d["per_device_train_batch_size"] * accumulation, config
    return config


def trainer_for(algo: str, setting: str, common: dict, callbacks: list):
    """(TRL trainer with our hyper-parameters for `algo` in `setting`, settings that could not be matched)."""
    import datasets
    import trl

    paths, d = settings.setting_paths(setting), settings.hyper(setting, algo)
    tokenizer = models.load_tokenizer(paths["policy"])
    model = models.load_causal_lm(paths["policy"], tokenizer)
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
    if algo == "grpo":
        config = grpo_config(setting, common)
        dataset = datasets.load_from_disk(paths["prompt_dataset"], keep_in_memory=True)["train"]
        trainer = trl.GRPOTrainer(model=model, reward_funcs=paths["reward"], args=config, train_dataset=dataset,
                                  processing_class=tokenizer, callbacks=callbacks)
        unmatched = ["TRL scores completions by decoding them to text and re-tokenizing for the reward model "
                     "(same ids with the word-level tokenizers used here)"]
        penalty = settings.grpo_value(setting, "missing_eos_penalty")
        if penalty is not None:
            unmatched.insert(0, f"missing-EOS penalty (ours: score - {penalty} without EOS; TRL has no such option)")
        return trainer, unmatched
    if algo == "sft":  # prompt-completion data: TRL's default loss on the completion tokens only, as sft.py's
        config = trl.SFTConfig(**common, max_length=d["max_length"], packing=False, warmup_steps=0, adam_epsilon=1e-5)
        dataset = datasets.load_from_disk(paths["sft_dataset"], keep_in_memory=True)["train"]
        return trl.SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                              callbacks=callbacks), []
    if algo == "distill":
        import distill

        teacher = models.load_causal_lm(paths["teacher"], tokenizer)
        config = trl.DistillationConfig(**common, max_completion_length=d["response_length"],
                                        temperature=d.get("temperature", distill.Args.temperature), top_p=1.0, top_k=0,
                                        beta=d.get("beta", distill.Args.beta), adam_epsilon=1e-5, warmup_steps=0,
                                        log_completions=False)
        dataset = datasets.load_from_disk(paths["prompt_dataset"], keep_in_memory=True)["train"]
        return trl.DistillationTrainer(model=model, teacher_model=teacher, args=config, train_dataset=dataset,
                                       processing_class=tokenizer, callbacks=callbacks), []
    raise ValueError(f"TRL has no trainer for {algo} here")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("algo", choices=(*settings.TRL_ALGOS, "sft"))
    parser.add_argument("--setting", default="toy", help="toy, tldr, or long512 / long1024 / long2048 (memory.py)")
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before measuring (0: no step time)")
    parser.add_argument("--out", required=True, help="where the result JSON goes")
    args = parser.parse_args()
    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"), ("WANDB_MODE", "disabled")):
        os.environ.setdefault(key, value)
    import torch
    import transformers
    import trl

    step_ends = {}
    per_step = settings.optimizer_steps_per_step(args.setting, args.algo)  # TRL optimizer steps in one of our steps

    class StepEnds(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % per_step == 0:
                step_ends[state.global_step // per_step] = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        common = common_fields(tmp, (args.warmup + args.steps) * per_step)
        trainer, unmatched = trainer_for(args.algo, args.setting, common, [StepEnds()])
        torch.manual_seed(0)
        with contextlib.redirect_stdout(sys.stderr):
            trainer.train()
    # --warmup 0: peak memory only (benchmark/memory.py), no step time
    result = dict(step=settings.seconds_per_step(step_ends, args.warmup, args.steps) if args.warmup else None,
                  steps_measured=args.steps,
                  trl_version=trl.__version__, unmatched=unmatched)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
