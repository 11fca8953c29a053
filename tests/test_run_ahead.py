"""--max_staleness (run_ahead.py): the decoupled objective on hand-worked numbers (GRPO's and RLOO's losses with the
importance weights pi_prox / pi_behav), its reduction to the plain loss when nothing is stale, the flag checks; then
the scripts as a user runs them: the versions that sampled each step, a resumed run equal to an uninterrupted one,
learning, two processes. (vLLM's threaded sampler: tests/test_vllm.py.)"""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, read_metrics, run_script, run_script_in_process, without_wall_clock
from test_scale import run_distributed

import grpo
import rloo
from plumbing import importance_sampling as isp
from plumbing import run_ahead as ra
from plumbing import vllm_generation as vg
from plumbing.errors import UserError
from plumbing.importance_sampling import ImportanceSampling


def importance(old, behaviour, mask, sampling, sequence_loss=False):
    """(weights, stats) of importance_sampling.py's functions, as the scripts use them (through their Rollout)."""
    return (isp.importance_weights(old, behaviour, mask, sampling, sequence_loss=sequence_loss),
            isp.importance_sampling_stats(old, behaviour, mask, sampling))


def test_decoupled_grpo_loss_hand_worked():
    # one completion of two tokens, advantage +1, epsilon 0.2; the behaviour policy sampled them, the proximal policy
    # is the trainer's at the start of the step, the current one has moved on since
    behav = torch.tensor([[-1.0, -2.0]])
    prox = torch.tensor([[-0.5, -2.5]])
    new = torch.tensor([[-0.4, -2.5]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    sampling = ImportanceSampling("token_truncate", clip_max=1.5, clip_min=None, sampler="async")
    weights, stats = importance(prox, behav, mask, sampling)
    # w_t = min(pi_prox / pi_behav, 1.5): e^0.5 = 1.6487 -> 1.5; e^-0.5 = 0.6065
    assert weights[0].tolist() == pytest.approx([1.5, math.exp(-0.5)], rel=1e-6)
    assert stats["async/is_truncated_frac"].item() == pytest.approx(0.5)
    loss, _ = grpo.per_token_loss(new, prox, None, torch.tensor([1.0]), mask, importance_sampling_level="token",
                                  epsilon=0.2, epsilon_high=0.2, beta=0.0, is_weights=weights)
    # r_t = pi / pi_prox = [e^0.1, 1], inside the clip range: -min(r A, clip(r) A) = -r; times w
    assert loss[0].tolist() == pytest.approx([-math.exp(0.1) * 1.5, -1.0 * math.exp(-0.5)], rel=1e-6)
    # past the clip range (r = e^0.3 > 1.2 with A > 0) the term is constant: no gradient, whatever w is
    far = torch.tensor([[-0.2, -2.5]], requires_grad=True)
    loss, _ = grpo.per_token_loss(far, prox, None, torch.tensor([1.0]), mask, importance_sampling_level="token",
                                  epsilon=0.2, epsilon_high=0.2, beta=0.0, is_weights=weights)
    assert loss[0, 0].item() == pytest.approx(-1.2 * 1.5, rel=1e-6)
    loss.sum().backward()
    assert far.grad[0, 0].item() == 0.0 and far.grad[0, 1].item() == pytest.approx(-math.exp(-0.5), rel=1e-6)


def test_decoupled_rloo_loss_hand_worked():
    # RLOO's sequence view: one ratio and one weight per completion (sequence_truncate)
    behav = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    prox = torch.tensor([[-0.5, -2.0], [-1.5, -1.5]])  # summed log-ratio to behav: +0.5, -1.0
    new = torch.tensor([[-0.45, -2.0], [-1.5, -1.5]])
    mask = torch.tensor([[True, True], [True, False]])  # second completion: one token
    sampling = ImportanceSampling("sequence_truncate", clip_max=3.0, clip_min=None, sampler="async")
    weights, _ = importance(prox, behav, mask, sampling, sequence_loss=True)
    assert weights.tolist() == pytest.approx([math.exp(0.5), math.exp(-0.5)], rel=1e-6)  # 2nd: only its 1st token
    advantages = torch.tensor([2.0, -1.0])
    loss, _ = rloo.clipped_policy_loss(new, prox, advantages, mask, cliprange=0.2, is_weights=weights)
    # ratios e^0.05 and 1: max(-A r, -A clip(r)) = -2 e^0.05 and +1; times the weights, mean over the 2 completions
    expected = (-2 * math.exp(0.05) * math.exp(0.5) + 1.0 * math.exp(-0.5)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_nothing_stale_is_the_plain_loss():
    # behaviour = proximal: every weight is 1 exactly, and the loss and its gradient are the synchronous loss's
    torch.manual_seed(0)
    old = torch.randn(4, 5)
    new = (old + 0.1 * torch.randn(4, 5)).requires_grad_()
    mask = torch.rand(4, 5) > 0.2
    advantages = torch.randn(4)
    for mode in vg.IS_MODES:
        weights, stats = importance(old, old.clone(), mask, ImportanceSampling(mode, 2.0, 0.5))
        assert torch.equal(weights, mask.float())
        plain, _ = grpo.per_token_loss(new, old, None, advantages, mask, importance_sampling_level="token",
                                       epsilon=0.2, epsilon_high=0.28, beta=0.0, is_weights=None)
        weighted, _ = grpo.per_token_loss(new, old, None, advantages, mask, importance_sampling_level="token",
                                          epsilon=0.2, epsilon_high=0.28, beta=0.0, is_weights=weights)
        assert torch.equal(plain * mask, weighted * mask)


def test_flag_checks():
    base = dict(max_staleness=1, tools=None, environment=None, dynamic_sampling=False)
    ra.AsyncFlags.check(SimpleNamespace(**base))
    for bad, words in ((dict(max_staleness=-1), ">= 0"), (dict(tools=["toy_worlds.toy_tools:lookup"]), "--tools")):
        with pytest.raises(UserError, match=words):
            ra.AsyncFlags.check(SimpleNamespace(**{**base, **bad}))
    # grpo.py's dynamic sampling rolls out in step (RunAhead.rollout_groups): its validate refuses a sampler ahead
    proc = run_script_in_process("grpo.py", "--max_staleness", "1", "--dynamic_sampling")
    assert proc.returncode == 2 and "--max_staleness with --dynamic_sampling is not supported" in proc.stderr
    # the importance-sampling flags are checked without vLLM too once samples can be stale
    args = vg.VLLMFlags(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=0.5)
    args.max_staleness = 1  # the AsyncFlags beside it in a script's Args
    with pytest.raises(UserError, match="clip_max must be >= 1"):
        args.check()
    args.max_staleness = 0
    args.check()  # synchronous: no samplers to weigh
    # rloo.py's sequence view weighs a completion, not its tokens
    proc = run_script_in_process("rloo.py", "--max_staleness", "1", "--vllm_importance_sampling_mode", "token_mask")
    assert proc.returncode == 2 and "sequence view" in proc.stderr


def test_stale_samples_are_weighted_per_token_by_default():
    """--vllm_importance_sampling_mode None (kept None in the flags, resolved by the loss it weights:
    ImportanceSampling.resolved): AReaL's token_mask for stale samples and a loss per token, TRL's sequence_mask
    otherwise (vLLM's samples, rloo.py's sequence view); a mode given is kept."""
    import distill
    from plumbing import run_utils as ru

    def mode(script, *argv):
        args = ru.parse_args(script.Args, script.ALIAS_DEFAULTS, argv=list(argv))
        sequence_loss = script is rloo and not args.token_level_kl  # rloo.py's sequence view: a term per completion
        return ImportanceSampling.from_args(args, "async").resolved(sequence_loss=sequence_loss).mode

    assert ru.parse_args(grpo.Args, grpo.ALIAS_DEFAULTS, argv=["--max_staleness", "1"]
                         ).vllm_importance_sampling_mode is None  # left to the loss
    assert mode(grpo, "--max_staleness", "1") == "token_mask"
    assert mode(rloo, "--max_staleness", "1", "--token_level_kl") == "token_mask"
    assert mode(rloo, "--max_staleness", "1") == "sequence_mask"  # one term per completion
    assert mode(grpo) == mode(rloo) == mode(distill) == "sequence_mask"  # TRL 1.16's default
    assert mode(grpo, "--max_staleness", "1", "--vllm_importance_sampling_mode", "sequence_truncate") == \
        "sequence_truncate"


def test_the_stale_weights_model_is_its_monte_carlo():
    """benchmark/stale_weights.py's closed form of the importance mass a sequence mask drops, against sampling."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmark"))
    import stale_weights

    for drift, length in ((0.0356, 512), (0.0356, 2048), (0.0118, 2048), (0.05, 1)):
        closed, sampled = stale_weights.dropped_mass(drift, length), stale_weights.dropped_mass_sampled(drift, length)
        assert closed == pytest.approx(sampled, abs=0.015), (drift, length)
    assert stale_weights.dropped_mass(0.0356, 2048) > 0.6 > 0.2 > stale_weights.dropped_mass(0.0356, 1)


SHORT = ["--eval_steps", "0", "--num_eval_prompts", "32", "--seed", "5"]


def training_rows(out):
    return [row for row in read_metrics(out) if row["step"] > 0]


def assert_resumed_equals_uninterrupted(full: str, resumed: str, checkpoint_step: int) -> None:
    """The resumed run's rows after `checkpoint_step` equal the uninterrupted run's (timing aside), and so do their
    final weights (also used by tests/test_vllm.py)."""
    import safetensors.torch

    uninterrupted = {row["step"]: row for row in without_wall_clock(read_metrics(full))}
    for row in without_wall_clock(read_metrics(resumed)):  # timing aside (async/*_wait_seconds too)
        if row["step"] > checkpoint_step:
            for key, value in row.items():
                if isinstance(value, float):
                    assert value == pytest.approx(uninterrupted[row["step"]][key], rel=1e-5, abs=1e-6), \
                        (row["step"], key)
    a = safetensors.torch.load_file(os.path.join(full, "model", "model.safetensors"))
    b = safetensors.torch.load_file(os.path.join(resumed, "model", "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def rloo_stale_runs(toy, tmp_path_factory):
    """rloo.py at --max_staleness 2 (HF generate) for 6 steps, checkpointing every 3, and the same run resumed from
    its checkpoint-3."""
    root = tmp_path_factory.mktemp("run_ahead")
    flags = [*SHORT, "--max_staleness", "2", "--max_steps", "6"]
    full, resumed = str(root / "full"), str(root / "resumed")
    run_script("rloo.py", *flags, "--save_steps", "3", "--output_dir", full)
    run_script("rloo.py", *flags, "--resume_from", os.path.join(full, "checkpoint-3"), "--output_dir", resumed)
    return full, resumed


@pytest.mark.slow
def test_each_step_trains_on_the_versions_that_sampled_it(rloo_stale_runs):
    full, _ = rloo_stale_runs
    rows = training_rows(full)
    assert [row["async/staleness_max"] for row in rows] == [0, 1, 2, 2, 2, 2]  # batch t: version max(0, t - 3)
    assert all(row["async/staleness_mean"] == row["async/staleness_max"] for row in rows)
    # the stale batches are reweighted by pi_prox / pi_behav (not 1: the policy moved); the fresh one is not
    assert "async/is_weight_mean" not in rows[0]
    assert all(row["async/is_weight_max"] > 1.0 > row["async/is_weight_min"] > 0.0 for row in rows[1:])
    checkpoint = os.path.join(full, "checkpoint-3")
    assert os.path.exists(os.path.join(checkpoint, "pending-0.safetensors"))  # batches 4 and 5, sampled ahead
    # each with the log-probs of the weights that sampled it (HF generate's, not an engine's): versions 1 and 2
    import safetensors.torch

    with open(os.path.join(checkpoint, "pending-0.json")) as f:
        batches = json.load(f)["batches"]
    assert [(b["version"], b["by_engine"]) for b in batches] == [(1, False), (2, False)]
    tensors = safetensors.torch.load_file(os.path.join(checkpoint, "pending-0.safetensors"))
    assert {"0.behaviour_logprobs", "1.behaviour_logprobs", "0.query_responses", "1.query_responses"} <= set(tensors)


@pytest.mark.slow
def test_resumed_run_equals_the_uninterrupted_one(rloo_stale_runs):
    full, resumed = rloo_stale_runs
    assert [row["step"] for row in training_rows(resumed) if row["step"] > 3] == [4, 5, 6]
    assert_resumed_equals_uninterrupted(full, resumed, 3)


@pytest.mark.slow
def test_stale_grpo_learns(toy, tmp_path):
    out = str(tmp_path / "grpo_stale")
    # the toy default for 16 steps, as tests/test_grpo.py's run_default (synchronous: ~0.47 -> ~0.9, margin 0.2)
    run_script("grpo.py", "--max_staleness", "1", "--max_steps", "16", "--output_dir", out, threads=1)
    rows = read_metrics(out)
    start, end = rows[0]["eval/gold_score"], rows[-1]["eval/gold_score"]
    assert end > start + 0.2, (start, end)
    assert [row["async/staleness_max"] for row in rows if row["step"] > 0][:3] == [0, 1, 1]


@pytest.mark.slow
def test_two_processes_run_ahead(toy, tmp_path):
    out = str(tmp_path / "two")
    run_distributed("grpo.py", *SHORT, "--max_staleness", "1", "--max_steps", "3", "--per_device_train_batch_size",
                    "32", "--output_dir", out)
    rows = training_rows(out)
    assert [row["async/staleness_max"] for row in rows] == [0, 1, 1]
    assert all(row["episode"] == 64 * row["step"] for row in rows)
