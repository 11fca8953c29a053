"""policy_common helpers against independent, obviously-correct computations on tiny models built here: the plain
forward (policy_common.Forward, ScalarForward) and its prompt-sharing subclasses (prompt_sharing.SharedPromptForward,
SharedPromptScalarForward), generation, the reference, loading."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig, GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

import policy_common as pc
from plumbing import forwards, models
from plumbing import prompt_sharing as ps
from plumbing.errors import UserError

PAD, EOS, VOCAB = 0, 1, 40


def tiny_config(**kw):
    kw = {"hidden_dropout": 0.0, "attention_dropout": 0.0, **kw}
    return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64, rotary_pct=0.25, tie_word_embeddings=False,
                         eos_token_id=EOS, bos_token_id=EOS, pad_token_id=PAD, **kw)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(tiny_config()).eval()


def random_queries(gen, lengths):
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]


# --------------------------------------------------------------------------------------------- small utilities
def test_first_true_indices_matches_loop():
    gen = torch.Generator().manual_seed(0)
    bools = torch.rand(50, 7, generator=gen) < 0.2
    expected = [next((j for j in range(7) if bools[i, j]), 7) for i in range(50)]
    assert pc.first_true_indices(bools).tolist() == expected


def test_truncate_after_eos_hand_made():
    responses = torch.tensor([[5, EOS, 7, EOS], [5, 6, 7, 8], [EOS, 2, 3, 4], [5, 6, 7, EOS]])
    expected = torch.tensor([[5, EOS, PAD, PAD], [5, 6, 7, 8], [EOS, PAD, PAD, PAD], [5, 6, 7, EOS]])
    assert torch.equal(pc.truncate_after_eos(responses, EOS, PAD), expected)


def test_last_token_index():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    assert pc.last_token_index(mask).tolist() == [2, 3, 2]


def test_masked_stats_against_numpy():
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 9, generator=gen) < 0.6
    picked = values[mask].numpy()
    assert pc.masked_mean(values, mask).item() == pytest.approx(picked.mean())
    assert pc.masked_var(values, mask).item() == pytest.approx(picked.var(ddof=1))
    assert pc.masked_var(values, mask, unbiased=False).item() == pytest.approx(picked.var())
    whitened = pc.masked_whiten(values, mask)[mask].numpy()
    np.testing.assert_allclose(whitened, (picked - picked.mean()) / np.sqrt(picked.var(ddof=1) + 1e-8), rtol=1e-6)
    np.testing.assert_allclose(pc.masked_mean(values, mask, dim=1).numpy(),
                               [values[i][mask[i]].mean().item() for i in range(6)])


def test_masked_var_and_whiten_of_fewer_than_two_values():
    """One unmasked value (e.g. a batch of one row whose response is a single EOS) has no spread: variance 0,
    whitened value 0, no error; no value at all gives no NaN either."""
    values = torch.tensor([[2.5, 7.0, -1.0]])
    one = torch.tensor([[False, True, False]])
    assert pc.masked_var(values, one).item() == 0.0
    assert pc.masked_whiten(values, one)[one].item() == 0.0
    assert pc.masked_whiten(values, one, shift_mean=False)[one].item() == pytest.approx(7.0)
    assert pc.masked_var(values, torch.zeros_like(one)).item() == 0.0


def test_exact_div():
    assert pc.exact_div(12, 4, "x") == 3
    with pytest.raises(UserError, match="local_batch_size: 10 is not divisible by 4"):
        pc.exact_div(10, 4, "local_batch_size")


def test_pad_sequences():
    assert pc.pad_sequences([[1, 2], [3]], 0, "left").tolist() == [[1, 2], [0, 3]]
    assert pc.pad_sequences([[1, 2], [3]], 0, "right").tolist() == [[1, 2], [3, 0]]


# --------------------------------------------------------------------------------------------- log-probs
def unpadded_logprobs(model, query, response, temperature=1.0):
    """The obvious computation: one unpadded row, softmax(logits / T) with the pad token's probability removed
    and the rest renormalised (the distribution sampling draws from)."""
    ids = torch.tensor([query + response])
    p = (model(input_ids=ids).logits[0, len(query) - 1:-1] / temperature).softmax(-1)
    p = p * (torch.arange(p.shape[-1]) != PAD)
    return (p / p.sum(-1, keepdim=True)).log()[torch.arange(len(response)), torch.tensor(response)]


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 5)), min_size=1, max_size=4),
       st.sampled_from([1.0, 0.7, 1.3]))
def test_forward_logits_padding_invariant(lm, shapes, temperature):
    gen = torch.Generator().manual_seed(len(shapes) * 31 + sum(a * 7 + b for a, b in shapes))
    queries = random_queries(gen, [q for q, _ in shapes])
    responses = random_queries(gen, [r for _, r in shapes])
    q = pc.pad_sequences(queries, PAD, "left")
    r = pc.pad_sequences(responses, PAD, "right")
    with torch.no_grad():
        batch = pc.Forward(PAD, temperature).logprobs(lm, torch.cat([q, r], 1), q.shape[1])
        for i, (query, response) in enumerate(zip(queries, responses)):
            expected = unpadded_logprobs(lm, query, response, temperature)
            torch.testing.assert_close(batch[i, :len(response)], expected, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------- shared prompts
def grouped_batch(gen, group_sizes, max_query=6, max_response=5):
    """Rows in a shuffled order; the rows of group g share one query. Returns (query_responses, Lq, rows) with
    rows = [(query, response)] per row, unpadded."""
    rows = []
    for size in group_sizes:
        query = random_queries(gen, [int(torch.randint(1, max_query + 1, (1,), generator=gen))])[0]
        rows += [(query, r)
                 for r in random_queries(gen, torch.randint(1, max_response + 1, (size,), generator=gen).tolist())]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
    q = pc.pad_sequences([a for a, _ in rows], PAD, "left")
    r = pc.pad_sequences([b for _, b in rows], PAD, "right")
    return torch.cat([q, r], 1), q.shape[1], rows


class CountCalls:
    def __init__(self, model):
        self.n = 0
        model.register_forward_hook(lambda *a: setattr(self, "n", self.n + 1))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.sampled_from([1.0, 0.7]))
def test_shared_prompt_logprobs_equal_unpadded_rows(lm, group_sizes, temperature):
    """Each distinct query encoded once (cache rows selected per sequence) gives every row's log-probs of the
    obvious one-row computation, whatever the group sizes and the row order."""
    gen = torch.Generator().manual_seed(sum(s * 13 ** i for i, s in enumerate(group_sizes)))
    query_responses, lq, rows = grouped_batch(gen, group_sizes)
    calls = CountCalls(lm)
    with torch.no_grad():
        batch = ps.SharedPromptForward(PAD, temperature).logprobs(lm, query_responses, lq)
    assert calls.n == 2  # the distinct queries, then every row's response
    with torch.no_grad():
        for i, (query, response) in enumerate(rows):
            torch.testing.assert_close(batch[i, :len(response)], unpadded_logprobs(lm, query, response, temperature),
                                       atol=1e-5, rtol=0)


def test_shared_prompt_gradients_equal_the_plain_forward():
    torch.manual_seed(3)
    model = GPTNeoXForCausalLM(tiny_config()).train()
    query_responses, lq, _ = grouped_batch(torch.Generator().manual_seed(4), [3, 1, 2])
    mask = query_responses[:, lq:] != PAD
    grads = []
    for forward in (pc.Forward(PAD, 0.8), ps.SharedPromptForward(PAD, 0.8)):
        model.zero_grad()
        logprobs = forward.logprobs(model, query_responses, lq)
        ((logprobs * mask).sum(1) * torch.arange(1.0, 7.0)).sum().backward()  # rows weighted differently
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert g.abs().sum() > 0 or "embed" in name
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4)


def test_shared_prompts_other_architecture_and_lora():
    """A Llama-style model (rotary, RMSNorm, grouped KV heads) and a LoRA-wrapped policy share prompts too."""
    torch.manual_seed(5)
    llama = llama_model().eval()
    lora = models.add_lora(GPTNeoXForCausalLM(tiny_config()), r=4, alpha=8, dropout=0.0).eval()
    query_responses, lq, rows = grouped_batch(torch.Generator().manual_seed(6), [2, 3])
    for model in (llama, lora):
        calls = CountCalls(model)
        with torch.no_grad():
            shared = ps.SharedPromptForward(PAD).logprobs(model, query_responses, lq)
        assert calls.n == 2, type(model).__name__
        with torch.no_grad():
            for i, (query, response) in enumerate(rows):
                torch.testing.assert_close(shared[i, :len(response)], unpadded_logprobs(model, query, response),
                                           atol=1e-5, rtol=0)


def test_shared_prompts_fall_back_under_activation_checkpointing():
    torch.manual_seed(7)
    model = GPTNeoXForCausalLM(tiny_config()).train()
    query_responses, lq, _ = grouped_batch(torch.Generator().manual_seed(8), [3, 2])
    expected = pc.Forward(PAD).logprobs(model, query_responses, lq)
    models.enable_activation_checkpointing(model)
    calls = CountCalls(model)
    torch.testing.assert_close(ps.SharedPromptForward(PAD).logprobs(model, query_responses, lq), expected)
    assert calls.n == 1


class OlderStyleLM(GPTNeoXForCausalLM):
    """Custom model code of an older style: neither `logits_to_keep` nor a `cache` argument."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache)


