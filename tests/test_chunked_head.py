"""The chunked output layer (chunked_head.ChunkedHead around the plain or prompt-sharing forward,
--logprob_chunk_tokens) against the obvious computation: each row run alone without padding, full logits, log-softmax.
Also: no rows x tokens x vocabulary tensor exists on the chunked path, generation keeps only the sampled tokens'
log-probs, models that transform their output layer's result are served by the full path or stopped, and every script
gives the same numbers with and without chunks."""

import math

import pytest
import torch
from conftest import assert_same_numbers, read_metrics, run_distributed, run_script, tiny_args
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

import policy_common as pc
from plumbing import chunked_head, forwards, models
from plumbing import prompt_sharing as ps
from plumbing.errors import UserError

PAD, EOS, VOCAB = 0, 1, 53


def neox(vocab=VOCAB, hidden=32, **kw):
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * hidden,
        max_position_embeddings=64, rotary_pct=0.25, tie_word_embeddings=False, hidden_dropout=0.0,
        attention_dropout=0.0, eos_token_id=EOS, bos_token_id=EOS, pad_token_id=PAD, **kw))


def llama():
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS))


MODELS = {"gpt_neox": neox, "llama_tied": llama,
          "lora": lambda: models.add_lora(neox(), r=4, alpha=8, dropout=0.0)}


def batch(seed: int, queries=(3, 5, 5, 2, 3, 3), responses=(6, 2, 6, 4, 1, 6), lq=5, R=6):
    """Rows [left pads | query | response | right pads]; queries 1-2 and 4-5 repeat (prompt sharing has work).
    Returns (query_responses (B, lq + R), [(query, response) token lists])."""
    gen = torch.Generator().manual_seed(seed)
    rows, seen = [], {}
    for i, (q, r) in enumerate(zip(queries, responses)):
        query = seen.setdefault(q, torch.randint(2, VOCAB, (q,), generator=gen).tolist()) if i else \
            torch.randint(2, VOCAB, (q,), generator=gen).tolist()
        rows.append((query, torch.randint(2, VOCAB, (r,), generator=gen).tolist()))
    qr = torch.full((len(rows), lq + R), PAD)
    for i, (query, response) in enumerate(rows):
        qr[i, lq - len(query):lq] = torch.tensor(query)
        qr[i, lq:lq + len(response)] = torch.tensor(response)
    return qr, rows


def obvious(model, rows, temperature: float, mask_pad: bool = True):
    """Each row alone, unpadded: the full logits of its response positions / temperature, pad given no probability
    (with `mask_pad`); returns [(log-probs of its response tokens, entropy there)] with autograd."""
    out = []
    for query, response in rows:
        ids = torch.tensor([query + response])
        logits = model(input_ids=ids).logits[0, len(query) - 1:-1] / temperature  # (r, V)
        if mask_pad:
            logits = logits.masked_fill(torch.arange(logits.shape[-1]) == PAD, -math.inf)
        logp = logits.log_softmax(-1)
        entropy = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)
        out.append((logp.gather(-1, torch.tensor(response)[:, None])[:, 0], entropy.detach()))
    return out


def weights(rows):  # a different weight per token, so every token's gradient counts
    return [torch.linspace(-1.0, 2.0, len(r)) * (i + 1) for i, (_, r) in enumerate(rows)]


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def chunked(chunk_tokens, temperature=1.0, share=False):
    """The output layer `chunk_tokens` positions at a time, around the plain forward or the prompt-sharing one."""
    return chunked_head.ChunkedHead((ps.SharedPromptForward if share else pc.Forward)(PAD, temperature), chunk_tokens)


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("temperature,share,chunk", [(1.0, False, 1), (0.7, False, 7), (0.7, True, 5),
                                                     (1.0, True, 16)])
