"""Group Relative Policy Optimization (GRPO): Shao et al. 2024, "DeepSeekMath" (https://arxiv.org/abs/2402.03300),
and the variants that change one line of it: Dr. GRPO (Liu et al. 2025), DAPO (Yu et al. 2025), GSPO (Zheng et al.
2025); docs/grpo.md says which flags make each. Per step: sample num_generations completions per prompt, advantage =
(reward - group mean) / (group std + 1e-4), then num_iterations steps on the clipped surrogate (+ beta x k3 KL to the
reference). Flags and defaults: TRL 1.16's GRPOConfig; metrics: docs/metrics.md; options: --help and docs/.

    python grpo.py                                  # the toy task on a CPU, about a minute
    python grpo.py --model toy_tools                # the toy tool world: multi-turn episodes with a lookup tool
    accelerate launch grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset <prompts> --reward_funcs file.py:fn
"""
import math
import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

import policy_common as pc
from plumbing import accumulation as acc
from plumbing import data_utils as du
from plumbing import episodes as ep
from plumbing import evaluation as ev
from plumbing import models, packing
from plumbing import prompt_sharing as ps
from plumbing import reward_sources as rs
from plumbing import rollout as ro
from plumbing import run_ahead as ra
from plumbing import run_utils as ru
from plumbing import throughput as tp
from plumbing import train_loop as tl
from plumbing import vllm_generation as vg
from plumbing.errors import RolloutError, UserError


@dataclass
class EntropyFlags:
    """grpo.py's entropy bonus and Skywork-OR1's adaptive control of it (TRL 1.16's names and defaults)"""
    entropy_coef: float = 0.0
    """entropy bonus: the loss minus entropy_coef x the mean token entropy (with --use_adaptive_entropy: its start)"""
    use_adaptive_entropy: bool = False
    """Skywork-OR1: each optimizer step entropy_coef grows by --entropy_coef_delta while the entropy is <=
    --entropy_target, else shrinks; the bonus applies only at or below the target"""
    entropy_coef_min: float = 0.0
    """with --use_adaptive_entropy: the smallest entropy_coef"""
    entropy_coef_max: float = 1.0
    """with --use_adaptive_entropy: the largest entropy_coef"""
    entropy_coef_delta: float = 0.005
    """with --use_adaptive_entropy: entropy_coef's change per optimizer step"""
    entropy_target: float = 0.2
    """with --use_adaptive_entropy: the mean token entropy (nats) at or below which the bonus applies"""


