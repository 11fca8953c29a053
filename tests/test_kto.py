"""kto.py: the loss, its KL reference point and class weights against hand-written formulas, the mismatched pairs
and data order, data conversion and errors, the joint forward, and short real runs on the toy task (metrics,
reload, PEFT, precomputed reference log-probs, determinism, resume, lengths on a 32-position model, learning)."""

import functools
import json
import math
import os
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, run_script, run_script_in_process, without_wall_clock
from hypothesis import given, settings
from hypothesis import strategies as st

from kto import kl_reference_point, kto_losses, loss_weights, make_kl_groups, weight_advice
from plumbing import data_utils as du
from plumbing import models
from plumbing import train_loop as tl
from plumbing.data_utils import to_unpaired
from plumbing.errors import UserError

SHORT = ["--num_eval_prompts", "32", "--num_eval_examples", "128"]
TRAIN_KEYS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "kl", "logps/chosen", "logps/rejected",
              "count/desirable", "count/undesirable", "lr", "epoch", "grad_norm"]
EVAL_KEYS = ["eval/" + k for k in TRAIN_KEYS[:9]] + ["eval/gold_score"]


def assert_rows_close(a, b, rel=1e-5, abs_=1e-6):
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for ra, rb in zip(a, b):
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=rel, abs=abs_), (ra["step"], k)


# ---------------------------------------------------------------------------------------------------------
# Algorithm pieces
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_kto_losses_match_hand_written_formula(seed):
    g = torch.Generator().manual_seed(seed)
    B = 17
    rewards = torch.randn(B, generator=g, dtype=torch.float64) * 5
    desirable = torch.rand(B, generator=g) < 0.5
    desirable[0], desirable[1] = True, False  # both labels present
    z0 = torch.rand((), generator=g, dtype=torch.float64) * 2
    beta, wd, wu = 0.05 + seed / 10, 1.0 + seed, 0.5 + seed / 3
    losses = kto_losses(rewards, z0, desirable, beta, wd, wu)

    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    for i in range(B):
        r = rewards[i].item()
        expected = (wd * (1 - sigmoid(beta * (r - z0.item()))) if desirable[i]
                    else wu * (1 - sigmoid(beta * (z0.item() - r))))
        assert losses[i].item() == pytest.approx(expected, rel=1e-12)


def test_kl_reference_point_is_the_clamped_detached_mean():
    policy = torch.tensor([-3.0, -1.0, -2.0], requires_grad=True)
    assert kl_reference_point(policy, torch.tensor([-4.0, -1.5, -2.0])).item() == pytest.approx(0.5)
    z0 = kl_reference_point(policy, torch.tensor([-1.0, 0.0, -1.0]))  # mean log-ratio -4/3 < 0
    assert z0.item() == 0.0 and not z0.requires_grad
    assert not kl_reference_point(policy, torch.tensor([-9.0, -9.0, -9.0])).requires_grad
    # the reference point moves every loss the expected way: larger z0 -> desirable loss up, undesirable down
    r, d = torch.zeros(2), torch.tensor([True, False])
    low, high = kto_losses(r, torch.tensor(0.0), d, 0.1, 1, 1), kto_losses(r, torch.tensor(2.0), d, 0.1, 1, 1)
    assert high[0] > low[0] and high[1] < low[1]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 60), group_size=st.integers(2, 12), seed=st.integers(0, 10_000))
def test_mismatched_pairs_never_use_the_examples_own_completion(n, group_size, seed):
    rng = random.Random(seed)
    examples = [dict(index=i, prompt_ids=[rng.randrange(3, 9) for _ in range(rng.randint(1, 4))],
                     completion_ids=[100 + i, 1], label=rng.random() < 0.3) for i in range(n)]
    if n < group_size:
        assert make_kl_groups(examples, group_size, seed, max_length=32) == []
        return
    groups = make_kl_groups(examples, group_size, seed, max_length=32)
    assert len(groups) == n // group_size and all(len(g) == group_size for g in groups)
    for group in groups:
        indices = [e["index"] for e in group]
        for e in group:
            assert e["kl_partner"] != e["index"] and e["kl_partner"] in indices  # another example of the same batch
            assert e["kl_completion_ids"] == examples[e["kl_partner"]]["completion_ids"] != e["completion_ids"]
        # the mismatched completions are exactly the batch's own completions, each used once
        assert sorted(e["kl_partner"] for e in group) == sorted(indices)
    assert make_kl_groups(examples, group_size, seed, 32) == groups  # fixed per seed: precomputable
    # the grouping is the shared data order's epoch 0
    assert [e["index"] for g in groups for e in g] == du.epoch_permutation(n, seed, 0)[:len(groups) * group_size]


