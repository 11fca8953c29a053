"""Direct Preference Optimization (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290) and common variants.
Trains a policy on (prompt, chosen, rejected) pairs with no reward model and no sampling:
    loss = -log sigmoid(beta * [(log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))])
Variants: --loss_type ipo, hinge (SLiC) or robust (rDPO), --label_smoothing (cDPO), --rpo_alpha (an NLL term on the
chosen completion, RPO), --reference_free (no reference); formulas and papers at dpo_loss and pair_losses. Style after
summarize_from_feedback_details' dpo.py; loss variants as in TRL's DPOTrainer. Data and implementation choices:
docs/offline.md; metrics: docs/metrics.md.

    python dpo.py                                        # the offline toy task, a few CPU minutes
    accelerate launch dpo.py --model pythia-1b           # TL;DR preference data (trl-lib/tldr-preference)
"""

import os
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F

import policy_common as pc
from plumbing import accumulation as acc
from plumbing import data_utils as du
from plumbing import forwards as fw
from plumbing import greedy_eval as ge
from plumbing import models, vision
from plumbing import prompt_sharing as ps
from plumbing import run_utils as ru
from plumbing import throughput as tp
from plumbing import train_loop as tl
from plumbing.errors import UserError

# Toy-task values (applied only to flags not given on the command line); the dataclass holds the TL;DR defaults.
ALIAS_DEFAULTS = {
    "toy": dict(learning_rate=2e-4, beta=0.5, per_device_train_batch_size=32, gradient_accumulation_steps=1,
                per_device_eval_batch_size=64, num_train_epochs=1.0, warmup_ratio=0.1, eval_steps=40,
                max_prompt_length=8, max_length=18, response_length=8, num_eval_prompts=256, max_eval_pairs=0),
}
# toy_hard (toy_task.SETTINGS): the toy defaults and budget, with room for its longer prompts and answers
ALIAS_DEFAULTS["toy_hard"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=10, max_length=22, response_length=10)
# toy_vision (toy_vision.py): its preference pairs (the right answer against a wrong one), room for the image tokens
ALIAS_DEFAULTS["toy_vision"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=None, max_length=16, response_length=3)


@dataclass
class Args(tl.TrainFlags, tl.EpochFlags, models.PolicyFlags, du.DataFlags, ge.GenerationFlags, pc.ReferenceFlags,
           ps.PromptSharingFlags):
    # shared flags whose default differs here (TRL's DPOConfig on TL;DR)
    learning_rate: float = 1e-6
    warmup_ratio: float = 0.1
    weight_decay: float = 0.0
    eval_steps: int = 500
    num_eval_prompts: int = 256

    # DPO
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    """the preference loss: sigmoid (DPO, cDPO with --label_smoothing), ipo, hinge (SLiC), robust (rDPO)"""
    beta: float = 0.1
    """temperature of the implicit reward beta * log(pi / ref): larger keeps the policy closer to the reference"""
    label_smoothing: float = 0.0
    """probability that a preference label is flipped (cDPO for sigmoid, the noise rate for robust)"""
    rpo_alpha: Optional[float] = None
    """weight of an NLL term on the chosen completion (RPO); None = off"""
    reference_free: bool = False
    """no reference model (its log-probs are 0)"""
    precompute_ref_logprobs: bool = False
    """compute every reference log-prob once before training, then free the reference model"""
    max_eval_pairs: int = 2000
    """evaluate on the first this many held-out pairs (0 = all)"""


