"""Environments as TRL 1.16 users bring them (`GRPOTrainer(environment_factory=)`): any callable as the factory,
several factories picked per row by the `environment` column (only that environment's tools in the row's prompt),
the prompt after reset's text (its length measured by the default --max_prompt_length, and what reward functions
get), and a --model alias's tools and reward giving way to the user's own."""

import json
import os
import types

import pytest
from conftest import read_metrics, run_script

import grpo
import rloo
from plumbing import environments as envs
from plumbing import episodes as ep
from plumbing import reward_sources as rs
from plumbing import run_utils as ru
from plumbing.errors import UserError

ENVIRONMENTS = '''
from toy_worlds import toy_tools


class Box:
    """The tool world's lookup as an environment whose reset adds a hint to the prompt."""

    def reset(self, **row):
        self.row, self.looked_up = row, 0
        return " hint : the box holds 3 to 6 letters"

    def lookup(self, box: str) -> str:
        """Look up the letters kept in a box.

        Args:
            box: the box number, its digits separated by spaces
        """
        self.looked_up += 1
        return toy_tools.lookup(box)

    def get_reward(self) -> float:
        return float(min(self.looked_up, 1))


class Counter:
    """A second environment with another tool, for the per-row choice."""

    def reset(self, **row):
        self.row = row

    def count(self, text: str) -> int:
        """Count the words of a text.

        Args:
            text: any text
        """
        return len(text.split())


def make_box():  # a factory function, as TRL takes
    return Box()


def record_prompts(prompts, completions, **columns):
    import os, json
    with open(os.environ["PROMPTS_LOG"], "a") as f:
        f.write(json.dumps(prompts) + "\\n")
    return [0.0] * len(completions)
'''


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVIRONMENTS)
    return str(path)


def test_a_factory_function_and_several_environments_picked_per_row(env_file, qwen_tokenizer):
    single = ep.load_toolset(types.SimpleNamespace(tools=None, environment=f"{env_file}:make_box"), qwen_tokenizer)
    assert single.names == ["lookup"] and [t.__name__ for t in single.environment_types] == ["Box"]
    assert type(single.new_environment()).__name__ == "Box"

    args = types.SimpleNamespace(tools=None, environment=[f"box={env_file}:make_box", f"counter={env_file}:Counter"])
    toolset = ep.load_toolset(args, qwen_tokenizer)
    assert sorted(toolset.names) == ["count", "lookup"] and sorted(toolset.factories) == ["box", "counter"]
    prompt = [{"role": "user", "content": "sort box 1 2 3"}]
    rows = [dict(prompt=prompt, environment="counter", answer="x"), dict(prompt=prompt, environment="box", answer="y"),
            dict(prompt=prompt, environment="counter", answer="z")]
    # a row's prompt shows its own environment's tools only (TRL's per-row schema)
    assert [s["function"]["name"] for s in toolset.schemas_for(rows[0])] == ["count"]
    assert [s["function"]["name"] for s in toolset.schemas_for(rows[1])] == ["lookup"]
    pool = envs.EnvironmentPool(toolset)
    first = pool.for_rows(rows)
    assert [type(e).__name__ for e in first] == ["Counter", "Box", "Counter"] and first[0] is not first[2]
    assert pool.for_rows(rows) == first  # the same instances next step: constructed once, reset often
    episodes = ep.start_episodes([r["prompt"] for r in rows], rows, toolset, qwen_tokenizer, first, 2000)
    assert first[0].row == dict(prompt=prompt, answer="x")  # the picking column is not reset's argument (TRL)
    assert set(episodes[0].tools) == {"count"} and set(episodes[1].tools) == {"lookup"}
    assert episodes[1].prompt[-1]["content"] == "sort box 1 2 3 hint : the box holds 3 to 6 letters"
    rendered = qwen_tokenizer.decode(episodes[0].prompt_ids)
    assert '"count"' in rendered and '"lookup"' not in rendered
    with pytest.raises(UserError, match="not one of --environment's names"):
        toolset.schemas_for(dict(prompt=prompt, environment="nope"))
    with pytest.raises(UserError, match="several environments need a name each"):
        ep.load_toolset(types.SimpleNamespace(tools=None, environment=[f"{env_file}:Box", f"{env_file}:Counter"]),
                        qwen_tokenizer)
    with pytest.raises(UserError, match="not a class or a function"):
        ep.load_toolset(types.SimpleNamespace(tools=None, environment=f"{env_file}:ENVIRONMENTS_MISSING"),
                        qwen_tokenizer)


