"""reward.py: the Bradley-Terry loss against hand-worked numbers, the new head's initialisation, padding safety, the two
input conventions, and short real runs (learning, the saved convention that rloo.py follows, exact resume, bad
input)."""

import json
import math
import os

import pytest
import torch
from conftest import read_metrics, run_script, run_script_in_process, without_wall_clock

import policy_common as pc
from plumbing import forwards as fw
from plumbing import models
from plumbing import prompt_sharing as ps
from plumbing import run_utils as ru
from plumbing.errors import UserError
from reward import (
    Args,
    RewardModel,
    bradley_terry_loss,
    init_score_head,
    load_reward_model,
    pair_rewards,
    pair_stats,
    reward_input_ids,
    tokenize_pairs,
    validate,
)

REQUIRED = ["loss", "accuracy", "rewards/chosen", "rewards/rejected", "rewards/margins", "grad_norm", "lr", "epoch"]
EVAL = ["eval/loss", "eval/accuracy", "eval/rewards/chosen", "eval/rewards/rejected", "eval/rewards/margins"]


# ---------------------------------------------------------------------------------------------------------
# The loss, by hand
# ---------------------------------------------------------------------------------------------------------
CHOSEN, REJECTED = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])  # score gaps 2, 0 (a tie), -2


def test_bradley_terry_loss_by_hand():
    # -log sigmoid(d) = log(1 + exp(-d)): d = 2, 0, -2
    losses = bradley_terry_loss(CHOSEN, REJECTED)
    assert losses.tolist() == pytest.approx([0.1269280110429725, 0.6931471805599453, 2.1269280110429727], rel=1e-6)
    stats = pair_stats(losses, CHOSEN, REJECTED)
    assert stats["accuracy"].tolist() == [1.0, 0.0, 0.0]  # a tie is not a correct ranking
    assert stats["rewards/margins"].tolist() == [2.0, 0.0, -2.0]
    assert stats["loss"].tolist() == losses.tolist() and stats["rewards/chosen"].tolist() == CHOSEN.tolist()


def test_margin_column_and_centring_term_by_hand():
    # margins 1, 0, 0.5: -log sigmoid(d - m) with d - m = 1, 0, -2.5
    losses = bradley_terry_loss(CHOSEN, REJECTED, margin=torch.tensor([1.0, 0.0, 0.5]))
    assert losses.tolist() == pytest.approx([0.31326168751822286, 0.6931471805599453, 2.5788897342925496], rel=1e-6)
    # centring, coefficient 0.1: + 0.1 * (r_c + r_r)^2 = + 0.4, 0, 0
    losses = bradley_terry_loss(CHOSEN, REJECTED, center_rewards_coefficient=0.1)
    assert losses.tolist() == pytest.approx([0.5269280110429725, 0.6931471805599453, 2.1269280110429727], rel=1e-6)
    # the batch mean is TRL 1.16 RewardTrainer.compute_loss's loss
    margin = torch.tensor([1.0, 0.0, 0.5])
    trl = (-torch.nn.functional.logsigmoid(CHOSEN - REJECTED - margin).mean()
           + 0.1 * torch.mean((CHOSEN + REJECTED) ** 2))
    assert bradley_terry_loss(CHOSEN, REJECTED, margin, 0.1).mean().item() == pytest.approx(trl.item(), rel=1e-6)
    assert trl.item() == pytest.approx((0.31326168751822286 + 0.6931471805599453 + 2.5788897342925496 + 0.4) / 3)


@pytest.mark.parametrize("flags,match", [(dict(center_rewards_coefficient=-1.0), "center_rewards"),
                                         (dict(max_prompt_length=8, max_length=8), "max_length"),
                                         (dict(weight_decay=-0.1), "weight_decay")])
def test_invalid_hyper_parameters(flags, match):
    args = Args(**flags)
    with pytest.raises(UserError, match=match):
        ru.check_flags(args)  # the flag groups' checks, as ru.parse_args runs them
        validate(args)


