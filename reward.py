"""Reward-model training: a Bradley-Terry model of pairwise preferences (Bradley & Terry 1952; Ziegler et al. 2019,
https://arxiv.org/abs/1909.08593; Stiennon et al. 2020, https://arxiv.org/abs/2009.01325; Ouyang et al. 2022,
https://arxiv.org/abs/2203.02155), the reward model that rloo.py, ppo.py and grpo.py read. Trains a scalar head on a
language model so that on (prompt, chosen, rejected) pairs
    loss = -log sigmoid(r(x, y_w) - r(x, y_l) [- margin])   [+ center_rewards_coefficient * (r_w + r_l)^2]
(formulas at bradley_terry_loss). Style after summarize_from_feedback_details' reward.py (SfFD); conventions of TRL
1.16. The input convention, defaults and implementation details: docs/offline.md; metrics: docs/metrics.md.

    python reward.py                                  # the offline toy task, on a CPU
    accelerate launch reward.py --model pythia-1b --eval_split validation   # TL;DR: benchmark/tldr/reward.sh
"""

import math
import os
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from plumbing import accumulation as acc
from plumbing import data_utils as du
from plumbing import forwards as fw
from plumbing import models
from plumbing import prompt_sharing as ps
from plumbing import run_utils as ru
from plumbing import throughput as tp
from plumbing import train_loop as tl
from plumbing.errors import UserError

# Toy-task values (applied only to flags not given on the command line); the dataclass holds the TL;DR defaults.
ALIAS_DEFAULTS = {
    "toy": dict(learning_rate=1e-3, warmup_ratio=0.1, per_device_train_batch_size=32, gradient_accumulation_steps=1,
                per_device_eval_batch_size=64, num_train_epochs=6.0, eval_steps=100, max_prompt_length=8,
                max_length=18, max_eval_pairs=0),
}
# toy_hard (toy_task.SETTINGS): the toy defaults and budget, with room for its longer prompts and answers
ALIAS_DEFAULTS["toy_hard"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=10, max_length=22)


@dataclass
class Args(tl.TrainFlags, tl.EpochFlags, models.ModelFlags, du.DataFlags, ps.PromptSharingFlags):
    # shared flags whose default differs here (Huang et al. 2024's TL;DR reward model)
    per_device_train_batch_size: int = 1

    # reward model
    reward_model_input: Optional[Literal["tokens", "text"]] = None
    """what the trained reward model reads, recorded in its config for the RL scripts: tokens (the policy's ids + EOS)
    or text (re-tokenised by its own tokenizer, no EOS); None = tokens"""
    center_rewards_coefficient: Optional[float] = None
    """weight of TRL's reward-centring term: loss += coef * mean((r_chosen + r_rejected)^2); None = off"""
    max_eval_pairs: int = 2000
    """evaluate on the first this many held-out pairs (0 = all)"""


# ALGO LOGIC: the Bradley-Terry loss
def bradley_terry_loss(chosen_rewards, rejected_rewards, margin=None, center_rewards_coefficient=None):
    """Per-pair losses (b,) from the scores of chosen and rejected completions (b,), (b,):
        -log sigmoid(r_c - r_r - margin) + coef * (r_c + r_r)^2
    P(chosen preferred) = sigmoid(r_c - r_r) is the Bradley-Terry model; `margin` (b,) or None asks for a score gap of
    at least that much (Llama 2's margin loss, TRL's `margin` column); the centring term (TRL's
    center_rewards_coefficient, Eisenstein et al. 2023) pulls each pair's scores towards a mean of 0. Their batch mean
    is TRL 1.16 RewardTrainer.compute_loss: -logsigmoid(c - r - margin).mean() + coef * mean((c + r) ** 2)."""
    difference = chosen_rewards - rejected_rewards
    if margin is not None:
        difference = difference - margin
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return losses


