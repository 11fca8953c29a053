"""Kahneman-Tversky Optimization (Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306) from unpaired feedback.

Trains a policy on (prompt, completion, label) examples, label True = desirable, with no pairs, no reward model and
no sampling. With r = log pi(y|x) - log pi_ref(y|x) summed over completion tokens and a KL reference point z0:
    desirable:    lambda_D * (1 - sigmoid(beta * (r - z0)))
    undesirable:  lambda_U * (1 - sigmoid(beta * (z0 - r)))
    z0 = max(0, mean over mismatched pairs (x, y') of log pi(y'|x) - log pi_ref(y'|x)), detached, all processes.
Paired data (prompt, chosen, rejected) is unpaired automatically: chosen -> desirable, rejected -> undesirable.

    python kto.py                                   # the offline toy task, about a CPU minute
    accelerate launch kto.py --model pythia-1b      # TL;DR preference data, unpaired

Implementation choices (reference: TRL's KTOTrainer, trl/trainer/kto_trainer.py):
- Mismatched pairs: the examples are shuffled once (seeded) into fixed micro-batches; inside one, example k is
  also scored on example k-1's completion (TRL's _get_kl_dataset rotates by one the same way). So the y' are the
  batch's own completions, never an example's own, and each example's pair is fixed: reference log-probs of
  both can be precomputed (--precompute_ref_logprobs). Each epoch visits the micro-batches in a new order.
- z0 is recomputed every micro-batch, averaged over processes, clamped at 0 and carries no gradient (paper sec.
  4.2; TRL). The policy's log-probs of the mismatched pairs are computed under no_grad.
- There is no reference-free mode: r and z0 are log-ratios against pi_ref; without one the "KL" term would be
  the policy's own log-likelihood of mismatched completions, which KTO's derivation does not support.
- The learning-rate schedule (linear warmup over warmup_ratio, linear decay) spans num_train_epochs;
  --max_steps stops the run early without changing it, so N steps + a resume to 2N == a 2N-step run.
- Logged rewards are beta * r (as TRL's KTOTrainer and dpo.py log them); kl is z0 itself.
- The desirable:undesirable balance: the paper advises lambda_D n_D / (lambda_U n_U) in [1, 4/3]; a warning
  with the matching weight ranges is printed when the data and weights fall outside (toy: 26% desirable, so
  desirable_weight 3).
"""
import functools
import math
import os
import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

import policy_common as pc
from policy_common import UserError

