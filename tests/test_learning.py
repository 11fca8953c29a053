"""The CI learning check: every script, run once as a user runs it (seed 1, its default budget on the standard toy
world), must end inside the band that benchmark/toy.py measured over three seeds (benchmark/results/toy_expected.json:
mean +- max(3 x seed std, 0.03) of the script's own final eval/gold_score, reward.py's eval/accuracy). A change that
quietly hurts learning fails here, not only one that breaks the code; a change that legitimately moves the numbers
regenerates the file with one command (`python benchmark/toy.py`, README "Results"). The check itself is shown to fail
on a copy of dpo.py whose loss has its sign flipped, and its band arithmetic is checked by hand."""

import json
import os
import sys

import pytest

from conftest import ROOT, run_script

sys.path.insert(0, os.path.join(ROOT, "benchmark"))

import toy as toy_bench  # noqa: E402  (benchmark/toy.py)

CHECKED = ("sft", "reward", "rloo", "ppo", "grpo", "dpo", "kto", "distill")  # every script with a toy default


def test_expected_values_cover_every_script_on_every_setting():
    with open(toy_bench.EXPECTED) as f:
        expected = json.load(f)
    for setting in toy_bench.SETTINGS:
        assert set(toy_bench.SETTING_ALGOS.get(setting, CHECKED)) <= set(expected[setting]), setting
        for algo, e in expected[setting].items():
            assert len(e["per_seed"]) >= 3 and e["low"] < e["mean"] < e["high"], (setting, algo)


def test_band_and_check_by_hand(tmp_path):
    # seeds 0.90, 0.92, 0.97: mean 0.93, population std sqrt((0.03^2 + 0.01^2 + 0.04^2) / 3) = 0.02944, band +- 0.0883;
    # seeds 0.50, 0.51, 0.50: std 0.0047, 3 x std = 0.014 < the 0.03 floor, band +- 0.03
    runs = {"rloo": [dict(seed=s, script_metric=v) for s, v in ((1, 0.90), (2, 0.92), (3, 0.97))],
            "reward": [dict(seed=s, script_metric=v) for s, v in ((1, 0.50), (2, 0.51), (3, 0.50))]}
    expected = toy_bench.expected_values({"toy": runs}, ["--seeds", "1", "2", "3"])
    rloo, reward = expected["toy"]["rloo"], expected["toy"]["reward"]
    assert rloo["metric"] == "eval/gold_score" and reward["metric"] == "eval/accuracy"
    assert rloo["mean"] == pytest.approx(0.93, abs=1e-4) and rloo["std"] == pytest.approx(0.0294, abs=1e-4)
    assert rloo["low"] == pytest.approx(0.93 - 0.0883, abs=2e-4)
    assert rloo["high"] == pytest.approx(0.93 + 0.0883, abs=2e-4)
    assert reward["low"] == pytest.approx(0.5033 - 0.03, abs=1e-4) and reward["high"] == pytest.approx(0.5333, abs=1e-4)
    path = tmp_path / "expected.json"
    path.write_text(json.dumps(expected))
    assert toy_bench.check_learning("rloo", 0.85, path=str(path)) == ""
    assert toy_bench.check_learning("rloo", 1.0, path=str(path)) == ""
    message = toy_bench.check_learning("rloo", 0.84, path=str(path))
    assert "rloo on toy" in message and "0.8400" in message and "outside" in message
    assert "outside" in toy_bench.check_learning("reward", 0.54, path=str(path))
    assert toy_bench.check_learning("reward", 0.53, path=str(path)) == ""


@pytest.mark.parametrize("algo", CHECKED)
def test_learning_at_the_default_budget(algo, toy, toy_teacher, tmp_path):
    out = str(tmp_path / algo)
    run_script(f"{algo}.py", "--output_dir", out, "--seed", "1")
    value = toy_bench.final_metric(out, algo)
    assert value is not None, f"{algo}.py logged no {toy_bench.metric_of(algo)}"
    message = toy_bench.check_learning(algo, value)
    assert message == "", message


def test_the_check_fails_on_a_flipped_loss_sign(toy, tmp_path):
    """A copy of dpo.py minimising the log-sigmoid of the margin instead of its negative: the code runs, the loss
    goes down, and only the learning check notices (gold falls below the SFT policy's instead of rising)."""
    with open(os.path.join(ROOT, "dpo.py")) as f:
        source = f.read()
    loss = "losses = -(1 - label_smoothing) * F.logsigmoid(beta * h)"
    assert source.count(loss) == 1
    copy = tmp_path / "dpo.py"
    copy.write_text(source.replace(loss, "losses = (1 - label_smoothing) * F.logsigmoid(beta * h)"))
    out = str(tmp_path / "run")
    run_script(str(copy), "--output_dir", out, "--seed", "1", env={"PYTHONPATH": ROOT})
    value = toy_bench.final_metric(out, "dpo")
    with open(toy_bench.EXPECTED) as f:
        low = json.load(f)["toy"]["dpo"]["low"]
    assert value < low
    assert "outside the expected band" in toy_bench.check_learning("dpo", value)