def pair_stats(losses, chosen_rewards, rejected_rewards) -> dict:
    """Per-pair metrics (b,) each: loss, accuracy (chosen scored higher), rewards/chosen, /rejected, /margins."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {"loss": losses.detach(), "accuracy": (chosen_rewards > rejected_rewards).float(),
            "rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
            "rewards/margins": chosen_rewards - rejected_rewards}


def pair_rewards(model, rows, pad_token_id: int, device):
    """Pairs `rows` -> scores (b,), (b,) of their chosen and rejected completions, from one forward of `model` (a
    RewardModel, prepared or not) over 2b rows (float32): du.concatenated_inputs, chosen rows then rejected rows."""
    query_responses, context_length = du.concatenated_inputs(rows, pad_token_id)
    rewards = model(query_responses.to(device), context_length)
    return rewards.float().chunk(2)


def batch_losses(args, model, rows, index, pad_token_id: int, device):
    """Pairs rows[index] -> per-pair losses (b,) and per-pair metrics (pair_stats); each prompt encoded once for its
    two completions where the model's forward shares prompts."""
    batch = [rows[i] for i in index]
    chosen_rewards, rejected_rewards = pair_rewards(model, batch, pad_token_id, device)
    margin = torch.tensor([r["margin"] for r in batch], device=device) if "margin" in batch[0] else None
    losses = bradley_terry_loss(chosen_rewards, rejected_rewards, margin, args.center_rewards_coefficient)
    return losses, pair_stats(losses, chosen_rewards, rejected_rewards)


# Data: (prompt, chosen, rejected[, margin]) -> token ids, as the reward model will read them
def reward_input_ids(tokenizer, prompt, completion, max_prompt_length: int, max_length: int, mode: str):
    """(prompt_ids, completion_ids) of one completion (text, or messages rendered with the chat template) as read in
    `mode`, by data_utils.tokenize_prompt_completion (the prompt cut from the left, the completion from the right):
    tokens = the completion ending with one EOS (data_utils.tokenize_completion: appended to text, and to messages
    unless the template already ends the turn with EOS); text = the completion's tokens as rendered, nothing appended,
    as reward_sources.py's text mode reads it (a cut completion loses its end, EOS included, in either mode)."""
    return du.tokenize_prompt_completion(tokenizer, prompt, completion, max_prompt_length, max_length,
                                         end_with_eos=mode == "tokens")


def tokenize_pairs(tokenizer, dataset, max_prompt_length: int, max_length: int, mode: str, name: str):
    """Text or conversational pairs -> (rows, dropped): rows of token-id lists `prompt`, `chosen`, `rejected`
    (reward_input_ids), plus a float `margin` when the data has that column; a pair with a completion cut to nothing
    is dropped and counted. A value of the wrong type is a UserError naming the row and column."""
    has_margin = "margin" in dataset.column_names
    rows, dropped = [], 0
    for i, example in enumerate(dataset):
        du.require_text_or_messages({column: example[column] for column in ("prompt", "chosen", "rejected")}, name, i)
        margin = example["margin"] if has_margin else 0.0
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            raise UserError(f"dataset {name!r} row {i} column 'margin': expected a finite number, got {margin!r}")
        (prompt_ids, chosen_ids), (_, rejected_ids) = [reward_input_ids(
            tokenizer, example["prompt"], example[column], max_prompt_length, max_length, mode)
            for column in ("chosen", "rejected")]
        if not chosen_ids or not rejected_ids:
            dropped += 1
            continue
        rows.append({"prompt": prompt_ids, "chosen": chosen_ids, "rejected": rejected_ids,
                     **({"margin": float(margin)} if has_margin else {})})
    if not rows:
        raise UserError(f"dataset {name!r}: no pair is left after truncation to --max_prompt_length "
                        f"{max_prompt_length} / --max_length {max_length} ({dropped} dropped)")
    return rows, dropped


# Model: a scalar head on the language model
def init_score_head(score: torch.nn.Linear) -> None:
    """SfFD's initialisation of a new reward head (layer_init in its reward.py, Huang et al. 2024): weight ~
    Normal(0, 1 / sqrt(hidden_size + 1)), bias 0 (GPT-NeoX's score head has none)."""
    torch.nn.init.normal_(score.weight, std=1 / math.sqrt(score.in_features + 1))
    if score.bias is not None:
        torch.nn.init.zeros_(score.bias)


def load_reward_model(path: str, tokenizer, args):
    """The trainable reward model from `path` (models.load_scalar_model: one label, dropout off): a new scalar head
    (the checkpoint is not a sequence classifier) initialised by init_score_head; then activation checkpointing
    and a LoRA adapter (task SEQ_CLS: PEFT also trains and saves the `score` head, modules_to_save) as flagged."""
    architectures = getattr(ru.model_config(path, args.trust_remote_code), "architectures", None) or []
    model = models.load_scalar_model(path, tokenizer, models.Precision.from_args(args),
                                     trust_remote_code=args.trust_remote_code)
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        init_score_head(model.score)
    if args.gradient_checkpointing:
        models.enable_activation_checkpointing(model)
    if args.use_peft:
        model = models.add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules,
                            task_type="SEQ_CLS")
    return model


