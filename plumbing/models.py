"""Loading models and tokenizers by name (a hub id or a local folder), with one-line errors: tokenizers that always
have an EOS and a pad token distinct from it, causal LMs and scalar-head models (reward, value) with dropout off and
embeddings fitted to the tokenizer, the trainable policy with its shared flags (LoRA, 4-bit, activation
checkpointing). Aliases such as `toy` are resolved by run_utils.resolve_model before names get here. Then what the
forwards need to know of a loaded model (the arguments its forward takes, its output layer) and where it runs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn as nn

from plumbing.errors import UserError
from plumbing.precision import AUTOCAST_DTYPE, DTYPES, FP32, Precision, require_plain_head


@dataclass
class ModelFlags:
    """Model loading: the model to start from, LoRA, precision, memory (every script)."""
    model: str = "toy"
    """policy to start from: alias (toy|pythia-1b|pythia-2.8b|pythia-6.9b), hub id or local folder"""
    use_peft: bool = False
    """train a LoRA adapter on the policy instead of all its weights (the reference is then the adapter-off base)"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA alpha"""
    lora_dropout: float = 0.0
    """LoRA dropout (0 keeps the forward deterministic, as log-ratios to the reference assume)"""
    lora_target_modules: Optional[List[str]] = None
    """modules LoRA adapts; None = PEFT's default for the architecture"""
    merge_peft: bool = False
    """with --use_peft, save merged full weights instead of the adapter"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    bf16: bool = False
    """bfloat16 weights and arithmetic (a GPU, or a CPU with native bfloat16; precision.py)"""
    fp16: bool = False
    """float16 arithmetic on float32 weights, the loss scaled (a GPU; precision.py); a vLLM engine in float16 too"""
    trust_remote_code: bool = False
    """allow models with custom code from the hub"""
    padding_free: bool = False
    """run every forward on packed rows, no padding (packing.py: the same numbers to float rounding; rows sharing a
    prompt share it there)"""


@dataclass
class PolicyFlags(ModelFlags):
    """Model loading for a policy (a causal LM whose log-probs are computed): ModelFlags, 4-bit weights, chunked
    log-probs."""
    load_in_4bit: bool = False
    """load the policy in 4 bits (QLoRA; needs --use_peft, a GPU and bitsandbytes)"""
    cast_lm_head_to_fp32: bool = False
    """the output layer of the policy, the reference and a teacher in float32 (logits and log-probs in float32 under
    --bf16 / --fp16; HF generation samples from them too; a vLLM engine keeps its own dtype)"""
    logprob_chunk_tokens: Optional[int] = None
    """log-probs from the output layer run on this many response tokens at a time, so that no rows x tokens x
    vocabulary logits are kept at long completions (the same numbers to float rounding); None = as many as make 256
    MiB of float32 logits (2**26 / vocabulary size), 0 = all at once"""

    def check(self) -> None:
        if (self.logprob_chunk_tokens or 0) < 0:
            raise UserError(f"--logprob_chunk_tokens must be >= 0 (0 = all at once), got {self.logprob_chunk_tokens}")

_HUB_REACHABLE: Optional[bool] = None


def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connect to the hub endpoint (cached). Hub libraries retry for about a minute when offline;
    this lets a run fail in seconds instead."""
    global _HUB_REACHABLE
    if _HUB_REACHABLE is None:
        import socket
        from urllib.parse import urlparse

        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
            _HUB_REACHABLE = False
        else:
            url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
            try:
                socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
                _HUB_REACHABLE = True
            except OSError:
                _HUB_REACHABLE = False
    return _HUB_REACHABLE


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): for one-line errors."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def from_pretrained(loader, name: str, **kwargs):
    """`loader.from_pretrained(name)` with one-line errors: a local path that does not exist, or a hub id not
    in the local cache while the hub is unreachable, fails at once."""
    path = os.path.expanduser(name)
    if not os.path.exists(path) and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise UserError(f"model {name!r}: local path does not exist")
    try:
        if os.path.exists(path):
            return loader.from_pretrained(path, **kwargs)
        try:
            return loader.from_pretrained(name, local_files_only=True, **kwargs)
        except OSError:
            if not hub_reachable():
                raise UserError(f"could not load {name!r}: not a local folder, not in the local hub cache, and the "
                                "hub is unreachable (offline)") from None
            return loader.from_pretrained(name, **kwargs)
    except OSError as e:  # missing files, unknown id: transformers raises OSError
        raise UserError(f"could not load {name!r}: {first_line(e)}") from None


