"""The model helpers every algorithm script uses: the reference model, generation, padding-safe forwards and
log-probs, and small tensor utilities. Nothing algorithm-specific, and nothing about runs (arguments, data,
logging, checkpoints). Loading by name: models.py; a repeated prompt encoded once: prompt_sharing.py; the output
layer in chunks of positions: chunked_head.py.

Conventions used throughout (shapes in docstrings use these names):
  B  batch size            Lq  query (prompt) length, LEFT-padded with pad_token_id
  R  response length       T = Lq + R, a `query_response` row is [left pads | query | response | right pads]
  V  vocabulary size
The pad token is always distinct from EOS, so `ids != pad_token_id` is the attention mask. A response keeps
its first EOS and everything after it is pad. Model names here are hub ids or local folders: aliases such as
`toy` are resolved by run_utils.resolve_model before they get here.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing import chunked_head, models, packing, prompt_sharing
from plumbing.errors import UserError

PADDING_LOGPROB = 0.0  # log-prob written at response positions after EOS (always masked out downstream)


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

    `logprobs(...)` has the signature of `response_logprobs` and is always run under no_grad, the output layer on
    `chunk_tokens` positions at a time (`map_response_logits`; 0: all at once)."""

    def __init__(self, mode: str, model: Optional[nn.Module] = None, policy: Optional[nn.Module] = None,
                 chunk_tokens: Optional[int] = 0):
        assert mode in ("copy", "adapter_off", "none"), mode
        self.mode, self.model, self.policy, self.chunk_tokens = mode, model, policy, chunk_tokens
        if mode == "copy":
            model.eval()
            model.requires_grad_(False)

    @contextlib.contextmanager
    def _model(self):
        if self.mode == "copy":
            yield self.model
        else:
            policy = models.unwrap(self.policy)
            with policy.disable_adapter():
                yield self.policy

    def logprobs(self, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                 temperature: float = 1.0, chunk_size: Optional[int] = None, share_prompts: bool = False):
        """No-grad (B, T) ids -> (B, T - context_length) reference log-probs of the response tokens, `chunk_size`
        rows per forward (all at once by default); `share_prompts` as in `forward_logits`."""
        if self.mode == "none":
            return torch.zeros(query_responses.shape[0], query_responses.shape[1] - context_length,
                               device=query_responses.device)
        with self._model() as model:
            return response_logprobs_no_grad(model, query_responses, context_length, pad_token_id, temperature,
                                             chunk_size, share_prompts, chunk_tokens=self.chunk_tokens)

    def free(self) -> None:
        """Drop the frozen copy (e.g. after precomputing reference log-probs); later calls are an error."""
        self.model, self.mode = None, "freed"


def create_reference(policy: nn.Module, tokenizer, *, policy_name: str, ref_model: Optional[str] = None,
                     use_peft: bool = False, reference_free: bool = False, accelerator=None, bf16: bool = False,
                     trust_remote_code: bool = False, chunk_tokens: Optional[int] = 0) -> Reference:
    """Build the Reference for a run from `--ref_model`: `reference_free` -> none; `ref_model=None` means "the
    starting policy": with `use_peft` its adapter-off base (no copy), otherwise a frozen copy of `policy_name`
    (the model the policy was loaded from). A given `ref_model` must share the policy's vocabulary. A frozen
    copy is prepared for the accelerator (under DeepSpeed ZeRO-3 as a sharded inference engine). `chunk_tokens`:
    the --logprob_chunk_tokens of its log-probs."""
    if reference_free:
        return Reference("none")
    if ref_model is None:
        if use_peft:
            return Reference("adapter_off", policy=policy, chunk_tokens=chunk_tokens)
        ref_model = policy_name
    else:
        models.check_same_vocab(tokenizer, models.load_tokenizer(ref_model, trust_remote_code=trust_remote_code),
                                "reference model")
    model = models.load_causal_lm(ref_model, tokenizer, bf16=bf16, trust_remote_code=trust_remote_code)
    model.eval().requires_grad_(False)
    if accelerator is not None:
        model = models.prepare_frozen(model, accelerator)
    return Reference("copy", model=model, chunk_tokens=chunk_tokens)


