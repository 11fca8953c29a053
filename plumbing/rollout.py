"""Rollouts for the RL scripts: prompts in, a scored batch out.

rloo.py, grpo.py and ppo.py get every step's data from one call, `Sampler.rollout`: this process's next prompts of
the data stream (with their images: vision.py), `samples_per_prompt` completions of each, sampled by HF `generate`
(policy_common.batch_generation) or a vLLM engine (vllm_generation.py, --use_vllm), truncated after their first EOS;
the old and the reference model's log-probs; each reward source's score and their weighted sum, minus the missing-EOS
penalty: a `Rollout`, from which the script computes its advantages and loss. It is `generate` then `score`: samples
may come from earlier weights (run_ahead.py). Evaluation: evaluation.py (offline scripts: greedy_eval.py).

The sampler owns the choices that change speed, never the numbers an algorithm computes:
- the policy's forward, chosen once at setup (forwards.py, from `rollout_forwards`: prompt sharing, packing, the
  output layer in chunks), in generation's prefill, scoring, and the scripts' training forward;
- chunk sizes: --local_rollout_forward_batch_size rows per generation and per no-grad forward;
- HF generate or vLLM, and the engine's weight sync (before a generation that follows an optimizer step);
- the order of rows in the update (`Rollout.shuffled_rows`): a prompt's samples stay together.

The old log-probs, stated once. With HF generate the log-probs of the sampled tokens, read from the scores that
generation sampled from, are the old log-probs (of the policy before this step's update); no forward recomputes them.
That holds while sampling never emits pad (`make_generation_config` suppresses it), generation applies the temperature
and nothing else (top_k 0, top_p 1, the model's own sampling defaults ignored: `batch_generation`), and every forward
scores that distribution (logits / temperature, pad masked: `Forward.logits`, `mask_pad_`). A top-p, top-k,
repetition penalty or logits processor added to generation would break it silently, so it is measured: at the first
rollout and every LOGPROB_CHECK_EVERY-th (by step: a resumed run checks the same steps) the first LOGPROB_CHECK_ROWS
rows are scored again by a forward; the largest |sampled - recomputed| over their tokens, on all processes, is logged as
`rollout/logprob_check`, the sampler-trainer mismatch on those rows as `hf/*` (importance_sampling_stats,
precision.py). Above the tolerance (float32: 1e-3 on any token; bf16/fp16, whose kernels round differently in
generation and in a forward: 0.05 on average) the run stops with a RolloutError, its finished steps checkpointed. With
vLLM (other kernels, a KV cache, bf16) or earlier weights the old log-probs come from a trainer forward, and
`Rollout.importance_weights` reweights the policy loss by pi_old / pi_behaviour.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn as nn

import policy_common as pc
from plumbing import data_utils as du
from plumbing import environments as envs
from plumbing import episodes as ep
from plumbing import greedy_eval as ge
from plumbing import models
from plumbing import prompt_sharing as ps
from plumbing import reward_sources as rs
from plumbing import run_utils as ru
from plumbing import vllm_generation as vg
from plumbing import vllm_server as vs
from plumbing.errors import RolloutError, UserError, require_positive
from plumbing.forwards import Forwards
from plumbing.importance_sampling import ImportanceSampling, importance_sampling_stats, importance_weights
from plumbing.vision import Vision, row_images

LOGPROB_CHECK_EVERY = 10  # steps between checks of the old-log-probs invariant (the first rollout is checked)
LOGPROB_CHECK_ROWS = 4  # rows scored again by a forward at each check
LOGPROB_CHECK_MAX = 1e-3  # float32: largest |sampled - recomputed| log-prob of any checked token
LOGPROB_CHECK_MEAN_LOW_PRECISION = 0.05  # bf16 / fp16: mean |sampled - recomputed| over the checked tokens


@dataclass
class RolloutFlags(ge.GenerationFlags):
    """Rollouts (rloo, grpo, ppo, distill): how many, how they are sampled, penalised and chunked."""
    total_episodes: int = 1_000_000
    """total number of sampled completions (episodes) to train on"""
    temperature: float = 1.0
    """sampling temperature (log-probs for ratios and the KL use logits / temperature too)"""
    missing_eos_penalty: Optional[float] = None
    """subtracted from the score of a completion without EOS (None = no penalty)"""
    local_rollout_forward_batch_size: Optional[int] = None
    """rows per generation / no-grad forward chunk (None = per_device_train_batch_size: a no-grad pass needs less
    memory than the training pass over as many rows)"""

    def check(self) -> None:
        """One-line errors before anything loads; --local_rollout_forward_batch_size's None becomes its value."""
        if self.local_rollout_forward_batch_size is None:  # the micro-batch the user sized for training
            self.local_rollout_forward_batch_size = self.per_device_train_batch_size
        require_positive(self, "response_length", "total_episodes", "num_eval_prompts",
                         "local_rollout_forward_batch_size", "temperature")


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
    context_limit: int  # the most tokens of prompt + response a sequence may hold (multi-turn: tool tokens too)
    vision: Optional[Vision] = None  # the data's images and the model's processor (vision.py), None for text


