"""The plumbing sft.py, reward.py, dpo.py and kto.py share, against hand-worked examples and slow obvious versions:
du.concatenated_inputs (one batch of prompts with k completions each), du.require_text_or_messages,
du.load_held_out_prompts, tl.fit_lengths (the lengths fitted to the data and the model), tl.process_items,
tl.EpochLoop (steps, data order, schedule, step metrics, evaluation cadence) and tl.gather_in_order."""

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from plumbing import data_utils as du
from plumbing import models
from plumbing import run_utils as ru
from plumbing import train_loop as tl
from plumbing.errors import UserError


# ---------------------------------------------------------------------------------------------------------
# du.concatenated_inputs
# ---------------------------------------------------------------------------------------------------------
def test_concatenated_inputs_by_hand():
    rows = [{"prompt": [5, 6], "chosen": [7], "rejected": [8, 9, 1]},
            {"prompt": [4], "chosen": [3, 1], "rejected": [2]}]
    query_responses, context_length = du.concatenated_inputs(rows, 0)
    assert context_length == 2
    assert query_responses.tolist() == [[5, 6, 7, 0, 0],   # chosen rows first: prompts left-padded,
                                        [0, 4, 3, 1, 0],   # completions right-padded
                                        [5, 6, 8, 9, 1],   # then the rejected rows
                                        [0, 4, 2, 0, 0]]
    one, context_length = du.concatenated_inputs([{"p": [4], "c": [3, 1]}, {"p": [2, 2], "c": [9]}], 0, ("c",), "p")
    assert context_length == 2 and one.tolist() == [[0, 4, 3, 1], [2, 2, 9, 0]]


def slow_concatenated_inputs(rows, pad, completions, prompt):
    """One row at a time: [pad..., prompt, completion, pad...] for each completion key, then each row."""
    width_prompt = max(len(r[prompt]) for r in rows)
    width_completion = max(len(r[key]) for key in completions for r in rows)
    out = []
    for key in completions:
        for r in rows:
            left = [pad] * (width_prompt - len(r[prompt]))
            right = [pad] * (width_completion - len(r[key]))
            out.append(left + r[prompt] + r[key] + right)
    return out, width_prompt


@pytest.mark.parametrize("keys", [("a",), ("a", "b"), ("a", "b", "c")])
def test_concatenated_inputs_equal_the_slow_version(keys):
    rng = random.Random(len(keys))
    for _ in range(20):
        rows = [{"prompt_ids": [rng.randrange(1, 50) for _ in range(rng.randint(1, 6))],
                 **{k: [rng.randrange(1, 50) for _ in range(rng.randint(1, 5))] for k in keys}}
                for _ in range(rng.randint(1, 5))]
        query_responses, context_length = du.concatenated_inputs(rows, 0, keys, prompt="prompt_ids")
        expected, expected_length = slow_concatenated_inputs(rows, 0, keys, "prompt_ids")
        assert query_responses.dtype == torch.long and query_responses.tolist() == expected
        assert context_length == expected_length


# ---------------------------------------------------------------------------------------------------------
# du.require_text_or_messages and du.load_held_out_prompts
# ---------------------------------------------------------------------------------------------------------
def test_require_text_or_messages_names_the_first_bad_value():
    messages = [{"role": "user", "content": "hi"}]
    du.require_text_or_messages({"prompt": "a b =", "chosen": messages, "rejected": " b"}, "pairs", 3)  # all fine
    with pytest.raises(UserError, match=r"^dataset 'pairs' row 3 column 'chosen': expected text or a list of "
                                        r"\{role, content\} messages, got int$"):
        du.require_text_or_messages({"prompt": "a b =", "chosen": 5, "rejected": None}, "pairs", 3)
    with pytest.raises(UserError, match="column 'prompt'.*got list"):
        du.require_text_or_messages({"prompt": ["not", "messages"]}, "x", 0)


