"""precision.py: the float32 output layer (--cast_lm_head_to_fp32) against the obvious computation from the model's own
hidden states, on every forward path (plain, shared prompts, packed, chunked) and with tied embeddings; fp16's
autocast; the flags' one-line errors; the low-precision log-softmax; and whole runs under --bf16 / --fp16 (bfloat16 is
native on this CPU where it has AVX512-BF16, float16 emulated: slow at real sizes, fine for the toy). The loss scaling
is tested in test_train_loop.py, the mismatch metrics' k3 KL in test_vllm.py's hand-worked importance weights."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, run_script
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

import policy_common as pc
from plumbing import models
from plumbing import run_utils as ru
from plumbing.errors import UserError
from plumbing.forwards import Forwards
from plumbing.models import compute_dtype
from plumbing.precision import Precision

PAD, EOS, VOCAB = 0, 1, 37
# two rows: [left pad | 4-token query | response, right-padded]; rows 0 and 2 share their query
QUERY_RESPONSES = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11, 1, 0],
                                [3, 4, 5, 6, 7, 12, 13, 1, 0, 0],
                                [0, 5, 6, 7, 8, 20, 21, 22, 23, 24]])
CONTEXT = 5


def neox(dtype=torch.float32):
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=EOS, pad_token_id=PAD))
    with torch.no_grad():  # peaked distributions, as a trained model's: low precision then rounds visibly
        models.output_layer(model).weight.mul_(20)
    return model.to(dtype).eval()


def tied_llama(dtype=torch.bfloat16):
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True, pad_token_id=PAD, eos_token_id=EOS,
                                        bos_token_id=EOS)).to(dtype).eval()


def head_input(model, query_responses):
    """The output layer's input at every position, read by a forward hook (independent of the forwards' machinery)."""
    seen = []
    handle = models.output_layer(model).register_forward_hook(lambda m, args, out: seen.append(args[0]))
    attention_mask, position_ids = pc.padding_inputs(query_responses, PAD)
    with torch.no_grad():
        model(input_ids=query_responses.masked_fill(attention_mask == 0, 0), attention_mask=attention_mask,
              position_ids=position_ids, use_cache=False)
    handle.remove()
    return seen[0]


def obvious_logprobs(model, query_responses, weight):
    """log-softmax of F.linear(head input in float32, `weight` in float32) at the response positions, pad masked."""
    hidden = head_input(model, query_responses)[:, CONTEXT - 1:-1].float()
    logits = pc.mask_pad_(torch.nn.functional.linear(hidden, weight.float()), PAD)
    tokens = query_responses[:, CONTEXT:]
    return torch.gather(logits.log_softmax(-1), -1, tokens[..., None])[..., 0]


FORWARDS = {"plain": dict(), "packed": dict(padding_free=True), "chunked": dict(chunk_tokens=3)}


@pytest.mark.parametrize("path", list(FORWARDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_output_layer_on_every_forward_path(path, dtype):
    """Under bf16 weights (or fp16 autocast) with --cast_lm_head_to_fp32, the logits are float32 and equal the output
    layer's weight (as loaded) applied in float32 to the model's own last hidden states, on the plain, packed and
    chunked paths alike."""
    model = neox(dtype if dtype == torch.bfloat16 else torch.float32)
    loaded_weight = models.output_layer(model).weight.detach().clone()
    Precision("bfloat16" if dtype == torch.bfloat16 else "float16", lm_head_fp32=True).apply(model)
    head = models.output_layer(model)
    assert head.weight.dtype == torch.float32 and torch.equal(head.weight, loaded_weight.float())
    assert compute_dtype(model) == dtype
    forward = Forwards(PAD, **FORWARDS[path]).lm(model)
    assert type(forward).__name__ == {"plain": "Forward", "packed": "PackedForward", "chunked": "ChunkedHead"}[path]
    with torch.no_grad():
        logits = forward.logits(model, QUERY_RESPONSES, CONTEXT)
        logprobs = forward.logprobs(model, QUERY_RESPONSES, CONTEXT)
    assert logits.dtype == torch.float32
    mask = QUERY_RESPONSES[:, CONTEXT:] != PAD
    expected = obvious_logprobs(model, QUERY_RESPONSES, loaded_weight)
    # packed rows round their hidden states differently in bf16 / fp16 (other shapes in the products)
    tolerance = 1e-5 if path != "packed" else {torch.bfloat16: 0.1, torch.float16: 1e-2}[dtype]
    assert (logprobs - expected)[mask].abs().max() < tolerance


def test_float32_output_layer_brings_logits_closer_to_float32():
    """What the flag is for: the bf16 model's log-probs with a float32 output layer are nearer the float32 model's than
    with a bf16 one, because the logits of a peaked distribution lose most in bf16 (here about 20 nats apart)."""
    reference = Forwards(PAD).lm(neox()).logprobs_no_grad(neox(), QUERY_RESPONSES, CONTEXT)
    mask = QUERY_RESPONSES[:, CONTEXT:] != PAD
    errors = {}
    for head in (False, True):
        model = Precision("bfloat16", lm_head_fp32=head).apply(neox(torch.bfloat16))
        logprobs = Forwards(PAD).lm(model).logprobs_no_grad(model, QUERY_RESPONSES, CONTEXT)
        errors[head] = (logprobs - reference)[mask].abs().mean().item()
    assert errors[True] < 0.75 * errors[False], errors


def test_float32_output_layer_with_tied_embeddings():
    """A head tied to the input embeddings stays tied (one float32 weight); the embeddings' output is cast back to the
    model's bfloat16, so the layers see what they did; logits are float32 and generation runs."""
    model = tied_llama()
    Precision("bfloat16", lm_head_fp32=True).apply(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dtype == torch.float32
    embedded = []
    model.model.layers[0].register_forward_pre_hook(lambda m, args, kwargs: embedded.append(args[0] if args else
                                                    kwargs["hidden_states"]), with_kwargs=True)
    forward = Forwards(PAD).lm(model)
    with torch.no_grad():
        logits = forward.logits(model, QUERY_RESPONSES, CONTEXT)
    assert logits.dtype == torch.float32 and embedded[0].dtype == torch.bfloat16
    expected = obvious_logprobs(model, QUERY_RESPONSES, model.lm_head.weight)
    logprobs = forward.logprobs_no_grad(model, QUERY_RESPONSES, CONTEXT)
    mask = QUERY_RESPONSES[:, CONTEXT:] != PAD
    assert (logprobs - expected)[mask].abs().max() < 1e-5
    config = pc.make_generation_config(SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS), 4)
    query_responses, sampled = pc.batch_generation(model, QUERY_RESPONSES[:, :CONTEXT], PAD, EOS, config, 3,
                                                   forward=forward)
    assert query_responses.shape == (3, CONTEXT + 4) and sampled.dtype == torch.float32


