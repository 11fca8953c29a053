"""grpo.py's 2026 settings (issue 47): the importance-reweighted KL (use_bias_correction_kl), off-policy sequence
masking, GDPO's normalize_then_sum, the high-entropy tokens (top_entropy_quantile), the entropy bonus and Skywork-OR1's
adaptive entropy control, RAGEN-2's reward-variance filtering and MaxRL's advantage. Each against a slow float64
loop or a hand-worked example, and where TRL 1.16 has the setting against TRL's own code on the same tensors (the
composed micro-batch loss through GRPOTrainer._compute_loss; its static masks; its advantage lines), on padded
batches with tool-result tokens masked out. The TRL comparisons are skipped when trl is not importable: run them
with `pip install --no-deps --target /tmp/trl trl==1.16.0` and `PYTHONPATH=/tmp/trl python -m pytest ...`. Then a
short real run with every setting on."""

import math
import types

import pytest
import torch
from conftest import read_metrics, run_script
from test_grpo import _FakeAccelerator, trl_loss

from grpo import (
    EntropyFlags,
    GRPOLoss,
    decoupled_advantages,
    group_advantages,
    high_entropy_mask,
    off_policy_mask,
    per_token_loss,
    reward_variance_groups,
)
from plumbing.errors import UserError

NAN = math.nan
E, E_HIGH = 0.2, 0.28


def padded_batch(seed=0, dtype=torch.float32):
    """6 completions of up to 5 tokens: padding after each length, tool-result tokens (not the policy's) inside two
    of them; log-probs of the policy now, of pi_old, of the sampler (off by more than pi_old) and of the reference;
    entropies; advantages of both signs."""
    generator = torch.Generator().manual_seed(seed)
    b, r = 6, 5
    lengths = torch.tensor([5, 3, 1, 4, 5, 2])
    completion_mask = torch.arange(r)[None, :] < lengths[:, None]
    tool_mask = torch.ones(b, r, dtype=torch.bool)
    tool_mask[0, 2:4] = tool_mask[3, 1] = False
    new = torch.randn(b, r, generator=generator, dtype=dtype) - 1.0
    shift = torch.tensor([0.5, -0.5, 0.3, -0.3, 0.0, 0.1], dtype=dtype)[:, None]
    old = new - shift + 0.4 * torch.randn(b, r, generator=generator, dtype=dtype)
    sampling = old + torch.tensor([0.9, 0.0, 0.6, 0.8, -0.2, 0.7], dtype=dtype)[:, None] \
        + 0.1 * torch.randn(b, r, generator=generator, dtype=dtype)
    ref = new + 0.5 * torch.randn(b, r, generator=generator, dtype=dtype)
    entropy = 3 * torch.rand(b, r, generator=generator, dtype=dtype)
    advantages = torch.tensor([1.2, -0.8, -1.5, -0.4, 0.9, -2.0], dtype=dtype)
    return dict(new=new, old=old, sampling=sampling, ref=ref, entropy=entropy, advantages=advantages,
                completion_mask=completion_mask, tool_mask=tool_mask, mask=completion_mask & tool_mask)


def settings(**overrides):
    base = dict(off_policy_mask_threshold=None, top_entropy_quantile=1.0, importance_sampling_level="token",
                epsilon=E, epsilon_high=E_HIGH, use_bias_correction_kl=False, loss_type="dapo", response_length=5,
                entropy_coef=0.0, use_adaptive_entropy=False)
    return types.SimpleNamespace(**{**base, **overrides})


def entropy_flags(args, **overrides) -> EntropyFlags:
    """grpo.py's entropy flags of `settings` (TRL 1.16's defaults: target 0.2, delta 0.005, within [0, 1])."""
    return EntropyFlags(entropy_coef=args.entropy_coef, use_adaptive_entropy=args.use_adaptive_entropy, **overrides)


