"""Padding-free forwards (packing.py, --padding_free): the packed layout on a hand-worked batch; log-probs, entropies,
rewards and values of packing.PackedForward / PackedScalarForward equal to each row run alone without padding
(GPT-NeoX, Llama, LoRA; prompts shared or not; temperature; the output layer in chunks); gradients equal to the padded
forward's; rows without gradient keep none; what forwards.Forwards chooses per model (packed, sharing prompts where
worth it, the output layer in chunks; `.unshared()`), models whose attention cannot take the packed inputs left padded
with one line; every script runs packed with the padded run's numbers."""

import pytest
import torch
from conftest import TWO_PROCESS_RLOO, assert_same_numbers, read_metrics, run_distributed, run_script, tiny_args
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

import policy_common as pc
from plumbing import chunked_head, forwards, models, packing
from plumbing import prompt_sharing as ps

PAD, VOCAB = 0, 40


def neox_config(**kw):
    return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                         eos_token_id=1, pad_token_id=PAD, **kw)


def neox():
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(neox_config())


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=PAD, eos_token_id=1, bos_token_id=1))


def lora():
    model = models.add_lora(neox(), r=4, alpha=8, dropout=0.0)
    with torch.no_grad():  # a trained-looking adapter (PEFT starts B at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def sliding_window():
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            sliding_window=4, pad_token_id=PAD, eos_token_id=1, bos_token_id=1))


MODELS = {"neox": neox, "llama": llama, "lora": lora}


def padded_forward(share: bool, temperature: float = 1.0) -> pc.Forward:
    """The padded forward, sharing prompts (prompt_sharing.SharedPromptForward) or not."""
    return (ps.SharedPromptForward if share else pc.Forward)(PAD, temperature)