# Toy-task values (applied only to flags not given on the command line); the dataclass holds real-scale values.
ALIAS_DEFAULTS = {
    "toy": dict(learning_rate=2e-4, per_device_train_batch_size=32, gradient_accumulation_steps=1,
                num_train_epochs=1.0, beta=0.1, desirable_weight=3.0, undesirable_weight=1.0,
                max_prompt_length=16, max_length=32, response_length=8, eval_steps=64,
                per_device_eval_batch_size=64, num_eval_examples=512, num_eval_prompts=256),
}


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    model: str = "toy"
    """policy to start from: alias (toy|pythia-1b|pythia-2.8b|pythia-6.9b), hub id or local folder"""
    ref_model: Optional[str] = None
    """frozen reference policy; None = the starting policy (adapter-off base with --use_peft)"""
    dataset: Optional[str] = None
    """unpaired (prompt, completion, label) or paired (prompt, chosen, rejected) data; None = the model's alias"""
    eval_split: str = "test"
    """held-out split for eval/ metrics and greedy generations"""
    output_dir: Optional[str] = None
    """where metrics, checkpoints and the model go; None = runs/<run_name>"""
    track: bool = False
    """log to Weights and Biases"""
    wandb_project: str = "policy-rlhf"
    """wandb project name"""

    # Algorithm specific arguments
    beta: float = 0.1
    """KTO temperature: scales the implicit reward r - z0 inside the sigmoid"""
    desirable_weight: float = 1.0
    """loss weight of desirable examples (lambda_D)"""
    undesirable_weight: float = 1.0
    """loss weight of undesirable examples (lambda_U)"""
    precompute_ref_logprobs: bool = False
    """compute every reference log-prob (own and mismatched completions) once before training, then free the reference"""
    max_prompt_length: int = 512
    """prompts keep their last max_prompt_length tokens"""
    max_length: int = 640
    """prompt + completion tokens; completions are cut from the right to fit"""

    # Optimization
    learning_rate: float = 5e-7
    """AdamW learning rate (peak of the linear schedule)"""
    per_device_train_batch_size: int = 8
    """examples per micro-batch per process (>= 2: the mismatched KL pairs are built inside it)"""
    gradient_accumulation_steps: int = 4
    """micro-batches per optimizer step"""
    num_train_epochs: float = 1.0
    """passes over the training data (sets the learning-rate schedule)"""
    max_steps: Optional[int] = None
    """stop after this many optimizer steps whatever the run length says (the schedule still follows epochs)"""
    warmup_ratio: float = 0.1
    """fraction of the run spent warming the learning rate up linearly from 0"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    skip_nonfinite: bool = False
    """skip optimizer steps whose loss or grad norm is not finite (default: checkpoint and stop)"""

    # Evaluation
    eval_steps: int = 500
    """evaluate every eval_steps optimizer steps (0 = only before training and at the end)"""
    per_device_eval_batch_size: int = 8
    """examples per eval micro-batch per process (>= 2)"""
    num_eval_examples: int = 1024
    """held-out unpaired examples scored for eval/ metrics (0 = all)"""
    num_eval_prompts: int = 64
    """held-out prompts completed greedily for eval/gold_score and samples"""
    response_length: int = 53
    """max new tokens of the greedy eval generations"""

    # Saving
    save_steps: int = 0
    """write a resumable checkpoint every save_steps steps (0 = never)"""
    resume_from: Optional[str] = None
    """checkpoint folder to resume from"""
    merge_peft: bool = False
    """with --use_peft, save merged full weights instead of the adapter"""

    # Model loading
    use_peft: bool = False
    """train a LoRA adapter; the reference is then the adapter-off base"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA alpha"""
    lora_dropout: float = 0.0
    """LoRA dropout (0 keeps the forward deterministic, as log-ratios to the reference assume)"""
    lora_target_modules: Optional[List[str]] = None
    """LoRA target modules (None = PEFT's default for the architecture)"""
    load_in_4bit: bool = False
    """load the policy in 4 bits (QLoRA; needs a GPU and bitsandbytes)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    bf16: bool = False
    """bfloat16 weights (GPU only)"""
    trust_remote_code: bool = False
    """allow custom model code from the hub"""


# ---------------------------------------------------------------------------------------------------------
# ALGO LOGIC: the KTO loss and its KL reference point
# ---------------------------------------------------------------------------------------------------------
def kl_reference_point(kl_policy_logps: torch.Tensor, kl_ref_logps: torch.Tensor, accelerator=None) -> torch.Tensor:
    """z0 = max(0, mean over the mismatched pairs (x, y') of log pi(y'|x) - log pi_ref(y'|x)), (B,) -> ().
    Detached (no gradient flows through the reference point) and averaged over every process's batch."""
    kl = (kl_policy_logps - kl_ref_logps).mean().detach()
    if accelerator is not None and accelerator.num_processes > 1:
        kl = accelerator.reduce(kl, reduction="mean")  # equal batch sizes: mean of means = global mean
    return kl.clamp(min=0)


def kto_losses(rewards: torch.Tensor, z0: torch.Tensor, desirable: torch.Tensor, beta: float,
               desirable_weight: float, undesirable_weight: float) -> torch.Tensor:
    """Per-example KTO loss, (B,) -> (B,), with r = log pi(y|x) - log pi_ref(y|x):
    desirable:   lambda_D * (1 - sigmoid(beta * (r - z0)))
    undesirable: lambda_U * (1 - sigmoid(beta * (z0 - r)))"""
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (rewards - z0)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - rewards)))
    return torch.where(desirable, desirable_losses, undesirable_losses)