def slow_loss(t, args, beta, entropy_coef):
    """The micro-batch loss token by token in float64 from the papers' definitions: a completion of negative advantage
    whose mean log(pi_sampler / pi) over its loss tokens exceeds the threshold is dropped from the surrogate
    (DeepSeek-V3.2 eq. 9); a token is trained on when its entropy is >= the (1 - rho) quantile of the batch's loss
    tokens (linear interpolation between order statistics: torch.quantile's and numpy's default); the clipped
    surrogate of the kept tokens + beta x k3 (x the ratio with the bias correction); token mean (dapo) or mean of
    sequence means (grpo); minus the entropy coefficient x the mean entropy over the trained tokens."""
    new, old, sampling, ref = (t[k].double() for k in ("new", "old", "sampling", "ref"))
    entropy, advantages, mask = t["entropy"].double(), t["advantages"].double(), t["mask"]
    b, r = new.shape
    tokens = [(i, j) for i in range(b) for j in range(r) if mask[i, j]]
    threshold = -math.inf
    if args.top_entropy_quantile < 1:
        values = sorted(entropy[i, j].item() for i, j in tokens)
        position = (1 - args.top_entropy_quantile) * (len(values) - 1)
        low = math.floor(position)
        high = min(low + 1, len(values) - 1)
        threshold = values[low] + (values[high] - values[low]) * (position - low)
    row_sums, trained_entropy, trained = [0.0] * b, 0.0, 0
    for i in range(b):
        row = [j for j in range(r) if mask[i, j]]
        if not row:
            continue
        sequence_log_ratio = sum(new[i, j] - old[i, j] for j in row) / len(row)
        mean_kl = sum((sampling[i, j] - new[i, j]).item() for j in row) / len(row)
        dropped = args.off_policy_mask_threshold is not None and advantages[i] < 0 \
            and mean_kl > args.off_policy_mask_threshold
        for j in row:
            log_ratio = new[i, j] - old[i, j] if args.importance_sampling_level == "token" else sequence_log_ratio
            ratio = torch.exp(log_ratio)
            surrogate = -torch.min(ratio * advantages[i], ratio.clamp(1 - E, 1 + E_HIGH) * advantages[i])
            high_entropy = entropy[i, j].item() >= threshold
            term = surrogate * float(high_entropy and not dropped)
            if beta:
                k3 = torch.exp(ref[i, j] - new[i, j]) - (ref[i, j] - new[i, j]) - 1
                term = term + beta * (k3 * ratio if args.use_bias_correction_kl else k3)
            row_sums[i] = row_sums[i] + term
            if high_entropy:
                trained_entropy, trained = trained_entropy + entropy[i, j], trained + 1
    if args.loss_type == "dapo":
        loss = sum(row_sums) / len(tokens)
    else:  # grpo: the mean over sequences of each sequence's token mean
        loss = sum(row_sums[i] / max(1, int(mask[i].sum())) for i in range(b)) / b
    return loss - entropy_coef * trained_entropy / max(trained, 1)


CASES = {
    "bias_corrected_kl": dict(use_bias_correction_kl=True),
    "bias_corrected_kl_sequence": dict(use_bias_correction_kl=True, importance_sampling_level="sequence"),
    "off_policy_mask": dict(off_policy_mask_threshold=0.5),
    "top_entropy": dict(top_entropy_quantile=0.3),
    "top_entropy_0": dict(top_entropy_quantile=0.0),
    "entropy_bonus": dict(entropy_coef=0.05),
    "adaptive_entropy_applied": dict(use_adaptive_entropy=True, entropy_coef=0.1),
    "everything": dict(use_bias_correction_kl=True, off_policy_mask_threshold=0.5, top_entropy_quantile=0.4,
                       use_adaptive_entropy=True, entropy_coef=0.1),
    "everything_grpo": dict(use_bias_correction_kl=True, off_policy_mask_threshold=0.5, top_entropy_quantile=0.4,
                            entropy_coef=0.02, loss_type="grpo"),
}


