"""dpo.py: losses against their formulas, batching and reference log-probs, data rules, and short real runs."""

import json
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import read_metrics, run_script, run_script_in_process, without_wall_clock

import policy_common as pc
from dpo import (
    Args,
    completion_sums,
    dpo_loss,
    pair_losses,
    precompute_reference_logps,
    reference_logps,
    tokenize_preferences,
    validate,
)
from plumbing import models
from plumbing import prompt_sharing as ps
from plumbing import run_utils as ru
from plumbing.data_utils import concatenated_inputs
from plumbing.errors import UserError

LN2 = math.log(2)
REQUIRED = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "lr", "epoch"]


# ---------------------------------------------------------------------------------------------------------
# Losses, one pair at a time with plain math
# ---------------------------------------------------------------------------------------------------------
def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def reference_loss(pc_, pr_, rc_, rr_, beta, loss_type, eps):
    h = (pc_ - rc_) - (pr_ - rr_)
    if loss_type == "sigmoid":
        return -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)
    if loss_type == "robust":
        return ((1 - eps) * -log_sigmoid(beta * h) + eps * log_sigmoid(-beta * h)) / (1 - 2 * eps)
    if loss_type == "hinge":
        return max(0.0, 1 - beta * h)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("robust", 0.0), ("robust", 0.3),
                                           ("hinge", 0.0), ("ipo", 0.0)])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_loss_matches_formula(loss_type, eps, beta):
    g = torch.Generator().manual_seed(0)
    logps = [-20 * torch.rand(64, generator=g, dtype=torch.float64) for _ in range(4)]
    losses, chosen_rewards, rejected_rewards = dpo_loss(*logps, beta=beta, loss_type=loss_type, label_smoothing=eps)
    for i in range(64):
        a, b, c, d = (float(x[i]) for x in logps)
        assert losses[i].item() == pytest.approx(reference_loss(a, b, c, d, beta, loss_type, eps), rel=1e-9, abs=1e-12)
        assert chosen_rewards[i].item() == pytest.approx(beta * (a - c))
        assert rejected_rewards[i].item() == pytest.approx(beta * (b - d))


def test_policy_equal_to_reference_gives_ln2_and_robust_is_unbiased():
    logps = torch.randn(8, dtype=torch.float64)
    losses, _, _ = dpo_loss(logps, logps + 1, logps, logps + 1, beta=0.1)
    assert torch.allclose(losses, torch.full_like(losses, LN2))
    # rDPO's defining property: its expectation over label flips (rate eps) equals the clean DPO loss
    h, eps = torch.randn(8, dtype=torch.float64), 0.2
    zero = torch.zeros_like(h)
    clean, _, _ = dpo_loss(h, zero, zero, zero, beta=1.0)
    kept, _, _ = dpo_loss(h, zero, zero, zero, beta=1.0, loss_type="robust", label_smoothing=eps)
    flipped, _, _ = dpo_loss(zero, h, zero, zero, beta=1.0, loss_type="robust", label_smoothing=eps)
    assert torch.allclose((1 - eps) * kept + eps * flipped, clean)


def test_ipo_uses_length_normalised_logps_and_rpo_adds_chosen_nll():
    # two pairs; completions of lengths (3, 1) chosen and (2, 2) rejected, written by hand
    pad = 0
    query_responses = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0], [5, 6, 6, 0], [5, 6, 7, 0]])
    policy_tok = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 9.0, 9.0], [-1.0, -1.0, 9.0], [-2.0, -4.0, 9.0]])
    ref_tok = torch.full_like(policy_tok, -1.0)
    policy_logps, lengths = completion_sums(policy_tok, query_responses, 1, pad)
    ref_logps, _ = completion_sums(ref_tok, query_responses, 1, pad)
    assert lengths.tolist() == [3, 1, 2, 2]
    losses, stats = pair_losses(Args(loss_type="ipo", beta=0.5), policy_logps, ref_logps, lengths)
    pol = [(-1 - 2 - 3) / 3, -4 / 1, (-1 - 1) / 2, (-2 - 4) / 2]  # per-token means over the real tokens
    ref = [-1.0, -1.0, -1.0, -1.0]
    for i in range(2):
        h = (pol[i] - ref[i]) - (pol[2 + i] - ref[2 + i])
        assert losses[i].item() == pytest.approx((h - 1 / (2 * 0.5)) ** 2)
    losses, stats = pair_losses(Args(loss_type="sigmoid", beta=0.5, rpo_alpha=0.7), policy_logps, ref_logps, lengths)
    sums = [-6.0, -4.0, -2.0, -6.0]
    refs = [-3.0, -1.0, -2.0, -2.0]
    for i, n in enumerate([3, 1]):
        h = (sums[i] - refs[i]) - (sums[2 + i] - refs[2 + i])
        expected = -log_sigmoid(0.5 * h) + 0.7 * (-sums[i] / n)
        assert losses[i].item() == pytest.approx(expected, rel=1e-6)
        assert stats["nll_loss"][i].item() == pytest.approx(-sums[i] / n)


