# PPO with a learned value function for RLHF. References: Ouyang et al. 2022 (InstructGPT); Huang et al. 2024,
# "The N+ Implementation Details of RLHF with PPO" (code: vwxyzjn/summarize_from_feedback_details ppo.py);
# Ziegler et al. 2019 (adaptive KL controller).
#   python ppo.py                                  # the offline toy task on a CPU, a few minutes
#   accelerate launch ppo.py --model pythia-1b     # TL;DR with the published Pythia SFT and reward models
# The reward: a reward model and/or reward functions, weighted (reward_sources.py), at the last token of the response.
# Metrics (metrics.jsonl, a row per update): objective/* (scores, kl, non_score_reward, rlhf_reward, entropy, kl_coef),
# reward/<source>/mean and /std (each reward source on its own, before weights and penalty), loss/policy, loss/value,
# policy/*, val/*, adv/*, returns/mean, lr, episode; eval/* (greedy, held-out prompts): scores, kl, response_length,
# eos_rate, reward/<source>/*, gold_score (when the task has a ground-truth scorer).
# --use_vllm samples with a colocated vLLM engine (vllm_generation.py) and adds vllm/logprob_diff, vllm/is_weight_*,
# vllm/is_truncated_frac (truncated importance weights on the policy loss) and time/weight_sync_seconds.
import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

import policy_common as pc
from plumbing import accumulation as acc
from plumbing import data_utils as du
from plumbing import evaluation as ev
from plumbing import models
from plumbing import reward_sources as rs
from plumbing import rollout as ro
from plumbing import run_utils as ru
from plumbing import throughput as tp
from plumbing import train_loop as tl
from plumbing import vllm_generation as vg
from plumbing.errors import RolloutError, UserError, require_positive
from policy_common import masked_mean, masked_var, masked_whiten


@dataclass
class Args(tl.TrainFlags, models.PolicyFlags, du.DataFlags, ro.RolloutFlags, pc.ReferenceFlags, rs.RewardFlags,
           tl.KLControlFlags, vg.VLLMFlags):
    # shared flags whose default differs here (Huang et al. 2024)
    per_device_train_batch_size: int = 16
    gradient_accumulation_steps: int = 4
    eval_steps: int = 200
    temperature: float = 0.7
    missing_eos_penalty: Optional[float] = 1.0
    vllm_importance_sampling_mode: str = "token_truncate"
    vllm_importance_sampling_clip_max: Optional[float] = 2.0

    # PPO (defaults from Huang et al. 2024)
    value_model: Optional[str] = None
    """value model's start; None = the reward model if it reads tokens (Ouyang et al.), else the policy + a new head"""
    num_ppo_epochs: int = 4
    """passes over each batch of rollouts"""
    num_mini_batches: int = 1
    """mini-batches (optimizer steps) per pass over a batch of rollouts"""
    kl_coef: float = 0.05
    """beta: weight of the KL-to-reference penalty in the reward (the start value if --kl_target adapts it)"""
    cliprange: float = 0.2
    """clip range of the policy's importance ratio"""
    cliprange_value: float = 0.2
    """value prediction clip range around the rollout values"""
    vf_coef: float = 0.1
    """value loss coefficient"""
    gamma: float = 1.0
    """discount factor"""
    lam: float = 0.95
    """GAE lambda"""
    whiten_rewards: bool = False
    """whiten the per-token rewards (masked, mean kept) before GAE"""
    save_value_model: bool = False
    """also save the value model to <output_dir>/value_model"""


# toy-task values, applied only to flags not given on the command line
ALIAS_DEFAULTS = {
    "toy": dict(learning_rate=1e-4, per_device_train_batch_size=16, gradient_accumulation_steps=1, num_mini_batches=4,
                total_episodes=64 * 40, response_length=8, temperature=1.0, kl_coef=0.3, missing_eos_penalty=1.0,
                max_prompt_length=16, local_rollout_forward_batch_size=256, eval_steps=10, num_eval_prompts=256),
}
# toy_hard (toy_task.SETTINGS): the toy defaults and budget, with room for its longer prompts and answers
ALIAS_DEFAULTS["toy_hard"] = dict(ALIAS_DEFAULTS["toy"], response_length=10)


