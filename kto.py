"""Kahneman-Tversky Optimization (Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306) from unpaired feedback:
(prompt, completion, label) examples, label True = desirable (pairs are unpaired: chosen desirable, rejected not);
no reward model, no sampling. With r = log pi(y|x) - log pi_ref(y|x) summed over completion tokens, a KL reference z0:
    desirable:    lambda_D * (1 - sigmoid(beta * (r - z0)))
    undesirable:  lambda_U * (1 - sigmoid(beta * (z0 - r)))
    z0 = max(0, mean over mismatched pairs (x, y') of log pi(y'|x) - log pi_ref(y'|x)), detached, all processes.
Reference implementation: TRL's KTOTrainer; choices: docs/offline.md; metrics: docs/metrics.md.

    python kto.py                                   # the offline toy task, about a CPU minute
    accelerate launch kto.py --model pythia-1b      # TL;DR preference data, unpaired
"""

import functools
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

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

# Toy-task values (applied only to flags not given on the command line); the dataclass holds real-scale values.
ALIAS_DEFAULTS = {
    "toy": dict(learning_rate=2e-4, per_device_train_batch_size=32, gradient_accumulation_steps=1,
                num_train_epochs=1.0, beta=0.1, desirable_weight=3.0, undesirable_weight=1.0,
                max_prompt_length=16, max_length=32, response_length=8, eval_steps=64,
                per_device_eval_batch_size=64, num_eval_examples=512, num_eval_prompts=256),
}
# toy_hard: its labels are imbalanced (about 7% desirable): class weights from the counts (`loss_weights`); beta 1.0:
# the undesirable examples are the reference's own samples, so z0 stays 0 and only beta bounds how far they (and the
# EOS token they share with the good answers) are pushed down (benchmark/results/kto_toy_hard.md)
ALIAS_DEFAULTS["toy_hard"] = dict(ALIAS_DEFAULTS["toy"], response_length=10, desirable_weight=None,
                                  undesirable_weight=None, beta=1.0)
# toy_vision (toy_vision.py): its unpaired examples (about half right: weights from the counts), room for image tokens
ALIAS_DEFAULTS["toy_vision"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=None, max_length=16, response_length=3,
                                    desirable_weight=None, undesirable_weight=None)


@dataclass
class Args(tl.TrainFlags, tl.EpochFlags, models.PolicyFlags, du.DataFlags, ge.GenerationFlags, pc.ReferenceFlags,
           ps.PromptSharingFlags):
    # shared flags whose default differs here (TRL's KTOConfig)
    learning_rate: float = 5e-7
    gradient_accumulation_steps: int = 4
    warmup_ratio: float = 0.1
    eval_steps: int = 500
    num_eval_prompts: int = 64

    # KTO
    beta: float = 0.1
    """scale of the implicit reward beta * (log(pi / ref) - z0) inside the sigmoid (larger: closer to the reference)"""
    desirable_weight: Optional[float] = None
    """loss weight of desirable examples (lambda_D); None = from the training data's counts (see loss_weights)"""
    undesirable_weight: Optional[float] = None
    """loss weight of undesirable examples (lambda_U); None = from the training data's counts (see loss_weights)"""
    precompute_ref_logprobs: bool = False
    """compute every reference log-prob once before training, then free the reference model"""
    num_eval_examples: int = 1024
    """held-out unpaired examples scored for eval/ metrics (0 = all)"""


# ALGO LOGIC: the KTO loss, its KL reference point and the class weights
def kl_reference_point(kl_policy_logps: torch.Tensor, kl_ref_logps: torch.Tensor, accelerator=None) -> torch.Tensor:
    """z0 = max(0, mean over the mismatched pairs (x, y') of log pi(y'|x) - log pi_ref(y'|x)), (B,) -> ().
    Detached (no gradient flows through the reference point) and averaged over every process's batch."""
    kl = (kl_policy_logps - kl_ref_logps).mean().detach()
    if accelerator is not None and accelerator.num_processes > 1:
        kl = accelerator.reduce(kl, reduction="mean")  # equal batch sizes: mean of means = global mean
    return kl.clamp(min=0)