# ---- Generation
def make_generation_config(tokenizer, max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
                           min_new_tokens: Optional[int] = None, cache_implementation: Optional[str] = None):
    """Sampling config for training (pure temperature sampling: top_k=0, top_p=1.0) or, with `greedy=True`,
    the deterministic config used for evaluation. pad/eos ids come from the tokenizer; the pad token is
    suppressed (never generated). cache_implementation: GenerationFlags'; "static" is never compiled (below)."""
    from transformers import GenerationConfig

    if not greedy and temperature <= 0:
        raise UserError(f"temperature must be > 0 for sampling, got {temperature}")
    # pad is never a valid output: a sampled pad would read as padding everywhere downstream
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  suppress_tokens=[tokenizer.pad_token_id])
    if min_new_tokens:
        kwargs["min_new_tokens"] = min_new_tokens
    if cache_implementation not in (None, "dynamic"):  # a new prompt length each batch would compile again each time
        kwargs.update(cache_implementation=cache_implementation, disable_compile=True)
    if greedy:
        return GenerationConfig(do_sample=False, **kwargs)
    return GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, **kwargs)


@torch.no_grad()
def batch_generation(model: nn.Module, queries: torch.Tensor, pad_token_id: int, eos_token_id: int,
                     generation_config, chunk_size: int, accelerator=None, share_prompts: bool = False,
                     return_entropy: bool = False):
    """Generate responses for a batch of queries (B, Lq), LEFT-padded, `chunk_size` rows at a time. Returns
    (query_responses, logprobs), or (query_responses, logprobs, entropy) with `return_entropy`:
      query_responses (B, Lq + max_new_tokens): query then response, pad after the first EOS (kept) and to the end.
      logprobs (B, max_new_tokens): log-probs of the sampled tokens under the sampling distribution (logits /
        temperature, pad suppressed), PADDING_LOGPROB after EOS: a fresh `response_logprobs` to float rounding, so
        while the weights have not changed since sampling they are the old log-probs (no forward needed).
      entropy (B, max_new_tokens): entropy of that distribution at each response position, 0 after EOS.
    Only our config applies: the model's own sampling defaults are ignored (`models.no_sampling_defaults`).
    With `share_prompts` (rows repeat queries, e.g. RLOO's k samples), each distinct query is encoded once for
    the prefill (prompt_sharing.generation_cache). cache_implementation "static": a StaticCache of Lq + R positions
    per chunk, made here (generate's own would be as long as the longest it ever made).
    """
    from transformers import StaticCache

    R = generation_config.max_new_tokens
    generation_config = copy.deepcopy(generation_config)
    generation_config.return_dict_in_generate = True
    responses, logprobs, entropies = [], [], []
    with models.unwrap_for_generation(model, accelerator) as gen_model, models.no_sampling_defaults(gen_model):
        share_prompts = share_prompts and prompt_sharing.takes_cache(gen_model)
        static = generation_config.cache_implementation == "static" and prompt_sharing.cache_argument(gen_model)
        if static:  # the cache argument's name: generate is given the cache itself
            generation_config.cache_implementation = None
        for i in range(0, queries.shape[0], chunk_size):
            query = queries[i:i + chunk_size]
            attention_mask, position_ids = padding_inputs(query, pad_token_id)
            cache = (StaticCache(config=gen_model.config.get_text_config(decoder=True),
                                 max_cache_len=query.shape[1] + R) if static else None)
            prefill = {static: cache} if static else {}
            if share_prompts:  # the distinct queries but their last token encoded (into `cache`, when static)
                prefill = prompt_sharing.generation_cache(gen_model, query, attention_mask, position_ids, cache,
                                                          **_keep_last(gen_model, 1))
            sampled = chunked_head.SampledTokenStats(generation_config, return_entropy)
            out = gen_model.generate(input_ids=query, attention_mask=attention_mask,
                                     generation_config=generation_config, logits_processor=[sampled], **prefill)
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