def validate(args: Args, num_processes: int):
    """Check PPO's flags (each flag group checked its own in ru.parse_args) and derive every batch size once (local_ =
    per process): returns (local_batch_size, batch_size, num_total_batches, num_optimizer_steps)."""
    require_positive(args, "num_ppo_epochs", "num_mini_batches", "cliprange", "cliprange_value")
    for name in ("kl_coef", "vf_coef"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name} must be >= 0, got {getattr(args, name)}")
    for name in ("gamma", "lam"):
        if not 0 <= getattr(args, name) <= 1:
            raise UserError(f"--{name} must be in [0, 1], got {getattr(args, name)}")
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    batch_size = local_batch_size * num_processes
    num_total_batches = min(math.ceil(args.total_episodes / batch_size), args.max_steps or math.inf)
    num_optimizer_steps = num_total_batches * args.num_ppo_epochs * args.num_mini_batches
    return local_batch_size, batch_size, num_total_batches, num_optimizer_steps


# ALGO LOGIC: the pieces a researcher changes, each tested in tests/test_ppo.py
def per_token_rewards(logprobs, ref_logprobs, scores, response_mask, kl_coef: float):
    """Rewards of Ziegler et al. / Ouyang et al.: a KL penalty on every response token, the reward-model score
    added at the last real token (the EOS, or the last token when there is no EOS).
    logprobs, ref_logprobs: (B, R); scores: (B,); response_mask: (B, R) bool, True up to and including EOS.
    Returns (rewards, non_score_reward, kl), all (B, R) and zero on padding."""
    kl = (logprobs - ref_logprobs) * response_mask
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), pc.last_token_index(response_mask)] += scores
    return rewards, non_score_reward, kl


