"""Scale-out on this CPU machine: every script under a real 2-process (gloo) launch, and DeepSpeed ZeRO-3.

The launch that works here: `ACCELERATE_USE_CPU=1 torchrun --standalone --nproc_per_node 2 <script>.py ...`
(see README "Multi-process and DeepSpeed"). Each process gets one thread so the two do not oversubscribe
the two cores.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, read_metrics, run_distributed, run_script, script_env

SHORT = {  # a few steps of each script on the toy task, small enough for two processes on two cores, with 3
    # held-out prompts (2 on one process, 1 on the other) evaluated one at a time: an uneven evaluation split must
    # not make the processes disagree on their collectives (DDP syncs buffers in every forward)
    "rloo.py": ["--max_steps", "2", "--per_device_train_batch_size", "8", "--rloo_k", "4", "--num_eval_prompts", "3",
                "--local_rollout_forward_batch_size", "1"],
    # 8 prompts x k=4 per process: shared-prompt encoding is used in training
    "rloo.py shared": ["--max_steps", "2", "--per_device_train_batch_size", "32", "--rloo_k", "4",
                       "--num_eval_prompts", "3"],
    # batch-scaled advantages and dapo's token count are reduced over the processes; the reference is loaded
    "grpo.py": ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
                "--scale_rewards", "batch", "--num_eval_prompts", "3", "--local_rollout_forward_batch_size", "1"],
    # no reference; pass@k / mean@k sampled on an uneven evaluation split; old log-probs (num_iterations 2)
    "grpo.py gold": ["--max_steps", "2", "--per_device_train_batch_size", "8", "--reward_funcs", "gold", "--beta", "0",
                     "--num_eval_generations", "2", "--num_iterations", "2", "--num_eval_prompts", "3"],
    "ppo.py": ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_mini_batches", "1",
               "--num_eval_prompts", "3", "--local_rollout_forward_batch_size", "1"],
    "dpo.py": ["--max_steps", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
               "--num_eval_prompts", "3", "--max_eval_pairs", "5", "--per_device_eval_batch_size", "1"],
    "kto.py": ["--max_steps", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
               "--num_eval_prompts", "3", "--num_eval_examples", "10", "--per_device_eval_batch_size", "2"],
}


EXIT_SCRIPT = """
import atexit, os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, {root!r})
from plumbing import run_utils as ru

def main():
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))  # keeps the group alive past destroy
    model(torch.ones(1, 2)).sum().backward()
    rank = dist.get_rank()
    atexit.register(lambda: open(os.path.join({out!r}, f"exit-handler-ran-{{rank}}"), "w").close())

