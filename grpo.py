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
from plumbing import data_utils as du
from plumbing import episodes as ep
from plumbing import evaluation as ev
from plumbing import models
from plumbing import prompt_sharing as ps
from plumbing import reward_sources as rs
from plumbing import rollout as ro
from plumbing import run_ahead as ra
from plumbing import run_utils as ru
from plumbing import train_loop as tl
from plumbing import vllm_generation as vg
from plumbing.errors import RolloutError, UserError


@dataclass
class Args(tl.TrainFlags, models.PolicyFlags, du.DataFlags, ro.RolloutFlags, pc.ReferenceFlags, rs.RewardFlags,
           tl.KLControlFlags, ps.PromptSharingFlags, vg.VLLMFlags, ra.AsyncFlags, ep.ToolFlags):
    # shared flags whose default differs here (TRL 1.16's GRPOConfig)
    learning_rate: float = 1e-6
    response_length: int = 512

    # GRPO (names and defaults of TRL 1.16's GRPOConfig)
    num_generations: int = 8
    """completions sampled per prompt (the group of the group-relative advantage)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide advantages by the std of the group's rewards, of the whole batch's, or not at all (none = Dr. GRPO)"""
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
    rewards (`batch`), or not (`none`); stds are unbiased, NaN rows are left out and get advantage 0.
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
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return advantages.nan_to_num(0.0), zero_std


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


def per_token_loss(new_logprobs, old_logprobs, ref_logprobs, advantages, mask, *, importance_sampling_level: str,
                   epsilon: float, epsilon_high: float, beta: float, is_weights=None):
    """The clipped surrogate (+ beta x k3 KL to the reference) per token. new/old/ref_logprobs, mask: (b, R);
    advantages (b,). Token level: ratio_t = exp(new_t - old_t); sequence level (GSPO): one ratio per sequence,
    exp(mean over its tokens of new - old). is_weights (b, R): the surrogate of each token times its weight
    (pc.importance_weights: samples of another policy; the KL term is not reweighted, as TRL). Returns (loss (b, R),
    stats)."""
    mask = mask.to(new_logprobs.dtype)
    log_ratio = new_logprobs - old_logprobs  # (b, R)
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1.0))[:, None]  # (b, 1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])  # (b, R) or (b, 1)
    if is_weights is not None:
        loss = loss * is_weights  # (b, R)
    if beta != 0.0:
        kl = torch.exp(ref_logprobs - new_logprobs) - (ref_logprobs - new_logprobs) - 1  # k3, >= 0
        loss = loss + beta * kl
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
    state = dict(step=0, episode=0, prompts_seen=0, nonfinite_skipped=0, kl_coef=args.beta)
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

    start_time, start_episode = time.time(), state["episode"]
    while state["step"] < num_total_batches:
        step, beta = state["step"] + 1, state["kl_coef"]
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

        # 6. group-relative advantages; the loss mask and its token count over all processes (for dapo)
        advantages, zero_std = group_advantages(scores, args.num_generations, args.scale_rewards, accelerator)
        loss_mask = response_mask & ~(truncated[:, None] & args.mask_truncated_completions)  # DAPO: no cut ones
        loss_mask &= ~(zero_std[:, None] & args.skip_zero_std_groups)  # flat groups: no signal
        global_tokens = ru.global_sum(accelerator, loss_mask.sum().item())
        tokens_per_micro_batch = global_tokens / (accelerator.num_processes * args.gradient_accumulation_steps)

        # 7. policy update: num_iterations optimizer steps on this batch, micro-batches accumulated
        losses, stats, entropy, kl = [], {}, [], []
        for iteration in range(args.num_iterations):
            for mb in batch.shuffled_rows().view(args.gradient_accumulation_steps, -1):  # per_device rows each
                micro = batch.subset(mb)
                with accelerator.accumulate(policy):
                    new_logprobs, token_entropy = sampler.forward_logprobs(policy, micro, entropy=iteration == 0)
                    # pi_old: the rollout's, or at one iteration this forward's own, detached (a ratio of 1, as TRL)
                    old = new_logprobs.detach() if micro.old_logprobs is None else micro.old_logprobs
                    # pi_old / pi_behaviour when another policy sampled (vLLM, earlier weights), else None
                    is_weights = pc.importance_weights(old, micro.behaviour_logprobs, micro.response_mask,
                                                       micro.importance_sampling)
                    token_loss, mb_stats = per_token_loss(
                        new_logprobs, old, micro.ref_logprobs, advantages[mb], loss_mask[mb],
                        importance_sampling_level=args.importance_sampling_level, epsilon=args.epsilon,
                        epsilon_high=args.epsilon_high, beta=beta, is_weights=is_weights)
                    loss = aggregate_loss(token_loss, loss_mask[mb], args.loss_type, args.response_length,
                                          tokens_per_micro_batch)
                    accelerator.backward(loss)
                losses.append(loss.detach())
                if iteration == 0:  # the importance weights, the sampling policy's entropy and KL to the reference
                    mb_stats.update(pc.importance_sampling_stats(old, micro.behaviour_logprobs, micro.response_mask,
                                                                 micro.importance_sampling))
                    entropy.append((token_entropy * micro.response_mask).sum(1))
                    if micro.ref_logprobs is not None:
                        kl.append(((old - micro.ref_logprobs) * micro.response_mask).sum(1))
                for key, value in mb_stats.items():
                    stats.setdefault(key, []).append(value)
            optimizer_step(torch.stack(losses[-args.gradient_accumulation_steps:]), state, step)
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
            **({"objective/kl": torch.cat(kl).mean()} if reference is not None else {}), **sampling_metrics,
        })
        metrics.update({**batch.metrics, **reward_sources.metrics(batch.source_scores, accelerator)})
        if reference is not None:
            metrics["objective/beta"] = beta
            state["kl_coef"] = tl.adaptive_kl_coef(beta, metrics["objective/kl"], batch_size, args.kl_target,
                                                   args.kl_horizon)
        metrics.update({"lr": optimizer_step.lr, "episode": state["episode"],
                        "time/episodes_per_second": (state["episode"] - start_episode) / (time.time() - start_time)})
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
