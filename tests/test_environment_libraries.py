"""Environments from verifiers and OpenEnv through --environment (plumbing/environment_libraries.py): each library's
environment, written here around the toy tool world's lookup (no network, no hub), shows its tools, gets the row at
reset, is stepped by a tool call, and scores the episode as the library itself scores it; bad specs are one-line
errors naming the flag; and each trains a short grpo.py run on the toy tool world."""

import asyncio
import types

import pytest
from conftest import read_metrics, run_script

from plumbing import episodes as ep
from plumbing import reward_sources as rs
from plumbing.errors import UserError
from toy_worlds import toy_tools

VERIFIERS_ENV = '''
import verifiers.v1 as vf

from toy_worlds import toy_tools


class BoxState(vf.State):
    lookups: int = 0


class Boxes(vf.Toolset[vf.ToolsetConfig, BoxState]):
    TOOL_PREFIX = None  # advertised as `lookup` (the tool world's vocabulary), not `boxes_lookup`

    @vf.tool
    def lookup(self, box: str) -> str:
        """Look up the letters kept in a box.

        Args:
            box: the box number, its digits separated by spaces
        """
        self.state.lookups += 1
        return toy_tools.lookup(box)


class SortBox(vf.Task[vf.TaskData, BoxState]):
    @vf.reward
    async def sorted_letters(self, task, trace) -> float:
        return toy_tools.gold_score(task.prompt_text, trace.last_reply)

    @vf.reward(weight=0.1)
    async def looked_up(self, trace) -> float:
        return float(trace.state.lookups > 0)

    @classmethod
    def toolsets(cls, config):
        return [Boxes(vf.ToolsetConfig())]


class SortBoxes(vf.Taskset[SortBox]):
    def load(self):
        for box in ("1 2 3", "4 5 6"):
            yield SortBox(vf.TaskData(prompt=f"sort box {box}"))


NOT_A_TASKSET = 3
'''

OPENENV_ENV = '''
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics.base import Rubric
from pydantic import Field

from toy_worlds import toy_tools


class LookupAction(Action):
    """Look up the letters kept in a box."""
    box: str = Field(description="the box number, its digits separated by spaces")


class LookupObservation(Observation):
    letters: str = ""


class FirstLookup(Rubric):
    """1 for an episode's first successful lookup, 0 for the others."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def reset(self):
        self.seen = False

    def forward(self, action, observation):
        score = float(bool(observation.letters) and not self.seen)
        self.seen = self.seen or bool(observation.letters)
        return score


class BoxEnvironment(Environment[LookupAction, LookupObservation, State]):
    def __init__(self):
        super().__init__(rubric=FirstLookup())
        self._state, self.row = State(), None

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._reset_rubric()
        self._state, self.row = State(episode_id=episode_id, step_count=0), kwargs
        return LookupObservation()

    def step(self, action: LookupAction, timeout_s=None, **kwargs):
        self._state.step_count += 1
        observation = LookupObservation(letters=toy_tools.lookup(action.box), done=self._state.step_count >= 2)
        observation.reward = self._apply_rubric(action, observation)
        return observation

    @property
    def state(self):
        return self._state


def not_an_environment():
    return object()
'''

PROMPT = [{"role": "user", "content": "sort box 1 2 3"}]
EPISODE = [  # what the episode loop records: a tool call, its result, the answer
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "lookup", "arguments": {"box": "1 2 3"}}}]},
    {"role": "tool", "name": "lookup", "content": toy_tools.lookup("1 2 3")},
    {"role": "assistant", "content": " ".join(sorted(toy_tools.hidden_letters("1 2 3")))},
]


@pytest.fixture
def verifiers_file(tmp_path):
    pytest.importorskip("verifiers.v1")
    path = tmp_path / "vf_boxes.py"
    path.write_text(VERIFIERS_ENV)
    return str(path)


@pytest.fixture
def openenv_file(tmp_path):
    pytest.importorskip("openenv.core")
    path = tmp_path / "openenv_boxes.py"
    path.write_text(OPENENV_ENV)
    return str(path)


def load(spec, tokenizer):
    return ep.load_toolset(types.SimpleNamespace(tools=None, environment=spec), tokenizer)


def one_line_error(spec, tokenizer, match):
    with pytest.raises(UserError, match=match) as error:
        load(spec, tokenizer)
    assert "--environment" in str(error.value) and "\n" not in str(error.value)