def weight_advice(n_desirable: int, n_undesirable: int, desirable_weight: float, undesirable_weight: float) -> Optional[str]:
    """The KTO paper (and TRL) advise lambda_D * n_D / (lambda_U * n_U) in [1, 4/3]; a warning text when outside."""
    if n_desirable == 0 or n_undesirable == 0:
        return f"the training data has {n_desirable} desirable and {n_undesirable} undesirable examples; KTO learns from both"
    ratio = desirable_weight * n_desirable / (undesirable_weight * n_undesirable)
    if 1.0 <= ratio <= 4 / 3:
        return None
    return (f"desirable_weight * n_desirable / (undesirable_weight * n_undesirable) = {ratio:.3f} is outside the "
            f"recommended [1, 4/3] ({n_desirable} desirable, {n_undesirable} undesirable): use EITHER "
            f"--desirable_weight in [{undesirable_weight * n_undesirable / n_desirable:.2f}, "
            f"{undesirable_weight * n_undesirable * 4 / 3 / n_desirable:.2f}] OR --undesirable_weight in "
            f"[{desirable_weight * n_desirable * 3 / 4 / n_undesirable:.2f}, {desirable_weight * n_desirable / n_undesirable:.2f}]")


# ---------------------------------------------------------------------------------------------------------
# Data: unpaired examples, fixed micro-batches with mismatched (prompt, other completion) pairs
# ---------------------------------------------------------------------------------------------------------
def to_unpaired(dataset, name: str):
    """An unpaired dataset (prompt, completion, label: bool) as is; a paired one (prompt, chosen, rejected)
    becomes two rows per pair: (prompt, chosen, True) and (prompt, rejected, False)."""
    from datasets import Dataset

    columns = dataset.column_names
    if "completion" not in columns and "chosen" in columns and "rejected" in columns:
        pc.require_columns(dataset, ["prompt", "chosen", "rejected"], name)
        rows = {"prompt": [], "completion": [], "label": []}
        for prompt, chosen, rejected in zip(dataset["prompt"], dataset["chosen"], dataset["rejected"]):
            rows["prompt"] += [prompt, prompt]
            rows["completion"] += [chosen, rejected]
            rows["label"] += [True, False]
        return Dataset.from_dict(rows)
    pc.require_columns(dataset, ["prompt", "completion", "label"], name)
    dtype = getattr(dataset.features["label"], "dtype", type(dataset.features["label"]).__name__)
    if dtype != "bool":
        raise UserError(f"dataset {name!r}: column 'label' must be boolean (true = desirable), got {dtype}")
    return dataset


def tokenize_unpaired(dataset, tokenizer, max_prompt_length: int, max_length: int, name: str):
    """Rows -> (examples, dropped). Each example: index, prompt_ids, completion_ids (EOS appended), label.
    Rows whose prompt or completion is emptied by truncation are dropped and counted."""
    examples, dropped = [], 0
    for row in dataset:
        prompt = pc.render_prompt(tokenizer, row["prompt"])
        completion = pc.render_completion(tokenizer, row["prompt"], row["completion"])
        prompt_ids, completion_ids = pc.tokenize_prompt_completion(tokenizer, prompt, completion, max_prompt_length, max_length)
        if not prompt_ids or not completion_ids:
            dropped += 1
            continue
        examples.append(dict(index=len(examples), prompt_ids=prompt_ids, completion_ids=completion_ids, label=bool(row["label"])))
    if not examples:
        raise UserError(f"dataset {name!r}: every row was emptied by truncation (max_length {max_length})")
    return examples, dropped


def make_kl_groups(examples: list, group_size: int, seed: int, max_length: int) -> list:
    """Shuffle the examples once (seeded) and cut them into fixed micro-batches of `group_size` (a remainder
    smaller than that is left out). Inside a micro-batch, example k is also scored on the completion of
    example k-1 (a rotation by one, as TRL's _get_kl_dataset): the mismatched pairs (x_k, y_{k-1}) whose
    log-ratios estimate the KL reference point. The mismatched y' are exactly the batch's own completions,
    each with a different prompt, and the pairing is fixed per example, so reference log-probs can be
    precomputed. Adds kl_partner (index) and kl_completion_ids (cut to fit max_length) to each example."""
    if group_size < 2:
        raise UserError(f"batch size {group_size}: KTO needs >= 2 examples per micro-batch for mismatched KL pairs")
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    groups = []
    for start in range(0, len(order) - group_size + 1, group_size):
        group = [dict(examples[i]) for i in order[start:start + group_size]]
        for k, example in enumerate(group):
            partner = group[k - 1]  # k = 0 takes the last example's completion
            example["kl_partner"] = partner["index"]
            example["kl_completion_ids"] = partner["completion_ids"][:max_length - len(example["prompt_ids"])]
        groups.append(group)
    return groups


