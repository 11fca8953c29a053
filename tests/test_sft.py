"""sft.py: the loss against slow per-token sums (prompt tokens and padding carry none), its normalisation over
accumulated micro-batches, the data rules, and short real runs on the toy task (learning, resume, bad input)."""

import argparse
import json
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import read_metrics, run_script, run_script_in_process, without_wall_clock
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

import policy_common as pc
from plumbing import accumulation as acc
from plumbing import data_utils as du
from plumbing import models
from plumbing import run_utils as ru
from plumbing.errors import UserError
from sft import (
    Args,
    accumulate_gradients,
    completion_token_stats,
    prompt_completion_pairs,
    sft_loss,
    tokenize_demonstrations,
    toy_demonstrations,
    validate,
)

PAD, EOS, VOCAB = 0, 1, 24
FORWARD = pc.Forward(PAD)  # the plain forward (no --padding_free, --logprob_chunk_tokens 0)
REQUIRED = ["loss", "token_accuracy", "num_tokens", "grad_norm", "lr", "epoch"]


# ---------------------------------------------------------------------------------------------------------
# The loss on a hand-built batch, against one-row-at-a-time forwards
# ---------------------------------------------------------------------------------------------------------
def tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, rotary_pct=0.25, tie_word_embeddings=False, hidden_dropout=0.0,
        attention_dropout=0.0, eos_token_id=EOS, bos_token_id=EOS, pad_token_id=PAD))


def hand_rows(lengths, seed=0):
    """Rows of random prompt / completion ids (no PAD among them; completions end with EOS)."""
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": torch.randint(2, VOCAB, (p,), generator=g).tolist(),
             "completion": torch.randint(2, VOCAB, (c - 1,), generator=g).tolist() + [EOS],
             "completion_mask": [True] * c}
            for p, c in lengths]


def slow_token_nll(model, row):
    """-log p(token) for each completion token, from an unpadded forward of that row alone."""
    ids = torch.tensor([row["prompt"] + row["completion"]])
    logprobs = F.log_softmax(model(ids).logits[0].double(), -1)
    start = len(row["prompt"])
    return [-logprobs[t - 1, ids[0, t]].item() for t in range(start, ids.shape[1])]


class PromptPositionNoise(nn.Module):
    """The model, with huge random logits at every position that predicts a prompt token (or left padding): the
    positions before the last prompt token. A loss that reads any of them changes."""

    def __init__(self, model, context_length):
        super().__init__()
        self.model, self.context_length = model, context_length

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        noise = 1e3 * torch.randn_like(out.logits[:, :self.context_length - 1])
        out.logits = torch.cat([noise, out.logits[:, self.context_length - 1:]], 1)
        return out


def test_loss_is_over_completion_tokens_only_and_padding_changes_nothing():
    model = tiny_model().eval()
    rows = hand_rows([(3, 4), (5, 1), (1, 6), (4, 3)])
    with torch.no_grad():
        token_nll, correct, mask = completion_token_stats(model, FORWARD, rows, PAD, "cpu")
        slow = [slow_token_nll(model, row) for row in rows]
    assert mask.sum(1).tolist() == [4, 1, 6, 3]  # the completion tokens (EOS included), nothing of the prompt
    for i, expected in enumerate(slow):
        assert token_nll[i, :len(expected)].tolist() == pytest.approx(expected, abs=1e-4)
    n = sum(len(s) for s in slow)
    loss = sft_loss(token_nll, mask, float(n))
    assert loss.item() == pytest.approx(sum(map(sum, slow)) / n, abs=1e-5)

    # a loss that also counted the prompt tokens would differ by far
    with torch.no_grad():
        with_prompt = [sum(slow_token_nll(model, {"prompt": r["prompt"][:1], "completion": r["prompt"][1:] +
                                                  r["completion"]})) for r in rows]
    assert sum(with_prompt) / sum(len(r["prompt"]) - 1 + len(r["completion"]) for r in rows) != \
        pytest.approx(loss.item(), abs=1e-2)

    # whatever the model predicts at the prompt positions, the loss is the same
    context_length = max(len(r["prompt"]) for r in rows)
    with torch.no_grad():
        noisy_nll, _, _ = completion_token_stats(PromptPositionNoise(model, context_length), FORWARD, rows, PAD,
                                                    "cpu")
    assert sft_loss(noisy_nll, mask, float(n)).item() == pytest.approx(loss.item(), abs=1e-5)

    # padding: the same rows beside a row with a longer prompt and completion (more padding on both sides)
    with torch.no_grad():
        padded_nll, padded_correct, padded_mask = completion_token_stats(model, FORWARD, rows + hand_rows([(9, 8)], 1),
                                                                         PAD, "cpu")
    for i, expected in enumerate(slow):
        assert padded_nll[i, :len(expected)].tolist() == pytest.approx(expected, abs=1e-4)
        assert padded_mask[i].sum().item() == len(expected)
        assert padded_correct[i].sum().item() == correct[i].sum().item()
    assert sft_loss(padded_nll[:4], padded_mask[:4], float(n)).item() == pytest.approx(loss.item(), abs=1e-5)