# ---------------------------------------------------------------------------------------------------------
# Batching, reference log-probs, data
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy_model(toy):
    tokenizer = models.load_tokenizer(toy["policy"])
    return tokenizer, models.load_causal_lm(toy["policy"], tokenizer)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def hand_rows(tokenizer):
    eos = tokenizer.eos_token_id
    pairs = [("c a b =", " a b c", " c a b"), ("f e d c b a =", " a b c d e f", " a"), ("k j =", " j k j k", " j")]
    return [{"prompt": encode(tokenizer, p), "chosen": encode(tokenizer, c) + [eos],
             "rejected": encode(tokenizer, r) + [eos]} for p, c, r in pairs]


def test_concatenated_forward_equals_separate_forwards(toy_model):
    tokenizer, model = toy_model
    pad, rows = tokenizer.pad_token_id, hand_rows(tokenizer)
    query_responses, context_length = concatenated_inputs(rows, pad)
    assert query_responses.shape[0] == 2 * len(rows)
    with torch.no_grad():
        token_logprobs = pc.Forward(pad).logprobs(model, query_responses, context_length)
    logps, lengths = completion_sums(token_logprobs, query_responses, context_length, pad)
    for i, row in enumerate(rows):
        for j, column in enumerate(("chosen", "rejected")):
            ids = torch.tensor([row["prompt"] + row[column]])
            with torch.no_grad():
                logits = model(ids).logits[0, len(row["prompt"]) - 1:-1]  # the pad token without probability
                alone = F.log_softmax(logits.index_fill(-1, torch.tensor([pad]), -math.inf), -1)
            expected = alone.gather(-1, torch.tensor(row[column]).unsqueeze(-1)).sum().item()
            assert logps[j * len(rows) + i].item() == pytest.approx(expected, abs=1e-4)
            assert lengths[j * len(rows) + i].item() == len(row[column])


def test_precomputed_reference_equals_on_the_fly(toy_model, toy):
    from accelerate import Accelerator

    tokenizer, _ = toy_model
    pad, rows = tokenizer.pad_token_id, hand_rows(tokenizer)
    reference = pc.Reference("copy", pc.Forward(pad), model=models.load_causal_lm(toy["policy"], tokenizer))
    query_responses, context_length = concatenated_inputs(rows, pad)  # all rows in one batch: other padding
    on_the_fly = reference_logps(reference, rows, query_responses, context_length, pad)
    # each row's (chosen, rejected) sums, batches of 2 with each prompt encoded once for its chosen and rejected rows
    shared = pc.Reference("copy", ps.SharedPromptForward(pad), model=reference.model)
    precompute_reference_logps(shared, rows, 2, pad, Accelerator(cpu=True))
    assert all(row["ref_logps"].shape == (2,) for row in rows)
    picked = [rows[2], rows[0]]
    looked_up = reference_logps(reference, picked, *concatenated_inputs(picked, pad), pad)
    assert torch.allclose(looked_up, on_the_fly[[2, 0, 5, 3]], atol=1e-5)


