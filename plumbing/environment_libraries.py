"""Environments from the two libraries RL users already have, as --environment factories (TRL's contract, read by
episodes.py and environments.py): `--environment verifiers:SPEC` and `--environment openenv:SPEC`. Each adapter is a
class made once per spec, one instance per episode like any environment: `reset(**row)`, its tools as public
methods (schemas from their type hints and a generated Google docstring), `get_reward(...)` one reward source logged
under the wrapped class's name. Everything runs in this process: no tool server, container or network.

verifiers (0.4, `verifiers.v1`): SPEC is `file.py:Name`, `package.module:Name` (a Taskset class or instance, a Task
class, or a function returning a Taskset) or an installed taskset id (`verifiers:my-taskset`).
  - tools: the @vf.tool methods of the taskset's and the task's Toolsets, named as verifiers advertises them
    (`<server>_<tool>`, bare with TOOL_PREFIX = None); a tool's `self.state` is the episode's State (the Task's type).
  - reset(**row): the row's columns named like the Task's TaskData fields (prompt, answer, info, ...) build the
    episode's Task (the prompt shown is still the dataset's); task-scoped Toolsets get setup_task(task).
  - reward: the Task's own scoring, `Task.score(trace)` -> `trace.reward` (the weighted sum of its @vf.reward
    functions and judges) on a Trace of the episode: the prompt, the sampled turns, the tool results. Rewards that
    need a sandbox runtime are skipped, as verifiers does when scoring without one.
  Not used: the taskset's own task list (prompts come from --dataset), harnesses, runtimes, @vf.stop, metrics.

OpenEnv (openenv-core 0.3): SPEC is `file.py:Name` or `package.module:Name`, an Environment class (made with no
arguments) or a function returning an environment or a sync client (`MyEnv(base_url=...).sync()`, TRL's examples).
  - one tool per environment: `step(action)` with the Action's fields as arguments, named after the Action class
    (`LookupAction(box: str)` -> `lookup(box)`; TRL's OpenEnv examples name it so by hand). The result is the
    observation's fields other than done/reward/metadata (one field: its value; several: a JSON object).
  - reset(**row): the environment's reset with the row's columns it takes (all but `prompt` if it takes **kwargs);
    a non-empty reset observation is appended to the prompt.
  - reward: the sum of the rewards the environment returned in the episode (its Rubric's, through observation.reward
    or the client's StepResult.reward). A step after `done` is an error the model reads.
The libraries are imported only when their prefix is used."""

from __future__ import annotations

import inspect
import json
import re
import typing
from typing import Callable, Optional

from plumbing import run_utils as ru
from plumbing.errors import UserError

LIBRARIES = ("verifiers", "openenv")


def factory(spec: str) -> Optional[Callable]:
    """The environment factory of `verifiers:SPEC` or `openenv:SPEC` (see the module docstring); None for any other
    spec (a plain file.py:Class, loaded by the caller). Errors are one-line UserErrors naming --environment."""
    library, _, rest = spec.partition(":")
    if library not in LIBRARIES or not rest:
        return None
    return verifiers_factory(spec, rest) if library == "verifiers" else openenv_factory(spec, rest)


def _load(spec: str, rest: str):
    try:
        return ru.load_object(rest, "--environment")
    except UserError as e:  # name the whole spec, prefix included
        raise UserError(str(e).replace(repr(rest), repr(spec), 1)) from None


def _tool_method(name: str, description: str, parameters: list, hints: dict, arguments: dict, call: Callable):
    """A method named `name` for the adapter class: signature (self, *parameters), type hints `hints`, a Google
    docstring of `description` and `arguments` (name -> description), so transformers' get_json_schema shows it like
    a hand-written tool; calling it runs call(self, kwargs)."""
    def method(self, **kwargs):
        return call(self, kwargs)

    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = inspect.Signature([self_parameter] + parameters)
    method.__name__ = method.__qualname__ = name
    method.__annotations__ = dict(hints)
    lines = [f"    {arg}: {(text or arg).strip()}" for arg, text in arguments.items()]
    method.__doc__ = (description.strip() or name) + ("\n\nArgs:\n" + "\n".join(lines) if lines else "")
    return method


