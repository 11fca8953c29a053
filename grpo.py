"""Group Relative Policy Optimization (GRPO): Shao et al. 2024, "DeepSeekMath" (https://arxiv.org/abs/2402.03300),
and its variants by flags: Dr. GRPO, DAPO, GSPO, ... (docs/grpo.md). Per step: sample num_generations completions per
prompt, advantage = (reward - group mean) / (group std + 1e-4), then num_iterations steps on the clipped surrogate (+
beta x k3 KL to the reference). Flags: TRL 1.16's GRPOConfig with its 2026 settings (so up to 500 lines, not 400).

    python grpo.py                                  # the toy task on a CPU, about a minute
    python grpo.py --model toy_tools                # the toy tool world: multi-turn episodes with a lookup tool
    python grpo.py --model toy_vision               # the toy vision world: a tiny LLaVA answers about pictures
    accelerate launch grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset <prompts> --reward_funcs file.py:fn
"""
import math
import os
from dataclasses import dataclass
from typing import Literal, Optional

import torch

import policy_common as pc
from plumbing import accumulation as acc
from plumbing import data_utils as du
from plumbing import episodes as ep
from plumbing import evaluation as ev
from plumbing import models
from plumbing import prompt_sharing as ps
from plumbing import reward_sources as rs
from plumbing import rollout as ro
from plumbing import run_ahead as ra
from plumbing import run_utils as ru
from plumbing import throughput as tp
from plumbing import train_loop as tl
from plumbing import vllm_generation as vg
from plumbing.errors import RolloutError, UserError, require_positive


@dataclass
class EntropyFlags:
    """grpo.py's entropy bonus, Skywork-OR1's adaptive control of it (He et al. 2025): flags, check, coefficient"""
    entropy_coef: float = 0.0
    """entropy bonus: the loss minus entropy_coef x the mean token entropy (with --use_adaptive_entropy: its start)"""
    use_adaptive_entropy: bool = False
    """Skywork-OR1: entropy_coef moves by --entropy_coef_delta per optimizer step; applies at or below the target"""
    entropy_coef_min: float = 0.0
    """with --use_adaptive_entropy: the smallest entropy_coef"""
    entropy_coef_max: float = 1.0
    """with --use_adaptive_entropy: the largest entropy_coef"""
    entropy_coef_delta: float = 0.005
    """with --use_adaptive_entropy: entropy_coef's change per optimizer step (up at or below the target, else down)"""
    entropy_target: float = 0.2
    """with --use_adaptive_entropy: the mean token entropy (nats) at or below which the bonus applies"""

    def check(self) -> None:
        if self.use_adaptive_entropy and (self.entropy_coef_min > self.entropy_coef_max or self.entropy_coef_delta < 0):
            raise UserError("--use_adaptive_entropy needs --entropy_coef_min <= _max and --entropy_coef_delta >= 0")

    def step_entropy_coef(self, state: dict) -> Optional[float]:
        """The coefficient in the optimizer step about to run (adaptive: 0 above the target); None: no bonus."""
        if self.entropy_coef != 0 or self.use_adaptive_entropy:  # adaptive: the bonus at or below the target only
            return state["entropy_coef"] if not self.use_adaptive_entropy or state["last_entropy"] <= \
                self.entropy_target else 0.0

    def update_entropy_coef(self, state: dict, window: torch.Tensor, accelerator) -> None:
        """After an optimizer step, (2,) its trained tokens' entropy sum and count on this process -> the coefficient
        grows by delta if their mean over every process (one all-reduce) was at or below the target, else shrinks."""
        if self.use_adaptive_entropy:
            window = accelerator.reduce(window, reduction="sum")
            state["last_entropy"] = entropy = (window[0] / window[1].clamp(min=1)).item()
            coef = state["entropy_coef"]
            state["entropy_coef"] = min(coef + self.entropy_coef_delta, self.entropy_coef_max) \
                if entropy <= self.entropy_target else max(coef - self.entropy_coef_delta, self.entropy_coef_min)