def load_prompt_data(args, tokenizer, policy_path: str, toolset: Optional[ep.Toolset] = None,
                     images: bool = False) -> PromptData:
    """--dataset's (None: the one paired with --model) training split and --eval_split (its first --num_eval_prompts
    rows), column `prompt` required, tokenised once (with the chat template when conversational; with an image column
    by the model's processor: vision.py). A prompt longer than --max_prompt_length is refused; None becomes the
    longest prompt in the data. --response_length is then fitted into the model's positions after the longest prompt
    (a default lowered with a note; a value given that cannot fit, a one-line error). With a `toolset` the prompts
    must be conversations, and are rendered with its tools. `images`: the script's forwards carry image inputs (else
    data with an image column is refused in one line)."""
    name = args.dataset or ru.default_dataset(args.model)
    train_data = du.load_prompt_dataset(name, "train")
    eval_data = du.load_prompt_dataset(name, args.eval_split)
    du.require_columns(train_data, ["prompt"], name)
    du.require_columns(eval_data, ["prompt"], name)
    eval_data = eval_data.select(range(min(args.num_eval_prompts, len(eval_data))))
    vision = Vision.from_data(policy_path, ru.model_config(policy_path, args.trust_remote_code),
                              train_data.column_names, name, args.trust_remote_code)
    if vision is not None:
        vision.refuse(("this script", not images), ("--tools / --environment", toolset is not None))
        train_prompts, eval_prompts = (vision.encode_rows(data, args.max_prompt_length) for data in (train_data,
                                                                                                      eval_data))
    elif toolset is None:
        train_prompts = du.tokenize_prompts(tokenizer, train_data["prompt"], args.max_prompt_length)
        eval_prompts = du.tokenize_prompts(tokenizer, eval_data["prompt"], args.max_prompt_length)
    else:
        if not du.is_conversational(train_data[0]["prompt"]):
            raise UserError(f"--tools / --environment need conversational prompts (lists of messages); dataset "
                            f"{name!r} has text prompts")
        # each row with its own tools; the default --max_prompt_length measures prompts after the environment's reset
        pool = envs.EnvironmentPool(toolset) if args.max_prompt_length is None else None
        train_prompts, eval_prompts = (
            [ep.episode_prompt(toolset, tokenizer, row["prompt"], row, pool and pool.for_rows([row])[0])[1]
             for row in data] for data in (train_data, eval_data))
        du.check_prompt_lengths(train_prompts, args.max_prompt_length)
        du.check_prompt_lengths(eval_prompts, args.max_prompt_length)
    if args.max_prompt_length is None:
        args.max_prompt_length = max(len(p) for p in train_prompts + eval_prompts)
    positions = ru.model_positions(policy_path, args.trust_remote_code)
    ru.fit_length(args, "response_length", None if positions is None else positions - args.max_prompt_length,
                  f"the model's {positions} positions minus prompts of up to {args.max_prompt_length} tokens")
    context_limit = args.max_prompt_length + args.response_length
    if toolset is not None:  # tool results take positions too: up to the model's, or twice the sampled budget
        context_limit = positions or args.max_prompt_length + 2 * args.response_length
    return PromptData(name, train_data, train_prompts, eval_data,
                      du.HeldOut(eval_data.to_list(), eval_prompts, tokenizer, du.gold_scorer(name)), context_limit,
                      vision)


