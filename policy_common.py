"""Shared, non-algorithmic helpers for rloo.py, ppo.py, dpo.py and kto.py.

Conventions used throughout (shapes in docstrings use these names):
  B  batch size            Lq  query (prompt) length, LEFT-padded with pad_token_id
  R  response length       T = Lq + R, a `query_response` row is [left pads | query | response | right pads]
  V  vocabulary size
The pad token is always distinct from EOS, so `ids != pad_token_id` is the attention mask. A response keeps
its first EOS and everything after it is pad. Nothing algorithm-specific lives here.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import os
import random
import shutil
import signal
import time
import weakref
from dataclasses import asdict, is_dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

INVALID_LOGPROB = 0.0  # log-prob written at response positions after EOS (always masked out downstream)

# ---------------------------------------------------------------------------------------------------------
# Aliases: short names for the public TL;DR checkpoints and datasets behind the published RLOO/PPO/DPO runs
# (Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO"; TRL documentation), and the toy task.
# ---------------------------------------------------------------------------------------------------------
TLDR_DATASETS = {
    "prompt": "trl-lib/tldr",  # prompt, completion
    "preference": "trl-lib/tldr-preference",  # prompt, chosen, rejected
    "unpaired": "trl-lib/tldr-preference",  # unpaired automatically by kto.py
}
MODEL_ALIASES = {
    f"pythia-{size}": {
        "policy": f"cleanrl/EleutherAI_pythia-{size}-deduped__sft__tldr",
        "reward": f"cleanrl/EleutherAI_pythia-{size}-deduped__reward__tldr",
        "dataset": "tldr",
    }
    for size in ("1b", "2.8b", "6.9b")
}
DATASET_ALIASES = {"tldr": TLDR_DATASETS}
TOY_ALIAS = "toy"


class UserError(ValueError):
    """Bad input from the command line or data: printed as one line by `main_guard`, exit code 2."""


def main_guard(main: Callable[[], None]) -> None:
    """Run `main()`; a `UserError` becomes a one-line message on stderr and exit code 2 (no traceback)."""
    import sys

    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def resolve_model(name: str, kind: str = "policy") -> str:
    """Map `--model`/`--reward_model` to a loadable id or folder. kind: "policy" or "reward".

    `toy` builds (or reuses) the offline toy task; `pythia-1b|2.8b|6.9b` map to the TL;DR SFT/reward
    checkpoints; an existing local folder or any other hub id is returned unchanged."""
    if name == TOY_ALIAS:
        import toy_task

        return toy_task.build()[kind]
    if name in MODEL_ALIASES:
        return MODEL_ALIASES[name][kind]
    return name


def default_reward_model(model: str) -> str:
    """The reward model paired with a `--model` alias (toy -> toy RM, pythia-1b -> its TL;DR RM)."""
    if model == TOY_ALIAS:
        return TOY_ALIAS
    if model in MODEL_ALIASES:
        return model
    raise UserError(f"--reward_model is required when --model is {model!r} (no paired reward model is known)")


def default_dataset(model: str) -> str:
    """The dataset paired with a `--model` alias (toy -> toy, pythia-* -> tldr)."""
    if model == TOY_ALIAS:
        return TOY_ALIAS
    if model in MODEL_ALIASES:
        return MODEL_ALIASES[model]["dataset"]
    raise UserError(f"--dataset is required when --model is {model!r} (no paired dataset is known)")


def parse_args(args_cls, alias_defaults: Optional[Dict[str, dict]] = None, argv: Optional[List[str]] = None):
    """tyro CLI with `--snake_case` flags. `alias_defaults` maps a `--model` alias (e.g. "toy") to tuned
    defaults for that alias; each applies only where the flag was not given on the command line, so the
    dataclass defaults stay those of the real-scale path."""
    import sys

    import tyro

    argv = sys.argv[1:] if argv is None else argv
    args = tyro.cli(args_cls, args=argv, use_underscores=True)
    given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    for field, value in (alias_defaults or {}).get(getattr(args, "model", None), {}).items():
        if field not in given and f"no_{field}" not in given:
            setattr(args, field, value)
    return args


def gold_scorer(dataset: str) -> Optional[Callable[[str, str], float]]:
    """A ground-truth scorer `(prompt_text, completion_text) -> float` if the dataset has one (the toy task
    does), else None. Evaluation reports `eval/gold_score` whenever one exists."""
    import toy_task

    return toy_task.gold_scorer(dataset)


# ---------------------------------------------------------------------------------------------------------
# Loading models and tokenizers
# ---------------------------------------------------------------------------------------------------------
def _check_model_source(name: str, resolved: str) -> None:
    """Fail early, in one line, for a path that does not exist (a hub id is `org/name` or a bare name)."""
    if os.path.exists(os.path.expanduser(resolved)):
        return
    if resolved.startswith((".", "/", "~")) or resolved.count("/") > 1:
        raise UserError(f"model {name!r}: local path {resolved!r} does not exist")


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


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _from_pretrained(loader, name: str, resolved: str, **kwargs):
    """`loader.from_pretrained` with one-line errors; a hub id not in the local cache fails at once when the
    hub is unreachable."""
    _check_model_source(name, resolved)
    hint = f" (known aliases: {', '.join([TOY_ALIAS, *MODEL_ALIASES])})" if "/" not in name else ""
    local = os.path.exists(os.path.expanduser(resolved))
    try:
        if local:
            return loader.from_pretrained(os.path.expanduser(resolved), **kwargs)
        try:
            return loader.from_pretrained(resolved, local_files_only=True, **kwargs)
        except OSError:
            if not hub_reachable():
                raise UserError(f"could not load {name!r}: hub id {resolved!r} is not in the local cache and the "
                                f"hub is unreachable (offline){hint}") from None
            return loader.from_pretrained(resolved, **kwargs)
    except OSError as e:  # missing files, unknown id: transformers raises OSError
        raise UserError(f"could not load {name!r} ({resolved}): {_first_line(e)}{hint}") from None


def load_tokenizer(name: str, kind: str = "policy", trust_remote_code: bool = False):
    """Load the tokenizer of `name` (alias, hub id or folder). Guarantees an EOS token and a pad token
    distinct from EOS: when the tokenizer has no pad (or pad == eos), a new `[PAD]` token is added, and model
    loaders below resize embeddings to `len(tokenizer)`. Raises UserError when there is no EOS token."""
    from transformers import AutoTokenizer

    resolved = resolve_model(name, kind)
    tokenizer = _from_pretrained(AutoTokenizer, name, resolved, trust_remote_code=trust_remote_code)
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


def model_dtype(bf16: bool) -> torch.dtype:
    """float32 on CPU; bfloat16 only when asked for and a GPU is present."""
    if bf16 and not torch.cuda.is_available():
        raise UserError("--bf16 needs a GPU; on a CPU the scripts run in float32")
    return torch.bfloat16 if bf16 else torch.float32


def load_causal_lm(name: str, tokenizer, kind: str = "policy", bf16: bool = False, trust_remote_code: bool = False,
                   load_in_4bit: bool = False):
    """AutoModelForCausalLM for `name`, dropout off, embeddings resized to the tokenizer, pad id set."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=model_dtype(bf16), trust_remote_code=trust_remote_code)
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=model_dtype(bf16))
    model = _from_pretrained(AutoModelForCausalLM, name, resolve_model(name, kind), **kwargs)
    _fit_to_tokenizer(model, tokenizer)
    disable_dropout(model)
    return model


