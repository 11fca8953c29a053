"""prompt_sharing.split_logits and fork_cache: some rows scored without gradient on a fork of the shared prompts'
key/value cache give shared_logits' numbers, no gradient from those rows, the others' gradients unchanged, for
GPT-NeoX, Llama and LoRA models; a fork and its cache change independently."""

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache, StaticCache

import policy_common as pc
from plumbing import models
from plumbing import prompt_sharing as ps

PAD, VOCAB = 0, 40


def neox():
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                           eos_token_id=1, pad_token_id=PAD)
    return GPTNeoXForCausalLM(config)


def llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=PAD, eos_token_id=1, bos_token_id=1))


MODELS = {"neox": neox, "llama": llama, "lora": lambda: models.add_lora(neox(), r=4, alpha=8, dropout=0.0)}


def batch(seed: int):
    """(B, T) rows [left-padded query | right-padded response], 3 distinct queries over 7 rows in a shuffled
    order; returns (query_responses, Lq, attention_mask, position_ids)."""
    gen = torch.Generator().manual_seed(seed)
    queries = [torch.randint(2, VOCAB, (int(n),), generator=gen).tolist() for n in (5, 9, 7)]
    order = [0, 2, 1, 0, 2, 2, 1]
    responses = [torch.randint(2, VOCAB, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in order]
    q = pc.pad_sequences([queries[i] for i in order], PAD, "left")
    query_responses = torch.cat([q, pc.pad_sequences(responses, PAD, "right")], 1)
    return (query_responses, q.shape[1], *pc.padding_inputs(query_responses, PAD))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("n", [1, 4, 6])
def test_split_logits_equal_shared_logits_and_rows_from_n_give_no_gradient(name, n):
    torch.manual_seed(1)
    model = MODELS[name]().train()
    query_responses, lq, mask, positions = batch(2)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.arange(1.0, 8.0)[:, None, None] * (torch.arange(7) < n)[:, None, None]  # rows < n only
    shared = ps.shared_logits(model, query_responses, mask, positions, lq, logits_to_keep=1)
    expected = torch.autograd.grad((shared.log_softmax(-1) * weights).sum(), params)
    grad_modes = []
    hook = model.register_forward_pre_hook(lambda *a: grad_modes.append(torch.is_grad_enabled()))
    split = ps.split_logits(model, query_responses, mask, positions, lq, n, logits_to_keep=1)
    hook.remove()
    assert grad_modes == [True, False, True]  # the queries, rows n.. without gradient, rows ..n with
    torch.testing.assert_close(split.detach(), shared.detach(), atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad((split.log_softmax(-1) * weights).sum(), params, retain_graph=True)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
    # rows n.. are constants: a loss on them alone gets a zero gradient (through the concatenation)
    assert all(g is None or not g.any() for g in torch.autograd.grad(split[n:].sum(), params, allow_unused=True))


def test_split_logits_is_none_without_a_cache_to_fork():
    class NoCache(GPTNeoXForCausalLM):  # returns no cache although it takes one
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.cache = None
            return out

    torch.manual_seed(3)
    model = NoCache(neox().config)
    query_responses, lq, mask, positions = batch(4)
    assert ps.split_logits(model, query_responses, mask, positions, lq, 3) is None


def test_a_fork_and_its_cache_change_independently():
    torch.manual_seed(5)
    model = neox().eval()
    ids = torch.randint(2, VOCAB, (2, 6))
    with torch.no_grad():
        name = models.cache_argument(model)  # `cache` or `past_key_values`, by transformers release
        cache = getattr(model(input_ids=ids, use_cache=True), name)
        keys = [layer.keys.clone() for layer in cache.layers]
        fork = ps.fork_cache(cache)
        fork.batch_select_indices(torch.tensor([1, 1, 0]))
        model(input_ids=torch.randint(2, VOCAB, (3, 4)), use_cache=True, **{name: fork})
    assert fork.get_seq_length() == 10 and fork.layers[0].keys.shape[0] == 3
    assert cache.get_seq_length() == 6 and all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, keys))
    assert ps.fork_cache(StaticCache(config=model.config, max_cache_len=16)) is None  # written in place
    assert isinstance(ps.fork_cache(DynamicCache(config=model.config)), DynamicCache)


def test_the_pinned_transformers_models_take_a_cache():
    # the cache argument was renamed (past_key_values -> cache in transformers 5.20): if neither name is found the
    # fast path silently turns off everywhere, so check it is on for the architectures the tests use
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    for model in (neox(), neox().gpt_neox, llama):
        assert models.cache_argument(model) in ("cache", "past_key_values")
        assert ps.takes_cache(model.eval())