def test_environment_rewards_one_source_per_class(env_file, qwen_tokenizer):
    args = types.SimpleNamespace(tools=None, environment=[f"a={env_file}:make_box", f"b={env_file}:Box",
                                                          f"c={env_file}:Counter"])
    toolset = ep.load_toolset(args, qwen_tokenizer)
    sources = [rs.environment_reward(t) for t in toolset.environment_types if hasattr(t, "get_reward")]
    assert [s.name for s in sources] == ["Box"]  # two names, one class: one reward column (TRL's dedup)
    box, counter = toolset.new_environment("a"), toolset.new_environment("c")
    box.reset(), counter.reset()
    box.lookup("1 2 3")
    assert sources[0].fn(environments=[box, counter]) == [1.0, None]  # another class's episode: not scored


def test_user_tools_and_rewards_replace_the_aliases():
    for script in (rloo, grpo):
        parse = lambda *argv: ru.parse_args(script.Args, script.ALIAS_DEFAULTS, argv=["--model", "toy_tools", *argv])  # noqa: E731
        alias = parse()
        assert alias.tools == ["toy_worlds.toy_tools:lookup"] and alias.reward_funcs == ["gold"]
        env = parse("--environment", "envs.py:Box")
        assert env.tools is None and env.environment == ["envs.py:Box"] and env.reward_funcs == ["gold"]
        assert env.max_prompt_length is None  # the user's environment changes the prompts: measured, not the alias's
        tools = parse("--tools", "my.py:f")
        assert tools.tools == ["my.py:f"] and tools.environment is None and tools.max_prompt_length == 16
        rewards = parse("--reward_funcs", "my.py:r")
        assert rewards.reward_funcs == ["my.py:r"] and rewards.tools == ["toy_worlds.toy_tools:lookup"]


def test_grpo_with_a_factory_whose_reset_lengthens_the_prompt(toy_tools_world, env_file, tmp_path):
    """The issue's failures in one run: `--model toy_tools --environment envs.py:make_box` (a factory function; the
    alias's own lookup would clash with the environment's; its reset text would not fit the alias's 16-token prompts)
    trains, reward functions get the prompt after reset, and the environment's get_reward is a reward source."""
    out, log = str(tmp_path / "run"), str(tmp_path / "prompts.jsonl")
    trl_reward = os.path.join(os.path.dirname(__file__), "..", "benchmark", "toy_environment.py")
    trl_reward += ":gold_with_trl_arguments"  # a reward function taking TRL's extra arguments
    run_script("grpo.py", "--model", "toy_tools", "--environment", f"{env_file}:make_box", "--reward_funcs", "gold",
               f"{env_file}:record_prompts", trl_reward, "--max_steps", "2", "--num_eval_prompts", "8",
               "--eval_steps", "0", "--output_dir", out, env={"PROMPTS_LOG": log})
    with open(os.path.join(out, "args.json")) as f:
        recorded = json.load(f)
    assert recorded["tools"] is None and recorded["max_prompt_length"] > 16  # measured after reset's text
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("reward/Box/mean" in r for r in rows[1:]) and "tools/call_frequency" in rows[1]
    # a reward function using TRL's extra arguments: its log_metric lands in the metrics, train and eval
    assert 0 <= rows[1]["tool_world/exact"] <= 1 and 0 <= rows[2]["eval/tool_world/exact"] <= 1
    with open(log) as f:
        prompts = [p for line in f for p in json.loads(line)]
    assert prompts and all(p[-1]["content"].endswith(" hint : the box holds 3 to 6 letters") for p in prompts)
