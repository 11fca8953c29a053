"""The model helpers every algorithm script uses: the forward that scores rows of [query | response] (log-probs, the
whole next-token distribution, per-token results of it), the reference model, generation, small tensor utilities.
Nothing algorithm-specific, nothing about runs. Loading models by name: plumbing/models.py.

The forwards here are the plain ones: each row whole, padding included, the output layer over every response position
at once. plumbing/forwards.py chooses, once per model at setup, the forward a run uses, maybe a faster one with the
same numbers to float rounding (a prompt repeated over rows encoded once: prompt_sharing.py; rows packed without
padding: packing.py; the output layer a chunk of positions at a time: chunked_head.py), each a subclass of these.

Conventions used throughout (shapes in docstrings use these names):
  B  batch size            Lq  query (prompt) length, LEFT-padded with pad_token_id
  R  response length       T = Lq + R, a `query_response` row is [left pads | query | response | right pads]
  V  vocabulary size       H  hidden size
The pad token is always distinct from EOS, so `ids != pad_token_id` is the attention mask. A response keeps its first
EOS and everything after it is pad. Model names are hub ids or local folders (aliases: run_utils.resolve_model)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing import models, vision
from plumbing.errors import UserError

PADDING_LOGPROB = 0.0  # log-prob written at response positions after EOS (always masked out downstream)


# ---- The forward of a causal LM over [query | response] rows
class Forward:
    """How a causal LM scores rows of [left-padded query | response]: its output at the positions that predict the
    response tokens (`outputs`), the logits / temperature there with the pad token (and `masked_token_ids`: a VLM's
    image tokens) masked, the distribution sampling draws from (`logits`), per-token results of them (`map_logits`),
    the response tokens' log-probs (`logprobs`). Temperature is applied here and only here. This is the plain forward;
    plumbing/forwards.py builds, once per model, the forward a run uses, for one model (and its wrappers)."""

    shares_prompts = False  # rows that repeat a query encode it once (prompt_sharing.py, packing.py)

    def __init__(self, pad_token_id: int, temperature: float = 1.0, masked_token_ids: tuple = ()):
        self.pad_token_id, self.temperature, self.masked_token_ids = pad_token_id, temperature, masked_token_ids

    def unshared(self) -> "Forward":
        """This forward for rows that repeat no prompt (evaluation's held-out prompts): prompt sharing off."""
        return self

    def chunked(self, model: nn.Module, positions: int) -> bool:
        """Does `map_logits` run the output layer a chunk of positions at a time for this many (chunked_head.py)?"""
        return False

    def outputs(self, model: nn.Module, query_responses: torch.Tensor, context_length: int,
                grad_rows: Optional[int] = None, hidden: bool = False, images=None) -> torch.Tensor:
        """(B, T) ids -> (B, R, X) the model's output at the positions that predict the response tokens
        query_responses[:, context_length:]: X = V logits (the output layer on those positions only), or with `hidden`
        H last hidden states. `grad_rows=n` (0 < n < B): only rows 0..n-1 get a gradient, nothing of the others is kept
        for the backward. `images`: the rows' image inputs (vision.py) or None. Here one forward over full rows
        (positions count real tokens only: `padding_inputs`), or with `grad_rows` two, the second without gradient."""
        if hidden:  # the output layer hands back its input
            with models.hidden_instead_of_logits(model):
                return self.outputs(model, query_responses, context_length, grad_rows, images=images)
        R = query_responses.shape[1] - context_length
        attention_mask, position_ids = padding_inputs(query_responses, self.pad_token_id)

        def plain(rows: slice):  # (rows, R, X): one forward over full rows, the output layer on the response positions
            input_ids = query_responses[rows].masked_fill(attention_mask[rows] == 0, 0)  # pad ids: maybe no embedding
            out = model(input_ids=input_ids, attention_mask=attention_mask[rows], use_cache=False,
                        **models.keep_last(model, R + 1), **vision.model_inputs(  # positions: ours or, images, its own
                            vision.row_images(images, rows), input_ids.device, model, input_ids, position_ids[rows]))
            return out.logits[:, -(R + 1):-1]

        if grad_rows is None or not 0 < grad_rows < len(query_responses):
            return plain(slice(None))
        logits = plain(slice(0, grad_rows))
        with torch.no_grad():
            other_logits = plain(slice(grad_rows, None))
        return torch.cat([logits, other_logits])

    def scaled(self, logits: torch.Tensor, mask_pad: bool = True) -> torch.Tensor:
        """(..., V) logits -> logits / temperature, pad and `masked_token_ids` masked (`mask_pad_`, with `mask_pad`)."""
        logits = logits / self.temperature if self.temperature != 1.0 else logits
        for token in (self.pad_token_id, *self.masked_token_ids) if mask_pad else ():
            logits = mask_pad_(logits, token)
        return logits

    def head_logits(self, model: nn.Module, hidden: torch.Tensor, mask_pad: bool = True) -> torch.Tensor:
        """(n, H) last hidden states -> (n, V) `scaled` logits: the output layer run apart from the forward, the
        distribution `logits` gives for the same positions."""
        return self.scaled(models.output_layer(model)(hidden), mask_pad)

    def logits(self, model: nn.Module, query_responses: torch.Tensor, context_length: int, *, mask_pad: bool = True,
               grad_rows: Optional[int] = None, images=None) -> torch.Tensor:
        """(B, T) ids -> (B, R, V) logits / temperature that predict the response tokens, the pad token masked
        (`mask_pad_`): the whole next-token distribution at each response position, with gradient unless called under
        no_grad (a term over the vocabulary: a KL to the reference's `Reference.logits`, a divergence to a teacher).
        `mask_pad=False` keeps the full softmax (SFT's maximum likelihood over the vocabulary)."""
        return self.scaled(self.outputs(model, query_responses, context_length, grad_rows, images=images), mask_pad)

    def map_logits(self, model: nn.Module, query_responses: torch.Tensor, context_length: int, fn: Callable,
                   *extra: torch.Tensor, mask_pad: bool = True, grad_rows: Optional[int] = None, images=None) -> tuple:
        """fn(logits (n, V), *extra (n, ...)) -> tuple of (n, ...) per-token results, for `logits` at the B x R
        response positions and `extra` (B, R, ...) tensors taken alongside (the tokens, say): returns the tuple shaped
        (B, R, ...). chunked_head.py: the same numbers a chunk of positions at a time, at the memory of one chunk's."""
        B, R = query_responses.shape[0], query_responses.shape[1] - context_length
        flat = [e.reshape(B * R, *e.shape[2:]) for e in extra]
        logits = self.logits(model, query_responses, context_length, mask_pad=mask_pad, grad_rows=grad_rows,
                             images=images)
        results = fn(logits.reshape(B * R, -1), *flat)
        return tuple(r.reshape(B, R, *r.shape[1:]) for r in results)

    def logprobs(self, model: nn.Module, query_responses: torch.Tensor, context_length: int, *, entropy: bool = False,
                 entropy_grad: bool = False, mask_pad: bool = True, grad_rows: Optional[int] = None, images=None):
        """(B, T) ids -> (B, R) log-probs of the response tokens under logits / temperature, with gradient unless
        called under no_grad; with `entropy` ((B, R) log-probs, (B, R) entropy at each response position, without
        gradient unless `entropy_grad`: an entropy bonus). Positions holding pad carry meaningless values: mask them
        with `responses != pad_token_id`."""
        fn = _logprobs_and_entropy_with_grad if entropy_grad else _logprobs_and_entropy
        results = self.map_logits(model, query_responses, context_length,
                                  fn if entropy else lambda *a: (selective_logprobs(*a),),
                                  query_responses[:, context_length:], mask_pad=mask_pad, grad_rows=grad_rows,
                                  images=images)
        return results if entropy else results[0]

    @torch.no_grad()
    def logprobs_no_grad(self, model: nn.Module, query_responses: torch.Tensor, context_length: int, *,
                         chunk_size: Optional[int] = None, entropy: bool = False, images=None):
        """`logprobs` without gradient, `chunk_size` rows per forward (all by default): a whole rollout batch scored
        with one chunk's activations alive at a time (reference log-probs, samples that did not come from
        `batch_generation`, old log-probs after the weights moved)."""
        chunk_size = chunk_size or query_responses.shape[0]
        results = [self.logprobs(model, query_responses[i:i + chunk_size], context_length, entropy=entropy,
                                 images=vision.row_images(images, slice(i, i + chunk_size)))
                   for i in range(0, query_responses.shape[0], chunk_size)]
        if not entropy:
            return torch.cat(results)
        return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])

    def prefill(self, model: nn.Module, queries: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, cache=None) -> dict:
        """`generate`'s extra keyword arguments for the queries (B, Lq): an empty `cache` (a StaticCache) given under
        the model's cache argument, or nothing; prompt_sharing.py encodes each distinct query into it first."""
        return {} if cache is None else {models.cache_argument(model): cache}


