"""grpo.py: the algorithm pieces against slow loops and hand-worked numbers (group advantages, also over 2 real
processes; the clipped surrogate + k3 KL per token and its 4 aggregations, token and sequence importance ratios;
the adaptive KL coefficient), the same numbers as TRL 1.16's GRPOTrainer._compute_loss and advantage formula, then
short real runs on the toy task (learning with a reward model and with the gold verifier, every variant option,
resume in place, the adaptive KL controller, bad flags)."""

import functools
import json
import math
import os
import shutil
import types
from collections import defaultdict

import pytest
import torch
from conftest import (
    read_metrics,
    run_script,
    run_script_in_process,
    run_two_processes,
    without_wall_clock,
    worker_accelerator,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo import aggregate_loss, group_advantages, high_entropy_mask, per_token_loss

NAN = math.nan
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


# ---------------------------------------------------------------------------------------------------------
# Group-relative advantages
# ---------------------------------------------------------------------------------------------------------
def slow_group_advantages(rewards, num_generations, scale_rewards):
    """Python loop over groups; torch.std (unbiased) of the scored rewards; NaN rows get 0. Returns (advantages,
    zero_std) with zero_std None for groups of fewer than 2 scored rows (no spread to speak of)."""
    scored_all = [r for r in rewards if not math.isnan(r)]
    batch_std = torch.tensor(scored_all, dtype=torch.float64).std().item() if len(scored_all) > 1 else 0.0
    advantages, zero_std = [], []
    for start in range(0, len(rewards), num_generations):
        group = rewards[start:start + num_generations]
        scored = [r for r in group if not math.isnan(r)]
        mean = sum(scored) / len(scored) if scored else 0.0
        std = torch.tensor(scored, dtype=torch.float64).std().item() if len(scored) > 1 else 0.0
        for r in group:
            if math.isnan(r):
                advantages.append(0.0)
            elif scale_rewards == "group":
                advantages.append((r - mean) / (std + 1e-4))
            elif scale_rewards == "batch":
                advantages.append((r - mean) / (batch_std + 1e-4))
            else:
                advantages.append(r - mean)
            zero_std.append(max(scored) == min(scored) if len(scored) > 1 else None)  # no spread: all equal
    return advantages, zero_std


def test_group_advantages_hand_worked():
    # 2 prompts x G=4, rows grouped prompt by prompt; row 1 was scored by no source (NaN)
    rewards = torch.tensor([1.0, NAN, 3.0, 5.0, 0.0, 0.0, 2.0, 2.0])
    # group 0: scored [1, 3, 5], mean 3, unbiased std sqrt((4 + 0 + 4) / 2) = 2
    # group 1: [0, 0, 2, 2], mean 1, std sqrt(4 / 3)
    centered = torch.tensor([-2.0, 0.0, 0.0, 2.0, -1.0, -1.0, 1.0, 1.0])
    adv, zero_std = group_advantages(rewards, 4, "none")
    torch.testing.assert_close(adv, centered)
    assert not zero_std.any()
    adv, _ = group_advantages(rewards, 4, "group")
    std1 = math.sqrt(4 / 3)
    torch.testing.assert_close(adv, torch.tensor([-2 / 2.0001, 0.0, 0.0, 2 / 2.0001, -1 / (std1 + 1e-4),
                                                  -1 / (std1 + 1e-4), 1 / (std1 + 1e-4), 1 / (std1 + 1e-4)]))
    # batch: the 7 scored rewards [1, 3, 5, 0, 0, 2, 2]: mean 13/7, unbiased std over 7
    values = [1.0, 3.0, 5.0, 0.0, 0.0, 2.0, 2.0]
    batch_std = math.sqrt(sum((v - 13 / 7) ** 2 for v in values) / 6)
    adv, _ = group_advantages(rewards, 4, "batch")
    torch.testing.assert_close(adv, centered / (batch_std + 1e-4))
    with pytest.raises(ValueError):
        group_advantages(rewards, 4, "global")


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_equal_rewards_give_zero_advantage_never_nan(scale_rewards):
    rewards = torch.tensor([0.1] * 4 + [3.0] * 4 + [-1 / 3] * 4 + [1.0, 2.0, NAN, NAN] + [NAN] * 4)
    adv, zero_std = group_advantages(rewards, 4, scale_rewards)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv[:12], torch.zeros(12), atol=1e-6, rtol=0)
    assert zero_std[:12].all() and not zero_std[12:16].any()
    torch.testing.assert_close(adv[14:], torch.zeros(6))  # NaN rows, including a group nobody scored
    assert adv[12] < 0 < adv[13]
    # the whole batch constant: the batch std is 0 too
    adv, zero_std = group_advantages(torch.full((8,), 0.7), 4, scale_rewards)
    torch.testing.assert_close(adv, torch.zeros(8), atol=1e-6, rtol=0)
    assert zero_std.all()


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_flat_groups_are_decided_on_the_rewards_not_a_float32_std(scale_rewards):
    # issue 32's case: 3 x 1000.1 in float32 has a group mean one rounding step off, std 6e-5 > 1e-8, and the old
    # isclose(std, 0) test gave each completion +0.349; a grid of group sizes and values that are not exact in binary
    values = [0.1, 0.3, 0.7, 1.1, 1000.1, 12345.678, -3.3, 7.77]
    off_by_rounding = 0
    for G in range(2, 17):
        for value in values:
            rewards = torch.full((2 * G,), value)
            rewards[G:] = torch.arange(G) * 0.5  # a second group with spread: untouched
            mean = rewards[:G].mean()
            off_by_rounding += bool((rewards[:G] != mean).any())
            adv, zero_std = group_advantages(rewards, G, scale_rewards)
            assert adv[:G].tolist() == [0.0] * G, (G, value, adv[:G])  # exactly zero, compared as values
            assert zero_std[:G].all() and not zero_std[G:].any()
            assert adv[G:].abs().sum() > 0
    assert off_by_rounding > 20  # the grid does exercise the rounding (63 of 120 here)
    # the exact numbers, under the old test: non-zero advantages and not counted
    rewards = torch.full((3,), 1000.1)
    std = rewards.std()
    assert 0 < std and not torch.isclose(std, torch.zeros(()))
    assert (rewards - rewards.mean()).abs().max() > 0
    adv, zero_std = group_advantages(rewards, 3, scale_rewards)
    assert adv.tolist() == [0.0, 0.0, 0.0] and zero_std.all()