class RewardModel(torch.nn.Module):
    """The sequence classifier behind a forward of its own: (B, T) ids -> (B,) scores, each read at its row's last
    real token by the scalar forward chosen for it (`scalar_forward`: plumbing/forwards.py), which runs the backbone
    and the score head directly; called through this module's forward, the prepared (DDP / DeepSpeed) wrapper still
    sees the forward and synchronises gradients."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model, self.scalar_forward = model, None  # choose_forward

    def choose_forward(self, forwards) -> None:
        """The model's forward, chosen once it is placed (forwards.py: a shared prompt encoded once, packed, ...)."""
        self.scalar_forward = forwards.scalar(self.model)

    def forward(self, query_responses, context_length: int):
        return self.scalar_forward.rewards(self.model, query_responses, context_length)


@torch.no_grad()
def evaluate(args, accelerator, model, held_out, logger, step):
    """Held-out pairs (`held_out.rows`) -> eval/... means over every process's pairs (each process takes an even
    share, so all make the same model calls); the sample table shows a few pairs' two completions with their scores."""
    tokenizer = held_out.tokenizer
    model.eval()
    indices, n_real = ru.even_share(list(range(len(held_out.rows))), accelerator)
    sums, samples = {}, []
    for i in range(0, len(indices), args.per_device_eval_batch_size):
        index = indices[i:i + args.per_device_eval_batch_size]
        _, stats = batch_losses(args, model, held_out.rows, index, tokenizer.pad_token_id, accelerator.device)
        for k, v in stats.items():  # only the first n_real pairs of the share count
            sums[f"eval/{k}"] = sum(v[:max(0, n_real - i)].tolist(), sums.get(f"eval/{k}", 0.0))
        for j, row_index in enumerate(index[:max(0, min(n_real, 16 * args.num_samples_printed) - i)]):
            row = held_out.rows[row_index]  # a few real pairs, decoded: chosen then rejected, each with its score
            prompt = tokenizer.decode(row["prompt"], skip_special_tokens=True)
            samples += [{"prompt": prompt, "completion": tokenizer.decode(row[c], skip_special_tokens=True),
                         "score": stats[f"rewards/{c}"][j].item()} for c in ("chosen", "rejected")]
    model.train()
    logger.log_samples("eval/samples", samples, step, 2 * args.num_samples_printed)
    return ru.global_means(accelerator, sums, n_real)


def validate(args: Args) -> None:
    """The reward model's own flags (each flag group checked its own in ru.parse_args)."""
    if args.center_rewards_coefficient is not None and args.center_rewards_coefficient < 0:
        raise UserError(f"--center_rewards_coefficient must be >= 0, got {args.center_rewards_coefficient}")
    if args.max_eval_pairs < 0:
        raise UserError("--max_eval_pairs must be >= 0")


