"""Asynchronous generation for rloo.py and grpo.py (--max_staleness N): the sampler runs N steps ahead of the trainer.

The batch trained at step t is sampled by the weights after step t - 1 - N (the first N + 1 batches by the starting
weights): a fixed lag, so the data and the versions of a run do not depend on how fast either side happens to be.
At N = 1, while the trainer takes step t on batch t, the sampler samples batch t + 1 with the weights of step t - 1:

    trainer   | train 1 (v0) | train 2 (v0) | train 3 (v1) | ...      batch t: sampled by version max(0, t - 1 - N)
    sampler   | sample 2 (v0)| sample 3 (v1)| sample 4 (v2)| ...      (and batch 1 by v0 before step 1)

The objective stays correct. Each completion keeps the weights version that sampled it and its sampler's log-probs
(the behaviour policy, pi_behav: `Rollout.behaviour_logprobs`); `Sampler.score` takes the old log-probs from the
trainer's weights at the start of the step (the proximal policy, pi_prox), and the scripts' losses are then the
decoupled objective of AReaL (Fu et al. 2025) and Hilton et al. 2022 ("Batch size-invariance for policy
optimization"):
    loss_t = -min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t) * w_t,   r_t = pi / pi_prox,   w_t = pi_prox / pi_behav
with w truncated or masked as --vllm_importance_sampling_mode / _clip_max / _clip_min say (by default AReaL's rule,
token_mask: a token whose weight exceeds the cap is left out; `Rollout.importance_weights`, computed by the
scripts beside their loss). Reference log-probs and
rewards are computed at training time, as in the synchronous loop. At N = 0 (the default) each batch is
`Sampler.rollout`'s, sampled and scored in step: the scripts' loop is the same either way.

Where generation runs:
- --use_vllm: the engine lives in its own process already, and one worker thread here drives it (its calls wait on
  the engine without holding the GIL) while the trainer trains: generation overlaps training. The trainer stages a
  copy of each version's weights for the engine and draws the completions' sampling seeds when it submits a batch,
  so a run repeats exactly whatever the threads' timing; the thread makes no collective call.
- HF generate: each batch is sampled in the trainer's thread when it is submitted (the same data, versions and
  objective as with vLLM), without overlap. On one device HF generation and the backward share the same compute
  (a GPU's stream, a CPU's cores), so a thread would gain little; generate draws from torch's global generator, so
  a thread would make runs unrepeatable; a sampler process would need a second copy of the weights on the device.
  What staleness does to learning can still be studied without vLLM.

Checkpoints hold each process's pending batches (samples, sampler log-probs, versions: `save`), so a resumed run
trains on the same data as an uninterrupted one. A checkpoint without them (written on an error) resumes with the
missing batches sampled by the resumed weights, with a note.

Metrics, per step: async/staleness_mean and async/staleness_max (versions behind of the batch's completions, the
same for all of them here), async/trainer_wait_seconds (how long the trainer waited for its batch; HF: its sampling
of the batches submitted at this step), async/sampler_wait_seconds (vLLM: how long the sampler waited for the
trainer's weights before it), the importance weights under async/ (HF) or vllm/ (vLLM).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import safetensors.torch
import torch

import policy_common as pc
from plumbing import rollout as ro
from plumbing import run_utils as ru
from plumbing import vllm_generation as vg
from plumbing.errors import UserError

# a Samples' tensors, by their names in a checkpoint's pending-<process>.safetensors
SAVED = ("query_responses", "behaviour_logprobs", "entropy", "truncated")


@dataclass
class AsyncFlags:
    """Asynchronous generation (rloo, grpo): a sampler running ahead of the trainer."""
    max_staleness: int = 0
    """the sampler runs this many steps ahead of the trainer: step t trains on completions sampled by the weights
    after step t - 1 - N (with --use_vllm, while it trains); the loss then weights them by pi_old / pi_sampler as
    --vllm_importance_sampling_* say (AReaL's decoupled objective); 0 = synchronous"""

    def check(self) -> None:
        """--max_staleness against the other flags: one-line errors before anything loads."""
        if self.max_staleness < 0:
            raise UserError(f"--max_staleness must be >= 0 (0: synchronous), got {self.max_staleness}")
        if self.max_staleness and (getattr(self, "tools", None) or getattr(self, "environment", None)):
            raise UserError("--max_staleness with --tools / --environment is not supported yet: multi-turn episodes "
                            "agree between processes turn by turn, which a sampler running ahead cannot do")


class RunAhead:
    """The rollouts of an RL run, its sampler `max_staleness` steps ahead (module docstring; 0: in step, each batch
    `Sampler.rollout`'s). The scripts' loop calls `rollout`; `save` goes to the checkpoints (train_loop's extra_files);
    `close` at the end. resume_from: the checkpoint the run resumed from (its pending batches are trained first)."""

    def __init__(self, sampler: ro.Sampler, max_staleness: int, resume_from: Optional[str] = None):
        self.sampler, self.max_staleness = sampler, max_staleness
        accelerator = sampler.accelerator
        self.prompts_per_step = sampler.prompts_per_process * accelerator.num_processes  # prompts_seen's stride
        self.pending = collections.deque()  # (prompts_seen, weights_version, Future or Samples), oldest first
        threaded = max_staleness > 0 and sampler.vllm is not None
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="sampler") if threaded else None
        self.staged_version = sampler.vllm.weights_version if threaded else None  # the engine's, or the last staged
        self.idle_since = time.perf_counter()  # when the worker last finished a batch
        self.file = f"pending-{accelerator.process_index}"
        if max_staleness and resume_from:
            self.load(resume_from)

    def rollout(self, prompts_seen: int, weights_version: int, *, old_logprobs: bool = True,
                entropy: bool = False) -> ro.Rollout:
        """The batch of the step after `weights_version` optimizer steps, its prompts at `prompts_seen` (as
        `Sampler.rollout`), sampled by the weights of version max(0, weights_version - max_staleness) and scored with
        the weights now; first the batches up to max_staleness steps ahead are submitted, sampled by the weights now."""
        if not self.max_staleness:
            return self.sampler.rollout(prompts_seen, weights_version, old_logprobs=old_logprobs, entropy=entropy)
        start = time.perf_counter()
        # 1. keep this batch and the next max_staleness ones sampled or being sampled
        position = self.pending[-1][0] + self.prompts_per_step if self.pending else prompts_seen
        while position <= prompts_seen + self.max_staleness * self.prompts_per_step:
            self.submit(position, weights_version, entropy)
            position += self.prompts_per_step
        # 2. the oldest one (waiting for it, if it is still being sampled), scored with the weights now
        position, version, job = self.pending.popleft()
        if position != prompts_seen:
            raise RuntimeError(f"run-ahead batch at prompt {position}, expected {prompts_seen}")  # a bug, not input
        samples = job.result() if isinstance(job, Future) else job
        waited = time.perf_counter() - start
        batch = self.sampler.score(samples, weights_version, old_logprobs=old_logprobs, entropy=entropy)
        behind = float(weights_version - version)
        batch.metrics.update({"async/staleness_mean": behind, "async/staleness_max": behind,
                              "async/trainer_wait_seconds": waited})
        return batch

    def rollout_groups(self, prompts_seen: int, weights_version: int, accept, max_rounds: int, *,
                       old_logprobs: bool = True):
        """A batch of prompts_per_process groups (a prompt's samples) that `accept` takes (a Rollout -> (P,) bool, one
        per group), rolling out the next prompts of the stream round after round until EVERY process holds that many
        (one all-reduce per round, so all run the same rounds) or `max_rounds` ran, then topped up with refused groups
        (DAPO's dynamic sampling: grpo.py). Returns (batch, rounds, metrics: dynamic_sampling/rounds and
        /frac_flat_sampled, the refused share of the groups sampled). In step (max_staleness 0: a sampler running ahead
        cannot know which prompts a round needs)."""
        sampler, kept, refused, rounds, n_refused = self.sampler, [], [], 0, 0
        k, wanted = sampler.samples_per_prompt, sampler.prompts_per_process * sampler.samples_per_prompt
        while True:
            rollout = self.rollout(prompts_seen + rounds * self.prompts_per_step, weights_version,
                                   old_logprobs=old_logprobs)
            rounds += 1
            accepted = accept(rollout)  # (P,)
            rows = torch.arange(len(rollout.rows), device=accepted.device).view(-1, k)  # (P, k)
            kept.append(rollout.subset(rows[accepted].flatten()))
            refused.append(rollout.subset(rows[~accepted].flatten()))
            n_refused += (~accepted).sum().item()
            short = sum(len(r.rows) for r in kept) < wanted
            if ru.global_sum(sampler.accelerator, float(short)) == 0 or rounds == max_rounds:
                break
        metrics = {"dynamic_sampling/rounds": float(rounds),
                   "dynamic_sampling/frac_flat_sampled": n_refused / (rounds * sampler.prompts_per_process)}
        return concat_rollouts([r for r in kept + refused if r.rows]).subset(torch.arange(wanted)), rounds, metrics

    def submit(self, position: int, weights_version: int, entropy: bool) -> None:
        """Sample the batch of prompts at `position` with the weights of `weights_version` (the policy's now): on the
        worker thread (vLLM: weights staged and seeds drawn here first), or here and now (HF generate)."""
        sampler = self.sampler
        if self.worker is None:
            self.pending.append((position, weights_version, self.generate(position, weights_version, entropy)))
            return
        if weights_version != self.staged_version:  # every process stages together (ZeRO-3 gathers)
            sampler.vllm.stage(sampler.policy, weights_version)
            self.staged_version = weights_version
        seeds = vg.draw_seeds(sampler.prompts_per_process * sampler.samples_per_prompt)
        job = self.worker.submit(self.generate, position, weights_version, entropy, seeds)
        self.pending.append((position, weights_version, job))

    def generate(self, position: int, weights_version: int, entropy: bool, seeds=None) -> ro.Samples:
        """`Sampler.generate`; as the worker thread's job (vLLM, seeds drawn by `submit`), also how long the worker
        waited for it (async/sampler_wait_seconds)."""
        start = time.perf_counter()
        samples = self.sampler.generate(position, weights_version, entropy=entropy, seeds=seeds)
        end = time.perf_counter()
        if self.worker is not None:
            samples.metrics["async/sampler_wait_seconds"] = start - self.idle_since
            self.idle_since = end
        return samples

    def save(self, folder: str) -> None:
        """Write this process's pending batches into checkpoint `folder` (waiting for those being sampled):
        pending-<process>.safetensors (their tensors) and pending-<process>.json (positions, versions, metrics); at
        max_staleness 0 nothing is pending."""
        if not self.max_staleness:
            return
        tensors, batches = {}, []
        for i, (position, version, job) in enumerate(self.pending):
            samples = job.result() if isinstance(job, Future) else job
            self.pending[i] = (position, version, samples)
            saved = {name: getattr(samples, name) for name in SAVED}
            tensors.update({f"{i}.{name}": value.detach().cpu().contiguous() for name, value in saved.items()
                            if value is not None})
            batches.append(dict(position=position, version=version, context_length=samples.context_length,
                                indices=list(samples.indices), by_engine=samples.by_engine, metrics=samples.metrics))
        safetensors.torch.save_file(tensors, os.path.join(folder, self.file + ".safetensors"))
        with open(os.path.join(folder, self.file + ".json"), "w") as f:
            json.dump(dict(max_staleness=self.max_staleness, batches=batches), f)

    def load(self, folder: str) -> None:
        """The pending batches `save` wrote into checkpoint `folder`; none there: a note, and they are sampled again."""
        sampler = self.sampler
        if not os.path.exists(os.path.join(folder, self.file + ".json")):
            sampler.accelerator.print(f"note: {folder} holds no pending batches (--max_staleness): the next "
                                      f"{self.max_staleness} are sampled by the resumed weights")
            return
        with open(os.path.join(folder, self.file + ".json")) as f:
            batches = json.load(f)["batches"]
        tensors = safetensors.torch.load_file(os.path.join(folder, self.file + ".safetensors"),
                                              device=str(sampler.accelerator.device))
        k = sampler.samples_per_prompt
        for i, saved in enumerate(batches):
            values = {name: tensors.get(f"{i}.{name}") for name in SAVED}
            rows = [sampler.rows[j] for j in saved["indices"] for _ in range(k)]
            samples = ro.Samples(**values, context_length=saved["context_length"], indices=saved["indices"], rows=rows,
                                 by_engine=saved["by_engine"], action_mask=None, episodes=None,
                                 metrics=saved["metrics"], weights_version=saved["version"])
            self.pending.append((saved["position"], saved["version"], samples))

    def close(self) -> None:
        """Stop the worker thread (after the batch it is sampling) and the sampler's engine."""
        if self.worker is not None:
            self.worker.shutdown(wait=True, cancel_futures=True)
        self.sampler.close()