@pytest.mark.parametrize("flags,warned", [
    (["--importance_sampling_level", "sequence"], True),  # GSPO with the default dapo loss
    (["--importance_sampling_level", "sequence", "--loss_type", "bnpo"], True),
    (["--importance_sampling_level", "sequence", "--loss_type", "dr_grpo"], True),
    (["--importance_sampling_level", "sequence", "--loss_type", "grpo"], False),  # GSPO's own setup
    ([], False),
])
def test_sequence_ratios_with_a_token_sum_loss_warn_once(flags, warned, capsys, monkeypatch):
    import grpo
    from plumbing import run_utils as ru

    monkeypatch.delenv("RANK", raising=False)
    grpo.validate(ru.parse_args(grpo.Args, argv=flags))
    out = capsys.readouterr().out
    assert out.count("warning:") == (1 if warned else 0)
    if warned:
        assert "weighting GSPO's sequences by their length" in out and "--loss_type grpo" in out


REWARD = st.one_of(st.sampled_from([0.0, 1.0, NAN]), st.floats(-5, 5))  # ties (zero std) and NaNs are common


@settings(max_examples=60, deadline=None)
@given(num_generations=st.integers(2, 5), prompts=st.integers(1, 4), scale_rewards=st.sampled_from(
    ["group", "batch", "none"]), data=st.data())
def test_group_advantages_match_slow_loop(num_generations, prompts, scale_rewards, data):
    values = data.draw(st.lists(REWARD, min_size=num_generations * prompts, max_size=num_generations * prompts))
    adv, zero_std = group_advantages(torch.tensor(values, dtype=torch.float64), num_generations, scale_rewards)
    expected, expected_zero = slow_group_advantages(values, num_generations, scale_rewards)
    assert not adv.isnan().any()
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    for flag, want in zip(zero_std.tolist(), expected_zero):
        if want is not None:
            assert flag == want


def global_rewards():
    """3 prompts x G=4 per process, the halves on very different scales, a few unscored rows."""
    generator = torch.Generator().manual_seed(0)
    rewards = torch.cat([torch.randn(12, generator=generator), 10 + 5 * torch.randn(12, generator=generator)])
    rewards[[2, 13, 14]] = NAN
    return rewards