def test_each_epoch_visits_the_micro_batches_in_the_shared_data_order():
    # 10 micro-batches, 3 per step (kto.py's loop: tl.EpochLoop over the micro-batches): 3 steps per epoch, each epoch
    # leaving a different one out
    flags = SimpleNamespace(seed=5, eval_steps=0, num_train_epochs=3.0, max_steps=None, warmup_ratio=0.0,
                            per_device_train_batch_size=2, gradient_accumulation_steps=3)
    loop = tl.EpochLoop(flags, 10, 3, "samples", rows_per_item=2, per_step_time=True)
    assert (loop.steps_per_epoch, loop.total_steps) == (3, 9)
    for step in range(7):
        epoch, position = divmod(step, 3)
        expected = du.epoch_permutation(10, 5, epoch)[3 * position:3 * position + 3]
        assert loop.batch_index(step + 1) == expected
    assert len(set(sum((loop.batch_index(s) for s in range(1, 4)), []))) == 9


def test_mismatched_pairs_need_two_examples_per_batch():
    with pytest.raises(UserError, match=">= 2"):
        make_kl_groups([dict(index=0, prompt_ids=[1], completion_ids=[2])], 1, 0, 8)


def test_paired_data_is_unpaired():
    from datasets import Dataset

    paired = Dataset.from_dict({"prompt": ["p1", "p2"], "chosen": ["good1", "good2"], "rejected": ["bad1", "bad2"]})
    unpaired = to_unpaired(paired, "x")
    assert unpaired.to_dict() == {"prompt": ["p1", "p1", "p2", "p2"], "completion": ["good1", "bad1", "good2", "bad2"],
                                  "label": [True, False, True, False]}
    conversational = Dataset.from_dict({"prompt": [[{"role": "user", "content": "q"}]],
                                        "chosen": [[{"role": "assistant", "content": "a"}]],
                                        "rejected": [[{"role": "assistant", "content": "b"}]]})
    rows = to_unpaired(conversational, "x").to_list()
    assert [r["completion"][0]["content"] for r in rows] == ["a", "b"] and [r["label"] for r in rows] == [True, False]
    with pytest.raises(UserError, match="boolean"):
        to_unpaired(Dataset.from_dict({"prompt": ["p"], "completion": ["c"], "label": [1]}), "x")
    with pytest.raises(UserError, match="completion"):
        to_unpaired(Dataset.from_dict({"prompt": ["p"], "label": [True]}), "x")