@dataclass
class Args(tl.TrainFlags, models.PolicyFlags, du.DataFlags, ro.RolloutFlags, pc.ReferenceFlags, rs.RewardFlags,
           tl.KLControlFlags, ps.PromptSharingFlags, vg.VLLMFlags, ra.AsyncFlags, ep.ToolFlags, EntropyFlags):
    # shared flags whose default differs here (TRL 1.16's GRPOConfig)
    learning_rate: float = 1e-6
    response_length: int = 512

    # GRPO (names and defaults of TRL 1.16's GRPOConfig)
    num_generations: int = 8
    """completions sampled per prompt (the group of the group-relative advantage)"""
    scale_rewards: Literal["group", "batch", "none", "maxrl"] = "group"
    """divide advantages by the std of the group's rewards, of the whole batch's, not at all (none = Dr. GRPO), or by
    the group's mean reward (maxrl: MaxRL, Tajwar et al. 2026, for pass rates: a group of mean <= 0 gets 0)"""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """several reward sources: normalise their weighted sum (--scale_rewards), or each in its group, then the weighted
    sum over the batch (normalize_then_sum: GDPO)"""
    reward_variance_filtering: Optional[Literal["top_p", "top_k"]] = None
    """train on the groups of highest reward variance only (RAGEN-2): the fewest holding --reward_variance_top_p of
    the summed variance, or the --reward_variance_top_k largest; None: every group"""
    reward_variance_top_p: float = 0.9
    """with --reward_variance_filtering top_p: the fraction of the batch's summed group reward variance kept"""
    reward_variance_top_k: int = 1
    """with --reward_variance_filtering top_k: the number of groups kept, over all processes"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """how token losses become the step's loss: grpo (sequence means), bnpo (token mean per micro-batch), dr_grpo
    (token sum / constant), dapo (token mean over the global batch); see aggregate_loss"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """one importance ratio per token, or one per sequence from the mean token log-ratio (sequence = GSPO; with
    --loss_type bnpo, dr_grpo or dapo, which sum token losses, each sequence then weighs by its length: a warning)"""
    epsilon: float = 0.2
    """lower clip range of the importance ratio: ratio >= 1 - epsilon"""
    epsilon_high: Optional[float] = None
    """upper clip range: ratio <= 1 + epsilon_high (DAPO's clip-higher: 0.28); None = epsilon"""
    num_iterations: int = 1
    """mu: optimizer steps on each generated batch (1: the ratio is 1 and no old-log-prob forward runs)"""
    beta: float = 0.0
    """weight of the k3 KL-to-reference term added to each token's loss (0: no reference model is loaded)"""
    use_bias_correction_kl: bool = True
    """multiply each token's KL term by its ratio pi / pi_old (DeepSeek-V3.2's unbiased KL gradient; on-policy too)"""
    off_policy_mask_threshold: Optional[float] = None
    """drop from the surrogate completions of negative advantage whose mean log(pi_sampler / pi) is above this
    (DeepSeek-V3.2's delta: 0.5, say); None: off"""
    top_entropy_quantile: float = 1.0
    """train the surrogate on this top fraction of tokens by entropy only ("Beyond the 80/20 rule": 0.2); 1: all"""
    mask_truncated_completions: bool = False
    """leave completions without EOS (cut at response_length) out of the loss (DAPO)"""
    skip_zero_std_groups: bool = False
    """leave groups whose rewards are all equal (zero advantage) out of the loss and its normalisation"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: sample more prompts until the batch is filled with groups whose rewards differ"""
    dynamic_sampling_max_rounds: int = 8
    """with --dynamic_sampling, at most this many rollouts per step (then flat groups fill the rest, counted)"""
    dynamic_sampling_metric: Optional[Literal["accuracy", "reward"]] = None
    """what a kept group's completions differ in: accuracy (0 < correct < G, DAPO eq. 11: correct = every reward
    function scoring >= 1, overlong shaping aside) or reward (their rewards); None: accuracy with --reward_funcs"""
    num_eval_generations: int = 0
    """k completions sampled per held-out prompt for eval/pass@k and eval/mean@k with reward functions (0 = off)"""


# Toy-tuned defaults, applied only to flags not given on the command line (see README "toy task").
ALIAS_DEFAULTS = {"toy": dict(
    total_episodes=8192, learning_rate=1e-4, per_device_train_batch_size=64, gradient_accumulation_steps=1,
    num_generations=4, beta=0.2, response_length=8, max_prompt_length=8, eval_steps=16, num_eval_prompts=256,
    missing_eos_penalty=1.0, local_rollout_forward_batch_size=256),
    # the toy tool world (toy_tools.py): the verifiable gold reward, its lookup tool, two tool rounds
    "toy_tools": dict(
        total_episodes=12288, learning_rate=3e-4, per_device_train_batch_size=64, gradient_accumulation_steps=1,
        num_generations=4, beta=0.0, response_length=24, max_prompt_length=16, eval_steps=16, num_eval_prompts=256,
        missing_eos_penalty=1.0, local_rollout_forward_batch_size=256, reward_funcs=["gold"],
        tools=["toy_worlds.toy_tools:lookup"], max_tool_calling_iterations=2)}
# toy_hard (toy_task.SETTINGS): the toy defaults and budget, with room for its longer prompts and answers
ALIAS_DEFAULTS["toy_hard"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=10, response_length=10)


# ALGO LOGIC: the GRPO pieces, pure functions of tensors (tested in tests/test_grpo.py)
def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str, accelerator=None):
    """(P * G,) rewards, NaN for a completion no source scored, grouped prompt by prompt (rows [i*G, (i+1)*G) share
    prompt i) -> (advantages (P * G,), zero_std (P * G,) bool: the row's group has no reward spread).
    advantage = reward - mean of its group, divided by (std + 1e-4) of its group (`group`), of all processes'
    rewards (`batch`), by the group's mean (`maxrl`: (r - mean) / mean, MaxRL's estimator of the gradient of log pass
    rate, 0 where the mean is <= 0: no success), or not (`none`); stds are unbiased, NaN rows get advantage 0.
    A group is flat when its scored rewards' maximum equals their minimum, decided on the rewards themselves: in
    float32 the mean of G equal values can be a rounding step off (3 x 1000.1: std 6e-5, advantages +0.35 each),
    so a computed std is never compared with 0; a flat group's advantages are exactly 0."""
    grouped = rewards.view(-1, num_generations)  # (P, G)
    mean = grouped.nanmean(1, keepdim=True)
    count = (~grouped.isnan()).sum(1, keepdim=True)
    std = (((grouped - mean) ** 2).nansum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # (P, 1)
    flat = grouped.nan_to_num(nan=-math.inf).amax(1, keepdim=True) <= grouped.nan_to_num(nan=math.inf).amin(1, True)
    zero_std = flat.expand_as(grouped).reshape(-1)  # (P * G,); a group nothing scored counts as flat
    advantages = (grouped - mean).masked_fill(flat, 0.0).reshape(-1)
    if scale_rewards == "group":
        advantages = advantages / (std.expand_as(grouped).reshape(-1) + 1e-4)
    elif scale_rewards == "batch":
        scored = ~rewards.isnan()
        sums = torch.stack([rewards[scored].sum(), scored.sum().to(rewards.dtype)])
        sums = sums if accelerator is None else accelerator.reduce(sums, reduction="sum")
        squares = ((rewards[scored] - sums[0] / sums[1]) ** 2).sum()
        squares = squares if accelerator is None else accelerator.reduce(squares, reduction="sum")
        advantages = advantages / ((squares / (sums[1] - 1).clamp(min=1)).sqrt() + 1e-4)
    elif scale_rewards == "maxrl":
        mean = mean.expand_as(grouped).reshape(-1)
        advantages = torch.where(mean > 0, advantages / mean.clamp(min=torch.finfo(mean.dtype).tiny), 0.0)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return advantages.nan_to_num(0.0), zero_std


def decoupled_advantages(per_source: torch.Tensor, weights: torch.Tensor, num_generations: int,
                         penalty: Optional[torch.Tensor] = None, accelerator=None):
    """GDPO (Liu et al. 2026; TRL's multi_objective_aggregation normalize_then_sum): (P * G, S) scores of each reward
    source (NaN: not scored), (S,) weights -> (advantages (P * G,), zero_std (P * G,) bool: the group is flat).
    Each source's scores are normalised within their group, (s - mean) / (std + 1e-4), summed weighted (a source
    that did not score a row adds 0; a row no source scored is left out with advantage 0), `penalty` (P * G,) is
    subtracted (--missing_eos_penalty, in reward units), and the sums are normalised over every process's batch:
    (r - batch mean) / (batch std + 1e-4). So a source of large scale or spread cannot drown the others."""
    grouped = per_source.view(-1, num_generations, per_source.shape[1])  # (P, G, S)
    mean = grouped.nanmean(1, keepdim=True)
    count = (~grouped.isnan()).sum(1, keepdim=True)
    std = (((grouped - mean) ** 2).nansum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    rewards = (((grouped - mean) / (std + 1e-4)) * weights.to(grouped)).nansum(2).reshape(-1)  # (P * G,)
    rewards = rewards.masked_fill(per_source.isnan().all(1), math.nan)
    rewards = rewards if penalty is None else rewards - penalty
    scored = ~rewards.isnan()
    sums = torch.stack([rewards[scored].sum(), scored.sum().to(rewards.dtype)])
    sums = sums if accelerator is None else accelerator.reduce(sums, reduction="sum")
    squares = ((rewards[scored] - sums[0] / sums[1]) ** 2).sum()
    squares = squares if accelerator is None else accelerator.reduce(squares, reduction="sum")
    advantages = (rewards - sums[0] / sums[1]) / ((squares / (sums[1] - 1).clamp(min=1)).sqrt() + 1e-4)
    return advantages.nan_to_num(0.0), group_advantages(rewards, num_generations, "none")[1]


def reward_variance_groups(rewards: torch.Tensor, num_generations: int, strategy: str, top_p: float, top_k: int,
                           accelerator=None) -> torch.Tensor:
    """RAGEN-2's SNR-aware filtering (Wang et al. 2026; TRL PR #7242): (P * G,) rewards (NaN: not scored) -> (P * G,)
    bool, the rows of the groups kept. Groups are ranked by the unbiased variance of their scored rewards over every
    process (ties: the earlier group first); `top_k` keeps the top_k first, `top_p` the fewest first groups whose
    variances sum to top_p of the total. A group without variance is never kept."""
    grouped = rewards.view(-1, num_generations)  # (P, G)
    count = (~grouped.isnan()).sum(1)
    variance = ((grouped - grouped.nanmean(1, keepdim=True)) ** 2).nansum(1) / (count - 1).clamp(min=1)  # (P,)
    variance = variance.nan_to_num(0.0)
    every = variance if accelerator is None or accelerator.num_processes == 1 else accelerator.gather(variance)
    order = torch.argsort(every, descending=True, stable=True)
    order = order[every[order] > 0]
    if strategy == "top_k":
        chosen = order[:top_k]
    else:  # the first index where the running sum reaches top_p of the total (relative slack for rounding)
        cutoff = torch.searchsorted(every[order].cumsum(0), top_p * every.sum() * (1 - 1e-6)).item()
        chosen = order[:cutoff + 1]
    kept = torch.zeros_like(every, dtype=torch.bool)
    kept[chosen] = True
    first = 0 if accelerator is None else accelerator.process_index * len(variance)
    return kept[first:first + len(variance)].repeat_interleave(num_generations)


def flat_groups(rewards: torch.Tensor, correct: torch.Tensor, num_generations: int, metric: str) -> torch.Tensor:
    """(P * G,) rewards (NaN: scored by no source), (P * G,) bool correct -> (P,) bool: the groups dynamic sampling
    drops. accuracy: all correct or all wrong (DAPO eq. 11; with overlong shaping an all-wrong group's rewards differ
    by length alone); reward: all rewards equal."""
    if metric == "accuracy":
        n_correct = correct.view(-1, num_generations).sum(1)  # (P,)
        return (n_correct == 0) | (n_correct == num_generations)
    return group_advantages(rewards, num_generations, "none")[1].view(-1, num_generations)[:, 0]


def dynamic_sampling_rollout(sampler, accelerator, args, prompts_seen: int, weights_version: int,
                             local_prompts: int, old_logprobs: bool):
    """DAPO's dynamic sampling (Yu et al. 2025): roll out this process's local_prompts prompts, keep the groups that
    are neither all correct nor all wrong (DAPO's eq. 11, verl's filter on accuracy; --dynamic_sampling_metric reward:
    whose rewards differ; a flat group has zero advantage: no signal), and roll out the next prompts of the stream until
    EVERY process holds local_prompts such groups (one all-reduce per round, so all run the same rounds) or
    --dynamic_sampling_max_rounds rounds ran; the batch is the first local_prompts kept groups, topped up with flat
    ones if the cap was reached. Returns (batch, prompts consumed over all processes, metrics)."""
    G, kept, flat, rounds, sampled_flat = args.num_generations, [], [], 0, 0
    metric = args.dynamic_sampling_metric or ("accuracy" if sampler.reward_sources.verdict_columns else "reward")
    while True:
        rollout = sampler.rollout(prompts_seen + rounds * local_prompts * accelerator.num_processes,
                                  weights_version=weights_version, old_logprobs=old_logprobs)
        rounds += 1
        group_is_flat = flat_groups(scored_rewards(rollout), sampler.reward_sources.correct(rollout.source_scores),
                                    G, metric)  # (P,)
        rows = torch.arange(len(rollout.rows), device=group_is_flat.device).view(-1, G)  # (P, G)
        kept.append(rollout.subset(rows[~group_is_flat].flatten()))
        flat.append(rollout.subset(rows[group_is_flat].flatten()))
        sampled_flat += group_is_flat.sum().item()
        short = sum(len(r.rows) for r in kept) < local_prompts * G
        if ru.global_sum(accelerator, float(short)) == 0 or rounds == args.dynamic_sampling_max_rounds:
            break
    batch = ro.concat_rollouts([r for r in kept + flat if r.rows]).subset(torch.arange(local_prompts * G))
    metrics = {"dynamic_sampling/rounds": float(rounds),
               "dynamic_sampling/frac_flat_sampled": sampled_flat / (rounds * local_prompts)}
    return batch, rounds * local_prompts * accelerator.num_processes, metrics


def scored_rewards(batch) -> torch.Tensor:
    """(B,) the batch's rewards, NaN where no reward source scored the completion (left out of its group)."""
    return batch.scores.masked_fill(batch.source_scores.isnan().all(1), math.nan)


def off_policy_mask(advantages, new_logprobs, sampling_logprobs, mask, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (its eq. 9; TRL's off_policy_mask_threshold): (b,) advantages,
    (b, R) log-probs of the policy now and of the policy that sampled, (b, R) loss mask -> (b, 1): 0 for a completion
    of negative advantage whose mean over its loss tokens of log pi_sampler - log pi is above `threshold`, else 1.
    A token the sampler could not score (NaN) counts 0."""
    mask = mask.to(new_logprobs.dtype)
    log_ratio = torch.where(mask > 0, (sampling_logprobs - new_logprobs.detach()).nan_to_num(0.0), 0.0)
    mean_kl = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)  # (b, 1)
    return ((advantages[:, None] >= 0) | (mean_kl <= threshold)).to(new_logprobs.dtype)


def high_entropy_mask(entropy, mask, quantile: float, accelerator=None) -> torch.Tensor:
    """(b, R) token entropies and loss mask -> (b, R): 1 on the loss tokens whose entropy is at least the
    (1 - quantile) quantile of every process's loss-token entropies (Wang et al. 2025, "Beyond the 80/20 rule": the
    forking tokens; TRL's top_entropy_quantile), 0 elsewhere. quantile 0 keeps the highest-entropy token(s)."""
    mask = mask.bool()
    values = entropy.detach()[mask]
    values = values if values.dtype in (torch.float32, torch.float64) else values.float()  # quantile's dtypes
    if accelerator is not None and accelerator.num_processes > 1:  # entropies are >= 0: -1 marks the padding
        values = accelerator.gather(accelerator.pad_across_processes(values, dim=0, pad_index=-1.0))
        values = values[values >= 0]
    if values.numel() == 0:
        return torch.zeros_like(entropy)
    return ((entropy.detach() >= torch.quantile(values, 1 - quantile)) & mask).to(entropy.dtype)


def adaptive_entropy_coef(coef: float, entropy: float, target: float, delta: float, low: float, high: float):
    """Skywork-OR1's adaptive entropy control (He et al. 2025, TRL's use_adaptive_entropy): after an optimizer step
    whose mean token entropy was `entropy`, the coefficient moves by delta towards more bonus at or below `target`,
    less above it, within [low, high]."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


def per_token_loss(new_logprobs, old_logprobs, ref_logprobs, advantages, mask, *, importance_sampling_level: str,
                   epsilon: float, epsilon_high: float, beta: float, is_weights=None, keep=None,
                   use_bias_correction_kl: bool = False):
    """The clipped surrogate (+ beta x k3 KL to the reference) per token. new/old/ref_logprobs, mask: (b, R);
    advantages (b,). Token level: ratio_t = exp(new_t - old_t); sequence level (GSPO): one ratio per sequence,
    exp(mean over its tokens of new - old). keep (b, R) or (b, 1): 0 leaves a token's (a completion's) surrogate out
    (off_policy_mask, high_entropy_mask). is_weights (b, R): the surrogate of each token times its weight
    (pc.importance_weights: samples of another policy). The KL term is neither masked nor reweighted (as TRL); with
    use_bias_correction_kl it is multiplied by the ratio (DeepSeek-V3.2). Returns (loss (b, R), stats)."""
    mask = mask.to(new_logprobs.dtype)
    log_ratio = new_logprobs - old_logprobs  # (b, R)
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1.0))[:, None]  # (b, 1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])  # (b, R) or (b, 1)
    if keep is not None:
        loss = loss * keep
    if is_weights is not None:
        loss = loss * is_weights  # (b, R)
    if beta != 0.0:
        kl = torch.exp(ref_logprobs - new_logprobs) - (ref_logprobs - new_logprobs) - 1  # k3, >= 0
        loss = loss + beta * (kl * ratio if use_bias_correction_kl else kl)
    loss = loss.expand_as(mask)
    with torch.no_grad():  # means over the actions (tokens or sequences) in the loss; 0 when there are none
        actions = mask if ratio.shape == mask.shape else (mask.sum(1, keepdim=True) > 0).to(mask.dtype)
        low = ((ratio < 1 - epsilon) & (advantages[:, None] < 0)).to(mask.dtype)
        high = ((ratio > 1 + epsilon_high) & (advantages[:, None] > 0)).to(mask.dtype)
        stats = {"policy/clipfrac_low": (low * actions).sum() / actions.sum().clamp(min=1.0),
                 "policy/clipfrac_high": (high * actions).sum() / actions.sum().clamp(min=1.0),
                 "policy/approxkl": (0.5 * (new_logprobs - old_logprobs) ** 2 * mask).sum() / mask.sum().clamp(min=1.0)}
    return loss, stats


def aggregate_loss(token_loss, mask, loss_type: str, response_length: int, tokens_per_micro_batch: float):
    """One micro-batch's loss from token losses (b, R) and the loss mask (b, R). accelerate then averages micro-batches
    (gradient accumulation) and DDP averages processes, so each line below is its loss over the whole step:
      grpo     mean over sequences of each sequence's token mean (Shao et al.; favours short right answers)
      bnpo     token mean over the local micro-batch
      dr_grpo  token sum / (sequences x response_length), a constant (Liu et al. 2025)
      dapo     token sum / the mean token count of a micro-batch over all processes = token mean over the global
               batch (Yu et al. 2025); `tokens_per_micro_batch` = global loss tokens / (processes x micro-batches)"""
    mask = mask.to(token_loss.dtype)
    if loss_type == "grpo":
        return ((token_loss * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (token_loss * mask).sum() / (token_loss.shape[0] * response_length)
    if loss_type == "dapo":
        return (token_loss * mask).sum() / max(tokens_per_micro_batch, 1.0)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def loss_share(loss_type: str, micro_batches, loss_mask: torch.Tensor, rows: torch.Tensor):
    """A micro-batch's part of the step's loss when --token_budget makes them unequal (acc.MicroBatches.weight): its
    rows' share for the means over sequences (grpo, dr_grpo), its loss tokens' share for bnpo's token mean; None for
    dapo, already normalised by the step's token count."""
    if loss_type == "bnpo":
        return loss_mask[rows].sum() / loss_mask.sum().clamp(min=1)
    return None if loss_type == "dapo" else micro_batches.row_share()


def micro_batch_loss(args, new_logprobs, token_entropy, old_logprobs, sampling_logprobs, ref_logprobs, advantages,
                     loss_mask, is_weights, *, beta: float, entropy_coef: float, tokens_per_micro_batch: float,
                     accelerator=None):
    """One micro-batch's loss, composed as TRL 1.16's GRPOTrainer._compute_loss: the surrogate of the tokens kept
    (off_policy_mask vs the sampler's log-probs, high_entropy_mask) times the importance weights, + beta x KL, then
    aggregated (--loss_type), minus entropy_coef x the mean entropy of the loss tokens the surrogate trains on (the
    bonus: `token_entropy` with gradient; not rescaled by the loss type, as TRL). (b, R) tensors, (b,) advantages.
    Returns (loss, stats, (2,) entropy sum and token count of those tokens: adaptive entropy control's measure)."""
    keep, trained, stats = None, loss_mask, {}
    if args.off_policy_mask_threshold is not None:
        keep = off_policy_mask(advantages, new_logprobs, sampling_logprobs, loss_mask, args.off_policy_mask_threshold)
        stats["policy/off_policy_masked_fraction"] = 1 - keep.mean()
    if args.top_entropy_quantile < 1:
        high = high_entropy_mask(token_entropy, loss_mask, args.top_entropy_quantile, accelerator)
        keep, trained = (high if keep is None else keep * high), loss_mask.bool() & (high > 0)
    token_loss, loss_stats = per_token_loss(
        new_logprobs, old_logprobs, ref_logprobs, advantages, loss_mask,
        importance_sampling_level=args.importance_sampling_level, epsilon=args.epsilon,
        epsilon_high=args.epsilon_high, beta=beta, is_weights=is_weights, keep=keep,
        use_bias_correction_kl=args.use_bias_correction_kl)
    loss = aggregate_loss(token_loss, loss_mask, args.loss_type, args.response_length, tokens_per_micro_batch)
    window = torch.zeros(2, device=new_logprobs.device)
    if args.entropy_coef != 0 or args.use_adaptive_entropy:
        trained = trained.to(token_entropy.dtype)
        entropy_sum, tokens = (token_entropy * trained).sum(), trained.sum()
        loss = loss - entropy_coef * entropy_sum / tokens.clamp(min=1.0)
        window = torch.stack([entropy_sum.detach(), tokens]).to(window)
    return loss, {**loss_stats, **stats}, window


def validate(args: Args):
    """Check GRPO's flags (each flag group checked its own in ru.parse_args) and derive the per-process sizes once:
    returns (local_batch_size, local_prompts): completions per process per step, and the prompts they sample (the
    num_generations completions of a prompt stay on one process)."""
    if args.num_generations < 2:
        raise UserError(f"--num_generations must be >= 2 (a group needs others to compare with), got "
                        f"{args.num_generations}")
    args.epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if min(args.epsilon, args.epsilon_high) <= 0 or args.beta < 0 or (args.kl_target is not None and args.beta == 0):
        raise UserError("--epsilon and --epsilon_high must be > 0, --beta >= 0, and --kl_target adapts a --beta that "
                        "starts above 0")
    if min(args.num_iterations, args.dynamic_sampling_max_rounds) < 1 or args.num_eval_generations < 0:
        raise UserError("--num_iterations and --dynamic_sampling_max_rounds must be >= 1, --num_eval_generations >= 0")
    if not 0 <= args.top_entropy_quantile <= 1 or not 0 < args.reward_variance_top_p <= 1 \
            or args.reward_variance_top_k < 1:
        raise UserError("--top_entropy_quantile must be in [0, 1], --reward_variance_top_p in (0, 1] and "
                        "--reward_variance_top_k >= 1")
    if args.use_adaptive_entropy and not (args.entropy_coef_min <= args.entropy_coef_max and
                                          args.entropy_coef_delta >= 0):
        raise UserError("--use_adaptive_entropy needs --entropy_coef_min <= --entropy_coef_max and "
                        "--entropy_coef_delta >= 0")
    if args.multi_objective_aggregation == "normalize_then_sum" and args.scale_rewards != "group":
        raise UserError("--multi_objective_aggregation normalize_then_sum normalises each source within its group and "
                        "the sum over the batch itself: leave --scale_rewards at its default (group)")
    if args.dynamic_sampling_metric == "accuracy" and not args.reward_funcs:
        raise UserError("--dynamic_sampling_metric accuracy needs --reward_funcs (a verifier says what is correct); "
                        "use --dynamic_sampling_metric reward with a reward model")
    if args.importance_sampling_level == "sequence" and args.loss_type != "grpo" and os.environ.get("RANK", "0") == "0":
        print(f"warning: with --importance_sampling_level sequence the '{args.loss_type}' loss sums per-token "
              "contributions, which weights each sequence by its completion length instead of optimising the "
              "per-sequence objective (TRL 1.16 warns the same); GSPO's setup is --loss_type grpo", flush=True)
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    local_prompts = pc.exact_div(local_batch_size, args.num_generations, "local_batch_size "
                                 "(per_device_train_batch_size * gradient_accumulation_steps) / num_generations")
    return local_batch_size, local_prompts


def main():
    # 1. arguments: validate and derive every batch size once
    args = ru.parse_args(Args, ALIAS_DEFAULTS)
    local_batch_size, local_prompts = validate(args)
    accelerator = ru.make_accelerator(args.gradient_accumulation_steps)
    packing.use_padding_free(args.padding_free)
    batch_size = local_batch_size * accelerator.num_processes
    num_total_batches = min(math.ceil(args.total_episodes / batch_size), args.max_steps or math.inf)
    num_optimizer_steps = num_total_batches * args.num_iterations
    ru.seed_everything(args.seed, accelerator.process_index)

    # 2. tokenizer and data: prompts tokenised once; completions fitted into the model's positions after them
    policy_path = ru.resolve_model(args.model)
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=args.trust_remote_code)
    toolset = ep.load_toolset(args, tokenizer)  # None: single-turn completions
    data = ro.load_prompt_data(args, tokenizer, policy_path, toolset)
    output_dir = ru.output_dir(args, data.name, accelerator)

    # 3. models: policy (+LoRA), frozen reference (only when beta > 0); reward sources (reward_sources.py)
    policy = models.load_policy(policy_path, tokenizer, args)
    reference = None if args.beta == 0 else ru.reference_from_flags(args, policy, tokenizer, policy_path, accelerator)
    reward_sources = rs.load_rewards(args, tokenizer, args.model, data.name, [data.train, data.eval_data], accelerator,
                                     toolset and toolset.environment_types, max_steps=num_total_batches)

    # 4. optimizer, linear decay per optimizer step, checkpointable state (kl_coef: beta), the sampler
    optimizer, scheduler = tl.adamw_linear_decay(policy, args.learning_rate, num_optimizer_steps)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    state = dict(step=0, episode=0, prompts_seen=0, nonfinite_skipped=0, kl_coef=args.beta,
                 entropy_coef=args.entropy_coef, last_entropy=math.inf)  # the last two: adaptive entropy control
    logger, optimizer_step = tl.start_or_resume(args, accelerator, policy, optimizer, scheduler, output_dir, state)
    logger.progress(num_total_batches, state["step"], batch_size, "episodes",
                    ("objective/scores", "objective/kl", "eval/gold_score"))
    sampler = ro.Sampler(args, accelerator, tokenizer, policy, reward_sources, reference, prompts=data.train_prompts,
                         rows=data.train, samples_per_prompt=args.num_generations, prompts_per_process=local_prompts,
                         max_prompt_length=args.max_prompt_length, weights_version=state["step"], toolset=toolset,
                         context_limit=data.context_limit)
    # --max_staleness N > 0: the sampler runs N steps ahead of the trainer (its pending batches go into checkpoints)
    rollouts = ra.RunAhead(sampler, args.max_staleness, args.resume_from) if args.max_staleness else sampler
    stop = tl.StopSignal()
    if state["step"] == 0:
        logger.log(ev.evaluate_policy(sampler, data.held_out, logger, 0, pass_at_k=args.num_eval_generations), step=0)

    # the policy's entropy in every forward: the high-entropy tokens, an entropy bonus (then with its gradient)
    entropy_bonus = args.entropy_coef != 0 or args.use_adaptive_entropy
    needs_entropy = entropy_bonus or args.top_entropy_quantile < 1
    meter = tp.StepMeter(accelerator, models.unwrap(policy), passes=args.num_iterations)  # perf/*
    start_time, start_episode = time.time(), state["episode"]
    while state["step"] < num_total_batches:
        step, beta = state["step"] + 1, state["kl_coef"]
        meter.start()
        # 5. rollout: local_prompts prompts x num_generations completions, scored; reference log-probs when beta > 0;
        #    old log-probs for reused batches only (--dynamic_sampling: more prompts until groups' rewards differ)
        with tl.checkpoint_on_error(RolloutError, accelerator, output_dir, dict(state), scheduler):
            if args.dynamic_sampling:
                batch, prompts_used, sampling_metrics = dynamic_sampling_rollout(
                    sampler, accelerator, args, state["prompts_seen"], state["step"], local_prompts,
                    old_logprobs=args.num_iterations > 1)
            else:
                batch = rollouts.rollout(state["prompts_seen"], weights_version=state["step"],
                                         old_logprobs=args.num_iterations > 1)
                prompts_used, sampling_metrics = local_prompts * accelerator.num_processes, {}
        response_mask, truncated = batch.response_mask, batch.truncated  # (B, R), (B,)
        scores = scored_rewards(batch)  # (B,): scored by no source: NaN, left out

        # 6. group-relative advantages (GDPO: each reward source normalised in its group); the loss mask and its
        #    token count over all processes (for dapo)
        if args.multi_objective_aggregation == "normalize_then_sum":
            penalty = truncated.float() * (args.missing_eos_penalty or 0.0)
            advantages, zero_std = decoupled_advantages(batch.source_scores, reward_sources.weights,
                                                        args.num_generations, penalty, accelerator)
        else:
            advantages, zero_std = group_advantages(scores, args.num_generations, args.scale_rewards, accelerator)
        loss_mask = response_mask & ~(truncated[:, None] & args.mask_truncated_completions)  # DAPO: no cut ones
        loss_mask &= ~(zero_std[:, None] & args.skip_zero_std_groups)  # flat groups: no signal
        if args.reward_variance_filtering:  # RAGEN-2: the groups of highest reward variance only
            kept_groups = reward_variance_groups(scores, args.num_generations, args.reward_variance_filtering,
                                                 args.reward_variance_top_p, args.reward_variance_top_k, accelerator)
            loss_mask &= kept_groups[:, None]
            sampling_metrics["reward_variance/frac_groups_kept"] = kept_groups.float().mean()
        global_tokens = ru.global_sum(accelerator, loss_mask.sum().item())
        tokens_per_micro_batch = global_tokens / (accelerator.num_processes * args.gradient_accumulation_steps)

        # 7. policy update: num_iterations optimizer steps on this batch, micro-batches accumulated
        losses, stats, entropy, kl = [], {}, [], []
        for iteration in range(args.num_iterations):
            window_entropy = torch.zeros(2, device=accelerator.device)  # (sum, tokens) for adaptive entropy control
            # the entropy bonus's weight this step: Skywork-OR1's applies only once the entropy fell to the target
            entropy_coef = state["entropy_coef"] if not args.use_adaptive_entropy or \
                state["last_entropy"] <= args.entropy_target else 0.0
            shuffled = batch.shuffled_rows()  # per_device_train_batch_size rows each, or --token_budget tokens
            micro_batches = acc.MicroBatches(accelerator, policy, shuffled, batch.token_counts, args.token_budget,
                                             group_size=args.num_generations)
            for mb in micro_batches:
                micro = batch.subset(mb)
                with micro_batches.accumulate():
                    new_logprobs, token_entropy = sampler.forward_logprobs(
                        policy, micro, entropy=iteration == 0 or needs_entropy, entropy_grad=entropy_bonus)
                    # pi_old: the rollout's, or at one iteration this forward's own, detached (a ratio of 1, as TRL)
                    old = new_logprobs.detach() if micro.old_logprobs is None else micro.old_logprobs
                    # pi_old / pi_behaviour when another policy sampled (vLLM, earlier weights), else None
                    is_weights = pc.importance_weights(old, micro.behaviour_logprobs, micro.response_mask,
                                                       micro.importance_sampling)
                    sampled_by = old if micro.behaviour_logprobs is None else micro.behaviour_logprobs
                    loss, mb_stats, mb_entropy = micro_batch_loss(
                        args, new_logprobs, token_entropy, old, sampled_by, micro.ref_logprobs, advantages[mb],
                        loss_mask[mb], is_weights, beta=beta, entropy_coef=entropy_coef,
                        tokens_per_micro_batch=tokens_per_micro_batch, accelerator=accelerator)
                    share = loss_share(args.loss_type, micro_batches, loss_mask, mb)  # with --token_budget
                    losses.append(micro_batches.backward(loss, share))
                window_entropy += mb_entropy
                if iteration == 0:  # the importance weights, the sampling policy's entropy and KL to the reference
                    mb_stats.update(pc.importance_sampling_stats(old, micro.behaviour_logprobs, micro.response_mask,
                                                                 micro.importance_sampling))
                    entropy.append((token_entropy.detach() * micro.response_mask).sum(1))
                    if micro.ref_logprobs is not None:
                        kl.append(((old - micro.ref_logprobs) * micro.response_mask).sum(1))
                for key, value in mb_stats.items():
                    stats.setdefault(key, []).append(value)
            optimizer_step(torch.stack(losses[-len(micro_batches):]), state, step)
            if args.use_adaptive_entropy:  # the window's entropy over all processes sets the next step's coefficient
                window_entropy = accelerator.reduce(window_entropy, reduction="sum")
                state["last_entropy"] = (window_entropy[0] / window_entropy[1].clamp(min=1)).item()
                state["entropy_coef"] = adaptive_entropy_coef(
                    state["entropy_coef"], state["last_entropy"], args.entropy_target, args.entropy_coef_delta,
                    args.entropy_coef_min, args.entropy_coef_max)
        state.update(step=step, episode=state["episode"] + batch_size, nonfinite_skipped=optimizer_step.skipped,
                     prompts_seen=state["prompts_seen"] + prompts_used)

        # 8. log, adapt beta (--kl_target), evaluate every eval_steps steps and after the last
        scored = ~scores.isnan()
        metrics = ru.reduce_metrics(accelerator, {
            "objective/scores": scores[scored].mean() if scored.any() else torch.tensor(0.0),
            "objective/entropy": torch.cat(entropy).mean(), "objective/frac_reward_zero_std": zero_std.float().mean(),
            "objective/advantage_std": advantages.std(), "loss/policy": torch.stack(losses).mean(),
            **{key: torch.stack(values).mean() for key, values in stats.items()},
            "val/num_eos_tokens": (~truncated).sum().float(), "val/truncated_fraction": truncated.float().mean(),
            "val/response_length": response_mask.sum(1).float().mean(),
            "nonfinite/skipped": float(state["nonfinite_skipped"]),
            **({"objective/entropy_coef": state["entropy_coef"]} if entropy_bonus else {}),
            **({"objective/kl": torch.cat(kl).mean()} if reference is not None else {}), **sampling_metrics,
        })
        metrics.update({**batch.metrics, **reward_sources.metrics(batch.source_scores, accelerator)})
        if reference is not None:
            metrics["objective/beta"] = beta
            state["kl_coef"] = tl.adaptive_kl_coef(beta, metrics["objective/kl"], batch_size, args.kl_target,
                                                   args.kl_horizon)
        metrics.update({"lr": optimizer_step.lr, "episode": state["episode"],
                        "time/episodes_per_second": (state["episode"] - start_episode) / (time.time() - start_time)})
        metrics.update(meter.batch_metrics(batch.query_responses, tokenizer.pad_token_id, batch.metrics))
        if (args.eval_steps and step % args.eval_steps == 0) or step == num_total_batches:
            metrics.update(ev.evaluate_policy(sampler, data.held_out, logger, step,
                                              pass_at_k=args.num_eval_generations))
        logger.log(metrics, step=step)

        # 9. checkpoints: periodic, and on SIGTERM / Ctrl-C on any process (then every process stops cleanly)
        if tl.checkpoint_or_stop(accelerator, args, output_dir, state, scheduler, stop, num_total_batches,
                                 extra_files=rollouts.save):  # with --max_staleness, the batches sampled ahead too
            rollouts.close()
            return logger.close()

    # 10. final save
    rollouts.close()
    tl.save_model(accelerator, policy, tokenizer, os.path.join(output_dir, "model"), merge_peft=args.merge_peft)
    logger.close(os.path.join(output_dir, "model"))


if __name__ == "__main__":
    ru.main_guard(main)