def test_float32_output_layer_refuses_a_lora_adapted_head(toy):
    """--use_peft --lora_target_modules lm_head --cast_lm_head_to_fp32: one line (TRL refuses it too)."""
    flags = models.PolicyFlags(use_peft=True, lora_target_modules=["lm_head"], cast_lm_head_to_fp32=True)
    with pytest.raises(UserError, match="--cast_lm_head_to_fp32: .*peft.* LoRA adapter on it"):
        models.load_policy(toy["policy"], models.load_tokenizer(toy["policy"]), flags)


def test_fp16_autocast_keeps_the_forward_signature_and_computes_in_float16():
    """--fp16: float32 weights, products in float16 (logits float16), the forward's signature intact for the code
    that inspects it (logits_to_keep, the cache argument), log-probs within fp16 rounding of float32's, and one
    generation under the same autocast."""
    reference = neox()
    model = Precision("float16").apply(neox())
    assert next(model.parameters()).dtype == torch.float32 and compute_dtype(model) == torch.float16
    assert "logits_to_keep" in models.forward_parameters(model) and models.cache_argument(model) is not None
    attention_mask, position_ids = pc.padding_inputs(QUERY_RESPONSES, PAD)
    with torch.no_grad():
        assert model(input_ids=QUERY_RESPONSES, attention_mask=attention_mask).logits.dtype == torch.float16
    mask = QUERY_RESPONSES[:, CONTEXT:] != PAD
    got = Forwards(PAD).lm(model).logprobs_no_grad(model, QUERY_RESPONSES, CONTEXT)
    expected = Forwards(PAD).lm(reference).logprobs_no_grad(reference, QUERY_RESPONSES, CONTEXT)
    assert 0 < (got - expected)[mask].abs().max() < 0.2
    config = pc.make_generation_config(SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS), 4)
    query_responses, sampled = pc.batch_generation(model, QUERY_RESPONSES[:, :CONTEXT], PAD, EOS, config, 3)
    assert torch.isfinite(sampled).all()