# ---- Forward passes: logits and log-probs of response tokens, padding-safe
def padding_inputs(query_responses: torch.Tensor, pad_token_id: int):
    """attention_mask and position_ids for rows with left-padded queries and right-padded responses:
    positions count real tokens only, so a row's logits do not depend on how much padding surrounds it."""
    attention_mask = (query_responses != pad_token_id).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return attention_mask, position_ids


def _keep_last(model: nn.Module, n: int) -> dict:
    """forward kwargs: the output layer on the last `n` positions only, where the forward takes `logits_to_keep`
    (custom code may not): callers slice [:, -n:] either way."""
    return {"logits_to_keep": n} if "logits_to_keep" in prompt_sharing.forward_parameters(model) else {}


def forward_logits(model: nn.Module, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                   temperature: float = 1.0, share_prompts: bool = False, mask_pad: bool = True,
                   grad_rows: Optional[int] = None) -> torch.Tensor:
    """(B, T) ids -> (B, T - context_length, V) logits / temperature that predict the response tokens
    query_responses[:, context_length:], the pad token masked (`mask_pad_`): the distribution sampling draws from.
    Temperature is applied here and only here. Only the response positions go through the output layer. With
    `share_prompts`, rows with identical queries encode the query once (prompt_sharing.py; the same numbers to
    float rounding), decided from sizes the same on every process (prompt_sharing.worth_sharing). `mask_pad=False`
    keeps the full softmax (SFT's maximum likelihood over the vocabulary).
    `grad_rows=n` (0 < n < B): only rows 0..n-1 get a gradient, nothing of the others is kept for the backward (with
    `share_prompts`, they run on a no-grad fork of the shared queries' cache: prompt_sharing.split_logits; else,
    or where the cache cannot be forked, rows 0..n-1 in one plain call and the others in a second, no-grad one)."""
    logits = response_outputs(model, query_responses, context_length, pad_token_id, share_prompts, grad_rows)
    if temperature != 1.0:
        logits = logits / temperature
    return mask_pad_(logits, pad_token_id) if mask_pad else logits


def response_outputs(model: nn.Module, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                     share_prompts: bool = False, grad_rows: Optional[int] = None, hidden: bool = False):
    """(B, T) ids -> (B, T - context_length, X) model output at the positions predicting the response: X = V (logits),
    or with `hidden` H (last hidden states). `share_prompts`, `grad_rows`: as in `forward_logits`. --padding_free:
    packed rows (packing.py), a query shared by rows with `share_prompts`, zeros at positions holding pad."""
    R = query_responses.shape[1] - context_length
    if packing.enabled() and R > 0 and packing.lm_supported(model, pad_token_id):
        return packing.response_outputs(model, query_responses, context_length, pad_token_id, share_prompts,
                                        grad_rows, hidden)
    if hidden:
        with chunked_head.hidden_instead_of_logits(model):
            return response_outputs(model, query_responses, context_length, pad_token_id, share_prompts, grad_rows)
    attention_mask, position_ids = padding_inputs(query_responses, pad_token_id)
    split = grad_rows is not None and 0 < grad_rows < len(query_responses)
    if share_prompts and R > 0 and prompt_sharing.takes_cache(models.unwrap(model)):
        logits = (prompt_sharing.split_logits(model, query_responses, attention_mask, position_ids, context_length,
                                              grad_rows, **_keep_last(model, 1)) if split else
                  prompt_sharing.shared_logits(model, query_responses, attention_mask, position_ids, context_length,
                                               **_keep_last(model, 1)))
        if logits is not None:
            return logits

    def plain(rows: slice):  # (rows, R, X): one forward over full rows, the output layer on the response positions
        input_ids = query_responses[rows].masked_fill(attention_mask[rows] == 0, 0)  # pad ids: maybe no embedding
        out = model(input_ids=input_ids, attention_mask=attention_mask[rows], position_ids=position_ids[rows],
                    use_cache=False, **_keep_last(model, R + 1))
        return out.logits[:, -(R + 1):-1]

    if not split:
        return plain(slice(None))
    logits = plain(slice(0, grad_rows))
    with torch.no_grad():
        other_logits = plain(slice(grad_rows, None))
    return torch.cat([logits, other_logits])