def test_tokenisation_truncation_rule_and_dropped_rows(toy_model):
    from datasets import Dataset

    tokenizer, _ = toy_model
    eos = tokenizer.eos_token_id
    data = Dataset.from_list([
        {"prompt": "a b c d =", "chosen": " a b c d", "rejected": " d"},  # prompt cut to "c d =", completions to 2
        {"prompt": "a b c d e f =", "chosen": " a", "rejected": " b"},  # prompt "e f =", a + EOS fit
        {"prompt": "a =", "chosen": " a", "rejected": " b c"},  # fits
    ])
    rows, dropped = tokenize_preferences(tokenizer, data, max_prompt_length=3, max_length=5, name="hand")
    assert dropped == 0 and len(rows) == 3
    assert rows[0] == {"prompt": encode(tokenizer, "c d ="), "chosen": encode(tokenizer, " a b"),
                       "rejected": encode(tokenizer, " d") + [eos]}
    assert rows[1]["prompt"] == encode(tokenizer, "e f =") and rows[1]["chosen"] == encode(tokenizer, " a") + [eos]
    assert rows[2]["rejected"] == encode(tokenizer, " b c") + [eos]
    rows, dropped = tokenize_preferences(tokenizer, data, max_prompt_length=4, max_length=4, name="hand")
    assert dropped == 2 and len(rows) == 1  # rows 0 and 1 have 4-token prompts: nothing is left of a completion
    with pytest.raises(UserError, match="no pair is left"):
        tokenize_preferences(tokenizer, data.select([0, 1]), max_prompt_length=4, max_length=4, name="hand")
    with pytest.raises(UserError, match="'rejected'"):
        tokenize_preferences(tokenizer, Dataset.from_list([{"prompt": "a =", "chosen": " a", "rejected": 3}]), 4, 8,
                             name="hand")


def test_conversational_pairs_render_with_the_chat_template(toy_model):
    from datasets import Dataset

    tokenizer, _ = toy_model
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' %} ={% endif %}"
                               "{% endfor %}")
    text = Dataset.from_list([{"prompt": "c a b =", "chosen": " a b c", "rejected": " c a b"}])
    chat = Dataset.from_list([{"prompt": [{"role": "user", "content": "c a b"}],
                               "chosen": [{"role": "assistant", "content": " a b c"}],
                               "rejected": [{"role": "assistant", "content": " c a b"}]}])
    assert tokenize_preferences(tokenizer, chat, 8, 16, "chat") == tokenize_preferences(tokenizer, text, 8, 16, "text")
    tokenizer.chat_template = None


# ---------------------------------------------------------------------------------------------------------
# Real runs on the toy task
# ---------------------------------------------------------------------------------------------------------
SHORT = ["--max_steps", "6", "--per_device_train_batch_size", "8", "--eval_steps", "3", "--save_steps", "3",
         "--max_eval_pairs", "32", "--num_eval_prompts", "16", "--seed", "5", "--precompute_ref_logprobs"]


