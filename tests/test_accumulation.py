"""plumbing/accumulation.py: micro-batches sized by --token_budget. The split by hand and as a property; the step's
gradient over unequal micro-batches against one backward over every row (a loss that is a mean over rows, a mean over
tokens, or normalised by the step's totals), on one process and on two (DDP, each process a different split, one
count); and each script's numbers with --token_budget against the same step in one micro-batch."""

import argparse
import random
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    TWO_PROCESS_RLOO,
    assert_same_numbers,
    read_metrics,
    run_distributed,
    run_script,
    run_two_processes,
    tiny_args,
    worker_accelerator,
)
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from plumbing import accumulation as acc
from plumbing.errors import UserError

PAD, VOCAB = 0, 24


# ---------------------------------------------------------------------------------------------------------- the split
def test_budget_groups_by_hand():
    # first-fit decreasing at 6 tokens: 5 -> bin 0, 3 and 3 -> bin 1, 2 -> bin 2, 1 -> bin 0 (its room of 1)
    assert acc.budget_groups([5, 3, 3, 2, 1], 6) == [[0, 4], [1, 2], [3]]
    assert acc.budget_groups([10, 2], 4) == [[0], [1]]  # longer than the budget: a bin of its own
    # count 3 from one bin of four: halved (alternately: [0, 2], [1, 3]), then the heavier-or-first halved again
    assert acc.budget_groups([1, 1, 1, 1], 10, count=3) == [[1, 3], [0], [2]]
    with pytest.raises(ValueError, match="cannot make 3"):
        acc.budget_groups([9, 9], 4, count=3)


def test_budget_groups_property():
    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget, count = rng.randint(1, 120), rng.randint(0, 6)
        groups = acc.budget_groups(lengths, budget, min(count, len(lengths)))
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every item once
        assert all(g == sorted(g) and g for g in groups)
        assert all(sum(lengths[i] for i in g) <= budget or len(g) == 1 for g in groups)
        assert len(groups) >= min(count, len(lengths))
        weights = [sum(lengths[i] for i in g) for g in groups]
        assert weights == sorted(weights, reverse=True)


# -------------------------------------------------------------------------------------------- the step's gradient
def tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=PAD, eos_token_id=1, bos_token_id=1))


def rows_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g) for n in lengths]


def row_nll(model, row):
    """(n - 1,) next-token losses of one row, alone (no padding): the independent computation."""
    logits = model(row[None]).logits[0, :-1]
    return F.cross_entropy(logits, row[1:], reduction="none")


