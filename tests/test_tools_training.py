"""grpo.py and rloo.py learn the toy tool world (`--model toy_tools`, multi-turn episodes with a lookup tool) with its
alias defaults: held-out gold (greedy episodes) rises by at least 0.3 and the sampled episodes call the tool more
often, on 1 process (grpo) and 2 processes (rloo, the same global batch). benchmark/toy_tool_world.py measures all four
combinations over seeds (benchmark/results/toy_tools.md)."""

from conftest import read_metrics, run_script
from test_scale import run_distributed


def check_learned(rows):
    evals = [r for r in rows if "eval/gold_score" in r]
    train = [r for r in rows if r["step"] > 0 and "tools/call_frequency" in r]
    assert evals[-1]["eval/gold_score"] >= evals[0]["eval/gold_score"] + 0.3
    tail = train[-len(train) // 10:]
    calls_after = sum(r["tools/call_frequency"] for r in tail) / len(tail)
    assert calls_after > train[0]["tools/call_frequency"] + 0.2  # the SFT policy's samples call it about half the time
    assert sum(r["objective/scores"] for r in tail) / len(tail) > train[0]["objective/scores"] + 0.2  # sampled gold
    assert all(r["tools/failure_frequency"] < 0.2 for r in train)
    assert all(1 <= r["episodes/turns"] <= 3 for r in train)  # at most 2 tool rounds: 3 sampled turns
    assert evals[-1]["eval/tools/call_frequency"] >= 0.9


def test_grpo_learns_the_tool_world(toy_tools_world, tmp_path):
    out = str(tmp_path / "grpo_tools")
    run_script("grpo.py", "--model", "toy_tools", "--output_dir", out, timeout=900)
    check_learned(read_metrics(out))


def test_rloo_learns_the_tool_world_on_two_processes(toy_tools_world, tmp_path):
    out = str(tmp_path / "rloo_tools")
    run_distributed("rloo.py", "--model", "toy_tools", "--per_device_train_batch_size", "32", "--output_dir", out,
                    timeout=900)
    check_learned(read_metrics(out))
