"""ppo.py: algorithm pieces against independent computations, then short real runs on the toy task."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import read_metrics, run_script_in_process, without_wall_clock
from conftest import run_script as _run_script

from plumbing import data_utils as du
from ppo import batch_advantages, compute_gae, per_token_rewards, ppo_losses

PAD, EOS = 0, 1


def run_script(*args, **kwargs):
    """One thread per run: the toy models are tiny, and threads only contend on a shared 2-core machine."""
    return _run_script(*args, threads=1, **kwargs)


def make_responses(lengths, R, eos_flags, generator):
    """(B, R) responses of the given real lengths; a row ends with EOS where its flag is set."""
    responses = torch.full((len(lengths), R), PAD)
    for i, (length, has_eos) in enumerate(zip(lengths, eos_flags)):
        responses[i, :length] = torch.randint(3, 10, (length,), generator=generator)
        if has_eos:
            responses[i, length - 1] = EOS
    return responses


# ---------------------------------------------------------------------------------------------------------
# algorithm pieces
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.5, 0.0)])
def test_gae_matches_python_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    lengths, R = [5, 1, 3, 5, 2], 5
    mask = torch.arange(R)[None] < torch.tensor(lengths)[:, None]
    rewards, values = torch.randn(len(lengths), R, generator=g), torch.randn(len(lengths), R, generator=g)
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    for i, length in enumerate(lengths):
        r, v = rewards[i].tolist(), values[i].tolist()
        expected = [0.0] * R
        for t in range(length):  # the slow definition: sum_l (gamma lam)^l delta_{t+l}, V after the end = 0
            total = 0.0
            for k in range(t, length):
                next_value = v[k + 1] if k + 1 < length else 0.0
                total += (gamma * lam) ** (k - t) * (r[k] + gamma * next_value - v[k])
            expected[t] = total
        assert advantages[i].tolist() == pytest.approx(expected, abs=1e-5)
        assert returns[i, :length].tolist() == pytest.approx([a + b for a, b in zip(expected, v)][:length], abs=1e-5)
        assert returns[i, length:].abs().sum() == 0


def test_gae_ignores_padding_contents():
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(6)[None] < torch.tensor([2, 6, 4])[:, None]
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    junk_r = torch.where(mask, rewards, torch.randn(3, 6, generator=g) * 100)
    junk_v = torch.where(mask, values, torch.randn(3, 6, generator=g) * 100)
    a1, r1 = compute_gae(rewards, values, mask, 1.0, 0.95)
    a2, r2 = compute_gae(junk_r, junk_v, mask, 1.0, 0.95)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(r1, r2)


def test_per_token_reward_layout():
    g = torch.Generator().manual_seed(2)
    R = 6
    lengths, eos_flags = [6, 3, 1, 6], [False, True, True, True]  # row 0 ran out of tokens without EOS
    responses = make_responses(lengths, R, eos_flags, g)
    mask = responses != PAD
    logprobs, ref_logprobs = torch.randn(4, R, generator=g), torch.randn(4, R, generator=g)
    scores = torch.tensor([1.0, 2.0, -3.0, 0.5])
    kl_coef = 0.1
    rewards, non_score_reward, kl = per_token_rewards(logprobs, ref_logprobs, scores, mask, kl_coef)
    for i, length in enumerate(lengths):
        for t in range(R):
            token_kl = (logprobs[i, t] - ref_logprobs[i, t]).item() if t < length else 0.0
            expected = -kl_coef * token_kl + (scores[i].item() if t == length - 1 else 0.0)
            assert rewards[i, t].item() == pytest.approx(expected, abs=1e-6), (i, t)
            assert kl[i, t].item() == pytest.approx(token_kl, abs=1e-6)
    assert torch.equal(rewards.sum(1) - non_score_reward.sum(1), scores)


@pytest.mark.parametrize("whiten_rewards", [False, True])
def test_advantages_of_a_single_response_token_are_finite(whiten_rewards):
    """One row whose response is a lone EOS (batch size 1): nothing to whiten by, yet finite advantages (the
    old masked_var raised here, and --whiten_rewards refused batches of one)."""
    g = torch.Generator().manual_seed(5)
    mask = torch.tensor([[True, False, False]])
    rewards, values = torch.randn(1, 3, generator=g), torch.randn(1, 3, generator=g)
    advantages, raw_advantages, returns = batch_advantages(rewards, values, mask, 1.0, 0.95,
                                                           whiten_rewards=whiten_rewards)
    for tensor in (advantages, raw_advantages, returns):
        assert torch.isfinite(tensor).all() and (tensor[~mask] == 0).all()
    assert advantages[0, 0].item() == 0.0  # a single value whitens to 0
    # the single reward is kept as it is (whitening with the mean kept is the identity for one value)
    assert raw_advantages[0, 0].item() == pytest.approx((rewards[0, 0] - values[0, 0]).item(), abs=1e-5)
    # two rows still whiten to mean 0, unit variance over the response tokens
    mask2 = torch.tensor([[True, True, False], [True, False, False]])
    advantages, _, _ = batch_advantages(torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g), mask2, 1.0,
                                        0.95, whiten_rewards=whiten_rewards)
    assert advantages[mask2].mean().item() == pytest.approx(0.0, abs=1e-5)
    assert advantages[mask2].var().item() == pytest.approx(1.0, abs=1e-3)


def test_batch_indices_follow_the_shared_data_order():
    """Updates read the data order of every script (du.epoch_permutation per pass) position after position,
    across pass boundaries."""
    num_prompts, batch_size, seed = 10, 4, 3
    order = [i for epoch in range(3) for i in du.epoch_permutation(num_prompts, seed, epoch)]
    read = [i for update in range(1, 8) for i in du.data_positions(num_prompts, seed, (update - 1) * batch_size,
                                                                   batch_size)]
    assert read == order[:28]
    assert du.data_positions(num_prompts, seed, 5 * batch_size, batch_size) == order[20:24]  # resume at update 6


def test_ppo_losses_against_elementwise_definition():
    g = torch.Generator().manual_seed(4)
    mask = torch.arange(5)[None] < torch.tensor([5, 2, 4])[:, None]
    new, old = torch.randn(3, 5, generator=g) * 0.3, torch.randn(3, 5, generator=g) * 0.3
    adv, vpred, old_v, ret = (torch.randn(3, 5, generator=g) for _ in range(4))
    pg_loss, vf_loss, stats = ppo_losses(new, old, adv, vpred, old_v, ret, mask, 0.2, 0.2)
    pg, vf, clipped = [], [], []
    for i, t in zip(*torch.nonzero(mask, as_tuple=True)):
        ratio = float(np.exp(new[i, t] - old[i, t]))
        a = adv[i, t].item()
        pg.append(max(-a * ratio, -a * min(max(ratio, 0.8), 1.2)))
        clipped.append(-a * min(max(ratio, 0.8), 1.2) > -a * ratio)
        v_clip = min(max(vpred[i, t].item(), old_v[i, t].item() - 0.2), old_v[i, t].item() + 0.2)
        vf.append(0.5 * max((vpred[i, t].item() - ret[i, t].item()) ** 2, (v_clip - ret[i, t].item()) ** 2))
    assert pg_loss.item() == pytest.approx(np.mean(pg), abs=1e-5)
    assert vf_loss.item() == pytest.approx(np.mean(vf), abs=1e-5)
    assert stats["policy/clipfrac"].item() == pytest.approx(np.mean(clipped), abs=1e-6)
    # at ratio 1 the policy loss is minus the mean advantage and nothing is clipped
    pg_loss, _, stats = ppo_losses(old, old, adv, old_v, old_v, ret, mask, 0.2, 0.2)
    assert pg_loss.item() == pytest.approx(-adv[mask].mean().item(), abs=1e-6)
    assert stats["policy/clipfrac"].item() == 0 and stats["val/clipfrac"].item() == 0


# ---------------------------------------------------------------------------------------------------------
# real runs on the toy task
# ---------------------------------------------------------------------------------------------------------
SMALL = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--num_mini_batches", "2",
         "--total_episodes", "64", "--num_eval_prompts", "32", "--eval_steps", "2", "--save_steps", "2"]
REQUIRED = ["objective/scores", "objective/kl", "objective/rlhf_reward", "objective/entropy",
            "objective/non_score_reward", "objective/kl_coef", "loss/policy", "loss/value", "policy/approxkl",
            "policy/clipfrac", "val/clipfrac", "val/mean", "val/var", "val/ratio", "val/num_eos_tokens",
            "val/response_length", "adv/mean", "adv/std", "lr", "episode", "time/episodes_per_second"]
EVAL = ["eval/scores", "eval/gold_score", "eval/kl", "eval/response_length", "eval/eos_rate"]


def load_weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def small_run(toy, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ppo") / "full")
    run_script("ppo.py", "--output_dir", out, "--save_value_model", *SMALL)
    return out


def test_end_to_end_metrics_and_reload(small_run):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    rows = read_metrics(small_run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for row in rows[1:]:
        assert set(REQUIRED) <= set(row), set(REQUIRED) - set(row)
        assert all(np.isfinite(v) for v in row.values())
    for row in (rows[0], rows[2], rows[4]):
        assert set(EVAL) <= set(row)
    assert rows[1]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # policy == reference before the first step
    assert rows[1]["val/ratio"] == pytest.approx(1.0, abs=0.05)
    assert rows[4]["episode"] == 64 and rows[4]["lr"] < rows[1]["lr"]
    AutoModelForCausalLM.from_pretrained(os.path.join(small_run, "model"))
    AutoModelForSequenceClassification.from_pretrained(os.path.join(small_run, "value_model"))
    assert os.path.isdir(os.path.join(small_run, "checkpoint-2"))


def test_determinism_and_resume(small_run, tmp_path):
    # determinism: the same seed gives the same metrics, wall-clock ones aside
    again = str(tmp_path / "again")
    run_script("ppo.py", "--output_dir", again, "--save_value_model", *SMALL, fresh=True)  # a new interpreter's own
    # hash seed and random generators (conftest.run_script)
    assert without_wall_clock(read_metrics(again)) == without_wall_clock(read_metrics(small_run))
    # resume: 2 steps + resume for 2 more == 4 steps (metrics and final weights)
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(small_run, "checkpoint-2"), os.path.join(resumed, "checkpoint-2"))
    with open(os.path.join(small_run, "metrics.jsonl")) as f, open(os.path.join(resumed, "metrics.jsonl"), "w") as g:
        g.writelines(f.readlines()[:3])  # steps 0..2, as the first run had written them at its checkpoint
    run_script("ppo.py", "--output_dir", resumed, "--save_value_model", "--resume_from",
               os.path.join(resumed, "checkpoint-2"), *SMALL)
    full_rows, resumed_rows = without_wall_clock(read_metrics(small_run)), without_wall_clock(read_metrics(resumed))
    assert [r["step"] for r in resumed_rows] == [0, 1, 2, 3, 4]
    for a, b in zip(full_rows, resumed_rows):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["step"], k)
    for folder in ("model", "value_model"):
        full, res = load_weights(os.path.join(small_run, folder)), load_weights(os.path.join(resumed, folder))
        for name in full:
            torch.testing.assert_close(full[name], res[name], rtol=1e-4, atol=1e-5)


def test_checkpoint_holds_no_pickled_scheduler(small_run):
    """The LR scheduler is not given to accelerator.prepare: the checkpoint carries it as JSON next to the step
    and the KL coefficient (exact resume is checked above)."""
    folder = os.path.join(small_run, "checkpoint-2")
    assert not [f for f in os.listdir(folder) if f.startswith("scheduler")], os.listdir(folder)
    with open(os.path.join(folder, "trainer_state.json")) as f:
        state = json.load(f)
    assert state["step"] == 2 and state["kl_coef"] == pytest.approx(0.3)  # the toy alias's fixed kl_coef
    assert state["episode"] == state["prompts_seen"] == 32 and state["nonfinite_skipped"] == 0
    # the schedule steps once per optimizer step: 4 epochs x 2 mini-batches per update, 2 of 4 updates done
    assert state["_scheduler"]["last_epoch"] == 16 and state["_scheduler"]["_last_lr"][0] == pytest.approx(1e-4 / 2)


def test_peft_run_uses_adapter_off_reference(toy, tmp_path):
    out = str(tmp_path / "peft")
    proc = run_script("ppo.py", "--output_dir", out, "--use_peft", "--lora_r", "4", "--lora_alpha", "8",
                      "--learning_rate", "1e-3", *SMALL[:-4], "--eval_steps", "0")
    assert "reference: adapter_off" in proc.stdout
    rows = read_metrics(out)
    # --eval_steps 0: evaluate before training and after the last step only
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [set(EVAL) <= set(r) for r in rows] == [True, False, False, False, True]
    assert rows[0]["eval/kl"] == pytest.approx(0.0, abs=1e-5)
    assert rows[1]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # a fresh adapter is the identity
    assert rows[-1]["eval/kl"] > 0  # the trained adapter moved away from the base it is compared with
    assert os.path.exists(os.path.join(out, "model", "adapter_config.json"))


def test_single_token_responses_in_batches_of_one(toy, tmp_path):
    """Batches of one row whose response is a single token: whitening has one value (it used to stop in
    masked_var, and --whiten_rewards refused to start)."""
    out = str(tmp_path / "one")
    run_script("ppo.py", "--output_dir", out, "--per_device_train_batch_size", "1", "--gradient_accumulation_steps",
               "1", "--num_mini_batches", "1", "--response_length", "1", "--whiten_rewards", "--max_steps", "2",
               "--num_ppo_epochs", "1", "--num_eval_prompts", "4")
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["val/response_length"] == 1 and row["adv/std"] == 0 and row["val/var"] == 0
        assert all(np.isfinite(v) for v in row.values()), row


@pytest.mark.parametrize("flags,message", [
    (["--kl_coef", "-0.1"], "--kl_coef must be >= 0"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--lam", "1.5"], "--lam must be in [0, 1]"),
    (["--num_mini_batches", "0"], "--num_mini_batches must be > 0"),
    (["--response_length", "60"], "--response_length 60 does not fit"),  # toy: 64 positions, prompts up to 7 tokens
    (["--max_prompt_length", "4"], "more than --max_prompt_length 4"),
    (["--num_eval_prompts", "0"], "--num_eval_prompts must be > 0"),
])
def test_bad_input_fails_early_without_output(toy, tmp_path, flags, message):
    out = str(tmp_path / "never")
    proc = run_script_in_process("ppo.py", "--output_dir", out, *flags)
    assert proc.returncode == 2
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error:") and message in last_line and "Traceback" not in proc.stderr, proc.stderr
    assert not os.path.exists(out)


# Learning at the toy defaults: tests/test_learning.py (the whole default budget, against the benchmark's band).


# ---------------------------------------------------------------------------------------------------------
# lengths and data that do not fit the defaults
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def short_models(toy, tmp_path_factory):
    """A tiny random GPT-NeoX policy and reward model with only 32 positions, with the toy tokenizer."""
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(toy["tokenizer"])
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=32, rotary_pct=0.25, num_labels=1,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    root = tmp_path_factory.mktemp("short")
    torch.manual_seed(0)
    for name, cls in (("policy", GPTNeoXForCausalLM), ("reward", GPTNeoXForSequenceClassification)):
        cls(config).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return str(root / "policy"), str(root / "reward")


SHORT_RUN = ["--dataset", "toy", "--max_steps", "1", "--per_device_train_batch_size", "2",
             "--gradient_accumulation_steps", "1", "--num_ppo_epochs", "1", "--num_eval_prompts", "4"]


def test_defaults_fit_a_model_with_32_positions(short_models, tmp_path):
    """The defaults (response_length 53, max_prompt_length = the longest prompt) fit a model with 32 positions:
    the response length is lowered to what the longest toy prompt (7 tokens) leaves, with a note."""
    policy, reward = short_models
    out = str(tmp_path / "short")
    proc = run_script("ppo.py", "--model", policy, "--reward_model", reward, *SHORT_RUN, "--output_dir", out)
    assert "--response_length lowered from 53 to 25" in proc.stdout, proc.stdout
    with open(os.path.join(out, "args.json")) as f:
        assert json.load(f)["response_length"] == 25
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    assert 1 <= rows[1]["val/response_length"] <= 25 and 1 <= rows[1]["eval/response_length"] <= 25


def test_explicit_response_length_that_cannot_fit_fails_in_one_line(short_models, tmp_path):
    policy, reward = short_models
    out = str(tmp_path / "never")
    proc = run_script_in_process("ppo.py", "--model", policy, "--reward_model", reward, *SHORT_RUN,
                                 "--response_length", "30", "--output_dir", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("error: --response_length 30 does not fit: the model's 32 "
                                                    "positions minus prompts of up to 7 tokens leaves 25 positions")
    assert not os.path.exists(out)


def test_empty_held_out_split_fails_in_one_line(toy, tmp_path):
    """A save_to_disk dataset whose held-out split has no rows (datasets itself cannot load such a split): one
    line naming the split, nothing written. (tests/test_hardening.py checks both splits for every script.)"""
    import datasets

    features = datasets.Features({"prompt": datasets.Value("string")})
    path = str(tmp_path / "prompts")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a b c =", "d e f ="]}, features=features),
                          "test": datasets.Dataset.from_dict({"prompt": []}, features=features)}).save_to_disk(path)
    out = str(tmp_path / "never")
    proc = run_script_in_process("ppo.py", "--reward_model", "toy", "--dataset", path, "--output_dir", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error:") and "empty" in last_line and "'test'" in last_line, last_line
    assert not os.path.exists(out)