def kto_losses(rewards: torch.Tensor, z0: torch.Tensor, desirable: torch.Tensor, beta: float,
               desirable_weight: float, undesirable_weight: float) -> torch.Tensor:
    """Per-example KTO loss (B,) -> (B,) of the rewards r = log pi(y|x) - log pi_ref(y|x) (module docstring)."""
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (rewards - z0)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - rewards)))
    return torch.where(desirable, desirable_losses, undesirable_losses)


def loss_weights(n_desirable: int, n_undesirable: int, desirable_weight: Optional[float] = None,
                 undesirable_weight: Optional[float] = None) -> Tuple[float, float]:
    """(lambda_D, lambda_U): a given weight is kept; a None one follows the paper's rule lambda_D n_D / (lambda_U n_U)
    in [1, 4/3] at ratio 1: both None -> the smaller class gets n_larger / n_smaller, the other 1.0; one given ->
    the other balances it. A class without examples leaves nothing to balance (None -> 1.0)."""
    if n_desirable == 0 or n_undesirable == 0:
        return desirable_weight or 1.0, undesirable_weight or 1.0
    if desirable_weight is None and undesirable_weight is None:
        larger = max(n_desirable, n_undesirable)
        return larger / n_desirable, larger / n_undesirable
    if desirable_weight is None:
        return undesirable_weight * n_undesirable / n_desirable, undesirable_weight
    if undesirable_weight is None:
        return desirable_weight, desirable_weight * n_desirable / n_undesirable
    return desirable_weight, undesirable_weight


def weight_advice(n_desirable: int, n_undesirable: int, desirable_weight: float,
                  undesirable_weight: float) -> Optional[str]:
    """The KTO paper (and TRL) advise lambda_D * n_D / (lambda_U * n_U) in [1, 4/3]; a warning text when outside."""
    if n_desirable == 0 or n_undesirable == 0:
        return (f"the training data has {n_desirable} desirable and {n_undesirable} undesirable examples; "
                "KTO learns from both")
    d, u = desirable_weight * n_desirable, undesirable_weight * n_undesirable
    if 1.0 - 1e-9 <= d / u <= 4 / 3 + 1e-9:  # derived weights give 1 up to float rounding
        return None
    return (f"desirable_weight * n_desirable / (undesirable_weight * n_undesirable) = {d / u:.3f} is outside the "
            f"recommended [1, 4/3] ({n_desirable} desirable, {n_undesirable} undesirable): use EITHER "
            f"--desirable_weight in [{u / n_desirable:.2f}, {u * 4 / 3 / n_desirable:.2f}] OR --undesirable_weight "
            f"in [{d * 3 / 4 / n_undesirable:.2f}, {d / n_undesirable:.2f}]")


def kto_step(policy, forward, reference, batch: dict, args: Args, pad_token_id: int, accelerator):
    """Forward one micro-batch of B examples (`forward`: the policy's; sharing prompts: `kto_forwards`). Returns the
    mean KTO loss and the sums behind the logged metrics."""
    joint = forward.shares_prompts
    device = accelerator.device
    query_responses, ctx = batch["query_responses"].to(device), batch["context_length"]  # (2B, T)
    desirable = batch["desirable"].to(device)
    # log pi(y|x) of each example's own completion, with gradient, and log pi(y'|x) of its mismatched pair
    # (x_k, y_{k-1}), without; the reference's the same way (unless precomputed), first: its forward's memory is
    # free again before the policy's activations are kept for the backward
    images, pad = batch["images"], pad_token_id  # (2B,) the prompts' image inputs, None for text
    all_ref_logps = (batch["ref_logps"].to(device) if "ref_logps" in batch
                     else completion_logprob_sums(reference.logprobs, query_responses, ctx, pad, joint, images))
    ref_logps, kl_ref_logps = all_ref_logps.chunk(2)
    policy_logps, kl_policy_logps = policy_logprob_sums(policy, forward, query_responses, ctx, pad_token_id, joint,
                                                        images).chunk(2)
    z0 = kl_reference_point(kl_policy_logps, kl_ref_logps, accelerator)
    rewards = policy_logps - ref_logps
    loss = kto_losses(rewards, z0, desirable, args.beta, args.desirable_weight, args.undesirable_weight).mean()
    undesirable = ~desirable
    r, logps = args.beta * rewards.detach(), policy_logps.detach()  # logged rewards are beta * r, as TRL and dpo.py
    sums = {"loss": loss.detach(), "kl": z0,
            "count/desirable": desirable.sum().float(), "count/undesirable": undesirable.sum().float(),
            "rewards/chosen": (r * desirable).sum(), "rewards/rejected": (r * undesirable).sum(),
            "logps/chosen": (logps * desirable).sum(), "logps/rejected": (logps * undesirable).sum()}
    return loss, sums


