"""The perf/* metrics (plumbing/throughput.py): parameter and token counts against hand counts, the metrics' formulas
on a hand-worked step, the peak-FLOPs table's lookups, and the run summary's line (metrics_log.perf_line)."""
import resource
import time

import pytest
import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

from plumbing import data_utils as du
from plumbing import metrics_log as ml
from plumbing import throughput as tp

pytestmark = pytest.mark.fast


def neox(tie: bool = False):
    config = GPTNeoXConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=32, tie_word_embeddings=tie)
    return GPTNeoXForCausalLM(config)


def test_matmul_parameters_leave_out_the_lookup_only():
    model = neox()
    # by hand: every parameter but embed_in (50 x 16), which the head (embed_out, its own 50 x 16) does not share
    total = sum(p.numel() for p in model.parameters())
    assert tp.matmul_parameters(model) == total - 50 * 16
    # tied (GPT-2): the embedding is the output layer, counted once
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32))
    unique = {id(p): p.numel() for p in gpt2.parameters()}  # parameters() already yields a tied weight once
    assert gpt2.get_output_embeddings().weight is gpt2.get_input_embeddings().weight
    assert tp.matmul_parameters(gpt2) == sum(unique.values())
    # two models (ppo's policy and value model): each counted; the same model twice: once
    assert tp.matmul_parameters(model, gpt2) == total - 50 * 16 + sum(unique.values())
    assert tp.matmul_parameters(model, model) == total - 50 * 16


def test_token_counts_leave_out_padding():
    pad = 0
    query_responses = torch.tensor([[0, 0, 5, 6, 7, 8, 0],  # left-padded prompt, right-padded response
                                    [3, 4, 5, 6, 7, 8, 9]])
    assert tp.sequence_tokens(query_responses, pad) == 4 + 7
    # row_tokens: the non-pad tokens of the sequences concatenated_inputs builds (pad 0 appears in no row)
    rows = [dict(prompt=[1, 2, 3], chosen=[4, 5], rejected=[6]), dict(prompt=[7], chosen=[8, 9, 10, 11], rejected=[])]
    built, _ = du.concatenated_inputs(rows, pad)
    assert sum(du.row_tokens(r) for r in rows) == int((built != pad).sum()) == (3 + 2 + 3 + 1) + (1 + 4 + 1 + 0)
    sft_rows = [dict(prompt=[1, 2], completion=[3, 4, 5])]
    built, _ = du.concatenated_inputs(sft_rows, pad, completions=("completion",))
    assert du.row_tokens(sft_rows[0], completions=("completion",)) == int((built != pad).sum()) == 5


def test_step_metrics_on_a_hand_worked_step():
    model = neox()
    meter = tp.StepMeter(Accelerator(cpu=True), model, passes=2)
    assert meter.peak is None  # a CPU: no perf/mfu
    meter.start()
    time.sleep(0.05)
    metrics = meter.metrics(1000, {"time/generate_seconds": 0.01})
    seconds = metrics["perf/step_seconds"]
    assert seconds >= 0.05 and "perf/mfu" not in metrics
    assert metrics["perf/tokens_per_second"] == pytest.approx(1000 / seconds)
    assert metrics["perf/generation_share"] == pytest.approx(0.01 / seconds)
    # with --max_staleness the trainer's wait is the generation it paid for, not the batch's own sampling
    meter.start()
    metrics = meter.metrics(1000, {"time/generate_seconds": 9.0, "async/trainer_wait_seconds": 0.0})
    assert metrics["perf/generation_share"] == 0.0
    assert "perf/generation_share" not in meter.metrics(1000)  # no sampling in the step (sft, dpo, ...)
    # a sampled batch's padding: 2 rows x 7 positions hold 4 + 7 tokens
    batch = meter.batch_metrics(torch.tensor([[0, 0, 5, 6, 7, 8, 0], [3, 4, 5, 6, 7, 8, 9]]), 0)
    assert batch["perf/padding_fraction"] == pytest.approx(3 / 14)
    assert batch["perf/tokens_per_second"] == pytest.approx(11 / batch["perf/step_seconds"])
    # this process's peak resident memory (Linux: KiB), at least what it holds now
    assert metrics["perf/peak_memory_gib"] == pytest.approx(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                                                            rel=0.05)
    # MFU by hand: 6 FLOPs per matmul parameter per token per pass, over the step's peak FLOPs (a made-up 1 TFLOP/s)
    meter.peak = 1e12
    meter.start()
    metrics = meter.metrics(1000)
    n = sum(p.numel() for p in model.parameters()) - 50 * 16
    assert metrics["perf/mfu"] == pytest.approx(6 * n * 2 * 1000 / (metrics["perf/step_seconds"] * 1e12))


@pytest.mark.parametrize("name,flops", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12), ("Tesla T4", None)])
def test_peak_flops_by_device_name(name, flops):
    assert tp.gpu_peak_flops(name) == flops
    assert tp.peak_flops(torch.device("cpu")) is None


def test_summary_line():
    rows = [{"step": 0, "eval/gold_score": 0.1},
            {"step": 1, "perf/tokens_per_second": 100.0, "perf/generation_share": 0.2, "perf/peak_memory_gib": 1.0},
            {"step": 2, "perf/tokens_per_second": 300.0, "perf/generation_share": 0.4, "perf/peak_memory_gib": 1.5},
            {"step": 3, "perf/tokens_per_second": 200.0, "perf/generation_share": 0.9, "perf/peak_memory_gib": 1.25}]
    assert ml.perf_line(rows) == "  perf:    200 tokens/s, generation 40% of the step, peak memory 1.50 GiB " \
                                    "(medians over the steps)"
    assert ml.perf_line(rows[:1]) is None