def test_model_code_without_cache_or_logits_to_keep_arguments_runs_plain():
    torch.manual_seed(15)
    model = OlderStyleLM(tiny_config()).eval()
    query_responses, lq, rows = grouped_batch(torch.Generator().manual_seed(16), [2, 3])
    calls = CountCalls(model)
    with torch.no_grad():
        logprobs = ps.SharedPromptForward(PAD).logprobs(model, query_responses, lq)
    assert calls.n == 1  # a property of the model code, the same on every process: one plain forward
    with torch.no_grad():
        for i, (query, response) in enumerate(rows):
            torch.testing.assert_close(logprobs[i, :len(response)], unpadded_logprobs(model, query, response),
                                       atol=1e-5, rtol=0)


def test_worth_sharing_is_a_rule_on_sizes():
    # saved positions = (rows - prompts) * prompt_length, against max(20% of all positions, 128)
    assert ps.worth_sharing(rows=64, rows_per_prompt=4, prompt_length=8, response_length=8)  # 384 >= 204.8
    assert not ps.worth_sharing(rows=8, rows_per_prompt=4, prompt_length=8, response_length=8)  # 48 < 128
    assert not ps.worth_sharing(rows=64, rows_per_prompt=2, prompt_length=4, response_length=60)  # 128 < 819.2
    assert ps.worth_sharing(rows=16, rows_per_prompt=2, prompt_length=512, response_length=53)
    assert not ps.worth_sharing(rows=64, rows_per_prompt=1, prompt_length=512, response_length=53)  # nothing repeats
    assert not ps.worth_sharing(rows=64, rows_per_prompt=4, prompt_length=0, response_length=8)


