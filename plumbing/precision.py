"""The numbers a run computes in, chosen once at setup (`Precision.from_args`) and applied where each model is loaded:

  float32 (default)  weights and every product in float32
  --bf16             weights in bfloat16 and every product in bfloat16 (the optimizer updates bfloat16 weights)
  --fp16             float32 weights (the optimizer's master copy), every forward under torch.autocast(float16), the
                     loss scaled against fp16's narrow range (torch.amp.GradScaler: a step whose gradients overflow is
                     skipped and the scale halved; Micikevicius et al. 2018); the vLLM engine in float16 too (Qi et al.
                     2025, "Defeating the Training-Inference Mismatch via FP16": fp16's 10 mantissa bits make the
                     sampler's and the trainer's numbers agree more closely than bf16's 7)
  --cast_lm_head_to_fp32  the output layer of every causal LM the run loads (policy, reference, teacher) in float32,
                     its input cast up: logits, log-probs and their gradient in float32 under bf16 or fp16 (TRL 1.16's
                     flag; ScaleRL, Khatri et al. 2025). HF generation uses the same model, so it samples from float32
                     logits as well, and a colocated vLLM engine gets its output layer in float32 too (vLLM's
                     head_dtype; TRL casts the trainer's alone, which measured worse: docs/precision.md).

The sampler-trainer mismatch these choices move is logged for every sampler (importance_sampling.py's `vllm/*`,
`async/*`, and `hf/*` at rollout.py's log-prob checks) and measured in benchmark/results/precision_mismatch.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from plumbing.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """`dtype`: what the models' products run in ("float32", "bfloat16" or "float16"); `lm_head_fp32`: the output
    layer in float32 (--cast_lm_head_to_fp32)."""
    dtype: str = "float32"
    lm_head_fp32: bool = False

    @classmethod
    def from_args(cls, args) -> "Precision":
        """--bf16 / --fp16 (every script) and --cast_lm_head_to_fp32 (the scripts that train a causal LM)."""
        if args.bf16 and args.fp16:
            raise UserError("--bf16 and --fp16 both given: choose one")
        dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
        return cls(dtype, getattr(args, "cast_lm_head_to_fp32", False))

    def emulated(self) -> Optional[str]:
        """A note when this machine has no native arithmetic for the dtype (a CPU without AVX512-BF16 / AMX for
        bfloat16, without AVX512-FP16 / AMX-FP16 for float16, as oneDNN reports): torch emulates it, which serves the
        toy worlds but is ~100x slower than float32 at real sizes (measured here: a 256 x 1024 x 1024 float16 matmul);
        None where it is native (any recent GPU)."""
        if self.dtype == "float32" or torch.cuda.is_available():
            return None
        native = {"bfloat16": torch.ops.mkldnn._is_mkldnn_bf16_supported,
                  "float16": torch.ops.mkldnn._is_mkldnn_fp16_supported}[self.dtype]()
        return None if native else (f"note: this CPU has no native {self.dtype} arithmetic; torch emulates it (fine "
                                    "for the toy worlds, ~100x slower than float32 at real sizes)")

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype models are loaded in: bfloat16 under --bf16; float32 otherwise (--fp16 computes under autocast)."""
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        return torch.float16 if self.dtype == "float16" else None

    def bytes_per_value(self) -> int:
        return DTYPES[self.dtype].itemsize

    def apply(self, model: nn.Module, causal_lm: bool = True) -> nn.Module:
        """`model`, just loaded in `weights_dtype` (a transformers model, unwrapped), set to compute in this precision:
        its forward under autocast (--fp16; a causal LM's output layer too, which the chunked and packed forwards run
        apart from the model's forward) and a causal LM's output layer in float32 (--cast_lm_head_to_fp32). Returns
        the model."""
        if self.autocast_dtype is not None:
            autocast_forward(model, self.autocast_dtype)
            if causal_lm:
                autocast_forward(model.get_output_embeddings(), self.autocast_dtype)
        if self.lm_head_fp32 and causal_lm:
            cast_output_layer_to_fp32(model)
        return model

    def loss_scaler(self, device: torch.device):
        """A torch.amp.GradScaler for --fp16's gradients, None otherwise."""
        return torch.amp.GradScaler(device.type) if self.dtype == "float16" else None


FP32 = Precision()
AUTOCAST_DTYPE = "autocast_dtype"  # the attribute naming the dtype on a forward `autocast_forward` wrapped


def autocast_forward(model: nn.Module, dtype: torch.dtype) -> None:
    """Run `model`'s forward (and so generate's) under torch.autocast(dtype) on the device of its weights. The wrapper
    keeps the forward's signature (functools.wraps), which the forwards inspect."""
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast(next(model.parameters()).device.type, dtype=dtype):
            return inner(*args, **kwargs)

    setattr(forward, AUTOCAST_DTYPE, dtype)
    model.forward = forward


def require_plain_head(head: nn.Module, model_name: str) -> nn.Linear:
    """A causal LM's output layer, which --cast_lm_head_to_fp32 needs to be a plain nn.Linear (as TRL 1.16 does)."""
    if type(head) is not nn.Linear:
        kind = f"{type(head).__module__}.{type(head).__name__}"
        raise UserError(f"--cast_lm_head_to_fp32: {model_name}'s output layer is a {kind}, not a plain torch Linear (a "
                        "LoRA adapter on it? leave the output layer out of --lora_target_modules)")
    return head


def cast_output_layer_to_fp32(model: nn.Module) -> None:
    """The causal LM's output layer in float32: its weight (and bias) stored in float32 and its input cast up, autocast
    off inside it (TRL 1.16's cast_lm_head_to_fp32). A weight tied to the input embeddings becomes float32 with it; the
    embeddings' output is then cast back to the model's dtype, so the layers between see what they saw before. An
    output layer that is not a plain linear layer (a LoRA-adapted one: --lora_target_modules lm_head) is refused.
    `model`: a transformers causal LM, unwrapped."""
    head, embeddings = require_plain_head(model.get_output_embeddings(), type(model).__name__), \
        model.get_input_embeddings()
    model_dtype = embeddings.weight.dtype
    head.float()
    if embeddings.weight is head.weight and model_dtype != torch.float32:
        embeddings.register_forward_hook(lambda module, args, output: output.to(model_dtype))

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return nn.functional.linear(hidden.float(), head.weight, head.bias)

    head.forward = forward
