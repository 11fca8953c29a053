"""grpo.py --dynamic_sampling (DAPO): rollouts of several rounds joined into one batch (run_ahead.concat_rollouts,
Rollout.subset) row for row, checked against the rounds themselves through a real tiny model; the rounds
(RunAhead.rollout_groups) on a scripted sampler; then grpo.py as a user runs it, on the toy task with a strict
exact-match reward whose groups are often flat: batches filled with groups that differ, one round = the plain loop,
and two processes agreeing on the rounds."""

import os
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, read_metrics, run_script, without_wall_clock
from test_scale import run_distributed

import policy_common as pc
from plumbing import models
from plumbing import rollout as ro
from plumbing import run_ahead as ra

EXACT_MATCH = os.path.join(ROOT, "benchmark", "toy_dynamic_sampling.py") + ":exact_match"


def make_rollout(tokenizer, policy, prompts, k, seed):
    """A Rollout of `prompts` (token-id lists) x k samples of the real toy policy, with per-row values a test can
    follow (scores = row numbers + seed / 10)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    queries = pc.pad_sequences(prompts, pad, "left").repeat_interleave(k, 0)
    torch.manual_seed(seed)
    config = pc.make_generation_config(tokenizer, 6, 1.0)
    query_responses, logprobs = pc.batch_generation(policy, queries, pad, eos, config, len(queries))
    B, R = len(queries), query_responses.shape[1] - queries.shape[1]
    mask = query_responses[:, queries.shape[1]:] != pad
    return ro.Rollout(query_responses=query_responses, context_length=queries.shape[1], samples_per_prompt=k,
                      rows=[{"prompt": i, "seed": seed} for i in range(B)], scores=torch.arange(B) + seed / 10,
                      source_scores=(torch.arange(B) + seed / 10)[:, None], old_logprobs=logprobs.masked_fill(
                          ~mask, pc.PADDING_LOGPROB), ref_logprobs=torch.randn(B, R), entropy=torch.rand(B, R),
                      behaviour_logprobs=None, metrics={"m": float(seed), "time/generate_seconds": 0.5 * seed},
                      pad_token_id=pad, eos_token_id=eos)


@torch.no_grad()
def test_concatenated_rounds_keep_every_row_and_its_log_probs(toy):
    tokenizer = models.load_tokenizer(toy["policy"])
    policy = models.load_causal_lm(toy["policy"], tokenizer).eval()
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    # two rounds with different prompt widths (3 vs 6 tokens) and, likely, response widths
    first = make_rollout(tokenizer, policy, [ids("a b ="), ids("c a =")], 2, seed=1)
    second = make_rollout(tokenizer, policy, [ids("d e f a b ="), ids("b ="), ids("f e d c b =")], 2, seed=2)
    joined = ra.concat_rollouts([first, second])
    assert joined.context_length == 6 and len(joined.rows) == 10
    assert joined.rows == first.rows + second.rows
    assert joined.metrics == {"m": 1.5, "time/generate_seconds": 0.5 + 1.0}  # a mean, but durations add up
    torch.testing.assert_close(joined.scores, torch.cat([first.scores, second.scores]))
    for part, rows in ((first, range(0, 4)), (second, range(4, 10))):
        for i, j in zip(range(len(part.rows)), rows):
            # the same prompt and response tokens, only more padding around them
            original, padded = part.query_responses[i], joined.query_responses[j]
            assert original[original != tokenizer.pad_token_id].tolist() == \
                padded[padded != tokenizer.pad_token_id].tolist()
            width = part.responses.shape[1]
            assert torch.equal(joined.response_mask[j, :width], part.response_mask[i])
            assert not joined.response_mask[j, width:].any()
            mask = part.response_mask[i]
            torch.testing.assert_close(joined.old_logprobs[j, :width][mask], part.old_logprobs[i][mask])
            torch.testing.assert_close(joined.ref_logprobs[j, :width][mask], part.ref_logprobs[i][mask])
    # the model scores every joined row as it scored it in its own round (re-padding changes nothing)
    forward = pc.Forward(tokenizer.pad_token_id)
    joined_logprobs = forward.logprobs(policy, joined.query_responses, joined.context_length)
    for part, offset in ((first, 0), (second, 4)):
        own = forward.logprobs(policy, part.query_responses, part.context_length)
        width, mask = own.shape[1], part.response_mask
        torch.testing.assert_close(joined_logprobs[offset:offset + len(own), :width][mask], own[mask],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(own[mask], part.old_logprobs[mask], atol=1e-4, rtol=1e-4)  # the sampled ones
    # a subset of whole groups: rows in the order asked
    picked = joined.subset(torch.tensor([6, 7, 0, 1]))
    assert [r["seed"] for r in picked.rows] == [2, 2, 1, 1]
    torch.testing.assert_close(picked.scores, joined.scores[[6, 7, 0, 1]])
    assert torch.equal(picked.query_responses, joined.query_responses[[6, 7, 0, 1]])


def test_rounds_roll_out_the_next_prompts_until_the_batch_is_full():
    """RunAhead.rollout_groups (grpo.sample_batch's --dynamic_sampling) on a scripted sampler: each round rolls out
    the next prompts of the stream; refused groups are left out while enough others come, and the batch is topped up
    with refused ones when --dynamic_sampling_max_rounds ran out; frac_flat_sampled is the refused share of the groups
    sampled."""
    k, calls = 2, []

    def rollout(prompts_seen, weights_version, *, old_logprobs, entropy):  # 3 prompts, numbered by their position
        calls.append((prompts_seen, weights_version, old_logprobs))
        prompts = torch.arange(prompts_seen, prompts_seen + 3).repeat_interleave(k).float()  # (B,)
        B = len(prompts)
        return ro.Rollout(query_responses=torch.ones(B, 4, dtype=torch.long), context_length=2, samples_per_prompt=k,
                          rows=[{"prompt": int(p)} for p in prompts], scores=prompts, source_scores=prompts[:, None],
                          old_logprobs=torch.zeros(B, 2), ref_logprobs=None, entropy=None, behaviour_logprobs=None,
                          metrics={}, pad_token_id=0, eos_token_id=2)

    accelerator = SimpleNamespace(num_processes=1, process_index=0, device="cpu")
    sampler = SimpleNamespace(accelerator=accelerator, prompts_per_process=3, samples_per_prompt=k, vllm=None,
                              rollout=rollout)
    rollouts = ra.RunAhead(sampler, max_staleness=0)

    def even(batch):  # (P,) the groups taken: those of even prompts
        return torch.tensor([row["prompt"] % 2 == 0 for row in batch.rows[::k]])

    batch, rounds, metrics = rollouts.rollout_groups(6, 4, even, 8, old_logprobs=True)
    assert calls == [(6, 4, True), (9, 4, True)] and rounds == 2  # prompts 6-8, then 9-11: 6, 8 and 10 taken
    assert [row["prompt"] for row in batch.rows] == [6, 6, 8, 8, 10, 10]
    assert batch.scores.tolist() == [6, 6, 8, 8, 10, 10] and batch.samples_per_prompt == k
    assert metrics == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/frac_flat_sampled": 3 / 6}
    calls.clear()
    batch, rounds, metrics = rollouts.rollout_groups(6, 4, even, 1, old_logprobs=False)
    assert calls == [(6, 4, False)] and rounds == 1
    assert [row["prompt"] for row in batch.rows] == [6, 6, 8, 8, 7, 7]  # topped up with the refused group
    assert metrics == {"dynamic_sampling/rounds": 1.0, "dynamic_sampling/frac_flat_sampled": 1 / 3}


@pytest.mark.slow
def test_dynamic_sampling_fills_batches_with_groups_that_differ_and_learns(toy, tmp_path):
    out = str(tmp_path / "ds")
    run_script("grpo.py", "--reward_funcs", EXACT_MATCH, "--dynamic_sampling", "--max_steps", "6", "--eval_steps", "0",
               "--num_eval_prompts", "128", "--output_dir", out)
    rows = read_metrics(out)
    train = [r for r in rows if r["step"] > 0]
    assert len(train) == 6
    for r in train:
        assert 1 <= r["dynamic_sampling/rounds"] <= 8
        if r["dynamic_sampling/rounds"] < 8:  # filled before the cap: no flat group trained on
            assert r["objective/frac_reward_zero_std"] == 0.0
    # exact match leaves many groups flat: extra rounds were needed (a third of the groups or more at the start)
    assert max(r["dynamic_sampling/rounds"] for r in train) >= 2
    assert train[0]["dynamic_sampling/frac_flat_sampled"] > 0.2
    assert rows[-1]["episode"] == 6 * 64  # trained completions per step stay the batch size
    assert rows[-1]["eval/gold_score"] > rows[0]["eval/gold_score"] + 0.1


@pytest.mark.slow
def test_one_round_of_dynamic_sampling_is_the_plain_loop(toy, tmp_path):
    """--dynamic_sampling_max_rounds 1: the same completions, flat groups moved after the others (a permutation of
    the rows: the same loss and statistics to float rounding)."""
    runs = {}
    for name, flags in (("plain", []), ("one_round", ["--dynamic_sampling", "--dynamic_sampling_max_rounds", "1"])):
        out = str(tmp_path / name)
        run_script("grpo.py", "--reward_funcs", EXACT_MATCH, "--max_steps", "1", "--eval_steps", "0",
                   "--num_eval_prompts", "16", "--output_dir", out, *flags)
        runs[name] = without_wall_clock(read_metrics(out))[1]
    plain, one_round = runs["plain"], runs["one_round"]
    assert one_round["dynamic_sampling/rounds"] == 1.0
    assert one_round["dynamic_sampling/frac_flat_sampled"] == pytest.approx(plain["objective/frac_reward_zero_std"])
    assert plain["objective/frac_reward_zero_std"] > 0  # flat groups were there to move
    for key, value in plain.items():
        if not key.startswith("eval/"):
            assert one_round[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_two_processes_agree_on_the_rounds(toy, tmp_path):
    out = str(tmp_path / "ds2")
    run_distributed("grpo.py", "--reward_funcs", EXACT_MATCH, "--dynamic_sampling", "--max_steps", "2",
                    "--per_device_train_batch_size", "32", "--eval_steps", "0", "--num_eval_prompts", "16",
                    "--output_dir", out)
    train = [r for r in read_metrics(out) if r["step"] > 0]
    assert len(train) == 2 and all(r["episode"] == 64 * r["step"] for r in train)
    assert all(r["dynamic_sampling/rounds"] >= 1 and r["objective/frac_reward_zero_std"] == 0.0 for r in train)


def test_groups_are_dropped_by_accuracy_or_by_reward():
    """DAPO's eq. 11 keeps a group when 0 < #correct < G. With overlong shaping an all-wrong group's rewards still
    differ by length: filtering on rewards (the old rule) kept it, to train on the length penalty alone."""
    from grpo import flat_groups

    rewards = torch.tensor([0.0, -0.5, -1.0, -0.25,   # all wrong, lengths differ
                            1.0, 0.0, -0.5, 0.0,      # one right
                            1.0, 1.0, 0.5, 1.0,       # all right, one long
                            0.3, 0.3, 0.3, 0.3])      # all wrong, all equal
    correct = rewards >= 1.0
    correct[10] = True  # right, and penalised for its length
    assert flat_groups(rewards, correct, 4, "accuracy").tolist() == [True, False, True, True]
    assert flat_groups(rewards, correct, 4, "reward").tolist() == [False, False, False, True]


def test_correct_is_every_verdict_at_least_one_with_shaping_aside():
    from plumbing import reward_sources as rs

    def f(completions, **kwargs):
        return [0.0] * len(completions)

    overlong = rs.overlong_penalty(8, 4, 1.0)
    sources = rs.Rewards(None, functions=[rs.RewardFunction("a", f), rs.RewardFunction("b", f), overlong])
    nan = float("nan")
    per_source = torch.tensor([[1.0, 1.0, -0.5],   # both verifiers pass; the length penalty is no verdict
                               [1.0, 0.9, 0.0],    # one fails
                               [1.0, nan, -1.0],   # b does not score it: a alone decides
                               [nan, nan, 0.0]])   # no verifier scored it: not correct
    assert sources.correct(per_source).tolist() == [True, False, True, False]
    assert sources.verdict_columns == [0, 1]