def _batch_scale_worker(rank, port, results):
    """One of 2 gloo processes, each with a real Accelerator, holding half of `global_rewards()`."""
    with worker_accelerator(rank, port) as accelerator:
        rewards = global_rewards()[12 * rank:12 * rank + 12]
        results[rank] = {scale: group_advantages(rewards, 4, scale, accelerator)[0] for scale in ("batch", "group")}


def test_batch_scaling_over_two_processes_equals_one_process():
    rewards = global_rewards()
    per_process = run_two_processes(_batch_scale_worker)
    for scale in ("batch", "group"):
        one_process = group_advantages(rewards, 4, scale)[0]
        two_processes = torch.cat([per_process[0][scale], per_process[1][scale]])
        torch.testing.assert_close(two_processes, one_process, rtol=1e-5, atol=1e-6)
        expected, _ = slow_group_advantages(rewards.tolist(), 4, scale)
        torch.testing.assert_close(one_process, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    # scaling each half by its own std (a process-local "batch") differs clearly
    halves = torch.cat([group_advantages(rewards[:12], 4, "batch")[0], group_advantages(rewards[12:], 4, "batch")[0]])
    assert (halves - group_advantages(rewards, 4, "batch")[0]).abs().max() > 0.1


def peaked_entropies():
    """(2 processes x 2 rows, 4) token entropies of peaked rows: float32 entropies a hair below 0 (as a forward gives
    them near certainty) among positive ones; the last token of each process's second row is padding."""
    entropy = torch.tensor([[-5e-6, -3e-6, -1e-6, 0.5], [-2e-6, -4e-6, 0.7, 0.9],
                            [-6e-6, -7e-6, -8e-6, 0.2], [0.1, -1e-6, 0.3, 0.4]])
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[[1, 3], 3] = False
    return entropy, mask


def _entropy_quantile_worker(rank, port, results):
    with worker_accelerator(rank, port) as accelerator:
        entropy, mask = (t[2 * rank:2 * rank + 2] for t in peaked_entropies())
        results[rank] = high_entropy_mask(entropy, mask, 0.5, accelerator)


def test_top_entropy_quantile_over_two_processes_keeps_negative_entropies():
    """Issue 63: over several processes the quantile's padding was marked -1 and every value below 0 dropped, so
    float32 entropies a hair below 0 left the quantile as if padding (15 of 200 masks differed from TRL's). Now NaN
    marks the padding: two processes give the one-process mask of the whole batch (TRL's, tests/test_grpo_knobs.py)."""
    entropy, mask = peaked_entropies()
    per_process = run_two_processes(_entropy_quantile_worker)
    one_process = high_entropy_mask(entropy, mask, 0.5)
    torch.testing.assert_close(torch.cat(per_process), one_process)
    positives = entropy[mask & (entropy >= 0)]  # what dropping them would keep: far fewer tokens
    assert one_process.sum() > (mask & (entropy >= torch.quantile(positives, 0.5))).sum()


# ---------------------------------------------------------------------------------------------------------
# Per-token surrogate and its aggregation
# ---------------------------------------------------------------------------------------------------------
E, E_HIGH = 0.2, 0.28


def token_case():
    """2 sequences x 3 tokens, the second padded after 2 tokens; log-ratios that clip on both sides."""
    old = torch.full((2, 3), -1.0)
    log_ratio = torch.tensor([[0.5, -0.5, 0.1], [0.5, -0.5, 0.0]])
    new = old + log_ratio
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -2.0])
    ref = new + torch.tensor([[0.0, 1.0, -1.0], [0.5, 0.0, 0.0]])  # ref - new = d
    return new, old, ref, advantages, mask