def test_logprobs_entropy_and_gradients_equal_the_obvious_computation(arch, temperature, share, chunk):
    model = MODELS[arch]().train()
    qr, rows = batch(seed=3)
    lq = 5
    expected = obvious(model, rows, temperature)
    model.zero_grad()
    sum(w @ lp for w, (lp, _) in zip(weights(rows), expected)).backward()
    expected_grads = grads(model)
    model.zero_grad()
    forward = chunked(chunk, temperature, share)
    logprobs, entropy = forward.logprobs(model, qr, lq, entropy=True)
    assert chunked_head.wanted(model, logprobs.numel(), chunk) and forward.chunked(model, logprobs.numel())
    assert not entropy.requires_grad
    sum(w @ logprobs[i, :len(w)] for i, w in enumerate(weights(rows))).backward()
    for i, (_, response) in enumerate(rows):
        torch.testing.assert_close(logprobs[i, :len(response)], expected[i][0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[i, :len(response)], expected[i][1], atol=2e-5, rtol=1e-5)
    got = grads(model)
    assert set(got) == set(expected_grads)
    for name, g in expected_grads.items():
        torch.testing.assert_close(got[name], g, atol=2e-5, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for n, g in got.items() if "lora" in n or arch != "lora")


def test_full_softmax_for_sft_and_rows_without_gradient():
    """mask_pad=False (SFT's full softmax) and grad_rows (KTO's mismatched half): rows from grad_rows on carry values
    but no gradient."""
    model = neox().train()
    qr, rows = batch(seed=4)
    expected = obvious(model, rows[:3], 1.0, mask_pad=False)
    model.zero_grad()
    sum(w @ lp for w, (lp, _) in zip(weights(rows), expected)).backward()
    expected_grads = grads(model)
    model.zero_grad()
    for share in (False, True):
        model.zero_grad()
        logprobs = chunked(4, share=share).logprobs(model, qr, 5, grad_rows=3, mask_pad=False)
        sum(w @ logprobs[i, :len(w)] for i, w in enumerate(weights(rows)[:3])).backward()
        for name, g in expected_grads.items():
            torch.testing.assert_close(model.get_parameter(name).grad, g, atol=2e-5, rtol=1e-4)
        with torch.no_grad():
            full = pc.Forward(PAD).logprobs(model, qr, 5, mask_pad=False)
        torch.testing.assert_close(logprobs.detach(), full, atol=2e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 6)), min_size=1, max_size=5), st.integers(1, 40),
       st.sampled_from([1.0, 0.6]))
def test_any_padding_and_chunk_size_gives_the_full_path_numbers(shapes, chunk, temperature):
    """Rows of any query/response lengths (empty responses included), any chunk size: chunked = full logits."""
    model = MODEL_FOR_HYPOTHESIS
    qr, _ = batch(seed=len(shapes) * 100 + chunk, queries=[q for q, _ in shapes], responses=[r for _, r in shapes])
    with torch.no_grad():
        full = pc.Forward(PAD, temperature).logprobs(model, qr, 5, entropy=True)
        in_chunks = chunked(chunk, temperature).logprobs(model, qr, 5, entropy=True)
    real = qr[:, 5:] != PAD
    for a, b in zip(in_chunks, full):
        torch.testing.assert_close(a[real], b[real], atol=2e-5, rtol=1e-5)


MODEL_FOR_HYPOTHESIS = neox().eval()


class LargestLogits(TorchDispatchMode):
    """Records the most rows any op output of shape (..., V) had: the logits and everything computed from them. A
    (V, H) matrix seen transposed (the output layer's weight, its gradient) is (H, V) with stride 1 along H:
    left out."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab and t.stride(-1) == 1:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_rows_x_tokens_x_vocabulary_tensor_on_the_chunked_path():
    """Forward and backward: on the chunked path no tensor holds more than one chunk's positions x V (the output
    layer's weight is (V, H)); the full path holds B x (R + 1) x V (so the check can fail)."""
    vocab = 211  # unlike any other size in the model
    model = neox(vocab=vocab).train()
    qr, _ = batch(seed=5)
    n = qr.shape[0] * 6  # response positions; the full path's model call computes one more per row
    for chunk, most in ((0, qr.shape[0] * 7), (5, 5), (13, math.ceil(n / math.ceil(n / 13)))):
        model.zero_grad()
        with LargestLogits(vocab) as seen:
            logprobs, _ = chunked(chunk, 0.7).logprobs(model, qr, 5, entropy=True)
            logprobs.sum().backward()
        assert seen.rows == most, (chunk, seen.rows)