def compute_gae(rewards, values, response_mask, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens.
    rewards, values: (B, R); response_mask: (B, R) bool. Padding after a response gets zero reward and value,
    so nothing leaks across the end of a response. Returns (advantages, returns), (B, R), zero on padding."""
    rewards, values = rewards * response_mask, values * response_mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    deltas = rewards + gamma * next_values - values  # TD errors, (B, R)
    last_gae, advantages_reversed = torch.zeros_like(rewards[:, 0]), []
    for t in reversed(range(rewards.shape[1])):
        last_gae = deltas[:, t] + gamma * lam * last_gae
        advantages_reversed.append(last_gae)
    advantages = torch.stack(advantages_reversed[::-1], 1) * response_mask
    return advantages, (advantages + values) * response_mask


def batch_advantages(rewards, values, response_mask, gamma: float, lam: float, whiten_rewards: bool):
    """GAE advantages whitened over the batch (the per-token rewards first, mean kept, with `whiten_rewards`).
    rewards, values: (B, R); response_mask: (B, R) bool. Returns (advantages, raw_advantages, returns), (B, R),
    zero on padding. A batch with a single response token (one row, a lone EOS) has no spread to whiten by:
    masked_var is 0 there, so its advantage whitens to 0 and its reward stays as it is."""
    if whiten_rewards:
        rewards = masked_whiten(rewards, response_mask, shift_mean=False) * response_mask
    raw_advantages, returns = compute_gae(rewards, values, response_mask, gamma, lam)
    return masked_whiten(raw_advantages, response_mask) * response_mask, raw_advantages, returns


def ppo_losses(new_logprobs, old_logprobs, advantages, vpred, old_values, returns, response_mask,
               cliprange: float, cliprange_value: float, is_weights=None):
    """Clipped surrogate policy loss and clipped value loss, masked token means. All inputs (b, R).
    is_weights (b, R): each token's surrogate times its weight (vLLM's truncated importance sampling; the value loss
    is not reweighted). Returns (pg_loss, vf_loss, stats)."""
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss_max = torch.max(pg_losses, pg_losses_clipped)
    pg_loss = masked_mean(pg_loss_max if is_weights is None else pg_loss_max * is_weights, response_mask)
    vpred_clipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses = torch.square(vpred - returns)
    vf_losses_clipped = torch.square(vpred_clipped - returns)
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses, vf_losses_clipped), response_mask)
    with torch.no_grad():
        stats = {"policy/approxkl": 0.5 * masked_mean(log_ratio ** 2, response_mask),
                 "policy/clipfrac": masked_mean((pg_losses_clipped > pg_losses).float(), response_mask),
                 "val/clipfrac": masked_mean((vf_losses_clipped > vf_losses).float(), response_mask),
                 "val/ratio": masked_mean(ratio, response_mask)}
    return pg_loss, vf_loss, stats


def load_value_model(args, tokenizer, reward_sources, policy_path: str):
    """The value model's start (Ouyang et al.): --value_model, else the reward model's weights when it reads the
    policy's token ids, else the policy with a new scalar head. Returns (model, where it was loaded from). A value
    model from the reward model was trained to read the last token only: its values at earlier positions start
    uncalibrated, and the clipped value loss absorbs this without a separate warm-up phase."""
    if args.value_model is not None:
        value_path = ru.resolve_reward_model(args.value_model)
        models.check_same_vocab(tokenizer, models.load_tokenizer(value_path, trust_remote_code=args.trust_remote_code),
                                "value model")
    else:  # a value model reads the policy's token ids: the reward model's weights only if it does too
        value_path = reward_sources.path if reward_sources.mode == "tokens" and reward_sources.path else policy_path
    value_model = models.load_scalar_model(value_path, tokenizer, models.Precision.from_args(args),
                                           trust_remote_code=args.trust_remote_code)
    if args.gradient_checkpointing:
        models.enable_activation_checkpointing(value_model)
    return value_model, value_path


class PolicyAndValue(nn.Module):
    """Policy and value model in one module, so one `accelerator.prepare` and one optimizer cover both (as in
    the N+ details), each run by the forward chosen for it (plumbing/forwards.py). forward: (B, T) ids -> log-probs
    (B, R) of the response tokens under logits / temperature, the entropy (B, R) there (no gradient), and values
    (B, R): the value for predicting response token t is read at position context_length - 1 + t."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy, self.value_model = policy, value_model
        self.policy_forward, self.value_forward = None, None  # choose_forwards

    def choose_forwards(self, forwards) -> None:
        """Each model's forward, chosen once they are placed (forwards.py: packed, the output layer in chunks, ...)."""
        self.policy_forward, self.value_forward = forwards.lm(self.policy), forwards.scalar(self.value_model)

    def forward(self, query_responses, context_length: int):
        logprobs, entropy = self.policy_forward.logprobs(self.policy, query_responses, context_length, entropy=True)
        return logprobs, entropy, self.values(query_responses, context_length)

    def values(self, query_responses, context_length: int, chunk_size: Optional[int] = None):
        """(B, T) -> (B, R) values alone, `chunk_size` rows per forward (all at once by default): the rollout's
        no-grad pass (its log-probs come from the sampler)."""
        chunk_size = chunk_size or len(query_responses)
        return torch.cat([self.value_forward.values(self.value_model, query_responses[i:i + chunk_size])
                          [:, context_length - 1:-1] for i in range(0, len(query_responses), chunk_size)])