def load_tokenizer(name: str, trust_remote_code: bool = False):
    """Load the tokenizer of `name`. Guarantees an EOS token and a pad token distinct from EOS: when the
    tokenizer has no pad (or pad == eos), a new `[PAD]` token is added, and the model loaders below resize
    embeddings to `len(tokenizer)`. Raises UserError when there is no EOS token."""
    from transformers import AutoTokenizer

    tokenizer = from_pretrained(AutoTokenizer, name, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise UserError(f"tokenizer of {name!r} has no EOS token; responses could never end")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return tokenizer


def disable_dropout(model: nn.Module) -> None:
    """Switch off every dropout: RL log-ratios and DPO rewards assume a deterministic forward. Covers
    nn.Dropout modules, float `*dropout*` attributes that attention layers pass to functional dropout, and
    the config's dropout fields."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    for name in list(vars(config)) if config is not None else []:
        if "dropout" in name and isinstance(getattr(config, name), float):
            setattr(config, name, 0.0)


def load_causal_lm(name: str, tokenizer, precision: Precision = FP32, trust_remote_code: bool = False,
                   load_in_4bit: bool = False):
    """AutoModelForCausalLM for `name` (AutoModelForImageTextToText for a vision-language model: LLaVA, Qwen-VL, ...)
    in `precision` (precision.py), dropout off, embeddings resized to the tokenizer, pad id set."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = from_pretrained(AutoConfig, name, trust_remote_code=trust_remote_code)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    kwargs = dict(dtype=precision.weights_dtype, trust_remote_code=trust_remote_code)
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=DTYPES[precision.dtype])
    model = from_pretrained(auto, name, **kwargs)
    _fit_to_tokenizer(model, tokenizer)
    disable_dropout(model)
    return precision.apply(model)


def enable_activation_checkpointing(model) -> None:
    """Recompute activations in the backward pass (non-reentrant, so frozen LoRA bases need no input grads).
    transformers 5.20 renamed gradient_checkpointing_enable to activation_checkpointing_enable: either is taken."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def load_policy(name: str, tokenizer, args):
    """The trainable policy `name`, set up by the shared flags of every script (--bf16 / --fp16 /
    --cast_lm_head_to_fp32: precision.py, `trust_remote_code`,
    `load_in_4bit`, `gradient_checkpointing`, `use_peft`, `lora_*`): loaded, optionally activation-checkpointed,
    optionally wrapped with a fresh LoRA adapter. 4-bit weights without `--use_peft` are a UserError (nothing
    would train)."""
    if args.load_in_4bit and not args.use_peft:
        raise UserError("--load_in_4bit needs --use_peft (4-bit weights cannot be trained directly)")
    policy = load_causal_lm(name, tokenizer, Precision.from_args(args), trust_remote_code=args.trust_remote_code,
                            load_in_4bit=args.load_in_4bit)
    if args.gradient_checkpointing:
        enable_activation_checkpointing(policy)
    if args.use_peft:
        policy = add_lora(policy, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
        if args.cast_lm_head_to_fp32:
            require_plain_head(output_layer(policy), type(causal_lm(policy)).__name__)
    return policy


def load_scalar_model(name: str, tokenizer, precision: Precision = FP32, trust_remote_code: bool = False):
    """AutoModelForSequenceClassification with one output (a reward or value model) in `precision`, dropout off."""
    from transformers import AutoModelForSequenceClassification

    model, info = from_pretrained(AutoModelForSequenceClassification, name, num_labels=1, output_loading_info=True,
                                   dtype=precision.weights_dtype, trust_remote_code=trust_remote_code)
    if info["missing_keys"]:  # e.g. a value model started from a causal LM: its scalar head is new (expected)
        print(f"note: {name}: new {', '.join(sorted(info['missing_keys']))} initialised (not in the checkpoint)",
              flush=True)
    _fit_to_tokenizer(model, tokenizer)
    disable_dropout(model)
    return precision.apply(model, causal_lm=False)


def _fit_to_tokenizer(model, tokenizer) -> None:
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def check_same_vocab(tokenizer_a, tokenizer_b, what: str = "reward model") -> None:
    """Scoring token ids produced by one tokenizer with a model of another is silently wrong: refuse it."""
    if tokenizer_a.get_vocab() != tokenizer_b.get_vocab():
        raise UserError(f"the {what}'s tokenizer differs from the policy's (vocab sizes {len(tokenizer_b)} vs "
                        f"{len(tokenizer_a)}); they must share a vocabulary")


def add_lora(model, r: int, alpha: int, dropout: float, target_modules: Optional[Sequence[str]] = None,
             task_type: str = "CAUSAL_LM"):
    """Wrap `model` with a fresh LoRA adapter (PEFT). The base weights stay frozen; `target_modules=None`
    lets PEFT choose the architecture's default projections."""
    from peft import LoraConfig, get_peft_model

    if target_modules is None and getattr(getattr(model, "config", None), "vision_config", None) is not None:
        # a vision-language model, which PEFT has no default for: TRL's convention, the language model's linear layers
        # (the vision tower and the projector stay frozen)
        target_modules = [name for name, module in model.named_modules()
                          if isinstance(module, nn.Linear) and ".language_model." in f".{name}."]
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, task_type=task_type,
                        target_modules=list(target_modules) if target_modules else None)
    return get_peft_model(model, config)


# ---------------------------------------------------------------------------------------------------------
# Wrappers and placement: the plain model inside DDP / DeepSpeed / compile, frozen models for inference
# ---------------------------------------------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP / DeepSpeed / compile wrappers (`.module`, `._orig_mod`); a PEFT adapter stays."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


