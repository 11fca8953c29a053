"""Security: no remote code unless asked for, checkpoints never unpickle arbitrary objects, no secrets on disk."""

import importlib
import json
import os
import shutil

import pytest
import torch

from plumbing import models
from plumbing import train_loop as tl

EVIL_MODULE = '''import os
open(os.environ["EVIL_MARKER"], "w").write("remote code ran")
from transformers import GPTNeoXForCausalLM
class EvilForCausalLM(GPTNeoXForCausalLM):
    pass
'''


def test_remote_code_runs_only_with_trust_remote_code(toy, tmp_path, monkeypatch):
    model_dir, marker = tmp_path / "m", tmp_path / "EXECUTED"
    monkeypatch.setenv("EVIL_MARKER", str(marker))
    shutil.copytree(toy["policy"], model_dir)
    (model_dir / "modeling_evil.py").write_text(EVIL_MODULE)
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model_dir / "config.json").write_text(json.dumps(config))
    tokenizer = models.load_tokenizer(str(model_dir))
    models.load_causal_lm(str(model_dir), tokenizer)
    assert not marker.exists()
    # the same folder does run its code when the user opts in: the check above can fail
    models.load_causal_lm(str(model_dir), tokenizer, trust_remote_code=True)
    assert marker.exists()


@pytest.mark.parametrize("script", ["rloo", "ppo", "dpo", "kto"])
def test_scripts_default_to_no_remote_code(script):
    module = importlib.import_module(script)
    assert module.Args().trust_remote_code is False


def test_checkpoints_load_without_unpickling(tmp_path, monkeypatch):
    """Model weights are safetensors; everything else accelerate reads goes through weights_only=True, and the
    scheduler travels as JSON."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / 10)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    tl.save_checkpoint(accelerator, str(tmp_path / "ckpt"), {"step": 1}, scheduler=scheduler)
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    # accelerate unpickles registered custom objects with weights_only=False: there must be none
    assert not [f for f in os.listdir(tmp_path / "ckpt") if f.startswith("custom_checkpoint")]

    real_load = torch.load

    def strict_load(*args, **kwargs):
        assert kwargs.get("weights_only", True), "torch.load called with weights_only=False"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", strict_load)
    fresh = Accelerator()  # a new run: its own prepared model and optimizer
    fresh_model = fresh.prepare(torch.nn.Linear(3, 2))
    fresh_optimizer = fresh.prepare(torch.optim.AdamW(fresh_model.parameters(), lr=1e-2))
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda s: 1 - s / 10)
    state = tl.load_checkpoint(fresh, str(tmp_path / "ckpt"), scheduler=fresh_scheduler)
    assert state == {"step": 1}
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    for a, b in zip(fresh_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