def ours(t, args, beta, entropy_coef, dtype=torch.float32):
    """grpo.GRPOLoss of the settings `args` (entropy_coef None: no entropy bonus) on the batch `t`."""
    new = t["new"].to(dtype).clone().requires_grad_(True)
    entropy = t["entropy"].to(dtype).clone().requires_grad_(True)
    loss, stats, window = GRPOLoss.from_args(args)(
        new, entropy, t["old"].to(dtype), t["sampling"].to(dtype), t["ref"].to(dtype),
        t["advantages"].to(dtype), t["mask"], None, beta=beta, entropy_coef=entropy_coef,
        tokens_per_micro_batch=t["mask"].sum().item())
    loss.backward()
    return loss, new.grad, entropy.grad, stats, window


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("case", sorted(CASES))
def test_micro_batch_loss_equals_a_slow_float64_loop(case, beta):
    t = padded_batch(1, torch.float64)
    args = settings(**CASES[case])
    # the coefficient of the step: the flag's, adaptive control's too once the last entropy is at the target or below
    entropy_coef = entropy_flags(args).step_entropy_coef(dict(entropy_coef=args.entropy_coef, last_entropy=0.1))
    assert entropy_coef == (args.entropy_coef if args.entropy_coef or args.use_adaptive_entropy else None)
    loss, new_grad, entropy_grad, _, window = ours(t, args, beta, entropy_coef, torch.float64)
    new = t["new"].clone().requires_grad_(True)
    entropy = t["entropy"].clone().requires_grad_(True)
    expected = slow_loss({**t, "new": new, "entropy": entropy}, args, beta, args.entropy_coef)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new_grad, new.grad, rtol=1e-10, atol=1e-12)
    if args.entropy_coef:  # the bonus's gradient reaches the trained tokens' entropies only
        torch.testing.assert_close(entropy_grad, entropy.grad, rtol=1e-10, atol=1e-12)
        assert (entropy_grad[~t["mask"]] == 0).all()
    assert (new_grad[~t["mask"]] == 0).all()  # padding and tool results get no gradient
    if args.entropy_coef:  # adaptive control's measure: the entropy sum and count of the tokens trained on
        trained = t["mask"] & high_entropy_mask(t["entropy"], t["mask"], args.top_entropy_quantile).bool()
        assert window[1] == trained.sum() and window[0].item() == pytest.approx(t["entropy"][trained].sum().item())


def test_bias_corrected_kl_changes_the_on_policy_gradient_hand_worked():
    """On-policy (pi_old = pi, detached) the ratio is 1 but its gradient is grad log pi: per token the KL term's
    gradient becomes dk3/dlogp + k3 = (1 - exp(ref - new)) + (exp(ref - new) - (ref - new) - 1) = new - ref."""
    new = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    for corrected, expected in [(False, 1 - torch.exp(ref - new.detach())), (True, new.detach() - ref)]:
        new.grad = None
        loss, _ = per_token_loss(new, new.detach(), ref, torch.zeros(1, dtype=torch.float64), mask,
                                 importance_sampling_level="token", epsilon=E, epsilon_high=E_HIGH, beta=1.0,
                                 use_bias_correction_kl=corrected)
        (loss * mask).sum().backward()
        torch.testing.assert_close(new.grad, expected * mask)