def test_loss_weights_follow_the_papers_rule_and_given_weights_win():
    # hand-worked: 18 desirable, 82 undesirable (18%) -> lambda_D = 82 / 18, lambda_U = 1: 82 / 18 * 18 / 82 = 1
    assert loss_weights(18, 82) == pytest.approx((82 / 18, 1.0))
    assert loss_weights(82, 18) == pytest.approx((1.0, 82 / 18))
    assert loss_weights(26, 74) == pytest.approx((74 / 26, 1.0)) and loss_weights(50, 50) == (1.0, 1.0)
    # one weight given: the other balances it (2 * 18 / (w * 82) = 1 -> w = 36 / 82)
    assert loss_weights(18, 82, desirable_weight=2.0) == pytest.approx((2.0, 36 / 82))
    assert loss_weights(18, 82, undesirable_weight=0.5) == pytest.approx((41 / 18, 0.5))
    # explicit weights win, with the warning when outside [1, 4/3]
    assert loss_weights(18, 82, 1.0, 1.0) == (1.0, 1.0) and "outside the recommended" in weight_advice(18, 82, 1.0, 1.0)
    assert loss_weights(26, 74, 3.0, 1.0) == (3.0, 1.0) and weight_advice(26, 74, 3.0, 1.0) is None
    # a class without examples: nothing to balance, and a warning
    assert loss_weights(0, 10) == (1.0, 1.0) and "KTO learns from both" in weight_advice(0, 10, 1.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(n_desirable=st.integers(1, 10**6), n_undesirable=st.integers(1, 10**6))
def test_derived_weights_are_in_the_recommended_range(n_desirable, n_undesirable):
    wd, wu = loss_weights(n_desirable, n_undesirable)
    assert min(wd, wu) == 1.0 and wd * n_desirable / (wu * n_undesirable) == pytest.approx(1.0)
    assert weight_advice(n_desirable, n_undesirable, wd, wu) is None


def test_weight_advice_follows_the_recommended_ratio():
    assert weight_advice(100, 100, 1.0, 1.0) is None and weight_advice(100, 100, 1.3, 1.0) is None
    text = weight_advice(26, 74, 1.0, 1.0)  # the toy task's imbalance
    assert "desirable_weight in [2.85, 3.79]" in text
    assert weight_advice(26, 74, 3.0, 1.0) is None


# ---------------------------------------------------------------------------------------------------------
# Real runs on the toy task
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_run(toy, tmp_path_factory):
    """4 seeded steps with an eval every 2 steps (reused by several tests)."""
    out = str(tmp_path_factory.mktemp("kto") / "base")
    run_script("kto.py", "--output_dir", out, "--max_steps", "4", "--eval_steps", "2", "--seed", "3", *SHORT)
    return out


def test_joint_forward_gives_the_loss_and_gradients_of_two_forwards():
    """Long prompts: each prompt encoded once for its own and mismatched completion (the mismatched ones scored
    without gradient) gives the same loss, metrics and gradients as the two-forward path; a policy equal to the
    reference gives rewards and KL of exactly 0 either way. The choice comes from the flags alone (kto_forwards)."""
    from accelerate import Accelerator
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    import kto
    import policy_common as pc
    from plumbing import prompt_sharing as ps

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                           eos_token_id=1, pad_token_id=0)
    policy = GPTNeoXForCausalLM(config).train()
    reference_model = GPTNeoXForCausalLM(config)
    reference_model.load_state_dict(policy.state_dict())
    rng = random.Random(1)
    group = [dict(prompt_ids=[rng.randrange(2, 40) for _ in range(rng.randrange(20, 30))],
                  completion_ids=[rng.randrange(2, 40) for _ in range(rng.randrange(2, 6))] + [1],
                  label=i % 3 == 0) for i in range(8)]
    for i, e in enumerate(group):
        e["kl_completion_ids"] = group[i - 1]["completion_ids"]
    batch = kto.collate(group, 0)
    T, ctx = batch["query_responses"].shape[1], batch["context_length"]
    flags = dict(max_prompt_length=30, max_length=36, per_device_train_batch_size=8, share_prompts=True,
                 gradient_checkpointing=False, logprob_chunk_tokens=0, beta=0.1, desirable_weight=1.0,
                 undesirable_weight=1.0)

    def forwards(**change):  # the run's forwards from these flags, and whether the policy's shares prompts (joint)
        run_forwards = kto.kto_forwards(kto.Args(**{**flags, **change}), 0)
        return run_forwards, run_forwards.lm(policy).shares_prompts

    assert forwards()[1] and isinstance(forwards()[0].lm(policy), ps.SharedPromptForward)
    for change in (dict(gradient_checkpointing=True), dict(share_prompts=False), dict(max_length=46)):  # no cache kept,
        assert not forwards(**change)[1]  # sharing off, completions > prompts / 2
    args = kto.Args(**flags)
    calls = []  # input shapes of the policy's forwards, and whether each keeps a graph
    policy.register_forward_pre_hook(
        lambda m, a, kw: calls.append((*kw["input_ids"].shape, torch.is_grad_enabled())), with_kwargs=True)
    results = []
    for joint in (True, False):
        calls.clear()
        policy.zero_grad()
        run_forwards, shares = forwards(share_prompts=joint)
        assert shares == joint
        reference = pc.Reference("copy", run_forwards.lm(reference_model), model=reference_model)
        loss, sums = kto.kto_step(policy, run_forwards.lm(policy), reference, batch, args, 0, Accelerator(cpu=True))
        assert abs(sums["rewards/chosen"]) < 1e-5 and abs(sums["kl"]) < 1e-5  # policy == reference (to float rounding)
        # joint: the 8 prompts once, then the 8 mismatched completions without gradient, then the 8 own ones on
        # the prompts' cache; else the two halves in full, the mismatched one without gradient
        assert calls == ([(8, ctx, True), (8, T - ctx, False), (8, T - ctx, True)] if joint
                         else [(8, T, True), (8, T, False)])
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0])
    for name, grad in results[1][1].items():
        torch.testing.assert_close(results[0][1][name], grad, atol=1e-6, rtol=1e-4)


