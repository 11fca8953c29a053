"""Padding-free forwards (--padding_free): the real tokens of a batch's rows packed into a few sequences, so that
no forward or backward runs on padding.

Rows are [left pads | query | response | right pads] (policy_common's layout). Each row's real tokens become a
*segment*; with `share` the rows that repeat one query (RLOO's k samples, DPO's chosen and rejected) make one
segment: the query's tokens once, then each row's response, every response attending to the query and to itself
only (a tree: the packed form of prompt_sharing.py). Position ids restart at each segment and count real tokens
as policy_common.padding_inputs does (a response continues from its query's length), so every token sees the same
positions and the same context as in the padded forward: the numbers are the padded forward's to float rounding
(tests/test_packing.py: log-probs, rewards, values and gradients, per script).

The attention is kept within a segment by a 4D attention mask (P, 1, C, C), which transformers hands to sdpa and
eager attention as it is. That mask is dense, so the attention costs C^2 per packed sequence: segments are binned
first-fit decreasing into sequences of at most a few times the longest segment, the length chosen by the FLOPs it
costs (`bins`: longer sequences leave less padding at their ends and cost more attention), not all into one. A
flash-attention implementation (GPU) takes no 4D mask: there every row goes into one sequence and transformers
finds the boundaries from the restarting position ids (varlen kernels), without query sharing.

Whether a model honours the packed inputs is checked when its forward is chosen (forwards.py, once per model, on a
tiny batch: `lm_supported`, `backbone_supported`): a model whose packed forward differs from its padded one (custom
code that ignores the mask, sliding-window attention) runs padded, with one log line. Nothing here keeps state, and
every process makes the same model calls whatever its data (one forward per call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

import policy_common as pc
from plumbing import chunked_head, models, vision


@dataclass
class Layout:
    """A batch packed: P sequences of C positions.
    input_ids, position_ids: (P, C); attention_mask: (P, 1, C, C) additive float mask (0 where a position may look,
    the dtype's minimum elsewhere), or None for flash attention (boundaries from position_ids); index: (B, T) the
    flat position (in P * C) holding each padded row's token, -1 at padding."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    index: torch.Tensor

    def gather(self, outputs: torch.Tensor, columns: slice, keep: Optional[torch.Tensor] = None):
        """(P, C, X) packed outputs -> ((n, X) the outputs at the real tokens of query_responses[:, columns] (where
        `keep`, (B, c) bool, allows), (B, c) bool where those are): put results back with `out[where] = results`."""
        index = self.index[:, columns]
        where = index >= 0 if keep is None else (index >= 0) & keep
        return outputs.reshape(-1, outputs.shape[-1])[index[where]], where


def _text_config(model: torch.nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_implementation(model: torch.nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")


def flash_attention(model: torch.nn.Module) -> bool:
    """Does the model attend with a flash-attention kernel (which takes position ids, not a 4D mask)?"""
    return "flash" in attention_implementation(model)


def sliding_window(model: torch.nn.Module) -> bool:
    """Does some layer attend within a sliding window (Mistral, Gemma 2/3, Qwen2 with use_sliding_window, GPT-Neo's
    local layers)? Read from the config: a window wider than the support check's tiny batch hides from that check."""
    config = _text_config(model)
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    if "local" in (getattr(config, "attention_layers", None) or ()):  # GPT-Neo: window_size
        return True
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False


def length_limit(model: torch.nn.Module) -> Optional[int]:
    """The longest packed sequence `model` takes: its max_position_embeddings where it keeps a table of max positions x
    max positions (GPT-Neo's causal-mask buffer, which a longer sequence overruns); None where nothing is sized by them
    (rotary or learned position embeddings see each row's positions, which restart within a packed sequence)."""
    limit = getattr(_text_config(model), "max_position_embeddings", None)
    if limit and any(b.dim() >= 2 and tuple(b.shape[-2:]) == (limit, limit) for b in model.buffers()):
        return limit
    return None


def first_fit_decreasing(lengths: list, capacity: int) -> list:
    """Segment lengths -> a bin index per segment: longest first, each into the first bin with room (bins of at
    most `capacity`, which must be >= every length)."""
    free, bins = [], [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((b for b, room in enumerate(free) if room >= lengths[i]), len(free))
        if b == len(free):
            free.append(capacity)
        free[b] -= lengths[i]
        bins[i] = b
    return bins


def bins(lengths: list, width: Optional[int] = None, limit: Optional[int] = None) -> tuple:
    """Segment lengths -> (capacity, bin of each segment): first-fit decreasing at the capacity whose packed batch
    costs least, P bins x C positions x (1 + C / (6 x width)): a position's projections and MLP cost about 24 x
    width^2 FLOPs, its attention over C keys (dense with a mask) about 4 x width x C. Capacities from the longest
    segment up to 4x it are tried, none above `limit` (the model's, `length_limit`) but the longest segment; `width`
    None: the longest segment's."""
    longest, total = max(1, max(lengths)), max(1, sum(lengths))
    if width is None:
        return longest, first_fit_decreasing(lengths, longest)
    best = None
    for capacity in sorted({max(longest, min(total, longest + (longest * k) // 4, limit or total)) for k in range(13)}):
        assigned = first_fit_decreasing(lengths, capacity)
        cost = (max(assigned) + 1) * capacity * (1 + capacity / (6 * width))
        if best is None or cost < best[0]:
            best = (cost, capacity, assigned)
    return best[1], best[2]


def layout(query_responses: torch.Tensor, pad_token_id: int, context_length: int = 0, share: bool = False,
           one_sequence: bool = False, dtype: torch.dtype = torch.float32, width: Optional[int] = None,
           limit: Optional[int] = None) -> Layout:
    """Pack (B, T) rows: a query in the first `context_length` columns, a response after them, any padding around
    (policy_common's layout, or context_length 0 for whole rows). Each row's real tokens keep their order and are
    counted as padding_inputs counts them. Identical rows are packed once (they get the same numbers, as in a padded
    batch). `share`: rows whose query columns are identical make one tree segment (their query once). `one_sequence`:
    every segment in one packed sequence and no mask (flash attention); `share` is then ignored. `dtype`: the
    mask's (the model's). `width`: the model's hidden size, which sets how long the packed sequences are (`bins`);
    None: as long as the longest segment. `limit`: the longest sequence the model takes (`length_limit`): no packed
    sequence is longer, and a shared query's rows are split into several segments where one would be."""
    B, T = query_responses.shape
    ids = query_responses.cpu()
    real = ids != pad_token_id
    _, same_row = torch.unique(ids, dim=0, return_inverse=True)
    first_of: dict = {}  # a distinct row -> the first row holding it
    for r, u in enumerate(same_row.tolist()):
        first_of.setdefault(u, r)
    unique_rows = sorted(first_of.values())
    query_cols = {r: real[r, :context_length].nonzero().flatten() for r in unique_rows}
    response_cols = {r: context_length + real[r, context_length:].nonzero().flatten() for r in unique_rows}
    groups: dict = {}
    if share and not one_sequence and context_length > 0:
        _, query_of = torch.unique(ids[:, :context_length], dim=0, return_inverse=True)
        for r in unique_rows:
            group = groups.setdefault(int(query_of[r]), [[]])
            rows = group[-1]
            used = len(query_cols[r]) + sum(len(response_cols[x]) for x in rows) + len(response_cols[r])
            if rows and limit is not None and used > limit:  # this row in a segment of its own, its query again
                group.append([])
            group[-1].append(r)
        groups = {(q, i): rows for q, group in groups.items() for i, rows in enumerate(group)}
    else:
        groups = {r: [r] for r in unique_rows}
    segments = list(groups.values())  # rows of each segment, in row order
    lengths = [len(query_cols[rows[0]]) + sum(len(response_cols[r]) for r in rows) for rows in segments]
    if one_sequence:
        capacity, bin_of = max(1, sum(lengths)), [0] * len(segments)
    else:
        capacity, bin_of = bins(lengths, width, limit)
    P = max(bin_of) + 1

    packed_ids = torch.zeros(P, capacity, dtype=torch.long)  # id 0 at padding (a pad id may have no embedding)
    positions = torch.zeros(P, capacity, dtype=torch.long)
    segment = torch.full((P, capacity), -1, dtype=torch.long)  # segment id of each position, -1 at padding
    branch = torch.zeros(P, capacity, dtype=torch.long)  # 0: a query token; r + 1: row r's response token
    index = torch.full((B, T), -1, dtype=torch.long)
    used = [0] * P
    for s, rows in enumerate(segments):
        p = bin_of[s]
        start = used[p]
        cols = query_cols[rows[0]]
        q = len(cols)
        packed_ids[p, start:start + q] = ids[rows[0], cols]
        positions[p, start:start + q] = torch.arange(q)
        segment[p, start:start + q] = s
        for r in rows:
            index[r, cols] = p * capacity + start + torch.arange(q)
        at = start + q
        for r in rows:
            cols = response_cols[r]
            n = len(cols)
            packed_ids[p, at:at + n] = ids[r, cols]
            positions[p, at:at + n] = q + torch.arange(n)
            segment[p, at:at + n] = s
            branch[p, at:at + n] = r + 1
            index[r, cols] = p * capacity + at + torch.arange(n)
            at += n
        used[p] = at
    index = index[torch.tensor([first_of[u] for u in same_row.tolist()])]  # a repeated row reads its first
    device = query_responses.device
    mask = None
    if not one_sequence:
        # i may look at j: j <= i, the same segment, and j a query token or a token of i's own response; padding
        # looks at itself only (no row of the softmax is empty)
        causal = torch.ones(capacity, capacity, dtype=torch.bool).tril()
        same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
        own = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
        allowed = (causal & same & own) | torch.eye(capacity, dtype=torch.bool)
        mask = torch.zeros(P, 1, capacity, capacity, dtype=dtype, device=device)
        mask.masked_fill_(~allowed[:, None].to(device), torch.finfo(dtype).min)
    return Layout(packed_ids.to(device), positions.to(device), mask, index.to(device))


def model_layout(model: torch.nn.Module, query_responses: torch.Tensor, pad_token_id: int, context_length: int = 0,
                 share: bool = False) -> Layout:
    """`layout` as `model` takes it: one sequence under flash attention, else binned for its hidden width and length
    limit, the mask in its dtype."""
    return layout(query_responses, pad_token_id, context_length, share=share, one_sequence=flash_attention(model),
                  dtype=_dtype(model), width=getattr(_text_config(model), "hidden_size", None),
                  limit=length_limit(model))


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return getattr(model, "dtype", torch.float32)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def supported(model: torch.nn.Module, run: Callable, kind: str, pad_token_id: int) -> bool:
    """Does `run(input_ids, attention_mask, position_ids) -> (b, t, H)` give the same outputs packed as padded? Tried
    on a tiny batch (three rows, two sharing a query), without gradient and in eval mode; a model that does not is run
    padded, with one log line (`kind` names the forward in it)."""
    if sliding_window(model):
        print(f"note: --padding_free: {type(model).__name__} attends within a sliding window, which the packed mask "
              "does not reproduce; its forwards run padded", flush=True)
        return False
    vocab_size = model.get_input_embeddings().weight.shape[0]
    tokens = [(7 * i + 3) % vocab_size for i in range(12)]
    tokens = [t if t != pad_token_id else (t + 1) % vocab_size for t in tokens]
    rows = [tokens[0:3] + tokens[3:5] + [pad_token_id],
            tokens[0:3] + tokens[5:8],
            [pad_token_id] + tokens[8:10] + tokens[10:11] + [pad_token_id] * 2]
    query_responses = torch.tensor(rows, device=_device(model))
    attention_mask, position_ids = pc.padding_inputs(query_responses, pad_token_id)
    packed = model_layout(model, query_responses, pad_token_id, context_length=3, share=True)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            padded_out = run(query_responses.masked_fill(attention_mask == 0, 0), attention_mask, position_ids)
            packed_out = run(packed.input_ids, packed.attention_mask, packed.position_ids)
        where = packed.index >= 0
        expected = padded_out[where].float()
        got = packed_out.reshape(-1, packed_out.shape[-1])[packed.index[where]].float()
        tolerance = 1e-4 if models.compute_dtype(model) == torch.float32 else 3e-2
        difference = (expected - got).abs().max().item()
        ok = difference <= tolerance * max(1.0, expected.abs().max().item())
    except Exception as e:  # a forward that refuses the packed inputs
        ok, difference = False, f"{type(e).__name__}: {e}"
    finally:
        model.train(training)
    if not ok:
        print(f"note: --padding_free: {type(model).__name__}'s packed {kind} forward differs from its padded one "
              f"({difference}); its forwards run padded", flush=True)
    return ok


# ---- The forwards of causal LMs and of reward and value models, packed (forwards.py chooses them)
def lm_supported(model: torch.nn.Module, pad_token_id: int) -> bool:
    """Can this causal LM's forwards run packed? `supported`, and an output layer that can be applied apart from the
    forward (chunked_head.supported: no soft-capping or logit scale)."""
    lm = models.causal_lm(model)
    if not chunked_head.supported(model) or lm.get_output_embeddings() is None:
        return False

    def run(input_ids, attention_mask, position_ids):
        with models.hidden_instead_of_logits(model):
            return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).logits

    return supported(lm, run, "causal_lm", pad_token_id)


def response_outputs(model: torch.nn.Module, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                     share_prompts: bool = False, grad_rows: Optional[int] = None,
                     hidden: bool = False) -> torch.Tensor:
    """policy_common.Forward.outputs on packed rows: one forward over the packed sequences, the hidden states of the
    real positions that predict a response token gathered, the output layer run on those only (not with `hidden`):
    (B, R, V) logits, or (B, R, H) hidden states, zeros at pad positions. `grad_rows=n`: rows n.. packed and run
    apart, without gradient."""
    B, T = query_responses.shape
    if grad_rows is not None and 0 < grad_rows < B:
        first = response_outputs(model, query_responses[:grad_rows], context_length, pad_token_id, share_prompts,
                                 None, hidden)
        with torch.no_grad():
            other = response_outputs(model, query_responses[grad_rows:], context_length, pad_token_id, share_prompts,
                                     None, hidden)
        return torch.cat([first, other])
    packed = model_layout(models.causal_lm(model), query_responses, pad_token_id, context_length, share_prompts)
    with models.hidden_instead_of_logits(model):
        states = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                       position_ids=packed.position_ids, use_cache=False).logits  # (P, C, H)
    # the token at column c - 1 predicts the response token at column c; a response token's predecessor is real
    predicting, where = packed.gather(states, slice(context_length - 1, T - 1),
                                      keep=query_responses[:, context_length:] != pad_token_id)
    outputs = predicting if hidden else models.output_layer(model)(predicting)  # (n, X)
    result = outputs.new_zeros(B, T - context_length, outputs.shape[-1])
    result[where] = outputs
    return result


def backbone_supported(backbone: torch.nn.Module, pad_token_id: int) -> bool:
    """Can this backbone (a reward or value model's, under its score head) run packed (`supported`)?"""
    def run(input_ids, attention_mask, position_ids):
        return backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False).last_hidden_state

    return supported(backbone, run, "backbone", pad_token_id)


def scalar_outputs(model: torch.nn.Module, backbone: torch.nn.Module, query_responses: torch.Tensor,
                   pad_token_id: int, context_length: int = 0, share_prompts: bool = False) -> torch.Tensor:
    """policy_common.ScalarForward.values on packed rows: (B, T) -> (B, T) the sequence classifier `model`'s score head
    on its `backbone`'s last hidden states at every real token, 0 at padding."""
    packed = model_layout(backbone, query_responses, pad_token_id, context_length, share_prompts)
    hidden = backbone(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                      position_ids=packed.position_ids, use_cache=False).last_hidden_state  # (P, C, H)
    real_hidden, where = packed.gather(hidden, slice(None))
    scores = model.score(real_hidden).squeeze(-1)
    values = scores.new_zeros(query_responses.shape)
    values[where] = scores
    return values


class PackedForward(pc.Forward):
    """`inner`'s forward (plain, or sharing prompts: then rows with one query make one tree segment) on packed rows
    (`response_outputs`); generation's prefill is `inner`'s."""

    def __init__(self, inner: pc.Forward):
        super().__init__(inner.pad_token_id, inner.temperature, inner.masked_token_ids)
        self.inner, self.shares_prompts = inner, inner.shares_prompts

    def unshared(self) -> pc.Forward:
        return PackedForward(self.inner.unshared())

    def outputs(self, model, query_responses, context_length, grad_rows=None, hidden=False, images=None):
        vision.require_no_images(images, "packing")  # forwards.py does not choose it for images
        if query_responses.shape[1] == context_length:  # no response position
            return self.inner.outputs(model, query_responses, context_length, grad_rows, hidden)
        return response_outputs(model, query_responses, context_length, self.pad_token_id, self.shares_prompts,
                                grad_rows, hidden)

    def prefill(self, model, queries, attention_mask, position_ids, cache=None) -> dict:
        return self.inner.prefill(model, queries, attention_mask, position_ids, cache)


class PackedScalarForward(pc.ScalarForward):
    """`inner`'s scalar forward (a reward or value model's) on packed rows (`scalar_outputs`)."""

    def __init__(self, inner: pc.ScalarForward):
        super().__init__(inner.pad_token_id)
        self.inner, self.shares_prompts = inner, inner.shares_prompts

    def unshared(self) -> pc.ScalarForward:
        return PackedScalarForward(self.inner.unshared())

    def values(self, model, query_responses, context_length=0):
        base = models.unwrap(model)
        return scalar_outputs(base, getattr(base, base.base_model_prefix), query_responses, self.pad_token_id,
                              context_length, self.shares_prompts)
