"""Greedy completions of held-out prompts for the offline scripts (sft.py, dpo.py, kto.py): their evaluation's
samples and, when the task has one, its gold score. (The RL scripts evaluate through evaluation.py.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional, Sequence

import torch

import policy_common as pc
from plumbing import data_utils as du
from plumbing import models, vision
from plumbing import run_utils as ru
from plumbing.errors import UserError


@dataclass
class GenerationFlags:
    """Completions: their length, and the held-out prompts completed greedily at each evaluation."""
    response_length: int = 53
    """maximum new tokens per completion; with tools, the sampled tokens of a whole episode, tool results not counted
    (a default is lowered to fit the model's positions)"""
    num_eval_prompts: int = 512
    """held-out prompts completed greedily at each evaluation (at most the split's size)"""
    cache_implementation: Optional[Literal["dynamic", "static"]] = None
    """HF generate's key/value cache (not vLLM's): None or dynamic grows it by copying it whole at every token;
    static writes each token into one preallocated cache (the same samples, faster on long prompts)"""

    def check(self) -> None:
        if self.response_length < 1 or self.num_eval_prompts < 0:
            raise UserError(f"--response_length must be >= 1 and --num_eval_prompts >= 0, got {self.response_length} "
                            f"and {self.num_eval_prompts}")


@torch.no_grad()
def greedy_completions(policy, tokenizer, prompts: Sequence[List[int]], response_length: int, batch_size: int,
                       accelerator, cache_implementation: Optional[str] = None, images: Optional[Sequence] = None,
                       blank: bool = False):
    """This process's even share of `prompts` (token-id lists) completed greedily, `batch_size` rows per generate
    call (every process makes the same calls), with HF generate's `cache_implementation`: the offline scripts'
    held-out completions. `images`: the prompts' vision.ImageSource (None: text), shown as they are or, `blank`,
    replaced by blank pictures (the blind control). Returns (prompt texts, completion texts) of its real rows, special
    tokens skipped; the padding rows of the share are dropped."""
    mine, n_real = ru.even_share(prompts, accelerator)
    pad = tokenizer.pad_token_id
    queries = pc.pad_sequences(mine, pad, "left").to(accelerator.device)  # (n, Lq)
    config = pc.make_generation_config(tokenizer, response_length, greedy=True,
                                       cache_implementation=cache_implementation,
                                       suppress=vision.image_token_ids(models.unwrap(policy).config))
    pixels = images and [s.inputs(blank) for s in ru.even_share(images, accelerator)[0]]  # (n,) image inputs
    query_responses, _ = pc.batch_generation(policy, queries, pad, tokenizer.eos_token_id, config, batch_size,
                                             accelerator, images=pixels)
    return (tokenizer.batch_decode(queries[:n_real], skip_special_tokens=True),
            tokenizer.batch_decode(query_responses[:n_real, queries.shape[1]:], skip_special_tokens=True))


def held_out_completions(policy, held_out: du.HeldOut, args, accelerator, logger, step: int) -> dict:
    """The offline scripts' greedy evaluation: this process's share of `held_out.prompts` completed greedily
    (`greedy_completions`, --response_length new tokens, --per_device_eval_batch_size rows per call,
    --cache_implementation), a few of them shown in the sample table (--num_samples_printed rows {prompt,
    completion[, gold]}). Returns eval/gold_score, the mean over every process's prompts, when the task has a gold
    scorer (else {}); with images also eval/gold_score_blind, the gold of the answers to blank pictures (a policy that
    reads the images sits at chance there)."""
    if not held_out.prompts:
        return {}
    gold, images = held_out.gold, held_out.images
    rows = ru.even_share(images or [None] * len(held_out.prompts), accelerator)[0]  # gold reads a row's columns

    def complete(blank=False):  # -> (prompt texts, completion texts, their gold or None)
        prompts, completions = greedy_completions(policy, held_out.tokenizer, held_out.prompts, args.response_length,
                                                  args.per_device_eval_batch_size, accelerator,
                                                  args.cache_implementation, images, blank)
        return prompts, completions, gold and [gold(p, c, r and r.row) for p, c, r in zip(prompts, completions, rows)]

    prompts, completions, scores = complete()
    samples = [{"prompt": p, "completion": c, **({} if gold is None else {"gold": g})}
               for p, c, g in zip(prompts, completions, scores or [None] * len(prompts))]
    logger.log_samples("eval/samples", samples, step, args.num_samples_printed)
    if gold is None:
        return {}
    sums = {"eval/gold_score": sum(scores), **({"eval/gold_score_blind": sum(complete(True)[2])} if images else {})}
    return ru.global_means(accelerator, sums, len(samples))