def hand_token_losses(beta):
    e = math.exp
    # row 0, A = +1: -min(r, clip(r)): r = e^.5 -> clipped to 1.28; r = e^-.5 < 0.8: the unclipped r is the min
    row0 = [-1.28, -e(-0.5), -e(0.1)]
    # row 1, A = -2: 2 max(r, clip(r)): e^.5 (unclipped), e^-.5 -> 0.8 (clipped)
    row1 = [2 * e(0.5), 1.6]
    # k3 = e^d - d - 1 with d = ref - new
    k3_0 = [0.0, e(1) - 2, e(-1)]
    k3_1 = [e(0.5) - 1.5, 0.0]
    return ([a + beta * b for a, b in zip(row0, k3_0)], [a + beta * b for a, b in zip(row1, k3_1)])


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_token_level_loss_hand_worked(beta):
    new, old, ref, advantages, mask = token_case()
    loss, stats = per_token_loss(new, old, ref, advantages, mask, importance_sampling_level="token",
                                 epsilon=E, epsilon_high=E_HIGH, beta=beta)
    row0, row1 = hand_token_losses(beta)
    assert loss.shape == (2, 3)
    torch.testing.assert_close(loss[0], torch.tensor(row0))
    torch.testing.assert_close(loss[1, :2], torch.tensor(row1))
    # one of the 5 real tokens is clipped on each side; approxkl = mean of 0.5 * log_ratio^2 over real tokens
    assert stats["policy/clipfrac_low"].item() == pytest.approx(0.2)
    assert stats["policy/clipfrac_high"].item() == pytest.approx(0.2)
    assert stats["policy/approxkl"].item() == pytest.approx(0.5 * (0.25 * 4 + 0.01) / 5)

    # the 4 aggregations, by hand
    total = sum(row0) + sum(row1)
    expected = {"grpo": (sum(row0) / 3 + sum(row1) / 2) / 2,
                "bnpo": total / 5,
                "dr_grpo": total / (2 * 4),  # sequences x response_length (4, not the tensor's width 3)
                "dapo": total / 2.5}  # tokens per micro-batch over all processes, e.g. 10 tokens / (2 x 2)
    for loss_type, value in expected.items():
        got = aggregate_loss(loss, mask, loss_type, response_length=4, tokens_per_micro_batch=2.5)
        assert got.item() == pytest.approx(value, rel=1e-6), loss_type
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "sum", response_length=4, tokens_per_micro_batch=2.5)


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_sequence_level_loss_hand_worked(beta):
    old = torch.zeros(3, 3)
    # mean log-ratios over real tokens: 0.3 (r 1.35 > 1.28), -0.3 (r 0.74 < 0.8; the padded 9.0 is ignored), 0.1
    log_ratio = torch.tensor([[0.6, 0.3, 0.0], [-0.4, -0.2, 9.0], [0.1, 0.1, 0.1]])
    new = old + log_ratio
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -2.0, 0.5])
    d = torch.tensor([[1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 0.5]])
    loss, stats = per_token_loss(new, old, new + d, advantages, mask, importance_sampling_level="sequence",
                                 epsilon=E, epsilon_high=E_HIGH, beta=beta)
    e = math.exp
    surrogate = [-1.28, 1.6, -0.5 * e(0.1)]  # clipped high, clipped low, unclipped: one value per sequence
    k3 = [[e(1) - 2, 0, 0], [0, e(-1), 0], [0, 0, e(0.5) - 1.5]]  # per token
    expected = torch.tensor([[surrogate[i] + beta * k3[i][t] for t in range(3)] for i in range(3)])
    assert loss.shape == (3, 3)
    torch.testing.assert_close(loss[mask], expected[mask])
    assert stats["policy/clipfrac_low"].item() == pytest.approx(1 / 3)
    assert stats["policy/clipfrac_high"].item() == pytest.approx(1 / 3)
    # grpo: per-sequence token means, then the mean over sequences; bnpo: mean over the 8 real tokens
    rows = [expected[i][mask[i]].tolist() for i in range(3)]
    assert aggregate_loss(loss, mask, "grpo", 3, 8.0).item() == pytest.approx(
        sum(sum(r) / len(r) for r in rows) / 3, rel=1e-6)
    assert aggregate_loss(loss, mask, "bnpo", 3, 8.0).item() == pytest.approx(sum(map(sum, rows)) / 8, rel=1e-6)