class ScalarForward:
    """How a sequence classifier (a reward or value model: a backbone under a `score` head) scores rows of
    [query | response]: the head at every position (`values`) or at each row's last real token (`rewards`). The
    backbone and the head run directly, so that every position is read; called inside a prepared wrapper's forward,
    gradients still sync. This is the plain forward; plumbing/forwards.py builds, once per model, the one a run uses."""

    shares_prompts = False

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def unshared(self) -> "ScalarForward":
        """This forward for rows that repeat no prompt: prompt sharing off."""
        return self

    def hidden(self, backbone: nn.Module, query_responses: torch.Tensor, context_length: int) -> torch.Tensor:
        """(B, T) ids -> (B, T, H) the backbone's last hidden states, padding-safe."""
        attention_mask, position_ids = padding_inputs(query_responses, self.pad_token_id)
        return backbone(input_ids=query_responses.masked_fill(attention_mask == 0, 0), attention_mask=attention_mask,
                        position_ids=position_ids, use_cache=False).last_hidden_state

    def values(self, model: nn.Module, query_responses: torch.Tensor, context_length: int = 0) -> torch.Tensor:
        """(B, T) ids -> (B, T) the score head's output at every position (a value model's values)."""
        base = models.unwrap(model)
        hidden = self.hidden(getattr(base, base.base_model_prefix), query_responses, context_length)
        return base.score(hidden).squeeze(-1)

    def rewards(self, model: nn.Module, query_responses: torch.Tensor, context_length: int = 0) -> torch.Tensor:
        """(B, T) ids -> (B,) the score read at each row's last real token (a reward model's score)."""
        values = self.values(model, query_responses, context_length)
        last = last_token_index(query_responses != self.pad_token_id)
        return values[torch.arange(values.shape[0], device=values.device), last]