def test_the_cases_exercise_each_setting():
    """The batch is built so that every setting changes the loss: were one ignored, the tests above could pass."""
    t = padded_batch(1, torch.float64)
    plain = ours(t, settings(), 0.04, None, torch.float64)
    for case, overrides in CASES.items():
        args = settings(**overrides)
        entropy_coef = entropy_flags(args).step_entropy_coef(dict(entropy_coef=args.entropy_coef, last_entropy=0.1))
        changed = ours(t, args, 0.04, entropy_coef, torch.float64)
        assert not torch.allclose(changed[1], plain[1]) or not torch.allclose(changed[0], plain[0]), case
    masked = off_policy_mask(t["advantages"], t["new"], t["sampling"], t["mask"], 0.5)[:, 0]
    assert 0 < masked.sum() < len(masked)  # some completions dropped, some kept


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("case", sorted(set(CASES) | {"adaptive_entropy_gated"}))
def test_micro_batch_loss_equals_trl_compute_loss(case, beta):
    """The same tensors through TRL 1.16's GRPOTrainer._compute_loss (completion_mask x tool_mask, its
    sampling_per_token_logps for the off-policy mask): equal loss, gradients (log-probs and entropies) and the
    adaptive entropy coefficient after the step."""
    pytest.importorskip("trl")
    t = padded_batch(2)
    overrides = CASES.get(case, dict(use_adaptive_entropy=True, entropy_coef=0.1))
    args = settings(**overrides)
    # Skywork-OR1 applies the coefficient once the previous step's entropy is at or below the target (0.2)
    last_entropy = 5.0 if case == "adaptive_entropy_gated" else 0.1
    flags, state = entropy_flags(args), dict(entropy_coef=args.entropy_coef, last_entropy=last_entropy)
    applied = flags.step_entropy_coef(state)
    if args.entropy_coef or args.use_adaptive_entropy:  # by hand: the coefficient, 0 above the target
        assert applied == (args.entropy_coef if not args.use_adaptive_entropy or last_entropy <= 0.2 else 0.0)
    else:
        assert applied is None  # no bonus
    loss, new_grad, entropy_grad, stats, window = ours(t, args, beta, applied)
    b, r = t["new"].shape
    inputs = dict(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                  completion_ids=torch.ones(b, r, dtype=torch.long), completion_mask=t["completion_mask"].long(),
                  tool_mask=t["tool_mask"].long(), advantages=t["advantages"], old_per_token_logps=t["old"],
                  sampling_per_token_logps=t["sampling"], ref_per_token_logps=t["ref"],
                  num_items_in_batch=t["mask"].sum())
    new = t["new"].clone().requires_grad_(True)
    entropy = t["entropy"].clone().requires_grad_(True)
    theirs, metrics = trl_loss(new, entropy, inputs, loss_type=args.loss_type, level=args.importance_sampling_level,
                               beta=beta, epsilon=E, epsilon_high=E_HIGH, max_completion_length=r,
                               use_bias_correction_kl=args.use_bias_correction_kl,
                               top_entropy_quantile=args.top_entropy_quantile,
                               off_policy_mask_threshold=args.off_policy_mask_threshold,
                               entropy_coef=args.entropy_coef, use_adaptive_entropy=args.use_adaptive_entropy,
                               last_world_entropy=last_entropy)
    theirs.backward()
    torch.testing.assert_close(loss, theirs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new_grad, new.grad, atol=1e-6, rtol=1e-5)
    if args.entropy_coef or args.use_adaptive_entropy:
        torch.testing.assert_close(entropy_grad, entropy.grad, atol=1e-6, rtol=1e-5)
    if args.use_adaptive_entropy:
        flags.update_entropy_coef(state, window, _FakeAccelerator())  # one process: the window is the world's
        assert state["last_entropy"] == pytest.approx((window[0] / window[1]).item())
        assert state["entropy_coef"] == pytest.approx(metrics["train"]["entropy_coef"][0], abs=1e-7)


def test_off_policy_mask_equals_trl_and_ignores_unscored_tokens():
    t = padded_batch(3)
    sampling = t["sampling"].clone()
    sampling[1, 0] = NAN  # a token the sampler could not score
    ours_mask = off_policy_mask(t["advantages"], t["new"], sampling, t["mask"], 0.5)
    slow = []
    for i in range(6):
        row = [j for j in range(5) if t["mask"][i, j]]
        kl = [0.0 if math.isnan(sampling[i, j].item()) else (sampling[i, j] - t["new"][i, j]).item() for j in row]
        slow.append(float(t["advantages"][i] >= 0 or sum(kl) / max(len(row), 1) <= 0.5))
    assert ours_mask[:, 0].tolist() == slow
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    theirs = trl_grpo.GRPOTrainer.get_off_policy_mask(t["advantages"][:, None], t["new"], sampling,
                                                      t["mask"].float(), 0.5)
    assert torch.equal(ours_mask, theirs)


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 1.0])
def test_high_entropy_mask_keeps_the_top_quantile_of_loss_tokens(quantile):
    t = padded_batch(4)
    kept = high_entropy_mask(t["entropy"], t["mask"], quantile).bool()
    assert not kept[~t["mask"]].any()
    values = t["entropy"][t["mask"]]
    if quantile == 0.0:  # the highest-entropy token only
        assert kept.sum() == 1 and t["entropy"][kept].item() == values.max().item()
    elif quantile == 1.0:
        assert torch.equal(kept, t["mask"])
    else:  # about rho of the loss tokens, all at least as uncertain as any token left out
        assert t["entropy"][kept].min() >= t["entropy"][t["mask"] & ~kept].max()
        assert abs(kept.sum().item() - quantile * len(values)) <= 1
    assert not high_entropy_mask(t["entropy"], torch.zeros_like(t["mask"]), quantile).any()  # no loss tokens
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    stand_in = types.SimpleNamespace(accelerator=_FakeAccelerator())
    theirs = trl_grpo.GRPOTrainer.get_high_entropy_mask(stand_in, t["entropy"], t["mask"].long(), 1 - quantile)
    assert torch.equal(kept, theirs)