# ---------------------------------------------------------------------------------------------------------
# verifiers
# ---------------------------------------------------------------------------------------------------------
def _verifiers_task(spec: str, rest: str):
    """The spec's (Task class, TaskConfig, taskset-scoped Toolsets)."""
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise UserError(f"--environment {spec!r}: needs the verifiers package (pip install verifiers==0.4.0)") from None
    if ":" not in rest:  # an installed taskset's id, as `vf-eval <id>` takes it
        try:
            obj = vf.load_taskset(vf.taskset_config_type(rest)(id=rest))
        except Exception as e:
            raise UserError(f"--environment {spec!r}: verifiers cannot load taskset {rest!r} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
    else:
        obj = _load(spec, rest)
    if inspect.isclass(obj) and issubclass(obj, vf.Task):
        return obj, obj.config_type()(), []
    if inspect.isclass(obj) and issubclass(obj, vf.Taskset):
        from verifiers.v1.utils.generic import concrete_type

        obj = obj((concrete_type(obj, vf.TasksetConfig) or vf.TasksetConfig)())  # its config's defaults
    elif callable(obj) and not isinstance(obj, vf.Taskset):
        try:
            obj = obj()
        except Exception as e:
            raise UserError(f"--environment {spec!r}: {getattr(obj, '__name__', rest)}() raised "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(obj, vf.Taskset):
        raise UserError(f"--environment {spec!r}: got {type(obj).__name__}, not a verifiers Taskset (class or "
                        "instance), Task class, or a function returning a Taskset")
    return obj.task_type(), obj.config.task, type(obj).toolsets(obj.config)


def _verifiers_tools(toolsets: list) -> dict:
    """Advertised tool name -> (bound @vf.tool method, its Toolset), as verifiers names them for the model."""
    from verifiers.v1.utils.decorators import discover_decorated

    tools = {}
    for toolset in toolsets:
        for fn in discover_decorated(toolset, "tool"):
            raw = getattr(fn, "tool_name", None) or fn.__name__
            tools[f"{toolset.server_name}_{raw}" if toolset.server_name else raw] = (fn, toolset)
    return tools


def _google_arguments(doc: str, names: list) -> tuple:
    """(description, {argument: description}) of a docstring, Google-style Args: read when present."""
    description, _, args = (doc or "").partition("Args:")
    described = dict(re.findall(r"^\s*(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", args.split("Returns:")[0], re.MULTILINE))
    return description.strip(), {name: described.get(name, name) for name in names}


def verifiers_factory(spec: str, rest: str) -> type:
    """The environment class of a verifiers taskset (module docstring): one instance per episode."""
    from verifiers.v1.mcp.server import _call_state  # the tool's `self.state` (verifiers' per-call context)
    from verifiers.v1.state import state_cls

    task_type, task_config, shared_toolsets = _verifiers_task(spec, rest)
    data_type, state_type = task_type.data_type(), state_cls(task_type)
    for toolset in shared_toolsets:  # taskset-scoped servers: set up once, shared by every episode (verifiers' too)
        ru.awaited(toolset.setup())
    probe_tools = _verifiers_tools(shared_toolsets + task_type.toolsets(task_config))

    def tool(name):
        def call(self, kwargs):
            fn, _ = self._tools[name]
            token = _call_state.set(self.state)
            try:
                return ru.awaited(fn(**kwargs))
            finally:
                _call_state.reset(token)
        return call

    def __init__(self):
        self._toolsets = task_type.toolsets(task_config)  # task-scoped servers: one per episode slot
        for toolset in self._toolsets:
            ru.awaited(toolset.setup())
        self._tools = _verifiers_tools(shared_toolsets + self._toolsets)
        self.task, self.state = None, state_type()

    def reset(self, **row):
        fields = {k: v for k, v in row.items() if k in data_type.model_fields}
        try:
            data = data_type.model_validate(fields)
        except Exception as e:
            raise ValueError(f"{data_type.__name__} cannot be built from the row's columns {sorted(fields)}: "
                             f"{str(e).splitlines()[0]}") from None
        self.task, self.state = task_type(data, task_config), state_type()
        for toolset in self._toolsets:
            ru.awaited(toolset.setup_task(self.task))
        return None

    def get_reward(self, prompt, completion) -> float:
        """The Task's score of this episode (verifiers' Task.score on a Trace of it)."""
        trace = verifiers_trace(self.task, prompt, completion, self.state)
        ru.awaited(self.task.score(trace))
        return trace.reward

    methods = {"__init__": __init__, "reset": reset, "get_reward": get_reward, "__doc__": task_type.__doc__}
    for name, (fn, _) in probe_tools.items():
        signature, hints = inspect.signature(fn), typing.get_type_hints(fn)
        description, arguments = _google_arguments(inspect.getdoc(fn), list(signature.parameters))
        methods[name] = _tool_method(name, description, list(signature.parameters.values()), hints, arguments,
                                     tool(name))
    return type(task_type.__name__, (), methods)


def verifiers_trace(task, prompt, completion, state=None):
    """A verifiers Trace of one episode: the prompt's messages (text: one user message), then the episode's
    conversation (assistant turns, sampled, with their tool calls; tool messages matched to the calls in order)."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
    nodes, calls = [], []
    for message, sampled in [(m, False) for m in messages] + [(m, m.get("role") == "assistant") for m in completion]:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant":
            tool_calls = []
            for call in message.get("tool_calls") or []:
                if "function" in call:  # an unparseable call has no name: the model read an error for it
                    calls.append(f"call_{len(calls)}")
                    arguments = call["function"].get("arguments", {})
                    tool_calls.append(vf.ToolCall(id=calls[-1], name=call["function"]["name"], arguments=arguments
                                                  if isinstance(arguments, str) else json.dumps(arguments)))
            vf_message = vf.AssistantMessage(content=content, tool_calls=tool_calls or None)
        elif role == "tool":
            vf_message = vf.ToolMessage(tool_call_id=calls.pop(0) if calls else "call_unmatched", content=content,
                                        name=message.get("name"))
        elif role == "system":
            vf_message = vf.SystemMessage(content=content)
        else:
            vf_message = vf.UserMessage(content=content)
        nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, message=vf_message, sampled=sampled))
    trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data), agent=AgentInfo(config=vf.AgentConfig()),
                     nodes=nodes, is_completed=True, ok=True)
    if state is not None:
        trace.state = state
    return trace


# ---------------------------------------------------------------------------------------------------------
# OpenEnv
# ---------------------------------------------------------------------------------------------------------
def _action_type(environment) -> Optional[type]:
    """The Action class an OpenEnv environment or client steps with: step's annotation, else the class's generic
    arguments (Environment[ActT, ObsT, StateT], EnvClient[ActT, ...])."""
    try:
        hint = typing.get_type_hints(type(environment).step).get("action")
    except Exception:
        hint = None
    if inspect.isclass(hint) and hasattr(hint, "model_fields"):
        return hint
    for klass in type(environment).__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            arguments = typing.get_args(base)
            if arguments and inspect.isclass(arguments[0]) and hasattr(arguments[0], "model_fields"):
                return arguments[0]
    return None


def _observation_text(observation) -> str:
    """An observation as the model reads it: its fields but done, reward and metadata; one field: its value."""
    fields = observation.model_dump(exclude={"done", "reward", "metadata"}) if hasattr(observation, "model_dump") \
        else {"observation": observation}
    if len(fields) == 1:
        value = next(iter(fields.values()))
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(fields) if fields else ""


def _tool_name(action_type: type) -> str:
    name = action_type.__name__.removesuffix("Action") or action_type.__name__
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def openenv_factory(spec: str, rest: str) -> Callable:
    """The environment factory of an OpenEnv environment (module docstring). The adapter class is made at the first
    instance, from the environment's Action class, and shared by the later ones."""
    maker = _load(spec, rest)
    if not callable(maker):
        raise UserError(f"--environment {spec!r}: not an OpenEnv Environment class or a function returning one")
    classes = {}

    def make():
        environment = maker()
        if not (callable(getattr(environment, "reset", None)) and callable(getattr(environment, "step", None))):
            raise UserError(f"--environment {spec!r}: {type(environment).__name__} has no reset() and step(action)")
        action_type = _action_type(environment)
        if action_type is None:
            raise UserError(f"--environment {spec!r}: cannot tell {type(environment).__name__}'s Action class "
                            "(annotate step(self, action: MyAction))")
        if type(environment) not in classes:
            classes[type(environment)] = _openenv_class(type(environment), action_type)
        return classes[type(environment)](environment)

    return make


def _openenv_class(environment_type: type, action_type: type) -> type:
    fields = {name: field for name, field in action_type.model_fields.items() if name != "metadata"}
    hints = typing.get_type_hints(action_type)
    parameters = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(name),
                                    default=inspect.Parameter.empty if field.is_required() else field.default)
                  for name, field in fields.items()]

    def __init__(self, environment):
        self.environment, self.reward, self.done = environment, 0.0, False

    def _observe(self, result) -> str:
        observation = getattr(result, "observation", result)  # a client's StepResult, or a server's Observation
        reward = getattr(result, "reward", None)
        self.reward += float(reward or 0.0)
        self.done = bool(getattr(result, "done", False))
        return _observation_text(observation)

    def reset(self, **row):
        accepted = inspect.signature(self.environment.reset).parameters
        takes_all = any(p.kind == p.VAR_KEYWORD for p in accepted.values())
        self.reward, self.done = 0.0, False
        text = self._observe(ru.awaited(self.environment.reset(**{k: v for k, v in row.items() if k in accepted or (
            takes_all and k != "prompt")})))
        return "\n" + text if text else None

    def step(self, kwargs):
        if self.done:
            raise RuntimeError("the episode is over: the environment returned done")
        return self._observe(ru.awaited(self.environment.step(action_type(**kwargs))))

    def get_reward(self) -> float:
        """The rewards the environment returned in this episode, summed."""
        return self.reward

    name = _tool_name(action_type)
    description = inspect.getdoc(action_type) or f"Take a step in {environment_type.__name__}."
    tool = _tool_method(name, description, parameters, {n: hints[n] for n in fields if n in hints},
                        {n: field.description for n, field in fields.items()}, step)
    return type(environment_type.__name__, (), {"__init__": __init__, "_observe": _observe, "reset": reset,
                                                "get_reward": get_reward, name: tool,
                                                "__doc__": environment_type.__doc__})
