# Group Relative Policy Optimization (GRPO): Shao et al. 2024, "DeepSeekMath" (https://arxiv.org/abs/2402.03300), and
# the variants that change one line of it: Dr. GRPO (Liu et al. 2025, --scale_rewards none --loss_type dr_grpo),
# DAPO (Yu et al. 2025, --loss_type dapo --epsilon_high 0.28 --mask_truncated_completions), GSPO (Zheng et al. 2025,
# --importance_sampling_level sequence). Flags of the algorithm follow TRL's GRPOConfig (defaults: TRL 1.16's).
#   python grpo.py                                   # toy task, CPU, about a minute
#   python grpo.py --reward_funcs gold               # the same on the toy task's verifiable reward, no reward model
#   accelerate launch grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset <prompts> --reward_funcs file.py:fn
# Per step: sample num_generations completions per prompt, score them (reward model and/or reward functions,
# weighted: reward_sources.py), advantage = (reward - group mean) / (group std + 1e-4), then num_iterations optimizer steps
# on the clipped surrogate (+ beta x k3 KL to the reference in the loss), token losses aggregated per --loss_type.
# Metrics (metrics.jsonl, a row per step): objective/scores (the weighted reward), objective/kl (sequence KL to the
# reference, k1, when beta > 0), objective/beta, objective/entropy, objective/frac_reward_zero_std (groups whose
# rewards are all equal: no signal), objective/advantage_std, reward/<source>/mean and /std, loss/policy,
# policy/clipfrac (low, high), policy/approxkl (new vs old policy), val/num_eos_tokens, val/response_length,
# val/truncated_fraction, nonfinite/skipped, lr, episode, time/episodes_per_second; eval/* (greedy, held-out
# prompts): scores, kl, response_length, eos_rate, reward/<source>/*, gold_score (when the task has one), and with
# --num_eval_generations k and reward functions: pass@k and mean@k over k sampled completions per prompt.
# --use_vllm samples with a colocated vLLM engine (vllm_generation.py) and adds vllm/logprob_diff, vllm/is_weight_*,
# vllm/is_truncated_frac (truncated importance weights on the policy loss) and time/vllm_sync.
import math
import os
import time
from dataclasses import dataclass
from typing import List, Literal, Optional

import numpy as np
import torch