def test_token_accuracy_counts_argmax_hits_on_completion_tokens():
    model = tiny_model().eval()
    rows = hand_rows([(2, 3), (4, 5)])
    with torch.no_grad():
        _, correct, mask = completion_token_stats(model, FORWARD, rows, PAD, "cpu")
        for i, row in enumerate(rows):
            ids = torch.tensor([row["prompt"] + row["completion"]])
            predicted = model(ids).logits[0, len(row["prompt"]) - 1:-1].argmax(-1)
            hits = (predicted == torch.tensor(row["completion"])).tolist()
            assert correct[i, :len(hits)].tolist() == hits and not correct[i, len(hits):].any()
    assert (correct <= mask).all()


# ---------------------------------------------------------------------------------------------------------
# Normalisation: a token mean over the whole accumulated batch
# ---------------------------------------------------------------------------------------------------------
def step_gradients(rows, accumulation_steps, micro_batch_size):
    from accelerate import Accelerator

    model = tiny_model(1).train()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation_steps)
    assert len(rows) == accumulation_steps * micro_batch_size  # one process: micro-batches of the step's rows
    micro_batches = acc.micro_batches(argparse.Namespace(token_budget=None), accelerator, model)
    sums, num_tokens = accumulate_gradients(model, FORWARD, accelerator, micro_batches, rows, list(range(len(rows))),
                                            PAD)
    Accelerator(cpu=True)  # accelerate's gradient state is shared by the process: leave it as found
    return {n: p.grad.clone() for n, p in model.named_parameters()}, sums, num_tokens


def test_loss_is_a_token_mean_over_the_accumulated_batch():
    # completions of very different lengths, so that a mean of micro-batch means would weigh tokens unequally
    rows = hand_rows([(3, 1), (2, 7), (4, 2), (1, 6), (5, 1), (2, 1)], seed=3)
    counts = [len(r["completion"]) for r in rows]
    # by hand: one model, every completion token of the six rows, sum / count
    model = tiny_model(1).train()
    total = sum(-F.log_softmax(model(torch.tensor([r["prompt"] + r["completion"]])).logits[0], -1)[
        len(r["prompt"]) - 1 + t, c] for r in rows for t, c in enumerate(r["completion"]))
    expected = total / sum(counts)
    expected.backward()
    by_hand = {n: p.grad.clone() for n, p in model.named_parameters()}

    # the other normalisation, a mean of the three micro-batches' token means, gives another gradient
    model.zero_grad()
    token_nll = [[-F.log_softmax(model(torch.tensor([r["prompt"] + r["completion"]])).logits[0], -1)[
        len(r["prompt"]) - 1 + t, c] for t, c in enumerate(r["completion"])] for r in rows]
    (sum(sum(map(sum, token_nll[i:i + 2])) / sum(counts[i:i + 2]) for i in range(0, 6, 2)) / 3).backward()
    other = torch.cat([p.grad.flatten() for p in model.parameters()])
    hand = torch.cat([g.flatten() for g in by_hand.values()])
    assert (other - hand).norm() > 0.2 * hand.norm()

    for accumulation_steps, micro_batch_size in ((3, 2), (1, 6), (6, 1)):
        grads, sums, num_tokens = step_gradients(rows, accumulation_steps, micro_batch_size)
        assert num_tokens == sum(counts)
        assert sums["loss"] == pytest.approx(expected.item(), abs=1e-5), accumulation_steps
        for name, g in by_hand.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy_tokenizer(toy):
    return models.load_tokenizer(toy["policy"])


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_toy_demonstrations(toy):
    from toy_worlds import toy_task

    sorted_demos = toy_demonstrations("test", "sorted", seed=1)
    assert len(sorted_demos) == 256 and sorted_demos.column_names == ["prompt", "completion"]
    assert all(toy_task.gold_score(p, c) == 1.0 for p, c in zip(sorted_demos["prompt"], sorted_demos["completion"]))
    noisy = [toy_demonstrations("train", "imperfect", seed=s)["completion"] for s in (1, 1, 2)]
    assert noisy[0] == noisy[1] and noisy[0] != noisy[2]  # a fixed draw per seed
    prompts = toy_demonstrations("train", "imperfect", seed=1)["prompt"]
    gold = sum(toy_task.gold_score(p, c) for p, c in zip(prompts, noisy[0])) / len(prompts)
    assert 0.4 < gold < 0.7  # 55% copies, 30% right, 15% nearly right


