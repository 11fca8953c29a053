"""Rollouts for the RL scripts: prompts in, a scored batch out.

rloo.py, grpo.py and ppo.py get every step's data from one call, `Sampler.rollout`: this process's next prompts of
the data stream, `samples_per_prompt` completions of each, sampled by HF `generate` (policy_common.batch_generation)
or by a vLLM engine (vllm_generation.py, --use_vllm) and truncated after their first EOS; the old log-probs; the
reference model's log-probs; each reward source's score and their weighted sum, minus the missing-EOS penalty. It
returns a `Rollout` of tensors; the script computes its advantages and loss from them. The RL scripts' evaluation
(`Sampler.evaluate`: greedy completions of held-out prompts) goes through the same sampler, and the offline scripts'
greedy completions through `held_out_completions`.

The sampler owns the choices that change speed, never the numbers an algorithm computes:
- prompt sharing (prompt_sharing.py): a prompt repeated over rows is encoded once in generation, scoring and the
  training forward (`Sampler.logprobs`); decided once, from flags that are the same on every process;
- chunk sizes: --local_rollout_forward_batch_size rows per generation and per no-grad forward;
- HF generate or vLLM, and the engine's weight sync (before a generation that follows an optimizer step);
- the order of rows in the update (`Rollout.shuffled_rows`): a prompt's samples stay together.

The old log-probs, stated once. With HF generate the log-probs of the sampled tokens, read from the scores that
generation sampled from, are the old log-probs (those of the policy before this step's update), and no forward
recomputes them. That holds while four things agree: sampling never emits pad (`make_generation_config` suppresses
it), generation applies the temperature and nothing else (top_k 0, top_p 1, the model's own sampling defaults
ignored: `batch_generation`), and every forward scores that same distribution (logits / temperature with pad masked:
`forward_logits`, `mask_pad_`). A top-p, a top-k, a repetition penalty or a logits processor added to generation
would break it without an error, so it is measured: at the first rollout and every LOGPROB_CHECK_EVERY-th (by step,
so a resumed run checks the same steps), the first LOGPROB_CHECK_ROWS rows are scored again by a forward, and the
largest |sampled - recomputed| over their tokens, on all processes, is logged as `rollout/logprob_check`. Above the
tolerance (float32: 1e-3 on any token; bf16/fp16, whose kernels round differently in generation and in a forward:
0.05 on average over the tokens) the run stops with a RolloutError, its finished steps checkpointed.
With vLLM the engine's log-probs are not the trainer's (other kernels, a KV cache, bf16): the old log-probs come from
a trainer forward, and `Rollout.importance_weights` reweights the policy loss by truncated importance weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn as nn

import data_utils as du
import policy_common as pc
import prompt_sharing as ps
import reward_sources as rs
import run_utils as ru
import vllm_generation as vg
from errors import RolloutError

LOGPROB_CHECK_EVERY = 10  # steps between checks of the old-log-probs invariant (the first rollout is checked)
LOGPROB_CHECK_ROWS = 4  # rows scored again by a forward at each check
LOGPROB_CHECK_MAX = 1e-3  # float32: largest |sampled - recomputed| log-prob of any checked token
LOGPROB_CHECK_MEAN_LOW_PRECISION = 0.05  # bf16 / fp16: mean |sampled - recomputed| over the checked tokens


@dataclass
class PromptData:
    """An RL run's prompts: `name` (the dataset as named: alias, folder or hub id), `train` (its training split, whose
    rows reward functions read), `train_prompts` (their token ids), `eval_data` (the held-out split, its first
    --num_eval_prompts rows) and `held_out` (those rows as dicts, their token ids and the task's gold scorer)."""
    name: str
    train: object
    train_prompts: List[List[int]]
    eval_data: object
    held_out: du.HeldOut


def load_prompt_data(args, tokenizer, policy_path: str) -> PromptData:
    """--dataset's (None: the one paired with --model) training split and --eval_split (its first --num_eval_prompts
    rows), column `prompt` required, tokenised once (with the chat template when conversational). A prompt longer
    than --max_prompt_length is refused; None becomes the longest prompt in the data. --response_length is then fitted
    into the model's positions after the longest prompt (a default lowered with a note; a value given that cannot fit,
    a one-line error)."""
    name = args.dataset or ru.default_dataset(args.model)
    train_data = du.load_prompt_dataset(name, "train")
    eval_data = du.load_prompt_dataset(name, args.eval_split)
    du.require_columns(train_data, ["prompt"], name)
    du.require_columns(eval_data, ["prompt"], name)
    train_prompts = du.tokenize_prompts(tokenizer, train_data["prompt"], args.max_prompt_length)
    eval_data = eval_data.select(range(min(args.num_eval_prompts, len(eval_data))))
    eval_prompts = du.tokenize_prompts(tokenizer, eval_data["prompt"], args.max_prompt_length)
    if args.max_prompt_length is None:
        args.max_prompt_length = max(len(p) for p in train_prompts + eval_prompts)
    positions = ru.model_positions(policy_path, args.trust_remote_code)
    ru.fit_length(args, "response_length", None if positions is None else positions - args.max_prompt_length,
                  f"the model's {positions} positions minus prompts of up to {args.max_prompt_length} tokens")
    return PromptData(name, train_data, train_prompts, eval_data,
                      du.HeldOut(eval_data.to_list(), eval_prompts, tokenizer, du.gold_scorer(name)))


@dataclass
class Rollout:
    """One step's rollout on this process: B = prompts x samples_per_prompt rows, prompt by prompt (rows
    [i * k, (i + 1) * k) are the k samples of prompt i). Response positions after the first EOS hold pad."""
    query_responses: torch.Tensor  # (B, Lq + R): [left-padded prompt | response, right-padded with pad]
    context_length: int  # Lq
    samples_per_prompt: int  # k
    rows: List[dict]  # (B,) the dataset row of each completion (what reward functions read)
    scores: torch.Tensor  # (B,) the weighted reward, minus --missing_eos_penalty where a completion has no EOS
    source_scores: torch.Tensor  # (B, S) each reward source's own score, NaN where a function returned None
    logprobs: Optional[torch.Tensor]  # (B, R) old log-probs: the policy's before this step's update; INVALID after EOS
    ref_logprobs: Optional[torch.Tensor]  # (B, R) the reference's; meaningless after EOS (mask with response_mask)
    entropy: Optional[torch.Tensor]  # (B, R) entropy of the sampling distribution at each response position
    sampler_logprobs: Optional[torch.Tensor]  # (B, R) vLLM's log-probs of its samples (None: HF generate sampled)
    is_cap: float  # C of the truncated importance weights min(pi_trainer / pi_vllm, C) (--vllm_is_cap)
    metrics: dict  # rollout/logprob_check (at the steps checked), time/vllm_sync (vLLM)
    pad_token_id: int
    eos_token_id: int

    @property
    def responses(self) -> torch.Tensor:
        """(B, R) the response tokens."""
        return self.query_responses[:, self.context_length:]

    @property
    def response_mask(self) -> torch.Tensor:
        """(B, R) bool: True up to and including the EOS."""
        return self.responses != self.pad_token_id

    @property
    def truncated(self) -> torch.Tensor:
        """(B,) bool: the completion has no EOS (it was cut at --response_length)."""
        return ~(self.responses == self.eos_token_id).any(1)

    def shuffled_rows(self) -> torch.Tensor:
        """(B,) a random order of the rows that keeps each prompt's samples together, so that a micro-batch of a
        multiple of k rows holds whole groups and encodes each of its prompts once (one torch.randperm draw)."""
        k, device = self.samples_per_prompt, self.query_responses.device
        prompts = len(self.query_responses) // k
        return (torch.randperm(prompts, device=device)[:, None] * k + torch.arange(k, device=device)).flatten()

    def importance_weights(self, trainer_logprobs: torch.Tensor, rows=slice(None), per_sequence: bool = False):
        """Truncated importance sampling for rows `rows` sampled by vLLM (Yao et al. 2025; vllm_generation.py):
        (weights, stats) with weights min(pi_trainer / pi_vllm, cap), detached, per token (b, R) or per completion
        (b,) with `per_sequence`; (None, {}) when the trainer's own policy sampled them (HF generate)."""
        if self.sampler_logprobs is None:
            return None, {}
        return vg.truncated_importance_weights(trainer_logprobs, self.sampler_logprobs[rows], self.response_mask[rows],
                                               self.is_cap, per_sequence=per_sequence)


class Sampler:
    """Sampling and scoring for one RL run (see the module docstring).

    policy: the causal LM that samples and is trained (rloo, grpo: the prepared policy; ppo: the policy inside its
    policy-and-value model). reference: a policy_common.Reference, or None (no reference log-probs). prompts: the
    training prompts' token ids; rows: their dataset rows (a datasets.Dataset or list). Each process takes
    `prompts_per_process` prompts of the data stream per rollout and samples each `samples_per_prompt` times.
    max_prompt_length: the longest prompt it may see (sizes the vLLM engine, and the prompt-sharing decision).
    weights_version: optimizer steps behind the policy's weights now (0; a resumed run's step): vLLM syncs when the
    version given to `rollout` moves. Reads the shared flags --response_length, --temperature,
    --missing_eos_penalty, --local_rollout_forward_batch_size, --share_prompts, --seed and --use_vllm/--vllm_*."""

    def __init__(self, args, accelerator, tokenizer, policy: nn.Module, reward_sources: rs.Rewards, reference, *,
                 prompts: Sequence[List[int]], rows, samples_per_prompt: int, prompts_per_process: int,
                 max_prompt_length: int, weights_version: int = 0):
        self.args, self.accelerator, self.tokenizer = args, accelerator, tokenizer
        self.policy, self.reward_sources, self.reference = policy, reward_sources, reference
        self.prompts, self.rows = prompts, rows
        self.samples_per_prompt, self.prompts_per_process = samples_per_prompt, prompts_per_process
        self.pad, self.eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.chunk = args.local_rollout_forward_batch_size  # rows per generation / no-grad forward
        self.share = getattr(args, "share_prompts", False) and ps.worth_sharing(  # the same on every process
            min(args.per_device_train_batch_size, self.chunk), samples_per_prompt, max_prompt_length,
            args.response_length)
        self.generation_config = pc.make_generation_config(tokenizer, args.response_length, args.temperature)
        self.vllm = vg.from_args(args, policy, tokenizer, accelerator, weights_version=weights_version,  # None: HF
                                 max_model_len=max_prompt_length + args.response_length,
                                 rows_per_call=prompts_per_process * samples_per_prompt)

    @torch.no_grad()
    def rollout(self, prompts_seen: int, weights_version: int, *, old_logprobs: bool = True,
                entropy: bool = False) -> Rollout:
        """This process's next prompts (positions prompts_seen + process index x prompts_per_process onward of the
        data stream, the same order on any number of processes), sampled, scored and with their reference
        log-probs. weights_version: the optimizer steps taken so far (vLLM syncs when it moved). old_logprobs=False:
        the caller takes them from its own training forward (GRPO at one iteration): Rollout.logprobs is None.
        entropy: also the sampling distribution's entropy at each response position."""
        args, accelerator, k = self.args, self.accelerator, self.samples_per_prompt
        indices = du.data_positions(len(self.prompts), args.seed,
                                    prompts_seen + accelerator.process_index * self.prompts_per_process,
                                    self.prompts_per_process)
        queries = pc.pad_sequences([self.prompts[i] for i in indices], self.pad, "left").to(accelerator.device)
        queries = queries.repeat_interleave(k, dim=0)  # (B, Lq): each prompt k times in a row
        context_length = queries.shape[1]

        # 1. sample (HF generate: the sampled tokens' log-probs are the old log-probs; vLLM: a trainer forward)
        training, metrics = self.policy.training, {}
        self.policy.eval()
        sampler_logprobs, entropies = None, None
        if self.vllm is None:
            query_responses, logprobs, *entropies = pc.batch_generation(
                self.policy, queries, self.pad, self.eos, self.generation_config, self.chunk, accelerator,
                share_prompts=self.share, return_entropy=entropy)
            entropies = entropies[0] if entropy else None
            if weights_version % LOGPROB_CHECK_EVERY == 0:
                metrics["rollout/logprob_check"] = self.check_logprobs(query_responses, context_length, logprobs,
                                                                       weights_version + 1)
        else:
            query_responses, sampler_logprobs = self.vllm.generate(self.policy, weights_version, queries,
                                                                   self.generation_config)
            metrics["time/vllm_sync"] = self.vllm.last_sync_seconds
            logprobs = None
            if old_logprobs or entropy:
                logprobs = pc.response_logprobs_no_grad(self.policy, query_responses, context_length, self.pad,
                                                        args.temperature, self.chunk, share_prompts=self.share,
                                                        return_entropy=entropy)
                logprobs, entropies = logprobs if entropy else (logprobs, None)
        self.policy.train(training)
        response_mask = query_responses[:, context_length:] != self.pad  # (B, R)
        if logprobs is not None:
            logprobs = logprobs.masked_fill(~response_mask, pc.INVALID_LOGPROB)

        # 2. score: each reward source, weighted; the missing-EOS penalty ("EOS trick")
        rows = [self.rows[i] for i in indices for _ in range(k)]  # the dataset row of each completion
        scores, source_scores = self.reward_sources(query_responses, context_length, rows, accelerator, self.chunk,
                                                    share_prompts=self.share)  # (B,), (B, sources)
        scores = rs.penalise_missing_eos(scores, query_responses[:, context_length:], self.eos,
                                         args.missing_eos_penalty)

        # 3. the reference's log-probs
        ref_logprobs = None
        if self.reference is not None:
            ref_logprobs = self.reference.logprobs(query_responses, context_length, self.pad, args.temperature,
                                                   self.chunk, share_prompts=self.share)
        return Rollout(query_responses=query_responses, context_length=context_length, samples_per_prompt=k, rows=rows,
                       scores=scores, source_scores=source_scores, logprobs=logprobs if old_logprobs else None,
                       ref_logprobs=ref_logprobs, entropy=entropies, sampler_logprobs=sampler_logprobs,
                       is_cap=getattr(args, "vllm_is_cap", 2.0), metrics=metrics, pad_token_id=self.pad,
                       eos_token_id=self.eos)

    def check_logprobs(self, query_responses: torch.Tensor, context_length: int, sampled_logprobs: torch.Tensor,
                       step: int) -> float:
        """The old-log-probs invariant (module docstring): the first LOGPROB_CHECK_ROWS rows scored again by a
        forward; returns the largest |sampled - recomputed| over their tokens on all processes (one all-reduce);
        raises RolloutError on every process when it is above the tolerance."""
        rows = query_responses[:LOGPROB_CHECK_ROWS]
        recomputed = pc.response_logprobs_no_grad(self.policy, rows, context_length, self.pad, self.args.temperature,
                                                  share_prompts=self.share)
        mask = rows[:, context_length:] != self.pad
        diff = (recomputed - sampled_logprobs[:LOGPROB_CHECK_ROWS]).abs()[mask]
        stats = torch.stack([diff.max(), diff.mean()]) if diff.numel() else diff.new_zeros(2)
        if self.accelerator.num_processes > 1:
            stats = self.accelerator.reduce(stats, reduction="max")
        largest, mean = stats.tolist()
        low_precision = next(self.policy.parameters()).dtype in (torch.bfloat16, torch.float16)
        if not math.isfinite(largest) or (mean > LOGPROB_CHECK_MEAN_LOW_PRECISION if low_precision
                                          else largest > LOGPROB_CHECK_MAX):
            raise RolloutError(
                f"at step {step} the sampler's log-probs are not the trainer's (max |sampled - recomputed| "
                f"{largest:.3g}, mean {mean:.3g} per token): generation no longer samples the distribution every "
                "forward scores (a top-p, top-k, repetition penalty or logits processor in the generation config?); the "
                "losses would use wrong old log-probs (rollout.py's docstring)")
        return largest

    def logprobs(self, model: nn.Module, batch: Rollout, rows, *, entropy: bool = False):
        """The training forward: ((b, R) log-probs of rows `rows` of `batch`'s responses under `model`, with gradient
        unless called under no_grad; (b, R) entropy at each response position with `entropy`, else None), scored as
        the rollout scored them (logits / temperature, pad masked, with the prompt sharing decided for it)."""
        logits = pc.forward_logits(model, batch.query_responses[rows], batch.context_length, self.pad,
                                   self.args.temperature, share_prompts=self.share)
        logprobs = pc.selective_logprobs(logits, batch.responses[rows])
        if not entropy:
            return logprobs, None
        with torch.no_grad():
            return logprobs, pc.entropy_from_logits(logits)

    @torch.no_grad()
    def evaluate(self, held_out: du.HeldOut, logger, step: int, *, pass_at_k: int = 0) -> dict:
        """Greedy completions of the held-out prompts: eval/scores (the weighted reward), eval/kl (sequence KL to the
        reference at the training temperature, like objective/kl; when there is a reference), eval/response_length,
        eval/eos_rate, eval/gold_score (when the task has a gold scorer) and eval/reward/<source>/*; with
        `pass_at_k` = k > 0 and reward functions, k sampled completions per prompt: eval/mean@k (the mean of their
        weighted function rewards) and eval/pass@k (a prompt passes when one of its k completions scores >= 1 by every
        reward function that scores it: a verifier's "correct"). Every process runs an equal share (padded: only its
        first n_real rows count), so all make the same model calls. Logs a few rows as eval/samples; returns means
        over all processes' prompts. Sampling stays on HF generate with --use_vllm: greedy decoding is the ground
        truth it is compared with."""
        args, accelerator, tokenizer = self.args, self.accelerator, self.tokenizer
        pad, eos, chunk = self.pad, self.eos, self.chunk
        greedy = pc.make_generation_config(tokenizer, args.response_length, greedy=True)
        functions = self.reward_sources.functions
        k = pass_at_k if functions else 0
        verifiers = rs.Rewards(tokenizer, functions=functions, weights=self.reward_sources.weights[-len(functions):]
                               .tolist()) if k else None  # the reward functions without the reward model
        indices, n_real = ru.even_share(range(len(held_out.prompts)), accelerator)  # this process's prompts
        sums, samples, source_scores = dict(scores=0.0, response_length=0.0, eos_rate=0.0), [], []
        sums.update({"kl": 0.0} if self.reference is not None else {})
        sums.update({"gold_score": 0.0} if held_out.gold is not None else {})
        sums.update({f"pass@{k}": 0.0, f"mean@{k}": 0.0} if k else {})
        training = self.policy.training
        self.policy.eval()
        for i in range(0, len(indices), chunk):
            real = max(0, min(chunk, n_real - i))  # rows of this chunk that count; the rest only pad the share
            chunk_indices = indices[i:i + chunk]
            queries = pc.pad_sequences([held_out.prompts[j] for j in chunk_indices], pad, "left").to(accelerator.device)
            context_length = queries.shape[1]
            query_responses, _ = pc.batch_generation(self.policy, queries, pad, eos, greedy, chunk, accelerator)
            responses = query_responses[:, context_length:]  # (b, R)
            mask = responses != pad
            scores, per_source = self.reward_sources(query_responses, context_length,
                                                     [held_out.rows[j] for j in chunk_indices], accelerator)
            source_scores.append(per_source[:real])
            sums["scores"] += scores[:real].sum().item()
            if self.reference is not None:
                logprobs = pc.response_logprobs(self.policy, query_responses, context_length, pad, args.temperature)
                ref_logprobs = self.reference.logprobs(query_responses, context_length, pad, args.temperature)
                sums["kl"] += ((logprobs - ref_logprobs) * mask)[:real].sum().item()
            sums["response_length"] += mask[:real].sum().item()
            sums["eos_rate"] += (responses == eos).any(1)[:real].sum().item()
            for query, response, score in zip(queries[:real], responses[:real], scores[:real].tolist()):
                row = dict(prompt=tokenizer.decode(query, skip_special_tokens=True),
                           completion=tokenizer.decode(response, skip_special_tokens=True), score=score)
                if held_out.gold is not None:
                    row["gold"] = held_out.gold(row["prompt"], row["completion"])
                    sums["gold_score"] += row["gold"]
                samples.append(row)
            if k:  # k sampled completions per prompt, scored by the reward functions only
                repeated = queries.repeat_interleave(k, 0)
                query_responses, _ = pc.batch_generation(self.policy, repeated, pad, eos, self.generation_config,
                                                         chunk, accelerator)
                rows = [held_out.rows[j] for j in chunk_indices for _ in range(k)]
                function_reward, verdicts = verifiers(query_responses, context_length, rows, accelerator)
                correct = ((verdicts >= 1.0) | verdicts.isnan()).all(1) & ~verdicts.isnan().all(1)  # (b * k,)
                sums[f"pass@{k}"] += correct.view(-1, k).any(1)[:real].sum().item()
                sums[f"mean@{k}"] += function_reward.view(-1, k).mean(1)[:real].sum().item()
        self.policy.train(training)
        means = ru.global_means(accelerator, sums, n_real)
        logger.log_samples("eval/samples", samples, step, args.num_samples_printed)
        return {**{f"eval/{key}": means[key] for key in sums},
                **self.reward_sources.metrics(torch.cat(source_scores), accelerator, prefix="eval/reward/")}

    def close(self) -> None:
        """Stop the vLLM engine, if there is one."""
        if self.vllm is not None:
            self.vllm.close()


@torch.no_grad()
def greedy_completions(policy, tokenizer, prompts: Sequence[List[int]], response_length: int, batch_size: int,
                       accelerator):
    """This process's even share of `prompts` (token-id lists) completed greedily, `batch_size` rows per generate
    call (every process makes the same calls): the offline scripts' held-out completions. Returns (prompt texts,
    completion texts) of its real rows, special tokens skipped; the padding rows of the share are dropped."""
    mine, n_real = ru.even_share(prompts, accelerator)
    pad = tokenizer.pad_token_id
    queries = pc.pad_sequences(mine, pad, "left").to(accelerator.device)  # (n, Lq)
    config = pc.make_generation_config(tokenizer, response_length, greedy=True)
    query_responses, _ = pc.batch_generation(policy, queries, pad, tokenizer.eos_token_id, config, batch_size,
                                             accelerator)
    return (tokenizer.batch_decode(queries[:n_real], skip_special_tokens=True),
            tokenizer.batch_decode(query_responses[:n_real, queries.shape[1]:], skip_special_tokens=True))


def held_out_completions(policy, held_out: du.HeldOut, response_length: int, batch_size: int, accelerator):
    """The offline scripts' greedy evaluation: this process's share of `held_out.prompts` completed greedily
    (`greedy_completions`). Returns (metrics, samples): eval/gold_score, the mean over every process's prompts, when
    the task has a gold scorer (else {}); and sample-table rows {prompt, completion[, gold]}."""
    if not held_out.prompts:
        return {}, []
    prompts, completions = greedy_completions(policy, held_out.tokenizer, held_out.prompts, response_length,
                                              batch_size, accelerator)
    samples = [{"prompt": p, "completion": c} for p, c in zip(prompts, completions)]
    if held_out.gold is None:
        return {}, samples
    for row in samples:
        row["gold"] = held_out.gold(row["prompt"], row["completion"])
    return ru.global_means(accelerator, {"eval/gold_score": sum(row["gold"] for row in samples)}, len(samples)), samples