def finish_metrics(sums: dict, n_batches: int, accelerator, prefix: str = "") -> dict:
    """Micro-batch sums -> metrics (one all-reduce): loss and kl averaged over the micro-batches of all processes,
    rewards and logps over the desirable (chosen) or undesirable (rejected) examples of all processes."""
    keys = sorted(sums)
    totals = torch.stack([sums[k].float() for k in keys])
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    t = dict(zip(keys, totals.tolist()))
    n = n_batches * accelerator.num_processes
    out = {"loss": t["loss"] / n, "kl": t["kl"] / n, "count/desirable": t["count/desirable"],
           "count/undesirable": t["count/undesirable"]}
    for name, count in (("chosen", t["count/desirable"]), ("rejected", t["count/undesirable"])):
        if count > 0:  # a batch without desirable (or undesirable) examples has no mean for them
            out[f"rewards/{name}"], out[f"logps/{name}"] = t[f"rewards/{name}"] / count, t[f"logps/{name}"] / count
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return {prefix + k: v for k, v in out.items()}


# Log-probs of own and mismatched completions: each prompt encoded once or twice, the reference precomputed
def kto_forwards(args, pad_token_id: int) -> fw.Forwards:
    """The run's forwards (plumbing/forwards.py): both halves of a micro-batch (own and mismatched completions) with
    each prompt encoded once (joint: `policy_logprob_sums`) where that saves enough: Lq + 2R positions forward and Lq +
    R backward, 3 Lq + 4R against 4 (Lq + R) in two forwards, for prompts over twice the completions (TL;DR:
    benchmark/results/speed_tldr.md), never under activation checkpointing (no key/value cache)."""
    R = args.max_length - args.max_prompt_length
    joint = not args.gradient_checkpointing and args.max_prompt_length > 2 * R
    repeats = ps.Repeats(2 * args.per_device_train_batch_size, 2, args.max_prompt_length, R) if joint else None
    return fw.Forwards.from_args(args, pad_token_id, repeats=repeats)


def completion_logprob_sums(logprobs_fn, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                            joint: bool, images=None) -> torch.Tensor:
    """(2B, T) collated rows (and their (2B,) `images`, None: text) -> (2B,) log p(completion | prompt) under a model
    (`logprobs_fn(rows, context_length, images=)` -> (b, R) log-probs, by a forward that shares prompts when `joint`):
    all rows in one call, each prompt encoded once (`joint`), or the own half and then the mismatched half, without
    gradient, in two calls."""
    def summed(rows, rows_images):  # (b, T) -> (b,) response log-probs summed over the real tokens
        logprobs = logprobs_fn(rows, context_length, images=rows_images)  # (b, R)
        return (logprobs * (rows[:, context_length:] != pad_token_id)).sum(1)

    if joint:
        return summed(query_responses, images)
    own, mismatched = query_responses.chunk(2)
    own_logps = summed(own, images and images[:len(own)])
    with torch.no_grad():
        mismatched_logps = summed(mismatched, images and images[len(own):])
    return torch.cat([own_logps, mismatched_logps])


def policy_logprob_sums(policy, forward, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                        joint: bool, images=None) -> torch.Tensor:
    """`completion_logprob_sums` of the policy (run by its `forward`), (2B, T) -> (2B,), the mismatched half (rows
    B..2B-1) without gradient. Joint: each prompt encoded once, with gradient; the mismatched completions run on a
    no-grad fork of its keys and values, then the own completions with gradient (`grad_rows`,
    prompt_sharing.split_logits), so that nothing of the mismatched half is kept for the backward. Else two
    forwards."""
    grad_rows = len(query_responses) // 2 if joint else None
    logprobs_fn = functools.partial(forward.logprobs, policy, grad_rows=grad_rows)
    return completion_logprob_sums(logprobs_fn, query_responses, context_length, pad_token_id, joint, images)