def test_tokenisation_truncation_rule_and_dropped_rows(toy_tokenizer):
    tokenizer, eos = toy_tokenizer, toy_tokenizer.eos_token_id
    pairs = [("a b c d =", " a b c d", None, None),  # prompt cut to "c d =", completion to " a b" (no EOS)
             ("a =", " a b", None, None),  # fits, EOS included
             ("a b c d e f =", " a", None, None)]  # prompt cut to "e f =", " a" + EOS fit
    rows, dropped = tokenize_demonstrations(tokenizer, pairs, max_prompt_length=3, max_length=5, name="hand")
    assert dropped == 0
    assert rows[0] == {"prompt": encode(tokenizer, "c d ="), "completion": encode(tokenizer, " a b"),
                       "completion_mask": [True] * 2}
    assert rows[1] == {"prompt": encode(tokenizer, "a ="), "completion": encode(tokenizer, " a b") + [eos],
                       "completion_mask": [True] * 3}
    assert rows[2] == {"prompt": encode(tokenizer, "e f ="), "completion": encode(tokenizer, " a") + [eos],
                       "completion_mask": [True] * 2}
    rows, dropped = tokenize_demonstrations(tokenizer, pairs, max_prompt_length=3, max_length=3, name="hand")
    assert dropped == 2 and rows == [{"prompt": encode(tokenizer, "a ="), "completion": encode(tokenizer, " a"),
                                      "completion_mask": [True]}]
    with pytest.raises(UserError, match="no example is left"):
        tokenize_demonstrations(tokenizer, [pairs[0]], max_prompt_length=3, max_length=3, name="hand")


def test_messages_render_with_the_chat_template(toy_tokenizer):
    from datasets import Dataset

    tokenizer = toy_tokenizer
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' %} ={% endif %}"
                               "{% endfor %}")
    try:
        text = Dataset.from_list([{"prompt": "c a b =", "completion": " a b c"}])
        chat = Dataset.from_list([{"messages": [{"role": "user", "content": "c a b"},
                                                {"role": "assistant", "content": " a b c"}]}])
        split = Dataset.from_list([{"prompt": [{"role": "user", "content": "c a b"}],
                                    "completion": [{"role": "assistant", "content": " a b c"}]}])
        expected = tokenize_demonstrations(tokenizer, prompt_completion_pairs(text, "text"), 8, 16, "text")
        assert expected[0][0]["completion"] == encode(tokenizer, " a b c") + [tokenizer.eos_token_id]
        for data in (chat, split):
            assert tokenize_demonstrations(tokenizer, prompt_completion_pairs(data, "chat"), 8, 16, "chat") == expected
        bad = Dataset.from_list([{"messages": [{"role": "assistant", "content": " a"},
                                               {"role": "user", "content": "b"}]}])
        with pytest.raises(UserError, match="ending with the assistant's"):
            prompt_completion_pairs(bad, "bad")
        with pytest.raises(UserError, match="'completion'"):
            prompt_completion_pairs(Dataset.from_list([{"prompt": "a =", "completion": 3}]), "bad")
    finally:
        tokenizer.chat_template = None


