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

Used through policy_common.map_response_logits; nothing here knows about algorithms.

Models whose forward changes the output layer's result (Gemma's soft-capping, Cohere's logit scale, Granite's logits
scaling) are recognised from their config and keep the full-logits path (`supported`); any other change is caught by
a check on every forward and stops the run with an error naming the flag.

Under DeepSpeed ZeRO-3 every output-layer call gathers its weight, a collective: every process must make the same
number of calls, so there the chunk count is agreed on (one all-reduce of an integer) and the chunked path is taken
whenever chunking is on.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from plumbing import models
from plumbing.errors import UserError

CHUNK_LOGITS_BYTES = 2**28  # the default chunk: as many positions as make 256 MiB of float32 logits
# config fields of models whose forward transforms the output layer's result (the full-logits path serves them)
TRANSFORMING_CONFIG_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logits_soft_cap",
                              "output_multiplier")


def causal_lm(model: nn.Module) -> nn.Module:
    """The causal LM inside DDP / DeepSpeed / compile wrappers and a PEFT adapter."""
    model = models.unwrap(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def output_layer(model: nn.Module) -> nn.Module:
    """The model's output layer (the LoRA-wrapped one when an adapter targets it)."""
    head = causal_lm(model).get_output_embeddings()
    if head is None:
        raise UserError(f"{type(causal_lm(model)).__name__} has no output layer (get_output_embeddings() is None): "
                        "pass --logprob_chunk_tokens 0")
    return head


def supported(model: nn.Module) -> bool:
    """Does the model's forward return its output layer's result unchanged (as far as its config tells)?"""
    config = causal_lm(model).config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return all(getattr(config, field, None) in (None, 1, 1.0) for field in TRANSFORMING_CONFIG_FIELDS)


def resolve_chunk_tokens(model: nn.Module, chunk_tokens) -> int:
    """--logprob_chunk_tokens for this model: None -> the positions whose float32 logits make CHUNK_LOGITS_BYTES
    (2**26 / vocabulary size: 1,334 at Pythia's 50,304 words, 441 at Qwen's 152,064; never at the toy's 16)."""
    if chunk_tokens is not None:
        return chunk_tokens
    head = output_layer(model)
    vocab = getattr(head, "out_features", None) or causal_lm(model).config.get_text_config().vocab_size
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
    return tokens > chunk_tokens or zero3_partitioned(output_layer(model))


@contextlib.contextmanager
def hidden_instead_of_logits(model: nn.Module):
    """Within the block, the model's forward returns its last hidden states (B, T', H) where it would return logits:
    the output layer hands back its input. Each forward is checked to return that tensor (its storage and shape): a
    model that transforms the output layer's result would otherwise hand out transformed hidden states."""
    base, head = causal_lm(model), output_layer(model)
    returned = []

    def identity(hidden, *args, **kwargs):
        returned.append(hidden)
        return hidden

    def check(module, inputs, output):
        logits = output.logits if hasattr(output, "logits") else output[0]
        # the same storage and shape (DeepSpeed ZeRO-3's module hooks hand back a new tensor object on it)
        if not any(logits.data_ptr() == r.data_ptr() and logits.shape == r.shape for r in returned):
            raise UserError(f"{type(base).__name__}'s forward changes its output layer's result, so log-probs cannot "
                            "be computed in chunks from its hidden states: pass --logprob_chunk_tokens 0")
        returned.clear()

    saved = head.__dict__.get("forward")  # an instance-level forward (accelerate's offload hooks) is restored
    head.forward = identity
    handle = base.register_forward_hook(check)
    try:
        yield
    finally:
        handle.remove()
        if saved is None:
            del head.forward
        else:
            head.forward = saved


def head_logits(model: nn.Module, hidden: torch.Tensor, temperature: float = 1.0, pad_token_id: int = -1,
                mask_pad: bool = True) -> torch.Tensor:
    """(n, H) last hidden states -> (n, V) logits / temperature, the pad token masked as policy_common.mask_pad_
    (with `mask_pad`): the distribution policy_common.forward_logits gives for the same positions."""
    head = output_layer(model)
    logits = head(hidden)
    if temperature != 1.0:
        logits = logits / temperature
    if mask_pad and 0 <= pad_token_id < logits.shape[-1]:
        logits[..., pad_token_id] = logits.detach().amax(-1) - 1e4
    return logits


def map_chunks(model: nn.Module, fn, hidden: torch.Tensor, extra, *, chunk_tokens, temperature: float = 1.0,
               pad_token_id: int = -1, mask_pad: bool = True, grad_positions: Optional[int] = None) -> tuple:
    """hidden (N, H) and extra tensors (N, ...) -> fn(head_logits(chunk of hidden), *chunks of extra) for chunks of
    about `chunk_tokens` positions, concatenated: a tuple of (N, ...) tensors. fn must reduce over the vocabulary and
    return a tuple of per-position tensors. With gradient (grad mode on and the hidden states or the output layer
    requiring it), each chunk is checkpointed: its logits are recomputed in the backward, one chunk at a time. An
    output with a graph that the loss does not use keeps its chunk's recomputed tensors until the backward ends:
    compute such outputs (metrics) under no_grad.
    `grad_positions=n` (0 < n < N): positions n.. carry no gradient, their chunks are computed under no_grad."""
    if grad_positions is not None and 0 < grad_positions < hidden.shape[0]:
        n = grad_positions
        with torch.no_grad():
            other = map_chunks(model, fn, hidden[n:], [e[n:] for e in extra], chunk_tokens=chunk_tokens,
                               temperature=temperature, pad_token_id=pad_token_id, mask_pad=mask_pad)
        first = map_chunks(model, fn, hidden[:n], [e[:n] for e in extra], chunk_tokens=chunk_tokens,
                           temperature=temperature, pad_token_id=pad_token_id, mask_pad=mask_pad)
        return tuple(torch.cat(pair) for pair in zip(first, other))
    head = output_layer(model)
    n_chunks = chunk_count(hidden.shape[0], resolve_chunk_tokens(model, chunk_tokens), head)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))

    def chunk_fn(hidden_chunk, *extra_chunks):
        return tuple(fn(head_logits(model, hidden_chunk, temperature, pad_token_id, mask_pad), *extra_chunks))

    outs = []
    for hidden_chunk, *extra_chunks in zip(hidden.tensor_split(n_chunks), *(e.tensor_split(n_chunks) for e in extra)):
        if grad:
            outs.append(checkpoint(chunk_fn, hidden_chunk, *extra_chunks, use_reentrant=False,
                                   preserve_rng_state=False))
        else:
            outs.append(chunk_fn(hidden_chunk, *extra_chunks))
    return tuple(torch.cat(parts) for parts in zip(*outs))