def grouped_batch(seed: int, group_sizes, max_query=6, max_response=5):
    """Rows in a shuffled order, the rows of group g sharing one query; returns (query_responses, Lq, [(query,
    response)] per row, unpadded)."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(2, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    queries = [draw(int(torch.randint(1, max_query + 1, (1,), generator=gen))) for _ in group_sizes]
    rows = [(queries[g], draw(int(torch.randint(1, max_response + 1, (1,), generator=gen))))
            for g, n in enumerate(group_sizes) for _ in range(n)]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
    q = pc.pad_sequences([r[0] for r in rows], PAD, "left")
    return torch.cat([q, pc.pad_sequences([r[1] for r in rows], PAD, "right")], 1), q.shape[1], rows


def unpadded_logprobs(model, query, response, temperature=1.0):
    """The obvious computation: one row alone, no padding, softmax(logits / T) without the pad token."""
    p = (model(input_ids=torch.tensor([query + response])).logits[0, len(query) - 1:-1] / temperature).softmax(-1)
    p = p * (torch.arange(p.shape[-1]) != PAD)
    return (p / p.sum(-1, keepdim=True)).log()[torch.arange(len(response)), torch.tensor(response)]


def assert_same_gradients_packed(model, query_responses, Lq, weights, temperature=1.0, share=False):
    """The gradient of sum(response log-probs x `weights` (B, R)) is the same packed as padded, for every parameter."""
    def grads(padding_free):
        model.zero_grad()
        forward = padded_forward(share, temperature)
        logprobs = (packing.PackedForward(forward) if padding_free else forward).logprobs(model, query_responses, Lq)
        (logprobs * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    padded, packed = grads(False), grads(True)
    assert padded.keys() == packed.keys() and len(packed) > 0
    for n in padded:
        torch.testing.assert_close(packed[n], padded[n], atol=1e-5, rtol=1e-4, msg=n)


# ------------------------------------------------------------------------------------------------------ layout
ROWS = torch.tensor([[5, 6, 7, 8, 9, 0],      # query 5 6 7, response 8 9
                     [5, 6, 7, 10, 11, 12],   # the same query, response 10 11 12
                     [0, 13, 14, 15, 0, 0]])  # query 13 14, response 15


def allowed(layout):  # (P, C, C) bool: where each packed position may look
    return layout.attention_mask[:, 0] == 0


def test_layout_packs_rows_into_bins_of_the_longest_row_by_hand():
    packed = packing.layout(ROWS, PAD, context_length=3)
    # segments of 5, 6 and 3 tokens into bins of 6, longest first: [row 1], [row 0], [row 2]
    assert packed.input_ids.tolist() == [[5, 6, 7, 10, 11, 12], [5, 6, 7, 8, 9, 0], [13, 14, 15, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 0, 0]]
    assert packed.index.tolist() == [[6, 7, 8, 9, 10, -1], [0, 1, 2, 3, 4, 5], [-1, 12, 13, 14, -1, -1]]
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(allowed(packed)[0], causal)
    tail = torch.eye(6, dtype=torch.bool)  # padding sees itself only
    expected = [causal.clone(), causal.clone()]
    expected[0][5], expected[1][3:] = tail[5], tail[3:]
    assert torch.equal(allowed(packed)[1], expected[0]) and torch.equal(allowed(packed)[2], expected[1])


def test_layout_shares_a_repeated_query_as_a_tree_by_hand():
    packed = packing.layout(ROWS, PAD, context_length=3, share=True)
    # rows 0 and 1 make one segment: the query once, then each response; row 2 its own bin (the first holds 8)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 0, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 2, 0, 0, 0, 0, 0]]
    assert packed.index.tolist() == [[0, 1, 2, 3, 4, -1], [0, 1, 2, 5, 6, 7], [-1, 8, 9, 10, -1, -1]]
    sees = {i: allowed(packed)[0, i].nonzero().flatten().tolist() for i in range(8)}
    assert sees == {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 2, 3, 4],
                    5: [0, 1, 2, 5], 6: [0, 1, 2, 5, 6], 7: [0, 1, 2, 5, 6, 7]}  # a response never sees the other
    # flash attention: one sequence, no mask, no sharing (the boundaries come from the position ids)
    flat = packing.layout(ROWS, PAD, context_length=3, share=True, one_sequence=True)
    assert flat.attention_mask is None and flat.input_ids.shape == (1, 14)
    assert flat.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2]]


def test_layout_of_whole_rows_and_of_repeated_rows():
    """context_length 0 (a value model reads whole rows): the same packing; a repeated row is packed once."""
    by_parts = packing.layout(ROWS, PAD, context_length=3)
    whole = packing.layout(ROWS, PAD, context_length=0)
    assert torch.equal(whole.input_ids, by_parts.input_ids) and torch.equal(whole.index, by_parts.index)
    assert torch.equal(whole.position_ids, by_parts.position_ids)
    repeated = packing.layout(torch.cat([ROWS, ROWS[2:], ROWS[:1]]), PAD, context_length=3, share=True)
    assert torch.equal(repeated.input_ids, packing.layout(ROWS, PAD, 3, share=True).input_ids)
    assert repeated.index[3].tolist() == repeated.index[2].tolist() and torch.equal(repeated.index[4],
                                                                                   repeated.index[0])


def test_first_fit_decreasing_by_hand():
    assert packing.first_fit_decreasing([5, 4, 3, 2], 5) == [0, 1, 2, 2]
    assert packing.first_fit_decreasing([1, 1, 1], 3) == [0, 0, 0]


def test_bins_trade_tail_padding_against_attention_by_hand():
    # wide model (attention cheap): one sequence of all 16 tokens beats three of 6 (18 positions)
    assert packing.bins([6, 5, 5], width=10**6) == (16, [0, 0, 0])
    # narrow model (attention dear): 3 x 6 x (1 + 6/6) = 36 beats 16 x (1 + 16/6) = 58.7
    assert packing.bins([6, 5, 5], width=1) == (6, [0, 1, 2])
    assert packing.bins([6, 5, 5], width=None) == (6, [0, 1, 2])  # no width known: the longest segment's
    assert packing.bins([0, 0], width=8) == (1, [0, 0])  # rows with no tokens at all still make a sequence


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=30))
def test_first_fit_decreasing_never_overfills_a_bin(lengths):
    bins = packing.first_fit_decreasing(lengths, max(lengths))
    load = [0] * (max(bins) + 1)
    for b, n in zip(bins, lengths):
        load[b] += n
    assert max(load) <= max(lengths) and min(load) > 0
    assert len(load) <= 2 * sum(lengths) / max(lengths) + 1  # first fit: no two bins at most half full


# ------------------------------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_and_entropy_equal_each_row_alone(name, share, temperature):
    model = MODELS[name]()
    query_responses, Lq, rows = grouped_batch(len(name) + share, [3, 1, 2, 2])
    with torch.no_grad():
        logprobs, entropy = packing.PackedForward(padded_forward(share, temperature)).logprobs(
            model, query_responses, Lq, entropy=True)
    padded_entropy = pc.Forward(PAD, temperature).logprobs(model, query_responses, Lq, entropy=True)[1]
    with torch.no_grad():
        for i, (query, response) in enumerate(rows):
            torch.testing.assert_close(logprobs[i, :len(response)],
                                       unpadded_logprobs(model, query, response, temperature), atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[i, :len(response)], padded_entropy[i, :len(response)],
                                       atol=1e-5, rtol=0)
    assert torch.isfinite(logprobs).all()  # padding positions too (masked downstream)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("share", [False, True])
def test_packed_gradients_equal_the_padded_forwards(name, share):
    model = MODELS[name]()
    query_responses, Lq, _ = grouped_batch(7, [4, 2, 1])
    query_responses = torch.cat([query_responses, query_responses[:2]])  # two rows twice: packed once, read twice
    mask = query_responses[:, Lq:] != PAD
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    assert_same_gradients_packed(model, query_responses, Lq, weights * mask, 0.9, share)


@pytest.fixture
def flash_stand_in():
    """An attention implementation named like flash attention (so packing.py takes its flash branch: every row in
    one sequence, no mask, the boundaries left to the restarting position ids) that runs torch's sdpa on the mask
    transformers builds from those position ids, the boundaries its flash varlen path reads from them: the flash
    branch end to end on a CPU, all but the kernel. Returns its name; unregistered after the test."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = "flash_attention_stand_in"
    AttentionInterface.register(name, sdpa_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    yield name
    AttentionInterface._global_mapping.pop(name)
    AttentionMaskInterface._global_mapping.pop(name)


@pytest.mark.parametrize("name", ["neox", "llama"])
def test_flash_branch_packs_one_sequence_with_the_padded_numbers(name, flash_stand_in):
    model = MODELS[name]()
    model.config._attn_implementation = flash_stand_in
    assert packing.flash_attention(model)
    query_responses, Lq, rows = grouped_batch(3, [3, 1, 2])
    flat = packing.model_layout(model, query_responses, PAD, Lq, share=True)
    assert flat.input_ids.shape[0] == 1 and flat.attention_mask is None  # one sequence, queries not shared
    assert packing.lm_supported(model, PAD)  # the tiny-batch check passes: the packed forward is taken
    assert isinstance(forwards.Forwards(PAD, padding_free=True).lm(model), packing.PackedForward)
    with torch.no_grad():
        logprobs = packing.PackedForward(padded_forward(True, 0.7)).logprobs(model, query_responses, Lq)
        for i, (query, response) in enumerate(rows):
            torch.testing.assert_close(logprobs[i, :len(response)], unpadded_logprobs(model, query, response, 0.7),
                                       atol=1e-5, rtol=0)
    assert_same_gradients_packed(model, query_responses, Lq, (query_responses[:, Lq:] != PAD).float())


@pytest.mark.parametrize("share", [False, True])
def test_packed_rows_without_gradient_keep_none(share):
    """grad_rows (KTO's mismatched completions): rows n.. give the same numbers and nothing to the gradient."""
    model = neox()
    query_responses, Lq, _ = grouped_batch(3, [2, 2, 2])
    mask = (query_responses[:, Lq:] != PAD).float()
    logprobs = packing.PackedForward(padded_forward(share)).logprobs(model, query_responses, Lq, grad_rows=3)
    (logprobs[:3] * mask[:3]).sum().backward()
    with_split = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (pc.Forward(PAD).logprobs(model, query_responses[:3], Lq) * mask[:3]).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(with_split[n], p.grad, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        expected = pc.Forward(PAD).logprobs(model, query_responses, Lq)
    torch.testing.assert_close(logprobs.detach() * mask, expected * mask, atol=1e-5, rtol=0)


def test_packed_chunked_output_layer_equals_the_padded_one():
    """--logprob_chunk_tokens: the packed hidden states through the output layer a few positions at a time."""
    model = neox()
    query_responses, Lq, _ = grouped_batch(5, [3, 3])
    mask = query_responses[:, Lq:] != PAD
    padded = pc.Forward(PAD, 0.8).logprobs(model, query_responses, Lq, entropy=True)
    forward = chunked_head.ChunkedHead(packing.PackedForward(padded_forward(True, 0.8)), 4)
    assert forward.chunked(model, mask.numel())
    packed = forward.logprobs(model, query_responses, Lq, entropy=True)
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("share", [False, True])
def test_packed_rewards_and_values_equal_each_row_alone(share):
    torch.manual_seed(2)
    model = GPTNeoXForSequenceClassification(neox_config(num_labels=1))
    query_responses, Lq, rows = grouped_batch(11, [2, 3, 1])
    padded = (ps.SharedPromptScalarForward if share else pc.ScalarForward)(PAD)
    packed = packing.PackedScalarForward(padded)
    assert packed.shares_prompts == share
    rewards = packed.rewards(model, query_responses, Lq)
    values = packed.values(model, query_responses, Lq)
    # PPO's value model: whole rows, no context length
    whole_rows = packing.PackedScalarForward(pc.ScalarForward(PAD)).values(model, query_responses)
    real = query_responses != PAD
    torch.testing.assert_close(whole_rows[real], pc.ScalarForward(PAD).values(model, query_responses)[real],
                               atol=1e-5, rtol=0)
    values.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    pc.ScalarForward(PAD).values(model, query_responses, Lq).masked_fill(query_responses == PAD, 0).sum().backward()
    for n, g in packed_grads.items():
        torch.testing.assert_close(g, dict(model.named_parameters())[n].grad, atol=1e-5, rtol=1e-4, msg=n)
    with torch.no_grad():
        for i, (query, response) in enumerate(rows):
            alone = model(input_ids=torch.tensor([query + response])).logits[0, 0]
            assert rewards[i].item() == pytest.approx(alone.item(), abs=1e-5)
    assert (values.detach()[query_responses == PAD] == 0).all()


# ------------------------------------------------------------------------------------------------------ fallback
class MaskIgnoringNeoX(GPTNeoXForCausalLM):
    """Custom model code that drops the attention mask it is given (some hub models do)."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=None, **kwargs)


WORTH_SHARING = ps.Repeats(rows=64, rows_per_prompt=4, prompt_length=8, response_length=8)  # padded or packed
ONLY_PACKED = ps.Repeats(rows=8, rows_per_prompt=4, prompt_length=8, response_length=8)  # saves too little padded


def test_a_model_ignoring_the_mask_runs_padded_with_one_line(capsys):
    """The model is checked once, when its forward is chosen: one line, the padded forward (sharing prompts as
    asked), whose every call and `.unshared()` twin then run padded without checking again."""
    torch.manual_seed(0)
    model = MaskIgnoringNeoX(neox_config())
    query_responses, Lq, rows = grouped_batch(2, [2, 2])
    forward = forwards.Forwards(PAD, padding_free=True, repeats=WORTH_SHARING).lm(model)
    assert type(forward) is ps.SharedPromptForward
    with torch.no_grad():
        first = forward.logprobs(model, query_responses, Lq)
        second = forward.unshared().logprobs(model, query_responses, Lq)
    out = capsys.readouterr().out
    assert out.count("--padding_free") == 1 and "MaskIgnoringNeoX" in out and "run padded" in out
    with torch.no_grad():
        expected = pc.Forward(PAD).logprobs(model, query_responses, Lq)
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)


def test_sliding_window_attention_runs_padded(capsys):
    model = sliding_window()
    query_responses, Lq, _ = grouped_batch(4, [2, 1])
    forward = forwards.Forwards(PAD, padding_free=True).lm(model)
    assert type(forward) is pc.Forward
    with torch.no_grad():
        got = forward.logprobs(model, query_responses, Lq)
    assert "sliding window" in capsys.readouterr().out
    with torch.no_grad():
        torch.testing.assert_close(got, pc.Forward(PAD).logprobs(model, query_responses, Lq))


def test_each_model_is_checked_by_its_own_config(capsys):
    """Issue 63: the packing check is made per model (its config), not remembered per class: a Qwen2 without a sliding
    window runs packed, a Qwen2 with window 3 after it runs padded (before, it reused the first's answer and ran
    packed, nats off). GPT-Neo's local layers are a sliding window the tiny check batch can miss (the audit's window 8
    is longer than its rows): read from the config, they run padded too."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM, Qwen2Config, Qwen2ForCausalLM

    def qwen2(window):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=PAD, eos_token_id=1, bos_token_id=1, use_sliding_window=window > 0,
            sliding_window=window or None, max_window_layers=0))

    torch.manual_seed(0)
    neo = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                                         attention_types=[[["global", "local"], 1]], window_size=2,
                                         max_position_embeddings=64, pad_token_id=PAD, eos_token_id=1))
    query_responses, Lq, _ = grouped_batch(7, [3, 2], max_query=8, max_response=8)
    chosen = {name: forwards.Forwards(PAD, padding_free=True).lm(model)
              for name, model in (("plain", qwen2(0)), ("window", qwen2(3)), ("neo", neo))}
    assert type(chosen["plain"]) is packing.PackedForward
    assert type(chosen["window"]) is pc.Forward and type(chosen["neo"]) is pc.Forward
    assert capsys.readouterr().out.count("sliding window") == 2
    for name, model in (("window", qwen2(3)), ("neo", neo)):
        with torch.no_grad():
            torch.testing.assert_close(chosen[name].logprobs(model, query_responses, Lq),
                                       pc.Forward(PAD).logprobs(model, query_responses, Lq))
    # what the packed forward (prompts shared) would have given GPT-Neo: far off, why it runs padded
    with torch.no_grad():
        packed = packing.PackedForward(padded_forward(True)).logprobs(neo, query_responses, Lq)
        padded = pc.Forward(PAD).logprobs(neo, query_responses, Lq)
    mask = query_responses[:, Lq:] != PAD
    assert (packed - padded)[mask].abs().max() > 1e-3