def map_response_logits(model: nn.Module, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                        fn, *extra: torch.Tensor, temperature: float = 1.0, mask_pad: bool = True,
                        share_prompts: bool = False, grad_rows: Optional[int] = None,
                        chunk_tokens: Optional[int] = 0) -> tuple:
    """fn(logits (n, V), *extra (n, ...)) -> tuple of (n, ...) per-token results, for `forward_logits`' logits at
    the B x R response positions and `extra` (B, R, ...) tensors taken alongside (the tokens, say): returns the tuple
    shaped (B, R, ...). With chunking on (`chunk_tokens` None: the default for the vocabulary; 0: off) and more
    positions than a chunk, the output layer runs a chunk at a time (chunked_head.py): the same numbers to rounding,
    at the memory of one chunk's logits. `share_prompts`, `grad_rows`: as in `forward_logits`."""
    B, R = query_responses.shape[0], query_responses.shape[1] - context_length
    flat = [e.reshape(B * R, *e.shape[2:]) for e in extra]
    if not chunked_head.wanted(model, B * R, chunk_tokens):
        logits = forward_logits(model, query_responses, context_length, pad_token_id, temperature, share_prompts,
                                mask_pad, grad_rows)
        results = fn(logits.reshape(B * R, -1), *flat)
    else:
        hidden = response_outputs(model, query_responses, context_length, pad_token_id, share_prompts, grad_rows,
                                  hidden=True)
        results = chunked_head.map_chunks(model, fn, hidden.reshape(B * R, -1), flat, chunk_tokens=chunk_tokens,
                                          temperature=temperature, pad_token_id=pad_token_id, mask_pad=mask_pad,
                                          grad_positions=None if grad_rows is None else grad_rows * R)
    return tuple(r.reshape(B, R, *r.shape[1:]) for r in results)