def test_distinct_queries_first_rows_and_inverse():
    queries = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9], [1, 2, 3]])
    first, inverse = ps.distinct_queries(queries)
    assert torch.equal(queries[first][inverse], queries)
    assert sorted(first.tolist()) == [0, 1, 4]  # the first row of each distinct query


def test_forward_logits_applies_temperature_once(lm):
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        raw = lm(input_ids=ids).logits[:, 1:-1]
        scaled = pc.Forward(PAD, temperature=0.5).logits(lm, ids, 2)
    not_pad = torch.arange(VOCAB) != PAD
    torch.testing.assert_close(scaled[..., not_pad], raw[..., not_pad] / 0.5)
    assert (scaled[..., PAD] == scaled.amax(-1) - 1e4).all() and (scaled.softmax(-1)[..., PAD] == 0).all()


def test_selective_logprobs_equals_full_log_softmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, VOCAB, generator=gen)
    tokens = torch.randint(0, VOCAB, (3, 5), generator=gen)
    expected = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(pc.selective_logprobs(logits, tokens), expected)
    torch.testing.assert_close(pc.selective_logprobs(logits, tokens, chunk_bytes=1), expected)  # row by row
    torch.testing.assert_close(pc.selective_logprobs(logits.bfloat16(), tokens),
                               torch.log_softmax(logits.bfloat16().float(), -1)
                               .gather(-1, tokens.unsqueeze(-1)).squeeze(-1))


def test_entropy_from_logits():
    logits = torch.randn(2, 3, VOCAB)
    p = logits.softmax(-1)
    torch.testing.assert_close(pc.entropy_from_logits(logits), -(p * p.log()).sum(-1))


# --------------------------------------------------------------------------------------------- generation
def test_batch_generation_greedy_equals_one_at_a_time(lm):
    gen = torch.Generator().manual_seed(3)
    queries = random_queries(gen, [2, 5, 3, 6, 1])
    config = GenerationConfig(do_sample=False, max_new_tokens=6, pad_token_id=PAD, eos_token_id=EOS,
                              suppress_tokens=[PAD])
    q = pc.pad_sequences(queries, PAD, "left")
    for chunk_size in (2, 5):
        query_responses, logprobs = pc.batch_generation(lm, q, PAD, EOS, config, chunk_size=chunk_size)
        assert query_responses.shape == (5, q.shape[1] + 6)
        for i, query in enumerate(queries):
            alone = lm.generate(torch.tensor([query]), generation_config=config)[0, len(query):]
            alone = pc.truncate_after_eos(alone.unsqueeze(0), EOS, PAD)[0]
            got = query_responses[i, q.shape[1]:q.shape[1] + len(alone)]
            assert got.tolist() == alone.tolist(), (i, chunk_size)
            assert (query_responses[i, q.shape[1] + len(alone):] == PAD).all()