@dataclass
class ReferenceFlags:
    """The frozen reference policy (`create_reference`)."""
    ref_model: Optional[str] = None
    """frozen reference policy; None = the starting policy (the adapter-off base with --use_peft)"""


# ---- Reference model: one interface for the three modes
class Reference:
    """The frozen reference policy pi_ref, in one of three modes:

    - "copy":        a separate frozen model (eval mode, requires_grad False, never in an optimizer).
    - "adapter_off": the policy's own base weights with its LoRA adapter switched off (no second copy).
    - "none":        reference-free; `logprobs` returns zeros.

    Scored without gradient by `forward`, the forward chosen for the model it runs."""

    def __init__(self, mode: str, forward: Optional[Forward] = None, model: Optional[nn.Module] = None,
                 policy: Optional[nn.Module] = None):
        assert mode in ("copy", "adapter_off", "none"), mode
        self.mode, self.forward, self.model, self.policy = mode, forward, model, policy
        if mode == "copy":
            model.eval()
            model.requires_grad_(False)

    @contextlib.contextmanager
    def _model(self):
        if self.mode == "copy":
            yield self.model
        else:
            with models.unwrap(self.policy).disable_adapter():
                yield self.policy

    def logprobs(self, query_responses: torch.Tensor, context_length: int, chunk_size: Optional[int] = None,
                 images=None):
        """(B, T) ids (and the rows' image inputs) -> (B, R) reference log-probs of the response tokens, `chunk_size`
        rows per forward (all at once by default), no gradient."""
        if self.mode == "none":
            return torch.zeros(query_responses.shape[0], query_responses.shape[1] - context_length,
                               device=query_responses.device)
        with self._model() as model:
            return self.forward.logprobs_no_grad(model, query_responses, context_length, chunk_size=chunk_size,
                                                 images=images)

    @torch.no_grad()
    def logits(self, query_responses: torch.Tensor, context_length: int, images=None) -> torch.Tensor:
        """(B, T) ids -> (B, R, V) the reference's logits / temperature at the response positions, the pad token
        masked, no gradient: its whole next-token distribution (`Forward.logits`), for a term over the vocabulary."""
        if self.mode == "none":
            raise UserError("a reference-free run (--reference_free) has no reference distribution")
        with self._model() as model:
            return self.forward.logits(model, query_responses, context_length, images=images)

    def unshared(self) -> "Reference":
        """This reference for rows that repeat no prompt (evaluation's): its forward without prompt sharing."""
        twin = copy.copy(self)
        twin.forward = None if self.forward is None else self.forward.unshared()
        return twin

    def free(self) -> None:
        """Drop the frozen copy (e.g. after precomputing reference log-probs); later calls are an error."""
        self.model, self.mode = None, "freed"