import data_utils as du
import metrics_log as ml
import models
import policy_common as pc
import prompt_sharing as ps
import reward_sources as rs
import run_utils as ru
import train_loop as tl
import vllm_generation as vg
from errors import UserError


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (each process adds its index; a run repeats exactly)"""
    model: str = "toy"
    """policy to start from: alias (toy|pythia-1b|pythia-2.8b|pythia-6.9b), hub id or local folder"""
    ref_model: Optional[str] = None
    """frozen reference policy; None = the starting policy (the adapter-off base with --use_peft)"""
    reward_model: Optional[str] = None
    """reward model: alias, hub id or local folder; None = the one paired with --model (none with --reward_funcs)"""
    reward_model_input: Optional[Literal["tokens", "text"]] = None
    """reward model reads tokens (the policy's ids + EOS) or text (re-tokenised); None = its record, else by vocab"""
    reward_funcs: Optional[List[str]] = None
    """reward functions: gold (the dataset's scorer), path/to/file.py:function or package.module:function"""
    reward_weights: Optional[List[float]] = None
    """one weight per reward source (the reward model first, then each function); None = 1.0 each"""
    dataset: Optional[str] = None
    """training data (columns: see the docstring): alias (toy|tldr), hub id, folder or json/parquet; None = --model's"""
    eval_split: str = "test"
    """split of the dataset held out for evaluation"""
    output_dir: Optional[str] = None
    """where metrics, checkpoints and the model go; None = runs/<run_name>, or the run folder of --resume_from"""
    track: bool = False
    """log to Weights & Biases as well as metrics.jsonl"""
    wandb_project: str = "policy-rlhf"
    """the wandb project name"""

    # Model loading
    use_peft: bool = False
    """train a LoRA adapter on the policy instead of all its weights (the reference is then the adapter-off base)"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA alpha"""
    lora_dropout: float = 0.0
    """LoRA dropout (0 keeps the forward deterministic, as log-ratios to the reference assume)"""
    lora_target_modules: Optional[List[str]] = None
    """modules LoRA adapts; None = PEFT's default for the architecture"""
    merge_peft: bool = False
    """with --use_peft, save merged full weights instead of the adapter"""
    load_in_4bit: bool = False
    """load the policy in 4 bits (QLoRA; needs --use_peft, a GPU and bitsandbytes)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    bf16: bool = False
    """bfloat16 weights (GPU only)"""
    trust_remote_code: bool = False
    """allow models with custom code from the hub"""
    verbose: bool = False
    """show the libraries' own logs and progress bars (quiet by default: the run's own lines and bar only)"""

    # Run length, optimisation, logging
    total_episodes: int = 1_000_000
    """total number of sampled completions (episodes) to train on"""
    max_steps: Optional[int] = None
    """stop after this many steps (RL: rollout batches; DPO/KTO: optimizer steps); the lr schedule ends there"""
    learning_rate: float = 1e-6
    """AdamW learning rate (the peak of the schedule; it decays linearly to 0)"""
    per_device_train_batch_size: int = 8
    """rows per micro-batch (forward/backward) on each process (RL: completions; DPO: pairs; KTO: examples)"""
    gradient_accumulation_steps: int = 8
    """micro-batches accumulated into one optimizer step"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    skip_nonfinite: bool = False
    """skip (and count) a step whose loss or gradient norm is not finite, instead of checkpointing and stopping"""
    eval_steps: int = 0
    """evaluate before training, every this many steps, and after the last step (0 = before and after only)"""
    num_eval_prompts: int = 512
    """held-out prompts completed greedily at each evaluation (at most the split's size)"""
    num_samples_printed: int = 4
    """evaluation samples printed per evaluation"""
    save_steps: int = 0
    """write a resumable checkpoint every this many steps (0 = none)"""
    resume_from: Optional[str] = None
    """checkpoint folder to resume from, exactly (data order, RNG, optimizer, schedule)"""

    # Generation
    response_length: int = 512
    """maximum new tokens per generated completion (a default is lowered to fit the model's positions)"""
    max_prompt_length: Optional[int] = None
    """longest prompt in tokens (None = the longest in the data); RL refuses longer prompts, DPO/KTO cut them left"""
    temperature: float = 1.0
    """sampling temperature (log-probs for ratios and the KL use logits / temperature too)"""
    missing_eos_penalty: Optional[float] = None
    """subtracted from the score of a completion without EOS (None = no penalty)"""
    local_rollout_forward_batch_size: Optional[int] = None
    """rows per generation / no-grad forward chunk (None = per_device_train_batch_size: a no-grad pass needs less
    memory than the training pass over as many rows)"""
    share_prompts: bool = True
    """encode a prompt repeated over rows once when that saves enough (prompt_sharing.py; the same numbers)"""

    # vLLM generation (vllm_generation.py, README "vLLM")
    use_vllm: bool = False
    """generate with a vLLM engine beside each process (weights synced after each step; needs requirements-vllm)"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of its GPU one vLLM engine may take (weights + KV cache), beside the trainer's models"""
    vllm_tensor_parallel_size: int = 1
    """GPUs one vLLM engine is sharded over (with one training process)"""
    vllm_sleep_mode: bool = False
    """free the engine's GPU memory (weights, KV cache) between generations, for the training passes (GPU only)"""
    vllm_is_cap: float = 2.0
    """cap C of the truncated importance weight min(pi_trainer / pi_vllm, C) on the policy loss (Yao et al. 2025)"""

    # Algorithm specific arguments (names and defaults of TRL's GRPOConfig)
    num_generations: int = 8
    """completions sampled per prompt (the group of the group-relative advantage)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide advantages by the std of the group's rewards, of the whole batch's, or not at all (none = Dr. GRPO)"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """loss variant: dpo.py sigmoid (DPO/cDPO), ipo, hinge (SLiC), robust (rDPO); grpo.py aggregation (see its code)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """one importance ratio per token, or one per sequence from the mean token log-ratio (sequence = GSPO)"""
    epsilon: float = 0.2
    """lower clip range of the importance ratio: ratio >= 1 - epsilon"""
    epsilon_high: Optional[float] = None
    """upper clip range: ratio <= 1 + epsilon_high (DAPO's clip-higher: 0.28); None = epsilon"""
    num_iterations: int = 1
    """mu: optimizer steps on each generated batch (1: the ratio is 1 and no old-log-prob forward runs)"""
    beta: float = 0.0
    """KL-to-reference strength: DPO/KTO reward = beta * log(pi / ref); GRPO loss += beta * k3 KL (0: no reference)"""
    kl_target: Optional[float] = None
    """adaptive KL controller target (sequence KL to the reference, nats); None = a fixed coefficient"""
    kl_horizon: int = 10_000
    """adaptive KL controller horizon in episodes"""
    mask_truncated_completions: bool = False
    """leave completions without EOS (cut at response_length) out of the loss (DAPO)"""
    skip_zero_std_groups: bool = False
    """leave groups whose rewards are all equal (zero advantage) out of the loss and its normalisation"""
    num_eval_generations: int = 0
    """k completions sampled per held-out prompt for eval/pass@k and eval/mean@k with reward functions (0 = off)"""