def test_batch_generation_shares_repeated_queries(lm):
    """k samples per prompt (repeat_interleave order, 1-token queries included): each distinct query is encoded
    once, and greedy outputs equal generating every row alone."""
    gen = torch.Generator().manual_seed(12)
    queries = [q for q in random_queries(gen, [3, 1, 5]) for _ in range(3)]
    config = GenerationConfig(do_sample=False, max_new_tokens=5, pad_token_id=PAD, eos_token_id=EOS,
                              suppress_tokens=[PAD])
    q = pc.pad_sequences(queries, PAD, "left")
    seen = []
    hook = lm.register_forward_hook(lambda m, a, kw, out: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        query_responses, _ = pc.batch_generation(lm, q, PAD, EOS, config, chunk_size=9,
                                                 forward=ps.SharedPromptForward(PAD))
    finally:
        hook.remove()
    assert seen[0] == (3, q.shape[1] - 1) and seen[1] == (9, 1)  # 3 distinct prefixes, then the last query token
    for i, query in enumerate(queries):
        alone = pc.truncate_after_eos(lm.generate(torch.tensor([query]), generation_config=config)[:, len(query):],
                                      EOS, PAD)[0]
        assert query_responses[i, q.shape[1]:q.shape[1] + len(alone)].tolist() == alone.tolist(), i


def eos_biased_model(seed=4):
    """A tiny model biased towards EOS, so that sampled rows end at different lengths."""
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[EOS] += 0.15 * head[2:].mean(0) + 0.02  # raise P(EOS) somewhat
        head[PAD] += 0.3 * head[2:].mean(0) + 0.05  # and give pad real mass, so an unmasked pad would show
    return model


def pad_free_row_logprobs(model, query, response, temperature):
    """The obvious computation, one unpadded row at a time: log-probs and entropies of `response` under
    softmax(logits / T) with the pad token's probability removed and the rest renormalised."""
    ids = torch.tensor([query + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(query) - 1:-1].double() / temperature  # (r, V)
    p = logits.softmax(-1)
    p[:, PAD] = 0.0
    p = p / p.sum(-1, keepdim=True)
    entropy = -(p[:, 1:] * p[:, 1:].log()).sum(-1) if PAD == 0 else None
    return p.log()[torch.arange(len(response)), response], entropy


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("share", [False, True])
def test_batch_generation_logprobs_and_entropy_equal_a_fresh_forward(share, cache):
    """Rows ending at different lengths, left-padded queries, chunks: the sampling log-probs and entropies equal
    (i) `Forward.logits` on the padded batch (pad masked: one distribution) and (ii) an unpadded row-by-row forward
    with the pad token's mass removed; also when repeated queries are encoded once (a SharedPromptForward, in
    generation's prefill and in the forward), and on a static key/value cache. `Forward.logprobs_no_grad` (the
    no-grad, chunked scoring of given samples) equals (ii) too, with or without entropy."""
    model = eos_biased_model()
    gen = torch.Generator().manual_seed(5)
    queries = random_queries(gen, [3, 1, 4, 2] * 4)
    q = pc.pad_sequences(queries, PAD, "left")
    temperature = 0.8
    forward = (ps.SharedPromptForward if share else pc.Forward)(PAD, temperature)
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=8,
                              pad_token_id=PAD, eos_token_id=EOS, suppress_tokens=[PAD], cache_implementation=cache)
    torch.manual_seed(6)
    query_responses, logprobs, entropy = pc.batch_generation(model, q, PAD, EOS, config, chunk_size=5,
                                                             forward=forward, return_entropy=True)
    responses = query_responses[:, q.shape[1]:]
    eos_at = pc.first_true_indices(responses == EOS)
    assert 0 < (eos_at < 8).sum() < 16, "want rows that end early and rows that do not"
    in_response = torch.arange(8).unsqueeze(0) <= eos_at.unsqueeze(1)  # up to and including the first EOS
    assert (responses[~in_response] == PAD).all()
    assert (logprobs[~in_response] == pc.PADDING_LOGPROB).all() and (entropy[~in_response] == 0).all()
    with torch.no_grad():
        logits = forward.logits(model, query_responses, q.shape[1])
        fresh = pc.selective_logprobs(logits, responses)
    torch.testing.assert_close(logprobs[in_response], fresh[in_response], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[in_response], pc.entropy_from_logits(logits)[in_response], atol=1e-5, rtol=0)
    rollout, rollout_entropy = forward.logprobs_no_grad(model, query_responses, q.shape[1], chunk_size=5,
                                                        entropy=True)
    assert torch.equal(forward.logprobs_no_grad(model, query_responses, q.shape[1], chunk_size=5), rollout)
    for i, query in enumerate(queries):
        n = int(in_response[i].sum())
        expected, expected_entropy = pad_free_row_logprobs(model, query, responses[i, :n].tolist(), temperature)
        torch.testing.assert_close(logprobs[i, :n].double(), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[i, :n].double(), expected_entropy, atol=1e-5, rtol=0)
        torch.testing.assert_close(rollout[i, :n].double(), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(rollout_entropy[i, :n].double(), expected_entropy, atol=1e-5, rtol=0)


def sliding_window_model():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                            max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS,
                                            bos_token_id=EOS))


