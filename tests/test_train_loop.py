"""train_loop.py: the adaptive KL controller against hand-worked numbers, the optimizer step (clip, finite check, step,
skip or stop, the schedule's unit, the learning rate it reports) on a real small model against the obvious loop, and
the periodic / signalled checkpoints."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from plumbing import run_utils as ru
from plumbing import train_loop as tl
from plumbing.errors import UserError


# ---------------------------------------------------------------------------------------------------------
# The adaptive KL coefficient (Ziegler et al. 2019), one controller for rloo, grpo and ppo
# ---------------------------------------------------------------------------------------------------------
def test_adaptive_kl_coef_hand_worked():
    assert tl.adaptive_kl_coef(0.1, 5.0, 64, None, 1000) == 0.1  # no target: fixed
    assert tl.adaptive_kl_coef(0.1, 2.2, 100, 2.0, 1000) == pytest.approx(0.1 * (1 + 0.1 * 0.1))  # KL 10% above
    assert tl.adaptive_kl_coef(0.1, 0.9, 64, 1.0, 640) == pytest.approx(0.1 * (1 - 0.1 * 0.1))  # 10% below
    assert tl.adaptive_kl_coef(0.1, 9.0, 100, 2.0, 1000) == pytest.approx(0.1 * (1 + 0.2 * 0.1))  # clipped at +0.2
    assert tl.adaptive_kl_coef(0.1, 0.0, 500, 2.0, 1000) == pytest.approx(0.1 * (1 - 0.2 * 0.5))  # and at -0.2
    assert tl.adaptive_kl_coef(0.1, 1.0, 64, 1.0, 640) == pytest.approx(0.1)  # on target


@pytest.mark.parametrize("current", [0.0, 3.0, 5.5, 6.0, 7.0, 20.0])
def test_adaptive_kl_coef_compounds(current):
    error = min(max(current / 6.0 - 1, -0.2), 0.2)
    kl_coef = tl.adaptive_kl_coef(0.1, current, n_episodes=512, target=6.0, horizon=10_000)
    assert kl_coef == pytest.approx(0.1 * (1 + error * 512 / 10_000))
    assert tl.adaptive_kl_coef(kl_coef, current, 512, 6.0, 10_000) == pytest.approx(kl_coef * (1 + error * 0.0512))


# ---------------------------------------------------------------------------------------------------------
# The optimizer step
# ---------------------------------------------------------------------------------------------------------
def setup(tmp_path, skip_nonfinite=False, steps=4, max_grad_norm=0.5, fp16=False):
    """A small model, AdamW, a linear schedule and the run's accelerator (ru.make_accelerator: with --fp16 it carries
    the loss scaler)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1.0 - s / steps))
    accelerator = ru.make_accelerator(SimpleNamespace(bf16=False, fp16=fp16, gradient_accumulation_steps=1))
    model, optimizer = accelerator.prepare(model, optimizer)
    args = SimpleNamespace(max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite, save_steps=0)
    step = tl.OptimizerStep(accelerator, model, optimizer, scheduler, args, str(tmp_path))
    return model, optimizer, scheduler, accelerator, step


@pytest.mark.parametrize("fp16", [False, True])
def test_optimizer_step_equals_the_obvious_loop(tmp_path, fp16):
    """Clip to max_grad_norm, AdamW step, schedule one step per optimizer step, gradients zeroed; `lr` is the rate
    each step used (1, 3/4, 1/2, 1/4 of 0.1 on a 4-step linear schedule). With --fp16's loss scaler the backward
    multiplies the loss by 2^16 and the step unscales before the clip: the same grad norms and weights (a power of
    two scales exactly)."""
    model, optimizer, scheduler, accelerator, optimizer_step = setup(tmp_path, fp16=fp16)
    assert (accelerator.scaler is not None) == fp16
    reference = torch.nn.Linear(3, 2)
    reference.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    x = torch.randn(5, 3)
    for i in range(4):
        loss = model(x).pow(2).mean() * (i + 1)
        accelerator.backward(loss)
        grad_norm = optimizer_step(loss.detach(), dict(step=i), i + 1)
        assert optimizer_step.lr == pytest.approx(0.1 * (1 - i / 4))
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())
        # the obvious loop
        reference_loss = reference(x).pow(2).mean() * (i + 1)
        reference_loss.backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        for group in reference_optimizer.param_groups:
            group["lr"] = 0.1 * (1 - i / 4)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        assert float(grad_norm) == pytest.approx(float(expected_norm))
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q)
    assert scheduler.last_epoch == 4 and optimizer_step.skipped == 0


