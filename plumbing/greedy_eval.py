"""Greedy completions of held-out prompts for the offline scripts (sft.py, dpo.py, kto.py): their evaluation's
samples and, when the task has one, its gold score. (The RL scripts evaluate through rollout.Sampler.evaluate.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from plumbing import data_utils as du
import policy_common as pc
from plumbing import run_utils as ru


@dataclass
class GenerationFlags:
    """Completions: their length, and the held-out prompts completed greedily at each evaluation."""
    response_length: int = 53
    """maximum new tokens per generated completion (a default is lowered to fit the model's positions)"""
    num_eval_prompts: int = 512
    """held-out prompts completed greedily at each evaluation (at most the split's size)"""


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