def main():
    # 1. arguments, batch sizes, accelerator, seeding
    args = ru.parse_args(Args, ALIAS_DEFAULTS)
    accelerator = ru.make_accelerator(args)
    local_batch_size, batch_size, num_total_batches, num_optimizer_steps = validate(args, accelerator.num_processes)
    ru.seed_everything(args.seed, accelerator.process_index)

    # 2. tokenizer and data: prompts tokenised once; completions fitted into the model's positions after them
    policy_path = ru.resolve_model(args.model)
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=args.trust_remote_code)
    data = ro.load_prompt_data(args, tokenizer, policy_path)
    output_dir = ru.output_dir(args, data.name, accelerator)
    pad = tokenizer.pad_token_id

    # 3. models: reward sources (reward_sources.py), policy (+LoRA) and value in one module with one optimizer (linear
    #    decay per optimizer step), prepared; reference; each one's forward, chosen once placed (plumbing/forwards.py)
    forwards = ro.rollout_forwards(args, pad, samples_per_prompt=1)
    reward_sources = rs.load_rewards(args, tokenizer, forwards, args.model, data.name, [data.train, data.eval_data],
                                     accelerator, max_steps=num_total_batches)
    policy = models.load_policy(policy_path, tokenizer, args)
    value_model, value_path = load_value_model(args, tokenizer, reward_sources, policy_path)
    model = PolicyAndValue(policy, value_model)
    optimizer, scheduler = tl.adamw_linear_decay(model, args.learning_rate, num_optimizer_steps,
                                                 weight_decay=0.01)  # torch's default, as Huang et al.
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    core = models.unwrap(model)  # the PolicyAndValue inside the accelerator's wrapper
    core.choose_forwards(forwards)
    reference = ru.reference_from_flags(args, core.policy, tokenizer, policy_path, accelerator, forwards)

    # 4. checkpointable state, the sampler
    state = dict(step=0, episode=0, prompts_seen=0, nonfinite_skipped=0, kl_coef=args.kl_coef)
    logger, optimizer_step = tl.start_or_resume(args, accelerator, model, optimizer, scheduler, output_dir, state)
    logger.progress(num_total_batches, state["step"], batch_size, "episodes",
                    ("objective/scores", "objective/kl", "eval/gold_score"))
    accelerator.print(f"ppo: {num_total_batches} updates of {batch_size} episodes, reference: "
                      f"{reference.mode}, value model from {value_path} -> {output_dir}")
    micro_batches = acc.micro_batches(args, accelerator, model)  # or sized by --token_budget
    sampler = ro.Sampler(args, accelerator, tokenizer, core.policy, core.policy_forward, reward_sources, reference,
                         prompts=data.train_prompts, rows=data.train, samples_per_prompt=1,
                         prompts_per_process=local_batch_size, max_prompt_length=args.max_prompt_length,
                         weights_version=state["step"])
    stop = tl.StopSignal()
    if state["step"] == 0:
        logger.log({**ev.evaluate_policy(sampler, data.held_out, logger, 0), "episode": 0}, step=0)

    meter = tp.StepMeter(accelerator, core.policy, core.value_model, passes=args.num_ppo_epochs,
                         episode=state["episode"])  # perf/*
    while state["step"] < num_total_batches:
        step, kl_coef = state["step"] + 1, state["kl_coef"]
        meter.start()
        # 5. rollout: this process's local_batch_size prompts, one completion each, scored; old and reference log-probs
        with tl.checkpoint_on_error(RolloutError, accelerator, output_dir, dict(state), scheduler):
            batch = sampler.rollout(state["prompts_seen"], weights_version=state["step"])
        query_responses, context_length = batch.query_responses, batch.context_length
        response_mask = batch.response_mask  # (B, R), True up to and including EOS
        with torch.no_grad():
            # 6. values before the update, a chunk of rows at a time
            values = core.values(query_responses, context_length, args.local_rollout_forward_batch_size)
            logprobs, values = batch.old_logprobs * response_mask, values * response_mask  # (B, R)
            ref_logprobs = batch.ref_logprobs * response_mask

            # 7. rewards: KL penalty on every token, the score (after the missing-EOS penalty) at the last real token
            rewards, non_score_reward, kl = per_token_rewards(logprobs, ref_logprobs, batch.scores, response_mask,
                                                              kl_coef)

            # 8. advantages (GAE, whitened over the batch) and returns
            advantages, raw_advantages, returns = batch_advantages(rewards, values, response_mask, args.gamma,
                                                                   args.lam, whiten_rewards=args.whiten_rewards)

        # 9. PPO epochs: each pass over the shuffled batch makes num_mini_batches optimizer steps, each accumulated
        #    over gradient_accumulation_steps micro-batches of per_device_train_batch_size rows (or --token_budget)
        stats = {}
        for _ in range(args.num_ppo_epochs):
            for mini_batch in batch.shuffled_rows().view(args.num_mini_batches, -1):
                mini_losses = []
                # token means: a micro-batch weighs its share of the mini-batch's response tokens
                for mb in micro_batches.split(mini_batch, batch.token_counts, mean_over=response_mask.sum(1)):
                    micro = batch.subset(mb)
                    with micro_batches.accumulate():
                        new_logprobs, entropy, vpred = model(micro.query_responses, context_length)
                        pg_loss, vf_loss, mb_stats = ppo_losses(new_logprobs, logprobs[mb], advantages[mb], vpred,
                                                                values[mb], returns[mb], response_mask[mb],
                                                                args.cliprange, args.cliprange_value,
                                                                micro.importance_weights(micro.old_logprobs))  # vLLM's
                        loss = pg_loss + args.vf_coef * vf_loss
                        mini_losses.append(micro_batches.backward(loss))
                    mb_stats.update({"loss/policy": micro_batches.logged(pg_loss),
                                     "loss/value": micro_batches.logged(vf_loss),
                                     "policy/entropy": masked_mean(entropy.detach(), response_mask[mb])})
                    for key, value in mb_stats.items():
                        stats.setdefault(key, []).append(value.item())
                optimizer_step(torch.stack(mini_losses), state, step)  # clip, check, step, schedule
        state.update(step=step, episode=state["episode"] + batch_size, nonfinite_skipped=optimizer_step.skipped,
                     prompts_seen=state["prompts_seen"] + local_batch_size * accelerator.num_processes)

        # 10. log, adapt kl_coef (--kl_target), evaluate every eval_steps steps and after the last
        with torch.no_grad():
            metrics = ru.reduce_metrics(accelerator, {
                "objective/scores": batch.scores.mean(), "objective/kl": kl.sum(1).mean(),
                "objective/non_score_reward": non_score_reward.sum(1).mean(),
                "objective/rlhf_reward": (batch.scores + non_score_reward.sum(1)).mean(),
                "objective/entropy": (-logprobs).sum(1).mean(), "objective/kl_coef": kl_coef,
                **{key: float(np.mean(values_)) for key, values_ in stats.items()},
                "val/mean": masked_mean(values, response_mask), "val/var": masked_var(values, response_mask),
                **batch.length_metrics(), "adv/mean": masked_mean(raw_advantages, response_mask),
                "adv/std": masked_var(raw_advantages, response_mask).sqrt(),
                "returns/mean": masked_mean(returns, response_mask), **optimizer_step.metrics(),
                "nonfinite/skipped": state["nonfinite_skipped"], **batch.importance_sampling_stats(batch.old_logprobs),
            })
            metrics.update({**batch.metrics, **reward_sources.metrics(batch.source_scores, accelerator)})
        state["kl_coef"] = tl.adaptive_kl_coef(kl_coef, metrics["objective/kl"], batch_size, args.kl_target,
                                               args.kl_horizon)
        metrics.update(meter.batch_metrics(query_responses, pad, batch.metrics, episode=state["episode"]))
        if (args.eval_steps and step % args.eval_steps == 0) or step == num_total_batches:
            metrics.update(ev.evaluate_policy(sampler, data.held_out, logger, step))
        logger.log(metrics, step=step)

        # 11. checkpoints: periodic, and on SIGTERM / Ctrl-C on any process (then every process stops cleanly)
        if tl.checkpoint_or_stop(accelerator, args, output_dir, state, scheduler, stop, num_total_batches):
            sampler.close()
            return logger.close()

    # 12. final save
    sampler.close()
    tl.save_model(accelerator, model, tokenizer, os.path.join(output_dir, "model"), merge_peft=args.merge_peft,
                  submodule="policy")
    if args.save_value_model:
        tl.save_model(accelerator, model, tokenizer, os.path.join(output_dir, "value_model"), submodule="value_model")
    logger.close(os.path.join(output_dir, "model"))


if __name__ == "__main__":
    ru.main_guard(main)