def concat_rollouts(rollouts: Sequence[ro.Rollout]) -> ro.Rollout:
    """Several rollouts of one step as one (rows in order; e.g. dynamic sampling's rounds): prompts re-padded on the
    left to the longest context, responses on the right to the longest (pad; PADDING_LOGPROB for old log-probs,
    0 elsewhere, outside the response mask either way); numeric metrics averaged over the rounds that have them, but
    durations (*_seconds) summed."""
    if len(rollouts) == 1:
        return rollouts[0]
    first, pad = rollouts[0], rollouts[0].pad_token_id
    context_length = max(r.context_length for r in rollouts)
    length = max(r.query_responses.shape[1] - r.context_length for r in rollouts)  # R

    def response_side(name: str, fill):  # (B, R_i) per rollout -> (sum B, R), right-filled
        if getattr(first, name) is None:
            return None
        return torch.cat([torch.nn.functional.pad(getattr(r, name), (0, length - getattr(r, name).shape[1]),
                                                  value=fill) for r in rollouts])

    query_responses = torch.cat([torch.nn.functional.pad(r.query_responses, (
        context_length - r.context_length, length - r.query_responses.shape[1] + r.context_length), value=pad)
        for r in rollouts])  # (sum B, Lq + R): left pad to the longest prompt, right pad to the longest response
    metrics = {}
    for key in {key for r in rollouts for key in r.metrics}:
        values = [r.metrics[key] for r in rollouts if key in r.metrics]
        metrics[key] = sum(values) / (1 if key.endswith("_seconds") else len(values))  # durations add up
    return dataclasses.replace(
        first, query_responses=query_responses, context_length=context_length,
        rows=[row for r in rollouts for row in r.rows],
        scores=torch.cat([r.scores for r in rollouts]), source_scores=torch.cat([r.source_scores for r in rollouts]),
        old_logprobs=response_side("old_logprobs", pc.PADDING_LOGPROB), ref_logprobs=response_side("ref_logprobs", 0.0),
        entropy=response_side("entropy", 0.0), behaviour_logprobs=response_side("behaviour_logprobs", 0.0),
        action_mask=response_side("action_mask", False), metrics=metrics,
        images=None if first.images is None else [images for r in rollouts for images in r.images],
        episode_truncated=None if first.episode_truncated is None else torch.cat([r.episode_truncated
                                                                                   for r in rollouts]))