def saved_for_backward_bytes(fn):
    """(fn's result, bytes of the distinct storages autograd keeps for the backward of what fn computes)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), sum(storages.values())


def test_joint_policy_logprobs_equal_the_obvious_rows_and_keep_only_the_own_half_for_the_backward():
    """The policy's joint log-prob sums of both halves equal the obvious one-row-at-a-time computation and the
    two-forward path, the own half's gradients too; the mismatched half gives none, and the forward keeps less for
    the backward than both halves in one forward with gradient (the earlier joint path) or, prompts repeating in
    the micro-batch, a plain forward of the own half alone. The same for a Llama-style model and a LoRA model; a
    model that keeps no cache takes the two-forward path."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    import kto
    import policy_common as pc
    from plumbing import prompt_sharing as ps

    shared, plain_forward = ps.SharedPromptForward(0), pc.Forward(0)  # --share_prompts's forward (joint), the plain one
    torch.manual_seed(0)
    neox = GPTNeoXConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                         eos_token_id=1, pad_token_id=0)
    llama = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                        eos_token_id=1, bos_token_id=1)
    policies = {"neox": GPTNeoXForCausalLM(neox), "llama": LlamaForCausalLM(llama),
                "lora": models.add_lora(GPTNeoXForCausalLM(neox), r=4, alpha=8, dropout=0.0)}
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 40) for _ in range(rng.randrange(20, 30))] for _ in range(3)]
    group = [dict(prompt_ids=prompts[i % 3],  # paired data: a prompt can come twice in one micro-batch
                  completion_ids=[rng.randrange(2, 40) for _ in range(rng.randrange(2, 6))] + [1], label=True)
             for i in range(6)]
    for i, e in enumerate(group):
        e["kl_completion_ids"] = group[i - 1]["completion_ids"]
    batch = kto.collate(group, 0)
    query_responses, ctx = batch["query_responses"], batch["context_length"]
    for name, model in policies.items():
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        joint, saved = saved_for_backward_bytes(
            lambda: kto.policy_logprob_sums(model, shared, query_responses, ctx, 0, True))
        _, earlier_saved = saved_for_backward_bytes(lambda: kto.completion_logprob_sums(
            functools.partial(shared.logprobs, model), query_responses, ctx, 0, joint=True))
        _, own_saved = saved_for_backward_bytes(lambda: plain_forward.logprobs(model, query_responses[:6], ctx))
        assert saved < earlier_saved and saved < own_saved, (name, saved, earlier_saved, own_saved)
        two_forwards = kto.policy_logprob_sums(model, plain_forward, query_responses, ctx, 0, False)
        torch.testing.assert_close(joint, two_forwards, atol=1e-5, rtol=0)
        with torch.no_grad():  # one unpadded row at a time, the pad token without probability (pc.mask_pad_)
            obvious = []
            for key in ("completion_ids", "kl_completion_ids"):
                for e in group:
                    logits = model(input_ids=torch.tensor([e["prompt_ids"] + e[key]])).logits[0, :-1]
                    logprobs = logits[len(e["prompt_ids"]) - 1:].index_fill(-1, torch.tensor([0]), -math.inf)
                    obvious.append(logprobs.log_softmax(-1).gather(-1, torch.tensor(e[key])[:, None]).sum())
        torch.testing.assert_close(joint.detach(), torch.stack(obvious), atol=1e-5, rtol=0)
        own_grads = torch.autograd.grad(joint[:6].sum(), params, retain_graph=True)
        for g, expected in zip(own_grads, torch.autograd.grad(two_forwards[:6].sum(), params)):
            torch.testing.assert_close(g, expected, atol=1e-6, rtol=1e-4)
        assert any(g.abs().sum() > 0 for g in own_grads)
        mismatched_grads = torch.autograd.grad(joint[6:].sum(), params, allow_unused=True)
        assert all(g is None or not g.any() for g in mismatched_grads), name  # no gradient from the mismatched half

    class NoCache(GPTNeoXForCausalLM):  # older custom code: no `cache` argument
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    torch.manual_seed(0)
    plain = NoCache(neox).train()
    torch.testing.assert_close(kto.policy_logprob_sums(plain, shared, query_responses, ctx, 0, True),
                               kto.policy_logprob_sums(plain, plain_forward, query_responses, ctx, 0, False))


