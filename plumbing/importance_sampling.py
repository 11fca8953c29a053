"""Importance weights: completions that another policy sampled (a vLLM engine, whose kernels round otherwise: Yao et
al. 2025; or earlier weights, --max_staleness: AReaL's decoupled objective, Fu et al. 2025), reweighted in a loss that
is about pi_old (the policy at the start of the step) by w = pi_old / pi_behaviour, truncated or masked outside
[clip_min, clip_max] (TRL 1.16's vllm_importance_sampling_*). The scripts reach them through their batch
(`rollout.Rollout.importance_weights` / `importance_sampling_stats`); the weights' shape follows the loss they
multiply: one per completion for a loss with one term per completion (rloo.py's sequence view), else one per token.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

import policy_common as pc
from plumbing.errors import UserError


@dataclass(frozen=True)
class ImportanceSampling:
    """How the loss of another policy's samples is reweighted: `mode` is token_* (a ratio per token) or sequence_*
    (one per completion, from its summed log-ratio), *_truncate (clamped into [clip_min, clip_max]) or *_mask (0
    outside them); None: by the loss it weights (`resolved`). clip None: no bound on that side. `sampler` names the
    metrics (vllm/..., or async/... for HF samples of earlier weights); `stale`: the samples may come from earlier
    weights (--max_staleness > 0)."""
    mode: Optional[str] = None
    clip_max: Optional[float] = 3.0
    clip_min: Optional[float] = None
    sampler: str = "vllm"
    stale: bool = False

    @classmethod
    def from_args(cls, args, sampler: str = "vllm") -> "ImportanceSampling":
        """The scripts' --vllm_importance_sampling_* flags (and --max_staleness, where the script has it)."""
        return cls(args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_max,
                   args.vllm_importance_sampling_clip_min, sampler, stale=getattr(args, "max_staleness", 0) > 0)

    def resolved(self, sequence_loss: bool) -> "ImportanceSampling":
        """The mode for a loss with one term per completion (`sequence_loss`) or per token, when none was given:
        AReaL's token_mask (Fu et al. 2025: tokens whose weight exceeds the cap are left out) for samples of earlier
        weights under a loss per token, where a product of a long completion's token ratios leaves the bounds for most
        completions and sequence_mask would drop most of a stale batch (benchmark/results/stale_weights.md); else
        TRL 1.16's sequence_mask (vLLM's rounding)."""
        if self.mode is not None:
            return self
        return dataclasses.replace(self, mode="token_mask" if self.stale and not sequence_loss else "sequence_mask")

    @property
    def per_sequence(self) -> bool:
        return self.mode.startswith("sequence_")

    def outside(self, ratio: torch.Tensor) -> torch.Tensor:
        """Where a ratio lies outside [clip_min, clip_max]."""
        low = -math.inf if self.clip_min is None else self.clip_min
        high = math.inf if self.clip_max is None else self.clip_max
        return (ratio < low) | (ratio > high)


def importance_ratios(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor,
                      per_sequence: bool) -> torch.Tensor:
    """r = pi_old / pi_behaviour of each action, detached: (B, R) per token, or (B, 1) per completion (exp of its summed
    log-ratio, as TRL; not GSPO's mean). A NaN log-ratio (a token the engine could not score) counts as 0, as TRL."""
    mask = response_mask.to(old_logprobs.dtype)
    log_ratio = torch.nan_to_num((old_logprobs - behaviour_logprobs).detach() * mask, nan=0.0)  # (B, R)
    return torch.exp(log_ratio.sum(1, keepdim=True) if per_sequence else log_ratio)


def importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: Optional[torch.Tensor],
                       response_mask: torch.Tensor, sampling: ImportanceSampling, sequence_loss: bool = False):
    """The weight of each action's loss term: w = r truncated into [clip_min, clip_max] (*_truncate) or r inside
    them and 0 outside (*_mask), r = `importance_ratios`. old/behaviour_logprobs, response_mask: (b, R). Returns (b, R)
    weights, 0 on padding (sequence_*: the completion's weight on each of its tokens), or with `sequence_loss` (a loss
    with one term per completion) (b,); None when behaviour_logprobs is None (pi_old sampled them itself)."""
    if behaviour_logprobs is None:
        return None
    sampling = sampling.resolved(sequence_loss)
    if sequence_loss and not sampling.per_sequence:
        raise UserError(f"--vllm_importance_sampling_mode {sampling.mode} weights tokens; this loss has one term per "
                        "completion: use sequence_truncate or sequence_mask")
    ratio = importance_ratios(old_logprobs, behaviour_logprobs, response_mask, sampling.per_sequence)
    if sampling.mode.endswith("_truncate"):
        weights = torch.clamp(ratio, min=sampling.clip_min, max=sampling.clip_max)
    else:
        weights = ratio.masked_fill(sampling.outside(ratio), 0.0)
    return weights.squeeze(1) if sequence_loss else weights * response_mask.to(weights.dtype)


def importance_sampling_stats(old_logprobs: torch.Tensor, behaviour_logprobs: Optional[torch.Tensor],
                              response_mask: torch.Tensor, sampling: ImportanceSampling,
                              sequence_loss: bool = False) -> dict:
    """A step's importance-sampling metrics under `sampling.sampler`'s name (vllm/, async/ for HF samples of earlier
    weights, hf/ for rollout.py's checks of HF samples of the current weights). The sampler-trainer mismatch:
    logprob_diff (mean |log pi_old - log pi_behaviour| per token) and kl (the mean per token of k3 = r - 1 - log r, an
    unbiased estimate of KL(pi_behaviour || pi_old) from the behaviour's samples; Schulman 2020). The weights:
    is_weight_mean|min|max (of r, before truncation or masking, over the actions: tokens, or completions for
    sequence_*) and the fraction of actions outside the bounds, is_truncated_frac (*_truncate) or is_masked_frac
    (*_mask). {} when behaviour_logprobs is None. `sequence_loss`: as in `importance_weights` (it resolves a mode left
    to the loss)."""
    if behaviour_logprobs is None:
        return {}
    sampling = sampling.resolved(sequence_loss)
    ratio = importance_ratios(old_logprobs, behaviour_logprobs, response_mask, sampling.per_sequence)
    actions = response_mask.bool().any(1, keepdim=True) if sampling.per_sequence else response_mask.bool()
    name, tokens = sampling.sampler, response_mask.bool()
    log_ratio = (old_logprobs - behaviour_logprobs).detach().masked_fill(~tokens, 0.0)  # padding's: no overflow in k3
    return {f"{name}/logprob_diff": pc.masked_mean(log_ratio.abs(), tokens),
            f"{name}/kl": pc.masked_mean(torch.expm1(log_ratio) - log_ratio, tokens),
            f"{name}/is_weight_mean": ratio[actions].mean(), f"{name}/is_weight_min": ratio[actions].min(),
            f"{name}/is_weight_max": ratio[actions].max(),
            f"{name}/is_truncated_frac" if sampling.mode.endswith("_truncate") else f"{name}/is_masked_frac":
                sampling.outside(ratio)[actions].float().mean()}