# ALGO LOGIC: the preference losses
def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0):
    """Per-pair losses (b,) and implicit rewards beta * log(pi / ref) of chosen and rejected (b,), (b,).

    h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)), eps = label_smoothing:
      sigmoid: -(1 - eps) log s(beta h) - eps log s(-beta h)          DPO (eps = 0), cDPO (Mitchell 2023)
      robust:  (-(1 - eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps)   rDPO (Chowdhury et al. 2024)
      hinge:   max(0, 1 - beta h)                                      SLiC (Zhao et al. 2023)
      ipo:     (h - 1 / (2 beta))^2                                    IPO (Azar et al. 2023)
    For ipo the caller passes length-normalised (per-token mean) log-probs, as TRL does: the IPO target
    1/(2 beta) then does not depend on completion length."""
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    h = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "robust":
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)) \
            / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise UserError(f"unknown --loss_type {loss_type!r}")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def pair_losses(args: Args, policy_logps, ref_logps, lengths):
    """(2b,) completion log-probs (summed over tokens) of policy and reference and (2b,) completion lengths,
    chosen rows then rejected rows -> per-pair losses (b,) (with the RPO term when on) and per-pair metrics."""
    if args.loss_type == "ipo":  # length-normalised log-probs (see dpo_loss)
        policy_logps, ref_logps = policy_logps / lengths, ref_logps / lengths
    policy_chosen, policy_rejected = policy_logps.chunk(2)
    losses, chosen_rewards, rejected_rewards = dpo_loss(policy_chosen, policy_rejected, *ref_logps.chunk(2), args.beta,
                                                        args.loss_type, args.label_smoothing)
    stats = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
             "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
             "rewards/margins": chosen_rewards - rejected_rewards,
             "logps/chosen": policy_chosen.detach(), "logps/rejected": policy_rejected.detach()}
    if args.rpo_alpha is not None:  # NLL of the chosen completion, per token (RPO, Pang et al. 2024, eq. 1)
        chosen_nll = -policy_chosen if args.loss_type == "ipo" else -policy_chosen / lengths.chunk(2)[0]
        stats["nll_loss"] = chosen_nll.detach()
        losses = losses + args.rpo_alpha * chosen_nll
    stats["loss"] = losses.detach()
    return losses, stats


def completion_sums(token_logprobs, query_responses, context_length: int, pad_token_id: int):
    """(2b, R) per-token log-probs -> (log-probs summed over each completion's tokens (2b,), completion lengths
    (2b,)); prompt and padding positions do not count."""
    mask = query_responses[:, context_length:] != pad_token_id
    return (token_logprobs * mask).sum(1), mask.sum(1)


def batch_losses(args, policy, forward: pc.Forward, reference, rows, pad_token_id: int, device):
    """Pairs `rows` -> per-pair losses (b,) and metrics (pair_losses): one policy forward (the one chosen for it: each
    prompt encoded once, packed, ...) over the chosen and the rejected completions together (du.concatenated_inputs);
    reference log-probs precomputed or from the reference."""
    query_responses, context_length = du.concatenated_inputs(rows, pad_token_id)
    query_responses = query_responses.to(device)  # (2b, Lq + R): chosen rows, rejected rows
    images = vision.batch_inputs(rows, copies=2)  # (2b,) the prompts' image inputs, None for text
    token_logprobs = forward.logprobs(policy, query_responses, context_length, images=images)  # (2b, R)
    policy_logps, lengths = completion_sums(token_logprobs, query_responses, context_length, pad_token_id)  # (2b,)
    ref_logps = reference_logps(reference, rows, query_responses, context_length, pad_token_id, images)
    return pair_losses(args, policy_logps, ref_logps, lengths)


# Data: (prompt, chosen, rejected) -> token ids
def tokenize_preferences(tokenizer, dataset, max_prompt_length: int, max_length: int, name: str):
    """Text or conversational pairs -> (rows, dropped): rows of token-id lists `prompt`, `chosen`, `rejected`
    (completions ending with one EOS, du.tokenize_completion, then cut by du.tokenize_prompt_completion's rule); a pair
    with a completion cut to nothing is dropped and counted. A value that is neither text nor a list of messages is a
    UserError. A pair whose prompt has images (du.with_images) keeps them under `images`."""
    rows, dropped = [], 0
    for i, example in enumerate(dataset):
        du.require_text_or_messages({column: example[column] for column in ("prompt", "chosen", "rejected")}, name, i)
        (prompt_ids, chosen_ids), (_, rejected_ids) = [du.tokenize_prompt_completion(
            tokenizer, example["prompt"], example[column], max_prompt_length, max_length, images=example.get("images"))
            for column in ("chosen", "rejected")]
        if not prompt_ids or not chosen_ids or not rejected_ids:
            dropped += 1
            continue
        rows.append({"prompt": prompt_ids, "chosen": chosen_ids, "rejected": rejected_ids,
                     **({"images": example["images"]} if example.get("images") else {})})
    if not rows:
        raise UserError(f"dataset {name!r}: no pair is left after truncation to --max_prompt_length "
                        f"{max_prompt_length} / --max_length {max_length} ({dropped} dropped)")
    return rows, dropped


# Reference log-probs and evaluation: each process takes an even share (ru.even_share), so that every process makes
# the same model calls; results are combined over all processes
def reference_logps(reference, rows, query_responses, context_length, pad_token_id, images=None):
    """(2b,) reference log-probs summed over each completion of the concatenated batch of `rows` (`images`: its image
    inputs): their precomputed `ref_logps` when they have them (--precompute_ref_logprobs), else computed with the
    reference model (no grad)."""
    if "ref_logps" in rows[0]:
        return torch.stack([row["ref_logps"] for row in rows], 1).reshape(-1).to(query_responses.device)
    token_logprobs = reference.logprobs(query_responses, context_length, images=images)
    return completion_sums(token_logprobs, query_responses, context_length, pad_token_id)[0]