def mask_pad_(logits: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Give the pad token no probability, in place: (..., V) logits -> the same tensor with logits[..., pad] set
    1e4 below the largest logit at that position. Sampling never emits pad (make_generation_config suppresses it), so
    this makes every forward score the distribution that was sampled, p(token) / (1 - p(pad)), reference included.
    exp(-1e4) is exactly 0 in every float format, so the probabilities are those of -inf; but a log-prob read at a
    pad position (masked out downstream) stays a finite number near -1e4, whose square, exponential or product with
    0 is no NaN. In place on the model's output costs no memory; the pad logit then gets no gradient."""
    if 0 <= pad_token_id < logits.shape[-1]:
        logits[..., pad_token_id] = logits.detach().amax(-1) - 1e4
    return logits


def selective_logprobs(logits: torch.Tensor, tokens: torch.Tensor, chunk_bytes: int = 2**25) -> torch.Tensor:
    """(B, R, V) logits, (B, R) tokens -> (B, R) log softmax(logits)[token]. Rows are processed in chunks of at
    most `chunk_bytes` of float32 log-softmax work (32 MiB by default), so a full-batch (B, R, V) log-softmax is
    never materialised at real vocabulary sizes, while small batches go in one vectorised call."""
    rows = max(1, chunk_bytes // (4 * logits[0].numel()))
    token_logits = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        logsumexp = torch.cat([torch.logsumexp(logits[i:i + rows], dim=-1) for i in range(0, len(logits), rows)])
        return token_logits - logsumexp
    # low precision: logsumexp in bf16 is inaccurate, so compute the log-softmax in float32
    return torch.cat([torch.gather(logits[i:i + rows].float().log_softmax(-1), -1, tokens[i:i + rows, :, None])[..., 0]
                      for i in range(0, len(logits), rows)])


def entropy_from_logits(logits: torch.Tensor, chunk_bytes: int = 2**25) -> torch.Tensor:
    """(B, R, V) -> (B, R) entropy of softmax(logits), in row chunks as `selective_logprobs` without gradient."""
    rows = max(1, chunk_bytes // (4 * logits[0].numel()))
    out = []
    for i in range(0, len(logits), rows):
        chunk = logits[i:i + rows].float()
        out.append(torch.logsumexp(chunk, -1) - (chunk.softmax(-1) * chunk).sum(-1))
    return torch.cat(out)


def _logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor):  # map_response_logits' fn: (n, V), (n,) ->
    with torch.no_grad():                                                  # ((n,) log-probs, (n,) entropy, no grad)
        entropy = entropy_from_logits(logits.detach())
    return selective_logprobs(logits, tokens), entropy


def _logprobs_and_entropy_with_grad(logits: torch.Tensor, tokens: torch.Tensor):  # the same, entropy with gradient
    return selective_logprobs(logits, tokens), entropy_from_logits(logits)           # (an entropy bonus in the loss)


def response_logprobs(model: nn.Module, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                      temperature: float = 1.0, share_prompts: bool = False, grad_rows: Optional[int] = None, *,
                      return_entropy: bool = False, mask_pad: bool = True, chunk_tokens: Optional[int] = 0,
                      entropy_grad: bool = False):
    """(B, T) ids -> (B, T - context_length) log-probs of the response tokens under logits / temperature, or
    ((B, R) log-probs, (B, R) entropy at each response position, without gradient unless `entropy_grad`) with
    `return_entropy` (`share_prompts`, `grad_rows`, `mask_pad`: as in `forward_logits`; `chunk_tokens`:
    `map_response_logits`'s). Positions holding pad carry meaningless values: mask them with
    `responses != pad_token_id`."""
    fn = _logprobs_and_entropy_with_grad if entropy_grad else _logprobs_and_entropy
    results = map_response_logits(model, query_responses, context_length, pad_token_id,
                                  fn if return_entropy else lambda *a: (selective_logprobs(*a),),
                                  query_responses[:, context_length:], temperature=temperature, mask_pad=mask_pad,
                                  share_prompts=share_prompts, grad_rows=grad_rows, chunk_tokens=chunk_tokens)
    return results if return_entropy else results[0]


@torch.no_grad()
def response_logprobs_no_grad(model: nn.Module, query_responses: torch.Tensor, context_length: int,
                              pad_token_id: int, temperature: float = 1.0, chunk_size: Optional[int] = None,
                              share_prompts: bool = False, return_entropy: bool = False,
                              chunk_tokens: Optional[int] = 0):
    """`response_logprobs` without gradient, `chunk_size` rows per forward (all by default): a whole rollout batch
    scored with one chunk's activations alive at a time. For reference log-probs, samples that did not come from
    `batch_generation` (vLLM), or old log-probs after the weights moved.
    Positions holding pad carry meaningless values: mask them with `responses != pad_token_id`."""
    chunk_size = chunk_size or query_responses.shape[0]
    results = [response_logprobs(model, query_responses[i:i + chunk_size], context_length, pad_token_id, temperature,
                                 share_prompts, return_entropy=return_entropy, chunk_tokens=chunk_tokens)
               for i in range(0, query_responses.shape[0], chunk_size)]
    if not return_entropy:
        return torch.cat(results)
    return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])


# ---- Importance weights: completions another policy sampled (vLLM, earlier weights), reweighted in the loss
@dataclass(frozen=True)
class ImportanceSampling:
    """How the loss of another policy's samples is reweighted (TRL 1.16's vllm_importance_sampling_*): `mode` is
    token_* (a ratio per token) or sequence_* (one per completion, from its summed log-ratio), *_truncate (clamped
    into [clip_min, clip_max]) or *_mask (0 outside them); None: no bound on that side. `sampler` names the metrics
    (vllm/..., or async/... for HF samples of earlier weights: --max_staleness)."""
    mode: str = "sequence_mask"
    clip_max: Optional[float] = 3.0
    clip_min: Optional[float] = None
    sampler: str = "vllm"

    @classmethod
    def from_args(cls, args, sampler: str = "vllm") -> "ImportanceSampling":
        """The scripts' --vllm_importance_sampling_* flags."""
        return cls(args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_max,
                   args.vllm_importance_sampling_clip_min, sampler)

    @property
    def per_sequence(self) -> bool:
        return self.mode.startswith("sequence_")

    def outside(self, ratio: torch.Tensor) -> torch.Tensor:
        """Where a ratio lies outside [clip_min, clip_max]."""
        low = -math.inf if self.clip_min is None else self.clip_min
        high = math.inf if self.clip_max is None else self.clip_max
        return (ratio < low) | (ratio > high)