def llama_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS))


GENERATION_MODELS = {"neox": eos_biased_model, "llama": llama_model, "sliding_window": sliding_window_model,
                     "lora": lambda: models.add_lora(eos_biased_model(), r=4, alpha=8, dropout=0.0)}


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("name", sorted(GENERATION_MODELS))
def test_static_cache_samples_the_dynamic_caches_tokens(name, share):
    """cache_implementation "static" (make_generation_config's): every decoding forward of batch_generation runs on
    a transformers StaticCache of exactly Lq + R positions, and the same seed samples the tokens the dynamic cache
    samples, with the same log-probs and entropies: left-padded queries of several lengths repeated over rows
    (prompt sharing prefills the static cache), two chunks, GPT-NeoX, Llama, a sliding window shorter than the
    longest query, and LoRA."""
    from transformers.cache_utils import DynamicCache, StaticCache

    class Tok:
        pad_token_id, eos_token_id, bos_token_id = PAD, EOS, None

    torch.manual_seed(7)
    model = GENERATION_MODELS[name]().eval()
    inner = model.get_base_model() if name == "lora" else model
    q = pc.pad_sequences(random_queries(torch.Generator().manual_seed(8), [3, 1, 7, 5]), PAD, "left")
    q = q.repeat_interleave(3, 0)  # (12, 7): each query 3 times in a row
    seen = []
    hook = inner.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw[models.cache_argument(inner)]) if kw["input_ids"].shape[1] == 1 else None,
        with_kwargs=True)
    outputs = {}
    try:
        for cache in ("dynamic", "static"):
            config = pc.make_generation_config(Tok, 8, temperature=0.9, cache_implementation=cache)
            seen.clear()
            torch.manual_seed(9)
            outputs[cache] = pc.batch_generation(model, q, PAD, EOS, config, chunk_size=6,
                                                 forward=(ps.SharedPromptForward if share else pc.Forward)(PAD),
                                                 return_entropy=True)
            assert seen and all(type(c) is {"dynamic": DynamicCache, "static": StaticCache}[cache] for c in seen)
    finally:
        hook.remove()
    if name != "sliding_window":  # (a sliding layer keeps its window only)
        assert {c.layers[0].max_cache_len for c in seen} == {q.shape[1] + 8}
    (dynamic, dynamic_logprobs, dynamic_entropy), (static, static_logprobs, static_entropy) = outputs.values()
    assert torch.equal(static, dynamic)
    torch.testing.assert_close(static_logprobs, dynamic_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(static_entropy, dynamic_entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lora", [False, True])
def test_batch_generation_ignores_the_models_own_sampling_defaults(lora):
    """A model whose generation_config.json asks for a repetition penalty and top-k (as Qwen2.5-Instruct's does)
    still samples from softmax(logits / T) without pad: the log-probs equal the forward's, and the model's config is
    left as it was."""
    model = eos_biased_model(seed=9)
    model.generation_config.repetition_penalty, model.generation_config.top_k = 3.0, 2
    if lora:
        model = models.add_lora(model, r=4, alpha=8, dropout=0.0)
    q = pc.pad_sequences(random_queries(torch.Generator().manual_seed(10), [3, 2, 4, 3]), PAD, "left")
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                              pad_token_id=PAD, eos_token_id=EOS, suppress_tokens=[PAD])
    torch.manual_seed(11)
    query_responses, logprobs = pc.batch_generation(model, q.repeat(4, 1), PAD, EOS, config, chunk_size=16)
    mask = query_responses[:, q.shape[1]:] != PAD
    forward = pc.Forward(PAD).logprobs(model, query_responses, q.shape[1]).detach()
    torch.testing.assert_close(logprobs[mask], forward[mask], atol=1e-5, rtol=0)
    inner = model.get_base_model() if lora else model
    assert inner.generation_config.repetition_penalty == 3.0 and inner.generation_config.top_k == 2


def test_forward_masks_pad_without_nan_gradients():
    """Pad gets no probability in every forward (the renormalised distribution, checked against softmax by hand);
    log-probs read at pad positions are finite, so masked losses and their gradients stay finite; the pad logit
    gets no gradient."""
    model = eos_biased_model(seed=13)
    q = pc.pad_sequences([[5, 6, 7], [8]], PAD, "left")
    query_responses = torch.cat([q, torch.tensor([[9, EOS, PAD, PAD], [10, 11, 12, EOS]])], 1)
    logits = pc.Forward(PAD, temperature=0.5).logits(model, query_responses, q.shape[1])
    assert (logits.softmax(-1)[..., PAD] == 0).all()
    with torch.no_grad():  # row 2 unpadded, p(token) / (1 - p(pad)) by hand
        p = (model(input_ids=torch.tensor([[8, 10, 11, 12, EOS]])).logits[0, :-1] / 0.5).softmax(-1)
    expected = (p / (1 - p[:, PAD:PAD + 1])).log()[torch.arange(4), torch.tensor([10, 11, 12, EOS])]
    logprobs = pc.selective_logprobs(logits, query_responses[:, q.shape[1]:])
    torch.testing.assert_close(logprobs[1], expected, atol=1e-5, rtol=0)
    assert torch.isfinite(logprobs ** 2).all() and torch.isfinite(logprobs.exp()).all()  # stats on unmasked values
    mask = query_responses[:, q.shape[1]:] != PAD
    (logprobs * mask).sum().backward()
    head = model.get_output_embeddings().weight.grad
    assert torch.isfinite(head).all() and (head[PAD] == 0).all() and head[EOS].abs().sum() > 0


@pytest.mark.parametrize("share", [False, True])
def test_forward_grad_rows_keeps_no_gradient_of_the_other_rows(share):
    """grad_rows=n: the same logits as one full forward (rows repeat queries, so that a SharedPromptForward shares
    them); only rows 0..n-1 carry a gradient, equal to the full forward's; rows n.. carry none."""
    model = eos_biased_model(seed=5)
    q = pc.pad_sequences([[5, 6, 7], [8], [5, 6, 7], [8]], PAD, "left")
    query_responses = torch.cat([q, torch.tensor([[9, EOS, PAD], [10, 11, EOS], [12, EOS, PAD], [9, 9, 9]])], 1)
    ctx, params = q.shape[1], list(model.parameters())
    forward = (ps.SharedPromptForward if share else pc.Forward)(PAD)
    full = forward.logits(model, query_responses, ctx)
    split = forward.logits(model, query_responses, ctx, grad_rows=2)
    torch.testing.assert_close(split, full, atol=1e-5, rtol=0)
    weights = torch.randn(full.shape)
    expected = torch.autograd.grad((full[:2] * weights[:2]).sum(), params)
    got = torch.autograd.grad((split[:2] * weights[:2]).sum(), params, retain_graph=True)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
    assert not split[2:].requires_grad or all(
        g is None or not g.any() for g in torch.autograd.grad(split[2:].sum(), params, allow_unused=True))


def test_make_generation_config():
    class Tok:
        pad_token_id, eos_token_id, bos_token_id = PAD, EOS, None

    sample = pc.make_generation_config(Tok, 10, temperature=0.7, min_new_tokens=2)
    assert sample.do_sample and sample.temperature == 0.7 and sample.top_k == 0 and sample.top_p == 1.0
    assert sample.max_new_tokens == 10 and sample.min_new_tokens == 2
    assert sample.pad_token_id == PAD and sample.eos_token_id == EOS
    assert not pc.make_generation_config(Tok, 10, greedy=True).do_sample
    assert sample.cache_implementation is None and not sample.disable_compile  # transformers' default cache
    assert pc.make_generation_config(Tok, 10, cache_implementation="dynamic").cache_implementation is None
    static = pc.make_generation_config(Tok, 10, greedy=True, cache_implementation="static")
    assert static.cache_implementation == "static" and static.disable_compile  # a new prompt length each batch
    with pytest.raises(UserError, match="temperature"):
        pc.make_generation_config(Tok, 10, temperature=0.0)


# --------------------------------------------------------------------------------------------- scalar heads
def test_scalar_forward_rewards_read_the_last_real_token():
    torch.manual_seed(7)
    rm = GPTNeoXForSequenceClassification(tiny_config(num_labels=1)).eval()
    gen = torch.Generator().manual_seed(8)
    queries, responses = random_queries(gen, [2, 4, 3]), random_queries(gen, [3, 1, 2])
    q, r = pc.pad_sequences(queries, PAD, "left"), pc.pad_sequences(responses, PAD, "right")
    with torch.no_grad():
        scores = pc.ScalarForward(PAD).rewards(rm, torch.cat([q, r], 1))
        for i in range(3):
            ids = torch.tensor([queries[i] + responses[i]])
            hidden = rm.gpt_neox(input_ids=ids).last_hidden_state
            assert scores[i].item() == pytest.approx(rm.score(hidden)[0, -1, 0].item(), abs=1e-5)


def test_shared_prompt_scalar_forward_reads_the_same_scores():
    torch.manual_seed(10)
    rm = GPTNeoXForSequenceClassification(tiny_config(num_labels=1)).eval()
    query_responses, lq, rows = grouped_batch(torch.Generator().manual_seed(11), [3, 2, 1])
    forward = ps.SharedPromptScalarForward(PAD)
    with torch.no_grad():
        calls = CountCalls(rm.gpt_neox)
        scores = forward.rewards(rm, query_responses, context_length=lq)
        values = forward.values(rm, query_responses, context_length=lq)
        assert calls.n == 4  # two calls each: the distinct queries, then the responses
        for i, (query, response) in enumerate(rows):
            hidden = rm.gpt_neox(input_ids=torch.tensor([query + response])).last_hidden_state
            expected = rm.score(hidden)[0, :, 0]
            assert scores[i].item() == pytest.approx(expected[-1].item(), abs=1e-5)
            # per-token values at the real positions: query right-aligned in [0, Lq), response from Lq on
            real = torch.cat([values[i, lq - len(query):lq], values[i, lq:lq + len(response)]])
            torch.testing.assert_close(real, expected, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------- reference modes
def test_adapter_off_reference_is_the_base_model_before_and_after_training():
    torch.manual_seed(9)
    base = GPTNeoXForCausalLM(tiny_config()).eval()
    base_copy = GPTNeoXForCausalLM(tiny_config()).eval()
    base_copy.load_state_dict(base.state_dict())
    policy = models.add_lora(base, r=4, alpha=8, dropout=0.0, target_modules=["query_key_value", "dense"])
    forward = pc.Forward(PAD)
    reference = pc.Reference("adapter_off", forward, policy=policy)
    ids = torch.tensor([[PAD, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, PAD]])
    with torch.no_grad():
        expected = forward.logprobs(base_copy, ids, 3)
    torch.testing.assert_close(reference.logprobs(ids, 3), expected)
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0)
    for _ in range(3):  # LoRA B starts at zero; after steps the adapter changes the policy's output
        loss = -forward.logprobs(policy, ids, 3).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        assert not torch.allclose(forward.logprobs(policy, ids, 3), expected, atol=1e-4)
    torch.testing.assert_close(reference.logprobs(ids, 3), expected)


def test_reference_logits_and_its_unshared_twin():
    """Reference.logits is its forward's `logits` (temperature, pad masked) without gradient; `.unshared()` is the
    same reference with prompt sharing off (the same numbers); a reference-free run has no distribution."""
    torch.manual_seed(14)
    model = GPTNeoXForCausalLM(tiny_config())
    reference = pc.Reference("copy", ps.SharedPromptForward(PAD, 0.7), model=model)
    query_responses, lq, _ = grouped_batch(torch.Generator().manual_seed(15), [3, 2])
    logits = reference.logits(query_responses, lq)
    assert not logits.requires_grad
    with torch.no_grad():
        expected = pc.Forward(PAD, 0.7).logits(model, query_responses, lq)
    mask = query_responses[:, lq:] != PAD
    torch.testing.assert_close(logits[mask], expected[mask], atol=1e-5, rtol=0)
    unshared = reference.unshared()
    assert type(unshared.forward) is pc.Forward and unshared.forward.temperature == 0.7
    assert reference.forward.shares_prompts and unshared.model is model
    torch.testing.assert_close(unshared.logprobs(query_responses, lq)[mask],
                               reference.logprobs(query_responses, lq)[mask], atol=1e-5, rtol=0)
    with pytest.raises(UserError, match="no reference distribution"):
        pc.Reference("none").logits(query_responses, lq)


def test_frozen_copy_unchanged_by_training(tmp_path):
    torch.manual_seed(10)
    GPTNeoXForCausalLM(tiny_config()).save_pretrained(tmp_path / "m")
    _save_tiny_tokenizer(tmp_path / "m", with_pad=True)
    tokenizer = models.load_tokenizer(str(tmp_path / "m"))
    policy = models.load_causal_lm(str(tmp_path / "m"), tokenizer)
    forward_for = forwards.Forwards(tokenizer.pad_token_id).lm
    reference = pc.create_reference(policy, tokenizer, forward_for, policy_name=str(tmp_path / "m"))
    assert reference.mode == "copy" and reference.model is not policy
    assert not any(p.requires_grad for p in reference.model.parameters())
    before = {k: v.clone() for k, v in reference.model.state_dict().items()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    for _ in range(3):
        pc.Forward(PAD).logprobs(policy, ids, 2).sum().neg().backward()
        optimizer.step()
        optimizer.zero_grad()
    for k, v in reference.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not torch.equal(policy.state_dict()["lm_head.weight"], before["lm_head.weight"])
    none = pc.create_reference(policy, tokenizer, forward_for, policy_name=str(tmp_path / "m"), reference_free=True)
    assert torch.equal(none.logprobs(ids, 2), torch.zeros(1, 3))


# --------------------------------------------------------------------------------------------- loading
def _save_tiny_tokenizer(path, with_pad: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kwargs = dict(eos_token="t1", unk_token="t2", **({"pad_token": "t0"} if with_pad else {}))
    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(path)


def test_tokenizer_without_pad_gets_a_distinct_one_and_model_is_resized(tmp_path):
    torch.manual_seed(11)
    GPTNeoXForCausalLM(tiny_config()).save_pretrained(tmp_path)
    _save_tiny_tokenizer(tmp_path, with_pad=False)
    tokenizer = models.load_tokenizer(str(tmp_path))
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    model = models.load_causal_lm(str(tmp_path), tokenizer)
    assert model.get_input_embeddings().num_embeddings >= len(tokenizer)
    assert model.config.pad_token_id == tokenizer.pad_token_id


def test_tokenizer_without_eos_is_refused(tmp_path):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", unk_token="t2").save_pretrained(tmp_path)
    with pytest.raises(UserError, match="no EOS token"):
        models.load_tokenizer(str(tmp_path))


def test_dropout_disabled_and_dtype(tmp_path):
    torch.manual_seed(12)
    GPTNeoXForCausalLM(tiny_config(hidden_dropout=0.3, attention_dropout=0.3)).save_pretrained(tmp_path)
    _save_tiny_tokenizer(tmp_path, with_pad=True)
    tokenizer = models.load_tokenizer(str(tmp_path))
    model = models.load_causal_lm(str(tmp_path), tokenizer).train()
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_bad_model_names_fail_in_one_line():
    with pytest.raises(UserError, match="does not exist"):
        models.load_tokenizer("./no/such/model")
    with pytest.raises(UserError, match="unreachable|could not load"):
        models.load_tokenizer("no-such-model-xyz")


def test_check_same_vocab(tmp_path):
    _save_tiny_tokenizer(tmp_path / "a", with_pad=True)
    _save_tiny_tokenizer(tmp_path / "b", with_pad=False)
    a, b = models.load_tokenizer(str(tmp_path / "a")), models.load_tokenizer(str(tmp_path / "b"))
    models.check_same_vocab(a, a)
    with pytest.raises(UserError, match="share a vocabulary"):
        models.check_same_vocab(a, b)


def _shared_flags(**overrides):
    from types import SimpleNamespace

    flags = dict(bf16=False, fp16=False, cast_lm_head_to_fp32=False, trust_remote_code=False, load_in_4bit=False,
                 gradient_checkpointing=False, use_peft=False, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                 lora_target_modules=None)
    return SimpleNamespace(**{**flags, **overrides})


def test_load_policy_checkpointed_lora_trains_like_the_plain_one(toy):
    """Activation checkpointing on a LoRA policy (frozen base) still gives the adapter its gradients, equal to
    those of the same policy without checkpointing."""
    tokenizer = models.load_tokenizer(toy["policy"])
    ids = torch.tensor([[5, 6, 7, 3, 5, 6, 7, 1]])
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        policy = models.load_policy(toy["policy"], tokenizer,
                                _shared_flags(use_peft=True, gradient_checkpointing=checkpointing)).train()
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        pc.Forward(tokenizer.pad_token_id).logprobs(policy, ids, 4).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad})
    assert grads[0] and all(g.abs().sum() > 0 for g in grads[1].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4)
    with pytest.raises(UserError, match="--load_in_4bit needs --use_peft"):
        models.load_policy(toy["policy"], tokenizer, _shared_flags(load_in_4bit=True))


def test_create_reference_defaults_to_the_starting_policy_and_checks_vocab(toy, tmp_path):
    tokenizer = models.load_tokenizer(toy["policy"])
    policy = models.load_policy(toy["policy"], tokenizer, _shared_flags())
    forward_for = forwards.Forwards(tokenizer.pad_token_id).lm
    reference = pc.create_reference(policy, tokenizer, forward_for, policy_name=toy["policy"])
    assert reference.mode == "copy" and reference.model is not policy
    for a, b in zip(reference.model.parameters(), policy.parameters()):
        assert torch.equal(a, b)
    GPTNeoXForCausalLM(tiny_config()).save_pretrained(tmp_path / "other")
    _save_tiny_tokenizer(tmp_path / "other", with_pad=True)
    with pytest.raises(UserError, match="reference model's tokenizer differs"):
        pc.create_reference(policy, tokenizer, forward_for, policy_name=toy["policy"],
                            ref_model=str(tmp_path / "other"))