def test_precision_flags_errors(monkeypatch):
    with pytest.raises(UserError, match="--bf16 and --fp16 both given"):
        Precision.from_args(SimpleNamespace(bf16=True, fp16=True))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(UserError, match="--fp16 under DeepSpeed"):
        ru.make_accelerator(SimpleNamespace(bf16=False, fp16=True, gradient_accumulation_steps=1))


@pytest.mark.parametrize("shape", [(6, VOCAB), (2, 3, VOCAB)])
def test_low_precision_log_softmax_matches_float32(shape):
    """selective_logprobs on bf16 logits, flat (n, V) as the forwards' map_logits passes them or (B, R, V): the float32
    log-softmax of the same values (it once indexed a flat batch as 3-D and failed under --bf16)."""
    logits = (torch.randn(*shape) * 10).to(torch.bfloat16)
    tokens = torch.randint(0, VOCAB, shape[:-1])
    expected = torch.gather(logits.float().log_softmax(-1), -1, tokens[..., None])[..., 0]
    torch.testing.assert_close(pc.selective_logprobs(logits, tokens), expected)


# ---------------------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------------------
def test_rloo_fp16_with_a_float32_head_runs_and_logs_its_loss_scale(toy, tmp_path):
    """rloo.py --fp16 --cast_lm_head_to_fp32: finite metrics, the loss scale and its overflow skips logged, the HF
    sampler's mismatch metrics (hf/*) at the checked step, and a saved model that loads with its float32 head."""
    out = str(tmp_path / "fp16")
    proc = run_script("rloo.py", "--fp16", "--cast_lm_head_to_fp32", "--max_steps", "2", "--eval_steps", "0",
                      "--num_eval_prompts", "8", "--output_dir", out)
    assert "no native float16 arithmetic" in proc.stdout or torch.ops.mkldnn._is_mkldnn_fp16_supported()
    rows = read_metrics(out)
    assert all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float))
    assert {"fp16/loss_scale", "fp16/overflow_skipped"} <= set(rows[-1])
    assert rows[-1]["fp16/loss_scale"] <= 2.0 ** 16 and rows[-1]["fp16/overflow_skipped"] < 2  # at most one skip
    assert rows[1]["hf/logprob_diff"] < 0.05 and rows[1]["hf/kl"] < 1e-2 and "hf/is_masked_frac" in rows[1]
    saved = models.load_causal_lm(os.path.join(out, "model"), models.load_tokenizer(os.path.join(out, "model")))
    assert all(torch.isfinite(p).all() for p in saved.parameters())


def test_grpo_bf16_float32_head_packed_and_chunked(toy, tmp_path):
    """grpo.py --bf16 --cast_lm_head_to_fp32 with every forward path that applies the output layer apart from the
    model (packed rows, chunks of 4 positions), at two iterations (old log-probs from a forward): it runs with finite
    numbers and the held-out gold score of a policy that moved."""
    out = str(tmp_path / "bf16")
    run_script("grpo.py", "--bf16", "--cast_lm_head_to_fp32", "--padding_free", "--logprob_chunk_tokens", "4",
               "--num_iterations", "2", "--max_steps", "2", "--eval_steps", "0", "--num_eval_prompts", "8",
               "--output_dir", out)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float))
    assert rows[1]["hf/logprob_diff"] < 0.05


def test_mismatch_kl_ignores_padding_log_probs():
    """The k3 KL of importance_sampling_stats over real tokens only: padding positions hold whatever a forward left
    there (here log-ratios of 200, whose e^x overflows float32: inf x 0 would be NaN); the padded batch gives the
    unpadded numbers."""
    from plumbing.importance_sampling import ImportanceSampling, importance_sampling_stats

    trainer, sampler = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.5, -1.0, -0.5]])
    padded_trainer = torch.cat([trainer, torch.full((1, 2), pc.PADDING_LOGPROB)], 1)
    padded_sampler = torch.cat([sampler, torch.full((1, 2), -200.0)], 1)
    mask = torch.tensor([[True, True, True, False, False]])
    sampling = ImportanceSampling("token_truncate", sampler="hf")
    stats = importance_sampling_stats(padded_trainer, padded_sampler, mask, sampling)
    k3 = [math.expm1(x) - x for x in (0.5, -1.0, 0.0)]
    assert stats["hf/kl"].item() == pytest.approx(sum(k3) / 3, abs=1e-6)
    assert stats["hf/logprob_diff"].item() == pytest.approx(1.5 / 3, abs=1e-6)
