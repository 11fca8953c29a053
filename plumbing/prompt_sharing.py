"""Encode a prompt that several rows repeat only once: the optional fast path behind policy_common's forwards.

RLOO's k samples of a prompt, DPO's chosen and rejected completions and KTO's own and mismatched completions
repeat one prompt over several rows. Instead of running every row's prompt tokens, each distinct prompt runs
once with a key/value cache, the cache rows are selected for every sequence, and only the response tokens run
on top. The numbers are those of one full forward (to float rounding; tests/test_policy_common.py checks
log-probs, rewards and gradients against the obvious per-row computation for GPT-NeoX, Llama and LoRA models).

`split_logits` scores some rows without gradient on a fork of the encoded queries' cache (KTO's mismatched
completions): nothing of them is kept for the backward.

How to use it: the CALLER decides, once, from sizes that are the same on every process (`worth_sharing`), and
passes `share_prompts=True` to policy_common's forwards. Nothing here keeps state or talks to other processes:
under DDP, DeepSpeed ZeRO-3 or FSDP every process must make the same model calls, and a decision taken from one
process's own data could differ between processes. A model whose forward takes no cache argument (`cache` from
transformers 5.20 on, `past_key_values` before), or that returns no cache, is run plainly (a property of the model
code, the same on every process).

Shapes: B rows, T = Lq + R positions; rows are [left pads | query | response | right pads]; `attention_mask` and
`position_ids` are those of policy_common.padding_inputs (positions count real tokens only).
"""

import copy
import functools
import inspect
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from plumbing import models, packing

# Sharing costs one more model call: on small models that costs more than the prompt positions it saves.
MIN_SAVED_FRACTION = 0.2  # of all input positions
MIN_SAVED_POSITIONS = 128


@dataclass
class PromptSharingFlags:
    """Prompt sharing (the scripts whose rows repeat a prompt: rloo, grpo, dpo, kto, reward)."""
    share_prompts: bool = True
    """encode a prompt repeated over rows once when that saves enough (prompt_sharing.py; the same numbers)"""


def worth_sharing(rows: int, rows_per_prompt: int, prompt_length: int, response_length: int) -> bool:
    """Does encoding each prompt once save enough? `rows` per model call, each prompt repeated `rows_per_prompt`
    times, prompts of up to `prompt_length` tokens followed by up to `response_length`. Give sizes that are the
    same on every process (flags, not the data), so that every process takes the same decision."""
    if rows_per_prompt < 2 or prompt_length == 0 or response_length == 0:
        return False
    if packing.enabled():  # packed, a shared prompt costs no extra call (packing.py)
        return True
    saved = (rows - rows // rows_per_prompt) * prompt_length
    return saved >= max(MIN_SAVED_FRACTION * rows * (prompt_length + response_length), MIN_SAVED_POSITIONS)


@functools.lru_cache(maxsize=None)
def _parameter_names(forward) -> frozenset:
    return frozenset(inspect.signature(forward).parameters)


def forward_parameters(model) -> frozenset:
    """Names of the arguments the model's own forward takes (wrappers and a PEFT adapter looked through); read once
    per forward function."""
    inner = models.unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT
    return _parameter_names(getattr(inner.forward, "__func__", inner.forward))


def cache_argument(model):
    """The name under which the model's forward takes and returns its key/value cache: `cache` (transformers
    >= 5.20) or `past_key_values` (earlier releases, and vLLM's 5.19 pin); None when it takes none."""
    parameters = forward_parameters(model)
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def takes_cache(model) -> bool:
    """The model's forward accepts a key/value cache and keeps one (not while training with activation
    checkpointing, which drops it)."""
    if cache_argument(model) is None:
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
    cache = getattr(out, cache_argument(model) or "cache", None)
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
                         position_ids=position_ids[:, context_length:], **{cache_argument(model): cache})
    return query_out, response_out, inverse


def shared_logits(model, query_responses, attention_mask, position_ids, context_length: int, **query_kwargs):
    """(B, T) -> (B, R, V) logits predicting the response tokens (as policy_common.forward_logits), or None.
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
                    position_ids=position_ids[rows, context_length:], **{cache_argument(model): rows_cache})
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
    returns generate's extra keyword arguments ({cache_argument(model): ...}, or {} when the model keeps no cache).
    `cache`: an empty cache the distinct queries are encoded into (a StaticCache: the model's own layers write it);
    None: the DynamicCache the forward makes. Its rows are then repeated for every row by `reorder_cache`, beam
    search's row selection, which static layers have too."""
    encoded = encode_distinct(model, queries, attention_mask, position_ids, queries.shape[1] - 1,
                              **({} if cache is None else {cache_argument(model): cache}), **kwargs)
    if encoded is None:
        return {}
    encoded[1].reorder_cache(encoded[2])
    return {cache_argument(model): encoded[1]}