def create_reference(policy: nn.Module, tokenizer, forward_for: Callable[[nn.Module], Forward], *, policy_name: str,
                     ref_model: Optional[str] = None, use_peft: bool = False, reference_free: bool = False,
                     accelerator=None, precision=models.FP32, trust_remote_code: bool = False) -> Reference:
    """Build the Reference for a run from `--ref_model`: `reference_free` -> none; `ref_model=None` means "the
    starting policy": with `use_peft` its adapter-off base (no copy), otherwise a frozen copy of `policy_name`
    (the model the policy was loaded from). A given `ref_model` must share the policy's vocabulary. A frozen
    copy is prepared for the accelerator (under DeepSpeed ZeRO-3 as a sharded inference engine).
    `forward_for(model)`: the forward chosen for the model the reference runs (forwards.Forwards.lm)."""
    if reference_free:
        return Reference("none")
    if ref_model is None:
        if use_peft:
            return Reference("adapter_off", forward_for(policy), policy=policy)
        ref_model = policy_name
    else:
        models.check_same_vocab(tokenizer, models.load_tokenizer(ref_model, trust_remote_code=trust_remote_code),
                                "reference model")
    model = models.load_causal_lm(ref_model, tokenizer, precision, trust_remote_code=trust_remote_code)
    model.eval().requires_grad_(False)
    if accelerator is not None:
        model = models.prepare_frozen(model, accelerator)
    return Reference("copy", forward_for(model), model=model)  # its forward chosen where it runs


# ---- Generation
def make_generation_config(tokenizer, max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
                           min_new_tokens: Optional[int] = None, cache_implementation: Optional[str] = None,
                           suppress: Sequence[int] = ()):
    """Sampling config for training (pure temperature sampling: top_k=0, top_p=1.0) or, with `greedy=True`, the
    deterministic config used for evaluation. pad/eos ids come from the tokenizer; the pad token (and `suppress`, the
    forward's masked_token_ids) is never generated. cache_implementation: GenerationFlags'; "static": never compiled."""
    from transformers import GenerationConfig

    if not greedy and temperature <= 0:
        raise UserError(f"temperature must be > 0 for sampling, got {temperature}")
    # pad is never a valid output: a sampled pad would read as padding everywhere downstream
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  suppress_tokens=[tokenizer.pad_token_id, *suppress])
    if min_new_tokens:
        kwargs["min_new_tokens"] = min_new_tokens
    if cache_implementation not in (None, "dynamic"):  # a new prompt length each batch would compile again each time
        kwargs.update(cache_implementation=cache_implementation, disable_compile=True)
    if greedy:
        return GenerationConfig(do_sample=False, **kwargs)
    return GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, **kwargs)


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


