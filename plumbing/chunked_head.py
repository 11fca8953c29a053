"""The output layer in chunks of tokens: per-token results of the logits (log-probs, entropy, a divergence) without
ever holding rows x tokens x vocabulary.

At long completions the logits are the largest tensor of a step (8 rows of 1,088 tokens at Pythia's 50,304-word
vocabulary are 1.75 GB of float32), and a log-softmax, its gradient and an entropy each add as much again. Here the
model runs as usual except that its output layer hands back its input, the last hidden states (B, R, H); the output
layer is then applied to `chunk_tokens` positions at a time and a caller's function reduces each chunk's logits to
per-token values. With gradient, each chunk is checkpointed (torch.utils.checkpoint, non-reentrant): only its hidden
states are kept, and the backward recomputes one chunk's logits at a time. The numbers are those of the full logits
to float rounding (tests/test_chunked_head.py: log-probs, entropy and gradients for GPT-NeoX, Llama, LoRA, with
temperature, pad masking, shared prompts and gradient for some rows only).

Chosen once per model by forwards.py (`ChunkedHead`, around the forward that computes the hidden states); nothing here
knows about algorithms.

Models whose forward changes the output layer's result (Gemma's soft-capping, Cohere's logit scale, Granite's logits
scaling) are recognised from their config and keep the full-logits path (`supported`); any other change is caught by
a check on every forward and stops the run with an error naming the flag.

Under DeepSpeed ZeRO-3 every output-layer call gathers its weight, a collective: every process must make the same
number of calls, so there the chunk count is agreed on (one all-reduce of an integer) and the chunked path is taken
whenever chunking is on.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import policy_common as pc
from plumbing import models

CHUNK_LOGITS_BYTES = 2**28  # the default chunk: as many positions as make 256 MiB of float32 logits
# config fields of models whose forward transforms the output layer's result (the full-logits path serves them)
TRANSFORMING_CONFIG_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logits_soft_cap",
                              "output_multiplier")


def supported(model: nn.Module) -> bool:
    """Does the model's forward return its output layer's result unchanged (as far as its config tells)?"""
    config = models.causal_lm(model).config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return all(getattr(config, field, None) in (None, 1, 1.0) for field in TRANSFORMING_CONFIG_FIELDS)


def resolve_chunk_tokens(model: nn.Module, chunk_tokens) -> int:
    """--logprob_chunk_tokens for this model: None -> the positions whose float32 logits make CHUNK_LOGITS_BYTES
    (2**26 / vocabulary size: 1,334 at Pythia's 50,304 words, 441 at Qwen's 152,064; never at the toy's 16)."""
    if chunk_tokens is not None:
        return chunk_tokens
    head = models.output_layer(model)
    vocab = getattr(head, "out_features", None) or models.causal_lm(model).config.get_text_config().vocab_size
    return max(1, CHUNK_LOGITS_BYTES // (4 * vocab))


def zero3_partitioned(head: nn.Module) -> bool:
    """Is the output layer's weight a DeepSpeed ZeRO-3 shard (gathered by a collective on every call)?"""
    return hasattr(head.weight, "ds_id")


def chunk_count(tokens: int, chunk_tokens: int, head: nn.Module) -> int:
    """ceil(tokens / chunk_tokens), the largest over processes under ZeRO-3 (every process then makes the same
    output-layer calls)."""
    n = max(1, math.ceil(tokens / chunk_tokens))
    if zero3_partitioned(head) and torch.distributed.is_available() and torch.distributed.is_initialized():
        count = torch.tensor([n], device=head.weight.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        n = int(count.item())
    return n


def wanted(model: nn.Module, tokens: int, chunk_tokens) -> bool:
    """Take the chunked path for `tokens` response positions? When chunking is on (chunk_tokens None or > 0), the
    model is `supported`, and the positions are more than one chunk, or always under ZeRO-3 (the same calls on every
    process, whatever its own batch)."""
    if chunk_tokens == 0 or not supported(model):
        return False
    chunk_tokens = resolve_chunk_tokens(model, chunk_tokens)
    return tokens > chunk_tokens or zero3_partitioned(models.output_layer(model))


def map_chunks(forward: pc.Forward, model: nn.Module, fn, hidden: torch.Tensor, extra, *, chunk_tokens,
               mask_pad: bool = True, grad_positions: Optional[int] = None) -> tuple:
    """hidden (N, H) and extra tensors (N, ...) -> fn(forward.head_logits(chunk of hidden), *chunks of extra) for
    chunks of about `chunk_tokens` positions, concatenated: a tuple of (N, ...) tensors. fn must reduce over the
    vocabulary and return a tuple of per-position tensors. With gradient (grad mode on and the hidden states or the
    output layer requiring it), each chunk is checkpointed: its logits are recomputed in the backward, one chunk at a
    time. An output with a graph that the loss does not use keeps its chunk's recomputed tensors until the backward
    ends: compute such outputs (metrics) under no_grad.
    `grad_positions=n` (0 < n < N): positions n.. carry no gradient, their chunks are computed under no_grad."""
    if grad_positions is not None and 0 < grad_positions < hidden.shape[0]:
        n = grad_positions
        with torch.no_grad():
            other = map_chunks(forward, model, fn, hidden[n:], [e[n:] for e in extra], chunk_tokens=chunk_tokens,
                               mask_pad=mask_pad)
        first = map_chunks(forward, model, fn, hidden[:n], [e[:n] for e in extra], chunk_tokens=chunk_tokens,
                           mask_pad=mask_pad)
        return tuple(torch.cat(pair) for pair in zip(first, other))
    head = models.output_layer(model)
    n_chunks = chunk_count(hidden.shape[0], resolve_chunk_tokens(model, chunk_tokens), head)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))

    def chunk_fn(hidden_chunk, *extra_chunks):
        return tuple(fn(forward.head_logits(model, hidden_chunk, mask_pad), *extra_chunks))

    outs = []
    for hidden_chunk, *extra_chunks in zip(hidden.tensor_split(n_chunks), *(e.tensor_split(n_chunks) for e in extra)):
        if grad:
            outs.append(checkpoint(chunk_fn, hidden_chunk, *extra_chunks, use_reentrant=False,
                                   preserve_rng_state=False))
        else:
            outs.append(chunk_fn(hidden_chunk, *extra_chunks))
    return tuple(torch.cat(parts) for parts in zip(*outs))


class ChunkedHead(pc.Forward):
    """`inner`'s forward (plain, sharing prompts, or packed) with its output layer run a chunk of `chunk_tokens`
    positions at a time in `map_logits` (and so in `logprobs`) wherever there are more positions than a chunk (always
    under ZeRO-3): `inner` computes the last hidden states, `map_chunks` the rest."""

    def __init__(self, inner: pc.Forward, chunk_tokens: Optional[int]):
        super().__init__(inner.pad_token_id, inner.temperature, inner.masked_token_ids)
        self.inner, self.chunk_tokens, self.shares_prompts = inner, chunk_tokens, inner.shares_prompts

    def unshared(self) -> pc.Forward:
        return ChunkedHead(self.inner.unshared(), self.chunk_tokens)

    def chunked(self, model: nn.Module, positions: int) -> bool:
        return wanted(model, positions, self.chunk_tokens)

    def outputs(self, model, query_responses, context_length, grad_rows=None, hidden=False, images=None):
        return self.inner.outputs(model, query_responses, context_length, grad_rows, hidden, images=images)

    def prefill(self, model, queries, attention_mask, position_ids, cache=None) -> dict:
        return self.inner.prefill(model, queries, attention_mask, position_ids, cache)

    def map_logits(self, model, query_responses, context_length, fn, *extra, mask_pad=True, grad_rows=None,
                   images=None) -> tuple:
        B, R = query_responses.shape[0], query_responses.shape[1] - context_length
        if not self.chunked(model, B * R):
            return self.inner.map_logits(model, query_responses, context_length, fn, *extra, mask_pad=mask_pad,
                                         grad_rows=grad_rows, images=images)
        flat = [e.reshape(B * R, *e.shape[2:]) for e in extra]
        hidden = self.inner.outputs(model, query_responses, context_length, grad_rows, hidden=True, images=images)
        results = map_chunks(self, model, fn, hidden.reshape(B * R, -1), flat, chunk_tokens=self.chunk_tokens,
                             mask_pad=mask_pad, grad_positions=None if grad_rows is None else grad_rows * R)
        return tuple(r.reshape(B, R, *r.shape[1:]) for r in results)