@torch.no_grad()
def precompute_reference_logps(reference, rows, batch_size: int, pad_token_id: int, accelerator) -> None:
    """Give each row its `ref_logps` (2,): the reference's log-probs summed over its chosen and rejected completion.
    Each process scores an even share, `batch_size` rows at a time; the shares are gathered (tl.gather_in_order), so
    every process's rows get all of them."""
    def score(share):  # this process's rows -> (len(share), 2): chosen, rejected
        table = []
        for i in range(0, len(share), batch_size):
            batch = share[i:i + batch_size]
            query_responses, context_length = du.concatenated_inputs(batch, pad_token_id)
            logps = reference_logps(reference, batch, query_responses.to(accelerator.device), context_length,
                                    pad_token_id, vision.batch_inputs(batch, copies=2))
            table.append(torch.stack(logps.chunk(2), 1))  # (b, 2)
        return torch.cat(table)

    for row, logps in zip(rows, tl.gather_in_order(rows, score, accelerator)):
        row["ref_logps"] = logps


@torch.no_grad()
def evaluate(args, accelerator, policy, forward, reference, held_out, logger, step):
    """Held-out pairs (`held_out.rows`) -> eval/... preference metrics; greedy completions of the held-out prompts ->
    eval/gold_score (when the task has a gold scorer) and the sample table. Means over every process's items."""
    pad = held_out.tokenizer.pad_token_id
    policy.eval()
    indices, n_real = ru.even_share(list(range(len(held_out.rows))), accelerator)
    sums = {}
    for i in range(0, len(indices), args.per_device_eval_batch_size):
        rows = [held_out.rows[j] for j in indices[i:i + args.per_device_eval_batch_size]]
        _, stats = batch_losses(args, policy, forward, reference, rows, pad, accelerator.device)
        for k, v in stats.items():  # only the first n_real pairs of the share count
            sums[f"eval/{k}"] = sum(v[:max(0, n_real - i)].tolist(), sums.get(f"eval/{k}", 0.0))
    metrics = {**ru.global_means(accelerator, sums, n_real),
               **ge.held_out_completions(policy, held_out, args, accelerator, logger, step)}
    policy.train()
    return metrics


def validate(args: Args) -> None:
    """DPO's own flags (each flag group checked its own in ru.parse_args)."""
    if args.beta <= 0 or (args.rpo_alpha is not None and args.rpo_alpha < 0):
        raise UserError(f"need --beta > 0 and --rpo_alpha >= 0, got {args.beta} and {args.rpo_alpha}")
    if args.loss_type in ("sigmoid", "robust") and not 0 <= args.label_smoothing < 0.5:
        raise UserError(f"--label_smoothing must be in [0, 0.5), got {args.label_smoothing}")
    if args.loss_type in ("ipo", "hinge") and args.label_smoothing != 0:
        raise UserError(f"--label_smoothing applies to sigmoid and robust only, not {args.loss_type}")
    if args.reference_free and (args.precompute_ref_logprobs or args.ref_model):
        raise UserError("--reference_free excludes --precompute_ref_logprobs and --ref_model")
    if args.max_eval_pairs < 0:
        raise UserError(f"--max_eval_pairs must be >= 0, got {args.max_eval_pairs}")