def test_load_held_out_prompts(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "other": i}) + "\n" for i in range(5)))
    assert du.load_held_out_prompts(str(data), "train", 0) == []
    assert du.load_held_out_prompts(str(data), "train", 3) == ["p0", "p1", "p2"]
    assert du.load_held_out_prompts(str(data), "train", 9) == [f"p{i}" for i in range(5)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(UserError, match="missing column"):
        du.load_held_out_prompts(str(bad), "train", 2)


# ---------------------------------------------------------------------------------------------------------
# tl.fit_lengths
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy_tokenizer(toy):
    return models.load_tokenizer(toy["policy"])


def flags(**values):
    return SimpleNamespace(**{"max_length": 640, "max_prompt_length": None, "response_length": 53,
                              "trust_remote_code": False, "given_flags": frozenset(), **values})


def test_fit_lengths_from_the_data_and_the_model(toy_tokenizer, monkeypatch):
    monkeypatch.setattr(tl.ru, "model_positions", lambda path, trust_remote_code=False: 32)

    def ids(text):
        return toy_tokenizer(text, add_special_tokens=False)["input_ids"]

    prompts, held_out = ["c a b =", "f e d c b a =", 5], ["k j =", "a b c d e f g h i ="]  # 5: skipped
    args = flags()
    queries = tl.fit_lengths(args, toy_tokenizer, "any", prompts, held_out)
    longest = max(len(ids(p)) for p in [*prompts[:2], *held_out])  # the longest prompt, held-out ones included
    assert (args.max_length, args.max_prompt_length) == (32, longest)
    assert queries == [ids(p) for p in held_out]
    assert args.response_length == 32 - max(len(q) for q in queries)  # what the longest held-out prompt leaves

    # given values that fit are kept; with cut_held_out (kto.py) held-out prompts keep their last tokens and the
    # completions fit after --max_prompt_length
    args = flags(max_length=20, max_prompt_length=3, response_length=8)
    queries = tl.fit_lengths(args, toy_tokenizer, "any", prompts, held_out, cut_held_out=True)
    assert queries == [ids(p)[-3:] for p in held_out] and (args.max_length, args.response_length) == (20, 8)
    args = flags(max_prompt_length=3, response_length=53)
    tl.fit_lengths(args, toy_tokenizer, "any", prompts, [], cut_held_out=True)
    assert args.response_length == 32 - 3
    # without cutting, a longer held-out prompt is refused; no held-out prompts (reward.py): no --response_length
    with pytest.raises(UserError, match="more than --max_prompt_length 3"):
        tl.fit_lengths(flags(max_prompt_length=3), toy_tokenizer, "any", prompts, held_out)
    args = SimpleNamespace(max_length=640, max_prompt_length=None, trust_remote_code=False, given_flags=frozenset())
    assert tl.fit_lengths(args, toy_tokenizer, "any", prompts) == []
    assert args.max_prompt_length == max(len(ids(p)) for p in prompts[:2])
    # a given --max_length the model cannot hold is an error; a prompt limit that leaves no completion is lowered
    with pytest.raises(UserError, match="--max_length 40 does not fit"):
        tl.fit_lengths(flags(max_length=40, given_flags=frozenset({"max_length"})), toy_tokenizer, "any", prompts)
    args = flags(max_length=8, max_prompt_length=9)
    tl.fit_lengths(args, toy_tokenizer, "any", prompts)
    assert args.max_prompt_length == 7


def test_fit_lengths_renders_messages_with_their_tools(monkeypatch):
    """Each prompt is measured as render_prompt renders it (with its tools); a model without a limit limits nothing."""
    monkeypatch.setattr(tl.ru, "model_positions", lambda path, trust_remote_code=False: None)
    seen = []

    class Tokenizer:
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [list(range(len(text))) for text in texts]}

    monkeypatch.setattr(du, "render_prompt", lambda tokenizer, prompt, tools=None: seen.append(tools) or
                        ("x" * len(prompt) + "t" * len(tools or [])))
    args = flags(response_length=500)
    tl.fit_lengths(args, Tokenizer(), "any", [[{"role": "user", "content": "a"}], "abc"], tools=[["f", "g"], None])
    assert args.max_prompt_length == 3 and args.max_length == 640 and args.response_length == 500
    assert ["f", "g"] in seen and None in seen


# ---------------------------------------------------------------------------------------------------------
# tl.process_items and tl.EpochLoop
# ---------------------------------------------------------------------------------------------------------
def test_process_items_by_hand():
    batch_index = list(range(100, 112))  # 2 processes x 3 accumulation steps x 2 items
    shares = [tl.process_items(batch_index, SimpleNamespace(num_processes=2, process_index=p,
                                                            gradient_accumulation_steps=3)) for p in range(2)]
    assert shares[1] == [102, 103, 106, 107, 110, 111]
    assert [i for m in range(3) for p in range(2) for i in shares[p][2 * m:2 * m + 2]] == batch_index  # (m, p)
    one = SimpleNamespace(num_processes=1, process_index=0, gradient_accumulation_steps=1)
    assert tl.process_items(batch_index, one) == batch_index


def epoch_flags(**values):
    return SimpleNamespace(**{"seed": 3, "eval_steps": 4, "num_train_epochs": 2.5, "max_steps": None,
                              "warmup_ratio": 0.1, "per_device_train_batch_size": 2,
                              "gradient_accumulation_steps": 2, **values})