def enable_activation_checkpointing(model) -> None:
    """Recompute activations in the backward pass (non-reentrant, so frozen LoRA bases need no input grads)."""
    model.activation_checkpointing_enable({"use_reentrant": False})


def load_policy(args, tokenizer):
    """The trainable policy from the shared flags of every script (`args.model`, `bf16`, `trust_remote_code`,
    `load_in_4bit`, `gradient_checkpointing`, `use_peft`, `lora_*`): loaded, optionally activation-checkpointed,
    optionally wrapped with a fresh LoRA adapter. 4-bit weights without `--use_peft` are a UserError (nothing
    would train)."""
    if args.load_in_4bit and not args.use_peft:
        raise UserError("--load_in_4bit needs --use_peft (4-bit weights cannot be trained directly)")
    policy = load_causal_lm(args.model, tokenizer, bf16=args.bf16, trust_remote_code=args.trust_remote_code,
                            load_in_4bit=args.load_in_4bit)
    if args.gradient_checkpointing:
        enable_activation_checkpointing(policy)
    if args.use_peft:
        policy = add_lora(policy, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
    return policy


def load_scalar_model(name: str, tokenizer, kind: str = "reward", bf16: bool = False, trust_remote_code: bool = False):
    """AutoModelForSequenceClassification with one output (a reward or value model), dropout off."""
    from transformers import AutoModelForSequenceClassification

    model = _from_pretrained(AutoModelForSequenceClassification, name, resolve_model(name, kind), num_labels=1,
                             dtype=model_dtype(bf16), trust_remote_code=trust_remote_code)
    _fit_to_tokenizer(model, tokenizer)
    disable_dropout(model)
    return model


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

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, task_type=task_type,
                        target_modules=list(target_modules) if target_modules else None)
    return get_peft_model(model, config)


# ---------------------------------------------------------------------------------------------------------
# Reference model: one interface for the three modes
# ---------------------------------------------------------------------------------------------------------
class Reference:
    """The frozen reference policy pi_ref, in one of three modes:

    - "copy":        a separate frozen model (eval mode, requires_grad False, never in an optimizer).
    - "adapter_off": the policy's own base weights with its LoRA adapter switched off (no second copy).
    - "none":        reference-free; `logprobs` returns zeros.

    `logprobs(...)` has the signature of `response_logprobs` and is always run under no_grad."""

    def __init__(self, mode: str, model: Optional[nn.Module] = None, policy: Optional[nn.Module] = None):
        assert mode in ("copy", "adapter_off", "none"), mode
        self.mode, self.model, self.policy = mode, model, policy
        if mode == "copy":
            model.eval()
            model.requires_grad_(False)

    @contextlib.contextmanager
    def _model(self):
        if self.mode == "copy":
            yield self.model
        else:
            policy = unwrap(self.policy)
            with policy.disable_adapter():
                yield self.policy

    @torch.no_grad()
    def logprobs(self, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                 temperature: float = 1.0, chunk_size: Optional[int] = None) -> torch.Tensor:
        """(B, T) ids -> (B, T - context_length) reference log-probs of the response tokens."""
        if self.mode == "none":
            return torch.zeros(query_responses.shape[0], query_responses.shape[1] - context_length,
                               device=query_responses.device)
        with self._model() as model:
            chunk_size = chunk_size or query_responses.shape[0]
            return torch.cat([
                response_logprobs(model, query_responses[i:i + chunk_size], context_length, pad_token_id, temperature)
                for i in range(0, query_responses.shape[0], chunk_size)
            ])

    def free(self) -> None:
        """Drop the frozen copy (e.g. after precomputing reference log-probs); later calls are an error."""
        self.model, self.mode = None, "freed"