def test_fully_masked_rows_and_empty_batch_stay_finite():
    new = torch.randn(2, 3)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)  # a row left out (e.g. truncated)
    for level in ("token", "sequence"):
        loss, _ = per_token_loss(new, new - 0.1, new, torch.tensor([1.0, 1.0]), mask, importance_sampling_level=level,
                                 epsilon=E, epsilon_high=E, beta=0.0)
        for loss_type in LOSS_TYPES:
            assert torch.isfinite(aggregate_loss(loss, mask, loss_type, 3, 2.0))
        # grpo averages over all rows of the micro-batch, the empty one counting 0
        assert aggregate_loss(loss, mask, "grpo", 3, 2.0).item() == pytest.approx(-math.exp(0.1) / 2, rel=1e-5)
        assert aggregate_loss(loss, torch.zeros_like(mask), "dapo", 3, 0.0).item() == 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_stats_of_an_empty_loss_mask_are_finite(level):
    new = torch.randn(2, 3)
    _, stats = per_token_loss(new, new - 0.5, new, torch.tensor([1.0, -1.0]), torch.zeros(2, 3, dtype=torch.bool),
                              importance_sampling_level=level, epsilon=E, epsilon_high=E, beta=0.0)
    assert all(torch.isfinite(value) for value in stats.values()), stats


def reinforce_reference_grad(new, advantages, mask, loss_type, response_length, tokens_per_micro_batch):
    """Gradient of the REINFORCE objective -A_i log p_it, weighted per loss type (explicit weights)."""
    x = new.detach().clone().requires_grad_(True)
    m = mask.float()
    n = m.sum(1, keepdim=True)
    weight = {"grpo": m / n / x.shape[0], "bnpo": m / m.sum(), "dr_grpo": m / (x.shape[0] * response_length),
              "dapo": m / tokens_per_micro_batch}[loss_type]
    (-(advantages[:, None] * x) * weight).sum().backward()
    return x.grad


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_gradient_is_reinforce(loss_type, level):
    """mu = 1: old = new.detach(), every ratio is 1; the surrogate's gradient is -A grad(log p), aggregated per the
    loss type (at sequence level too: d ratio / d log p_t = 1 / n_tokens, summed back over the n tokens)."""
    generator = torch.Generator().manual_seed(1)
    new = torch.randn(3, 4, generator=generator, dtype=torch.float64).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.5, -0.7, 2.0], dtype=torch.float64)
    loss, stats = per_token_loss(new, new.detach(), torch.zeros_like(new), advantages, mask,
                                 importance_sampling_level=level, epsilon=E, epsilon_high=E_HIGH, beta=0.0)
    aggregate_loss(loss, mask, loss_type, response_length=5, tokens_per_micro_batch=3.5).backward()
    expected = reinforce_reference_grad(new, advantages, mask, loss_type, 5, 3.5)
    torch.testing.assert_close(new.grad, expected)
    assert new.grad[~mask].abs().max() == 0
    assert stats["policy/clipfrac_low"] == 0 and stats["policy/clipfrac_high"] == 0 and stats["policy/approxkl"] == 0