def test_run_writes_metrics_and_a_reloadable_model(base_run):
    rows = read_metrics(base_run)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 2, 4]
    for r in train:
        assert all(k in r for k in TRAIN_KEYS) and "time/step_seconds" in r and math.isfinite(r["loss"])
    for r in evals:
        assert all(k in r for k in EVAL_KEYS)
    assert rows[0]["data/dropped"] == 0
    assert (rows[0]["data/desirable_weight"], rows[0]["data/undesirable_weight"]) == (3.0, 1.0)  # the toy's own
    assert evals[0]["eval/rewards/chosen"] == 0.0 and evals[0]["eval/kl"] == 0.0  # policy == reference at start
    assert evals[-1]["eval/rewards/margins"] != 0.0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(base_run, "model"))
    assert model.config.vocab_size > 0


@pytest.fixture(scope="module")
def resumed_run(base_run, tmp_path_factory):
    """The base run again with a checkpoint at step 2, then a resume from that checkpoint for the last 2 steps;
    returns (folder, rows up to step 2 of the first run)."""
    out = str(tmp_path_factory.mktemp("kto") / "resumed")
    common = ["--output_dir", out, "--eval_steps", "2", "--seed", "3", "--max_steps", "4", *SHORT]
    run_script("kto.py", *common, "--save_steps", "2", fresh=True)  # a new interpreter's own hash seed and RNGs
    first_part = [r for r in read_metrics(out) if r["step"] <= 2]
    run_script("kto.py", *common, "--resume_from", os.path.join(out, "checkpoint-2"))
    return out, first_part


def test_same_seed_same_metrics(base_run, resumed_run):
    # two separate processes with seed 3: identical rows (up to time/*) over the steps both ran
    first_part = without_wall_clock(resumed_run[1])
    assert [r["step"] for r in first_part] == [0, 0, 1, 2, 2]
    assert first_part == [r for r in without_wall_clock(read_metrics(base_run)) if r["step"] <= 2]


def test_precomputed_reference_logprobs_equal_on_the_fly(base_run, tmp_path):
    out = str(tmp_path / "pre")
    run_script("kto.py", "--output_dir", out, "--max_steps", "4", "--eval_steps", "2", "--seed", "3",
               "--precompute_ref_logprobs", *SHORT)
    assert_rows_close(without_wall_clock(read_metrics(out)), without_wall_clock(read_metrics(base_run)))


def test_resume_equals_uninterrupted_run(base_run, resumed_run):
    out = resumed_run[0]
    assert_rows_close(without_wall_clock(read_metrics(out)), without_wall_clock(read_metrics(base_run)))
    from safetensors.torch import load_file

    a, b = (load_file(os.path.join(d, "model", "model.safetensors")) for d in (base_run, out))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_peft_run_uses_the_adapter_off_base_as_reference(base_run, tmp_path):
    out = str(tmp_path / "peft")
    run_script("kto.py", "--output_dir", out, "--max_steps", "3", "--seed", "3", "--use_peft",
               "--learning_rate", "1e-3", *SHORT)
    evals = [r for r in read_metrics(out) if "eval/loss" in r]
    start = [r for r in read_metrics(base_run) if "eval/loss" in r][0]
    # at the start the adapter is a no-op: the policy is the base, whose log-probs equal the full run's start
    assert evals[0]["eval/logps/chosen"] == pytest.approx(start["eval/logps/chosen"], rel=1e-5)
    assert evals[0]["eval/rewards/margins"] == 0.0 and evals[-1]["eval/rewards/margins"] != 0.0
    assert os.path.exists(os.path.join(out, "model", "adapter_config.json"))