def test_default_chunk_follows_the_vocabulary():
    """None: 256 MiB of float32 logits, 2**26 / V positions; a 53-word vocabulary is never chunked at test sizes,
    a 50,304-word one from 1,335 positions on; 0 is off."""
    small, pythia = neox(), neox(vocab=50304, hidden=8)
    assert chunked_head.resolve_chunk_tokens(small, None) == 2**26 // VOCAB
    assert chunked_head.resolve_chunk_tokens(pythia, None) == 1334
    assert not chunked_head.wanted(pythia, 1334, None) and chunked_head.wanted(pythia, 1335, None)
    assert not chunked_head.wanted(pythia, 10**6, 0)
    assert not chunked(None).chunked(pythia, 1334) and chunked(None).chunked(pythia, 1335)  # ChunkedHead's own test
    assert not chunked(0).chunked(pythia, 10**6)
    lora = models.add_lora(neox(vocab=50304, hidden=8), r=2, alpha=4, dropout=0.0)
    assert chunked_head.resolve_chunk_tokens(lora, None) == 1334


def test_models_that_transform_their_output_use_the_full_path_or_stop():
    """A soft-capping config (Gemma's field) is served by the full logits; a forward that changes the output layer's
    result without a known field is stopped with an error naming the flag, never silently wrong."""
    capped = neox(final_logit_softcapping=30.0)
    assert not chunked_head.supported(capped)
    assert type(forwards.Forwards(PAD, chunk_tokens=3).lm(capped)) is pc.Forward  # never wrapped in a ChunkedHead
    qr, _ = batch(seed=6)
    torch.testing.assert_close(chunked(3).logprobs(capped, qr, 5), pc.Forward(PAD).logprobs(capped, qr, 5))

    class Doubled(GPTNeoXForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    doubled = Doubled(neox().config)
    assert chunked_head.supported(doubled)
    with pytest.raises(UserError, match="--logprob_chunk_tokens 0"):
        chunked(3).logprobs(doubled, qr, 5)
    pc.Forward(PAD).logprobs(doubled, qr, 5)  # the full path serves it; the output layer is restored
    assert "forward" not in models.output_layer(doubled).__dict__


@pytest.mark.parametrize("temperature,greedy,warpers", [(0.7, False, {}), (1.0, False, {}), (1.0, True, {}),
                                                        (0.7, False, dict(top_k=9, top_p=0.8, min_p=0.02))])
def test_generation_keeps_the_sampled_tokens_log_probs_as_full_scores_give_them(temperature, greedy, warpers):
    """batch_generation's per-step log-probs and entropy equal those from generate's full (b, r, V) scores
    (output_scores), same seed, with min_new_tokens (a processor that changes the early distributions), and with
    top-k, top-p and min-p (warpers generate applies after our processor: it applies them itself)."""
    from transformers import GenerationConfig

    model = neox().eval()
    queries = torch.tensor([[PAD, 5, 6, 7], [8, 9, 10, 11], [PAD, PAD, 12, 13]])
    config = GenerationConfig(do_sample=not greedy, temperature=temperature if not greedy else None,
                              **dict(dict(top_k=0, top_p=1.0), **warpers), max_new_tokens=7, min_new_tokens=3,
                              pad_token_id=PAD, eos_token_id=EOS,
                              suppress_tokens=[PAD])
    torch.manual_seed(11)
    query_responses, logprobs, entropy = pc.batch_generation(model, queries, PAD, EOS, config, 2, return_entropy=True)
    torch.manual_seed(11)  # generate's own, on the same chunks of 2 rows, keeping every step's scores
    expected = []
    for rows in (slice(0, 2), slice(2, 3)):
        out = model.generate(input_ids=queries[rows], attention_mask=(queries[rows] != PAD).long(),
                             generation_config=config, output_scores=True, return_dict_in_generate=True)
        logp = torch.stack(out.scores, 1).float().log_softmax(-1)  # scores after every processor and warper
        sampled = out.sequences[:, queries.shape[1]:]
        expected.append((logp.gather(-1, sampled[..., None])[..., 0], -(logp.exp() * logp).nan_to_num(0.0).sum(-1),
                         sampled))
    for rows, (lp, ent, sampled) in zip((slice(0, 2), slice(2, 3)), expected):
        real = query_responses[rows, 4:4 + sampled.shape[1]] != PAD
        assert torch.equal(query_responses[rows, 4:4 + sampled.shape[1]][real], sampled[real])
        torch.testing.assert_close(logprobs[rows, :sampled.shape[1]][real], lp[real], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(entropy[rows, :sampled.shape[1]][real], ent[real], atol=1e-6, rtol=1e-6)


def test_generation_refuses_a_config_with_warpers_it_does_not_apply():
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=0.7, epsilon_cutoff=0.01, max_new_tokens=3,
                              pad_token_id=PAD, eos_token_id=EOS)
    with pytest.raises(ValueError, match="epsilon_cutoff"):
        pc.batch_generation(neox().eval(), torch.tensor([[5, 6]]), PAD, EOS, config, 1)


# ---------------------------------------------------------------------------------------------------- the scripts
SCRIPT_METRICS = {  # metrics that are not rounding noise around 0 (policy = reference at step 1)
    "grpo.py": ["loss/policy", "objective/entropy"], "rloo.py": ["objective/entropy", "objective/kl"],
    "ppo.py": ["loss/value", "policy/entropy"], "distill.py": ["loss/distill", "objective/entropy"],
    "dpo.py": ["loss", "grad_norm"], "kto.py": ["loss", "grad_norm"], "sft.py": ["loss", "token_accuracy"]}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPT_METRICS))