def main() -> None:
    # 1. arguments: validate and derive the batch size once
    args = ru.parse_args(Args, ALIAS_DEFAULTS)
    validate(args)
    args.reward_model_input = args.reward_model_input or "tokens"  # recorded in args.json and the saved config
    args.dataset = args.dataset or ru.default_dataset(args.model)
    model_path = ru.resolve_model(args.model)
    accelerator = ru.make_accelerator(args)
    batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    ru.seed_everything(args.seed, accelerator.process_index)

    # 2. tokenizer and data (before the model loads): pairs, lengths fitted to the data and the model, token ids as
    # the reward model reads them, the epochs' order
    tokenizer = models.load_tokenizer(model_path, trust_remote_code=args.trust_remote_code)
    pad = tokenizer.pad_token_id
    train_data = du.text_only(du.load_preference_dataset(args.dataset, "train"), args.dataset)  # a scalar head on text
    du.require_columns(train_data, ["prompt", "chosen", "rejected"], args.dataset)
    eval_data = du.load_preference_dataset(args.dataset, args.eval_split)
    du.require_columns(eval_data, ["prompt", "chosen", "rejected"], args.dataset)
    if args.max_eval_pairs:
        eval_data = eval_data.select(range(min(args.max_eval_pairs, len(eval_data))))
    tl.fit_lengths(args, tokenizer, model_path, [*train_data["prompt"], *eval_data["prompt"]])
    train_rows, dropped = tokenize_pairs(tokenizer, train_data, args.max_prompt_length, args.max_length,
                                         args.reward_model_input, args.dataset)
    eval_rows, eval_dropped = tokenize_pairs(tokenizer, eval_data, args.max_prompt_length, args.max_length,
                                             args.reward_model_input, f"{args.dataset}:{args.eval_split}")
    held_out = du.HeldOut(eval_rows, [], tokenizer)
    loop = tl.EpochLoop(args, len(train_rows), batch_size, "pairs")

    # 3. the reward model: the language model with a scalar head (+ LoRA with --use_peft), and its forward, chosen once
    #    (plumbing/forwards.py: chosen and rejected rows repeat a prompt, encoded once where that saves enough, ...)
    forwards = fw.Forwards.from_args(args, pad, repeats=ps.Repeats(2 * args.per_device_train_batch_size, 2,
                                                                   args.max_prompt_length,
                                                                   args.max_length - args.max_prompt_length))
    model = RewardModel(load_reward_model(model_path, tokenizer, args))

    # 4. optimizer (eps 1e-5 as in SfFD's reward.py), schedule, the run folder, the state (resumed from
    # --resume_from), the logger
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate, eps=1e-5,
                                  weight_decay=args.weight_decay)
    scheduler = loop.scheduler(optimizer)
    model, optimizer = accelerator.prepare(model, optimizer)
    models.unwrap(model).choose_forward(forwards)
    output_dir = ru.output_dir(args, args.dataset, accelerator)
    state = dict(step=0, nonfinite_skipped=0)
    logger, optimizer_step = tl.start_or_resume(args, accelerator, model, optimizer, scheduler, output_dir, state)
    logger.progress(loop.total_steps, state["step"], batch_size, "pairs", ("loss", "accuracy", "eval/accuracy"))
    if not args.resume_from:  # step 0: data counts and the evaluation before training
        metrics = evaluate(args, accelerator, model, held_out, logger, 0)
        logger.log({"data/train_pairs": len(train_rows), "data/dropped": dropped, "data/eval_pairs": len(eval_rows),
                    "data/eval_dropped": eval_dropped, **metrics}, step=0)

    stop = tl.StopSignal()
    model.train()
    meter = tp.StepMeter(accelerator, models.unwrap(model))  # perf/*
    micro_batches = acc.micro_batches(args, accelerator, model)  # or sized by --token_budget
    row_tokens = [du.row_tokens(row) for row in train_rows]  # chosen and rejected, each with its prompt
    for step in loop.steps(state["step"]):
        meter.start()
        # 5. one optimizer step over the next `batch_size` pairs of the epoch's order, micro-batches accumulated
        sums = {}
        for index in micro_batches.split(tl.process_items(loop.batch_index(step), accelerator), row_tokens):
            with micro_batches.accumulate():
                # ALGO LOGIC: one forward over chosen and rejected, per-pair Bradley-Terry losses (b,), backward
                losses, stats = batch_losses(args, model, train_rows, index, pad, accelerator.device)
                micro_batches.backward(losses.mean())  # a mean over the micro-batch's pairs
            for k, v in stats.items():  # the step's means
                sums[k] = sums.get(k, 0.0) + v.mean().item() * micro_batches.weight()
        grad_norm = optimizer_step(sums["loss"], state, step)  # clip, check, step, schedule
        state.update(step=step, nonfinite_skipped=optimizer_step.skipped)

        # 6. log, evaluate every eval_steps steps and after the last
        metrics = ru.reduce_metrics(accelerator, {**sums, **({} if grad_norm is None else {"grad_norm": grad_norm})})
        metrics.update({**loop.metrics(step, optimizer_step),
                        **meter.metrics(sum(row_tokens[i] for i in loop.batch_index(step)))})
        if loop.evaluate_now(step):
            metrics.update(evaluate(args, accelerator, model, held_out, logger, step))
        logger.log(metrics, step=step)

        # 7. checkpoints: periodic, and on SIGTERM / Ctrl-C on any process (then every process stops cleanly)
        if tl.checkpoint_or_stop(accelerator, args, output_dir, state, scheduler, stop, loop.total_steps):
            logger.close()
            return

    # 8. final save, with the input convention in config.json (reward_sources.py reads the model the same way by
    # default)
    models.unwrap(model).model.config.reward_model_input = args.reward_model_input
    tl.save_model(accelerator, model, tokenizer, os.path.join(output_dir, "model"), merge_peft=args.merge_peft,
                  submodule="model")
    logger.close(os.path.join(output_dir, "model"))


if __name__ == "__main__":
    ru.main_guard(main)
