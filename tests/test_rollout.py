"""rollout.py: the Sampler on the toy policy: a rollout's layout and scores against the obvious computations, the
old-log-probs invariant (kept by the sampling the scripts use; a changed sampler fails loudly), the training
forward, the group-keeping shuffle."""
import json
from types import SimpleNamespace

import pytest
import torch

import policy_common as pc
from plumbing import models
from plumbing import prompt_sharing as ps
from plumbing import reward_sources as rs
from plumbing import rollout as ro
from plumbing import vllm_generation as vg
from plumbing.errors import RolloutError
from plumbing.forwards import Forwards


def letters_reward(prompts, completions, **columns):
    """1 per completion that has as many words as its prompt has letters (a cheap, deterministic reward)."""
    return [float(len(c.split()) == len(p.split()) - 1) for p, c in zip(prompts, completions)]


@pytest.fixture(scope="module")
def toy_sampler_parts(toy):
    from accelerate import Accelerator

    tokenizer = models.load_tokenizer(toy["policy"])
    policy = models.load_causal_lm(toy["policy"], tokenizer)
    prompts = ["f b k c =", "a c =", "l k j i h =", "b d ="]
    rows = [{"prompt": p} for p in prompts]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return dict(tokenizer=tokenizer, policy=policy, rows=rows, prompt_ids=prompt_ids,
                accelerator=Accelerator(cpu=True))


def make_sampler(parts, k=4, reference=None, forward=None, **flags):
    """A Sampler built by hand, as the scripts build theirs; `forward`: the policy's (None: the plain one)."""
    args = SimpleNamespace(**{**vars(vg.VLLMFlags()), **dict(
        response_length=8, temperature=1.0, missing_eos_penalty=1.0, seed=5, local_rollout_forward_batch_size=16,
        per_device_train_batch_size=8, num_samples_printed=0, cache_implementation=None), **flags})
    rewards = rs.Rewards(parts["tokenizer"], functions=[rs.RewardFunction("letters", letters_reward)])
    forward = forward or pc.Forward(parts["tokenizer"].pad_token_id, args.temperature)
    return ro.Sampler(args, parts["accelerator"], parts["tokenizer"], parts["policy"], forward, rewards, reference,
                      prompts=parts["prompt_ids"], rows=parts["rows"], samples_per_prompt=k, prompts_per_process=2,
                      max_prompt_length=max(map(len, parts["prompt_ids"])))