@torch.no_grad()
def precompute_reference(groups: list, reference, pad_token_id: int, accelerator, joint: bool) -> None:
    """Store ref_logps and kl_ref_logps in every example: the groups in even shares over the processes (the same
    model calls everywhere), the results gathered back in order (tl.gather_in_order)."""
    def score(share):  # this process's groups -> (len(share), 2B): own completions, then mismatched ones
        return torch.stack([completion_logprob_sums(reference.logprobs, b["query_responses"].to(accelerator.device),
                                                    b["context_length"], pad_token_id, joint, b["images"])
                            for b in (collate(group, pad_token_id) for group in share)])

    for group, logps in zip(groups, tl.gather_in_order(groups, score, accelerator).cpu()):
        ref, kl_ref = logps.chunk(2)
        for example, r, kl_r in zip(group, ref.tolist(), kl_ref.tolist()):
            example["ref_logps"], example["kl_ref_logps"] = r, kl_r


# Data: unpaired examples, fixed micro-batches with mismatched (prompt, other completion) pairs
def make_kl_groups(examples: list, group_size: int, seed: int, max_length: int) -> list:
    """Fixed micro-batches of `group_size` shuffled examples (a remainder is left out); inside one, example k is also
    scored on example k-1's completion, the mismatched pair (x_k, y_{k-1}): each example gets kl_partner (index)
    and kl_completion_ids (cut to fit max_length)."""
    if group_size < 2:
        raise UserError(f"batch size {group_size}: KTO needs >= 2 examples per micro-batch for mismatched KL pairs")
    order, groups = du.epoch_permutation(len(examples), seed, 0), []
    for start in range(0, len(order) - group_size + 1, group_size):
        group = [dict(examples[i]) for i in order[start:start + group_size]]
        for k, example in enumerate(group):
            partner = group[k - 1]  # k = 0 takes the last example's completion
            example["kl_partner"] = partner["index"]
            example["kl_completion_ids"] = partner["completion_ids"][:max_length - len(example["prompt_ids"])]
        groups.append(group)
    return groups


def collate(group: list, pad_token_id: int) -> dict:
    """A micro-batch of B examples: query_responses (2B, Lq + R), rows 0..B-1 each prompt with its own
    completion and rows B..2B-1 each prompt with its mismatched completion; context_length Lq; desirable (B,)
    bool; images (2B,): their prompts' image inputs (None: text); ref_logps (2B,) when precomputed."""
    query_responses, context_length = du.concatenated_inputs(group, pad_token_id, prompt="prompt_ids",
                                                             completions=("completion_ids", "kl_completion_ids"))
    batch = dict(query_responses=query_responses, context_length=context_length,
                 desirable=torch.tensor([e["label"] for e in group]), images=vision.batch_inputs(group, copies=2))
    if "ref_logps" in group[0]:
        batch["ref_logps"] = torch.tensor([e["ref_logps"] for e in group] + [e["kl_ref_logps"] for e in group])
    return batch


@torch.no_grad()
def evaluate(args, accelerator, policy, forward, reference, held_out, logger, step: int):
    """The KTO metrics of the held-out micro-batches (`held_out.rows`: len // processes on each, the rest left out)
    and greedy completions of the held-out prompts -> eval/gold_score (when the task has a gold scorer) and the
    sample table."""
    world, pad = accelerator.num_processes, held_out.tokenizer.pad_token_id
    policy.eval()
    n_batches, total = len(held_out.rows) // world, {}
    for group in held_out.rows[accelerator.process_index:n_batches * world:world]:
        _, sums = kto_step(policy, forward, reference, collate(group, pad), args, pad, accelerator)
        total = {k: total.get(k, 0) + v for k, v in sums.items()}
    metrics = {**finish_metrics(total, n_batches, accelerator, prefix="eval/"),
               **ge.held_out_completions(policy, held_out, args, accelerator, logger, step)}
    policy.train()
    return metrics