@pytest.mark.parametrize("flags,match", [(dict(max_prompt_length=8, max_length=8), "max_length"),
                                         (dict(warmup_ratio=1.0), "warmup_ratio"),
                                         (dict(max_eval_examples=-1), "max_eval_examples"),
                                         (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps")])
def test_invalid_hyper_parameters(flags, match):
    args = Args(**flags)
    with pytest.raises(UserError, match=match):
        ru.check_flags(args)  # the flag groups' checks, as ru.parse_args runs them
        validate(args)


# ---------------------------------------------------------------------------------------------------------
# Real runs on the toy task
# ---------------------------------------------------------------------------------------------------------
SHORT = ["--max_steps", "8", "--eval_steps", "4", "--save_steps", "4", "--num_eval_prompts", "64", "--seed", "3"]


def run_sft(*args):
    return run_script("sft.py", *args, threads=1)  # the toy model gains nothing from more threads


@pytest.fixture(scope="module")
def short_run(toy, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft") / "a")
    run_sft("--output_dir", out, *SHORT)
    return out


def load_weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_short_run_learns_and_saves_a_loadable_model(short_run, toy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = read_metrics(short_run)
    assert rows[0]["step"] == 0 and rows[0]["data/train_examples"] == 4096 and rows[0]["data/dropped"] == 0
    assert rows[0]["data/eval_examples"] == 256
    train = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train] == list(range(1, 9))
    for key in REQUIRED:
        assert all(math.isfinite(r[key]) for r in train), key
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 4, 8]
    assert train[-1]["epoch"] == pytest.approx(8 / (4096 // 64))
    with open(os.path.join(toy["root"], "report.json")) as f:
        sft_greedy_gold = json.load(f)["sft_gold_greedy"]
    first, last = rows[0], rows[-1]
    # measured at seed 3: eval/loss 0.28 -> 0.08, gold 0.46 -> 0.98 (the toy SFT policy: 0.47 on all 256 prompts)
    assert first["eval/gold_score"] < sft_greedy_gold + 0.05
    assert last["eval/gold_score"] > first["eval/gold_score"] + 0.3
    assert last["eval/loss"] < first["eval/loss"] - 0.1
    assert last["eval/token_accuracy"] > first["eval/token_accuracy"] + 0.05
    model = AutoModelForCausalLM.from_pretrained(os.path.join(short_run, "model"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(short_run, "model"))
    ids = torch.tensor([encode(tokenizer, "c a b =")])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split() == ["a", "b", "c"]


def test_first_logged_loss_is_the_token_mean_of_the_first_batch(short_run, toy, toy_tokenizer):
    """The script's own step 1: the starting policy's token mean over the 64 examples that du.epoch_permutation puts
    first, computed here without the script's batching."""

    tokenizer = toy_tokenizer
    demos = toy_demonstrations("train", "sorted", seed=3)
    first = du.epoch_permutation(len(demos), 3, 0)[:64]
    model = models.load_causal_lm(toy["policy"], tokenizer).eval()
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for i in first:
            row = {"prompt": encode(tokenizer, demos[i]["prompt"]),
                   "completion": encode(tokenizer, demos[i]["completion"]) + [tokenizer.eos_token_id]}
            token_nll = slow_token_nll(model, row)
            nll, tokens = nll + sum(token_nll), tokens + len(token_nll)
    step1 = read_metrics(short_run)[1]
    assert step1["num_tokens"] == tokens
    assert step1["loss"] == pytest.approx(nll / tokens, abs=1e-4)


def test_resume_equals_the_uninterrupted_run(short_run, tmp_path):
    resumed = str(tmp_path / "resumed")
    run_sft("--output_dir", resumed, *SHORT, "--resume_from", os.path.join(short_run, "checkpoint-4"))
    got = without_wall_clock(read_metrics(resumed))
    later = [r for r in without_wall_clock(read_metrics(short_run)) if r["step"] > 4]
    assert [r["step"] for r in got] == [5, 6, 7, 8]
    for a, b in zip(got, later):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k)
    wa, wb = load_weights(os.path.join(resumed, "model")), load_weights(os.path.join(short_run, "model"))
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wb)


def assert_one_line_error(proc, expected, out):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ") and expected in lines[-1], lines[-1]
    assert not os.path.exists(out)


@pytest.mark.parametrize("case", ["missing_column", "empty_file"])
def test_bad_files_fail_fast_without_output_folder(case, toy, tmp_path):
    data = str(tmp_path / "data.jsonl")
    with open(data, "w") as f:
        if case == "missing_column":
            f.write(json.dumps({"prompt": "a b =", "answer": " a b"}) + "\n")
    out = str(tmp_path / "out")
    proc = run_script_in_process("sft.py", "--dataset", data, "--output_dir", out)
    assert_one_line_error(proc, {"missing_column": "missing column(s) ['completion']", "empty_file": "empty"}[case],
                          out)


@pytest.mark.parametrize("split", ["train", "test"])
def test_empty_split_is_a_one_line_error(split, toy, tmp_path):
    from datasets import DatasetDict

    demos = {s: toy_demonstrations(s, "sorted", seed=1) for s in ("train", "test")}
    folder = str(tmp_path / f"empty_{split}")
    DatasetDict({**demos, split: demos[split].select([])}).save_to_disk(folder)
    out = str(tmp_path / "out")
    proc = run_script_in_process("sft.py", "--dataset", folder, "--output_dir", out)
    assert_one_line_error(proc, f"split '{split}' is empty", out)


def test_two_processes_with_accumulation_match_one_process(short_run, tmp_path):
    """torchrun with 2 CPU ranks x 2 accumulation steps x 16 examples: the same 64 examples per step as the short run's
    one micro-batch of 64, so the same metrics, because the loss is a token mean over every micro-batch of every
    process (a mean of micro-batch means moves loss and grad_norm by about 1% here). No checkpoints: see test_dpo's
    note on save_checkpoint with several ranks."""
    import subprocess
    import sys

    from conftest import ROOT, script_env

    out = str(tmp_path / "two")
    flags = list(SHORT)
    del flags[flags.index("--save_steps"):flags.index("--save_steps") + 2]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "sft.py", "--output_dir", out, *flags, "--per_device_train_batch_size", "16",
                           "--gradient_accumulation_steps", "2"], cwd=ROOT, env=script_env(1), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = read_metrics(short_run), read_metrics(out)
    assert [r["step"] for r in one] == [r["step"] for r in two]
    assert [r.keys() for r in one] == [r.keys() for r in two]
    for a, b in zip(without_wall_clock(one), without_wall_clock(two)):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["step"], k)