@dataclass
class Args(tl.TrainFlags, models.PolicyFlags, du.DataFlags, ro.RolloutFlags, pc.ReferenceFlags, rs.RewardFlags,
           tl.KLControlFlags, ps.PromptSharingFlags, vg.VLLMFlags, ra.AsyncFlags, ep.ToolFlags, EntropyFlags):
    # shared flags whose default differs here, and GRPO's own (names and defaults of TRL 1.16's GRPOConfig)
    learning_rate: float = 1e-6
    response_length: int = 512
    num_generations: int = 8
    """completions sampled per prompt (the group of the group-relative advantage)"""
    scale_rewards: Literal["group", "batch", "none", "maxrl"] = "group"
    """advantages divided by the group's reward std, the batch's, nothing (Dr. GRPO), or the group's mean (MaxRL)"""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """several reward sources: normalise their weighted sum, or each in its group and then the sum (GDPO)"""
    reward_variance_filtering: Optional[Literal["top_p", "top_k"]] = None
    """train on the groups of highest reward variance only (RAGEN-2: top_p of the summed variance, or top_k groups)"""
    reward_variance_top_p: float = 0.9
    """with --reward_variance_filtering top_p: the fraction of the batch's summed group reward variance kept"""
    reward_variance_top_k: int = 1
    """with --reward_variance_filtering top_k: the number of groups kept, over all processes"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """how token losses become the step's loss (aggregate_loss): sequence means, micro-batch or global token means"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """one importance ratio per token, or one per sequence from its mean token log-ratio (GSPO)"""
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
    """drop completions of negative advantage whose mean log(pi_sampler / pi) is above this (DeepSeek-V3.2's delta)"""
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
    """what a kept group's completions differ in: accuracy or reward (None: accuracy with --reward_funcs)"""
    num_eval_generations: int = 0
    """k completions sampled per held-out prompt for eval/pass@k and eval/mean@k with reward functions (0 = off)"""


# Toy-tuned defaults, applied only to flags not given on the command line (docs/toy_worlds.md).
ALIAS_DEFAULTS = {"toy": dict(total_episodes=8192, learning_rate=1e-4, per_device_train_batch_size=64,
                              gradient_accumulation_steps=1, num_generations=4, beta=0.2, response_length=8,
                              max_prompt_length=8, eval_steps=16, num_eval_prompts=256, missing_eos_penalty=1.0,
                              local_rollout_forward_batch_size=256)}
# toy_hard: room for longer prompts; toy_tools: the gold reward, the lookup tool, 2 tool rounds; toy_vision: images
ALIAS_DEFAULTS["toy_hard"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=10, response_length=10)
ALIAS_DEFAULTS["toy_tools"] = dict(ALIAS_DEFAULTS["toy"], total_episodes=12288, learning_rate=3e-4, beta=0.0,
                                   response_length=24, max_prompt_length=16, reward_funcs=["gold"],
                                   tools=["toy_worlds.toy_tools:lookup"], max_tool_calling_iterations=2)
ALIAS_DEFAULTS["toy_vision"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=None, response_length=3,
                                    reward_funcs=["gold"], total_episodes=64 * 48)