# ---------------------------------------------------------------------------------------------------------
# TRL 1.16: GRPOTrainer._compute_loss and the advantage formula
# ---------------------------------------------------------------------------------------------------------
class _FakeAccelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def trl_loss(new, entropies, inputs, *, loss_type, level, beta, epsilon, epsilon_high, max_completion_length,
             use_bias_correction_kl=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
             entropy_coef=0.0, use_adaptive_entropy=False, last_world_entropy=math.inf, entropy_target=0.2,
             entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0):
    """TRL's real `_compute_loss`, unbound, on a stand-in trainer whose forward returns `new` and `entropies`; its
    adapted entropy coefficient is in metrics["train"]["entropy_coef"] when the entropy bonus is on."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

    def per_token_logps(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == new.shape[1] and input_ids.shape[0] == new.shape[0]
        return new, entropies, None

    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token_logps, aux_loss_enabled=False,
        top_entropy_quantile=top_entropy_quantile, off_policy_mask_threshold=off_policy_mask_threshold,
        importance_sampling_level=level, beta=beta, loss_type=loss_type,
        epsilon_low=epsilon, epsilon_high=epsilon_high, use_vllm=False, vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, accelerator=_FakeAccelerator(),
        _metrics=defaultdict(lambda: defaultdict(list)),
        entropy_coef=entropy_coef, use_adaptive_entropy=use_adaptive_entropy,
        _entropy_bonus_enabled=entropy_coef != 0 or use_adaptive_entropy, _last_world_entropy=last_world_entropy,
        _entropy_window_stats=None, get_off_policy_mask=trl_grpo.GRPOTrainer.get_off_policy_mask,
        args=types.SimpleNamespace(use_bias_correction_kl=use_bias_correction_kl, delta=None, steps_per_generation=1,
                                   entropy_target=entropy_target, entropy_coef_delta=entropy_coef_delta,
                                   entropy_coef_min=entropy_coef_min, entropy_coef_max=entropy_coef_max))
    fake.get_high_entropy_mask = functools.partial(trl_grpo.GRPOTrainer.get_high_entropy_mask, fake)
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs), fake._metrics


def trl_case(seed=0):
    generator = torch.Generator().manual_seed(seed)
    b, r = 6, 5
    lengths = torch.tensor([5, 3, 1, 4, 5, 2])
    completion_mask = (torch.arange(r)[None, :] < lengths[:, None]).long()
    new = torch.randn(b, r, generator=generator) - 1.0
    # ratios well away from 1, also per sequence (row shifts): both clips active at either level
    shift = torch.tensor([0.5, -0.5, 0.3, -0.3, 0.0, 0.1])[:, None]
    old = new - shift + 0.4 * torch.randn(b, r, generator=generator)
    ref = new + 0.5 * torch.randn(b, r, generator=generator)
    advantages = torch.cat([torch.tensor([1.2, -0.8]), torch.randn(b - 2, generator=generator)])
    return new, old, ref, advantages, completion_mask


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_matches_trl_compute_loss(loss_type, level, beta):
    pytest.importorskip("trl")
    new, old, ref, advantages, completion_mask = trl_case()
    b, r = new.shape
    inputs = dict(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                  completion_ids=torch.ones(b, r, dtype=torch.long), completion_mask=completion_mask,
                  advantages=advantages, old_per_token_logps=old, ref_per_token_logps=ref,
                  num_items_in_batch=completion_mask.sum())
    new_trl = new.clone().requires_grad_(True)
    theirs, metrics = trl_loss(new_trl, torch.rand(b, r), inputs, loss_type=loss_type, level=level, beta=beta,
                               epsilon=E, epsilon_high=E_HIGH, max_completion_length=r)
    new_ours = new.clone().requires_grad_(True)
    token_loss, stats = per_token_loss(new_ours, old, ref, advantages, completion_mask,
                                       importance_sampling_level=level, epsilon=E, epsilon_high=E_HIGH, beta=beta)
    ours = aggregate_loss(token_loss, completion_mask, loss_type, response_length=r,
                          tokens_per_micro_batch=completion_mask.sum().item())
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    theirs.backward()
    ours.backward()
    torch.testing.assert_close(new_ours.grad, new_trl.grad, atol=1e-6, rtol=1e-5)
    # the case clips on both sides, and our clip fractions are TRL's
    assert metrics["train"]["clip_ratio/low_mean"][0] > 0 and metrics["train"]["clip_ratio/high_mean"][0] > 0
    assert stats["policy/clipfrac_low"].item() == pytest.approx(metrics["train"]["clip_ratio/low_mean"][0])
    assert stats["policy/clipfrac_high"].item() == pytest.approx(metrics["train"]["clip_ratio/high_mean"][0])


def trl_advantages(rewards, num_generations, scale_rewards):
    """TRL 1.16's formula (sum_then_normalize): (rewards - group nanmean) / (nanstd + 1e-4), NaN -> 0."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_match_trl_formula(scale_rewards):
    pytest.importorskip("trl")
    generator = torch.Generator().manual_seed(3)
    rewards = torch.randn(40, generator=generator) * 3
    rewards[[1, 5, 6, 20, 21, 22]] = NAN  # a group with one scored row (20-23)
    rewards[8:12] = 0.5  # a group without spread
    rewards[32:36] = NAN  # a group nobody scored
    ours, zero_std = group_advantages(rewards, 4, scale_rewards)
    theirs, trl_zero_std = trl_advantages(rewards, 4, scale_rewards)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    if scale_rewards != "batch":  # TRL's flag then uses the batch std; ours is always the group's
        counted = torch.ones(40, dtype=torch.bool)
        counted[20:24] = counted[32:36] = False  # TRL's std is NaN there (fewer than 2 scored rows)
        assert torch.equal(zero_std[counted], trl_zero_std[counted]) and zero_std[8:12].all()