@torch.no_grad()
def batch_generation(model: nn.Module, queries: torch.Tensor, pad_token_id: int, eos_token_id: int,
                     generation_config, chunk_size: int, accelerator=None, forward: Optional[Forward] = None,
                     return_entropy: bool = False, images=None):
    """Generate responses for a batch of queries (B, Lq), LEFT-padded, `chunk_size` rows at a time. Returns
    (query_responses, logprobs), or (query_responses, logprobs, entropy) with `return_entropy`:
      query_responses (B, Lq + max_new_tokens): query then response, pad after the first EOS (kept) and to the end.
      logprobs (B, max_new_tokens): log-probs of the sampled tokens under the sampling distribution (logits /
        temperature, pad suppressed), PADDING_LOGPROB after EOS: a fresh `Forward.logprobs` to float rounding, so
        while the weights have not changed since sampling they are the old log-probs (no forward needed).
      entropy (B, max_new_tokens): entropy of that distribution at each response position, 0 after EOS.
    Only our config applies: the model's own sampling defaults are ignored (`models.no_sampling_defaults`).
    `forward`: the model's chosen forward, which fills generate's cache before it starts (`Forward.prefill`: each
    distinct query encoded once where it shares prompts, e.g. RLOO's k samples); None: generate's own prefill.
    `images`: the rows' image inputs (vision.py), or None. cache_implementation "static": a StaticCache of Lq + R
    positions per chunk, made here (generate's own would be as long as the longest it ever made)."""
    from transformers import StaticCache

    R = generation_config.max_new_tokens
    generation_config = copy.deepcopy(generation_config)
    generation_config.return_dict_in_generate = True
    responses, logprobs, entropies = [], [], []
    forward = forward or Forward(pad_token_id)
    with models.unwrap_for_generation(model, accelerator) as gen_model, models.no_sampling_defaults(gen_model):
        static = generation_config.cache_implementation == "static" and models.cache_argument(gen_model)
        if static:  # the cache argument's name: generate is given the cache itself
            generation_config.cache_implementation = None
        for i in range(0, queries.shape[0], chunk_size):
            query = queries[i:i + chunk_size]
            attention_mask, position_ids = padding_inputs(query, pad_token_id)
            cache = (StaticCache(config=gen_model.config.get_text_config(decoder=True),
                                 max_cache_len=query.shape[1] + R) if static else None)
            prefill = forward.prefill(gen_model, query, attention_mask, position_ids, cache)
            sampled = SampledTokenStats(generation_config, return_entropy)
            out = gen_model.generate(input_ids=query, attention_mask=attention_mask,
                                     generation_config=generation_config, logits_processor=[sampled], **prefill,
                                     **vision.model_inputs(vision.row_images(images, slice(i, i + chunk_size)),
                                                           query.device, gen_model, query))
            response = out.sequences[:, query.shape[1]:]
            logprob, entropy = sampled.finish(response[:, -1])  # (b, r), r <= R
            if return_entropy:
                entropies.append(F.pad(entropy, (0, R - response.shape[1])))
            responses.append(F.pad(response, (0, R - response.shape[1]), value=pad_token_id))
            logprobs.append(F.pad(logprob, (0, R - logprob.shape[1]), value=PADDING_LOGPROB))
    responses = truncate_after_eos(torch.cat(responses), eos_token_id, pad_token_id)
    logprobs = torch.cat(logprobs).masked_fill(responses == pad_token_id, PADDING_LOGPROB).nan_to_num(PADDING_LOGPROB)
    if return_entropy:
        return (torch.cat([queries, responses], 1), logprobs,
                torch.cat(entropies).masked_fill(responses == pad_token_id, 0.0))
    return torch.cat([queries, responses], 1), logprobs


# ---- Forward passes: padding-safe inputs, the pad token masked, log-probs and entropy from logits
def padding_inputs(query_responses: torch.Tensor, pad_token_id: int):
    """attention_mask and position_ids for rows with left-padded queries and right-padded responses:
    positions count real tokens only, so a row's logits do not depend on how much padding surrounds it."""
    attention_mask = (query_responses != pad_token_id).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return attention_mask, position_ids