@contextlib.contextmanager
def unwrap_for_generation(model: nn.Module, accelerator=None):
    """Yield a plain model that can `.generate`. Under DeepSpeed ZeRO-3 the sharded parameters are gathered
    for the duration of the block (one all-gather per call, so generate in as few calls as possible)."""
    unwrapped = unwrap(model)
    ds_plugin = getattr(accelerator.state, "deepspeed_plugin", None) if accelerator is not None else None
    if ds_plugin is not None and ds_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            yield unwrapped
    else:
        yield unwrapped


@contextlib.contextmanager
def no_sampling_defaults(model: nn.Module):
    """transformers fills every field our GenerationConfig leaves unset from the model's own generation_config.json
    (Qwen2.5-Instruct's repetition_penalty 1.1, for one), which would sample from another distribution than the one
    the losses score. Within the block the model has a blank generation config, so only ours applies."""
    from transformers import GenerationConfig

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    saved = getattr(inner, "generation_config", None)
    inner.generation_config = GenerationConfig()
    try:
        yield
    finally:
        inner.generation_config = saved


def prepare_frozen(model: nn.Module, accelerator) -> nn.Module:
    """Place a frozen model (reference, reward, teacher) for inference. Under DeepSpeed ZeRO-3 it becomes an inference
    engine sharded like the policy; otherwise it is moved to the device (no DDP wrapper: it has no gradients to
    synchronise)."""
    model.eval().requires_grad_(False)
    ds_plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if ds_plugin is not None and ds_plugin.zero_stage == 3:
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": ds_plugin.deepspeed_config["train_micro_batch_size_per_gpu"],
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e4},
            "bf16": {"enabled": next(model.parameters()).dtype == torch.bfloat16},
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine
    return model.to(accelerator.device)


# ---------------------------------------------------------------------------------------------------------
# Inside a model: the arguments its forward takes, its output layer
# ---------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _parameter_names(forward) -> frozenset:
    return frozenset(inspect.signature(forward).parameters)


def forward_parameters(model: nn.Module) -> frozenset:
    """Names of the arguments the model's own forward takes (wrappers and a PEFT adapter looked through); read once
    per forward function."""
    inner = unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT
    return _parameter_names(getattr(inner.forward, "__func__", inner.forward))


def cache_argument(model: nn.Module) -> Optional[str]:
    """The name under which the model's forward takes and returns its key/value cache: `cache` (transformers
    >= 5.20) or `past_key_values` (earlier releases, and vLLM's 5.19 pin); None when it takes none."""
    parameters = forward_parameters(model)
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model's products run in (precision.py): the autocast dtype its forward runs under (--fp16), else
    its weights'."""
    return getattr(causal_lm(model).forward, AUTOCAST_DTYPE, next(model.parameters()).dtype)


def keep_last(model: nn.Module, n: int) -> dict:
    """forward kwargs: the output layer on the last `n` positions only, where the forward takes `logits_to_keep`
    (custom code may not): callers slice [:, -n:] either way."""
    return {"logits_to_keep": n} if "logits_to_keep" in forward_parameters(model) else {}


def causal_lm(model: nn.Module) -> nn.Module:
    """The causal LM inside DDP / DeepSpeed / compile wrappers and a PEFT adapter."""
    model = unwrap(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def output_layer(model: nn.Module) -> nn.Module:
    """The model's output layer (the LoRA-wrapped one when an adapter targets it)."""
    head = causal_lm(model).get_output_embeddings()
    if head is None:
        raise UserError(f"{type(causal_lm(model)).__name__} has no output layer (get_output_embeddings() is None): "
                        "pass --logprob_chunk_tokens 0")
    return head


@contextlib.contextmanager
def hidden_instead_of_logits(model: nn.Module):
    """Within the block, the model's forward returns its last hidden states (B, T', H) where it would return logits:
    the output layer hands back its input. Each forward is checked to return that tensor (its storage and shape): a
    model that transforms the output layer's result would otherwise hand out transformed hidden states."""
    base, head = causal_lm(model), output_layer(model)
    returned = []

    def identity(hidden, *args, **kwargs):
        returned.append(hidden)
        return hidden

    def check(module, inputs, output):
        logits = output.logits if hasattr(output, "logits") else output[0]
        # the same storage and shape (DeepSpeed ZeRO-3's module hooks hand back a new tensor object on it)
        if not any(logits.data_ptr() == r.data_ptr() and logits.shape == r.shape for r in returned):
            raise UserError(f"{type(base).__name__}'s forward changes its output layer's result, so log-probs cannot "
                            "be computed in chunks from its hidden states: pass --logprob_chunk_tokens 0")
        returned.clear()

    saved = head.__dict__.get("forward")  # an instance-level forward (accelerate's offload hooks) is restored
    head.forward = identity
    handle = base.register_forward_hook(check)
    try:
        yield
    finally:
        handle.remove()
        if saved is None:
            del head.forward
        else:
            head.forward = saved