def padded_nll(model, rows):
    """Per-row token losses of a right-padded micro-batch, (b, T - 1), and the mask of real targets."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    mask = ids != PAD
    logits = model(ids, attention_mask=mask.long()).logits[:, :-1]
    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return nll, mask[:, 1:]


def budgeted_step(model, accelerator, rows, budget, kind):
    """One step over `rows` in micro-batches of at most `budget` tokens; kind "rows": the loss is the mean over rows of
    each row's token mean (mean_over "rows"); "tokens": the micro-batch's token mean (mean_over its rows' loss tokens);
    "totals": the micro-batch's token sum / the step's loss tokens per micro-batch, normalised by the step's totals
    (mean_over None). Returns (micro-batch sizes, the step's loss as logged)."""
    loss_tokens = torch.tensor([len(r) - 1 for r in rows])
    mean_over = {"rows": "rows", "tokens": loss_tokens, "totals": None}[kind]
    micro_batches = acc.micro_batches(argparse.Namespace(token_budget=budget), accelerator, model)
    assert isinstance(micro_batches, acc.TokenBudget)
    tokens_per_micro_batch = loss_tokens.sum() / accelerator.gradient_accumulation_steps
    logged = []
    for mb in micro_batches.split(torch.arange(len(rows)), [len(r) for r in rows], mean_over=mean_over):
        with micro_batches.accumulate():
            nll, mask = padded_nll(model, [rows[i] for i in mb.tolist()])
            if kind == "rows":
                loss = ((nll * mask).sum(1) / mask.sum(1)).mean()
            elif kind == "tokens":
                loss = (nll * mask).sum() / mask.sum()
            else:
                loss = (nll * mask).sum() / tokens_per_micro_batch
            logged.append(micro_batches.backward(loss))
    return [len(mb) for mb in micro_batches.batches], torch.stack(logged).mean()


@pytest.mark.parametrize("kind", ["rows", "tokens", "totals"])
def test_unequal_micro_batches_give_the_step_gradient(kind):
    from accelerate import Accelerator

    lengths = [12, 3, 9, 4, 15, 2, 6, 5]
    rows = rows_of(lengths)
    model = tiny_model(1).train()
    nll = [row_nll(model, r) for r in rows]
    if kind == "rows":  # by hand: each row alone, its token mean, their mean
        expected = torch.stack([x.mean() for x in nll]).mean()
    else:  # the step's token mean (normalised per micro-batch, or by the step's totals)
        expected = torch.cat(nll).mean()
    expected.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    try:
        sizes, logged = budgeted_step(model, accelerator, rows, 20, kind)
    finally:
        Accelerator(cpu=True)  # accelerate's gradient state is shared by the process: leave it as found
    assert len(set(sizes)) > 1 and len(sizes) != 4  # unequal, and not the accumulation steps' count
    assert logged.item() == pytest.approx(expected.item(), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


def grpo_loss_of(loss_type: str):
    """grpo.py's loss (GRPOLoss) of `loss_type`, on-policy settings (no clipping at a ratio of 1, no KL, no masks)."""
    from grpo import GRPOLoss

    return GRPOLoss(loss_type=loss_type, importance_sampling_level="token", epsilon=0.2, epsilon_high=0.2,
                    use_bias_correction_kl=False, off_policy_mask_threshold=None, top_entropy_quantile=1.0,
                    response_length=16)


def grpo_step_under_a_budget(model, rows, grpo_loss, gradient_accumulation_steps, loss_of):
    """One step of `grpo_loss` over `rows` in micro-batches of at most 20 tokens, each weighted by what the loss means
    over (GRPOLoss.mean_over the step's loss mask, as sample_batch's); loss_of(micro_batches, index) -> the loss of the
    micro-batch of rows `index`. Returns (the micro-batches, as lists of rows; the step's loss as logged)."""
    from accelerate import Accelerator

    lengths = torch.tensor([len(r) - 1 for r in rows])
    loss_mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]  # (rows, T - 1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gradient_accumulation_steps)
    try:
        micro_batches = acc.micro_batches(argparse.Namespace(token_budget=20), accelerator, model)
        logged = []
        for mb in micro_batches.split(torch.arange(len(rows)), [len(r) for r in rows],
                                      mean_over=grpo_loss.mean_over(loss_mask)):
            with micro_batches.accumulate():
                logged.append(micro_batches.backward(loss_of(micro_batches, mb)))
    finally:
        Accelerator(cpu=True)
    return [mb.tolist() for mb in micro_batches.batches], torch.stack(logged).mean()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_loss_types_give_the_step_gradient_under_a_budget(loss_type):
    """grpo.py's loss (GRPOLoss, on-policy: REINFORCE) over unequal micro-batches, each weighted by what the loss type
    means over (GRPOLoss.mean_over: rows, loss tokens, or nothing for dapo's step-normalised sum): the gradient and
    logged loss of the whole batch in one micro-batch."""
    rows = rows_of([12, 3, 9, 4, 15, 2, 6, 5], seed=3)
    advantages = torch.tensor([1.5, -0.5, 0.8, -1.2, 0.3, 2.0, -0.7, 0.1])
    grpo_loss = grpo_loss_of(loss_type)

    def loss_of(model, index, tokens_per_micro_batch):  # the micro-batch of rows `index`
        nll, mask = padded_nll(model, [rows[i] for i in index.tolist()])
        new_logprobs = -nll
        return grpo_loss(new_logprobs, None, new_logprobs.detach(), None, None, advantages[index], mask, None,
                         beta=0.0, entropy_coef=None, tokens_per_micro_batch=tokens_per_micro_batch)[0]

    model = tiny_model(4).train()
    total_tokens = sum(len(r) - 1 for r in rows)
    expected = loss_of(model, torch.arange(len(rows)), total_tokens)  # one micro-batch on one process
    expected.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    batches, logged = grpo_step_under_a_budget(model, rows, grpo_loss, 4,
                                               lambda _, mb: loss_of(model, mb, total_tokens / 4))
    assert len(set(map(len, batches))) > 1 and len(batches) != 4
    assert logged.item() == pytest.approx(expected.item(), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_grpo_entropy_bonus_under_a_budget_is_the_micro_batches_mean(loss_type):
    """Issue 63: grpo.py's entropy bonus (entropy_coef x a micro-batch's token mean) beside dapo's loss, normalised by
    the step's totals, entered the step times (micro-batches / gradient_accumulation_steps): x4 at GA 1 with 4
    micro-batches. With MicroBatches.mean_term it is the mean of the micro-batches' token means, as accelerate's equal
    micro-batches give it; beside bnpo (token shares) the step's token mean. Advantages of 0: the bonus alone."""
    rows = rows_of([12, 3, 9, 4, 15, 2, 6, 5], seed=5)
    grpo_loss, coef = grpo_loss_of(loss_type), 0.1
    total_tokens = float(sum(len(r) - 1 for r in rows))  # per micro-batch at gradient_accumulation_steps 1
    model = tiny_model(6).train()

    def loss_of(micro_batches, index):
        nll, mask = padded_nll(model, [rows[i] for i in index.tolist()])  # the "entropy": any per-token term
        return grpo_loss(-nll.detach(), nll, -nll.detach(), None, None, torch.zeros(len(index)), mask, None,
                         beta=0.0, entropy_coef=micro_batches.mean_term(coef), tokens_per_micro_batch=total_tokens)[0]

    batches, logged = grpo_step_under_a_budget(model, rows, grpo_loss, 1, loss_of)
    assert len(batches) > 1  # != gradient_accumulation_steps (1): the case that was off
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    means = [torch.cat([row_nll(model, rows[i]) for i in mb]).mean() for mb in batches]  # each alone, unpadded
    if loss_type == "dapo":
        expected = -coef * torch.stack(means).mean()
    else:
        expected = -coef * torch.cat([row_nll(model, r) for r in rows]).mean()
    expected.backward()
    assert logged.item() == pytest.approx(expected.item(), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_without_a_budget_the_slices_are_accelerates():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    try:
        micro_batches = acc.micro_batches(argparse.Namespace(token_budget=None), accelerator, None)
        assert type(micro_batches) is acc.MicroBatches
        micro_batches.split(torch.arange(12), None, mean_over=torch.arange(12))
        assert [mb.tolist() for mb in micro_batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        assert micro_batches.weight() == pytest.approx(1 / 3)  # equal micro-batches: accelerate's weight
        value = torch.tensor(2.5, requires_grad=True)
        assert micro_batches.logged(value).item() == 2.5 and not micro_batches.logged(value).requires_grad
        listed = acc.micro_batches(argparse.Namespace(token_budget=3), accelerator, None)  # of lists
        listed.split(list("abcdef"), dict.fromkeys("abcdef", 1))
        assert sorted(x for mb in listed for x in mb) == list("abcdef") and len(listed) == 2
    finally:
        Accelerator(cpu=True)


def _two_process_worker(rank, port, results):
    with worker_accelerator(rank, port, gradient_accumulation_steps=2) as accelerator:
        # process 0's rows are long (many micro-batches at the budget), process 1's short (fewer alone)
        lengths = [[14, 12, 13, 11, 15, 10], [3, 2, 4, 3, 2, 5]][rank]
        rows = rows_of(lengths, seed=rank)
        model = accelerator.prepare(tiny_model(2).train())
        sizes, logged = budgeted_step(model, accelerator, rows, 28, "rows")
        alone = len(acc.budget_groups(lengths, 28))
        results[rank] = (sizes, alone, logged.item(),
                         {n: p.grad.clone() for n, p in model.module.named_parameters()})


def test_two_processes_agree_on_a_count_and_give_the_global_gradient():
    (sizes0, alone0, logged0, grads0), (sizes1, alone1, logged1, grads1) = run_two_processes(_two_process_worker)
    assert len(sizes0) == len(sizes1) == max(alone0, alone1) and alone0 != alone1  # process 1 split further
    # by hand: the mean over all 12 rows (DDP averages the two processes' means), each row alone
    model = tiny_model(2).train()
    rows = rows_of([14, 12, 13, 11, 15, 10], seed=0) + rows_of([3, 2, 4, 3, 2, 5], seed=1)
    expected = torch.stack([row_nll(model, r).mean() for r in rows]).mean()
    expected.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads0[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(grads1[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert (logged0 + logged1) / 2 == pytest.approx(expected.item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------- scripts
BUDGET_METRICS = {  # a step's numbers that the loss's weighting feeds (unweighted micro-batch statistics aside)
    "rloo.py": (150, ["objective/scores", "objective/kl", "loss/policy", "objective/entropy"]),
    "grpo.py": (150, ["objective/scores", "loss/policy", "objective/entropy"]),
    "ppo.py": (150, ["objective/scores", "loss/value", "loss/policy"]),
    "distill.py": (150, ["loss/distill", "objective/entropy"]),
    "dpo.py": (150, ["loss", "grad_norm", "rewards/margins"]),  # accuracies: ties at policy = reference
    "sft.py": (60, ["loss", "token_accuracy"]), "reward.py": (150, ["loss", "accuracy", "grad_norm"])}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(BUDGET_METRICS))
def test_every_script_gives_the_same_numbers_with_a_token_budget(script, tmp_path, toy, shared_run):
    """The tiny run of each script on the toy (conftest.tiny_args: 2 steps): one micro-batch a step (the run shared
    with test_smoke.py), or unequal ones within --token_budget."""
    budget, keys = BUDGET_METRICS[script]
    # ppo: one mini-batch a step (its logged losses pool micro-batches: over mini-batches split into unequal counts,
    # that mean weighs each mini-batch by its count)
    batch = ["--num_mini_batches", "1", "--per_device_train_batch_size", "64"] if script == "ppo.py" else []
    _, one = shared_run(script, *tiny_args(script), *batch)
    out = str(tmp_path / "budget")
    proc = run_script(script, *tiny_args(script), *batch, "--token_budget", str(budget), "--padding_free",
                      "--output_dir", out)
    split = re.search(r"--token_budget \d+: the first step's (\d+) rows per process in (\d+) micro-batches "
                      r"of (\d+)-(\d+)", proc.stdout)
    assert split and int(split[2]) > 1 and split[3] != split[4], proc.stdout  # several, unequal
    rows = {mode: {r["step"]: r for r in read_metrics(folder)} for mode, folder in (("one", one), ("budget", out))}
    keys = keys + [k for k in rows["one"][2] if k.startswith("eval/")]
    assert_same_numbers(rows["budget"], rows["one"], (1, 2), keys, script)


@pytest.mark.slow
def test_two_processes_with_a_token_budget(tmp_path, toy, shared_run):
    """rloo on 2 processes (DDP over gloo), a micro-batch a step (the run shared with test_packing.py) against
    --token_budget's unequal ones."""
    _, one = shared_run("rloo.py", *TWO_PROCESS_RLOO, processes=2)
    out = str(tmp_path / "budget")
    run_distributed("rloo.py", *TWO_PROCESS_RLOO, "--token_budget", "150", "--output_dir", out)
    rows = {mode: {r["step"]: r for r in read_metrics(folder)} for mode, folder in (("one", one), ("budget", out))}
    for key in ("loss/policy", "objective/kl", "objective/entropy", "objective/scores"):
        assert rows["budget"][2][key] == pytest.approx(rows["one"][2][key], rel=1e-4, abs=1e-5), key


# ------------------------------------------------------------------------------------------------------ bad input
def test_kto_and_deepspeed_refuse_a_budget(monkeypatch):
    import kto
    from plumbing import run_utils as ru

    with pytest.raises(UserError, match="--token_budget"):
        kto.validate(ru.parse_args(kto.Args, kto.ALIAS_DEFAULTS, ["--token_budget", "100"]))
    with pytest.raises(UserError, match="--token_budget must be > 0"):
        ru.parse_args(kto.Args, kto.ALIAS_DEFAULTS, ["--token_budget", "0"])
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(UserError, match="DeepSpeed"):
        ru.parse_args(kto.Args, kto.ALIAS_DEFAULTS, ["--token_budget", "100"])