class SampledTokenStats:
    """A logits processor for `generate` keeping, of each step's sampling distribution, only the sampled token's
    log-prob (and the entropy): (b,) numbers per step, not the (b, V) scores of `output_scores`. It runs before
    generate's warpers, so it applies the config's itself (temperature, top-k, top-p, min-p, typical-p; others are
    refused). The token sampled at step t is read from the inputs of step t + 1; `finish` takes the last one."""

    def __init__(self, generation_config, entropy: bool = False):
        from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper

        c, self.warpers, self.temperature = generation_config, [], 1.0  # in generate's order
        self.entropy, self.logprobs, self.entropies, self.last = entropy, [], [], None
        if not c.do_sample:
            return
        if c.top_h is not None or (c.epsilon_cutoff or 0.0) > 0.0 or (c.eta_cutoff or 0.0) > 0.0:
            raise ValueError("batch_generation does not take top_h, epsilon_cutoff or eta_cutoff")
        self.temperature = 1.0 if c.temperature is None else c.temperature
        self.warpers += [TopKLogitsWarper(c.top_k)] if c.top_k else []
        self.warpers += [TopPLogitsWarper(c.top_p)] if (c.top_p or 1.0) < 1.0 else []
        self.warpers += [MinPLogitsWarper(c.min_p)] if c.min_p is not None else []
        self.warpers += [TypicalLogitsWarper(c.typical_p)] if (c.typical_p or 1.0) < 1.0 else []

    def _take(self, tokens: torch.Tensor) -> None:
        self.logprobs.append(torch.gather(self.last, 1, tokens.unsqueeze(-1)).squeeze(-1))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:
            self._take(input_ids[:, -1])
        warped = scores / self.temperature if self.temperature != 1.0 else scores
        for warper in self.warpers:
            warped = warper(input_ids, warped)
        logprob = warped.float().log_softmax(-1)
        if self.entropy:
            self.entropies.append(-torch.special.xlogy(logprob.exp(), logprob.exp()).sum(-1))
        self.last = logprob
        return scores

    def finish(self, last_tokens: torch.Tensor):  # (b,) last step's tokens -> ((b, r) log-probs, (b, r) entropy)
        self._take(last_tokens)
        self.last = None
        return torch.stack(self.logprobs, 1), torch.stack(self.entropies, 1) if self.entropy else None