def importance_ratios(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor,
                      per_sequence: bool) -> torch.Tensor:
    """r = pi_old / pi_behaviour of each action, detached: (B, R) per token, or (B, 1) per completion (exp of its summed
    log-ratio, as TRL; not GSPO's mean). A NaN log-ratio (a token the engine could not score) counts as 0, as TRL."""
    mask = response_mask.to(old_logprobs.dtype)
    log_ratio = torch.nan_to_num((old_logprobs - behaviour_logprobs).detach() * mask, nan=0.0)  # (B, R)
    return torch.exp(log_ratio.sum(1, keepdim=True) if per_sequence else log_ratio)


def importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: Optional[torch.Tensor],
                       response_mask: torch.Tensor, sampling: ImportanceSampling, sequence_loss: bool = False):
    """The weight of each action's loss term for completions sampled by pi_behaviour (a vLLM engine, whose kernels
    round otherwise: Yao et al. 2025; or earlier weights, --max_staleness: AReaL's decoupled objective, Fu et al. 2025)
    when the loss is about pi_old (the policy at the start of the step): w = r truncated into [clip_min, clip_max]
    (*_truncate) or r inside them and 0 outside (*_mask), r = `importance_ratios`. old/behaviour_logprobs,
    response_mask: (b, R). Returns (b, R) weights, 0 on padding (sequence_*: the completion's weight on each of its
    tokens), or with `sequence_loss` (a loss with one term per completion, RLOO's sequence view) (b,); None when
    behaviour_logprobs is None (pi_old sampled them itself)."""
    if behaviour_logprobs is None:
        return None
    if sequence_loss and not sampling.per_sequence:
        raise UserError(f"--vllm_importance_sampling_mode {sampling.mode} weights tokens; this loss has one term per "
                        "completion")
    ratio = importance_ratios(old_logprobs, behaviour_logprobs, response_mask, sampling.per_sequence)
    if sampling.mode.endswith("_truncate"):
        weights = torch.clamp(ratio, min=sampling.clip_min, max=sampling.clip_max)
    else:
        weights = ratio.masked_fill(sampling.outside(ratio), 0.0)
    return weights.squeeze(1) if sequence_loss else weights * response_mask.to(weights.dtype)


def importance_sampling_stats(old_logprobs: torch.Tensor, behaviour_logprobs: Optional[torch.Tensor],
                              response_mask: torch.Tensor, sampling: ImportanceSampling) -> dict:
    """A step's importance-sampling metrics under `sampling.sampler`'s name (vllm/, or async/ for HF samples of earlier
    weights): logprob_diff (mean |log pi_old - log pi_behaviour| per token), is_weight_mean|min|max (of r, before
    truncation or masking, over the actions: tokens, or completions for sequence_*) and the fraction of actions outside
    the bounds, is_truncated_frac (*_truncate) or is_masked_frac (*_mask); {} when behaviour_logprobs is None."""
    if behaviour_logprobs is None:
        return {}
    ratio = importance_ratios(old_logprobs, behaviour_logprobs, response_mask, sampling.per_sequence)
    actions = response_mask.bool().any(1, keepdim=True) if sampling.per_sequence else response_mask.bool()
    name, log_ratio = sampling.sampler, (old_logprobs - behaviour_logprobs).detach()
    return {f"{name}/logprob_diff": masked_mean(log_ratio.abs(), response_mask.bool()),
            f"{name}/is_weight_mean": ratio[actions].mean(), f"{name}/is_weight_min": ratio[actions].min(),
            f"{name}/is_weight_max": ratio[actions].max(),
            f"{name}/is_truncated_frac" if sampling.mode.endswith("_truncate") else f"{name}/is_masked_frac":
                sampling.outside(ratio)[actions].float().mean()}


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