ru.main_guard(main)
sys.exit(3)  # not reached: a finished multi-process run leaves from main_guard with code 0
"""


def test_finished_multi_process_run_exits_zero_after_its_exit_handlers(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(EXIT_SCRIPT.format(root=ROOT, out=str(tmp_path)))
    run_distributed(str(script), timeout=120)
    assert sorted(p.name for p in tmp_path.glob("exit-handler-ran-*")) == ["exit-handler-ran-0", "exit-handler-ran-1"]


@pytest.mark.parametrize("case", sorted(SHORT))
def test_two_processes(case, tmp_path, toy):
    out = tmp_path / "run"
    run_distributed(case.split()[0], *SHORT[case], "--output_dir", str(out), timeout=300)
    rows = read_metrics(str(out))
    train_steps = sorted({r["step"] for r in rows if r["step"] > 0})
    assert train_steps == [1, 2], rows  # one row per step: only the main process logs
    assert all(json.dumps(r).count("NaN") == 0 for r in rows)
    assert any("eval/gold_score" in r for r in rows)
    assert os.path.exists(out / "model" / "config.json")


def test_every_process_refuses_a_used_output_folder(tmp_path, toy):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(AssertionError) as failed:
        run_distributed("rloo.py", "--max_steps", "1", "--output_dir", str(tmp_path), timeout=300)
    assert str(failed.value).count("already holds a run (metrics.jsonl)") == 2, failed.value  # one line per process
    assert "[rank1]: Traceback" not in str(failed.value)  # not a collective left waiting for the main process
    assert str(failed.value).count("exitcode  : 2 (pid") == 2, failed.value  # the usage-error code on both


def test_dpo_first_step_loss_independent_of_process_count(tmp_path, toy):
    """The same global batch of 8 pairs: one process x 8, or two processes x 4. The first step's loss (before
    any update) must agree."""
    common = ["--max_steps", "1", "--gradient_accumulation_steps", "1", "--num_eval_prompts", "8", "--seed", "3"]
    run_distributed("dpo.py", *common, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "two"))
    run_script("dpo.py", *common, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one"),
               threads=1)

    def first(d):
        return next(r for r in read_metrics(str(tmp_path / d)) if r["step"] == 1 and "loss" in r)

    one, two = first("one"), first("two")
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert two["rewards/accuracies"] == pytest.approx(one["rewards/accuracies"], abs=1e-6)


def test_deepspeed_zero3_on_cpu(tmp_path, toy):
    """ZeRO-3 code paths that run on a CPU (one process): the policy's parameters gathered for generation, the
    frozen reference and reward model as ZeRO-3 inference engines (each called twice per forward when a prompt is
    shared), shards gathered for the final save."""
    pytest.importorskip("deepspeed")
    env = script_env(threads=1)
    out = tmp_path / "zero3"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ROOT, "configs", "deepspeed_zero3_cpu.yaml"), os.path.join(ROOT, "rloo.py"),
           "--max_steps", "2", "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "1",
           "--num_eval_prompts", "8", "--output_dir", str(out)]  # 8 prompts x k=4: shared-prompt encoding is used
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "[accelerate] DEEPSPEED" in proc.stdout
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows if "objective/scores" in r] == [1, 2]
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out / "model")  # full weights, not empty ZeRO-3 shards
    sft = AutoModelForCausalLM.from_pretrained(toy["policy"])
    assert all(p.shape == q.shape for p, q in zip(reloaded.parameters(), sft.parameters()))
    assert any(not torch.equal(p, q) for p, q in zip(reloaded.parameters(), sft.parameters()))
    # under ZeRO-3 the output layer always runs in chunks (chunked_head.wanted: every process makes the same
    # gathers); the full-logits path gives the same numbers
    full = tmp_path / "zero3_full"
    proc = subprocess.run(cmd[:-1] + [str(full), "--logprob_chunk_tokens", "0"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for chunked_row, full_row in zip(rows, read_metrics(str(full))):
        for key in ("objective/kl", "objective/entropy", "loss/policy"):
            if key in chunked_row:
                assert chunked_row[key] == pytest.approx(full_row[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("script,args", [
    ("rloo.py", ["--total_episodes", "100000", "--per_device_train_batch_size", "16", "--num_eval_prompts", "8"]),
    ("grpo.py", ["--total_episodes", "100000", "--per_device_train_batch_size", "16", "--num_eval_prompts", "8"]),
    ("grpo.py", ["--total_episodes", "100000", "--per_device_train_batch_size", "16", "--num_eval_prompts", "8",
                 "--max_staleness", "2"]),
    ("dpo.py", ["--num_train_epochs", "50", "--per_device_train_batch_size", "8", "--num_eval_prompts", "8",
                "--eval_steps", "0"]),
])
def test_sigterm_writes_a_checkpoint_then_resume_finishes(script, args, tmp_path, toy):
    """A run stopped by SIGTERM between steps checkpoints, exits cleanly, and resumes from there."""
    import signal
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, script), *args, "--output_dir", str(out)], cwd=ROOT,
                            env=script_env(threads=1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(out / "metrics.jsonl") and any(r["step"] >= 2 for r in read_metrics(str(out))):
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    checkpoints = [d for d in os.listdir(out) if d.startswith("checkpoint-") and ".tmp" not in d]
    assert len(checkpoints) == 1, os.listdir(out)
    step = int(checkpoints[0].split("-")[1])
    assert step == max(r["step"] for r in read_metrics(str(out)))
    if "--max_staleness" in args:  # the batches sampled ahead are in the checkpoint with it
        assert os.path.exists(out / checkpoints[0] / "pending-0.safetensors")
    run_script(script, *args, "--output_dir", str(out), "--resume_from", str(out / checkpoints[0]),
               "--max_steps", str(step + 2), threads=1)
    assert max(r["step"] for r in read_metrics(str(out))) == step + 2
    assert os.path.exists(out / "model" / "config.json")