def test_a_verifiers_taskset_as_an_environment(verifiers_file, qwen_tokenizer):
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    toolset = load(f"verifiers:{verifiers_file}:SortBoxes", qwen_tokenizer)
    assert toolset.names == ["lookup"] and [t.__name__ for t in toolset.environment_types] == ["SortBox"]
    assert toolset.schemas[0]["function"]["parameters"]["properties"]["box"]["type"] == "string"
    environment = toolset.new_environment()
    assert environment.reset(prompt=PROMPT, environment_notes="not a TaskData field") is None
    assert environment.task.data.prompt_text == "sort box 1 2 3"  # the row built the episode's Task
    assert toolset.tools_for(environment)["lookup"](box="1 2 3") == toy_tools.lookup("1 2 3")
    assert environment.state.lookups == 1  # the tool's self.state is the episode's

    reward = rs.environment_reward(type(environment))
    [score] = reward.fn(environments=[environment], prompts=[PROMPT], completions=[EPISODE])
    # verifiers' own scoring of the same episode, its Trace built here by hand
    messages = [vf.UserMessage(content=PROMPT[0]["content"]),
                vf.AssistantMessage(content="", tool_calls=[vf.ToolCall(id="a", name="lookup",
                                                                        arguments='{"box": "1 2 3"}')]),
                vf.ToolMessage(tool_call_id="a", content=EPISODE[1]["content"]),
                vf.AssistantMessage(content=EPISODE[2]["content"])]
    nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=m.role == "assistant")
             for i, m in enumerate(messages)]
    task = type(environment.task)(environment.task.data)
    trace = vf.Trace(task=TraceTask(type="SortBox", data=task.data), agent=AgentInfo(config=vf.AgentConfig()),
                     nodes=nodes, state=type(environment.state)(lookups=1))
    asyncio.run(task.score(trace))
    assert score == pytest.approx(trace.reward) and score == pytest.approx(1.0 + 0.1)
    environment.reset(prompt=PROMPT)  # a new episode: no lookup, a wrong answer
    assert reward.fn(environments=[environment], prompts=[PROMPT], completions=[[
        {"role": "assistant", "content": "a"}]]) == [pytest.approx(toy_tools.gold_score("sort box 1 2 3", "a"))]

    one_line_error(f"verifiers:{verifiers_file}:NOT_A_TASKSET", qwen_tokenizer, "not a verifiers Taskset")
    one_line_error("verifiers:missing_file.py:SortBoxes", qwen_tokenizer, "not found")
    one_line_error("verifiers:no-such-taskset", qwen_tokenizer, "verifiers cannot load taskset")


def test_an_openenv_environment_as_an_environment(openenv_file, qwen_tokenizer):
    toolset = load(f"openenv:{openenv_file}:BoxEnvironment", qwen_tokenizer)
    assert toolset.names == ["lookup"] and [t.__name__ for t in toolset.environment_types] == ["BoxEnvironment"]
    box = toolset.schemas[0]["function"]["parameters"]["properties"]["box"]  # the Action's field, described
    assert box["type"] == "string" and "digits separated by spaces" in box["description"]
    adapter = toolset.new_environment()
    assert adapter.reset(prompt=PROMPT, answer="x") is None  # an empty reset observation adds nothing
    assert adapter.environment.row == {"answer": "x"}  # the row's columns but the prompt reach OpenEnv's reset
    lookup = toolset.tools_for(adapter)["lookup"]
    assert lookup(box="1 2 3") == toy_tools.lookup("1 2 3") and adapter.environment.state.step_count == 1
    assert lookup(box="4 5 6") == toy_tools.lookup("4 5 6")
    with pytest.raises(RuntimeError, match="episode is over"):  # the environment said done
        lookup(box="4 5 6")

    direct = type(adapter.environment)()  # OpenEnv's own rewards for the same actions: the rubric's, summed
    direct.reset()
    action_type = type(direct).step.__annotations__["action"]  # LookupAction
    expected = sum(direct.step(action_type(box=box)).reward for box in ("1 2 3", "4 5 6"))
    [score] = rs.environment_reward(type(adapter)).fn(environments=[adapter], prompts=[PROMPT], completions=[[]])
    assert score == expected == 1.0
    adapter.reset(prompt=PROMPT)
    assert adapter.get_reward() == 0.0

    one_line_error(f"openenv:{openenv_file}:not_an_environment", qwen_tokenizer, "has no reset")
    one_line_error(f"openenv:{openenv_file}:Missing", qwen_tokenizer, "not an OpenEnv Environment")
    one_line_error("openenv:no_such_package.module:Env", qwen_tokenizer, "cannot import")


def train(tmp_path, *args):
    out = str(tmp_path / "run")
    run_script("grpo.py", "--model", "toy_tools", *args, "--max_steps", "2", "--num_eval_prompts", "8",
               "--eval_steps", "0", "--output_dir", out, threads=1)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and "tools/call_frequency" in rows[1]
    return rows


def test_grpo_trains_with_a_verifiers_environment(toy_tools_world, verifiers_file, tmp_path):
    """The taskset's Task scores the episodes: the only reward source."""
    rows = train(tmp_path, "--environment", f"verifiers:{verifiers_file}:SortBoxes", "--reward_funcs", "None")
    assert all(0 < r["reward/SortBox/mean"] <= 1.1 for r in rows[1:]) and not any("reward/gold/mean" in r for r in rows)


def test_grpo_trains_with_an_openenv_environment(toy_tools_world, openenv_file, tmp_path):
    """The environment's rubric rewards the lookup, the gold score the answer."""
    rows = train(tmp_path, "--environment", f"openenv:{openenv_file}:BoxEnvironment")
    # the rubric pays an episode's first lookup: its mean is the fraction of episodes that looked a box up
    assert all(0 < r["reward/BoxEnvironment/mean"] <= 1 and "reward/gold/mean" in r for r in rows[1:])