def mask_pad_(logits: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Give the pad token no probability, in place: (..., V) logits -> the same tensor with logits[..., pad] set 1e4
    below the largest logit at that position. Sampling never emits pad (make_generation_config suppresses it), so every
    forward scores the distribution sampled, p(token) / (1 - p(pad)), reference included. exp(-1e4) is exactly 0 in
    every float format; a log-prob read at a pad position (masked out downstream) stays finite, near -1e4, whose
    square, exponential or product with 0 is no NaN. In place: no memory; the pad logit then gets no gradient."""
    if 0 <= pad_token_id < logits.shape[-1]:
        logits[..., pad_token_id] = logits.detach().amax(-1) - 1e4
    return logits


def selective_logprobs(logits: torch.Tensor, tokens: torch.Tensor, chunk_bytes: int = 2**25) -> torch.Tensor:
    """(..., V) logits, (...) tokens -> (...) log softmax(logits)[token]. Rows are processed in chunks of at
    most `chunk_bytes` of float32 log-softmax work (32 MiB by default), so a full-batch (B, R, V) log-softmax is
    never materialised at real vocabulary sizes, while small batches go in one vectorised call."""
    rows = max(1, chunk_bytes // (4 * logits[0].numel()))
    token_logits = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        logsumexp = torch.cat([torch.logsumexp(logits[i:i + rows], dim=-1) for i in range(0, len(logits), rows)])
        return token_logits - logsumexp
    # low precision: logsumexp in bf16 is inaccurate, so compute the log-softmax in float32
    return torch.cat([torch.gather(logits[i:i + rows].float().log_softmax(-1), -1, tokens[i:i + rows, ..., None])
                      [..., 0] for i in range(0, len(logits), rows)])


def entropy_from_logits(logits: torch.Tensor, chunk_bytes: int = 2**25) -> torch.Tensor:
    """(B, R, V) -> (B, R) entropy of softmax(logits), in row chunks as `selective_logprobs` without gradient."""
    rows = max(1, chunk_bytes // (4 * logits[0].numel()))
    chunks = (logits[i:i + rows].float() for i in range(0, len(logits), rows))
    return torch.cat([torch.logsumexp(chunk, -1) - (chunk.softmax(-1) * chunk).sum(-1) for chunk in chunks])


def _logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor):  # Forward.logprobs' fn: (n, V), (n,) ->
    with torch.no_grad():                                                  # ((n,) log-probs, (n,) entropy, no grad)
        entropy = entropy_from_logits(logits.detach())
    return selective_logprobs(logits, tokens), entropy


def _logprobs_and_entropy_with_grad(logits: torch.Tensor, tokens: torch.Tensor):  # the same, entropy with gradient
    return selective_logprobs(logits, tokens), entropy_from_logits(logits)           # (an entropy bonus in the loss)


# ---- Small tensor utilities
def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """(B, L) bool -> (B,) index of the first True in each row, or L when a row has none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool mask of real tokens -> (B,) index of the last True (0 for an all-False row)."""
    return (mask.shape[1] - 1 - first_true_indices(mask.flip(1))).clamp(min=0)


def truncate_after_eos(responses: torch.Tensor, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """(B, R) -> (B, R): keep each row up to and including its first EOS, pad everything after it."""
    eos_index = first_true_indices(responses == eos_token_id)
    after_eos = torch.arange(responses.shape[1], device=responses.device).unsqueeze(0) > eos_index.unsqueeze(1)
    return responses.masked_fill(after_eos, pad_token_id)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of `values` where `mask` is True (over all elements, or along `dim`)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(dim) / mask.sum(dim)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` where `mask` is True (Bessel-corrected by default); 0 for fewer than two values (so
    `masked_whiten` maps a single value to 0)."""
    n = mask.sum()
    if n < 2:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return var * n / (n - 1) if unbiased else var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the masked entries; mean added back if not shift_mean."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def exact_div(a: int, b: int, what: str) -> int:
    """a / b as an int, or a UserError that says which batch sizes do not divide."""
    if b <= 0 or a % b != 0:
        raise UserError(f"{what}: {a} is not divisible by {b}")
    return a // b


def pad_sequences(seqs: Sequence[Sequence[int]], pad_token_id: int, side: str) -> torch.Tensor:
    """List of token-id lists -> (B, max_len) tensor, padded on `side` ("left" or "right")."""
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        out[i, cols] = torch.as_tensor(s, dtype=torch.long)
    return out