# ---------------------------------------------------------------------------------------------------------
# The model: head initialisation, padding safety
# ---------------------------------------------------------------------------------------------------------
def test_new_head_is_initialised_as_sffd_and_an_existing_head_is_kept(toy):
    torch.manual_seed(0)
    head = torch.nn.Linear(4095, 1)
    init_score_head(head)
    assert head.weight.std().item() == pytest.approx(1 / 64, rel=0.05) and abs(head.weight.mean().item()) < 1e-3
    assert head.bias.item() == 0.0
    tokenizer = models.load_tokenizer(toy["policy"])
    torch.manual_seed(0)
    fresh = load_reward_model(toy["policy"], tokenizer, Args())  # a causal LM: its head is new
    torch.manual_seed(0)
    expected = torch.nn.Linear(fresh.config.hidden_size, 1, bias=False)
    init_score_head(expected)
    assert torch.equal(fresh.score.weight, expected.weight)
    trained = models.load_scalar_model(toy["reward"], tokenizer)
    assert torch.equal(load_reward_model(toy["reward"], tokenizer, Args()).score.weight, trained.score.weight)


@pytest.fixture(scope="module")
def toy_reward_model(toy):
    tokenizer = models.load_tokenizer(toy["policy"])
    model = models.load_scalar_model(toy["reward"], tokenizer).eval()
    return tokenizer, model


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_scores_do_not_depend_on_padding(toy_reward_model):
    tokenizer, classifier = toy_reward_model
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model, sharing = RewardModel(classifier), RewardModel(classifier)
    model.choose_forward(fw.Forwards(pad))  # the plain forward
    # chosen and rejected rows repeating each prompt, in micro-batches where sharing it saves enough: encoded once
    sharing.choose_forward(fw.Forwards(pad, repeats=ps.Repeats(16, 2, 32, 8)))
    assert type(model.scalar_forward) is pc.ScalarForward
    assert isinstance(sharing.scalar_forward, ps.SharedPromptScalarForward)
    pairs = [("c a b =", " a b c", " c a b"), ("f e d c b a =", " a b c d e f", " a"), ("k j =", " j k j k", " j")]
    rows = [{"prompt": encode(tokenizer, p), "chosen": encode(tokenizer, c) + [eos],
             "rejected": encode(tokenizer, r) + [eos]} for p, c, r in pairs]
    with torch.no_grad():
        together = torch.stack(pair_rewards(model, rows, pad, "cpu"))  # (2, 3): padded to the longest row
        shared = torch.stack(pair_rewards(sharing, rows, pad, "cpu"))
        alone = torch.cat([torch.stack(pair_rewards(model, [row], pad, "cpu")) for row in rows], 1)
        # the model's own forward on each unpadded sequence (score at its last token)
        plain = torch.tensor([[classifier(input_ids=torch.tensor([row["prompt"] + row[c]])).logits.item()
                               for row in rows] for c in ("chosen", "rejected")])
    assert torch.allclose(together, alone, atol=1e-5) and torch.allclose(together, plain, atol=1e-5)
    assert torch.allclose(shared, together, atol=1e-5)
    assert (together[0] - together[1]).abs().min() > 1e-3  # the pairs are told apart: not a constant model


# ---------------------------------------------------------------------------------------------------------
# Input conventions and data
# ---------------------------------------------------------------------------------------------------------
def test_tokens_mode_ends_with_eos_and_text_mode_does_not(toy_reward_model):
    tokenizer, _ = toy_reward_model
    eos = tokenizer.eos_token_id
    prompt_ids, tokens = reward_input_ids(tokenizer, "c a b =", " a b c", 8, 18, "tokens")
    _, text = reward_input_ids(tokenizer, "c a b =", " a b c", 8, 18, "text")
    assert prompt_ids == encode(tokenizer, "c a b =")
    assert tokens == encode(tokenizer, " a b c") + [eos] and text == encode(tokenizer, " a b c")
    # a completion cut by --max_length keeps its first tokens and no EOS, in both modes
    for mode in ("tokens", "text"):
        assert reward_input_ids(tokenizer, "c a b =", " a b c", 8, 6, mode)[1] == encode(tokenizer, " a b")


