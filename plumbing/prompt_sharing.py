"""Encode a prompt that several rows repeat only once: a forward that plumbing/forwards.py chooses where the rows of a
run repeat prompts and sharing saves enough (`SharedPromptForward`, `SharedPromptScalarForward`).

RLOO's k samples of a prompt, DPO's chosen and rejected completions and KTO's own and mismatched completions
repeat one prompt over several rows. Instead of running every row's prompt tokens, each distinct prompt runs
once with a key/value cache, the cache rows are selected for every sequence, and only the response tokens run
on top. The numbers are those of one full forward (to float rounding; tests/test_policy_common.py checks
log-probs, rewards and gradients against the obvious per-row computation for GPT-NeoX, Llama and LoRA models).

`split_logits` scores some rows without gradient on a fork of the encoded queries' cache (KTO's mismatched
completions): nothing of them is kept for the backward.

Whether to share is decided once, at setup, from sizes that are the same on every process (`worth_sharing`, from the
script's flags: `Repeats`): under DDP, DeepSpeed ZeRO-3 or FSDP every process must make the same model calls, and a
decision taken from one process's own data could differ between processes. Nothing here keeps state or talks to
other processes. A model whose forward takes no cache argument (`cache` from transformers 5.20 on, `past_key_values`
before), or that returns no cache, is run plainly (a property of the model code, the same on every process).

Shapes: B rows, T = Lq + R positions; rows are [left pads | query | response | right pads]; `attention_mask` and
`position_ids` are those of policy_common.padding_inputs (positions count real tokens only).
"""

import copy
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

import policy_common as pc
from plumbing import models, vision

# Sharing costs one more model call: on small models that costs more than the prompt positions it saves.
MIN_SAVED_FRACTION = 0.2  # of all input positions
MIN_SAVED_POSITIONS = 128


@dataclass
class PromptSharingFlags:
    """Prompt sharing (the scripts whose rows repeat a prompt: rloo, grpo, dpo, kto, reward)."""
    share_prompts: bool = True
    """encode a prompt repeated over rows once when that saves enough (prompt_sharing.py; the same numbers)"""


class Repeats(NamedTuple):
    """How a script's rows repeat prompts, from its flags (the same on every process): `rows` per model call, each
    prompt on `rows_per_prompt` of them, prompts of up to `prompt_length` tokens followed by up to
    `response_length`."""
    rows: int
    rows_per_prompt: int
    prompt_length: int
    response_length: int


def worth_sharing(rows: int, rows_per_prompt: int, prompt_length: int, response_length: int,
                  packed: bool = False) -> bool:
    """Does encoding each prompt once save enough? `rows` per model call, each prompt repeated `rows_per_prompt`
    times, prompts of up to `prompt_length` tokens followed by up to `response_length`. Give sizes that are the
    same on every process (flags, not the data), so that every process takes the same decision. `packed`: the rows
    run packed (packing.py), where a shared prompt costs no extra call."""
    if rows_per_prompt < 2 or prompt_length == 0 or response_length == 0:
        return False
    if packed:
        return True
    saved = (rows - rows // rows_per_prompt) * prompt_length
    return saved >= max(MIN_SAVED_FRACTION * rows * (prompt_length + response_length), MIN_SAVED_POSITIONS)


def takes_cache(model) -> bool:
    """The model's forward accepts a key/value cache and keeps one (not while training with activation
    checkpointing, which drops it)."""
    if models.cache_argument(model) is None:
        return False
    checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    return not (torch.is_grad_enabled() and model.training and checkpointed)


def distinct_queries(query_ids: torch.Tensor):
    """(B, Lq) -> (first (U,) index of one row per distinct query, inverse (B,)): query_ids[first][inverse] ==
    query_ids. Distinct queries come in sorted order."""
    _, inverse = torch.unique(query_ids, dim=0, return_inverse=True)
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((int(inverse.max()) + 1,), len(inverse), device=inverse.device, dtype=rows.dtype)
    return first.scatter_reduce(0, inverse, rows, reduce="amin"), inverse


def encode_distinct(model, query_responses: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    length: int, **kwargs):
    """Run the distinct values of query_responses[:, :length] once. Returns (output for the U distinct queries,
    their key/value cache (U rows), inverse (B,)), or None when the model returns no cache."""
    first, inverse = distinct_queries(query_responses[:, :length])
    mask = attention_mask[first, :length]
    out = model(input_ids=query_responses[first, :length].masked_fill(mask == 0, 0), attention_mask=mask,
                position_ids=position_ids[first, :length], use_cache=True, **kwargs)
    cache = getattr(out, models.cache_argument(model) or "cache", None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None
    return out, cache, inverse


def encode_queries(model, query_responses: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                   length: int, **kwargs):
    """`encode_distinct`, the cache rows then selected: (output for the U distinct queries, key/value cache with
    one row per input row, inverse (B,)), or None when the model returns no cache."""
    encoded = encode_distinct(model, query_responses, attention_mask, position_ids, length, **kwargs)
    if encoded is not None:
        encoded[1].batch_select_indices(encoded[2])
    return encoded


def fork_cache(cache):
    """A second cache over the same key/value tensors, or None. A forward extends the cache it is given and
    `batch_select_indices` selects in place; DynamicCache's full-attention and sliding-window layers do both by
    replacing their tensors, never writing into them, so shallow copies of the layers change independently.
    Other caches (static, quantized, linear-attention or shared layers) write in place or hold more: None."""
    if type(cache) is not DynamicCache or any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)
                                              for layer in cache.layers):
        return None
    fork = copy.copy(cache)
    fork.layers = [copy.copy(layer) for layer in cache.layers]
    return fork