# ALGO LOGIC: the GRPO pieces, pure functions of tensors (tests/test_grpo*.py), composed in sample_batch and GRPOLoss
def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str, accelerator=None):
    """(P * G,) rewards (NaN: not scored), prompt by prompt (rows [i*G, (i+1)*G) share prompt i) -> (advantages,
    zero_std (bool: the group is flat)), (P * G,) each. advantage = reward - its group's mean, divided by (std + 1e-4)
    of its group or of every process's rewards, by the group's mean (maxrl: MaxRL, Tajwar et al. 2026: rewards >= 0, 0
    for a mean of 0) or not; exactly 0 for a NaN row or a flat group (max == min: a float32 mean can be off them)."""
    grouped = rewards.view(-1, num_generations)  # (P, G)
    mean, count = grouped.nanmean(1, keepdim=True), (~grouped.isnan()).sum(1, keepdim=True)
    std = (((grouped - mean) ** 2).nansum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # (P, 1)
    flat = grouped.nan_to_num(nan=-math.inf).amax(1, keepdim=True) <= grouped.nan_to_num(nan=math.inf).amin(1, True)
    zero_std = flat.expand_as(grouped).reshape(-1)  # (P * G,); a group nothing scored counts as flat
    advantages = (grouped - mean).masked_fill(flat, 0.0).reshape(-1)
    if scale_rewards == "group":
        advantages = advantages / (std.expand_as(grouped).reshape(-1) + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (ru.global_mean_std(rewards, accelerator)[1] + 1e-4)
    elif scale_rewards == "maxrl":
        if (negative := rewards[rewards < 0]).numel():  # a success rate: a signed group's mean near 0 blows A up
            raise UserError(f"--scale_rewards maxrl: a reward {negative.min():.3g} < 0 (--missing_eos_penalty 0?)")
        mean = mean.expand_as(grouped).reshape(-1)
        advantages = torch.where(mean > 0, advantages / mean.clamp(min=torch.finfo(mean.dtype).tiny), 0.0)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return advantages.nan_to_num(0.0), zero_std


def decoupled_advantages(per_source: torch.Tensor, weights: torch.Tensor, num_generations: int,
                         penalty: Optional[torch.Tensor] = None, accelerator=None):
    """GDPO (Liu et al. 2026; TRL's normalize_then_sum): (P * G, S) each reward source's scores (NaN: not scored), (S,)
    weights -> (advantages, zero_std), (P * G,) each: each source normalised in its group, summed weighted, `penalty`
    subtracted, the sums normalised over every process's batch (a source of large scale cannot drown the others)."""
    grouped = per_source.view(-1, num_generations, per_source.shape[1])  # (P, G, S)
    mean, count = grouped.nanmean(1, keepdim=True), (~grouped.isnan()).sum(1, keepdim=True)
    std = (((grouped - mean) ** 2).nansum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # (P, 1, S)
    rewards = (((grouped - mean) / (std + 1e-4)) * weights.to(grouped)).nansum(2).reshape(-1)  # (P * G,)
    rewards = rewards.masked_fill(per_source.isnan().all(1), math.nan)  # a row no source scored: left out
    rewards = rewards if penalty is None else rewards - penalty
    mean, std = ru.global_mean_std(rewards, accelerator)
    return ((rewards - mean) / (std + 1e-4)).nan_to_num(0.0), group_advantages(rewards, num_generations, "none")[1]


def reward_variance_groups(rewards: torch.Tensor, num_generations: int, strategy: str, top_p: float, top_k: int,
                           accelerator=None) -> torch.Tensor:
    """RAGEN-2 (Wang et al. 2026; TRL PR #7242): (P * G,) rewards -> (P * G,) bool, the rows of the groups kept: by
    reward variance over every process (ties: earlier first), the top_k, or the fewest summing to top_p; never flat."""
    grouped, count = rewards.view(-1, num_generations), (~rewards.view(-1, num_generations).isnan()).sum(1)  # (P, G)
    variance = (((grouped - grouped.nanmean(1, keepdim=True)) ** 2).nansum(1) / (count - 1).clamp(min=1)).nan_to_num(0)
    every = variance if accelerator is None or accelerator.num_processes == 1 else accelerator.gather(variance)
    order = torch.argsort(every, descending=True, stable=True)
    order = order[every[order] > 0]
    # top_k, or up to the first index where the running sum reaches top_p of the total (relative slack for rounding)
    n = top_k if strategy == "top_k" else 1 + torch.searchsorted(every[order].cumsum(0),
                                                                 top_p * every.sum() * (1 - 1e-6)).item()
    kept = torch.zeros_like(every, dtype=torch.bool)
    kept[order[:n]] = True
    first = 0 if accelerator is None else accelerator.process_index * len(variance)
    return kept[first:first + len(variance)].repeat_interleave(num_generations)


def flat_groups(rewards: torch.Tensor, correct: torch.Tensor, num_generations: int, metric: str) -> torch.Tensor:
    """(P * G,) rewards (NaN: not scored), (P * G,) bool correct -> (P,) bool: the groups dynamic sampling drops.
    accuracy: all correct or all wrong (DAPO eq. 11; overlong shaping aside); reward: all rewards equal."""
    if metric == "accuracy":
        n_correct = correct.view(-1, num_generations).sum(1)  # (P,)
        return (n_correct == 0) | (n_correct == num_generations)
    return group_advantages(rewards, num_generations, "none")[1].view(-1, num_generations)[:, 0]


def sample_batch(rollouts, reward_sources, args, state: dict, accelerator):
    """This step's batch (old log-probs where reused: num_iterations > 1) -> (batch, advantages (B,), loss mask (B, R),
    rounds of prompts sampled, metrics). --dynamic_sampling (DAPO): `flat_groups` refused and more prompts rolled out.
    The loss mask: the completions' tokens, less those cut at response_length (--mask_truncated_completions), of flat
    groups (--skip_zero_std_groups) and of groups outside RAGEN-2's highest reward variance."""
    old_logprobs, G, metrics, rounds = args.num_iterations > 1, args.num_generations, {}, 1
    if not args.dynamic_sampling:
        batch = rollouts.rollout(state["prompts_seen"], state["step"], old_logprobs=old_logprobs)
    else:
        metric = args.dynamic_sampling_metric or ("accuracy" if reward_sources.verdict_columns else "reward")
        batch, rounds, metrics = rollouts.rollout_groups(  # the groups kept: not flat_groups
            state["prompts_seen"], state["step"], lambda r: ~flat_groups(
                r.scored_rewards, reward_sources.correct(r.source_scores), G, metric),
            args.dynamic_sampling_max_rounds, old_logprobs=old_logprobs)
    scores, truncated = batch.scored_rewards, batch.truncated
    if args.multi_objective_aggregation == "normalize_then_sum":
        penalty = truncated.float() * (args.missing_eos_penalty or 0.0)
        advantages, zero_std = decoupled_advantages(batch.source_scores, reward_sources.weights, G, penalty,
                                                    accelerator)
    else:
        advantages, zero_std = group_advantages(scores, G, args.scale_rewards, accelerator)
    loss_mask = batch.response_mask & ~(truncated[:, None] & args.mask_truncated_completions)
    loss_mask &= ~(zero_std[:, None] & args.skip_zero_std_groups)
    metrics.update({"objective/scores": scores[~scores.isnan()].mean() if (~scores.isnan()).any() else torch.tensor(0.),
                    "objective/frac_reward_zero_std": zero_std.float().mean(),
                    "objective/advantage_std": advantages.std(), **batch.length_metrics()})
    if args.reward_variance_filtering:
        kept_groups = reward_variance_groups(scores, G, args.reward_variance_filtering, args.reward_variance_top_p,
                                             args.reward_variance_top_k, accelerator)
        loss_mask &= kept_groups[:, None]
        metrics["reward_variance/frac_groups_kept"] = kept_groups.float().mean()
    return batch, advantages, loss_mask, rounds, metrics


def off_policy_mask(advantages, new_logprobs, behaviour_logprobs, mask, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (its eq. 9): (b,) advantages, (b, R) log-probs now and the sampler's,
    loss mask -> (b, 1): 0 for negative advantage and mean log pi_behaviour - log pi (NaN: 0) above `threshold`."""
    mask = mask.to(new_logprobs.dtype)
    log_ratio = torch.where(mask > 0, (behaviour_logprobs - new_logprobs.detach()).nan_to_num(0.0), 0.0)
    mean_kl = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)  # (b, 1)
    return ((advantages[:, None] >= 0) | (mean_kl <= threshold)).to(new_logprobs.dtype)


def high_entropy_mask(entropy, mask, quantile: float, accelerator=None) -> torch.Tensor:
    """(b, R) token entropies and loss mask -> (b, R): 1 on the loss tokens whose entropy is at least the (1 - quantile)
    quantile of every process's (Wang et al. 2025, "Beyond the 80/20 rule"; TRL's top_entropy_quantile), else 0."""
    mask = mask.bool()
    values = entropy.detach()[mask].to(torch.promote_types(entropy.dtype, torch.float32))  # quantile's dtypes
    if accelerator is not None and accelerator.num_processes > 1:  # NaN marks the padding (float32 entropies < 0 too)
        values = accelerator.gather(accelerator.pad_across_processes(values, dim=0, pad_index=math.nan))
        values = values[~values.isnan()]
    if values.numel() == 0:
        return torch.zeros_like(entropy)
    return ((entropy.detach() >= torch.quantile(values, 1 - quantile)) & mask).to(entropy.dtype)


def per_token_loss(new_logprobs, old_logprobs, ref_logprobs, advantages, mask, *, importance_sampling_level: str,
                   epsilon: float, epsilon_high: float, beta: float, is_weights=None, keep=None,
                   use_bias_correction_kl: bool = False):
    """The clipped surrogate (+ beta x k3 KL to the reference) per token: (b, R) log-probs and mask, (b,) advantages ->
    ((b, R) loss, stats). ratio = exp(new - old) per token, or per sequence of its mean (GSPO). keep (b, R) or (b, 1): 0
    drops a surrogate; is_weights (b, R) weigh them. The KL is neither masked nor reweighted (as TRL), but times the
    ratio with use_bias_correction_kl (DeepSeek-V3.2)."""
    mask = mask.to(new_logprobs.dtype)
    log_ratio = new_logprobs - old_logprobs  # (b, R)
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1.0))[:, None]  # (b, 1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])  # (b, R) or (b, 1)
    loss = loss if keep is None else loss * keep
    loss = loss if is_weights is None else loss * is_weights  # (b, R)
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
    """A micro-batch's loss from (b, R) token losses and mask, the step's with accelerate's and DDP's means: grpo, the
    mean of sequences' token means (Shao et al.; favours short right answers); bnpo, the micro-batch's token mean;
    dr_grpo, the token sum / (sequences x response_length) (Liu et al. 2025); dapo, the global batch's token mean (Yu
    et al. 2025; tokens_per_micro_batch = the step's loss tokens / (processes x micro-batches))."""
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


@dataclass(frozen=True)
class GRPOLoss:
    """A micro-batch's loss, its settings taken once from the flags of their names, composed as TRL 1.16's
    _compute_loss: the kept tokens' surrogate (off_policy_mask, high_entropy_mask) times the importance weights, + beta
    x KL, aggregated, minus entropy_coef x the trained tokens' mean entropy (not rescaled by the loss type, as TRL)."""
    loss_type: str
    importance_sampling_level: str
    epsilon: float
    epsilon_high: float
    use_bias_correction_kl: bool
    off_policy_mask_threshold: Optional[float]
    top_entropy_quantile: float
    response_length: int

    @classmethod
    def from_args(cls, args) -> "GRPOLoss":
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})

    def mean_over(self, loss_mask: torch.Tensor):
        """What a micro-batch's loss is a mean over (--token_budget's shares): loss tokens, rows, or none (dapo)."""
        return {"bnpo": loss_mask.sum(1), "dapo": None}.get(self.loss_type, "rows")

    def __call__(self, new_logprobs, token_entropy, old_logprobs, behaviour_logprobs, ref_logprobs, advantages,
                 loss_mask, is_weights, *, beta: float, entropy_coef: Optional[float], tokens_per_micro_batch: float,
                 accelerator=None):
        """(b, R) tensors, (b,) advantages; entropy_coef None: no bonus -> (loss, stats, (2,) entropy sum and count)."""
        keep, trained, stats = None, loss_mask, {}
        if self.off_policy_mask_threshold is not None:
            behaviour = old_logprobs if behaviour_logprobs is None else behaviour_logprobs  # None: pi_old sampled
            keep = off_policy_mask(advantages, new_logprobs, behaviour, loss_mask, self.off_policy_mask_threshold)
            stats["policy/off_policy_masked_fraction"] = 1 - keep.mean()
        if self.top_entropy_quantile < 1:
            high = high_entropy_mask(token_entropy, loss_mask, self.top_entropy_quantile, accelerator)
            keep, trained = (high if keep is None else keep * high), loss_mask.bool() & (high > 0)
        token_loss, loss_stats = per_token_loss(
            new_logprobs, old_logprobs, ref_logprobs, advantages, loss_mask, beta=beta, is_weights=is_weights,
            keep=keep, importance_sampling_level=self.importance_sampling_level, epsilon=self.epsilon,
            epsilon_high=self.epsilon_high, use_bias_correction_kl=self.use_bias_correction_kl)
        loss = aggregate_loss(token_loss, loss_mask, self.loss_type, self.response_length, tokens_per_micro_batch)
        window = torch.zeros(2, device=new_logprobs.device)
        if entropy_coef is not None:
            trained = trained.to(token_entropy.dtype)
            entropy_sum, tokens = (token_entropy * trained).sum(), trained.sum()
            loss = loss - entropy_coef * entropy_sum / tokens.clamp(min=1.0)
            window = torch.stack([entropy_sum.detach(), tokens]).to(window)
        return loss, {**loss_stats, **stats}, window


def validate(args: Args):
    """GRPO's own flags -> (local_batch_size, local_prompts): completions and prompts per process per step."""
    args.epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    require_positive(args, "epsilon", "epsilon_high", "num_iterations", "dynamic_sampling_max_rounds",
                     "reward_variance_top_k", "reward_variance_top_p")
    if args.num_generations < 2 or min(args.beta, args.num_eval_generations) < 0 or args.reward_variance_top_p > 1 \
            or not 0 <= args.top_entropy_quantile <= 1 or (args.kl_target is not None and args.beta == 0):
        raise UserError("--num_generations must be >= 2 (a group needs others to compare with), --beta and "
                        "--num_eval_generations >= 0, --reward_variance_top_p <= 1, --top_entropy_quantile in [0, 1], "
                        "and --kl_target adapts a --beta that starts above 0")
    if args.multi_objective_aggregation == "normalize_then_sum" and args.scale_rewards != "group":
        raise UserError("--multi_objective_aggregation normalize_then_sum scales per group: keep --scale_rewards group")
    if args.dynamic_sampling_metric == "accuracy" and not args.reward_funcs:
        raise UserError("--dynamic_sampling_metric accuracy needs --reward_funcs (a verifier), reward a reward model")
    if args.dynamic_sampling and args.max_staleness:
        raise UserError("--max_staleness with --dynamic_sampling is not supported: the rounds a step needs depend "
                        "on its rewards, which a sampler running ahead does not know")
    if args.importance_sampling_level == "sequence" and args.loss_type != "grpo" and os.environ.get("RANK", "0") == "0":
        print(f"warning: the '{args.loss_type}' loss sums per-token terms, weighting GSPO's sequences by their length "
              "(TRL 1.16 warns the same); GSPO's setup is --loss_type grpo", flush=True)
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    local_prompts = pc.exact_div(local_batch_size, args.num_generations, "local_batch_size "
                                 "(per_device_train_batch_size * gradient_accumulation_steps) / num_generations")
    return local_batch_size, local_prompts


def main():
    # 1. arguments: validate and derive every batch size once
    args = ru.parse_args(Args, ALIAS_DEFAULTS)
    local_batch_size, local_prompts = validate(args)
    accelerator = ru.make_accelerator(args)
    batch_size = local_batch_size * accelerator.num_processes
    num_total_batches = min(math.ceil(args.total_episodes / batch_size), args.max_steps or math.inf)
    ru.seed_everything(args.seed, accelerator.process_index)

    # 2. tokenizer and data: prompts tokenised once; completions fitted into the model's positions after them
    policy_path = ru.resolve_model(args.model)
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=args.trust_remote_code)
    toolset = ep.load_toolset(args, tokenizer)  # None: single-turn completions
    data = ro.load_prompt_data(args, tokenizer, policy_path, toolset, images=True)
    output_dir = ru.output_dir(args, data.name, accelerator)

    # 3. models: policy (+LoRA) and optimizer, prepared; reference (beta > 0), rewards; each one's forward (forwards.py)
    policy = models.load_policy(policy_path, tokenizer, args)
    optimizer, scheduler = tl.adamw_linear_decay(policy, args.learning_rate, num_total_batches * args.num_iterations)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    forwards = ro.rollout_forwards(args, tokenizer.pad_token_id, samples_per_prompt=args.num_generations)
    reference = None if args.beta == 0 else ru.reference_from_flags(args, policy, tokenizer, policy_path, accelerator,
                                                                     forwards)
    reward_sources = rs.load_rewards(args, tokenizer, forwards, args.model, data.name, [data.train, data.eval_data],
                                     accelerator, toolset and toolset.environment_types, max_steps=num_total_batches)

    # 4. checkpointable state (kl_coef: beta), the loss, the sampler
    state = dict(step=0, episode=0, prompts_seen=0, nonfinite_skipped=0, kl_coef=args.beta,
                 entropy_coef=args.entropy_coef, last_entropy=math.inf)  # the last two: adaptive entropy control
    logger, optimizer_step = tl.start_or_resume(args, accelerator, policy, optimizer, scheduler, output_dir, state)
    logger.progress(num_total_batches, state["step"], batch_size, "episodes",
                    ("objective/scores", "objective/kl", "eval/gold_score"))
    grpo_loss, micro_batches = GRPOLoss.from_args(args), acc.micro_batches(args, accelerator, policy)  # --token_budget
    sampler = ro.Sampler(args, accelerator, tokenizer, policy, forwards.lm(policy), reward_sources, reference,
                         prompts=data.train_prompts, rows=data.train, samples_per_prompt=args.num_generations,
                         prompts_per_process=local_prompts, vision=data.vision,
                         weights_version=state["step"], toolset=toolset, context_limit=data.context_limit)
    rollouts = ra.RunAhead(sampler, args.max_staleness, args.resume_from)  # --max_staleness N: sampled N steps ahead
    stop = tl.StopSignal()
    if state["step"] == 0:
        logger.log(ev.evaluate_policy(sampler, data.held_out, logger, 0, pass_at_k=args.num_eval_generations), step=0)

    bonus = args.step_entropy_coef(state) is not None  # the entropy bonus: the forward's entropy with gradient
    high_entropy = args.top_entropy_quantile < 1  # the forward's entropy picks the tokens trained on
    meter = tp.StepMeter(accelerator, models.unwrap(policy), passes=args.num_iterations, episode=state["episode"])
    while state["step"] < num_total_batches:
        step, beta = state["step"] + 1, state["kl_coef"]
        meter.start()
        # 5. rollout: local_prompts prompts x num_generations, scored; 6. group-relative advantages, the loss mask
        with tl.checkpoint_on_error(RolloutError, accelerator, output_dir, dict(state), scheduler):
            batch, advantages, loss_mask, rounds, batch_metrics = sample_batch(rollouts, reward_sources, args, state,
                                                                               accelerator)
        tokens_per_micro_batch = ru.global_sum(accelerator, loss_mask.sum().item()) / (
            accelerator.num_processes * args.gradient_accumulation_steps)

        # 7. policy update: num_iterations optimizer steps on this batch, micro-batches accumulated
        losses, stats, token_entropies, kl = [], {}, [], []
        for iteration in range(args.num_iterations):
            window = torch.zeros(2, device=accelerator.device)  # entropy sum and count of the trained tokens
            entropy_coef, with_entropy = args.step_entropy_coef(state), iteration == 0 or bonus or high_entropy
            for mb in micro_batches.split(batch.shuffled_rows(), batch.token_counts, group_size=args.num_generations,
                                          mean_over=grpo_loss.mean_over(loss_mask)):
                micro, coef = batch.subset(mb), micro_batches.mean_term(entropy_coef)  # coef: a micro-batch mean's
                with micro_batches.accumulate():
                    out = sampler.forward.logprobs(policy, micro.query_responses, micro.context_length,
                                                   entropy=with_entropy, entropy_grad=bonus, images=micro.images)
                    new_logprobs, token_entropy = out if with_entropy else (out, None)  # (b, R) each
                    # pi_old: the rollout's, or at one iteration this forward's own, detached (a ratio of 1, as TRL)
                    old = new_logprobs.detach() if micro.old_logprobs is None else micro.old_logprobs
                    loss, mb_stats, mb_window = grpo_loss(
                        new_logprobs, token_entropy, old, micro.behaviour_logprobs, micro.ref_logprobs, advantages[mb],
                        loss_mask[mb], micro.importance_weights(old), beta=beta, entropy_coef=coef,
                        tokens_per_micro_batch=tokens_per_micro_batch, accelerator=accelerator)
                    losses.append(micro_batches.backward(loss))
                window += mb_window
                if iteration == 0:  # the importance weights, the sampling policy's entropy and KL to the reference
                    mb_stats.update(micro.importance_sampling_stats(old))
                    token_entropies.append((token_entropy.detach() * micro.response_mask).sum(1))
                    if micro.ref_logprobs is not None:
                        kl.append(((old - micro.ref_logprobs) * micro.response_mask).sum(1))
                for key, value in mb_stats.items():
                    stats.setdefault(key, []).append(value)
            optimizer_step(torch.stack(losses[-len(micro_batches):]), state, step)
            args.update_entropy_coef(state, window, accelerator)  # Skywork-OR1's next coefficient
        state.update(step=step, episode=state["episode"] + batch_size, nonfinite_skipped=optimizer_step.skipped,
                     prompts_seen=state["prompts_seen"] + rounds * local_prompts * accelerator.num_processes)

        # 8. log, adapt beta (--kl_target), evaluate every eval_steps steps and after the last
        metrics = ru.reduce_metrics(accelerator, {
            "objective/entropy": torch.cat(token_entropies).mean(), "loss/policy": torch.stack(losses).mean(),
            **{key: torch.stack(values).mean() for key, values in stats.items()},
            "nonfinite/skipped": float(state["nonfinite_skipped"]),
            **({"objective/entropy_coef": state["entropy_coef"]} if bonus else {}),
            **({"objective/kl": torch.cat(kl).mean()} if reference is not None else {}), **batch_metrics})
        metrics.update({**batch.metrics, **reward_sources.metrics(batch.source_scores, accelerator)})
        if reference is not None:
            metrics["objective/beta"] = beta
            state["kl_coef"] = tl.adaptive_kl_coef(beta, metrics["objective/kl"], batch_size, args.kl_target,
                                                   args.kl_horizon)
        metrics.update({**optimizer_step.metrics(), **meter.batch_metrics(batch.query_responses, tokenizer.pad_token_id,
                                                                       batch.metrics, episode=state["episode"])})
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
