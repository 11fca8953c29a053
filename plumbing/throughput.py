"""What a training step costs: the perf/* metrics every script logs (docs/metrics.md; metrics_log.perf_line
prints their medians in the run summary).

    perf/step_seconds         the step's wall time, its evaluation left out
    perf/tokens_per_second    the tokens the step trained on (every sequence's prompt and completion, padding left out;
                              all processes) per second of the step
    perf/generation_share     (rloo, grpo, ppo, distill) the share of the step the trainer spent sampling its batch,
                              or with --max_staleness waiting for it (what the overlap did not hide)
    perf/mfu                  (a GPU whose peak it knows) the update's model FLOPs, 6 x parameters per trained token
                              per pass over the batch (forward and backward; the sampling and the no-grad forwards of
                              old and reference log-probs not counted: a lower bound), over the processes' peak bf16
                              dense FLOPs in the step's time
    perf/padding_fraction     (rloo, grpo, ppo, distill) the share of the trained batch's rows x width positions that
                              are padding: what each padded forward over it runs for nothing (--padding_free skips it)
    perf/peak_memory_gib      this process's peak: on a GPU the step's peak allocated memory; on a CPU the process's
                              peak resident memory so far (the operating system does not reset it per step)
"""
from __future__ import annotations

import resource
import sys
import time
from typing import Dict, Optional

import torch
from torch import nn

from plumbing import run_utils as ru

# peak dense bf16 tensor FLOP/s per GPU from the vendors' data sheets, by a substring of torch.cuda.get_device_name
# (first match wins: the more specific names first)
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                   ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12))


def peak_flops(device: torch.device) -> Optional[float]:
    """The peak bf16 FLOP/s of one `device`; None on a CPU or a GPU not in PEAK_BF16_FLOPS."""
    return gpu_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def gpu_peak_flops(name: str) -> Optional[float]:
    """The peak bf16 FLOP/s of the GPU torch.cuda.get_device_name calls `name`; None when PEAK_BF16_FLOPS lacks it."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def matmul_parameters(*models: nn.Module) -> int:
    """The parameters that take part in matrix products, each counted once (tied weights too): all of them but an
    input embedding that is not also the output layer (a lookup costs no FLOPs)."""
    seen, count = set(), 0
    for model in models:
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        lookup = None if embedding is None or (output is not None and output.weight is embedding.weight) \
            else embedding.weight
        for p in model.parameters():
            if id(p) not in seen and p is not lookup:
                seen.add(id(p))
                count += p.numel()
    return count


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / (2**30 if sys.platform == "darwin" else 2**20)


class StepMeter:
    """Times each training step (`start` at its beginning, `metrics` before its evaluation) and reports the perf/*
    metrics. models: the trained models (their parameters count for the MFU); passes: the times the update goes over
    the batch (rloo/ppo: num_ppo_epochs, grpo: num_iterations); episode: the RL scripts' episodes so far (a resumed
    run's), from which `batch_metrics` counts time/episodes_per_second."""

    def __init__(self, accelerator, *models: nn.Module, passes: int = 1, episode: int = 0):
        self.first_episode, self.created = episode, time.time()
        self.accelerator, self.device = accelerator, accelerator.device
        self.flops_per_token = 6 * matmul_parameters(*models) * passes
        peak = peak_flops(self.device)
        self.peak = None if peak is None else peak * accelerator.num_processes
        if self.device.type == "cuda" and peak is None and accelerator.is_main_process:
            print(f"perf/mfu is not logged: the peak FLOPs of {torch.cuda.get_device_name(self.device)} are not in "
                  "plumbing/throughput.py's PEAK_BF16_FLOPS", flush=True)
        self.started = time.perf_counter()

    def start(self) -> None:
        self.started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def metrics(self, tokens: float, rollout_metrics: Optional[dict] = None) -> Dict[str, float]:
        """The perf/* metrics of the step started last. tokens: the step's trained tokens over all processes.
        rollout_metrics: a sampled batch's metrics, whose time/generate_seconds (or async/trainer_wait_seconds with
        --max_staleness) is the generation in the step."""
        seconds = max(time.perf_counter() - self.started, 1e-9)
        metrics = {"perf/step_seconds": seconds, "perf/tokens_per_second": tokens / seconds,
                   "perf/peak_memory_gib": peak_memory_gib(self.device)}
        if rollout_metrics is not None:
            generation = rollout_metrics.get("async/trainer_wait_seconds", rollout_metrics.get("time/generate_seconds"))
            metrics["perf/generation_share"] = min(generation / seconds, 1.0)
        if self.peak is not None:
            metrics["perf/mfu"] = self.flops_per_token * tokens / (seconds * self.peak)
        return metrics

    def batch_metrics(self, query_responses: torch.Tensor, pad_token_id: int, rollout_metrics: Optional[dict] = None,
                      episode: Optional[int] = None) -> Dict[str, float]:
        """`metrics` of a step that trained on this process's `query_responses` (B, T): their tokens summed over all
        processes (a collective: every process calls it), and perf/padding_fraction; with `episode` (the RL scripts'
        count after the step) also episode and time/episodes_per_second since the meter was made."""
        tokens = ru.global_sum(self.accelerator, sequence_tokens(query_responses, pad_token_id))
        positions = ru.global_sum(self.accelerator, query_responses.numel())
        metrics = {**self.metrics(tokens, rollout_metrics), "perf/padding_fraction": 1 - tokens / max(positions, 1)}
        if episode is not None:
            metrics.update({"episode": episode, "time/episodes_per_second":
                            (episode - self.first_episode) / (time.time() - self.created)})
        return metrics


def sequence_tokens(query_responses: torch.Tensor, pad_token_id: int) -> int:
    """The tokens of a batch of sequences, padding left out."""
    return int((query_responses != pad_token_id).sum())