def test_packed_sequences_stay_within_a_models_position_table():
    """Issue 63: GPT-Neo keeps a max positions x max positions causal-mask table, which a longer packed sequence
    overran (a RuntimeError at a packed length above max_position_embeddings). Its packed sequences now stay within
    16 positions (bins), a shared query's 8 rows that would make a tree of 26 tokens are split into segments that fit
    (layout), and the packed log-probs equal the padded ones; a rotary model (no such table) has no limit."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    assert packing.bins([15, 3, 3, 3, 3], width=10**6) == (27, [0, 0, 0, 0, 0])  # one sequence: no tail padding
    assert packing.bins([15, 3, 3, 3, 3], width=10**6, limit=16) == (15, [0, 1, 1, 1, 1])
    torch.manual_seed(0)
    neo = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=VOCAB, hidden_size=256, num_layers=2, num_heads=4,
                                         attention_types=[[["global"], 2]], max_position_embeddings=16,
                                         pad_token_id=PAD, eos_token_id=1, bos_token_id=1,
                                         attn_implementation="eager")).eval()
    assert packing.length_limit(neo) == 16 and packing.length_limit(neox()) is None
    gen = torch.Generator().manual_seed(0)
    spread = torch.randint(2, VOCAB, (15, 15), generator=gen)
    spread[1:, :12] = PAD  # one row of 15 tokens, fourteen of 3: binned at a width of 256, more than 16 per sequence
    shared = torch.randint(2, VOCAB, (8, 10), generator=gen)
    shared[:, :6] = shared[0, :6]
    shared[:, :2] = PAD  # one query of 4 tokens, 8 responses of 4: 36 tokens as one tree
    for query_responses, Lq, share in ((spread, 13, False), (shared, 6, True)):
        packed = packing.model_layout(neo, query_responses, PAD, Lq, share=share)
        assert packed.input_ids.shape[1] <= 16
        forward = packing.PackedForward(padded_forward(share))
        with torch.no_grad():
            torch.testing.assert_close(forward.logprobs(neo, query_responses, Lq),
                                       pc.Forward(PAD).logprobs(neo, query_responses, Lq))


def layers(forward) -> list:
    """A chosen forward as the classes it is built from, outermost first: [ChunkedHead, PackedForward, Forward]."""
    return [type(forward)] + (layers(forward.inner) if hasattr(forward, "inner") else [])


@pytest.mark.parametrize("name", ["neox", "llama"])
def test_forwards_choose_packing_sharing_and_chunking_per_model(name, capsys):
    """forwards.Forwards(padding_free=True).lm(model): packed for a model whose packed forward matches its padded one,
    the padded forward for a model with a sliding window; prompts shared only where prompt_sharing.worth_sharing says
    (packed: any repeat; padded: enough saved positions); a ChunkedHead unless chunk_tokens is 0. `.unshared()` drops
    prompt sharing and keeps packing, chunking and the temperature. The chosen forward gives the plain forward's
    numbers."""
    model, window = MODELS[name](), sliding_window()
    Packed, Chunked, Shared = packing.PackedForward, chunked_head.ChunkedHead, ps.SharedPromptForward

    def chosen(m, repeats=WORTH_SHARING, chunk_tokens=0, padding_free=True):
        forward = forwards.Forwards(PAD, 0.7, padding_free, chunk_tokens, repeats).lm(m)
        assert forward.pad_token_id == PAD and forward.temperature == 0.7
        return forward

    assert ps.worth_sharing(*WORTH_SHARING) and ps.worth_sharing(*ONLY_PACKED, packed=True)
    assert not ps.worth_sharing(*ONLY_PACKED)
    assert layers(chosen(model)) == [Packed, Shared] and chosen(model).shares_prompts
    assert layers(chosen(model, ONLY_PACKED)) == [Packed, Shared]  # a shared prompt costs no extra call packed
    assert layers(chosen(model, None)) == [Packed, pc.Forward] and not chosen(model, None).shares_prompts
    assert layers(chosen(model, ps.Repeats(64, 1, 8, 8))) == [Packed, pc.Forward]  # no prompt repeats
    assert layers(chosen(model, padding_free=False)) == [Shared]
    assert layers(chosen(model, ONLY_PACKED, padding_free=False)) == [pc.Forward]
    assert "--padding_free" not in capsys.readouterr().out  # every check passed
    assert layers(chosen(window)) == [Shared]  # padded, each check with one line
    assert layers(chosen(window, ONLY_PACKED)) == [pc.Forward]  # padded: sharing saves too little
    assert capsys.readouterr().out.count("sliding window") == 2
    for chunk_tokens in (None, 8):
        forward = chosen(model, chunk_tokens=chunk_tokens)
        assert layers(forward) == [Chunked, Packed, Shared] and forward.chunk_tokens == chunk_tokens
        assert forward.shares_prompts
        assert layers(chosen(window, chunk_tokens=chunk_tokens)) == [Chunked, Shared]
    forward = chosen(model, chunk_tokens=8)
    unshared = forward.unshared()
    assert layers(unshared) == [Chunked, Packed, pc.Forward] and not unshared.shares_prompts
    assert unshared.chunk_tokens == 8 and (unshared.pad_token_id, unshared.temperature) == (PAD, 0.7)
    assert layers(chosen(window, chunk_tokens=8).unshared()) == [Chunked, pc.Forward]
    query_responses, Lq, _ = grouped_batch(6, [3, 3, 2])
    mask = query_responses[:, Lq:] != PAD
    with torch.no_grad():
        expected = pc.Forward(PAD, 0.7).logprobs(model, query_responses, Lq)
        for f in (forward, unshared):
            assert f.chunked(model, mask.numel())  # 40 positions, chunks of 8
            torch.testing.assert_close(f.logprobs(model, query_responses, Lq)[mask], expected[mask], atol=1e-5,
                                       rtol=0)


def test_forwards_choose_packed_scalar_forwards():
    """forwards.Forwards(padding_free=True).scalar(model) for a reward or value model: packed, sharing prompts where
    worth it; `.unshared()` keeps the packing."""
    torch.manual_seed(2)
    model = GPTNeoXForSequenceClassification(neox_config(num_labels=1))
    forward = forwards.Forwards(PAD, padding_free=True, repeats=WORTH_SHARING).scalar(model)
    assert layers(forward) == [packing.PackedScalarForward, ps.SharedPromptScalarForward] and forward.shares_prompts
    assert layers(forward.unshared()) == [packing.PackedScalarForward, pc.ScalarForward]
    assert layers(forwards.Forwards(PAD, repeats=WORTH_SHARING).scalar(model)) == [ps.SharedPromptScalarForward]
    assert layers(forwards.Forwards(PAD, padding_free=True).scalar(model)) == [packing.PackedScalarForward,
                                                                               pc.ScalarForward]


# ------------------------------------------------------------------------------------------------------ scripts
SCRIPT_METRICS = {  # a step's numbers that the forwards feed
    "rloo.py": ["objective/scores", "objective/kl", "loss/policy", "objective/entropy"],
    "grpo.py": ["objective/scores", "loss/policy", "objective/entropy"],
    "ppo.py": ["objective/scores", "loss/value", "loss/policy", "policy/entropy"],
    "distill.py": ["loss/distill", "objective/entropy"],
    "dpo.py": ["loss", "grad_norm", "rewards/margins"], "kto.py": ["loss", "grad_norm"],
    "sft.py": ["loss", "token_accuracy"], "reward.py": ["loss", "accuracy", "grad_norm"]}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPT_METRICS))
def test_every_script_gives_the_same_numbers_packed(script, tmp_path, toy, shared_run):
    """The tiny run of each script on the toy (conftest.tiny_args: 2 steps), packed and padded (the padded one shared
    with test_smoke.py): the same metrics and evaluation."""
    padded_proc, padded = shared_run(script, *tiny_args(script))
    packed = str(tmp_path / "packed")
    proc = run_script(script, *tiny_args(script), "--padding_free", "--output_dir", packed)
    for run in (padded_proc, proc):
        assert "run padded" not in run.stdout  # packed indeed: no model fell back
    rows = {mode: {r["step"]: r for r in read_metrics(out)} for mode, out in (("padded", padded), ("packed", packed))}
    assert rows["packed"].keys() == rows["padded"].keys()
    keys = SCRIPT_METRICS[script] + [k for k in rows["padded"][2] if k.startswith("eval/")]
    assert_same_numbers(rows["packed"], rows["padded"], (1, 2), keys, script)


@pytest.mark.slow
def test_two_processes_give_the_same_numbers_packed(tmp_path, toy, shared_run):
    """rloo on 2 processes (DDP over gloo; each process packs its own rows into its own bins, the output layer runs
    outside the wrapped forward): packed = padded (the padded run shared with test_accumulation.py)."""
    _, padded = shared_run("rloo.py", *TWO_PROCESS_RLOO, processes=2)
    packed = str(tmp_path / "packed")
    run_distributed("rloo.py", *TWO_PROCESS_RLOO, "--padding_free", "--output_dir", packed)
    rows = {mode: {r["step"]: r for r in read_metrics(out)} for mode, out in (("padded", padded), ("packed", packed))}
    for key in ("loss/policy", "objective/kl", "objective/entropy", "objective/scores"):
        assert rows["packed"][2][key] == pytest.approx(rows["padded"][2][key], rel=1e-4, abs=1e-5), key