def test_tokenize_pairs_margin_dropped_rows_and_types(toy_reward_model):
    from datasets import Dataset

    tokenizer, _ = toy_reward_model
    eos = tokenizer.eos_token_id
    data = Dataset.from_list([{"prompt": "a b c d e f =", "chosen": " a b", "rejected": " b", "margin": 0.5},
                              {"prompt": "a =", "chosen": " a", "rejected": "", "margin": 2}])
    rows, dropped = tokenize_pairs(tokenizer, data, 3, 8, "tokens", "hand")
    assert dropped == 0 and [r["margin"] for r in rows] == [0.5, 2.0]
    assert rows[0]["prompt"] == encode(tokenizer, "e f =")  # cut from the left
    assert rows[1]["rejected"] == [eos]  # an empty completion is its EOS in tokens mode ...
    rows, dropped = tokenize_pairs(tokenizer, data, 3, 8, "text", "hand")
    assert dropped == 1 and len(rows) == 1 and rows[0]["chosen"] == encode(tokenizer, " a b")  # ... nothing as text
    assert "margin" not in tokenize_pairs(tokenizer, data.remove_columns("margin"), 3, 8, "tokens", "hand")[0][0]
    with pytest.raises(UserError, match="'margin'"):
        tokenize_pairs(tokenizer, Dataset.from_list([{"prompt": "a =", "chosen": " a", "rejected": " b",
                                                      "margin": "big"}]), 3, 8, "tokens", "hand")
    with pytest.raises(UserError, match="'rejected'"):
        tokenize_pairs(tokenizer, Dataset.from_list([{"prompt": "a =", "chosen": " a", "rejected": 3}]), 3, 8,
                       "tokens", "hand")


# ---------------------------------------------------------------------------------------------------------
# Real runs on the toy task
# ---------------------------------------------------------------------------------------------------------
SHORT = ["--max_steps", "30", "--eval_steps", "15", "--save_steps", "15", "--seed", "3"]


def run_reward(*args):
    return run_script("reward.py", *args, threads=1)  # the toy model gains nothing from more threads


@pytest.fixture(scope="module")
def short_run(toy, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reward") / "tokens")
    run_reward("--output_dir", out, *SHORT)
    return out


@pytest.fixture(scope="module")
def text_run(toy, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reward") / "text")
    run_reward("--output_dir", out, "--max_steps", "2", "--reward_model_input", "text")
    return out


def load_weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_short_run_learns_and_saves_a_reward_model(short_run, toy):
    from transformers import AutoModelForSequenceClassification

    rows = read_metrics(short_run)
    assert rows[0]["step"] == 0 and rows[0]["data/dropped"] == 0
    with open(os.path.join(toy["root"], "report.json")) as f:
        report = json.load(f)
    assert rows[0]["data/train_pairs"] == report["n_preference_train"]
    assert rows[0]["data/eval_pairs"] == report["n_preference_test"]  # the toy alias evaluates every held-out pair
    train = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert all(math.isfinite(r[k]) for r in train for k in REQUIRED)
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 15, 30] and all(k in rows[-1] for k in EVAL)
    assert rows[0]["eval/loss"] == pytest.approx(math.log(2), abs=0.25)  # a fresh head: scores near each other
    # seeds 1-4 measured: held-out pairwise accuracy 0.36-0.53 -> 0.82-0.86 in 30 steps (the toy world's own model:
    # 0.88 in 500)
    assert rows[-1]["eval/accuracy"] > rows[0]["eval/accuracy"] + 0.15 and rows[-1]["eval/accuracy"] > 0.7
    assert rows[-1]["eval/loss"] < rows[0]["eval/loss"] - 0.2
    assert rows[-1]["eval/rewards/margins"] > 0.5
    model_dir = os.path.join(short_run, "model")
    with open(os.path.join(model_dir, "config.json")) as f:
        assert json.load(f)["reward_model_input"] == "tokens"  # None means tokens, and is recorded
    assert AutoModelForSequenceClassification.from_pretrained(model_dir).config.num_labels == 1


def test_text_mode_is_recorded_and_followed_by_rloo(text_run, tmp_path):
    with open(os.path.join(text_run, "model", "config.json")) as f:
        assert json.load(f)["reward_model_input"] == "text"
    proc = run_script("rloo.py", "--reward_model", os.path.join(text_run, "model"), "--max_steps", "1",
                      "--num_eval_prompts", "8", "--output_dir", str(tmp_path / "rloo"), threads=1)
    assert f"reward model {os.path.join(text_run, 'model')} reads text (its config's record)" in proc.stdout


def test_resume_equals_an_uninterrupted_run(short_run, tmp_path):
    resumed = str(tmp_path / "resumed")
    run_reward("--output_dir", resumed, *SHORT, "--resume_from", os.path.join(short_run, "checkpoint-15"))
    got = without_wall_clock(read_metrics(resumed))
    later = [r for r in without_wall_clock(read_metrics(short_run)) if r["step"] > 15]
    assert [r["step"] for r in got] == list(range(16, 31))
    for a, b in zip(got, later):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k)
    wa, wb = load_weights(os.path.join(resumed, "model")), load_weights(os.path.join(short_run, "model"))
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wb)