# ---------------------------------------------------------------------------------------------------------
# End-to-end runs on the toy task
# ---------------------------------------------------------------------------------------------------------
def all_finite(rows):
    return all(isinstance(v, (int, float)) and math.isfinite(v) for r in rows for v in r.values())


@pytest.fixture(scope="module")
def run_default(toy, tmp_path_factory):
    """The toy default (reward model, beta 0.2, dapo): 16 steps of 64 completions, eval at 0 and 16."""
    out = str(tmp_path_factory.mktemp("grpo") / "default")
    run_script("grpo.py", "--max_steps", "16", "--output_dir", out, threads=1)
    return out


@pytest.fixture(scope="module")
def run_gold(toy, tmp_path_factory):
    """The toy task's verifier as the only reward, no reference (beta 0), pass@4 / mean@4 at each evaluation."""
    out = str(tmp_path_factory.mktemp("grpo") / "gold")
    run_script("grpo.py", "--reward_funcs", "gold", "--max_steps", "16", "--beta", "0", "--num_eval_generations", "4",
               "--output_dir", out, threads=1)
    return out


def test_default_run_learns_and_writes_a_model(run_default):
    from transformers import AutoModelForCausalLM

    rows = read_metrics(run_default)
    assert [r["step"] for r in rows] == list(range(17))
    assert all_finite(rows)
    for name in ["objective/scores", "objective/kl", "objective/beta", "objective/entropy",
                 "objective/frac_reward_zero_std", "objective/advantage_std", "loss/policy", "policy/clipfrac_low",
                 "policy/clipfrac_high", "policy/approxkl", "val/num_eos_tokens", "val/response_length",
                 "val/truncated_fraction", "reward/reward_model/mean", "lr", "episode", "time/episodes_per_second"]:
        assert all(name in r for r in rows[1:]), name
    for name in ["eval/scores", "eval/kl", "eval/gold_score", "eval/response_length", "eval/eos_rate"]:
        assert name in rows[0] and name in rows[16], name
    assert "eval/gold_score" not in rows[8]  # eval_steps 16 (the toy alias's)
    assert all(r["objective/beta"] == 0.2 for r in rows[1:])  # fixed without --kl_target
    # num_iterations 1: the batch is used once, on-policy: ratio 1, nothing clipped, no drift from old
    assert all(r["policy/approxkl"] == 0 and r["policy/clipfrac_low"] == 0 and r["policy/clipfrac_high"] == 0
               for r in rows[1:])
    # `lr`: the rate the step's optimizer step used, the 16th of a 16-step linear schedule: 1e-4 / 16
    assert rows[16]["episode"] == 16 * 64 and rows[16]["lr"] == pytest.approx(1e-4 / 16)
    # SFT greedy gold ~0.47; this run reaches ~0.9
    assert rows[16]["eval/gold_score"] > rows[0]["eval/gold_score"] + 0.2
    assert rows[16]["eval/scores"] > rows[0]["eval/scores"] + 1.0
    assert rows[0]["eval/kl"] == 0.0 and rows[16]["eval/kl"] > 0
    model = AutoModelForCausalLM.from_pretrained(os.path.join(run_default, "model"))
    assert model.config.vocab_size > 0


def test_gold_reward_run_learns_without_a_reference(run_gold):
    rows = read_metrics(run_gold)
    assert [r["step"] for r in rows] == list(range(17)) and all_finite(rows)
    keys = set().union(*rows)
    assert not {"eval/kl", "objective/kl", "objective/beta"} & keys  # beta 0: no reference loaded
    assert "reward/gold/mean" in rows[1] and "reward/reward_model/mean" not in keys
    assert rows[16]["eval/gold_score"] > rows[0]["eval/gold_score"] + 0.2
    for step in (0, 16):
        assert 0 <= rows[step]["eval/pass@4"] <= 1 and 0 <= rows[step]["eval/mean@4"] <= 1
    assert rows[16]["eval/pass@4"] > rows[0]["eval/pass@4"]
    assert rows[16]["eval/mean@4"] > rows[0]["eval/mean@4"]