@pytest.mark.parametrize("rows,message", [
    ([{"prompt": "a b =", "completion": " a b", "label": 1}, {"prompt": "c a =", "completion": " a c", "label": 0}],
     "'label' must be boolean"),
    ([{"prompt": "a b =", "label": True}, {"prompt": "c a =", "label": False}], "missing column(s) ['completion']"),
])
def test_bad_input_exits_without_creating_the_output_folder(toy, tmp_path, rows, message):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    proc = run_script_in_process("kto.py", "--dataset", str(data), "--eval_split", "train", "--output_dir", str(out))
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]  # above it only the datasets progress bars
    assert last.startswith("error: ") and message in last and "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("empty,shards", [("train", None), ("test", 1)])
def test_an_empty_split_stops_with_a_one_line_error(toy, tmp_path, empty, shards):
    # saved with no shard (save_to_disk's default for an empty split, which datasets cannot load) or with one
    from datasets import DatasetDict, load_from_disk

    data = load_from_disk(toy["unpaired_dataset"])
    data = DatasetDict({s: data[s].select([] if s == empty else range(64)) for s in ("train", "test")})
    data.save_to_disk(str(tmp_path / "data"), num_shards=shards and {"train": shards, "test": shards})
    out = tmp_path / "out"
    proc = run_script_in_process("kto.py", "--dataset", str(tmp_path / "data"), "--output_dir", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"split {empty!r} is empty" in last
    assert not out.exists()


@pytest.fixture(scope="module")
def short_model(toy, tmp_path_factory):
    """A tiny GPT-NeoX with only 32 positions (a model this project never saw), saved with the toy tokenizer."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    tokenizer = models.load_tokenizer(toy["policy"])
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=32, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    path = str(tmp_path_factory.mktemp("kto") / "short_model")
    GPTNeoXForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_lengths_and_class_weights_fit_a_model_with_32_positions(short_model, tmp_path):
    out = str(tmp_path / "short")
    proc = run_script("kto.py", "--model", short_model, "--dataset", "toy", "--output_dir", out, "--max_steps", "2",
                      "--gradient_accumulation_steps", "1", "--num_eval_examples", "64", "--num_eval_prompts", "8")
    with open(os.path.join(out, "args.json")) as f:
        args = json.load(f)
    # the defaults (640, the longest prompt, 53) are fitted: toy prompts have up to 7 tokens (6 letters and "=")
    assert (args["max_length"], args["max_prompt_length"], args["response_length"]) == (32, 7, 25)
    assert "--max_length lowered from 640 to 32" in proc.stdout
    assert "--response_length lowered from 53 to 25" in proc.stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "eval/gold_score" in r] == [0, 2]
    # no weights given (not the toy alias): lambda_D n_D = lambda_U n_U from the training data's counts
    n_desirable = rows[0]["data/desirable"]
    n_undesirable = rows[0]["data/train_examples"] - n_desirable
    assert n_desirable < n_undesirable and rows[0]["data/undesirable_weight"] == 1.0
    assert rows[0]["data/desirable_weight"] == pytest.approx(n_undesirable / n_desirable)
    # explicit lengths that cannot fit: a one-line error before anything is written
    for flag, value in (("--max_length", "40"), ("--response_length", "53")):
        failed = tmp_path / flag.strip("-")
        proc = run_script_in_process("kto.py", "--model", short_model, "--dataset", "toy", "--output_dir", str(failed),
                                     flag, value)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {flag} {value} does not fit")
        assert not failed.exists()


# Learning at the toy defaults: tests/test_learning.py (the whole default budget, against the benchmark's band).