def validate(args: Args) -> None:
    """KTO's own flags (each flag group checked its own in ru.parse_args)."""
    if args.beta <= 0 or any(w is not None and w <= 0 for w in (args.desirable_weight, args.undesirable_weight)):
        raise UserError(f"--beta, --desirable_weight and --undesirable_weight must be > 0, got {args.beta}, "
                        f"{args.desirable_weight}, {args.undesirable_weight}")
    if args.per_device_train_batch_size < 2 or args.per_device_eval_batch_size < 2:
        raise UserError("--per_device_train_batch_size and --per_device_eval_batch_size must be >= 2 "
                        "(KL pairs are built in the batch)")
    if args.token_budget is not None:
        raise UserError("--token_budget: kto.py's micro-batch is also the group its KL baseline is estimated over, "
                        "fixed at --per_device_train_batch_size examples; leave --token_budget out")


def main():
    # 1. arguments: validate and derive the batch sizes once
    args = ru.parse_args(Args, ALIAS_DEFAULTS)
    validate(args)
    dataset_name, policy_path = args.dataset or ru.default_dataset(args.model), ru.resolve_model(args.model)
    accelerator = ru.make_accelerator(args)
    world = accelerator.num_processes
    groups_per_step = world * args.gradient_accumulation_steps  # micro-batches per optimizer step, all processes
    batch_size = args.per_device_train_batch_size * groups_per_step  # examples per optimizer step
    ru.seed_everything(args.seed, accelerator.process_index)

    # 2. tokenizer and data (before any model loads): unpaired train and held-out examples, held-out prompts, lengths
    # fitted to the data and the model, fixed micro-batches with mismatched pairs and the epochs' order over them
    # (groups_per_step micro-batches per step), the class weights
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=args.trust_remote_code)
    pad = tokenizer.pad_token_id
    train_data = du.to_unpaired(du.load_unpaired_dataset(dataset_name, "train"), dataset_name)
    eval_data = du.to_unpaired(du.load_unpaired_dataset(dataset_name, args.eval_split), dataset_name)
    eval_data = eval_data.select(range(min(args.num_eval_examples or len(eval_data), len(eval_data))))
    images, train_data, eval_data = ru.with_images(args, policy_path, dataset_name, train_data, eval_data)
    eval_prompts = du.load_held_out_prompts(dataset_name, args.eval_split, args.num_eval_prompts, images)
    eval_queries = tl.fit_lengths(args, tokenizer, policy_path, du.prompts_of(train_data, eval_data), eval_prompts,
                                  cut_held_out=True)
    (examples, dropped), (eval_examples, eval_dropped) = (du.tokenize_unpaired(
        data, tokenizer, args.max_prompt_length, args.max_length, dataset_name) for data in (train_data, eval_data))
    groups = make_kl_groups(examples, args.per_device_train_batch_size, args.seed, args.max_length)
    eval_groups = make_kl_groups(eval_examples, args.per_device_eval_batch_size, args.seed, args.max_length)
    if len(groups) < groups_per_step or len(eval_groups) < world:
        raise UserError(f"dataset {dataset_name!r}: {len(examples)} train / {len(eval_examples)} eval examples do not "
                        f"fill one batch ({batch_size} train, {args.per_device_eval_batch_size * world} eval)")
    held_out = du.HeldOut(eval_groups, eval_queries, tokenizer, du.gold_scorer(dataset_name), images and eval_prompts)
    loop = tl.EpochLoop(args, len(groups), groups_per_step, "samples", rows_per_item=args.per_device_train_batch_size,
                        per_step_time=True)
    n_desirable = sum(e["label"] for e in examples)
    n_undesirable = len(examples) - n_desirable  # the class weights from the counts where not given
    args.desirable_weight, args.undesirable_weight = loss_weights(n_desirable, n_undesirable, args.desirable_weight,
                                                                  args.undesirable_weight)
    advice = weight_advice(n_desirable, n_undesirable, args.desirable_weight, args.undesirable_weight)
    accelerator.print(f"loss weights: desirable {args.desirable_weight:.4g}, undesirable {args.undesirable_weight:.4g} "
                      f"({n_desirable} desirable, {n_undesirable} undesirable examples)"
                      + (f"\nwarning: {advice}" if advice else ""))

    # 3. models: policy (+ LoRA with --use_peft) and its optimizer, prepared; the frozen reference; the schedule; the
    #    forward each runs, chosen once (plumbing/forwards.py; joint: each prompt encoded once for both halves)
    policy = models.load_policy(policy_path, tokenizer, args)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate,
                                  weight_decay=args.weight_decay)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    forwards = kto_forwards(args, pad)
    forward = forwards.lm(policy)
    joint = forward.shares_prompts
    reference = ru.reference_from_flags(args, policy, tokenizer, policy_path, accelerator, forwards)
    scheduler = loop.scheduler(optimizer)

    # 4. reference log-probs once (--precompute_ref_logprobs) of the micro-batches the run visits (all of them unless
    # --max_steps cuts it), the run folder, the state (resumed from --resume_from), the logger
    if args.precompute_ref_logprobs:
        used = sorted({g for step in range(1, loop.total_steps + 1) for g in loop.batch_index(step)})
        precompute_reference([groups[g] for g in used], reference, pad, accelerator, joint)
        precompute_reference(eval_groups, reference, pad, accelerator, joint)
        if reference.mode == "copy":
            reference.free()
    output_dir = ru.output_dir(args, dataset_name, accelerator)
    state = dict(step=0, nonfinite_skipped=0)
    logger, optimizer_step = tl.start_or_resume(args, accelerator, policy, optimizer, scheduler, output_dir, state)
    logger.progress(loop.total_steps, state["step"], batch_size, "examples", ("loss", "kl", "eval/gold_score"))
    if not args.resume_from:  # step 0: data counts and the evaluation before training
        logger.log({"data/train_examples": len(examples), "data/desirable": n_desirable, "data/dropped": dropped,
                    "data/eval_examples": len(eval_examples), "data/eval_dropped": eval_dropped,
                    "data/desirable_weight": args.desirable_weight, "data/undesirable_weight": args.undesirable_weight},
                   step=0)
        logger.log(evaluate(args, accelerator, policy, forward, reference, held_out, logger, 0), step=0)

    stop = tl.StopSignal()
    policy.train()
    meter = tp.StepMeter(accelerator, models.unwrap(policy))  # perf/*
    micro_batches = acc.micro_batches(args, accelerator, policy)  # equal ones: a micro-batch is a KL group
    group_tokens = [sum(du.row_tokens(e, ("completion_ids", "kl_completion_ids"), "prompt_ids") for e in group)
                    for group in groups]  # each example with its own and its mismatched completion
    for step in loop.steps(state["step"]):
        meter.start()
        # 5. one optimizer step: the epoch's next gradient_accumulation_steps micro-batches on every process
        total, losses = {}, []
        for (group_index,) in micro_batches.split(tl.process_items(loop.batch_index(step), accelerator)):
            with micro_batches.accumulate():  # one group of examples each
                loss, sums = kto_step(policy, forward, reference, collate(groups[group_index], pad), args, pad,
                                      accelerator)
                losses.append(micro_batches.backward(loss))
            total = {k: total.get(k, 0) + v for k, v in sums.items()}
        grad_norm = optimizer_step(torch.stack(losses), state, step)  # clip, check, step, schedule
        state.update(step=step, nonfinite_skipped=optimizer_step.skipped)

        # 6. log, evaluate every eval_steps steps and after the last
        metrics = finish_metrics(total, args.gradient_accumulation_steps, accelerator)
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        logger.log({**metrics, **loop.metrics(step, optimizer_step),
                    **meter.metrics(sum(group_tokens[g] for g in loop.batch_index(step)))}, step=step)
        if loop.evaluate_now(step):
            logger.log(evaluate(args, accelerator, policy, forward, reference, held_out, logger, step), step=step)

        # 7. checkpoints: periodic, and on SIGTERM / Ctrl-C on any process (then every process stops cleanly)
        if tl.checkpoint_or_stop(accelerator, args, output_dir, state, scheduler, stop, loop.total_steps):
            logger.close()
            return

    # 8. final save
    tl.save_model(accelerator, policy, tokenizer, os.path.join(output_dir, "model"), merge_peft=args.merge_peft)
    logger.close(os.path.join(output_dir, "model"))


if __name__ == "__main__":
    ru.main_guard(main)