def shared_forward(model, query_responses: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                   context_length: int, **query_kwargs):
    """Queries once, then every row's response on its query's cache rows. Returns (query output (U, ...),
    response output (B, ...), inverse (B,)), or None when the model returns no cache (run it plainly)."""
    encoded = encode_queries(model, query_responses, attention_mask, position_ids, context_length, **query_kwargs)
    if encoded is None:
        return None
    query_out, cache, inverse = encoded
    responses = query_responses[:, context_length:].masked_fill(attention_mask[:, context_length:] == 0, 0)
    response_out = model(input_ids=responses, attention_mask=attention_mask, use_cache=True,
                         position_ids=position_ids[:, context_length:], **{models.cache_argument(model): cache})
    return query_out, response_out, inverse


def shared_logits(model, query_responses, attention_mask, position_ids, context_length: int, **query_kwargs):
    """(B, T) -> (B, R, V) logits predicting the response tokens (as policy_common.Forward.logits), or None.
    `query_kwargs` should ask for the last query position's logits only (logits_to_keep=1)."""
    outs = shared_forward(model, query_responses, attention_mask, position_ids, context_length, **query_kwargs)
    if outs is None:
        return None
    query_out, response_out, inverse = outs
    return torch.cat([query_out.logits[:, -1:][inverse], response_out.logits[:, :-1]], 1)


def split_logits(model, query_responses, attention_mask, position_ids, context_length: int, n: int, **query_kwargs):
    """`shared_logits` (B, T) -> (B, R, V) with a gradient for rows 0..n-1 only (0 < n < B), or None (run it
    plainly). Each distinct query is encoded once, with gradient; rows n..B-1's responses run first, under no_grad,
    on a fork of that cache (`fork_cache`), so nothing of them is kept for the backward; then rows 0..n-1's
    responses run on the cache itself, with gradient (it flows into the queries' keys and values). None also when
    the cache cannot be forked."""
    encoded = encode_distinct(model, query_responses, attention_mask, position_ids, context_length, **query_kwargs)
    fork = None if encoded is None else fork_cache(encoded[1])
    if fork is None:
        return None
    query_out, cache, inverse = encoded
    responses = query_responses[:, context_length:].masked_fill(attention_mask[:, context_length:] == 0, 0)

    def run(rows: slice, rows_cache):  # -> (rows, R, V) logits of these rows, on their queries' cache rows
        rows_cache.batch_select_indices(inverse[rows])
        out = model(input_ids=responses[rows], attention_mask=attention_mask[rows], use_cache=True,
                    position_ids=position_ids[rows, context_length:], **{models.cache_argument(model): rows_cache})
        return torch.cat([query_out.logits[inverse[rows], -1:], out.logits[:, :-1]], 1)

    with torch.no_grad():
        other_logits = run(slice(n, None), fork)
    del fork  # its keys/values, extended by the responses, go before the pass with gradient
    return torch.cat([run(slice(0, n), cache), other_logits])


