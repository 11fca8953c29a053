"""What a person sees: third-party noise off by default (--verbose brings it back), a progress line every tenth of the
run on a non-terminal, an evaluation line with rotating samples, and a summary at the end."""

import json
import os

import pytest
from conftest import run_script

from plumbing import metrics_log as ml

NOISE = ("LOAD REPORT", "Setting accelerator", "Saving the dataset", "Loading weights", "Writing model shards")


def test_fresh_toy_build_and_run_are_quiet_and_end_with_a_summary(fresh_toy_run):
    """A new user's first `python rloo.py`, on a machine without the toy world (built here into an empty cache):
    none of the libraries' noise, progress lines, and a summary with gold before -> after and the model path."""
    proc, out, _ = fresh_toy_run
    text = proc.stdout + proc.stderr
    assert "[toy] sft trained" in text  # the world was built in this run
    assert not [n for n in NOISE if n in text], [n for n in NOISE if n in text]
    assert "\r" not in text  # no bar redrawn in place on a non-terminal
    assert "step 5/10 (50%)" in proc.stdout and "episodes/s" in proc.stdout
    assert proc.stdout.count("eval @ step") == 3  # steps 0, 5, 10: one line each
    lines = proc.stdout.strip().splitlines()
    summary = lines[next(i for i, line in enumerate(lines) if line.startswith("summary: step 10")):]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    gold = [r["eval/gold_score"] for r in rows if "eval/gold_score" in r]
    assert any(line.split() == ["eval/gold_score", ml.short_number(gold[0]), "->", ml.short_number(gold[-1]),
                                "(step", "0", "->", "10)"] for line in summary), summary
    assert summary[-3:] == [f"  model:   {out}/model", f"  metrics: {out}/metrics.jsonl",
                            f"  plot:    python benchmark/plot.py {out}"]


def test_verbose_brings_the_library_output_back(toy, tmp_path):
    """ppo.py without a reward model starts its value model from the policy: transformers reports the new scalar
    head with a LOAD REPORT table, which the quiet default replaces by one line of ours."""
    args = ["--reward_funcs", "gold", "--max_steps", "1", "--num_eval_prompts", "4"]
    quiet = run_script("ppo.py", *args, "--output_dir", str(tmp_path / "quiet"), fresh=True)  # all a user sees
    loud = run_script("ppo.py", *args, "--verbose", "--output_dir", str(tmp_path / "loud"), fresh=True)
    quiet_text, loud_text = quiet.stdout + quiet.stderr, loud.stdout + loud.stderr
    assert "new score.weight initialised" in quiet_text and not [n for n in NOISE if n in quiet_text]
    assert "LOAD REPORT" in loud_text and "Loading weights" in loud_text


def test_progress_on_a_non_terminal_prints_a_line_every_tenth(capsys):
    progress = ml.Progress(total=20, done=0, items_per_step=64, items="episodes", keys=("objective/kl",
                                                                                        "eval/gold_score"))
    for step in range(1, 21):
        progress.update(step, {"objective/kl": step / 10, **({"eval/gold_score": 0.5} if step == 5 else {})})
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[1] for line in lines] == [f"{s}/20" for s in range(2, 21, 2)]
    assert lines[1].endswith("kl 0.4") and lines[2].endswith("kl 0.6  eval/gold_score 0.5")  # the latest eval kept


def test_samples_rotate_and_the_summary_reads_the_first_and_last_evaluation(tmp_path, capsys):
    logger = ml.MetricsLogger(str(tmp_path / "run"), {"seed": 1})
    rows = [{"prompt": f"p{i}", "completion": "x", "score": float(i)} for i in range(10)]
    shown = []
    for step in range(3):
        logger.log_samples("eval/samples", rows, step, 4)
        shown.append([line.split()[0] for line in capsys.readouterr().out.strip().splitlines()[1:]])
    assert shown == [["p0", "p1", "p2", "p3"], ["p4", "p5", "p6", "p7"], ["p8", "p9", "p0", "p1"]]
    logger.log({"eval/gold_score": 0.25, "eval/scores": -1.5, "eval/kl": 0.0}, step=0)
    logger.log({"objective/kl": 0.3}, step=1)
    logger.log({"eval/gold_score": 0.75, "eval/scores": 2.0, "eval/kl": 1.25}, step=2)
    assert capsys.readouterr().out.splitlines() == ["eval @ step 0: gold_score 0.25  scores -1.5  kl 0",
                                                     "eval @ step 2: gold_score 0.75  scores 2  kl 1.25"]
    logger.close(str(tmp_path / "run" / "model"))
    summary = capsys.readouterr().out.splitlines()
    assert summary[0].startswith("summary: step 2, ")
    assert summary[1:4] == ["  eval/gold_score  0.25 -> 0.75   (step 0 -> 2)",
                            "  eval/scores      -1.5 -> 2   (step 0 -> 2)",
                            "  eval/kl          0 -> 1.25   (step 0 -> 2)"]


@pytest.mark.parametrize("value, text", [(0.0, "0"), (3, "3"), (0.123456, "0.1235"), (-4.15432, "-4.154"),
                                         (1234567.0, "1.235e+06"), (True, "True")])
def test_short_numbers(value, text):
    assert ml.short_number(value) == text