def test_rollout_layout_scores_and_old_logprobs(toy_sampler_parts):
    """Rows come prompt by prompt, k each; responses are truncated after the first EOS; scores are the reward
    function's, minus the missing-EOS penalty; the old log-probs equal a fresh forward's (the invariant), and the
    reference's are the reference model's own."""
    parts = toy_sampler_parts
    tokenizer, policy = parts["tokenizer"], parts["policy"]
    plain = pc.Forward(tokenizer.pad_token_id)
    reference = pc.Reference("copy", plain, model=models.load_causal_lm(parts["policy"].name_or_path, tokenizer))
    sampler = make_sampler(parts, reference=reference)
    torch.manual_seed(0)
    batch = sampler.rollout(prompts_seen=0, weights_version=0, entropy=True)
    B, ctx = batch.query_responses.shape[0], batch.context_length
    assert B == 8 and batch.samples_per_prompt == 4
    assert all(batch.rows[i] == batch.rows[4 * (i // 4)] for i in range(B))  # k copies of each prompt's row
    queries = batch.query_responses[:, :ctx]
    assert torch.equal(queries[0], queries[3]) and not torch.equal(queries[0], queries[4])
    responses, pad, eos = batch.responses, tokenizer.pad_token_id, tokenizer.eos_token_id
    for row in responses.tolist():  # pad only after the first EOS
        end = row.index(eos) + 1 if eos in row else len(row)
        assert pad not in row[:end] and all(t == pad for t in row[end:])
    # scores: the function's value, minus 1.0 where there is no EOS
    texts = [tokenizer.decode(r[r != pad], skip_special_tokens=True) for r in responses]
    expected = torch.tensor(letters_reward([row["prompt"] for row in batch.rows], texts)) - batch.truncated.float()
    assert torch.equal(batch.scores, expected)
    assert torch.equal(batch.source_scores[:, 0], expected + batch.truncated.float())
    # old log-probs: a forward's, to float rounding; PADDING_LOGPROB after EOS; the policy sampled them itself
    mask = batch.response_mask
    forward = plain.logprobs(policy, batch.query_responses, ctx)
    torch.testing.assert_close(batch.old_logprobs[mask], forward[mask], atol=1e-5, rtol=0)
    assert (batch.old_logprobs[~mask] == pc.PADDING_LOGPROB).all() and batch.behaviour_logprobs is None
    assert batch.metrics["time/generate_seconds"] > 0
    ref = plain.logprobs(reference.model, batch.query_responses, ctx)
    torch.testing.assert_close(batch.ref_logprobs[mask], ref[mask], atol=1e-5, rtol=0)
    assert batch.entropy.shape == mask.shape and (batch.entropy[mask] > 0).all()
    # the invariant's check ran (step 1) and found the sampled log-probs equal to a forward's; its mismatch metrics
    # (hf/*) are plain numbers: a batch sampled ahead is checkpointed with its metrics as JSON (run_ahead.py)
    assert batch.metrics["rollout/logprob_check"] < 1e-4
    assert batch.metrics["hf/logprob_diff"] < 1e-4 and batch.metrics["hf/kl"] < 1e-6
    json.dumps(batch.metrics)


def test_next_rollout_takes_the_next_prompts_and_checks_every_tenth_step(toy_sampler_parts):
    sampler = make_sampler(toy_sampler_parts, k=2)
    first = sampler.rollout(prompts_seen=0, weights_version=0)
    second = sampler.rollout(prompts_seen=2, weights_version=1)
    assert "rollout/logprob_check" in first.metrics and "rollout/logprob_check" not in second.metrics
    assert "rollout/logprob_check" in sampler.rollout(prompts_seen=2, weights_version=10).metrics
    firsts = {tuple(r["prompt"] for r in b.rows[::2]) for b in (first, second)}
    assert len(firsts) == 2  # another pair of prompts (a permutation of the 4: no prompt twice in one pass)
    assert sorted(first.rows[::2] + second.rows[::2], key=lambda r: r["prompt"]) == sorted(
        toy_sampler_parts["rows"], key=lambda r: r["prompt"])


@pytest.mark.parametrize("change, keeps", [
    (dict(top_k=0), True),  # the scripts' own: no top-k
    (dict(top_k=10_000), True),  # a top-k above the vocabulary keeps every token: the same distribution
    (dict(top_k=2), False),
    (dict(top_p=0.5), False),
    (dict(repetition_penalty=1.5), False),  # a logits processor
    (dict(temperature=0.5), False),  # generation at another temperature than the losses score
])
def test_a_changed_sampler_keeps_the_invariant_or_fails_loudly(toy_sampler_parts, change, keeps):
    """The sampled tokens' log-probs are the old log-probs only while generation samples the distribution the
    forwards score: any change of the generation config that breaks it stops the first rollout with one line."""
    sampler = make_sampler(toy_sampler_parts)
    for key, value in change.items():
        setattr(sampler.generation_config, key, value)
    torch.manual_seed(1)
    if keeps:
        assert sampler.rollout(prompts_seen=0, weights_version=0).metrics["rollout/logprob_check"] < 1e-4
    else:
        with pytest.raises(RolloutError, match="sampler's log-probs are not the trainer's"):
            sampler.rollout(prompts_seen=0, weights_version=0)


def test_training_forward_scores_as_the_rollout_did(toy_sampler_parts):
    """The sampler's forward (`Sampler.forward`, what the scripts' training forward runs) on a micro-batch
    (Rollout.subset), prompt sharing on (forced: at toy sizes it does not save enough to be chosen), gives the plain
    forward's log-probs and entropy for any rows."""
    parts = toy_sampler_parts
    pad = parts["tokenizer"].pad_token_id
    # what rollout_forwards would choose here: 8 rows of <= 6 prompt tokens, sharing saves fewer than 128 positions
    repeats = ps.Repeats(8, 4, max(map(len, parts["prompt_ids"])), 8)
    assert not ps.worth_sharing(*repeats)
    assert type(Forwards(pad, 1.0, repeats=repeats).lm(parts["policy"])) is pc.Forward
    sampler = make_sampler(parts, forward=ps.SharedPromptForward(pad, 1.0))
    assert sampler.forward.shares_prompts
    torch.manual_seed(2)
    batch = sampler.rollout(prompts_seen=0, weights_version=3)
    rows = batch.shuffled_rows()[:4]
    micro_batch = batch.subset(rows)
    logprobs, entropy = sampler.forward.logprobs(parts["policy"], micro_batch.query_responses,
                                                 micro_batch.context_length, entropy=True)
    logits = pc.Forward(pad).logits(parts["policy"], batch.query_responses[rows], batch.context_length)
    mask = batch.response_mask[rows]
    torch.testing.assert_close(logprobs[mask], pc.selective_logprobs(logits, batch.responses[rows])[mask],
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[mask], pc.entropy_from_logits(logits)[mask], atol=1e-5, rtol=0)
    assert logprobs.requires_grad and not entropy.requires_grad
    alone = sampler.forward.logprobs(parts["policy"], micro_batch.query_responses, micro_batch.context_length)
    assert isinstance(alone, torch.Tensor)  # without entropy: the log-probs alone
    torch.testing.assert_close(alone[mask], logprobs[mask], atol=1e-6, rtol=0)


@pytest.mark.parametrize("k, rows", [(1, 6), (2, 8), (4, 12)])
def test_shuffled_rows_keep_groups_together(k, rows):
    batch = SimpleNamespace(samples_per_prompt=k, query_responses=torch.zeros(rows, 3))
    orders = [ro.Rollout.shuffled_rows(batch) for _ in range(5)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(rows))
        groups = order.view(-1, k)
        assert (groups // k == groups[:, :1] // k).all() and (groups % k == torch.arange(k)).all()
    assert len({tuple(o.tolist()) for o in orders}) > 1