def shared_hidden(backbone, query_responses, attention_mask, position_ids, context_length: int):
    """(B, T) -> (B, T, H) last hidden states of a transformer backbone (for reward and value heads), or None."""
    outs = shared_forward(backbone, query_responses, attention_mask, position_ids, context_length)
    if outs is None:
        return None
    query_out, response_out, inverse = outs
    return torch.cat([query_out.last_hidden_state[inverse], response_out.last_hidden_state], 1)


def generation_cache(model, queries: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                     cache=None, **kwargs) -> dict:
    """Prefill for `generate` on repeated queries (B, Lq): every distinct query but its last token encoded once;
    returns generate's extra keyword arguments ({models.cache_argument(model): ...}, or {} when the model keeps no
    cache).
    `cache`: an empty cache the distinct queries are encoded into (a StaticCache: the model's own layers write it);
    None: the DynamicCache the forward makes. Its rows are then repeated for every row by `reorder_cache`, beam
    search's row selection, which static layers have too."""
    encoded = encode_distinct(model, queries, attention_mask, position_ids, queries.shape[1] - 1,
                              **({} if cache is None else {models.cache_argument(model): cache}), **kwargs)
    if encoded is None:
        return {}
    encoded[1].reorder_cache(encoded[2])
    return {models.cache_argument(model): encoded[1]}


# ---- The forwards that share prompts (forwards.py chooses them)
class SharedPromptForward(pc.Forward):
    """policy_common.Forward with each distinct query of a batch encoded once (`shared_logits`; with `grad_rows`,
    `split_logits`), in training forwards and in generation's prefill (`generation_cache`); a model that keeps no
    cache here (activation checkpointing while training) runs plainly."""

    shares_prompts = True

    def unshared(self) -> pc.Forward:
        return pc.Forward(self.pad_token_id, self.temperature, self.masked_token_ids)

    def outputs(self, model, query_responses, context_length, grad_rows=None, hidden=False, images=None):
        vision.require_no_images(images, "prompt sharing")  # forwards.py does not choose it for images
        if not hidden and query_responses.shape[1] > context_length and takes_cache(models.unwrap(model)):
            attention_mask, position_ids = pc.padding_inputs(query_responses, self.pad_token_id)
            if grad_rows is not None and 0 < grad_rows < len(query_responses):
                logits = split_logits(model, query_responses, attention_mask, position_ids, context_length, grad_rows,
                                      **models.keep_last(model, 1))
            else:
                logits = shared_logits(model, query_responses, attention_mask, position_ids, context_length,
                                       **models.keep_last(model, 1))
            if logits is not None:
                return logits
        return super().outputs(model, query_responses, context_length, grad_rows, hidden)

    def prefill(self, model, queries, attention_mask, position_ids, cache=None) -> dict:
        if not takes_cache(model):
            return super().prefill(model, queries, attention_mask, position_ids, cache)
        return generation_cache(model, queries, attention_mask, position_ids, cache, **models.keep_last(model, 1))


class SharedPromptScalarForward(pc.ScalarForward):
    """policy_common.ScalarForward with each distinct query of a batch encoded once (`shared_hidden`)."""

    shares_prompts = True

    def unshared(self) -> pc.ScalarForward:
        return pc.ScalarForward(self.pad_token_id)

    def hidden(self, backbone, query_responses, context_length):
        if 0 < context_length < query_responses.shape[1] and takes_cache(backbone):
            attention_mask, position_ids = pc.padding_inputs(query_responses, self.pad_token_id)
            hidden = shared_hidden(backbone, query_responses, attention_mask, position_ids, context_length)
            if hidden is not None:
                return hidden
        return super().hidden(backbone, query_responses, context_length)