@functools.lru_cache(maxsize=2)
def epoch_order(n_groups: int, seed: int, epoch: int) -> List[int]:
    return torch.randperm(n_groups, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def step_groups(step: int, n_groups: int, groups_per_step: int, seed: int) -> List[int]:
    """Indices of the micro-batches of optimizer step `step` (0-based): each epoch visits the fixed
    micro-batches in a fresh seeded order, `groups_per_step` (= processes x accumulation) at a time, so the
    data position is a function of the step (nothing else to save for resume)."""
    epoch, position = divmod(step, n_groups // groups_per_step)
    return epoch_order(n_groups, seed, epoch)[position * groups_per_step:(position + 1) * groups_per_step]


def collate(group: list, pad_token_id: int) -> dict:
    """A micro-batch of B examples: query_responses (2B, Lq + R), rows 0..B-1 each prompt with its own
    completion and rows B..2B-1 each prompt with its mismatched completion; context_length Lq; desirable (B,)
    bool; ref_logps (2B,) when precomputed."""
    queries = pc.pad_sequences([e["prompt_ids"] for e in group], pad_token_id, "left")
    responses = pc.pad_sequences([e["completion_ids"] for e in group] + [e["kl_completion_ids"] for e in group],
                                 pad_token_id, "right")
    batch = dict(query_responses=torch.cat([queries.repeat(2, 1), responses], 1), context_length=queries.shape[1],
                 desirable=torch.tensor([e["label"] for e in group]))
    if "ref_logps" in group[0]:
        batch["ref_logps"] = torch.tensor([e["ref_logps"] for e in group] + [e["kl_ref_logps"] for e in group])
    return batch


def completion_logps(logprobs_fn, query_responses: torch.Tensor, context_length: int, pad_token_id: int) -> torch.Tensor:
    """Summed log-prob of each completion, (B, T) -> (B,); `logprobs_fn` has response_logprobs' signature."""
    logprobs = logprobs_fn(query_responses, context_length, pad_token_id)  # (B, R)
    return (logprobs * (query_responses[:, context_length:] != pad_token_id)).sum(1)


def joint_forward(query_responses: torch.Tensor, context_length: int, gradient_checkpointing: bool) -> bool:
    """Score both halves of a collated batch (own and mismatched completions of the same prompts) in ONE policy
    forward, each prompt encoded once and the mismatched half's gradient discarded? Per example that costs
    3 (Lq + 2R) token passes (forward + backward) against 4 (Lq + R) for two forwards: cheaper when the prompt is
    longer than twice the completions (TL;DR), and only when the prompts are really shared (pc.shared_queries;
    not under activation checkpointing, where no key/value cache is kept). Agreed by all processes, so that
    every process makes the same model calls (ZeRO-3)."""
    R = query_responses.shape[1] - context_length
    joint = (not gradient_checkpointing and context_length > 2 * R
             and pc.shared_queries(query_responses, context_length) is not None)
    return pc.all_processes_agree(joint, query_responses.device)


def reference_logps(reference, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                    joint: bool) -> torch.Tensor:
    """(2B, T) collated rows -> (2B,) reference log-probs, in one call or the two halves separately exactly as
    the policy is run (`joint`), so that a policy equal to the reference gives log-ratios of exactly 0."""
    halves = [query_responses] if joint else query_responses.chunk(2)
    return torch.cat([completion_logps(reference.logprobs, h, context_length, pad_token_id) for h in halves])


@torch.no_grad()
def precompute_reference(groups: list, reference, pad_token_id: int, accelerator, gradient_checkpointing: bool) -> None:
    """Store ref_logps and kl_ref_logps in every example. Groups are split across processes and gathered."""
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    per_process = math.ceil(len(groups) / world)
    local = []  # per_process x (2B,): reference log-probs of own and mismatched completions of this process's groups
    for g in range(rank, per_process * world, world):
        batch = collate(groups[min(g, len(groups) - 1)], pad_token_id)  # past the end: a repeat, discarded
        query_responses, ctx = batch["query_responses"].to(device), batch["context_length"]
        joint = joint_forward(query_responses, ctx, gradient_checkpointing)
        local.append(reference_logps(reference, query_responses, ctx, pad_token_id, joint))
    gathered = accelerator.gather(torch.stack(local)).cpu()  # (world * per_process, 2B), process-major
    for p in range(world):
        for k in range(per_process):
            g = k * world + p
            if g < len(groups):
                ref, kl_ref = gathered[p * per_process + k].chunk(2)
                for example, r, kl_r in zip(groups[g], ref.tolist(), kl_ref.tolist()):
                    example["ref_logps"], example["kl_ref_logps"] = r, kl_r


def kto_step(policy, reference, batch: dict, args: Args, pad_token_id: int, accelerator):
    """Forward one micro-batch. Returns the mean KTO loss and the sums behind the logged metrics."""
    device = accelerator.device
    query_responses, ctx = batch["query_responses"].to(device), batch["context_length"]  # (2B, T)
    desirable = batch["desirable"].to(device)
    B = desirable.shape[0]
    policy_logprobs = functools.partial(pc.response_logprobs, policy)
    # 1-2. log pi(y|x) of each example's own completion, with gradient, and log pi(y'|x) of the mismatched pairs
    # (x_k, y_{k-1}), without: in one forward when the prompts are long (see joint_forward), else in two
    joint = joint_forward(query_responses, ctx, args.gradient_checkpointing)
    if joint:
        all_policy_logps = completion_logps(policy_logprobs, query_responses, ctx, pad_token_id)  # (2B,)
        policy_logps, kl_policy_logps = all_policy_logps[:B], all_policy_logps[B:].detach()
    else:
        policy_logps = completion_logps(policy_logprobs, query_responses[:B], ctx, pad_token_id)
        with torch.no_grad():
            kl_policy_logps = completion_logps(policy_logprobs, query_responses[B:], ctx, pad_token_id)
    # the reference on all 2B rows, computed the way the policy was
    all_ref_logps = (batch["ref_logps"].to(device) if "ref_logps" in batch
                     else reference_logps(reference, query_responses, ctx, pad_token_id, joint))
    ref_logps, kl_ref_logps = all_ref_logps[:B], all_ref_logps[B:]
    # 3. KL reference point z0 = max(0, mean log-ratio of the mismatched pairs), detached, over all processes
    z0 = kl_reference_point(kl_policy_logps, kl_ref_logps, accelerator)
    # 4. r = log pi(y|x) - log pi_ref(y|x) and the KTO loss, averaged over the batch
    rewards = policy_logps - ref_logps
    loss = kto_losses(rewards, z0, desirable, args.beta, args.desirable_weight, args.undesirable_weight).mean()
    undesirable = ~desirable
    r, logps = args.beta * rewards.detach(), policy_logps.detach()  # logged rewards are beta * r, as TRL and dpo.py
    sums = {"loss": loss.detach(), "kl": z0, "count/desirable": desirable.sum().float(), "count/undesirable": undesirable.sum().float(),
            "rewards/chosen": (r * desirable).sum(), "rewards/rejected": (r * undesirable).sum(),
            "logps/chosen": (logps * desirable).sum(), "logps/rejected": (logps * undesirable).sum()}
    return loss, sums


def finish_metrics(sums: dict, n_batches: int, accelerator, prefix: str = "") -> dict:
    """Micro-batch sums -> step metrics: loss and kl averaged over micro-batches and processes, rewards and
    logps averaged over the desirable (chosen) or undesirable (rejected) examples of all processes."""
    keys = sorted(sums)
    totals = torch.stack([sums[k].float() for k in keys])
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    t = dict(zip(keys, totals.tolist()))
    out = {"loss": t["loss"] / (n_batches * accelerator.num_processes), "kl": t["kl"] / (n_batches * accelerator.num_processes),
           "count/desirable": t["count/desirable"], "count/undesirable": t["count/undesirable"]}
    for name, count in (("chosen", t["count/desirable"]), ("rejected", t["count/undesirable"])):
        if count > 0:  # a batch without desirable (or undesirable) examples has no mean for them
            out[f"rewards/{name}"], out[f"logps/{name}"] = t[f"rewards/{name}"] / count, t[f"logps/{name}"] / count
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return {prefix + k: v for k, v in out.items()}


def add_sums(total: Optional[dict], sums: dict) -> dict:
    return dict(sums) if total is None else {k: total[k] + v for k, v in sums.items()}


@torch.no_grad()
def evaluate(policy, reference, eval_groups, gen_prompts, scorer, tokenizer, args: Args, accelerator, logger, step: int) -> dict:
    """eval/ metrics: the KTO metrics on held-out unpaired data, and eval/gold_score of greedy completions."""
    world, rank = accelerator.num_processes, accelerator.process_index
    pad = tokenizer.pad_token_id
    policy.eval()
    # 1. KTO loss, rewards and KL on held-out micro-batches (the same number on every process)
    total, n_batches = None, len(eval_groups) // world
    for g in range(rank, n_batches * world, world):
        _, sums = kto_step(policy, reference, collate(eval_groups[g], pad), args, pad, accelerator)
        total = add_sums(total, sums)
    metrics = finish_metrics(total, n_batches, accelerator, prefix="eval/") if total is not None else {}
    # 2. greedy completions of held-out prompts, scored by the gold scorer when the dataset has one
    local_prompts = gen_prompts[rank::world]
    if local_prompts:
        config = pc.make_generation_config(tokenizer, args.response_length, greedy=True)
        queries = pc.pad_sequences(local_prompts, pad, "left").to(accelerator.device)
        query_responses, _ = pc.batch_generation(policy, queries, pad, tokenizer.eos_token_id, config,
                                                 args.per_device_eval_batch_size, accelerator)
        prompt_texts = [tokenizer.decode(q, skip_special_tokens=True) for q in queries]
        response_texts = [tokenizer.decode(r, skip_special_tokens=True) for r in query_responses[:, queries.shape[1]:]]
        rows = [{"prompt": p, "response": r} for p, r in zip(prompt_texts, response_texts)]
        if scorer is not None:
            gold = [scorer(p, r) for p, r in zip(prompt_texts, response_texts)]
            for row, score in zip(rows, gold):
                row["gold_score"] = round(score, 4)
            totals = torch.tensor([sum(gold), len(gold)], device=accelerator.device, dtype=torch.float64)
            totals = accelerator.reduce(totals, reduction="sum") if world > 1 else totals
            metrics["eval/gold_score"] = (totals[0] / totals[1]).item()
        logger.log_samples("eval/samples", rows[:4], step)
    policy.train()
    return metrics


def main():
    # TRY NOT TO MODIFY: arguments, validation, seeding
    args = pc.parse_args(Args, ALIAS_DEFAULTS)
    if args.beta <= 0:
        raise UserError(f"--beta must be > 0, got {args.beta}")
    if args.desirable_weight <= 0 or args.undesirable_weight <= 0:
        raise UserError(f"--desirable_weight and --undesirable_weight must be > 0, got {args.desirable_weight}, {args.undesirable_weight}")
    if args.learning_rate <= 0 or args.num_train_epochs <= 0 or not 0 <= args.warmup_ratio < 1:
        raise UserError("--learning_rate and --num_train_epochs must be > 0 and --warmup_ratio in [0, 1)")
    if args.max_prompt_length <= 0 or args.max_length <= args.max_prompt_length:
        raise UserError(f"need 0 < --max_prompt_length ({args.max_prompt_length}) < --max_length ({args.max_length})")
    if args.per_device_train_batch_size < 2 or args.per_device_eval_batch_size < 2:
        raise UserError("--per_device_train_batch_size and --per_device_eval_batch_size must be >= 2 (KL pairs are built in the batch)")
    if args.gradient_accumulation_steps < 1 or (args.max_steps is not None and args.max_steps < 1):
        raise UserError("--gradient_accumulation_steps and --max_steps must be >= 1")
    if args.resume_from and not os.path.exists(os.path.join(args.resume_from, "trainer_state.json")):
        raise UserError(f"--resume_from {args.resume_from!r} is not a checkpoint (no trainer_state.json)")
    dataset_name = args.dataset or pc.default_dataset(args.model)

    accelerator = pc.make_accelerator(args.gradient_accumulation_steps)
    world = accelerator.num_processes
    batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * world  # examples per optimizer step
    pc.seed_everything(args.seed, accelerator.process_index)

    # 1. data: unpaired train and held-out examples in fixed micro-batches with mismatched pairs, eval prompts
    tokenizer = pc.load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    train_data = to_unpaired(pc.load_any_dataset(dataset_name, "unpaired", "train"), dataset_name)
    eval_data = to_unpaired(pc.load_any_dataset(dataset_name, "unpaired", args.eval_split), dataset_name)
    if args.num_eval_examples:
        eval_data = eval_data.select(range(min(args.num_eval_examples, len(eval_data))))
    examples, dropped = tokenize_unpaired(train_data, tokenizer, args.max_prompt_length, args.max_length, dataset_name)
    eval_examples, eval_dropped = tokenize_unpaired(eval_data, tokenizer, args.max_prompt_length, args.max_length, dataset_name)
    groups = make_kl_groups(examples, args.per_device_train_batch_size, args.seed, args.max_length)
    eval_groups = make_kl_groups(eval_examples, args.per_device_eval_batch_size, args.seed, args.max_length)
    groups_per_step = world * args.gradient_accumulation_steps
    steps_per_epoch = len(groups) // groups_per_step
    if steps_per_epoch == 0 or len(eval_groups) < world:
        raise UserError(f"dataset {dataset_name!r}: {len(examples)} train / {len(eval_examples)} eval examples do not fill one "
                        f"batch ({batch_size} train, {args.per_device_eval_batch_size * world} eval)")
    scorer = pc.gold_scorer(dataset_name)
    gen_prompts = []
    if args.num_eval_prompts > 0:
        prompt_data = pc.load_any_dataset(dataset_name, "prompt", args.eval_split)
        pc.require_columns(prompt_data, ["prompt"], dataset_name)
        prompt_rows = prompt_data.select(range(min(args.num_eval_prompts, len(prompt_data))))["prompt"]
        gen_prompts = [tokenizer(pc.render_prompt(tokenizer, p), add_special_tokens=False)["input_ids"][-args.max_prompt_length:]
                       for p in prompt_rows]
    n_desirable = sum(e["label"] for e in examples)
    advice = weight_advice(n_desirable, len(examples) - n_desirable, args.desirable_weight, args.undesirable_weight)
    if advice and accelerator.is_main_process:
        print(f"warning: {advice}")
    total_steps = max(1, int(args.num_train_epochs * steps_per_epoch))  # the schedule's length
    stop_step = min(total_steps, args.max_steps) if args.max_steps else total_steps

    # 2. models: policy (optionally a LoRA adapter), frozen reference, optimizer and schedule
    policy = pc.load_policy(args, tokenizer)  # (+ LoRA with --use_peft)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    # KTO has no reference-free mode: z0 and r are log-ratios against pi_ref, without it the KL term is meaningless
    reference = pc.create_reference(policy, args.ref_model, tokenizer, args.use_peft, reference_free=False,
                                    accelerator=accelerator, bf16=args.bf16, trust_remote_code=args.trust_remote_code,
                                    policy_name=args.model)
    from transformers import get_scheduler

    # not prepared (accelerate would step it once per process); checkpoints carry its state as JSON
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=math.ceil(args.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    if args.precompute_ref_logprobs:
        # only the micro-batches that steps 0 .. stop_step - 1 visit (all of them unless --max_steps cuts the run)
        used = sorted({g for s in range(stop_step) for g in step_groups(s, len(groups), groups_per_step, args.seed)})
        precompute_reference([groups[g] for g in used], reference, tokenizer.pad_token_id, accelerator,
                             args.gradient_checkpointing)
        precompute_reference(eval_groups, reference, tokenizer.pad_token_id, accelerator, args.gradient_checkpointing)
        if reference.mode == "copy":
            reference.free()

    # TRY NOT TO MODIFY: run folder, logger, resume
    from accelerate.utils import broadcast_object_list

    name = broadcast_object_list([pc.run_name(args.exp_name, dataset_name, args.seed)])[0]  # one clock for all
    output_dir = args.output_dir or (os.path.dirname(os.path.abspath(args.resume_from)) if args.resume_from
                                     else os.path.join("runs", name))
    step, skipped = 0, 0
    if args.resume_from:
        state = pc.load_checkpoint(accelerator, args.resume_from, scheduler)
        step, skipped = state["step"], state.get("nonfinite_skipped", 0)
    logger = pc.MetricsLogger(output_dir, args, accelerator.is_main_process, args.track, args.wandb_project, name,
                              resume_step=step if args.resume_from else None)
    if not args.resume_from:
        logger.log({"data/train_examples": len(examples), "data/desirable": n_desirable, "data/dropped": dropped,
                    "data/eval_examples": len(eval_examples), "data/eval_dropped": eval_dropped}, step=0)
        logger.log(evaluate(policy, reference, eval_groups, gen_prompts, scorer, tokenizer, args, accelerator, logger, 0), step=0)
    stop = pc.StopSignal()
    pad = tokenizer.pad_token_id
    policy.train()

    # 3. training loop: one optimizer step = gradient_accumulation_steps micro-batches on every process
    while step < stop_step:
        t0 = time.time()
        this_step = step_groups(step, len(groups), groups_per_step, args.seed)
        total, lr = None, scheduler.get_last_lr()[0]
        for a in range(args.gradient_accumulation_steps):
            group = groups[this_step[a * world + accelerator.process_index]]
            with accelerator.accumulate(policy):
                loss, sums = kto_step(policy, reference, collate(group, pad), args, pad, accelerator)
                accelerator.backward(loss)
                total = add_sums(total, sums)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(policy.parameters(), args.max_grad_norm)  # None: DeepSpeed clips
                    metrics = finish_metrics(total, args.gradient_accumulation_steps, accelerator)
                    if grad_norm is not None:
                        metrics["grad_norm"] = float(grad_norm)
                    bad = [k for k in ("loss", "grad_norm") if not math.isfinite(metrics.get(k, 0.0))]
                    if bad and not args.skip_nonfinite:
                        pc.save_checkpoint(accelerator, os.path.join(output_dir, "checkpoint-nonfinite"),
                                           {"step": step, "nonfinite_skipped": skipped}, scheduler)
                        raise UserError(f"non-finite {', '.join(bad)} at step {step + 1}; last good state saved to "
                                        f"{output_dir}/checkpoint-nonfinite (or pass --skip_nonfinite)")
                    if bad:
                        skipped += 1
                    else:
                        optimizer.step()
                    optimizer.zero_grad()
        scheduler.step()
        step += 1
        # TRY NOT TO MODIFY: logging, evaluation, checkpoints
        elapsed = time.time() - t0
        logger.log({**metrics, "lr": lr, "epoch": step / steps_per_epoch,
                    "nonfinite/skipped": skipped, "time/step_seconds": elapsed,
                    "time/samples_per_second": batch_size / elapsed}, step=step)
        if (args.eval_steps and step % args.eval_steps == 0) or step == stop_step:
            logger.log(evaluate(policy, reference, eval_groups, gen_prompts, scorer, tokenizer, args, accelerator, logger, step), step=step)
        if (args.save_steps and step % args.save_steps == 0) or stop.received:
            pc.save_checkpoint(accelerator, os.path.join(output_dir, f"checkpoint-{step}"), {"step": step, "nonfinite_skipped": skipped}, scheduler)
        if stop.received:
            accelerator.print(f"{stop.received} received: checkpoint-{step} written; resume with --resume_from")
            logger.close()
            return

    # 4. final save
    pc.save_model(accelerator, policy, tokenizer, os.path.join(output_dir, "model"), merge_peft=args.merge_peft)
    logger.close()
    accelerator.print(f"saved to {output_dir}/model")


if __name__ == "__main__":
    pc.main_guard(main)