def test_epoch_loop_steps_and_data_order():
    loop = tl.EpochLoop(epoch_flags(), num_items=23, batch_size=4, unit="pairs")
    assert (loop.steps_per_epoch, loop.total_steps, loop.warmup_steps) == (5, 12, 2)  # 23 // 4; int(2.5 x 5); ceil
    assert list(loop.steps(0)) == list(range(1, 13)) and list(loop.steps(7)) == [8, 9, 10, 11, 12]
    # the obvious loop the scripts ran: a new permutation at each epoch's start, the next batch_size items per step
    for step in range(1, 13):
        epoch, position = divmod(step - 1, 5)
        assert loop.batch_index(step) == du.epoch_permutation(23, 3, epoch)[4 * position:4 * position + 4]
    first_epoch = [i for step in range(1, 6) for i in loop.batch_index(step)]
    assert len(set(first_epoch)) == 20  # each epoch: 5 disjoint batches, 3 items left out
    assert loop.batch_index(3) == du.epoch_permutation(23, 3, 0)[8:12]  # any order of calls: a step's items are fixed
    assert tl.EpochLoop(epoch_flags(max_steps=7), 23, 4, "pairs").total_steps == 7
    assert tl.EpochLoop(epoch_flags(num_train_epochs=0.01), 23, 4, "pairs").total_steps == 1
    with pytest.raises(UserError, match="3 training pairs are fewer than one batch of 4"):
        tl.EpochLoop(epoch_flags(), 3, 4, "pairs")


def test_epoch_loop_schedule_metrics_and_evaluations():
    loop = tl.EpochLoop(epoch_flags(), num_items=23, batch_size=4, unit="pairs")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    scheduler = loop.scheduler(optimizer)
    rates = []
    for _ in range(12):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    # by hand: warmup 0, 1/2 of the peak over 2 steps, then linear decay to 0 at step 12
    expected = [0.5 * s / 2 if s < 2 else 0.5 * (12 - s) / 10 for s in range(12)]
    assert rates == pytest.approx(expected)
    assert [s for s in range(1, 13) if loop.evaluate_now(s)] == [4, 8, 12]
    assert [s for s in range(1, 13) if tl.EpochLoop(epoch_flags(eval_steps=0), 23, 4, "pairs").evaluate_now(s)] == [12]

    optimizer_step = SimpleNamespace(lr=0.25, skipped=1, metrics=lambda: {"lr": 0.25})  # OptimizerStep's float32 view
    steps = loop.steps(2)
    step = next(steps)
    metrics = loop.metrics(step, optimizer_step)
    assert list(metrics) == ["lr", "epoch", "nonfinite/skipped", "time/elapsed", "time/pairs_per_second"]
    assert (metrics["lr"], metrics["epoch"], metrics["nonfinite/skipped"]) == (0.25, 3 / 5, 1)
    assert metrics["time/pairs_per_second"] == pytest.approx(4 / metrics["time/elapsed"])
    per_step = tl.EpochLoop(epoch_flags(), 23, 4, "samples", rows_per_item=32, per_step_time=True)
    step = next(per_step.steps(0))
    metrics = per_step.metrics(step, optimizer_step)
    assert list(metrics) == ["lr", "epoch", "nonfinite/skipped", "time/step_seconds", "time/samples_per_second"]
    assert metrics["time/samples_per_second"] == pytest.approx(4 * 32 / metrics["time/step_seconds"])
    assert math.isfinite(metrics["epoch"])


# ---------------------------------------------------------------------------------------------------------
# tl.gather_in_order
# ---------------------------------------------------------------------------------------------------------
class Ranks:
    """Process `rank` of `world` simulated in one: gather returns every process's rows, each computed on its own
    even share (as accelerate's gather: process 0's rows, then process 1's, ...)."""

    def __init__(self, world, rank, items, compute):
        self.num_processes, self.process_index, self.items, self.compute = world, rank, items, compute

    def gather(self, tensor):
        shares = [ru.even_share(self.items, SimpleNamespace(num_processes=self.num_processes, process_index=p))[0]
                  for p in range(self.num_processes)]
        assert torch.equal(tensor, self.compute(shares[self.process_index]))
        return torch.cat([self.compute(share) for share in shares])


@pytest.mark.parametrize("world,n", [(1, 5), (2, 5), (3, 7), (4, 4), (3, 2)])
def test_gather_in_order_returns_every_item_in_order(world, n):
    items = [10 * i for i in range(n)]

    def compute(share):  # one row per item: the item and its square
        return torch.tensor([[item, item * item] for item in share])

    obvious = torch.tensor([[item, item * item] for item in items])
    for rank in range(world):
        assert torch.equal(tl.gather_in_order(items, compute, Ranks(world, rank, items, compute)), obvious)
