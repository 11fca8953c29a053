"""REINFORCE Leave-One-Out (RLOO): Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
Learning from Human Feedback in LLMs" (https://arxiv.org/abs/2402.14740). Per step: sample rloo_k completions per
prompt, reward minus kl_coef x KL to the reference, advantage = reward - the mean of the prompt's other k - 1, then
the clipped REINFORCE loss. Defaults: TRL's RLOO TL;DR run; metrics: docs/metrics.md; options: --help and docs/.

    python rloo.py                                  # the toy task on a CPU, about a minute
    python rloo.py --model toy_tools                # the toy tool world: multi-turn episodes with a lookup tool
    python rloo.py --model toy_vision               # the toy vision world: a tiny LLaVA answers about pictures
    accelerate launch rloo.py --model pythia-1b     # the published TL;DR setting
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
from plumbing import models
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
class Args(tl.TrainFlags, models.PolicyFlags, du.DataFlags, ro.RolloutFlags, pc.ReferenceFlags, rs.RewardFlags,
           tl.KLControlFlags, ps.PromptSharingFlags, vg.VLLMFlags, ra.AsyncFlags, ep.ToolFlags):
    # shared flags whose default differs here (TRL's RLOO TL;DR run)
    per_device_train_batch_size: int = 16
    gradient_accumulation_steps: int = 16
    temperature: float = 0.7
    missing_eos_penalty: Optional[float] = 1.0

    # RLOO
    rloo_k: int = 2
    """completions sampled per prompt (k of the leave-one-out baseline)"""
    kl_coef: float = 0.03
    """beta: weight of the KL-to-reference penalty in the reward (the start value if --kl_target adapts it)"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL estimator: k1 = logp - ref_logp; k3 = exp(ref_logp - logp) - 1 - (ref_logp - logp)"""
    token_level_kl: bool = False
    """penalise KL per token (return-to-go of per-token rewards) instead of once per sequence"""
    normalize_advantage: bool = False
    """whiten the advantages over the batch"""
    cliprange: float = 0.2
    """clip range of the policy's importance ratio"""
    num_ppo_epochs: int = 1
    """passes over each batch of rollouts"""
    num_mini_batches: int = 1
    """mini-batches (optimizer steps) per pass over a batch of rollouts"""


# Toy-tuned defaults, applied only to flags not given on the command line (docs/toy_worlds.md).
ALIAS_DEFAULTS = {"toy": dict(
    total_episodes=8192, learning_rate=1e-4, per_device_train_batch_size=64, gradient_accumulation_steps=1, rloo_k=4,
    kl_coef=0.2, temperature=1.0, response_length=8, max_prompt_length=8, eval_steps=16, num_eval_prompts=256,
    missing_eos_penalty=1.0, local_rollout_forward_batch_size=256),
    # the toy tool world (toy_tools.py): the verifiable gold reward, its lookup tool, two tool rounds
    "toy_tools": dict(
        total_episodes=12288, learning_rate=3e-4, per_device_train_batch_size=64, gradient_accumulation_steps=1,
        rloo_k=4, kl_coef=0.0, response_length=24, max_prompt_length=16, eval_steps=16, num_eval_prompts=256,
        missing_eos_penalty=1.0, local_rollout_forward_batch_size=256, reward_funcs=["gold"],
        tools=["toy_worlds.toy_tools:lookup"], max_tool_calling_iterations=2)}
# toy_hard (toy_task.SETTINGS): the toy defaults and budget, with room for its longer prompts and answers
ALIAS_DEFAULTS["toy_hard"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=10, response_length=10)
# toy_vision (toy_vision.py): the toy defaults, the gold reward, room for a prompt's image tokens, 48 steps (it has
# learnt what it can by about step 40: benchmark/results/toy_vision.md)
ALIAS_DEFAULTS["toy_vision"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=None, response_length=3,
                                    reward_funcs=["gold"], total_episodes=64 * 48)