def rollout_forwards(args, pad_token_id: int, samples_per_prompt: int) -> Forwards:
    """An RL run's forwards (forwards.py): log-probs of logits / --temperature; the samples_per_prompt completions of a
    prompt encode it once where that saves enough at the sampler's chunks (min(--per_device_train_batch_size,
    --local_rollout_forward_batch_size) rows, prompts of --max_prompt_length, completions of --response_length)."""
    repeats = ps.Repeats(min(args.per_device_train_batch_size, args.local_rollout_forward_batch_size),
                         samples_per_prompt, args.max_prompt_length, args.response_length)
    return Forwards.from_args(args, pad_token_id, temperature=args.temperature, repeats=repeats)


@dataclass
class Samples:
    """`Sampler.generate`'s unscored completions: `Rollout`'s fields, the episodes, the sampling weights' version."""
    query_responses: torch.Tensor  # (B, Lq + R)
    context_length: int
    indices: List[int]  # (B / k,) the prompts' rows in the training data
    rows: List[dict]
    behaviour_logprobs: torch.Tensor  # (B, R) the sampled tokens' log-probs under the policy that sampled them
    by_engine: bool  # a vLLM engine sampled: its log-probs are not the trainer's, even at the same weights
    entropy: Optional[torch.Tensor]  # (B, R) HF generate: the sampling distribution's entropy, when asked for
    action_mask: Optional[torch.Tensor]
    truncated: torch.Tensor  # (B,)
    episodes: Optional[list]
    metrics: dict
    weights_version: int
    images: Optional[list] = None  # (B,) each row's image inputs (vision.py), None for text


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
    old_logprobs: Optional[torch.Tensor]  # (B, R) pi_old: the policy before this step's update; PADDING after EOS
    ref_logprobs: Optional[torch.Tensor]  # (B, R) the reference's; meaningless after EOS (mask with response_mask)
    entropy: Optional[torch.Tensor]  # (B, R) entropy of the sampling distribution at each response position
    # (B, R) pi_behaviour: the log-probs of the policy that sampled (a vLLM engine, or earlier weights with
    # --max_staleness), whose samples the loss reweights (`importance_weights`); None: pi_old sampled them itself
    behaviour_logprobs: Optional[torch.Tensor]
    metrics: dict  # rollout/logprob_check and hf/* (at the steps checked), time/weight_sync_seconds (vLLM)
    pad_token_id: int
    eos_token_id: int
    action_mask: Optional[torch.Tensor] = None  # (B, R) multi-turn: True on sampled tokens, False on tool results
    episode_truncated: Optional[torch.Tensor] = None  # (B,) multi-turn: the episode ended at the budget
    # how the loss of another policy's samples is reweighted (--vllm_importance_sampling_*, with behaviour_logprobs)
    importance_sampling: ImportanceSampling = ImportanceSampling()
    images: Optional[list] = None  # (B,) each row's image inputs (vision.py: every forward of the row takes them)

    @property
    def responses(self) -> torch.Tensor:
        """(B, R) the response tokens (multi-turn: sampled turns and tool results, in order)."""
        return self.query_responses[:, self.context_length:]

    @property
    def response_mask(self) -> torch.Tensor:
        """(B, R) bool: the policy's actions, where the loss, the KL and the entropy are taken: the sampled tokens up
        to and including the EOS (multi-turn: of every turn; tool-result tokens are not actions)."""
        mask = self.responses != self.pad_token_id
        return mask if self.action_mask is None else mask & self.action_mask

    def length_metrics(self) -> dict:
        """val/num_eos_tokens (completions that ended with EOS), val/truncated_fraction, val/response_length (mean)."""
        return {"val/num_eos_tokens": (~self.truncated).sum().float(), "val/truncated_fraction":
                self.truncated.float().mean(), "val/response_length": self.response_mask.sum(1).float().mean()}

    @property
    def scored_rewards(self) -> torch.Tensor:
        """(B,) `scores`, NaN where no reward source scored the completion (left out of its group's statistics)."""
        return self.scores.masked_fill(self.source_scores.isnan().all(1), math.nan)

    @property
    def token_counts(self) -> torch.Tensor:
        """(B,) each row's real tokens, prompt and response (what a padding-free forward processes; --token_budget)."""
        return (self.query_responses != self.pad_token_id).sum(1)

    @property
    def truncated(self) -> torch.Tensor:
        """(B,) bool: the completion has no EOS (it was cut at --response_length; multi-turn: the episode's last
        turn was cut by the budget)."""
        if self.episode_truncated is not None:
            return self.episode_truncated
        return ~(self.responses == self.eos_token_id).any(1)

    def shuffled_rows(self) -> torch.Tensor:
        """(B,) a random order of the rows that keeps each prompt's samples together, so that a micro-batch of a
        multiple of k rows holds whole groups and encodes each of its prompts once (one torch.randperm draw)."""
        k, device = self.samples_per_prompt, self.query_responses.device
        prompts = len(self.query_responses) // k
        return (torch.randperm(prompts, device=device)[:, None] * k + torch.arange(k, device=device)).flatten()

    def importance_weights(self, old_logprobs: torch.Tensor, sequence_loss: bool = False):
        """The weights pi_old / pi_behaviour of the loss terms of another policy's samples (importance_sampling.py):
        (B, R), or (B,) for a loss with one term per completion (`sequence_loss`); None when pi_old sampled them.
        old_logprobs (B, R): pi_old's (the rollout's, or the training forward's own, detached, at one pass)."""
        return importance_weights(old_logprobs, self.behaviour_logprobs, self.response_mask,
                                  self.importance_sampling, sequence_loss)

    def importance_sampling_stats(self, old_logprobs: torch.Tensor, sequence_loss: bool = False) -> dict:
        """vllm/* (or async/*) metrics of those weights (importance_sampling.py); {} when pi_old sampled them."""
        return importance_sampling_stats(old_logprobs, self.behaviour_logprobs, self.response_mask,
                                         self.importance_sampling, sequence_loss)

    def subset(self, rows: torch.Tensor) -> "Rollout":
        """The rows `rows` (whole groups of samples_per_prompt, in order) as a Rollout of their own."""
        per_row = ("query_responses", "scores", "source_scores", "old_logprobs", "ref_logprobs", "entropy",
                   "behaviour_logprobs", "action_mask", "episode_truncated")
        picked = {name: None if getattr(self, name) is None else getattr(self, name)[rows] for name in per_row}
        return dataclasses.replace(self, rows=[self.rows[i] for i in rows.tolist()], **picked,
                                   images=row_images(self.images, rows))