def create_reference(policy: nn.Module, ref_model: Optional[str], tokenizer, use_peft: bool, reference_free: bool,
                     accelerator=None, bf16: bool = False, trust_remote_code: bool = False,
                     policy_name: Optional[str] = None) -> Reference:
    """Build the Reference for a run from `--ref_model`: `reference_free` -> none; `ref_model=None` means "the
    starting policy": with `use_peft` its adapter-off base (no copy), otherwise a frozen copy of `policy_name`
    (the run's `--model`). A given `ref_model` must share the policy's vocabulary. A frozen copy is prepared for
    the accelerator (under DeepSpeed ZeRO-3 as a sharded inference engine)."""
    if reference_free:
        return Reference("none")
    if ref_model is None:
        if use_peft:
            return Reference("adapter_off", policy=policy)
        if policy_name is None:
            raise ValueError("create_reference needs policy_name (--model) for a frozen copy of the starting policy")
        ref_model = policy_name
    else:
        check_same_vocab(tokenizer, load_tokenizer(ref_model, trust_remote_code=trust_remote_code), "reference model")
    model = load_causal_lm(ref_model, tokenizer, bf16=bf16, trust_remote_code=trust_remote_code)
    model.eval().requires_grad_(False)
    if accelerator is not None:
        model = prepare_frozen(model, accelerator)
    return Reference("copy", model=model)


def prepare_frozen(model: nn.Module, accelerator) -> nn.Module:
    """Place a frozen model (reference, reward, value-free scorer) for inference. Under DeepSpeed ZeRO-3 it
    becomes an inference engine sharded like the policy; otherwise it is moved to the device (no DDP
    wrapper: it has no gradients to synchronise)."""
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


def make_accelerator(gradient_accumulation_steps: int, **kwargs):
    """The run's Accelerator. On a machine without a GPU, a multi-process launch (torchrun or accelerate launch)
    runs real ranks over gloo; a DeepSpeed launch keeps its engine (ZeRO code paths run on a CPU too)."""
    from accelerate import Accelerator

    use_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    accelerator = Accelerator(gradient_accumulation_steps=gradient_accumulation_steps,
                              cpu=not torch.cuda.is_available() and not use_deepspeed, **kwargs)
    accelerator.print(f"[accelerate] {accelerator.distributed_type.value}, {accelerator.num_processes} process(es), "
                      f"device {accelerator.device}")
    return accelerator


def unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP / DeepSpeed / compile wrappers (`.module`, `._orig_mod`)."""
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


# ---------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------
def make_generation_config(tokenizer, max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
                           min_new_tokens: Optional[int] = None):
    """Sampling config for training (pure temperature sampling: top_k=0, top_p=1.0) or, with `greedy=True`,
    the deterministic config used for evaluation. pad/eos ids come from the tokenizer; the pad token is
    suppressed (never generated)."""
    from transformers import GenerationConfig

    if not greedy and temperature <= 0:
        raise UserError(f"temperature must be > 0 for sampling, got {temperature}")
    # pad is never a valid output: a sampled pad would read as padding everywhere downstream
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  suppress_tokens=[tokenizer.pad_token_id])
    if min_new_tokens:
        kwargs["min_new_tokens"] = min_new_tokens
    if greedy:
        return GenerationConfig(do_sample=False, **kwargs)
    return GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, **kwargs)


def _prefill_shared(model: nn.Module, queries: torch.Tensor, pad_token_id: int) -> dict:
    """Repeated queries (RLOO's k samples of a prompt): encode each distinct query, all but its last token, once
    and hand `generate` the key/value cache with one row per query (`generate` then runs the last token).
    Returns generate's extra keyword arguments: {} when sharing saves too little (see `shared_queries`)."""
    plan = _sharing_plan(model, queries, queries.shape[1] - 1)
    if plan is None or not _sharing_verified(
            model, lambda: _shared_logits(model, queries, queries.shape[1] - 1, pad_token_id, plan),
            lambda: _plain_logits(model, queries, queries.shape[1] - 1, pad_token_id), queries[:, -1:] != pad_token_id):
        return {}
    _, cache = _encode_queries(model, plan, pad_token_id, **_keep_last(model, 1))
    return {} if cache is None else {"cache": cache}


@torch.no_grad()
def batch_generation(model: nn.Module, queries: torch.Tensor, pad_token_id: int, eos_token_id: int,
                     generation_config, chunk_size: int, accelerator=None):
    """Generate responses for a LEFT-padded batch of queries, `chunk_size` rows at a time.

    queries: (B, Lq) left-padded with pad_token_id.
    Returns (query_responses, logprobs):
      query_responses (B, Lq + max_new_tokens): query then response; after the first EOS (kept) every token
        is pad, and short responses are right-padded to max_new_tokens.
      logprobs (B, max_new_tokens): log-probs of the sampled tokens under the sampling distribution (the
        processed scores: logits / temperature, suppressed tokens such as pad removed), INVALID_LOGPROB
        after EOS. A forward pass gives the same values up to the (tiny) probability mass of suppressed tokens.
    Rows with the same query share the encoding of that query (see `_prefill_shared`).
    """
    R = generation_config.max_new_tokens
    generation_config = copy.deepcopy(generation_config)
    generation_config.return_dict_in_generate, generation_config.output_scores = True, True
    responses, logprobs = [], []
    with unwrap_for_generation(model, accelerator) as gen_model:
        for i in range(0, queries.shape[0], chunk_size):
            query = queries[i:i + chunk_size]
            out = gen_model.generate(input_ids=query, attention_mask=(query != pad_token_id).long(),
                                     generation_config=generation_config,
                                     **_prefill_shared(gen_model, query, pad_token_id))
            response = out.sequences[:, query.shape[1]:]
            scores = torch.stack(out.scores, 1).float()  # (b, r, V), r <= R, processed as sampled
            logprob = torch.gather(scores.log_softmax(-1), 2, response.unsqueeze(-1)).squeeze(-1)
            responses.append(F.pad(response, (0, R - response.shape[1]), value=pad_token_id))
            logprobs.append(F.pad(logprob, (0, R - logprob.shape[1]), value=INVALID_LOGPROB))
    responses = truncate_after_eos(torch.cat(responses), eos_token_id, pad_token_id)
    logprobs = torch.cat(logprobs).masked_fill(responses == pad_token_id, INVALID_LOGPROB).nan_to_num(INVALID_LOGPROB)
    return torch.cat([queries, responses], 1), logprobs


# ---------------------------------------------------------------------------------------------------------
# Forward passes: logits and log-probs of response tokens, padding-safe
# ---------------------------------------------------------------------------------------------------------
def padding_inputs(query_responses: torch.Tensor, pad_token_id: int):
    """attention_mask and position_ids for rows with left-padded queries and right-padded responses:
    positions count real tokens only, so a row's logits do not depend on how much padding surrounds it."""
    attention_mask = (query_responses != pad_token_id).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return attention_mask, position_ids


# Rows that share a prompt (RLOO's k samples of one prompt, DPO's chosen and rejected, KTO's matched and
# mismatched pairs) need that prompt encoded only once: each distinct query runs once with a key/value cache, the
# cache rows are selected for every sequence, and only the response tokens run on top. The numbers are those of
# one full forward (to float rounding); the saving is the duplicated prompt tokens, in the forward and backward.
# Sharing costs one more model call, so it is used only when it saves at least SHARE_MIN_FRACTION of the input
# positions and at least SHARE_MIN_POSITIONS of them (below that, on a tiny model, the extra call costs more).
SHARE_MIN_FRACTION, SHARE_MIN_POSITIONS = 0.2, 128


def shared_queries(query_responses: torch.Tensor, context_length: int):
    """(B, T) -> (queries (U, Lq), inverse (B,)) with query_responses[:, :Lq] == queries[inverse], or None when
    encoding only the U distinct queries saves too little (see SHARE_MIN_*; then one plain forward is used)."""
    if context_length == 0 or query_responses.shape[1] == context_length:
        return None
    queries, inverse = torch.unique(query_responses[:, :context_length], dim=0, return_inverse=True)
    saved = (query_responses.shape[0] - queries.shape[0]) * context_length
    if saved < max(SHARE_MIN_FRACTION * query_responses.numel(), SHARE_MIN_POSITIONS):
        return None
    return queries, inverse


def _can_share(model: nn.Module) -> bool:
    """A key/value cache is returned unless the model is training with activation checkpointing."""
    return not (torch.is_grad_enabled() and model.training and
                any(getattr(m, "gradient_checkpointing", False) for m in unwrap(model).modules()))


def all_processes_agree(flag: bool, device) -> bool:
    """True only when `flag` is True on every process (one tiny all-reduce; `flag` itself in a single process).
    For data-dependent choices that change how many model calls a step makes: under ZeRO-3 or FSDP every
    process must make the same calls, or the parameter gathers wait for each other forever."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    agreed = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


_SHARING_VERIFIED = weakref.WeakKeyDictionary()  # model -> shared-prompt results matched a plain forward?


def _sharing_plan(model: nn.Module, query_responses: torch.Tensor, context_length: int, share: bool = True):
    """`shared_queries`' plan when this model may share prompts here, agreed by every process; else None."""
    ok = share and _SHARING_VERIFIED.get(unwrap(model), True) and _can_share(model)
    plan = shared_queries(query_responses, context_length) if ok else None
    return plan if all_processes_agree(plan is not None, query_responses.device) else None


def _sharing_verified(model: nn.Module, shared: Callable, plain: Callable, mask: torch.Tensor) -> bool:
    """The first time a model shares prompts, compare with the plain forward (no grad, once) at the real
    response positions `mask` (B, R); a model whose key/value cache does not reproduce the plain forward (or
    returns none) is reported once and from then on always run plain. The verdict is agreed by all processes."""
    key = unwrap(model)
    if key not in _SHARING_VERIFIED:
        with torch.no_grad():
            try:
                a = shared()
            except TypeError:  # custom model code without a `cache` argument
                a = None
            b = plain()
        ok = a is not None
        if ok and mask.any():
            low_precision = torch.float32 not in (a.dtype, b.dtype) or a.dtype != b.dtype
            a, b = a[mask].float(), b[mask].float()
            tolerance = (5e-2 if low_precision else 1e-4) * (1 + b.abs().max())  # float noise of two summation orders
            ok = bool((a - b).abs().max() <= tolerance)
        ok = all_processes_agree(ok, mask.device)
        if not ok:
            print(f"[policy_common] {type(key).__name__}: encoding a shared prompt once does not reproduce the "
                  "plain forward with this model; prompts are encoded per row from now on", flush=True)
        _SHARING_VERIFIED[key] = ok
    return _SHARING_VERIFIED[key]


def _encode_queries(model: nn.Module, plan, pad_token_id: int, **kwargs):
    """Run the U distinct queries of `plan` = (queries, inverse) once. Returns (output, key/value cache with one
    row per sequence, rows selected by `inverse`), or (output, None) when the model returned no usable cache."""
    queries, inverse = plan
    mask, positions = padding_inputs(queries, pad_token_id)
    out = model(input_ids=queries.masked_fill(mask == 0, 0), attention_mask=mask, position_ids=positions,
                use_cache=True, **kwargs)
    cache = getattr(out, "cache", None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return out, None
    cache.batch_select_indices(inverse)
    return out, cache


def _run_shared(model: nn.Module, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                plan, **prompt_kwargs):
    """Run the distinct queries once (returning a cache), then the responses of all rows on the selected cache
    rows. Returns (prompt_out, response_out), or None when the model returned no cache."""
    attention_mask, position_ids = padding_inputs(query_responses, pad_token_id)
    prompt_out, cache = _encode_queries(model, plan, pad_token_id, **prompt_kwargs)
    if cache is None:
        return None
    responses = query_responses[:, context_length:]
    response_out = model(input_ids=responses.masked_fill(attention_mask[:, context_length:] == 0, 0),
                         attention_mask=attention_mask, position_ids=position_ids[:, context_length:], cache=cache,
                         use_cache=True)
    return prompt_out, response_out


_KEEPS_LOGITS = {}  # model class -> whether its forward takes `logits_to_keep`


def _keep_last(model: nn.Module, n: int) -> dict:
    """forward kwargs computing the output layer on the last `n` positions only, where the model supports it
    (all transformers 5 causal LMs; custom code may not): callers slice [:, -n:] either way."""
    inner = unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT
    if type(inner) not in _KEEPS_LOGITS:
        _KEEPS_LOGITS[type(inner)] = "logits_to_keep" in inspect.signature(inner.forward).parameters
    return {"logits_to_keep": n} if _KEEPS_LOGITS[type(inner)] else {}


def _plain_logits(model, query_responses, context_length, pad_token_id):
    attention_mask, position_ids = padding_inputs(query_responses, pad_token_id)
    input_ids = query_responses.masked_fill(attention_mask == 0, 0)  # pad ids may be outside the embedding
    R = query_responses.shape[1] - context_length
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                **_keep_last(model, R + 1))
    return out.logits[:, -(R + 1):-1]


def _shared_logits(model, query_responses, context_length, pad_token_id, plan):
    outs = _run_shared(model, query_responses, context_length, pad_token_id, plan, **_keep_last(model, 1))
    if outs is None:
        return None
    prompt_out, response_out = outs
    return torch.cat([prompt_out.logits[:, -1:][plan[1]], response_out.logits[:, :-1]], 1)


def forward_logits(model: nn.Module, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                   temperature: float = 1.0, share_prompts: bool = True) -> torch.Tensor:
    """(B, T) ids -> (B, T - context_length, V) logits / temperature that predict the response tokens
    query_responses[:, context_length:]. Temperature is applied here and only here. Only the response positions
    go through the output layer. With `share_prompts`, rows with identical queries encode the query once
    (see `shared_queries`; checked against the plain forward the first time for each model); same result."""
    args = (model, query_responses, context_length, pad_token_id)
    plan = _sharing_plan(model, query_responses, context_length, share_prompts)
    logits = None
    if plan is not None and _sharing_verified(model, lambda: _shared_logits(*args, plan), lambda: _plain_logits(*args),
                                              query_responses[:, context_length:] != pad_token_id):
        logits = _shared_logits(*args, plan)
    if logits is None:
        logits = _plain_logits(*args)
    return logits / temperature if temperature != 1.0 else logits


def selective_logprobs(logits: torch.Tensor, tokens: torch.Tensor, chunk_bytes: int = 2**25) -> torch.Tensor:
    """(B, R, V) logits, (B, R) tokens -> (B, R) log softmax(logits)[token]. Rows are processed in chunks of at
    most `chunk_bytes` of float32 log-softmax work (32 MiB by default), so a full-batch (B, R, V) log-softmax is
    never materialised at real vocabulary sizes, while small batches go in one vectorised call."""
    rows = max(1, chunk_bytes // (4 * logits[0].numel()))
    token_logits = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        logsumexp = torch.cat([torch.logsumexp(logits[i:i + rows], dim=-1) for i in range(0, len(logits), rows)])
        return token_logits - logsumexp
    # low precision: logsumexp in bf16 is inaccurate, so compute the log-softmax in float32
    return torch.cat([torch.gather(logits[i:i + rows].float().log_softmax(-1), -1, tokens[i:i + rows].unsqueeze(-1)).squeeze(-1)
                      for i in range(0, len(logits), rows)])


def entropy_from_logits(logits: torch.Tensor, chunk_bytes: int = 2**25) -> torch.Tensor:
    """(B, R, V) -> (B, R) entropy of softmax(logits), in row chunks of at most `chunk_bytes` of float32 work
    (as `selective_logprobs`)."""
    rows = max(1, chunk_bytes // (4 * logits[0].numel()))
    out = []
    for i in range(0, len(logits), rows):
        chunk = logits[i:i + rows].float()
        out.append(torch.logsumexp(chunk, -1) - (chunk.softmax(-1) * chunk).sum(-1))
    return torch.cat(out)


def response_logprobs(model: nn.Module, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                      temperature: float = 1.0, share_prompts: bool = True) -> torch.Tensor:
    """(B, T) ids -> (B, T - context_length) log-probs of the response tokens under logits / temperature.
    Positions holding pad carry meaningless values: mask them with `responses != pad_token_id`."""
    logits = forward_logits(model, query_responses, context_length, pad_token_id, temperature, share_prompts)
    return selective_logprobs(logits, query_responses[:, context_length:])


def _plain_hidden(backbone, query_responses, pad_token_id):
    attention_mask, position_ids = padding_inputs(query_responses, pad_token_id)
    return backbone(input_ids=query_responses.masked_fill(attention_mask == 0, 0), attention_mask=attention_mask,
                    position_ids=position_ids, use_cache=False).last_hidden_state


def _shared_hidden(backbone, query_responses, context_length, pad_token_id, plan):
    outs = _run_shared(backbone, query_responses, context_length, pad_token_id, plan)
    if outs is None:
        return None
    prompt_out, response_out = outs
    return torch.cat([prompt_out.last_hidden_state[plan[1]], response_out.last_hidden_state], 1)


def scalar_forward(model: nn.Module, query_responses: torch.Tensor, pad_token_id: int,
                   context_length: Optional[int] = None) -> torch.Tensor:
    """Per-token scalar outputs of a sequence-classification model (reward or value): (B, T) -> (B, T).
    Runs the backbone and the `score` head directly so that every position is read, padding-safe. Given
    `context_length`, rows with identical queries encode the query once (see `forward_logits`)."""
    base = unwrap(model)
    backbone = getattr(base, base.base_model_prefix)
    plan = _sharing_plan(model, query_responses, context_length) if context_length else None
    hidden = None
    if plan is not None and _sharing_verified(
            model, lambda: _shared_hidden(backbone, query_responses, context_length, pad_token_id, plan),
            lambda: _plain_hidden(backbone, query_responses, pad_token_id), query_responses != pad_token_id):
        hidden = _shared_hidden(backbone, query_responses, context_length, pad_token_id, plan)
    if hidden is None:
        hidden = _plain_hidden(backbone, query_responses, pad_token_id)
    return base.score(hidden).squeeze(-1)


def get_reward(model: nn.Module, query_responses: torch.Tensor, pad_token_id: int,
               context_length: Optional[int] = None) -> torch.Tensor:
    """(B, T) -> (B,) reward-model score read at the last non-pad token of each row (`context_length`: as in
    `scalar_forward`)."""
    values = scalar_forward(model, query_responses, pad_token_id, context_length)
    last = last_token_index(query_responses != pad_token_id)
    return values[torch.arange(values.shape[0], device=values.device), last]


# ---------------------------------------------------------------------------------------------------------
# Small tensor utilities
# ---------------------------------------------------------------------------------------------------------
def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """(B, L) bool -> (B,) index of the first True in each row, or L when a row has none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool mask of real tokens -> (B,) index of the last True (0 for an all-False row)."""
    L = mask.shape[1]
    return (L - 1 - first_true_indices(mask.flip(1))).clamp(min=0)


def truncate_after_eos(responses: torch.Tensor, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """(B, R) -> (B, R): keep each row up to and including its first EOS, pad everything after it."""
    eos_index = first_true_indices(responses == eos_token_id)
    after_eos = torch.arange(responses.shape[1], device=responses.device).unsqueeze(0) > eos_index.unsqueeze(1)
    return responses.masked_fill(after_eos, pad_token_id)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of `values` where `mask` is True (over all elements, or along `dim`)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(dim) / mask.sum(dim)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` where `mask` is True (Bessel-corrected by default)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError("masked_var needs at least two unmasked values")
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the masked entries; mean added back if not shift_mean."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def is_finite(value) -> bool:
    """True for a finite number or tensor (all elements), and for None: the gradient norm that accelerate returns
    under DeepSpeed may be None (DeepSpeed clips, and steps, inside `accelerator.backward`)."""
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return math.isfinite(float(value))


def exact_div(a: int, b: int, what: str) -> int:
    """a / b as an int, or a UserError that says which batch sizes do not divide."""
    if b <= 0 or a % b != 0:
        raise UserError(f"{what}: {a} is not divisible by {b}")
    return a // b


def pad_sequences(seqs: Sequence[Sequence[int]], pad_token_id: int, side: str) -> torch.Tensor:
    """List of token-id lists -> (B, max_len) tensor, padded on `side` ("left" or "right")."""
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            if side == "left":
                out[i, width - len(s):] = torch.as_tensor(s)
            else:
                out[i, :len(s)] = torch.as_tensor(s)
    return out


# ---------------------------------------------------------------------------------------------------------
# Data: loading, columns, chat templates, prompt/completion tokenisation
# ---------------------------------------------------------------------------------------------------------
def load_any_dataset(name: str, form: str, split: str):
    """Load one split of a dataset given by alias (`toy`, `tldr`), local `save_to_disk` folder, local
    .json/.jsonl/.parquet file(s) (comma-separated), or hub id. `form` is "prompt", "preference" or
    "unpaired" and picks the alias's matching dataset. An empty split is a UserError."""
    import datasets

    if name == TOY_ALIAS:
        import toy_task

        name = toy_task.build()[f"{form}_dataset"]
    elif name in DATASET_ALIASES:
        name = DATASET_ALIASES[name][form]
    files = [f for f in name.split(",") if f]
    try:
        if os.path.isdir(name) and (os.path.exists(os.path.join(name, "dataset_dict.json"))
                                    or os.path.exists(os.path.join(name, "state.json"))):
            ds = datasets.load_from_disk(name, keep_in_memory=True)  # later .map() writes no cache files here
        elif files and all(f.endswith((".json", ".jsonl", ".parquet")) for f in files):
            missing = [f for f in files if not os.path.exists(f)]
            if missing:
                raise UserError(f"dataset file(s) not found: {', '.join(missing)}")
            empty = [f for f in files if os.path.getsize(f) == 0]
            if empty:
                raise UserError(f"dataset file(s) are empty: {', '.join(empty)}")
            try:
                ds = datasets.load_dataset("parquet" if files[0].endswith(".parquet") else "json", data_files=files)
            except Exception as e:  # malformed files surface as assorted pyarrow/datasets errors
                raise UserError(f"could not read dataset file(s) {name!r}: {type(e).__name__}: {_first_line(e)}") from None
        elif os.path.exists(name) or name.startswith((".", "/", "~")):
            raise UserError(f"dataset {name!r}: not a save_to_disk folder nor .json/.jsonl/.parquet file(s)")
        else:
            if not hub_reachable() and not _in_datasets_cache(name):
                raise UserError(f"could not load dataset {name!r}: not a local path, and the hub is unreachable "
                                f"(offline); known aliases: {', '.join([TOY_ALIAS, *DATASET_ALIASES])}")
            ds = datasets.load_dataset(name)
    except (FileNotFoundError, ConnectionError, OSError) as e:
        raise UserError(f"could not load dataset {name!r}: {_first_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"dataset {name!r} has no split {split!r} (has: {', '.join(ds.keys())})")
        ds = ds[split]
    if len(ds) == 0:
        raise UserError(f"dataset {name!r} split {split!r} is empty")
    return ds


def _in_datasets_cache(name: str) -> bool:
    import datasets

    cache = os.environ.get("HF_DATASETS_CACHE", datasets.config.HF_DATASETS_CACHE)
    return os.path.isdir(os.path.join(str(cache), name.replace("/", "___")))


def require_columns(dataset, columns: Iterable[str], name: str) -> None:
    """UserError naming every required column the dataset lacks."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise UserError(f"dataset {name!r} is missing column(s) {missing}; it has {dataset.column_names}")


def is_conversational(value) -> bool:
    """True for a list of {"role", "content"} messages (the conversational dataset form)."""
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]


def render_prompt(tokenizer, prompt) -> str:
    """Text of a prompt: unchanged if already text; messages are rendered with the chat template and the
    generation prompt appended."""
    if is_conversational(prompt):
        if tokenizer.chat_template is None:
            raise UserError("conversational data needs a tokenizer with a chat template")
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt


def render_completion(tokenizer, prompt, completion) -> str:
    """Text of a completion: unchanged if text; for messages, the chat-template rendering of prompt+completion
    minus the rendering of the prompt (so that the two concatenate back to the full conversation)."""
    if is_conversational(completion):
        full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        head = render_prompt(tokenizer, prompt)
        if not full.startswith(head):
            raise UserError("chat template does not render the prompt as a prefix of prompt+completion")
        return full[len(head):]
    return completion


def tokenize_prompt_completion(tokenizer, prompt: str, completion: str, max_prompt_length: int,
                               max_length: int):
    """Token ids of (prompt, completion + EOS) under the documented truncation rule:
    1. the prompt keeps its LAST `max_prompt_length` tokens (truncated from the left);
    2. the completion keeps its FIRST `max_length - len(prompt)` tokens (truncated from the right);
    EOS is appended before truncation, so a truncated completion has no EOS. Returns (prompt_ids,
    completion_ids); completion_ids is empty when truncation removed all of it (callers drop and count)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-max_prompt_length:] if max_prompt_length > 0 else []
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids, completion_ids[:max(0, max_length - len(prompt_ids))]


def tokenize_prompts(tokenizer, prompts: Sequence, max_prompt_length: int) -> List[List[int]]:
    """Token ids of each prompt (rendered with the chat template if conversational). A prompt longer than
    `max_prompt_length` is a UserError (RL scripts refuse rather than silently cut the task)."""
    out = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            raise UserError(f"prompt {i} has {len(ids)} tokens, more than --max_prompt_length {max_prompt_length}; "
                            "raise the limit or filter the dataset")
        if len(ids) == 0:
            raise UserError(f"prompt {i} is empty")
        out.append(ids)
    return out


# ---------------------------------------------------------------------------------------------------------
# Runs: seeding, run folder, metrics, saving, checkpoints
# ---------------------------------------------------------------------------------------------------------
def seed_everything(seed: int, process_index: int = 0) -> int:
    """Seed python, numpy and torch with seed + process_index (each process samples differently, runs
    repeat exactly). Returns the per-process seed."""
    local_seed = seed + process_index
    random.seed(local_seed)
    np.random.seed(local_seed % 2**32)
    torch.manual_seed(local_seed)
    return local_seed


def run_name(script: str, dataset: str, seed: int) -> str:
    """`<dataset>__<script>__<seed>__<unix time>`, as in CleanRL."""
    return f"{os.path.basename(dataset.rstrip('/'))}__{script}__{seed}__{int(time.time())}"


def config_dict(args) -> dict:
    """Args dataclass (or namespace, or dict) -> plain dict for args.json and wandb."""
    if isinstance(args, dict):
        return dict(args)
    return asdict(args) if is_dataclass(args) else dict(vars(args))


class MetricsLogger:
    """Append one JSON object per `log` call to `<output_dir>/metrics.jsonl` (always), and send the same
    metrics to wandb when `track` is on. Only the main process writes; others are no-ops. The wandb API
    key is never written anywhere by this class."""

    def __init__(self, output_dir: str, args, is_main_process: bool = True, track: bool = False,
                 wandb_project: str = "policy-rlhf", run_name: Optional[str] = None,
                 resume_step: Optional[int] = None):
        """A fresh run refuses an output folder that already holds metrics (it is never overwritten); a
        resumed run (`resume_step` = the checkpoint's step) keeps the rows up to that step."""
        self.active, self.track = is_main_process, track and is_main_process
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if not self.active:
            return
        if os.path.exists(self.path):
            if resume_step is None:
                raise UserError(f"{output_dir!r} already holds a run (metrics.jsonl); choose another --output_dir "
                                "or pass --resume_from")
            with open(self.path) as f:
                rows = [line for line in f if json.loads(line)["step"] <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(rows)
        os.makedirs(output_dir, exist_ok=True)
        config = config_dict(args)
        with open(os.path.join(output_dir, "args.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
        if self.track:
            import wandb

            wandb.init(project=wandb_project, name=run_name, config=config, dir=output_dir)
            wandb.run.log_code(".", include_fn=lambda p: p.endswith(".py"))

    def log(self, metrics: Dict[str, float], step: int) -> None:
        if not self.active:
            return
        row = {"step": step, **{k: _to_float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.track:
            import wandb

            wandb.log(row, step=step)

    def log_samples(self, name: str, rows: List[Dict[str, object]], step: int) -> None:
        """Sample table (prompt/response/score rows): printed, and a wandb Table when tracking."""
        if not self.active:
            return
        for row in rows:
            print(" | ".join(f"{k}: {v}" for k, v in row.items()))
        if self.track and rows:
            import wandb

            wandb.log({name: wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}, step=step)

    def close(self) -> None:
        if self.track:
            import wandb

            wandb.finish()


def _to_float(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


def reduce_metrics(accelerator, metrics: Dict[str, float]) -> Dict[str, float]:
    """Average a dict of scalars across processes (one all-reduce for the whole dict)."""
    if accelerator is None or accelerator.num_processes == 1:
        return {k: _to_float(v) for k, v in metrics.items()}
    keys = sorted(metrics)
    values = torch.tensor([float(_to_float(metrics[k])) for k in keys], device=accelerator.device)
    values = accelerator.reduce(values, reduction="mean")
    return dict(zip(keys, values.tolist()))


@contextlib.contextmanager
def atomic_dir(path: str):
    """Yield a temporary sibling folder to write into; on success it replaces `path` in one rename, so a
    reader never sees a half-written folder. On failure the temporary folder is removed."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = f"{path}.old-{os.getpid()}"
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save_model(accelerator, model: nn.Module, tokenizer, path: str, merge_peft: bool = False,
               submodule: Optional[str] = None) -> None:
    """Save `model` (+ tokenizer) to `path` atomically, safetensors, loadable by `from_pretrained`.
    `model` is the object given to `accelerator.prepare` (under ZeRO-3 its shards are gathered); `submodule`
    names a child to save on its own (e.g. "policy" of a policy+value wrapper). A PEFT model saves its adapter;
    with `merge_peft` the merged full weights are saved instead."""
    if accelerator is not None:
        accelerator.wait_for_everyone()
        state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards on the main process
        is_main = accelerator.is_main_process
    else:
        state_dict, is_main = None, True
    if not is_main:
        return
    base = unwrap(model)
    if submodule is not None:
        base = getattr(base, submodule)
        if state_dict is not None:
            state_dict = {k[len(submodule) + 1:]: v for k, v in state_dict.items() if k.startswith(submodule + ".")}
    with atomic_dir(path) as tmp:
        if merge_peft and hasattr(base, "merge_and_unload"):
            merged = copy.deepcopy(base).merge_and_unload()
            merged.save_pretrained(tmp, safe_serialization=True)
        else:
            base.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def save_checkpoint(accelerator, path: str, extra_state: dict, scheduler=None) -> None:
    """Atomically write a resumable checkpoint: accelerate state (model weights as safetensors, optimizer, RNG
    states of every process) plus `extra_state` (step, data position, ...) and the LR scheduler's state as
    JSON in trainer_state.json (JSON, not pickle: resuming never unpickles objects)."""
    if scheduler is not None:
        extra_state = {**extra_state, "_scheduler": _jsonable(scheduler.state_dict())}
    accelerator.wait_for_everyone()
    path = os.path.abspath(path)
    tmp = f"{path}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp, safe_serialization=True)
    accelerator.wait_for_everyone()  # every rank's RNG file is in tmp before the rename
    if accelerator.is_main_process:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(extra_state, f)
        old = f"{path}.old"
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, path: str, scheduler=None) -> dict:
    """Restore what `save_checkpoint` wrote (into the prepared model/optimizer and `scheduler`); returns its
    `extra_state`. Tensors load through safetensors / torch.load(weights_only=True) inside accelerate."""
    state_file = os.path.join(path, "trainer_state.json")
    if not os.path.exists(state_file):
        raise UserError(f"--resume_from {path!r} is not a checkpoint (no trainer_state.json)")
    accelerator.load_state(path)
    with open(state_file) as f:
        state = json.load(f)
    scheduler_state = state.pop("_scheduler", None)
    if scheduler is not None:
        if scheduler_state is None:
            raise UserError(f"checkpoint {path!r} holds no LR scheduler state")
        scheduler.load_state_dict(scheduler_state)
    return state


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else None


class StopSignal:
    """Turn SIGTERM / Ctrl-C into a flag the training loop checks between steps, so it can write a checkpoint
    and exit cleanly instead of dying mid-step."""

    def __init__(self):
        self.received = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