@pytest.fixture(scope="module")
def short_run(toy, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dpo") / "a")
    run_dpo("--output_dir", out, *SHORT)
    return out


def run_dpo(*args, fresh=False):
    return run_script("dpo.py", *args, threads=1, fresh=fresh)  # the toy model gains nothing from more threads


def load_weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_short_run_metrics_and_model(short_run):
    from transformers import AutoModelForCausalLM

    rows = read_metrics(short_run)
    assert rows[0]["step"] == 0 and rows[0]["data/dropped"] == 0 and rows[0]["data/train_pairs"] > 0
    train = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train] == list(range(1, 7))
    for key in REQUIRED:
        assert all(math.isfinite(r[key]) for r in train), key
    for row in (rows[0], train[2], train[5]):  # evaluated before training too (step 0)
        for key in ["eval/loss", "eval/rewards/accuracies", "eval/rewards/margins", "eval/logps/chosen",
                    "eval/gold_score"]:
            assert key in row
    assert rows[0]["eval/loss"] == pytest.approx(LN2, abs=1e-4)  # policy == reference before training
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 3, 6]
    assert train[0]["loss"] == pytest.approx(LN2, abs=1e-4)  # policy == reference at step 0
    assert train[-1]["epoch"] == pytest.approx(6 * 8 / (rows[0]["data/train_pairs"] // 8 * 8))
    assert AutoModelForCausalLM.from_pretrained(os.path.join(short_run, "model")) is not None


def test_determinism_and_resume(short_run, tmp_path):
    again, resumed = str(tmp_path / "b"), str(tmp_path / "c")
    run_dpo("--output_dir", again, *SHORT, fresh=True)  # a new interpreter's own hash seed and RNGs (conftest)

    assert without_wall_clock(read_metrics(again)) == without_wall_clock(read_metrics(short_run))

    run_dpo("--output_dir", resumed, *SHORT, "--resume_from", os.path.join(short_run, "checkpoint-3"))
    later = [r for r in without_wall_clock(read_metrics(short_run)) if r["step"] > 3]
    got = without_wall_clock(read_metrics(resumed))
    assert [r["step"] for r in got] == [4, 5, 6]
    for a, b in zip(got, later):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    wa, wb = load_weights(os.path.join(resumed, "model")), load_weights(os.path.join(short_run, "model"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wb)


def test_resume_without_output_dir_continues_in_the_checkpoint_folder(short_run, tmp_path):
    """--resume_from runs/X/checkpoint-N alone continues run X in its folder (it used to start a new runs/ folder)."""
    run = str(tmp_path / "run")
    shutil.copytree(short_run, run)
    shutil.rmtree(os.path.join(run, "model"))
    with open(os.path.join(run, "metrics.jsonl")) as f:  # as if stopped after step 3
        head = [line for line in f if json.loads(line)["step"] <= 3]
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.writelines(head)
    run_dpo(*SHORT, "--resume_from", os.path.join(run, "checkpoint-3"))
    rows, original = read_metrics(run), read_metrics(short_run)
    assert [r["step"] for r in rows] == list(range(7))
    assert [r.keys() for r in rows[4:]] == [r.keys() for r in original[4:]]
    for a, b in zip(without_wall_clock(rows[4:]), without_wall_clock(original[4:])):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    wa, wb = load_weights(os.path.join(run, "model")), load_weights(os.path.join(short_run, "model"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wb)


def test_two_processes_match_one_for_the_same_global_batch(short_run, tmp_path):
    """torchrun with 2 CPU ranks, half the per-device batch: the same pairs per step, so the same metrics.
    No checkpoints here: tl.save_checkpoint renames the folder while another rank may still be writing its RNG
    state into it (no barrier after accelerator.save_state): the likely cause of one failure seen in six runs."""
    import subprocess
    import sys

    from conftest import ROOT, script_env

    out = str(tmp_path / "two")
    flags = list(SHORT)
    flags[flags.index("--per_device_train_batch_size") + 1] = "4"
    del flags[flags.index("--save_steps"):flags.index("--save_steps") + 2]  # see the note on save_checkpoint below
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "dpo.py", "--output_dir", out, *flags], cwd=ROOT, env=script_env(1), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = without_wall_clock(read_metrics(short_run)), without_wall_clock(read_metrics(out))
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        for k in a:
            if k.endswith("rewards/accuracies") and abs(a[k.replace("accuracies", "margins")]) < 1e-5:
                # policy still equal to the reference (warm-up): every margin is float noise, its sign arbitrary
                continue
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["step"], k)


def test_peft_run_uses_the_adapter_off_base_as_reference(toy, tmp_path):
    out = str(tmp_path / "peft")
    run_dpo("--output_dir", out, "--use_peft", "--max_steps", "3", "--per_device_train_batch_size", "8",
               "--learning_rate", "1e-2", "--max_eval_pairs", "16", "--num_eval_prompts", "8")
    train = [r for r in read_metrics(out) if r["step"] > 0]
    assert train[0]["loss"] == pytest.approx(LN2, abs=1e-4)  # fresh LoRA (B = 0): policy == adapter-off base
    assert abs(train[-1]["rewards/margins"]) > 0  # the reference did not move with the adapter
    assert os.path.exists(os.path.join(out, "model", "adapter_config.json"))


def test_learns_on_the_toy_task(toy, tmp_path):
    out = str(tmp_path / "learn")
    run_dpo("--output_dir", out, "--max_steps", "20", "--eval_steps", "0", "--num_eval_prompts", "64")
    with open(os.path.join(toy["root"], "report.json")) as f:
        sft_greedy_gold = json.load(f)["sft_gold_greedy"]
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "eval/gold_score" in r] == [0, 20]  # --eval_steps 0: before and after
    assert train_gain(rows, "eval/gold_score") > 0.25 and train_gain(rows, "eval/loss") < -0.1
    train = [r for r in rows if r["step"] > 0]
    first, last = train[:5], train[-5:]

    def mean(rows, k):
        return sum(r[k] for r in rows) / len(rows)

    # seeds 1-3 measured: loss -0.19, accuracy +0.30..0.39, held-out accuracy 0.81..0.86, gold +0.46..0.49
    assert mean(last, "loss") < mean(first, "loss") - 0.1
    assert mean(last, "rewards/accuracies") > mean(first, "rewards/accuracies") + 0.15
    assert train[-1]["eval/rewards/accuracies"] > 0.7
    assert train[-1]["eval/gold_score"] > sft_greedy_gold + 0.25


def train_gain(rows, key):
    """How much `key` rose from the evaluation before training to the last one."""
    evaluated = [r[key] for r in rows if key in r]
    return evaluated[-1] - evaluated[0]


@pytest.mark.parametrize("case", ["missing_column", "empty"])
def test_bad_input_fails_fast_without_output_folder(case, toy, tmp_path):
    data = str(tmp_path / "data.jsonl")
    with open(data, "w") as f:
        if case == "missing_column":
            f.write(json.dumps({"prompt": "a b =", "chosen": " a b"}) + "\n")
    out = str(tmp_path / "out")
    proc = run_script_in_process("dpo.py", "--dataset", data, "--output_dir", out)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("error: ") and "Traceback" not in proc.stderr
    assert {"missing_column": "['rejected']", "empty": "empty"}[case] in lines[-1]
    assert not os.path.exists(out)


@pytest.fixture(scope="module")
def empty_split_data(toy, tmp_path_factory):
    """save_to_disk copies of the toy pairs with an empty train or test split (`datasets` writes no data file for
    an empty split, and its loader then failed with IndexError: list index out of range)."""
    from datasets import DatasetDict, load_from_disk

    pairs = load_from_disk(toy["preference_dataset"])
    folders = {}
    for split in ("train", "test"):
        folders[split] = str(tmp_path_factory.mktemp("empty") / f"empty_{split}")
        DatasetDict({**pairs, split: pairs[split].select([])}).save_to_disk(folders[split])
    return folders


@pytest.mark.parametrize("split", ["train", "test"])
def test_empty_split_is_a_one_line_error(split, empty_split_data, tmp_path):
    out = str(tmp_path / "out")
    proc = run_script_in_process("dpo.py", "--dataset", empty_split_data[split], "--output_dir", out)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ") and f"split '{split}' is empty" in lines[-1]
    assert not os.path.exists(out)


@pytest.fixture(scope="module")
def short_model(toy, tmp_path_factory):
    """A tiny GPT-NeoX that attends to 32 positions (fewer than the default --max_length 640 and --response_length
    53 ask for), with the toy tokenizer."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    tokenizer = models.load_tokenizer(toy["policy"])
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    path = str(tmp_path_factory.mktemp("short") / "model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_lengths_fit_a_model_with_32_positions(short_model, toy, tmp_path):
    from datasets import load_from_disk

    out = str(tmp_path / "short")
    flags = ["--model", short_model, "--dataset", "toy", "--max_steps", "2", "--per_device_train_batch_size", "8",
             "--gradient_accumulation_steps", "1", "--max_eval_pairs", "16", "--num_eval_prompts", "4"]
    proc = run_dpo(*flags, "--output_dir", out)
    with open(os.path.join(out, "args.json")) as f:
        args = json.load(f)
    tokenizer = models.load_tokenizer(toy["policy"])
    pairs, prompts = load_from_disk(toy["preference_dataset"]), load_from_disk(toy["prompt_dataset"])["test"]["prompt"]
    longest = max(len(encode(tokenizer, p)) for p in [*pairs["train"]["prompt"], *pairs["test"]["prompt"][:16]])
    longest_query = max(len(encode(tokenizer, p)) for p in prompts[:4])
    assert args["max_length"] == 32 and "note: --max_length lowered from 640 to 32" in proc.stdout
    assert args["max_prompt_length"] == max(longest, longest_query)  # the longest prompt of the data
    assert args["response_length"] == 32 - longest_query and "note: --response_length lowered from 53" in proc.stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(math.isfinite(rows[-1][k]) for k in REQUIRED)
    assert "eval/gold_score" in rows[0] and "eval/gold_score" in rows[-1]
    for flag, value in (("--max_length", "33"), ("--response_length", str(33 - longest_query))):
        proc = run_script_in_process("dpo.py", *flags, flag, value, "--output_dir", str(tmp_path / "refused"))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and lines[-1].startswith(f"error: {flag} {value} does not fit"), proc.stderr
        assert not os.path.exists(tmp_path / "refused")


@pytest.mark.parametrize("flags,match", [(dict(beta=-1.0), "--beta"), (dict(label_smoothing=0.5), "label_smoothing"),
                                         (dict(loss_type="ipo", label_smoothing=0.1), "sigmoid and robust"),
                                         (dict(reference_free=True, precompute_ref_logprobs=True), "reference_free"),
                                         (dict(max_prompt_length=8, max_length=8), "max_length")])
def test_invalid_hyper_parameters(flags, match):
    args = Args(**flags)
    with pytest.raises(UserError, match=match):
        ru.check_flags(args)  # the flag groups' checks, as ru.parse_args runs them
        validate(args)