def test_adaptive_entropy_coefficient_hand_worked():
    """Skywork-OR1: +delta while the entropy is at or below the target, -delta above, within [min, max]; the bonus of
    a step applies only once the last step's entropy was at or below the target."""
    flags = EntropyFlags(entropy_coef=0.0, use_adaptive_entropy=True, entropy_target=0.2, entropy_coef_delta=0.01,
                         entropy_coef_min=0.0, entropy_coef_max=0.02)
    state, trace, applied = dict(entropy_coef=0.0, last_entropy=math.inf), [], []
    for entropy in [0.5, 0.1, 0.2, 0.1, 0.3, 0.3, 0.3]:
        applied.append(flags.step_entropy_coef(state))
        # the step's trained tokens: entropy sum and count (4 tokens of this mean entropy)
        flags.update_entropy_coef(state, torch.tensor([4 * entropy, 4.0], dtype=torch.float64), _FakeAccelerator())
        assert state["last_entropy"] == pytest.approx(entropy)
        trace.append(round(state["entropy_coef"], 10))
    assert trace == [0.0, 0.01, 0.02, 0.02, 0.01, 0.0, 0.0]
    # applied before each step: 0 until an entropy at or below the target, then the coefficient, 0 again above it
    assert [round(a, 10) for a in applied] == [0.0, 0.0, 0.01, 0.02, 0.02, 0.0, 0.0]
    # a fixed bonus: the coefficient every step, never moved; no bonus at all: None
    fixed, state = EntropyFlags(entropy_coef=0.05), dict(entropy_coef=0.05, last_entropy=5.0)
    fixed.update_entropy_coef(state, torch.tensor([20.0, 4.0]), _FakeAccelerator())
    assert fixed.step_entropy_coef(state) == 0.05 and state == dict(entropy_coef=0.05, last_entropy=5.0)
    assert EntropyFlags().step_entropy_coef(dict(entropy_coef=0.0, last_entropy=math.inf)) is None


# ---------------------------------------------------------------------------------------------------------
# Advantages: GDPO's decoupled normalisation, MaxRL; RAGEN-2's group filter
# ---------------------------------------------------------------------------------------------------------
def slow_decoupled(per_source, weights, G, penalty):
    """Python loops in float64: each source normalised within its group over the rows it scored (unbiased std),
    weighted sum (an unscored source adds 0), minus the penalty, then (r - batch mean) / (batch std + 1e-4)."""
    rows, S = len(per_source), len(per_source[0])
    rewards = []
    for i in range(rows):
        start = i - i % G
        if all(math.isnan(per_source[i][k]) for k in range(S)):
            rewards.append(NAN)
            continue
        total = 0.0
        for k in range(S):
            value = per_source[i][k]
            if math.isnan(value):
                continue
            group = [per_source[j][k] for j in range(start, start + G) if not math.isnan(per_source[j][k])]
            mean = sum(group) / len(group)
            std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1)) if len(group) > 1 else 0.0
            total += weights[k] * (value - mean) / (std + 1e-4)
        rewards.append(total - penalty[i])
    scored = [r for r in rewards if not math.isnan(r)]
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / (len(scored) - 1))
    return [0.0 if math.isnan(r) else (r - mean) / (std + 1e-4) for r in rewards]