def main() -> None:
    # 1. arguments: validate and derive the batch size once
    args = ru.parse_args(Args, ALIAS_DEFAULTS)
    validate(args)
    args.dataset = args.dataset or ru.default_dataset(args.model)
    policy_path = ru.resolve_model(args.model)
    accelerator = ru.make_accelerator(args)
    batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    ru.seed_everything(args.seed, accelerator.process_index)

    # 2. tokenizer and data (before the models load): pairs, held-out prompts for the gold score, lengths fitted to
    # the data and the model, token ids, the epochs' order
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=args.trust_remote_code)
    pad = tokenizer.pad_token_id
    train_data = du.load_preference_dataset(args.dataset, "train")
    du.require_columns(train_data, ["prompt", "chosen", "rejected"], args.dataset)
    eval_data = du.load_preference_dataset(args.dataset, args.eval_split)
    du.require_columns(eval_data, ["prompt", "chosen", "rejected"], args.dataset)
    if args.max_eval_pairs:
        eval_data = eval_data.select(range(min(args.max_eval_pairs, len(eval_data))))
    images, train_data, eval_data = ru.with_images(args, policy_path, args.dataset, train_data, eval_data)
    scorer = du.gold_scorer(args.dataset) if args.num_eval_prompts else None
    eval_prompts = du.load_held_out_prompts(args.dataset, args.eval_split, args.num_eval_prompts,
                                            images) if scorer else []
    eval_queries = tl.fit_lengths(args, tokenizer, policy_path, du.prompts_of(train_data, eval_data), eval_prompts)
    train_rows, dropped = tokenize_preferences(tokenizer, train_data, args.max_prompt_length, args.max_length,
                                               args.dataset)
    eval_rows, eval_dropped = tokenize_preferences(tokenizer, eval_data, args.max_prompt_length, args.max_length,
                                                   f"{args.dataset}:{args.eval_split}")
    held_out = du.HeldOut(eval_rows, eval_queries, tokenizer, scorer, images and eval_prompts)
    loop = tl.EpochLoop(args, len(train_rows), batch_size, "pairs")

    # 3. models: policy (+ LoRA with --use_peft) with its optimizer and schedule, prepared; reference (frozen copy /
    #    adapter-off base / none); the forward each runs, chosen once it is placed (plumbing/forwards.py: chosen and
    #    rejected rows repeat a prompt, encoded once where that saves enough, ...)
    policy = models.load_policy(policy_path, tokenizer, args)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate,
                                  weight_decay=args.weight_decay)
    scheduler = loop.scheduler(optimizer)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    forwards = fw.Forwards.from_args(args, pad, repeats=ps.Repeats(2 * args.per_device_train_batch_size, 2,
                                                                   args.max_prompt_length,
                                                                   args.max_length - args.max_prompt_length))
    forward = forwards.lm(policy)
    reference = ru.reference_from_flags(args, policy, tokenizer, policy_path, accelerator, forwards,
                                        args.reference_free)

    # 4. the run folder, the state (resumed from --resume_from), the logger; reference log-probs once
    #    (--precompute_ref_logprobs), then the reference model is freed
    output_dir = ru.output_dir(args, args.dataset, accelerator)
    state = dict(step=0, nonfinite_skipped=0)
    logger, optimizer_step = tl.start_or_resume(args, accelerator, policy, optimizer, scheduler, output_dir, state)
    logger.progress(loop.total_steps, state["step"], batch_size, "pairs",
                    ("loss", "rewards/accuracies", "eval/gold_score"))
    if args.precompute_ref_logprobs:
        for rows in (train_rows, eval_rows):
            precompute_reference_logps(reference, rows, args.per_device_eval_batch_size, pad, accelerator)
        reference.free()
    if not args.resume_from:  # step 0: data counts and the evaluation before training
        metrics = evaluate(args, accelerator, policy, forward, reference, held_out, logger, 0)
        logger.log({"data/train_pairs": len(train_rows), "data/dropped": dropped, "data/eval_pairs": len(eval_rows),
                    "data/eval_dropped": eval_dropped, **metrics}, step=0)

    stop = tl.StopSignal()
    policy.train()
    meter = tp.StepMeter(accelerator, models.unwrap(policy))  # perf/*
    micro_batches = acc.micro_batches(args, accelerator, policy)  # or sized by --token_budget
    row_tokens = [du.row_tokens(row) for row in train_rows]  # chosen and rejected, each with its prompt
    for step in loop.steps(state["step"]):
        meter.start()
        # 5. one optimizer step over the next `batch_size` pairs of the epoch's order, micro-batches accumulated
        sums = {}
        for index in micro_batches.split(tl.process_items(loop.batch_index(step), accelerator), row_tokens):
            with micro_batches.accumulate():
                # ALGO LOGIC: one forward over chosen and rejected, per-pair losses (b,), backward
                losses, stats = batch_losses(args, policy, forward, reference, [train_rows[i] for i in index], pad,
                                             accelerator.device)
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
            metrics.update(evaluate(args, accelerator, policy, forward, reference, held_out, logger, step))
        logger.log(metrics, step=step)

        # 7. checkpoints: periodic, and on SIGTERM / Ctrl-C on any process (then every process stops cleanly)
        if tl.checkpoint_or_stop(accelerator, args, output_dir, state, scheduler, stop, loop.total_steps):
            logger.close()
            return

    # 8. final save
    tl.save_model(accelerator, policy, tokenizer, os.path.join(output_dir, "model"), merge_peft=args.merge_peft)
    logger.close(os.path.join(output_dir, "model"))


if __name__ == "__main__":
    ru.main_guard(main)