def test_two_processes_match_one_for_the_same_global_batch(short_run, tmp_path):
    """torchrun with 2 CPU ranks and half the per-device batch: the same pairs per step, so the same metrics (the
    gradients are synchronised: RewardModel's forward goes through the DDP wrapper), and an uneven held-out split
    (146 pairs) counted once. The loss sees only score differences, so the scores' common offset drifts by float
    rounding (about 1e-3 over 30 steps) while losses, margins and accuracies agree closely."""
    import subprocess
    import sys

    from conftest import ROOT, script_env

    out = str(tmp_path / "two")
    flags = list(SHORT)
    del flags[flags.index("--save_steps"):flags.index("--save_steps") + 2]  # checkpoints: test_resume's business
    flags += ["--per_device_train_batch_size", "16"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "reward.py", "--output_dir", out, *flags], cwd=ROOT, env=script_env(1), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = read_metrics(short_run), read_metrics(out)
    assert [r["step"] for r in one] == [r["step"] for r in two]
    assert [r.keys() for r in one] == [r.keys() for r in two]
    for a, b in zip(without_wall_clock(one), without_wall_clock(two)):
        for k in a:
            if k.endswith(("rewards/chosen", "rewards/rejected")):
                assert b[k] == pytest.approx(a[k], abs=1e-2), (a["step"], k)
            else:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["step"], k)


@pytest.fixture(scope="module")
def empty_test_split(toy, tmp_path_factory):
    """A save_to_disk copy of the toy pairs whose test split is empty."""
    from datasets import DatasetDict, load_from_disk

    pairs = load_from_disk(toy["preference_dataset"])
    folder = str(tmp_path_factory.mktemp("empty") / "empty_test")
    DatasetDict({"train": pairs["train"], "test": pairs["test"].select([])}).save_to_disk(folder)
    return folder


@pytest.mark.parametrize("case", ["missing_column", "empty_split"])
def test_bad_input_is_one_line_and_writes_nothing(case, empty_test_split, tmp_path):
    data = empty_test_split
    if case == "missing_column":
        data = str(tmp_path / "pairs.jsonl")
        with open(data, "w") as f:
            f.write(json.dumps({"prompt": "a b =", "chosen": " a b"}) + "\n")
    out = str(tmp_path / "out")
    proc = run_script_in_process("reward.py", "--dataset", data, "--output_dir", out)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ") and {"missing_column": "['rejected']",
                                                "empty_split": "split 'test' is empty"}[case] in lines[-1]
    assert not os.path.exists(out)
