"""Cross-script hardening: bad input fails in one line and touches nothing; non-finite values stop (or skip) a
run without losing the last good state; tracking never writes the wandb key."""

import os
import shutil

import pytest
import torch
from conftest import read_metrics, run_script, run_script_in_process

SCRIPTS = ["rloo.py", "ppo.py", "dpo.py", "kto.py"]
FEW_STEPS = {
    "rloo.py": ["--max_steps", "2", "--per_device_train_batch_size", "16", "--num_eval_prompts", "8"],
    "ppo.py": ["--max_steps", "2", "--per_device_train_batch_size", "16", "--num_mini_batches", "1",
               "--num_eval_prompts", "8"],
    "dpo.py": ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_eval_prompts", "8"],
    "kto.py": ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_eval_prompts", "8"],
}


def one_line_error(proc) -> str:
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_unknown_model_fails_in_one_line_and_leaves_output_untouched(script, tmp_path, toy):
    out = tmp_path / "existing_run"
    out.mkdir()
    (out / "keep.txt").write_text("finished work")
    rl = ["--reward_model", "toy"] if script in ("rloo.py", "ppo.py") else []
    proc = run_script_in_process(script, "--model", "pythia-3b", *rl, "--dataset", "toy", "--output_dir", str(out))
    assert "pythia-3b" in one_line_error(proc)
    assert sorted(os.listdir(out)) == ["keep.txt"] and (out / "keep.txt").read_text() == "finished work"


@pytest.fixture(scope="module")
def nan_reference(toy, tmp_path_factory):
    """The SFT policy with one NaN weight: every reference log-prob it gives is NaN (a broken checkpoint)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("nan_ref") / "model"
    model = AutoModelForCausalLM.from_pretrained(toy["policy"])
    with torch.no_grad():
        model.get_output_embeddings().weight[5, 0] = float("nan")
    model.save_pretrained(path)
    for f in os.listdir(toy["policy"]):
        if "token" in f:
            shutil.copy(os.path.join(toy["policy"], f), path)
    return str(path)


@pytest.mark.parametrize("script", SCRIPTS)
def test_nonfinite_loss_stops_with_checkpoint_or_is_skipped(script, tmp_path, nan_reference):
    out = tmp_path / "stop"
    proc = run_script(script, *FEW_STEPS[script], "--ref_model", nan_reference, "--output_dir", str(out),
                      check=False, threads=1)
    message = one_line_error(proc)
    assert "non-finite" in message and "step 1" in message.replace("update 1", "step 1"), message
    assert os.path.exists(out / "checkpoint-nonfinite" / "trainer_state.json")
    assert not os.path.exists(out / "model")

    out = tmp_path / "skip"
    run_script(script, *FEW_STEPS[script], "--ref_model", nan_reference, "--output_dir", str(out),
               "--skip_nonfinite", threads=1)
    rows = [r for r in read_metrics(str(out)) if "nonfinite/skipped" in r]
    # every optimizer step of both training steps was skipped (PPO counts its epochs' steps), and the run finished
    assert len(rows) >= 2 and 1 <= rows[0]["nonfinite/skipped"] < rows[-1]["nonfinite/skipped"]
    assert os.path.exists(out / "model" / "config.json")


def test_wandb_key_never_written(tmp_path, toy, monkeypatch):
    secret = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("WANDB_MODE", "offline")
    import conftest

    env_fn = conftest.script_env
    monkeypatch.setattr(conftest, "script_env", lambda threads=2: {**env_fn(threads), "WANDB_MODE": "offline"})
    out = tmp_path / "tracked"
    proc = run_script("dpo.py", *FEW_STEPS["dpo.py"], "--track", "--output_dir", str(out), threads=1)
    assert os.path.isdir(out / "wandb"), os.listdir(out)
    assert secret not in proc.stdout and secret not in proc.stderr
    for folder, _, files in os.walk(out):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                assert secret.encode() not in f.read(), os.path.join(folder, name)


COLUMNS = {"rloo.py": {"prompt": "a b ="}, "ppo.py": {"prompt": "a b ="},
           "dpo.py": {"prompt": "a b =", "chosen": " a b", "rejected": " b a"},
           "kto.py": {"prompt": "a b =", "completion": " a b", "label": True}}


@pytest.mark.parametrize("empty_split", ["train", "test"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_empty_split_fails_in_one_line(script, empty_split, tmp_path, toy):
    """A dataset whose train or held-out split has zero rows: one line naming the dataset and the split, nothing
    written."""
    from datasets import Dataset, DatasetDict

    row = COLUMNS[script]
    splits = {split: [row] * 64 for split in ("train", "test")}
    splits[empty_split] = []
    data = tmp_path / "data"
    DatasetDict({split: Dataset.from_list(rows) if rows else Dataset.from_dict({k: [] for k in row})
                 for split, rows in splits.items()}).save_to_disk(str(data))
    rl = ["--reward_model", "toy"] if script in ("rloo.py", "ppo.py") else []
    out = tmp_path / "run"
    proc = run_script_in_process(script, "--dataset", str(data), *rl, "--output_dir", str(out))
    message = one_line_error(proc)
    assert "empty" in message and repr(empty_split) in message, message
    assert not os.path.exists(out)