def test_nonfinite_step_is_skipped_and_counted(tmp_path):
    model, optimizer, scheduler, accelerator, optimizer_step = setup(tmp_path, skip_nonfinite=True)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.full((2, 3), float("nan"))).sum()
    accelerator.backward(loss)
    optimizer_step(loss.detach(), dict(step=0), 1)
    assert optimizer_step.skipped == 1 and scheduler.last_epoch == 1  # the schedule moves on a skipped step too
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_fp16_overflow_is_the_scalers_to_skip(tmp_path):
    """--fp16: gradients that overflow at the loss scale (a finite loss) skip the update and halve the scale, without
    the non-finite stop (no --skip_nonfinite); they are counted in fp16/overflow_skipped; the next step updates."""
    model, optimizer, scheduler, accelerator, optimizer_step = setup(tmp_path, fp16=True)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(2, 3)).sum() * 1e36  # finite; its gradients x 2^16 overflow float32
    accelerator.backward(loss)
    optimizer_step(loss.detach(), dict(step=0, nonfinite_skipped=0), 1)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert optimizer_step.metrics() == {"lr": 0.1, "fp16/loss_scale": 2.0 ** 15, "fp16/overflow_skipped": 1}
    assert optimizer_step.skipped == 0 and scheduler.last_epoch == 1
    loss = model(torch.ones(2, 3)).sum()
    accelerator.backward(loss)
    optimizer_step(loss.detach(), dict(step=1, nonfinite_skipped=0), 2)
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert optimizer_step.overflows == 1 and accelerator.scaler.get_scale() == 2.0 ** 15


def test_nonfinite_step_stops_with_the_state_before_it(tmp_path):
    model, optimizer, scheduler, accelerator, optimizer_step = setup(tmp_path)
    loss = model(torch.ones(2, 3)).sum() * float("inf")
    accelerator.backward(loss)
    with pytest.raises(UserError, match="non-finite loss -?inf, grad norm .* at step 7"):
        optimizer_step(loss.detach(), dict(step=6, nonfinite_skipped=0), 7)
    with open(tmp_path / "checkpoint-nonfinite" / "trainer_state.json") as f:
        assert json.load(f)["step"] == 6


# ---------------------------------------------------------------------------------------------------------
# Periodic and signalled checkpoints
# ---------------------------------------------------------------------------------------------------------
def test_checkpoint_or_stop(tmp_path):
    model, optimizer, scheduler, accelerator, _ = setup(tmp_path)
    stop = tl.StopSignal()
    args = SimpleNamespace(save_steps=2)
    assert not tl.checkpoint_or_stop(accelerator, args, str(tmp_path), dict(step=1), scheduler, stop, 10)
    assert not os.path.exists(tmp_path / "checkpoint-1")
    assert not tl.checkpoint_or_stop(accelerator, args, str(tmp_path), dict(step=2), scheduler, stop, 10)
    assert os.path.exists(tmp_path / "checkpoint-2" / "trainer_state.json")
    stop.received = "SIGTERM"
    assert tl.checkpoint_or_stop(accelerator, args, str(tmp_path), dict(step=3), scheduler, stop, 10)
    assert os.path.exists(tmp_path / "checkpoint-3")
    # at the last step a signal changes nothing: the run finishes and saves its model
    assert not tl.checkpoint_or_stop(accelerator, args, str(tmp_path), dict(step=10), scheduler, stop, 10)