VARIANTS = {
    "grpo_seq_mu2_batch": ["--loss_type", "grpo", "--importance_sampling_level", "sequence", "--num_iterations", "2",
                           "--scale_rewards", "batch"],
    "bnpo_dapo_options": ["--loss_type", "bnpo", "--epsilon_high", "0.28", "--mask_truncated_completions",
                          "--skip_zero_std_groups", "--scale_rewards", "none"],
    "dr_grpo_mu2_gold": ["--loss_type", "dr_grpo", "--num_iterations", "2", "--scale_rewards", "none",
                         "--skip_zero_std_groups", "--reward_funcs", "gold", "--beta", "0.05"],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_runs(variant, toy, tmp_path):
    out = str(tmp_path / variant)
    args = VARIANTS[variant]
    run_script("grpo.py", "--max_steps", "2", "--per_device_train_batch_size", "16", "--num_eval_prompts", "8",
               *args, "--output_dir", out, threads=1)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and all_finite(rows)
    assert rows[1]["episode"] == 16 and rows[2]["episode"] == 32
    with open(os.path.join(out, "args.json")) as f:
        saved = json.load(f)
    assert saved["loss_type"] == args[1]
    if "--num_iterations" in args:
        # 2 optimizer steps per batch, 4 in all: `lr` is the rate of each step's last, the schedule's 2nd and 4th
        # (1e-4 x 3/4, 1e-4 x 1/4); the second pass over a batch sees a policy that moved from the one that sampled it
        assert rows[1]["lr"] == pytest.approx(0.75e-4) and rows[2]["lr"] == pytest.approx(0.25e-4)
        assert rows[1]["policy/approxkl"] > 0 and rows[2]["policy/approxkl"] > 0
    else:
        assert saved["epsilon_high"] == 0.28 and rows[1]["policy/approxkl"] == 0


RESUME_ARGS = ["--max_steps", "4", "--per_device_train_batch_size", "16", "--save_steps", "2", "--eval_steps", "2",
               "--num_eval_prompts", "16", "--kl_target", "1.0", "--kl_horizon", "500"]


@pytest.fixture(scope="module")
def run_resumable(toy, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("grpo") / "resumable")
    run_script("grpo.py", *RESUME_ARGS, "--output_dir", out, threads=1)
    return out


def test_adaptive_kl_controller_changes_beta(run_resumable):
    rows = read_metrics(run_resumable)
    assert rows[1]["objective/beta"] == 0.2
    for prev, cur in zip(rows[1:4], rows[2:5]):
        error = max(-0.2, min(0.2, prev["objective/kl"] / 1.0 - 1))
        assert cur["objective/beta"] == pytest.approx(prev["objective/beta"] * (1 + error * 16 / 500), rel=1e-9)
        assert cur["objective/beta"] != prev["objective/beta"]


def test_resume_in_place_equals_uninterrupted_run(run_resumable, tmp_path):
    from safetensors.torch import load_file

    # the run folder as it was when checkpoint-2 was written; resuming without --output_dir continues in it
    out = str(tmp_path / "b")
    shutil.copytree(os.path.join(run_resumable, "checkpoint-2"), os.path.join(out, "checkpoint-2"))
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in read_metrics(run_resumable)[:3])
    run_script("grpo.py", *RESUME_ARGS, "--resume_from", os.path.join(out, "checkpoint-2"), threads=1)
    rows, full = without_wall_clock(read_metrics(out)), without_wall_clock(read_metrics(run_resumable))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[:3] == full[:3]
    for a, b in zip(rows[3:], full[3:]):
        assert a.keys() == b.keys()
        for k in a:  # objective/beta included: the adapted coefficient is restored
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    w_full = load_file(os.path.join(run_resumable, "model", "model.safetensors"))
    w_resumed = load_file(os.path.join(out, "model", "model.safetensors"))
    assert w_full.keys() == w_resumed.keys()
    for k in w_full:
        torch.testing.assert_close(w_resumed[k], w_full[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args, message", [
    (["--kl_target", "1.0", "--beta", "0"], "--kl_target"),
    (["--num_generations", "1"], "--num_generations"),
    (["--per_device_train_batch_size", "6"], "not divisible"),  # 6 rows, groups of 4
    (["--dynamic_sampling", "--dynamic_sampling_metric", "accuracy"], "needs --reward_funcs"),  # a reward model only
])
def test_bad_flags_fail_cleanly(toy, tmp_path, args, message):
    out = str(tmp_path / "never")
    proc = run_script_in_process("grpo.py", *args, "--output_dir", out)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not os.path.exists(out)