def test_every_script_gives_the_same_numbers_in_chunks(script, tmp_path, toy, shared_run):
    """The tiny run of each script on the toy (conftest.tiny_args: 2 steps) with the output layer on 100 positions at
    a time, and without chunks: the plain run (shared with test_smoke.py), whose default chunk never splits the toy's
    vocabulary of 16 (checked here): the same metrics and evaluation."""
    tokenizer = models.load_tokenizer(toy["policy"])
    policy = models.load_causal_lm(toy["policy"], tokenizer)
    assert chunked_head.resolve_chunk_tokens(policy, None) > 100_000  # the default: the full path at the toy's size
    _, plain = shared_run(script, *tiny_args(script))
    chunked = str(tmp_path / "chunked")
    run_script(script, *tiny_args(script), "--logprob_chunk_tokens", "100", "--output_dir", chunked)
    rows = {name: {r["step"]: r for r in read_metrics(out)} for name, out in (("plain", plain), ("100", chunked))}
    keys = SCRIPT_METRICS[script] + [k for k in rows["plain"][2] if k.startswith("eval/") and "gold" in k]
    assert_same_numbers(rows["100"], rows["plain"], (1, 2), keys, script)


@pytest.mark.slow
def test_two_processes_give_the_same_numbers_in_chunks(tmp_path, toy):
    """grpo on 2 processes (chunk counts differ per process when response lengths do): chunked = full path."""
    rows = {}
    for chunk in ("60", "0"):
        out = tmp_path / chunk
        run_distributed("grpo.py", "--max_steps", "2", "--per_device_train_batch_size", "32",
                        "--num_eval_prompts", "8", "--logprob_chunk_tokens", chunk, "--output_dir", str(out))
        rows[chunk] = {r["step"]: r for r in read_metrics(str(out))}
    for key in ("loss/policy", "objective/entropy", "objective/scores"):
        assert rows["60"][2][key] == pytest.approx(rows["0"][2][key], rel=1e-4, abs=1e-5), key