# Toy-tuned defaults, applied only to flags not given on the command line (see README "toy task").
ALIAS_DEFAULTS = {"toy": dict(
    total_episodes=8192, learning_rate=1e-4, per_device_train_batch_size=64, gradient_accumulation_steps=1,
    num_generations=4, beta=0.2, response_length=8, max_prompt_length=8, eval_steps=16, num_eval_prompts=256,
    missing_eos_penalty=1.0, local_rollout_forward_batch_size=256)}


# ALGO LOGIC: the GRPO pieces, pure functions of tensors (tested in tests/test_grpo.py)
def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str, accelerator=None):
    """(P * G,) rewards, NaN for a completion no source scored, grouped prompt by prompt (rows [i*G, (i+1)*G) share
    prompt i) -> (advantages (P * G,), zero_std (P * G,) bool: the row's group has no reward spread).
    advantage = reward - mean of its group, divided by (std + 1e-4) of its group (`group`), of all processes'
    rewards (`batch`), or not (`none`); stds are unbiased, NaN rows are left out and get advantage 0."""
    grouped = rewards.view(-1, num_generations)  # (P, G)
    mean = grouped.nanmean(1, keepdim=True)
    count = (~grouped.isnan()).sum(1, keepdim=True)
    std = (((grouped - mean) ** 2).nansum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # (P, 1)
    zero_std = torch.isclose(std, torch.zeros_like(std)).expand_as(grouped).reshape(-1)
    advantages = (grouped - mean).reshape(-1)
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


def per_token_loss(new_logprobs, old_logprobs, ref_logprobs, advantages, mask, *, importance_sampling_level: str,
                   epsilon: float, epsilon_high: float, beta: float, is_weights=None):
    """The clipped surrogate (+ beta x k3 KL to the reference) per token. new/old/ref_logprobs, mask: (b, R);
    advantages (b,). Token level: ratio_t = exp(new_t - old_t); sequence level (GSPO): one ratio per sequence,
    exp(mean over its tokens of new - old). is_weights (b, R): the surrogate of each token times its weight (vLLM's
    truncated importance sampling; the KL term is not reweighted, as TRL). Returns (loss (b, R), stats)."""
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


def adaptive_kl_coef(kl_coef: float, current_kl: float, n_episodes: int, target: Optional[float], horizon: int):
    """The next KL coefficient: unchanged when `target` is None, else adapted as in Ziegler et al. 2019:
    kl_coef * (1 + clip(KL / target - 1, -0.2, 0.2) * n_episodes / horizon)."""
    if target is None:
        return kl_coef
    proportional_error = float(np.clip(current_kl / target - 1, -0.2, 0.2))
    return kl_coef * (1 + proportional_error * n_episodes / horizon)


# TRY NOT TO MODIFY: evaluation
@torch.no_grad()
def evaluate(args, accelerator, policy, reference, reward_sources, tokenizer, eval_prompts, eval_rows, gold, logger,
             step):
    """Greedy completions of the held-out prompts: reward, KL to the reference (when there is one), length, EOS rate,
    gold score if the task has one; with --num_eval_generations k and reward functions, k sampled completions per
    prompt: mean@k (the mean of their weighted function rewards) and pass@k (a prompt passes when one of its k
    completions scores >= 1 by every reward function that scores it: a verifier's "correct"). Every process runs an
    equal share (padded: only its first n_real rows count). Logs a few rows as eval/samples; returns means over all
    processes' prompts."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    greedy = pc.make_generation_config(tokenizer, args.response_length, greedy=True)
    sampled = pc.make_generation_config(tokenizer, args.response_length, args.temperature)
    k = args.num_eval_generations if reward_sources.functions else 0
    functions = reward_sources.functions
    verifiers = rs.Rewards(tokenizer, functions=functions, weights=reward_sources.weights[-len(functions):].tolist()
                           ) if k else None  # the reward functions without the reward model
    chunk = args.local_rollout_forward_batch_size
    share, n_real = ru.even_share(range(len(eval_prompts)), accelerator)  # indices of the prompts
    sums, samples, source_scores = dict(scores=0.0, response_length=0.0, eos_rate=0.0), [], []
    sums.update({"kl": 0.0} if reference is not None else {}, **({"gold_score": 0.0} if gold is not None else {}))
    sums.update({f"pass@{k}": 0.0, f"mean@{k}": 0.0} if k else {})
    policy.eval()
    for i in range(0, len(share), chunk):
        real = max(0, min(chunk, n_real - i))  # rows of this chunk that count; the rest only pad the share
        indices = share[i:i + chunk]
        queries = pc.pad_sequences([eval_prompts[j] for j in indices], pad, "left").to(accelerator.device)
        context_length = queries.shape[1]
        query_responses, _ = pc.batch_generation(policy, queries, pad, eos, greedy, chunk, accelerator)
        responses = query_responses[:, context_length:]  # (b, R)
        mask = responses != pad
        scores, per_source = reward_sources(query_responses, context_length, [eval_rows[j] for j in indices],
                                            accelerator)  # (b,), (b, sources)
        source_scores.append(per_source[:real])
        sums["scores"] += scores[:real].sum().item()
        if reference is not None:
            logprobs = pc.response_logprobs(policy, query_responses, context_length, pad, args.temperature)
            ref_logprobs = reference.logprobs(query_responses, context_length, pad, args.temperature)
            sums["kl"] += ((logprobs - ref_logprobs) * mask)[:real].sum().item()
        sums["response_length"] += mask[:real].sum().item()
        sums["eos_rate"] += (responses == eos).any(1)[:real].sum().item()
        for query, response, score in zip(queries[:real], responses[:real], scores[:real].tolist()):
            row = dict(prompt=tokenizer.decode(query, skip_special_tokens=True),
                       completion=tokenizer.decode(response, skip_special_tokens=True), score=round(score, 4))
            if gold is not None:
                row["gold"] = gold(row["prompt"], row["completion"])
                sums["gold_score"] += row["gold"]
            samples.append(row)
        if k:  # k sampled completions per prompt, scored by the reward functions only
            repeated = queries.repeat_interleave(k, 0)
            query_responses, _ = pc.batch_generation(policy, repeated, pad, eos, sampled, chunk, accelerator)
            rows = [eval_rows[j] for j in indices for _ in range(k)]
            function_reward, verdicts = verifiers(query_responses, context_length, rows, accelerator)  # (bk,), (bk,F)
            correct = ((verdicts >= 1.0) | verdicts.isnan()).all(1) & ~verdicts.isnan().all(1)  # (b * k,)
            sums[f"pass@{k}"] += correct.view(-1, k).any(1)[:real].sum().item()
            sums[f"mean@{k}"] += function_reward.view(-1, k).mean(1)[:real].sum().item()
    means = ru.global_means(accelerator, sums, n_real)
    logger.log_samples("eval/samples", samples, step, args.num_samples_printed)
    return {**{f"eval/{key}": means[key] for key in sums},
            **reward_sources.metrics(torch.cat(source_scores), accelerator, prefix="eval/reward/")}


def main():
    # 1. arguments: validate and derive every batch size once
    args = ru.parse_args(Args, ALIAS_DEFAULTS)
    if args.num_generations < 2:
        raise UserError(f"--num_generations must be >= 2 (a group needs others to compare with), got "
                           f"{args.num_generations}")
    args.epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if min(args.epsilon, args.epsilon_high, args.learning_rate, args.max_grad_norm, args.temperature) <= 0:
        raise UserError("--epsilon, --epsilon_high, --learning_rate, --max_grad_norm and --temperature must be > 0")
    if args.beta < 0 or (args.kl_target is not None and (args.kl_target <= 0 or args.beta == 0)):
        raise UserError("--beta must be >= 0, and --kl_target (> 0) adapts a --beta that starts above 0")
    vg.validate_args(args)
    if args.local_rollout_forward_batch_size is None:  # the micro-batch the user sized for training
        args.local_rollout_forward_batch_size = args.per_device_train_batch_size
    if min(args.num_iterations, args.per_device_train_batch_size, args.num_eval_prompts, args.kl_horizon,
           args.gradient_accumulation_steps, args.response_length, args.total_episodes,
           args.local_rollout_forward_batch_size, 1 if args.max_steps is None else args.max_steps) < 1 \
            or args.num_eval_generations < 0:
        raise UserError("batch sizes, --num_iterations, --num_eval_prompts, --response_length, --total_episodes, "
                           "--kl_horizon and --max_steps must be >= 1, --num_eval_generations >= 0")
    accelerator = ru.make_accelerator(args.gradient_accumulation_steps)
    # completions per process per step; the num_generations completions of a prompt stay on one process
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    local_prompts = pc.exact_div(local_batch_size, args.num_generations, "local_batch_size "
                                 "(per_device_train_batch_size * gradient_accumulation_steps) / num_generations")
    batch_size = local_batch_size * accelerator.num_processes
    num_total_batches = min(math.ceil(args.total_episodes / batch_size), args.max_steps or math.inf)
    num_optimizer_steps = num_total_batches * args.num_iterations
    chunk = args.local_rollout_forward_batch_size  # rows per generation / no-grad forward
    ru.seed_everything(args.seed, accelerator.process_index)

    # 2. tokenizer of the policy and its reference (a reward model may have its own: reward_sources.py)
    policy_path = ru.resolve_model(args.model)
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=args.trust_remote_code)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id

    # 3. data and lengths: prompts tokenised once; completions must fit in the model's positions after a prompt
    dataset_name = args.dataset or ru.default_dataset(args.model)
    train_data = du.load_prompt_dataset(dataset_name, "train")
    eval_data = du.load_prompt_dataset(dataset_name, args.eval_split)
    du.require_columns(train_data, ["prompt"], dataset_name)
    du.require_columns(eval_data, ["prompt"], dataset_name)
    train_prompts = du.tokenize_prompts(tokenizer, train_data["prompt"], args.max_prompt_length)
    eval_data = eval_data.select(range(min(args.num_eval_prompts, len(eval_data))))
    eval_prompts = du.tokenize_prompts(tokenizer, eval_data["prompt"], args.max_prompt_length)
    if args.max_prompt_length is None:
        args.max_prompt_length = max(len(p) for p in train_prompts + eval_prompts)
    positions = ru.model_positions(policy_path, args.trust_remote_code)
    ru.fit_length(args, "response_length", None if positions is None else positions - args.max_prompt_length,
                  f"the model's {positions} positions minus prompts of up to {args.max_prompt_length} tokens")
    share = args.share_prompts and ps.worth_sharing(  # one decision, from sizes the same on every process
        min(args.per_device_train_batch_size, chunk), args.num_generations, args.max_prompt_length,
        args.response_length)
    gold = du.gold_scorer(dataset_name)
    generation_config = pc.make_generation_config(tokenizer, args.response_length, args.temperature)
    output_dir = ru.output_dir(args, dataset_name, accelerator)

    # 4. models: policy (+LoRA), frozen reference (only when beta > 0); reward sources (reward_sources.py)
    policy = models.load_policy(policy_path, tokenizer, args)
    reference = None if args.beta == 0 else pc.create_reference(
        policy, tokenizer, policy_name=policy_path, use_peft=args.use_peft, accelerator=accelerator, bf16=args.bf16,
        ref_model=ru.resolve_model(args.ref_model) if args.ref_model else None,
        trust_remote_code=args.trust_remote_code)
    reward_sources = rs.load_rewards(args, tokenizer, args.model, dataset_name, [train_data, eval_data], accelerator)
    eval_rows = eval_data.to_list()

    # 5. optimizer, linear decay per optimizer step, checkpointable state
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate,
                                  eps=1e-5, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1.0 - s / num_optimizer_steps))
    policy, optimizer = accelerator.prepare(policy, optimizer)
    # the scheduler is not prepared (accelerate would step it once per process); checkpoints carry it as JSON
    state = dict(step=0, episode=0, prompts_seen=0, skipped=0, beta=args.beta)
    if args.resume_from:
        state.update(tl.load_checkpoint(accelerator, args.resume_from, scheduler))
    logger = ml.MetricsLogger(output_dir, args, accelerator.is_main_process, args.track, args.wandb_project,
                              os.path.basename(output_dir), resume_step=state["step"] if args.resume_from else None)
    logger.progress(num_total_batches, state["step"], batch_size, "episodes",
                    ("objective/scores", "objective/kl", "eval/gold_score"))
    stop = tl.StopSignal()
    generator = vg.from_args(args, policy, tokenizer, accelerator, weights_version=state["step"],  # None: no vLLM
                             max_model_len=args.max_prompt_length + args.response_length,
                             rows_per_call=local_batch_size)
    if state["step"] == 0:
        logger.log(evaluate(args, accelerator, policy, reference, reward_sources, tokenizer, eval_prompts, eval_rows,
                            gold, logger, 0), step=0)

    start_time, start_episode = time.time(), state["episode"]
    while state["step"] < num_total_batches:
        step, beta = state["step"] + 1, state["beta"]
        # 6. generate: this process's local_prompts prompts of the stream, each repeated num_generations times
        indices = du.data_positions(len(train_prompts), args.seed,
                                    state["prompts_seen"] + accelerator.process_index * local_prompts, local_prompts)
        queries = pc.pad_sequences([train_prompts[i] for i in indices], pad, "left").to(accelerator.device)
        queries = queries.repeat_interleave(args.num_generations, dim=0)  # (local_batch_size, Lq)
        context_length = queries.shape[1]
        policy.eval()
        if generator is None:
            # the sampled tokens' log-probs: the old log-probs when the batch is reused (num_iterations > 1; the
            # losses score the distribution sampling draws from, policy_common.mask_pad_), so no policy forward
            query_responses, sampled_logprobs = pc.batch_generation(policy, queries, pad, eos, generation_config,
                                                                    chunk, accelerator, share_prompts=share)
        else:  # vLLM (synced to this step's weights first); reused batches need the trainer's own old log-probs
            query_responses, sampler_logprobs = generator.generate(policy, state["step"], queries, generation_config)
            sampled_logprobs = None if args.num_iterations == 1 else pc.response_logprobs_no_grad(
                policy, query_responses, context_length, pad, args.temperature, chunk, share_prompts=share)
        responses = query_responses[:, context_length:]  # (B, R): truncated after the first EOS, then pad
        response_mask = responses != pad  # (B, R)
        truncated = ~(responses == eos).any(1)  # (B,) cut at response_length

        # 7. score; reference log-probs when beta > 0
        with torch.no_grad():
            rows = [train_data[i] for i in indices for _ in range(args.num_generations)]  # the row of each completion
            with tl.checkpoint_on_error(rs.RewardFunctionError, accelerator, output_dir, dict(state), scheduler):
                scores, source_scores = reward_sources(query_responses, context_length, rows, accelerator, chunk,
                                                       share_prompts=share)  # (B,), (B, sources)
            if args.missing_eos_penalty is not None:
                scores = torch.where(truncated, scores - args.missing_eos_penalty, scores)
            scores = scores.masked_fill(source_scores.isnan().all(1), math.nan)  # scored by no source: left out
            # at num_iterations 1 the old log-probs are the new ones detached (a ratio of exactly 1, as TRL)
            old_logprobs = sampled_logprobs if args.num_iterations > 1 else None
            ref_logprobs = torch.zeros_like(responses, dtype=torch.float32)
            if reference is not None:
                ref_logprobs = reference.logprobs(query_responses, context_length, pad, args.temperature, chunk,
                                                  share_prompts=share)

            # 8. group-relative advantages; the loss mask and its token count over all processes (for dapo)
            advantages, zero_std = group_advantages(scores, args.num_generations, args.scale_rewards, accelerator)
            loss_mask = response_mask.clone()
            if args.mask_truncated_completions:
                loss_mask &= ~truncated[:, None]
            if args.skip_zero_std_groups:
                loss_mask &= ~zero_std[:, None]
            global_tokens = ru.global_sum(accelerator, loss_mask.sum().item())
            tokens_per_micro_batch = global_tokens / (accelerator.num_processes * args.gradient_accumulation_steps)

        # 9. policy update: num_iterations optimizer steps on this batch, micro-batches accumulated
        policy.train()
        losses, stats, entropy, kl, skipped = [], {}, [], [], 0
        for iteration in range(args.num_iterations):
            # shuffled prompt by prompt, so a micro-batch holds whole groups and encodes each prompt once
            order = (torch.randperm(local_prompts, device=accelerator.device)[:, None] * args.num_generations +
                     torch.arange(args.num_generations, device=accelerator.device)).flatten()
            for mb in order.view(args.gradient_accumulation_steps, -1):  # micro-batches of per_device rows
                with accelerator.accumulate(policy):
                    logits = pc.forward_logits(policy, query_responses[mb], context_length, pad, args.temperature,
                                               share_prompts=share)
                    new_logprobs = pc.selective_logprobs(logits, responses[mb])
                    old = new_logprobs.detach() if old_logprobs is None else old_logprobs[mb]
                    is_weights = None
                    if generator is not None:  # sampled by vLLM: weight each token by min(pi_old / pi_vllm, cap)
                        is_weights, is_stats = vg.truncated_importance_weights(
                            old, sampler_logprobs[mb], response_mask[mb], args.vllm_is_cap, per_sequence=False)
                    token_loss, mb_stats = per_token_loss(
                        new_logprobs, old, ref_logprobs[mb], advantages[mb], loss_mask[mb],
                        importance_sampling_level=args.importance_sampling_level, epsilon=args.epsilon,
                        epsilon_high=args.epsilon_high, beta=beta, is_weights=is_weights)
                    if generator is not None and iteration == 0:  # the sampler mismatch, once per rollout
                        mb_stats.update(is_stats)
                    loss = aggregate_loss(token_loss, loss_mask[mb], args.loss_type, args.response_length,
                                          tokens_per_micro_batch)
                    accelerator.backward(loss)
                    losses.append(loss.detach())
                    for key, value in mb_stats.items():
                        stats.setdefault(key, []).append(value)
                    if iteration == 0:  # the sampling policy's entropy and KL to the reference, per sequence
                        with torch.no_grad():
                            entropy.append((pc.entropy_from_logits(logits) * response_mask[mb]).sum(1))
                            kl.append(((old - ref_logprobs[mb]) * response_mask[mb]).sum(1))
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                        if ru.all_finite(accelerator, loss, grad_norm):
                            optimizer.step()
                        elif args.skip_nonfinite:
                            skipped += 1
                        else:
                            optimizer.zero_grad()
                            tl.stop_on_nonfinite(accelerator, output_dir, step, dict(state), scheduler,
                                                 loss=loss, grad_norm=grad_norm)
                        lr = scheduler.get_last_lr()[0]  # the rate this optimizer step used
                        scheduler.step()
                        optimizer.zero_grad()
        state.update(step=step, episode=state["episode"] + batch_size, skipped=state["skipped"] + skipped,
                     prompts_seen=state["prompts_seen"] + local_prompts * accelerator.num_processes)

        # 10. log, adapt beta (--kl_target), evaluate every eval_steps steps and after the last
        scored = ~scores.isnan()
        metrics = ru.reduce_metrics(accelerator, {
            "objective/scores": scores[scored].mean() if scored.any() else torch.tensor(0.0),
            "objective/entropy": torch.cat(entropy).mean(), "objective/frac_reward_zero_std": zero_std.float().mean(),
            "objective/advantage_std": advantages.std(), "loss/policy": torch.stack(losses).mean(),
            **{key: torch.stack(values).mean() for key, values in stats.items()},
            "val/num_eos_tokens": (responses == eos).sum().float(), "val/truncated_fraction": truncated.float().mean(),
            "val/response_length": response_mask.sum(1).float().mean(), "nonfinite/skipped": float(state["skipped"]),
            **({"objective/kl": torch.cat(kl).mean()} if reference is not None else {}),
        })
        metrics.update(reward_sources.metrics(source_scores, accelerator))
        if generator is not None:
            metrics["time/vllm_sync"] = generator.last_sync_seconds
        if reference is not None:
            metrics["objective/beta"] = beta
            state["beta"] = adaptive_kl_coef(beta, metrics["objective/kl"], batch_size, args.kl_target,
                                             args.kl_horizon)
        metrics.update({"lr": lr, "episode": state["episode"],
                        "time/episodes_per_second": (state["episode"] - start_episode) / (time.time() - start_time)})
        if (args.eval_steps and step % args.eval_steps == 0) or step == num_total_batches:
            metrics.update(evaluate(args, accelerator, policy, reference, reward_sources, tokenizer, eval_prompts,
                                    eval_rows, gold, logger, step))
        logger.log(metrics, step=step)

        # 11. checkpoints: periodic, and on SIGTERM / Ctrl-C on any process (then all exit cleanly)
        stopping = stop.agreed(accelerator) and step < num_total_batches
        if (args.save_steps and step % args.save_steps == 0) or stopping:
            tl.save_checkpoint(accelerator, os.path.join(output_dir, f"checkpoint-{step}"), dict(state), scheduler)
        if stopping:
            accelerator.print(f"stop signal received: checkpoint-{step} written, stopping")
            logger.close()
            return

    # 12. final save
    if generator is not None:
        generator.close()
    tl.save_model(accelerator, policy, tokenizer, os.path.join(output_dir, "model"), merge_peft=args.merge_peft)
    logger.close(os.path.join(output_dir, "model"))


if __name__ == "__main__":
    ru.main_guard(main)
