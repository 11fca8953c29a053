"""One tiny end-to-end run of every script on the toy task (2 steps, a few held-out items: conftest.tiny_args): the
fast tier's check that each script still starts, trains, evaluates, logs and saves. The full suite runs each much
further; it shares these runs (conftest's shared_run) with the tests that compare a flag's run with the plain one
(--cache_implementation static here, --padding_free, --logprob_chunk_tokens, --token_budget)."""

import math
import os

import pytest
from conftest import TINY, read_metrics, run_script, tiny_args, without_wall_clock

EVAL_KEY = {"reward.py": "eval/accuracy"}  # the others: the gold score of greedy completions


@pytest.mark.fast
@pytest.mark.parametrize("script", sorted(TINY))
def test_tiny_run(script, toy, shared_run):
    proc, out = shared_run(script, *tiny_args(script))
    rows = read_metrics(out)
    assert sorted({r["step"] for r in rows}) == [0, 1, 2]
    evals = [r for r in rows if EVAL_KEY.get(script, "eval/gold_score") in r]
    assert [r["step"] for r in evals] == [0, 2]  # before training and after the last step
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert all("lr" in r and "nonfinite/skipped" in r for r in rows if r["step"] > 0 and "loss" in r or
               "objective/scores" in r)
    # every step's perf/* (throughput.py); the sampling scripts' share of the step spent generating
    trained = [r for r in rows if r["step"] > 0 and "perf/step_seconds" in r]
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert r["perf/tokens_per_second"] * r["perf/step_seconds"] > 2 and r["perf/peak_memory_gib"] > 0.05
        assert "perf/mfu" not in r  # a CPU
        if script in ("rloo.py", "grpo.py", "ppo.py"):
            assert 0 < r["perf/generation_share"] < 1 and 0 <= r["perf/padding_fraction"] < 1
    assert "  perf:    " in proc.stdout and " tokens/s, " in proc.stdout  # the run summary's line
    assert os.path.exists(os.path.join(out, "model", "config.json")) or \
        os.path.exists(os.path.join(out, "model", "adapter_config.json"))


@pytest.mark.parametrize("script", ["rloo.py", "sft.py"])
def test_static_cache_gives_the_same_run(script, toy, tmp_path, shared_run):
    """--cache_implementation static (HF generate writes a preallocated key/value cache): the run of the default
    (dynamic) cache, the tiny run test_tiny_run checks, to float rounding, through rloo's sampling (prompts shared over
    its k samples) and evaluation, and sft's greedy evaluation. Wall-clock and memory metrics aside."""
    out = str(tmp_path / "static")
    run_script(script, *tiny_args(script), "--cache_implementation", "static", "--output_dir", out)
    runs = {"dynamic": read_metrics(shared_run(script, *tiny_args(script))[1]), "static": read_metrics(out)}
    assert len(runs["static"]) == len(runs["dynamic"])
    for dynamic, static in zip(without_wall_clock(runs["dynamic"]), runs["static"]):
        numbers = {k for k, v in dynamic.items() if isinstance(v, float)}
        assert numbers and numbers <= set(static), sorted(numbers - set(static))
        for key in numbers:
            assert static[key] == pytest.approx(dynamic[key], rel=1e-4, abs=1e-4), key