def trl_normalize_then_sum(rewards_per_func, weights, G):
    """TRL 1.16's normalize_then_sum lines (GRPOTrainer._generate_and_score_completions) on the same tensors."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, G, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    advantages = (rewards - torch.nanmean(rewards)) / (nanstd(rewards).expand_as(rewards) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def two_sources(seed=5):
    """8 groups of 4: a reward model's scores (spread ~10) and a verifier's pass/fail (spread ~0.5); unscored rows,
    a group one source did not score at all, a row no source scored, a group flat in both."""
    generator = torch.Generator().manual_seed(seed)
    model = 10 * torch.randn(32, generator=generator)
    verifier = (torch.rand(32, generator=generator) > 0.5).float()
    per_source = torch.stack([model, verifier], 1)
    per_source[[2, 9], 1] = NAN
    per_source[12:16, 0] = NAN
    per_source[21] = NAN
    per_source[24:28] = torch.tensor([1.0, 1.0])
    return per_source


def test_decoupled_advantages_equal_a_slow_loop_and_trl():
    per_source, weights = two_sources(), torch.tensor([1.0, 2.0])
    penalty = torch.zeros(32)
    penalty[[3, 17]] = 1.0
    advantages, zero_std = decoupled_advantages(per_source.double(), weights.double(), 4, penalty.double())
    expected = slow_decoupled(per_source.tolist(), weights.tolist(), 4, penalty.tolist())
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-10)
    assert advantages[21] == 0 and zero_std[24:28].all() and not zero_std[:4].any()
    pytest.importorskip("trl")
    ours32, _ = decoupled_advantages(per_source, weights, 4)
    torch.testing.assert_close(ours32, trl_normalize_then_sum(per_source, weights, 4), atol=1e-5, rtol=1e-5)


def test_decoupled_advantages_give_each_source_its_say():
    """The GDPO point: summed first, a reward model of spread 10 decides the ranking alone; normalised per source,
    a pass on the verifier counts as much as the reward model's spread."""
    per_source = torch.tensor([[10.0, 0.0], [-10.0, 1.0], [0.5, 0.0], [-0.5, 1.0]])  # one group of 4
    summed, _ = group_advantages(per_source.sum(1), 4, "group")
    decoupled, _ = decoupled_advantages(per_source, torch.ones(2), 4)
    assert summed[1] < 0 < summed[0]  # the verifier's pass is drowned
    assert decoupled[1] > decoupled[2]  # the passing row beats the failing one of a higher model score


def test_maxrl_advantages_hand_worked_and_unbiased_for_log_pass_rate():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0,  0.0, 0.0, 0.0, 0.0,  1.0, 1.0, 0.0, 1.0,  0.0, 0.5, 1.0, 0.5])
    advantages, zero_std = group_advantages(rewards, 4, "maxrl")
    # (r - mean) / mean: 1 success in 4 -> 3, -1; none (mean 0) -> 0; 3 in 4 -> 1/3, -1; partial credit, mean 0.5
    expected = [3.0, -1.0, -1.0, -1.0, 0, 0, 0, 0, 1 / 3, 1 / 3, -1.0, 1 / 3, -1.0, 0, 1.0, 0]
    torch.testing.assert_close(advantages, torch.tensor(expected))
    assert zero_std[4:8].all() and not zero_std[:4].any()
    # MaxRL's estimator of grad log p: the mean score of the successes minus the mean score of all samples (a
    # zero-mean control variate); the advantages reproduce it as (1/N) sum_i A_i g_i for any per-sample scores g
    generator = torch.Generator().manual_seed(0)
    g = torch.randn(16, 7, generator=generator, dtype=torch.float64)
    for group in (slice(0, 4), slice(8, 12)):
        success = rewards[group] == 1
        estimator = g[group][success].mean(0) - g[group].mean(0)
        torch.testing.assert_close((advantages[group].double()[:, None] * g[group]).mean(0), estimator)


