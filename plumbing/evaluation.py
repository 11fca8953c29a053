"""Evaluation of the RL scripts' policy on held-out prompts (rloo.py, grpo.py, ppo.py, distill.py): greedy completions
(or, with tools, greedy episodes) scored by the run's reward sources, with the KL to the reference, the EOS rate, the
task's gold score where it has one, and pass@k of sampled completions by the reward functions. The offline scripts'
greedy completions are greedy_eval.py's."""

from __future__ import annotations

import torch

import policy_common as pc
from plumbing import data_utils as du
from plumbing import episodes as ep
from plumbing import reward_sources as rs
from plumbing import run_utils as ru


@torch.no_grad()
def evaluate_policy(sampler, held_out: du.HeldOut, logger, step: int, *, pass_at_k: int = 0) -> dict:
    """The RL scripts' evaluation of `sampler`'s policy (rollout.Sampler): greedy completions of the held-out prompts:
    eval/scores (the weighted reward), eval/kl (sequence KL to the reference at the training temperature, like
    objective/kl; when there is a reference), eval/response_length,
    eval/eos_rate, eval/gold_score (when the task has a gold scorer; with images also eval/gold_score_blind, of the
    greedy answers to blank images: a policy that reads the images sits at chance there), eval/reward/<source>/*; with
    `pass_at_k` = k > 0 and reward functions, k sampled completions per prompt: eval/mean@k (the mean of their
    weighted function rewards) and eval/pass@k (a prompt passes when one of its k completions scores >= 1 by every
    reward function that scores it, overlong shaping aside: a verifier's "correct", `Rewards.correct`). Every
    process runs an equal share (padded: only its first n_real rows count), so all make the same model calls. Logs a
    few rows as eval/samples; returns means over all processes' prompts. Sampling stays on HF generate with
    --use_vllm: greedy decoding is the ground truth it is compared with."""
    args, accelerator, tokenizer = sampler.args, sampler.accelerator, sampler.tokenizer
    pad, chunk = sampler.pad, sampler.chunk
    greedy = pc.make_generation_config(tokenizer, args.response_length, greedy=True,
                                       cache_implementation=args.cache_implementation,
                                       suppress=sampler.forward.masked_token_ids)
    functions = sampler.reward_sources.functions
    k = pass_at_k if functions else 0
    verifiers = rs.Rewards(tokenizer, functions=functions, weights=sampler.reward_sources.weights[-len(functions):]
                           .tolist()) if k else None  # the reward functions without the reward model
    indices, n_real = ru.even_share(range(len(held_out.prompts)), accelerator)  # this process's prompts
    sums, samples, source_scores, tool_sums = dict(scores=0.0, response_length=0.0, eos_rate=0.0), [], [], []
    blind = held_out.gold is not None and sampler.vision is not None  # the gold of greedy answers to blank images
    sums.update({**({"kl": 0.0} if sampler.reference is not None else {}),
                 **({"gold_score": 0.0} if held_out.gold is not None else {}),
                 **({"gold_score_blind": 0.0} if blind else {}),
                 **({f"pass@{k}": 0.0, f"mean@{k}": 0.0} if k else {})})
    # one completion per prompt: the forwards without prompt sharing
    forward, reference = sampler.forward.unshared(), sampler.reference and sampler.reference.unshared()
    training = sampler.policy.training
    sampler.policy.eval()
    for i in range(0, len(indices), chunk):
        real = max(0, min(chunk, n_real - i))  # rows of this chunk that count; the rest only pad the share
        chunk_indices = indices[i:i + chunk]
        queries = pc.pad_sequences([held_out.prompts[j] for j in chunk_indices], pad, "left").to(accelerator.device)
        rows = [held_out.rows[j] for j in chunk_indices]
        images = sampler.vision and sampler.vision.rows_inputs(rows)  # (b,) the rows' image inputs (None: text)
        query_responses, context_length, mask, truncated, episodes = sampler.complete(queries, rows, greedy, images)
        queries, responses = query_responses[:, :context_length], query_responses[:, context_length:]  # (b, R)
        scores, per_source = sampler.reward_sources(query_responses, context_length, rows, accelerator,
                                                 episodes=episodes, step=step)
        extra_columns = sampler.reward_sources.take_extra_columns()  # reward functions' log_extra
        if episodes is not None:
            tool_sums.append(episodes[:real])  # only the real rows count
        source_scores.append(per_source[:real])
        sums["scores"] += scores[:real].sum().item()
        if reference is not None:
            logprobs = forward.logprobs(sampler.policy, query_responses, context_length, images=images)
            ref_logprobs = reference.logprobs(query_responses, context_length, images=images)
            sums["kl"] += ((logprobs - ref_logprobs) * mask)[:real].sum().item()
        sums["response_length"] += mask[:real].sum().item()
        sums["eos_rate"] += (~truncated)[:real].sum().item()
        for j, (query, response, score) in enumerate(zip(queries[:real], responses[:real], scores[:real].tolist())):
            row = dict(prompt=tokenizer.decode(query, skip_special_tokens=True),
                       completion=tokenizer.decode(response, skip_special_tokens=True), score=score)
            if held_out.gold is not None:
                row["gold"] = held_out.gold(row["prompt"], row["completion"], rows[j])
                sums["gold_score"] += row["gold"]
            samples.append({**row, **{column: values[j] for column, values in extra_columns.items()}})
        if blind:  # the same prompts with blank images: a policy that reads the image scores at chance here
            blank = sampler.complete(queries, rows, greedy, sampler.vision.rows_inputs(rows, blank=True))[0]
            sums["gold_score_blind"] += sum(held_out.gold(tokenizer.decode(q, skip_special_tokens=True),
                                                          tokenizer.decode(r, skip_special_tokens=True), row)
                                            for q, r, row in zip(queries[:real], blank[:real, context_length:], rows))
        if k:  # k sampled completions per prompt, scored by the reward functions only
            rows, images = [row for row in rows for _ in range(k)], images and [i for i in images for _ in range(k)]
            query_responses, context_length, _, _, episodes = sampler.complete(queries.repeat_interleave(k, 0), rows,
                                                                            sampler.generation_config, images)
            function_reward, verdicts = verifiers(query_responses, context_length, rows, accelerator,
                                                  episodes=episodes)
            correct = verifiers.correct(verdicts)  # (b * k,): overlong shaping is no verdict
            sums[f"pass@{k}"] += correct.view(-1, k).any(1)[:real].sum().item()
            sums[f"mean@{k}"] += function_reward.view(-1, k).mean(1)[:real].sum().item()
    sampler.policy.train(training)
    means = ru.global_means(accelerator, sums, n_real)
    means = {key: means[key] for key in sums}
    if sampler.toolset is not None:  # tools/call_frequency, ... of the greedy episodes
        means.update(ep.episode_metrics([e for chunk_episodes in tool_sums for e in chunk_episodes], accelerator))
    logger.log_samples("eval/samples", samples, step, args.num_samples_printed)
    return {**{f"eval/{key}": value for key, value in means.items()},
            **sampler.reward_sources.metrics(torch.cat(source_scores), accelerator, prefix="eval/reward/")}