class Sampler:
    """Sampling and scoring for one RL run (see the module docstring).

    policy: the causal LM that samples and is trained (rloo, grpo: the prepared policy; ppo: the policy inside its
    policy-and-value model); forward: the forward chosen for it (`rollout_forwards(...).lm(policy)`). reference: a
    policy_common.Reference, or None (no reference log-probs). prompts: the training prompts' token ids; rows: their
    dataset rows (a datasets.Dataset or list); vision: their images' processor (vision.py), None for text. Each process
    takes `prompts_per_process` prompts of the data stream per rollout and samples each `samples_per_prompt` times.
    max_prompt_length: the longest prompt it may see (sizes the vLLM engine; None: --max_prompt_length).
    weights_version: optimizer steps behind the policy's weights now (0; a resumed run's step). Reads the shared flags
    --response_length, --temperature, --missing_eos_penalty, --local_rollout_forward_batch_size, --seed and
    --use_vllm/--vllm_*."""

    def __init__(self, args, accelerator, tokenizer, policy: nn.Module, forward: pc.Forward,
                 reward_sources: rs.Rewards, reference, *, prompts: Sequence[List[int]], rows, samples_per_prompt: int,
                 prompts_per_process: int, max_prompt_length: Optional[int] = None, weights_version: int = 0,
                 toolset: Optional[ep.Toolset] = None, context_limit: Optional[int] = None,
                 vision: Optional[Vision] = None):
        self.args, self.accelerator, self.tokenizer = args, accelerator, tokenizer
        self.policy, self.forward, self.reward_sources, self.reference = policy, forward, reward_sources, reference
        self.prompts, self.rows, self.vision = prompts, rows, vision
        self.samples_per_prompt, self.prompts_per_process = samples_per_prompt, prompts_per_process
        self.pad, self.eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.chunk = args.local_rollout_forward_batch_size  # rows per generation / no-grad forward
        self.generation_config = pc.make_generation_config(tokenizer, args.response_length, args.temperature,
                                                          cache_implementation=args.cache_implementation,
                                                          suppress=forward.masked_token_ids)
        self.toolset, self.environments = toolset, toolset and envs.EnvironmentPool(toolset)  # multi-turn (episodes.py)
        self.max_prompt_length = max_prompt_length = max_prompt_length or args.max_prompt_length
        self.context_limit = context_limit or max_prompt_length + args.response_length
        if args.use_vllm and args.vllm_mode == "server":  # a server the user started samples (vllm_server.py)
            self.vllm = vs.from_args(args, policy, tokenizer, accelerator, weights_version=weights_version,
                                     max_model_len=self.context_limit)
        else:  # an engine beside this process, or None: HF generate
            self.vllm = vg.from_args(args, policy, tokenizer, accelerator, weights_version=weights_version,
                                     max_model_len=self.context_limit,
                                     rows_per_call=prompts_per_process * samples_per_prompt)

    def rollout(self, prompts_seen: int, weights_version: int, *, old_logprobs: bool = True,
                entropy: bool = False) -> Rollout:
        """This process's next prompts (positions prompts_seen + process index x prompts_per_process onward of the
        data stream, the same order on any number of processes), sampled, scored, with reference log-probs.
        weights_version: optimizer steps taken so far. old_logprobs=False: the caller takes them from its training
        forward (GRPO at one iteration; Rollout.old_logprobs None). entropy: the sampling distribution's, per
        position. Logs time/generate_seconds (the sampling)."""
        samples = self.generate(prompts_seen, weights_version, entropy=entropy)
        return self.score(samples, weights_version, old_logprobs=old_logprobs, entropy=entropy)

    @torch.no_grad()
    def generate(self, prompts_seen: int, weights_version: int, *, entropy: bool = False,
                 seeds: Optional[List[int]] = None) -> Samples:
        """`rollout`'s first half: the prompts at `prompts_seen` sampled by the weights of `weights_version`: HF
        generate with the policy as it is now (the old-log-probs check runs here), or the vLLM engine synced to that
        version (weights staged earlier when this runs on another thread: run_ahead.py). seeds: vLLM's, one per row."""
        start, args, accelerator, k = time.perf_counter(), self.args, self.accelerator, self.samples_per_prompt
        indices = du.data_positions(len(self.prompts), args.seed,
                                    prompts_seen + accelerator.process_index * self.prompts_per_process,
                                    self.prompts_per_process)
        queries = pc.pad_sequences([self.prompts[i] for i in indices], self.pad, "left").to(accelerator.device)
        queries = queries.repeat_interleave(k, dim=0)  # (B, Lq): each prompt k times in a row
        context_length = queries.shape[1]

        # 1. sample (HF generate: the sampled tokens' log-probs are the old log-probs; vLLM: its own log-probs);
        #    with tools, whole episodes (episodes.py): sampled turns and tool results, an action mask between them
        rows = [self.rows[i] for i in indices for _ in range(k)]  # the dataset row of each completion
        images = self.vision and self.vision.rows_inputs(rows[::k], repeats=k)  # (B,) each row's (None: text)
        pictures = self.vllm and self.vision and [p for row in rows[::k] for p in [self.vision.images_of(row)] * k]
        training, metrics, hf = self.policy.training, {}, self.vllm is None or self.toolset is not None
        if hf:  # (a vLLM engine samples in its own process; the policy may be training meanwhile: run_ahead.py)
            self.policy.eval()
        by_engine = self.vllm is not None
        if self.toolset is None:
            query_responses, behaviour_logprobs, entropies = self.sample(queries, weights_version, entropy, seeds=seeds,
                                                                         images=images, pictures=pictures)
            truncated, action_mask, episodes = ~(query_responses[:, context_length:] == self.eos).any(1), None, None
        else:
            episodes = self.play(rows, self.generation_config, weights_version, entropy=entropy)
            tensors = ep.episode_tensors(episodes, self.pad, accelerator.device)
            query_responses, context_length = tensors["query_responses"], tensors["context_length"]
            action_mask, truncated = tensors["action_mask"], tensors["truncated"]
            behaviour_logprobs, entropies = tensors["behaviour_logprobs"], tensors["entropy"] if entropy else None
            metrics.update(ep.episode_metrics(episodes, accelerator))
        response_mask = query_responses[:, context_length:] != self.pad  # (B, R)
        if action_mask is not None:
            response_mask &= action_mask
        if not by_engine and weights_version % LOGPROB_CHECK_EVERY == 0:
            metrics.update(self.check_logprobs(query_responses, context_length, behaviour_logprobs, response_mask,
                                               weights_version + 1, images))
        metrics.update({"time/weight_sync_seconds": self.vllm.last_sync_seconds} if by_engine else {})
        if hf:
            self.policy.train(training)
        metrics["time/generate_seconds"] = time.perf_counter() - start
        return Samples(query_responses, context_length, indices, rows, behaviour_logprobs, by_engine,
                       None if by_engine else entropies, action_mask, truncated, episodes, metrics, weights_version,
                       images)

    @torch.no_grad()
    def score(self, samples: Samples, weights_version: int, *, old_logprobs: bool = True,
              entropy: bool = False) -> Rollout:
        """`rollout`'s second half, with the policy at `weights_version` (its optimizer steps now): old log-probs,
        scores and reference log-probs of `samples`. Samples the policy did not draw itself now (vLLM's; HF's of an
        earlier version, --max_staleness) keep their log-probs as `behaviour_logprobs`; the old (proximal) log-probs
        come from a forward."""
        args, query_responses, context_length = self.args, samples.query_responses, samples.context_length
        logprobs, entropies, behaviour_logprobs = samples.behaviour_logprobs, samples.entropy, None
        if samples.by_engine or samples.weights_version != weights_version:  # another policy sampled them
            behaviour_logprobs, logprobs, entropies = logprobs, None, None
        response_mask = query_responses[:, context_length:] != self.pad  # (B, R)
        if samples.action_mask is not None:
            response_mask &= samples.action_mask
        if behaviour_logprobs is not None and (old_logprobs or entropy):  # the trainer's own log-probs of the samples
            training = self.policy.training
            self.policy.eval()
            logprobs = self.forward.logprobs_no_grad(self.policy, query_responses, context_length,
                                                     chunk_size=self.chunk, entropy=entropy, images=samples.images)
            logprobs, entropies = logprobs if entropy else (logprobs, None)
            self.policy.train(training)
        if logprobs is not None:
            logprobs = logprobs.masked_fill(~response_mask, pc.PADDING_LOGPROB)
        if entropies is not None:
            entropies = entropies.masked_fill(~response_mask, 0.0)

        # 2. score: each reward source, weighted; the missing-EOS penalty ("EOS trick")
        scores, source_scores = self.reward_sources(query_responses, context_length, samples.rows, self.accelerator,
                                                    self.chunk, shared=True, episodes=samples.episodes,
                                                    step=samples.weights_version)
        scores = rs.penalise_missing_eos(scores, samples.truncated, args.missing_eos_penalty)  # (B,), (B, S)

        # 3. the reference's log-probs
        ref_logprobs = None
        if self.reference is not None:
            ref_logprobs = self.reference.logprobs(query_responses, context_length, self.chunk, images=samples.images)
        return Rollout(query_responses=query_responses, context_length=context_length,
                       samples_per_prompt=self.samples_per_prompt, rows=samples.rows, scores=scores,
                       source_scores=source_scores, old_logprobs=logprobs if old_logprobs else None,
                       ref_logprobs=ref_logprobs, entropy=entropies, behaviour_logprobs=behaviour_logprobs,
                       metrics=dict(samples.metrics), pad_token_id=self.pad, eos_token_id=self.eos,
                       action_mask=samples.action_mask,
                       episode_truncated=None if samples.episodes is None else samples.truncated,
                       importance_sampling=ImportanceSampling.from_args(args, "vllm" if self.vllm else "async"),
                       images=samples.images)

    def sample(self, queries: torch.Tensor, weights_version: int, entropy: bool = False, generation_config=None,
               first_turn: bool = True, budgets: Optional[List[int]] = None, use_vllm: bool = True, seeds=None,
               images=None, pictures=None):
        """One completion per row of `queries` (B, Lq), left-padded, by HF generate or vLLM -> (query_responses
        (B, Lq + R), behaviour log-probs (B, R) of the sampled tokens under the policy that sampled them, entropy
        (B, R) or None (HF only)). R = the config's max_new_tokens; responses cut after their EOS. `budgets`: vLLM
        stops each row at its own (HF generates R for every row; the caller cuts). use_vllm=False: HF generate even
        with an engine. seeds: vLLM's per row (None: drawn). images: image inputs (HF); pictures: PIL images (vLLM)."""
        config = generation_config or self.generation_config
        if self.vllm is not None and use_vllm:
            query_responses, behaviour_logprobs = self.vllm.generate(self.policy, weights_version, queries, config,
                                                                     budgets, seeds, pictures)
            return query_responses, behaviour_logprobs, None
        query_responses, logprobs, *entropies = pc.batch_generation(
            self.policy, queries, self.pad, self.eos, config, self.chunk, self.accelerator,
            forward=self.forward if first_turn else None, return_entropy=entropy,  # later turns: one row per prompt
            images=images)
        return query_responses, logprobs, entropies[0] if entropy else None

    def play(self, rows: Sequence[dict], generation_config, weights_version: int = 0, *, entropy: bool = False,
             use_vllm: bool = True) -> list:
        """Multi-turn episodes of the prompts of `rows` (episodes.py), each turn sampled with `generation_config`
        (its max_new_tokens set per turn) by `sample` (HF only with use_vllm=False). Returns the Episodes."""
        episodes = ep.start_episodes([row["prompt"] for row in rows], rows, self.toolset, self.tokenizer,
                                     self.environments.for_rows(rows), self.max_prompt_length)

        def generate(sequences, budgets: List[int], first_turn: bool):
            queries = pc.pad_sequences(sequences, self.pad, "left").to(self.accelerator.device)
            config = copy.deepcopy(generation_config)
            config.max_new_tokens = max(budgets)
            if len(self.toolset.stop_ids) > 1:  # a turn also ends at e.g. GPT-OSS's <|call|>
                config.eos_token_id = list(self.toolset.stop_ids)
            query_responses, behaviour_logprobs, entropies = self.sample(queries, weights_version, entropy, config,
                                                                         first_turn, budgets, use_vllm)
            responses = query_responses[:, queries.shape[1]:].tolist()
            turns = [[t for t in response if t != self.pad] for response in responses]

            def lists(values):
                return None if values is None else [v[:len(t)] for v, t in zip(values.tolist(), turns)]

            return turns, lists(behaviour_logprobs), lists(entropies)

        return ep.run_episodes(episodes, generate, self.tokenizer, self.toolset,
                               response_length=generation_config.max_new_tokens, context_limit=self.context_limit,
                               max_tool_calling_iterations=self.args.max_tool_calling_iterations,
                               tool_timeout=self.args.tool_timeout,
                               max_tool_result_tokens=self.args.max_tool_result_tokens, accelerator=self.accelerator)

    def check_logprobs(self, query_responses: torch.Tensor, context_length: int, sampled_logprobs: torch.Tensor,
                       response_mask: torch.Tensor, step: int, images=None) -> dict:
        """The old-log-probs invariant (module docstring): the first LOGPROB_CHECK_ROWS rows scored again by a
        forward; returns rollout/logprob_check, the largest |sampled - recomputed| over their tokens on all processes
        (one all-reduce), and the sampler-trainer mismatch on those rows as hf/* (importance_sampling_stats: what
        importance weights would do, were they applied); raises RolloutError on every process when it is above the
        tolerance."""
        rows = query_responses[:LOGPROB_CHECK_ROWS]
        recomputed = self.forward.logprobs_no_grad(self.policy, rows, context_length,
                                                   images=row_images(images, slice(0, LOGPROB_CHECK_ROWS)))
        mask = response_mask[:LOGPROB_CHECK_ROWS]  # the sampled tokens
        diff = (recomputed - sampled_logprobs[:LOGPROB_CHECK_ROWS]).abs()[mask]
        stats = torch.stack([diff.max(), diff.mean()]) if diff.numel() else diff.new_zeros(2)
        if self.accelerator.num_processes > 1:
            stats = self.accelerator.reduce(stats, reduction="max")
        largest, mean = stats.tolist()
        low_precision = models.compute_dtype(self.policy) != torch.float32
        if not math.isfinite(largest) or (mean > LOGPROB_CHECK_MEAN_LOW_PRECISION if low_precision
                                          else largest > LOGPROB_CHECK_MAX):
            raise RolloutError(
                f"at step {step} the sampler's log-probs are not the trainer's (max |sampled - recomputed| "
                f"{largest:.3g}, mean {mean:.3g} per token): generation no longer samples the distribution every "
                "forward scores (a top-p, top-k, repetition penalty or logits processor in the generation config?); "
                "the losses would use wrong old log-probs (rollout.py's docstring)")
        stats = importance_sampling_stats(recomputed, sampled_logprobs[:LOGPROB_CHECK_ROWS], mask,
                                          ImportanceSampling.from_args(self.args, "hf"))
        return {"rollout/logprob_check": largest, **{k: v.item() for k, v in stats.items()}}  # JSON in checkpoints

    def complete(self, queries: torch.Tensor, rows: Sequence[dict], generation_config, images=None):
        """Evaluation's completions (HF generate, also with --use_vllm): one per row of `queries` (b, Lq) (`images`:
        the rows' image inputs), or with tools one episode per row of `rows` -> (query_responses, context_length,
        response_mask (b, R): the sampled tokens, truncated (b,), episodes or None)."""
        if self.toolset is None:
            query_responses, _ = pc.batch_generation(self.policy, queries, self.pad, self.eos, generation_config,
                                                     self.chunk, self.accelerator, images=images)
            responses = query_responses[:, queries.shape[1]:]
            return (query_responses, queries.shape[1], responses != self.pad, ~(responses == self.eos).any(1), None)
        episodes = self.play(rows, generation_config, use_vllm=False)
        tensors = ep.episode_tensors(episodes, self.pad, self.accelerator.device)
        query_responses, context_length = tensors["query_responses"], tensors["context_length"]
        mask = (query_responses[:, context_length:] != self.pad) & tensors["action_mask"]
        return query_responses, context_length, mask, tensors["truncated"], episodes

    def close(self) -> None:
        """Stop the vLLM engine, if there is one."""
        if self.vllm is not None:
            self.vllm.close()