# ALGO LOGIC: the RLOO pieces, pure functions of tensors (tested in tests/test_rloo.py)
def per_token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """(B, R), (B, R) -> (B, R) per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.
    k1 = log r with r = pi/pi_ref (unbiased, can be negative); k3 = (1/r - 1) + log r (unbiased, >= 0)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def leave_one_out_baseline(rewards: torch.Tensor, rloo_k: int) -> torch.Tensor:
    """(P * k,) -> (P * k,) mean reward of the OTHER k-1 completions of the same prompt.
    Rows are grouped prompt by prompt (repeat_interleave order): rows [i*k, (i+1)*k) share prompt i.
    A group whose rewards are all equal (max == min) gets that value as its baseline exactly: in float32 the
    (sum - own) / (k - 1) of equal values can be a rounding step off, and whitening would blow that up."""
    grouped = rewards.view(-1, rloo_k)  # (P, k)
    baseline = (grouped.sum(1, keepdim=True) - grouped) / (rloo_k - 1)
    flat = grouped.amax(1, keepdim=True) == grouped.amin(1, keepdim=True)  # (P, 1)
    return torch.where(flat, grouped, baseline).reshape(-1)


def token_level_returns(scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor,
                        kl_coef: float) -> torch.Tensor:
    """Per-token rewards r_t = -kl_coef * kl_t, plus the score at the last response token; returns the
    undiscounted REINFORCE return-to-go G_t = sum_{s >= t} r_s, (B, R), zero on padding. G_0 is the sequence
    reward score - kl_coef * sum_t kl_t."""
    rewards = -kl_coef * kl * response_mask
    last = pc.last_token_index(response_mask.bool())
    rewards[torch.arange(rewards.shape[0]), last] += scores
    return rewards.flip(1).cumsum(1).flip(1) * response_mask


def whiten_advantages(advantages: torch.Tensor, mask: torch.Tensor, accelerator=None) -> torch.Tensor:
    """(advantages - mean) / (std + 1e-8) where the float `mask` is 1, else 0; mean and biased std over ALL processes'
    entries (the same global batch gives the same advantages on any number of processes): two passes, one
    all-reduce each. Constant advantages stay 0, never NaN."""
    sums = torch.stack([(advantages * mask).sum(), mask.sum()])  # [sum, count] of this process's entries
    sums = sums if accelerator is None else accelerator.reduce(sums, reduction="sum")
    mean = sums[0] / sums[1]
    squares = ((advantages - mean) ** 2 * mask).sum()
    squares = squares if accelerator is None else accelerator.reduce(squares, reduction="sum")
    return (advantages - mean) / ((squares / sums[1]).sqrt() + 1e-8) * mask


def rloo_advantages(scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float,
                    rloo_k: int, *, token_level_kl: bool, normalize: bool, accelerator=None):
    """scores (B,), kl (B, R) per-token KL, response_mask (B, R) -> (advantages, rlhf_reward, non_score_reward).
    Sequence-level: rlhf_reward = score - kl_coef * sum_t kl_t, advantage (B,) = rlhf_reward - LOO baseline.
    Token-level: advantage (B, R) = return-to-go G_t - LOO baseline (baseline from the others' G_0).
    `normalize` whitens over all processes' rows (`whiten_advantages`; every process calls this once per step)."""
    response_mask = response_mask.to(kl.dtype)
    non_score_reward = -kl_coef * (kl * response_mask).sum(1)  # (B,)
    rlhf_reward = scores + non_score_reward  # (B,)
    baseline = leave_one_out_baseline(rlhf_reward, rloo_k)  # (B,)
    if token_level_kl:
        advantages = (token_level_returns(scores, kl, response_mask, kl_coef) - baseline[:, None]) * response_mask
    else:
        advantages = rlhf_reward - baseline
    if normalize:
        advantages = whiten_advantages(advantages, response_mask if token_level_kl else torch.ones_like(advantages),
                                       accelerator)
    return advantages, rlhf_reward, non_score_reward


def clipped_policy_loss(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, cliprange: float, is_weights: Optional[torch.Tensor] = None):
    """Clipped-ratio REINFORCE loss. new/old_logprobs, response_mask: (B, R).
    advantages (B,): the completion is one action, ratio = exp(sum_t new - old) (RLOO's sequence view).
    advantages (B, R): every token is an action with its own ratio; token losses are summed per sequence.
    is_weights (shaped as advantages): each action's loss times its weight (Rollout.importance_weights: samples of
    another policy, vLLM's or earlier weights').
    Returns (loss, stats) with stats = clipfrac, ratio (per action, for logging), approxkl."""
    mask = response_mask.to(new_logprobs.dtype)
    log_ratio = (new_logprobs - old_logprobs) * mask  # (B, R)
    if advantages.dim() == 1:
        log_ratio, mask = log_ratio.sum(1), torch.ones_like(advantages)  # (B,)
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss_max = torch.max(pg_losses, pg_losses_clipped) * mask
    if is_weights is not None:
        pg_loss_max = pg_loss_max * is_weights
    loss = (pg_loss_max.sum(1) if pg_loss_max.dim() == 2 else pg_loss_max).mean()
    with torch.no_grad():
        stats = dict(clipfrac=pc.masked_mean((pg_losses_clipped > pg_losses).float(), mask.bool()),
                     approxkl=pc.masked_mean(0.5 * log_ratio ** 2, mask.bool()), ratio=ratio[mask.bool()])
    return loss, stats


def validate(args: Args):
    """Check RLOO's flags (each flag group checked its own in ru.parse_args) and derive the per-process sizes once:
    returns (local_batch_size, local_prompts): sequences per process per step, and the prompts they sample (the
    rloo_k completions of a prompt stay on one process)."""
    if args.rloo_k < 2:
        raise UserError(f"--rloo_k must be >= 2 (the leave-one-out baseline needs other samples), got {args.rloo_k}")
    if args.kl_coef < 0 or args.cliprange <= 0 or min(args.num_ppo_epochs, args.num_mini_batches) < 1:
        raise UserError("--kl_coef must be >= 0, --cliprange > 0, --num_ppo_epochs and --num_mini_batches >= 1")
    if args.kl_target is not None and args.kl_coef == 0:
        raise UserError("--kl_target adapts a --kl_coef that starts above 0")
    if (args.use_vllm or args.max_staleness) and not args.token_level_kl and \
            (args.vllm_importance_sampling_mode or "").startswith("token_"):  # the sequence view: a term per completion
        raise UserError(f"--vllm_importance_sampling_mode {args.vllm_importance_sampling_mode} weights each token's "
                        "loss, but rloo.py's loss has one term per completion (its sequence view): use "
                        "sequence_truncate / sequence_mask, or --token_level_kl for a loss per token")
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    local_prompts = pc.exact_div(local_batch_size, args.rloo_k, "local_batch_size (per_device_train_batch_size * "
                                 "gradient_accumulation_steps * num_mini_batches) / rloo_k")
    return local_batch_size, local_prompts


def main():
    # 1. arguments: validate and derive every batch size once
    args = ru.parse_args(Args, ALIAS_DEFAULTS)
    local_batch_size, local_prompts = validate(args)
    accelerator = ru.make_accelerator(args)
    batch_size = local_batch_size * accelerator.num_processes
    num_total_batches = min(math.ceil(args.total_episodes / batch_size), args.max_steps or math.inf)
    num_optimizer_steps = num_total_batches * args.num_ppo_epochs * args.num_mini_batches
    ru.seed_everything(args.seed, accelerator.process_index)

    # 2. tokenizer and data: prompts tokenised once; completions fitted into the model's positions after them
    policy_path = ru.resolve_model(args.model)
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=args.trust_remote_code)
    toolset = ep.load_toolset(args, tokenizer)  # None: single-turn completions
    data = ro.load_prompt_data(args, tokenizer, policy_path, toolset, images=True)
    output_dir = ru.output_dir(args, data.name, accelerator)

    # 3. models: policy (+LoRA) with its optimizer (linear decay per optimizer step), prepared; frozen reference;
    #    reward sources (a frozen reward model and/or functions); the forward each runs, chosen once it is placed
    #    (plumbing/forwards.py: a prompt's rloo_k samples encode it once, packed, ...)
    policy = models.load_policy(policy_path, tokenizer, args)
    optimizer, scheduler = tl.adamw_linear_decay(policy, args.learning_rate, num_optimizer_steps)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    forwards = ro.rollout_forwards(args, tokenizer.pad_token_id, samples_per_prompt=args.rloo_k)
    reference = ru.reference_from_flags(args, policy, tokenizer, policy_path, accelerator, forwards)
    reward_sources = rs.load_rewards(args, tokenizer, forwards, args.model, data.name, [data.train, data.eval_data],
                                     accelerator, toolset and toolset.environment_types, max_steps=num_total_batches)
    forward = forwards.lm(policy)

    # 4. checkpointable state, micro-batches, the sampler
    state = dict(step=0, episode=0, prompts_seen=0, nonfinite_skipped=0, kl_coef=args.kl_coef)
    logger, optimizer_step = tl.start_or_resume(args, accelerator, policy, optimizer, scheduler, output_dir, state)
    logger.progress(num_total_batches, state["step"], batch_size, "episodes",
                    ("objective/scores", "objective/kl", "eval/gold_score"))
    micro_batches = acc.micro_batches(args, accelerator, policy)  # or sized by --token_budget
    sampler = ro.Sampler(args, accelerator, tokenizer, policy, forward, reward_sources, reference,
                         prompts=data.train_prompts, rows=data.train, samples_per_prompt=args.rloo_k,
                         prompts_per_process=local_prompts, vision=data.vision,
                         weights_version=state["step"], toolset=toolset, context_limit=data.context_limit)
    # the batches: sampled now, or with --max_staleness N by the sampler N steps ahead (pending ones checkpointed)
    rollouts = ra.RunAhead(sampler, args.max_staleness, args.resume_from)
    stop = tl.StopSignal()
    if state["step"] == 0:
        logger.log(ev.evaluate_policy(sampler, data.held_out, logger, 0), step=0)

    meter = tp.StepMeter(accelerator, models.unwrap(policy), passes=args.num_ppo_epochs)  # perf/*
    start_time, start_episode = time.time(), state["episode"]
    while state["step"] < num_total_batches:
        step, kl_coef = state["step"] + 1, state["kl_coef"]
        meter.start()
        # 5. rollout: this process's local_prompts prompts, rloo_k completions each, scored; old and reference
        #    log-probs (a failure on any process first keeps the finished steps)
        with tl.checkpoint_on_error(RolloutError, accelerator, output_dir, dict(state), scheduler):
            batch = rollouts.rollout(state["prompts_seen"], weights_version=state["step"], entropy=True)
        response_mask = batch.response_mask  # (B, R)

        # 6. KL-penalised rewards and leave-one-out advantages
        with torch.no_grad():
            kl = per_token_kl(batch.old_logprobs, batch.ref_logprobs, args.kl_estimator) * response_mask  # (B, R)
            advantages, rlhf_reward, non_score_reward = rloo_advantages(
                batch.scores, kl, response_mask, kl_coef, args.rloo_k, token_level_kl=args.token_level_kl,
                normalize=args.normalize_advantage, accelerator=accelerator)

        # 7. policy update: num_ppo_epochs x num_mini_batches optimizer steps, micro-batches accumulated
        losses, stats = [], dict(clipfrac=[], approxkl=[], ratio=[])
        for _ in range(args.num_ppo_epochs):
            for mini_batch in batch.shuffled_rows().view(args.num_mini_batches, -1):
                for mb in micro_batches.split(mini_batch, batch.token_counts, group_size=args.rloo_k):
                    micro = batch.subset(mb)
                    with micro_batches.accumulate():
                        new_logprobs = forward.logprobs(policy, micro.query_responses, micro.context_length,
                                                        images=micro.images)  # (b, R)
                        # sampled by another policy (vLLM, earlier weights): each term of the loss (a completion's, or
                        # a token's) weighted by pi_old / pi_behaviour; None when pi_old sampled
                        is_weights = micro.importance_weights(micro.old_logprobs, sequence_loss=advantages.dim() == 1)
                        loss, mb_stats = clipped_policy_loss(new_logprobs, micro.old_logprobs, advantages[mb],
                                                             micro.response_mask, args.cliprange, is_weights)
                        losses.append(micro_batches.backward(loss))  # a mean over the micro-batch's completions
                    for key, value in mb_stats.items():
                        stats[key].append(value)
                optimizer_step(torch.stack(losses[-len(micro_batches):]), state, step)  # clip, check, step, schedule
        state.update(step=step, episode=state["episode"] + batch_size, nonfinite_skipped=optimizer_step.skipped,
                     prompts_seen=state["prompts_seen"] + local_prompts * accelerator.num_processes)

        # 8. log, adapt kl_coef (--kl_target), evaluate every eval_steps steps and after the last
        ratio = torch.cat(stats["ratio"])
        metrics = ru.reduce_metrics(accelerator, {
            "objective/scores": batch.scores.mean(), "objective/kl": kl.sum(1).mean(),
            "objective/non_score_reward": non_score_reward.mean(), "objective/rlhf_reward": rlhf_reward.mean(),
            "objective/entropy": (batch.entropy * response_mask).sum(1).mean(),
            "objective/advantage_std": advantages[response_mask].std() if advantages.dim() == 2 else advantages.std(),
            "loss/policy": torch.stack(losses).mean(), "policy/clipfrac": torch.stack(stats["clipfrac"]).mean(),
            "policy/approxkl": torch.stack(stats["approxkl"]).mean(), "val/ratio": ratio.mean(),
            "val/ratio_var": ratio.var() if ratio.numel() > 1 else torch.tensor(0.0),
            **batch.length_metrics(), "nonfinite/skipped": float(state["nonfinite_skipped"]),
            **batch.importance_sampling_stats(batch.old_logprobs, sequence_loss=advantages.dim() == 1),
        })
        metrics.update({**batch.metrics, **reward_sources.metrics(batch.source_scores, accelerator)})
        metrics["objective/kl_coef"] = kl_coef
        state["kl_coef"] = tl.adaptive_kl_coef(kl_coef, metrics["objective/kl"], batch_size, args.kl_target,
                                               args.kl_horizon)
        metrics.update({**optimizer_step.metrics(), "episode": state["episode"],
                        "time/episodes_per_second": (state["episode"] - start_episode) / (time.time() - start_time)})
        metrics.update(meter.batch_metrics(batch.query_responses, tokenizer.pad_token_id, batch.metrics))
        if (args.eval_steps and step % args.eval_steps == 0) or step == num_total_batches:
            metrics.update(ev.evaluate_policy(sampler, data.held_out, logger, step))
        logger.log(metrics, step=step)

        # 9. checkpoints: periodic, and on SIGTERM / Ctrl-C on any process (then every process stops cleanly)
        if tl.checkpoint_or_stop(accelerator, args, output_dir, state, scheduler, stop, num_total_batches,
                                 extra_files=rollouts.save):  # with --max_staleness, the batches sampled ahead too
            rollouts.close()
            logger.close()
            return

    # 10. final save
    rollouts.close()
    tl.save_model(accelerator, policy, tokenizer, os.path.join(output_dir, "model"), merge_peft=args.merge_peft)
    logger.close(os.path.join(output_dir, "model"))


if __name__ == "__main__":
    ru.main_guard(main)