def test_maxrl_refuses_negative_rewards_naming_the_flag():
    """Issue 63: MaxRL divides by a group's mean success rate; a negative reward (the toy aliases' default
    --missing_eos_penalty 1, a signed reward model) made a mean near 0: rewards [1, 0, 0, -0.99] gave advantages
    [399, -1, -1, -397]. Now one line naming the problem and the flag."""
    with pytest.raises(UserError, match=r"--scale_rewards maxrl: a reward -0.99 < 0 \(--missing_eos_penalty 0\?\)"):
        group_advantages(torch.tensor([1.0, 0.0, 0.0, -0.99]), 4, "maxrl")
    for scale in ("group", "batch", "none"):  # the others take signed rewards
        assert group_advantages(torch.tensor([1.0, 0.0, 0.0, -0.99]), 4, scale)[0].abs().max() < 5


def slow_variance_filter(rewards, G, strategy, top_p, top_k):
    groups = []
    for start in range(0, len(rewards), G):
        scored = [r for r in rewards[start:start + G] if not math.isnan(r)]
        mean = sum(scored) / len(scored) if scored else 0.0
        groups.append(sum((r - mean) ** 2 for r in scored) / max(len(scored) - 1, 1))
    order = sorted((i for i in range(len(groups)) if groups[i] > 0), key=lambda i: (-groups[i], i))
    if strategy == "top_k":
        chosen = order[:top_k]
    else:
        chosen, running = [], 0.0
        for i in order:
            chosen.append(i)
            running += groups[i]
            if running >= top_p * sum(groups) * (1 - 1e-6):
                break
    return [i // G in chosen for i in range(len(rewards))]


@pytest.mark.parametrize("strategy, top_p, top_k", [("top_p", 0.9, 1), ("top_p", 0.5, 1), ("top_p", 1.0, 1),
                                                     ("top_k", 0.9, 2), ("top_k", 0.9, 20)])
def test_reward_variance_groups_equal_a_slow_sort(strategy, top_p, top_k):
    generator = torch.Generator().manual_seed(7)
    rewards = torch.randn(40, generator=generator)
    rewards[[1, 6]] = NAN
    rewards[8:12] = 0.5  # no variance: never kept
    rewards[16:20] = rewards[20:24]  # a tie: the earlier group ranks first
    kept = reward_variance_groups(rewards, 4, strategy, top_p, top_k)
    assert kept.tolist() == slow_variance_filter(rewards.tolist(), 4, strategy, top_p, top_k)
    assert not kept[8:12].any() and (strategy != "top_k" or kept.sum() == 4 * min(top_k, 9))


def test_a_run_with_every_setting(toy, tmp_path):
    """Two reward sources (the toy reward model and the verifier) aggregated GDPO's way, MaxRL is left to its own
    run in benchmark/; two iterations per batch so that off-policy masking sees a moved policy; the adaptive entropy
    coefficient grows by delta per optimizer step while the entropy is under a high target."""
    out = str(tmp_path / "knobs")
    run_script("grpo.py", "--max_steps", "2", "--per_device_train_batch_size", "16", "--num_eval_prompts", "8",
               "--reward_model", "toy", "--reward_funcs", "gold", "--multi_objective_aggregation", "normalize_then_sum",
               "--num_iterations", "2", "--off_policy_mask_threshold", "0.0", "--top_entropy_quantile", "0.5",
               "--use_adaptive_entropy", "--entropy_coef", "0.01", "--entropy_target", "100",
               "--reward_variance_filtering", "top_k", "--reward_variance_top_k", "2", "--output_dir", out, threads=1)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert rows[1]["objective/entropy_coef"] == pytest.approx(0.02)
    assert rows[2]["objective/entropy_coef"] == pytest.approx(0.03)
    assert rows[1]["reward_variance/frac_groups_kept"] <= 0.5
    assert "policy/off_policy_masked_fraction" in rows[1]
