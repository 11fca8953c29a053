"""Multi-turn episodes with tools: the policy writes a turn, a tool answers, the policy writes the next turn.

The interface is TRL 1.16's (GRPOTrainer `tools=`, `environment_factory=`, `max_tool_calling_iterations`), so tools
and environments written for TRL work here unchanged:
- `--tools FILE.py:fn[,FILE.py:fn2]` (or package.module:fn): plain functions with type hints and a Google-style
  docstring; transformers' `get_json_schema` turns each into the JSON schema the chat template shows the model.
- `--environment FILE.py:Class` (or any callable returning an environment: a factory function): one instance per
  episode, reused across steps (reset each time). `reset(**row)` gets the dataset row and returns None or text
  appended to the last user message (reward functions then get that prompt, as TRL's); the public methods (not
  reset, get_reward, _private) are its tools; an optional `get_reward()` -> float is one more reward source (weight
  1, logged under the class name), and reward functions receive the instances as `environments=`.
  `--environment name=FILE.py:Class name2=...` (TRL's dict of factories): each row's `environment` column picks
  one, and only its tools (and --tools) are shown in that row's prompt.
- `--max_tool_calling_iterations`: tool rounds per episode (None: no limit but the budget).

Token in, token out. An episode is ONE token sequence built by appending, never re-rendered:
    prompt (chat template, tools shown) | sampled turn 1 ... EOS | tool-result tokens | sampled turn 2 ... EOS | ...
A chat template is not append-only in general (re-rendering a conversation can change earlier tokens: a dropped
separator, a stripped thinking block), and log-probs computed on a re-rendered conversation would not belong to
what the sampler produced. So the tool results' tokens come from `tool_suffix_ids`: the template's rendering of
[dummy user, dummy assistant, tool messages] + the next generation prompt, minus its rendering up to and including
the assistant's EOS (TRL's method): whatever the template writes after EOS (e.g. Qwen's newline) belongs to the
tool tokens. `action_mask` is True on the sampled tokens only: the policy loss, the KL and the entropy use it, and
the old log-probs are those of the sampled tokens. The finished conversation, rendered by the template, equals the
sequence wherever the template is prefix-preserving and the sampled text re-tokenises to the sampled tokens
(tests/test_episodes.py); where it does not, the trainer still uses the sampled tokens.

An episode ends at a turn with no tool call, at the budget (`--response_length` sampled tokens in total, or the
model's context: `truncated`, the missing-EOS penalty applies; a turn that calls a tool with the budget spent
ends the episode there, its calls not executed), or after --max_tool_calling_iterations tool rounds
(the last turn's calls are then not executed, as TRL). Tool calls are read in the chat template's own format and
run by tool_calls.py: a call that cannot be parsed, an unknown tool, bad arguments, an exception and a call that
runs past --tool_timeout seconds each become a tool message `{"error": "..."}` the model reads next turn, counted
in tools/failure_frequency; the run never stops for them. Results that are dicts or lists are sent as JSON (TRL: str);
a result longer than --max_tool_result_tokens is cut there, with a marker.

Collectives: `run_episodes` makes the same number of `generate` calls on every process (one per turn until no
process has a running episode, agreed by one all-reduce per turn): a process whose episodes have all ended calls it
on one dummy row, so ZeRO-3's parameter gathering inside generation stays in step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

import policy_common as pc
from plumbing import data_utils as du
from plumbing import environment_libraries as env_libs
from plumbing import environments as envs
from plumbing import run_utils as ru
from plumbing import tool_calls as tc
from plumbing.errors import UserError


@dataclass
class ToolFlags:
    """Tools and environments (rloo, grpo): each completion a multi-turn episode (TRL's interface)."""
    # a --model alias's tools (e.g. toy_tools' lookup) give way to the user's own tools or environment; an
    # environment's reset text lengthens the prompts, so the alias's --max_prompt_length gives way to the measured one
    ALIAS_REPLACES = {"tools": ("environment",), "environment": ("tools", "max_prompt_length")}
    tools: Optional[List[str]] = None
    """tools the policy may call: path/to/file.py:fn or package.module:fn (comma-separated or repeated); given, it
    or --environment replaces a --model alias's tools"""
    environment: Optional[List[str]] = None
    """environment factory (file.py:Class or a function returning one), one per episode: reset(**row), its public
    methods are tools, get_reward(); several as name=file.py:Class, picked by each row's `environment` column"""
    max_tool_calling_iterations: Optional[int] = None
    """tool rounds per episode (None = until a turn calls no tool or --response_length sampled tokens are spent)"""
    tool_timeout: float = 30.0
    """seconds a tool call may run before it is cut off (the model then reads an error)"""
    max_tool_result_tokens: Optional[int] = None
    """tokens of a tool result the model reads: a longer one is cut there, with a marker (None = no cap)"""

    def check(self) -> None:
        """One-line errors for the tool flags, before anything loads."""
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise UserError(f"--max_tool_calling_iterations must be >= 0 (None: no limit), got "
                            f"{self.max_tool_calling_iterations}")
        if self.tool_timeout <= 0:
            raise UserError(f"--tool_timeout must be > 0 seconds, got {self.tool_timeout}")
        if self.max_tool_result_tokens is not None and self.max_tool_result_tokens < 1:
            raise UserError(f"--max_tool_result_tokens must be >= 1 (None: no cap), got {self.max_tool_result_tokens}")


# ---------------------------------------------------------------------------------------------------------
# Start-up: the run's tools from --tools / --environment, and the chat template checks
# ---------------------------------------------------------------------------------------------------------
def _schema(fn: Callable, flag: str) -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:
        raise UserError(f"{flag}: tool {getattr(fn, '__name__', fn)!r} cannot be shown to the model: "
                        f"{type(e).__name__}: {str(e).splitlines()[0]} (a tool needs type hints and a Google-style "
                        "docstring with an Args: section)") from None


@dataclass
class Toolset:
    """A run's tools: `functions` (--tools), `environment` (the --environment factory: a class or a function
    returning an instance; None without one or with several), `schemas` (every tool's JSON schema, the environments'
    methods included). With several environments, `factories` maps each name to its factory and `environment_schemas`
    each name to its methods' schemas: a row's prompt shows --tools and its own environment's tools only."""
    functions: List[Callable]
    environment: Optional[Callable]
    schemas: List[dict]
    factories: Dict[str, Callable] = field(default_factory=dict)
    environment_schemas: Dict[str, List[dict]] = field(default_factory=dict)
    environment_types: List[type] = field(default_factory=list)  # the instances' classes (their get_reward)
    call_format: str = "hermes"  # how the chat template writes a tool call (tool_calls.call_format)
    stop_ids: List[int] = field(default_factory=list)  # the tokens ending a turn (empty: the EOS); GPT-OSS: <|call|>

    @property
    def names(self) -> List[str]:
        """The tools' names, as the schemas show them."""
        return [schema["function"]["name"] for schema in self.schemas]

    @property
    def has_environment(self) -> bool:
        return self.environment is not None or bool(self.factories)

    def environment_name(self, row: dict) -> Optional[str]:
        """The environment a row uses: its `environment` column with several environments, else None."""
        if not self.factories:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise UserError(f"a row's environment column is {name!r}, not one of --environment's names "
                            f"{sorted(self.factories)}")
        return name

    def schemas_for(self, row: dict) -> List[dict]:
        """The tools shown in a row's prompt: every tool, or with several environments --tools and the row's own."""
        if not self.factories:
            return self.schemas
        return self.schemas[:len(self.functions)] + self.environment_schemas[self.environment_name(row)]

    def new_environment(self, name: Optional[str] = None):
        """A fresh environment instance (None without an environment); `name`: which one, with several."""
        if self.factories:
            return self.factories[name]()
        return None if self.environment is None else self.environment()

    def tools_for(self, environment) -> Dict[str, Callable]:
        """name -> callable for one episode: the functions, plus its environment instance's methods."""
        tools = {fn.__name__: fn for fn in self.functions}
        if environment is not None:
            tools.update({fn.__name__: fn for fn in envs.environment_tools(environment)})
        return tools


def load_toolset(args, tokenizer) -> Optional[Toolset]:
    """The Toolset of `--tools` and `--environment` (None when neither is given), checked at start-up: every tool
    has a schema, names are unique, the environment has `reset`, and the tokenizer's chat template can render a tool
    conversation and is prefix-preserving (`tool_suffix_ids` works). Errors are one-line UserErrors."""
    specs = [spec for entry in (args.tools or []) for spec in entry.split(",") if spec]
    if not specs and not args.environment:
        return None
    functions = []
    for spec in specs:
        fn = ru.load_object(spec, "--tools")
        if not callable(fn) or inspect.isclass(fn):
            where, _, name = spec.rpartition(":")
            raise UserError(f"--tools {spec!r}: {where!r} has no function {name!r}")
        functions.append(fn)
    entries = [args.environment] if isinstance(args.environment, str) else list(args.environment or [])
    named = [entry.partition("=") if "=" in entry.split(":")[0] else (None, "", entry) for entry in entries]
    if len(named) > 1 and any(name is None for name, _, _ in named):
        raise UserError(f"--environment {entries}: several environments need a name each (name=file.py:Class), "
                        "the one a row's `environment` column picks")
    factories, methods, types = {}, {}, []
    for name, _, spec in named:
        factories[name] = env_libs.factory(spec) or ru.load_object(spec, "--environment")  # verifiers:, openenv:
        probe = envs.probe_environment(factories[name], spec)
        methods[name] = envs.environment_tools(probe)
        types += [type(probe)] if type(probe) not in types else []
        if not methods[name]:
            raise UserError(f"--environment {spec!r}: the environment has no public method to use as a tool")
    schemas = [_schema(fn, "--tools") for fn in functions]
    environment_schemas = {name: [_schema(fn, "--environment") for fn in fns] for name, fns in methods.items()}
    for fns in [functions] + [functions + fns for fns in methods.values()]:
        if len({fn.__name__ for fn in fns}) != len(fns):
            raise UserError(f"--tools / --environment: tool names must be unique, got {[fn.__name__ for fn in fns]}")
    seen = {schema["function"]["name"] for schema in schemas}
    for fns in environment_schemas.values():  # every tool once: what check_chat_template and metrics read
        schemas += [schema for schema in fns if schema["function"]["name"] not in seen]
        seen |= {schema["function"]["name"] for schema in fns}
    check_chat_template(tokenizer, schemas[0]["function"]["name"])
    call_format, stop_ids = tc.call_format(tokenizer, schemas[0]["function"]["name"])
    if None in factories:
        return Toolset(functions, factories[None], schemas, environment_types=types, call_format=call_format,
                       stop_ids=stop_ids)
    return Toolset(functions, None, schemas, factories, environment_schemas, types, call_format, stop_ids)


def check_chat_template(tokenizer, tool_name: str = "lookup") -> None:
    """UserError unless the chat template renders a tool call and a tool result, and is prefix-preserving around
    them (what `tool_suffix_ids` needs)."""
    if tokenizer.chat_template is None:
        raise UserError("tools need a tokenizer with a chat template (it shows the tools and renders tool results)")
    messages = tc.sentinel_conversation(tool_name)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:
        raise UserError(f"the chat template cannot render a tool conversation ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if "sentinel_result" not in text or tool_name not in text:
        raise UserError("the chat template drops tool calls or tool results: it does not support tools")
    tool_suffix_ids(tokenizer, [messages[-1]])


def tool_suffix_ids(tokenizer, tool_messages: List[dict], stop_ids: Sequence[int] = ()) -> List[int]:
    """Token ids appended after a turn's EOS (or other `stop_ids` token): the tool messages and the next generation
    prompt, as the chat template renders them after an assistant turn (anything it writes after EOS included).
    UserError when the template is not prefix-preserving there."""
    call = {"type": "function", "id": tool_messages[0].get("tool_call_id", tc.SENTINEL_ID),
            "function": {"name": tool_messages[0].get("name", "tool"), "arguments": {}}}
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prefix = tokenizer.apply_chat_template(head, tokenize=False)
    full = tokenizer.apply_chat_template(head + tool_messages, tokenize=False, add_generation_prompt=True)
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    stops = set(stop_ids) | {tokenizer.eos_token_id}
    eos = [i for i, token in enumerate(prefix_ids) if token in stops]
    prefix_ids = prefix_ids[:eos[-1] + 1] if eos else prefix_ids
    if full_ids[:len(prefix_ids)] != prefix_ids:
        raise UserError("the chat template is not prefix-preserving: rendering a tool result changes the tokens "
                        "before it, so tool results cannot be appended to the sampled tokens")
    return full_ids[len(prefix_ids):]


# ---------------------------------------------------------------------------------------------------------
# The episode loop
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Episode:
    """One episode: `prompt_ids`, `response_ids` (sampled and tool tokens, in order), `action_mask` (True on the
    sampled ones), `behaviour_logprobs` (of the policy that sampled: HF's or vLLM's) and `entropy` per response token
    (0 on tool tokens), `messages`
    (the conversation after the prompt: assistant turns as parsed, tool messages), `environment` (its instance, or
    None), `prompt` (the prompt messages after the environment's reset), counts of `tool_calls`, `tool_failures`,
    `turns`, and how it ended (`truncated`: by the budget)."""
    prompt_ids: List[int]
    tools: Dict[str, Callable]
    environment: object = None
    prompt: object = None  # the prompt messages after the environment's reset (what reward functions get)
    response_ids: List[int] = field(default_factory=list)
    action_mask: List[bool] = field(default_factory=list)
    behaviour_logprobs: List[float] = field(default_factory=list)
    entropy: List[float] = field(default_factory=list)
    messages: List[dict] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    truncated_results: int = 0  # tool results cut to --max_tool_result_tokens
    tool_rounds: int = 0
    turns: int = 0
    done: bool = False
    truncated: bool = False

    @property
    def sampled(self) -> int:
        return sum(self.action_mask)

    def append(self, ids: Sequence[int], sampled: bool, behaviour_logprobs=None, entropy=None):
        n = len(ids)
        self.response_ids += list(ids)
        self.action_mask += [sampled] * n
        self.behaviour_logprobs += list(behaviour_logprobs) if behaviour_logprobs is not None else [0.0] * n
        self.entropy += list(entropy) if entropy is not None else [0.0] * n


def episode_prompt(toolset: Toolset, tokenizer, prompt, row: dict, environment) -> tuple:
    """A row's prompt as its episode starts -> (messages, token ids): the environment reset with the row (without
    its `environment` column when that picks one of several), reset's text appended to the last user message (TRL),
    rendered with the row's tools."""
    if environment is not None:
        observation = environment.reset(**{k: v for k, v in row.items() if k != "environment" or not toolset.factories})
        if observation is not None:
            prompt = list(prompt[:-1]) + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
    text = du.render_prompt(tokenizer, prompt, toolset.schemas_for(row))
    return prompt, tokenizer(text, add_special_tokens=False)["input_ids"]


def start_episodes(prompts: Sequence, rows: Sequence[dict], toolset: Toolset, tokenizer, environments: list,
                   max_prompt_length: int) -> List[Episode]:
    """An Episode per (prompt messages, dataset row): its environment instance (from `environments`, one per row)
    reset with the row, the prompt after reset rendered with the row's tools (`episode_prompt`). A prompt longer
    than `max_prompt_length` after reset is a UserError naming the row and the flag."""
    episodes = []
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        environment = environments[i] if toolset.has_environment else None
        prompt, ids = episode_prompt(toolset, tokenizer, prompt, row, environment)
        if len(ids) > max_prompt_length:
            raise UserError(f"a prompt ({str(prompt[-1]['content'])[:60]!r}...) has {len(ids)} tokens after the "
                            f"environment's reset, more than --max_prompt_length {max_prompt_length}: raise it")
        episodes.append(Episode(prompt_ids=ids, tools=toolset.tools_for(environment), environment=environment,
                                prompt=prompt))
    return episodes


def run_episodes(episodes: List[Episode], generate: Callable, tokenizer, toolset: Toolset, *, response_length: int,
                 context_limit: int, max_tool_calling_iterations: Optional[int], tool_timeout: float,
                 max_tool_result_tokens: Optional[int] = None, accelerator=None) -> List[Episode]:
    """Play `episodes` to the end. generate(sequences: list of token-id lists, budgets: the most new tokens of each,
    first_turn) ->
    (turns: token-id lists, each cut after its EOS; the behaviour log-probs; entropy or None: per-token lists) samples
    one turn per sequence. Each turn gets at most the episode's remaining budget: response_length
    sampled tokens in all, and context_limit tokens of prompt + response; a tool result is cut to
    max_tool_result_tokens tokens. See the module docstring for how episodes end and for the collectives."""
    stops = set(toolset.stop_ids) | {tokenizer.eos_token_id}  # the EOS, and e.g. GPT-OSS's <|call|>
    for turn in range(response_length + 1):  # every turn samples >= 1 token: the budget bounds the loop
        running = [e for e in episodes if not e.done]
        still_running = len(running) if accelerator is None else ru.global_sum(accelerator, len(running))
        if still_running == 0:  # agreed by every process: they all stop after the same turn
            break
        budgets = [min(response_length - e.sampled, context_limit - len(e.prompt_ids) - len(e.response_ids))
                   for e in running]
        rows = [e.prompt_ids + e.response_ids for e in running] or [episodes[0].prompt_ids]  # dummy row: same calls
        turns, behaviour_logprobs, entropy = generate(rows, budgets or [1], turn == 0)
        for i, (episode, budget) in enumerate(zip(running, budgets)):
            ids = turns[i][:budget]
            cut = slice(0, len(ids))
            episode.append(ids, True, behaviour_logprobs[i][cut], None if entropy is None else entropy[i][cut])
            episode.turns += 1
            message = tc.parse_turn(tokenizer, ids, episode.prompt_ids + episode.response_ids[:-len(ids)],
                                    toolset.schemas, toolset.call_format)
            episode.messages.append(message)
            if not ids or ids[-1] not in stops:  # cut by the budget
                episode.done = episode.truncated = True
                continue
            calls = message.get("tool_calls") or []
            limit = max_tool_calling_iterations
            if not calls or (limit is not None and episode.tool_rounds >= limit):
                episode.done = True
                continue
            if episode.sampled >= response_length:  # no budget left for a turn after the results: calls not run
                episode.done = episode.truncated = True
                continue
            results = []
            for call in calls:
                content, failed = tc.call_tool(episode.tools, call, tool_timeout)
                content, cut = tc.truncate_result(tokenizer, content, max_tool_result_tokens)
                name = call.get("function", {}).get("name", "unknown")
                results.append({"role": "tool", "name": name, "content": content})
                if call.get("id") or toolset.call_format == "mistral":  # Mistral's templates need the call's id
                    results[-1]["tool_call_id"] = call.get("id") or f"call{episode.tool_calls:05d}"
                episode.tool_calls += 1
                episode.tool_failures += failed
                episode.truncated_results += cut
            suffix = tool_suffix_ids(tokenizer, results, toolset.stop_ids)
            if len(episode.prompt_ids) + len(episode.response_ids) + len(suffix) >= context_limit:
                episode.done = episode.truncated = True  # no room for the results and one more token
                continue
            episode.messages += results
            episode.append(suffix, False)
            episode.tool_rounds += 1
    for episode in episodes:  # the loop bound was reached (cannot happen: each turn samples a token)
        episode.done = True
    return episodes


def episode_tensors(episodes: List[Episode], pad_token_id: int, device=None) -> dict:
    """Episodes -> the rollout's tensors: query_responses (B, Lq + R) [left-padded prompt | response right-padded
    with pad], context_length Lq, action_mask (B, R) bool (True on sampled tokens), behaviour_logprobs, entropy (B, R)
    float (pc.PADDING_LOGPROB / 0 off the sampled tokens), truncated (B,) bool."""
    queries = pc.pad_sequences([e.prompt_ids for e in episodes], pad_token_id, "left")
    width = max(1, max(len(e.response_ids) for e in episodes))

    def right(values, fill, dtype):
        return torch.tensor([list(v) + [fill] * (width - len(v)) for v in values], dtype=dtype)

    responses = right([e.response_ids for e in episodes], pad_token_id, torch.long)
    action_mask = right([e.action_mask for e in episodes], False, torch.bool)
    out = dict(query_responses=torch.cat([queries, responses], 1), context_length=queries.shape[1],
               action_mask=action_mask,
               behaviour_logprobs=right([e.behaviour_logprobs for e in episodes], 0.0, torch.float32).masked_fill(
                   ~action_mask, pc.PADDING_LOGPROB),
               entropy=right([e.entropy for e in episodes], 0.0, torch.float32),
               truncated=torch.tensor([e.truncated for e in episodes]))
    return {k: v.to(device) if isinstance(v, torch.Tensor) and device is not None else v for k, v in out.items()}


def episode_metrics(episodes: List[Episode], accelerator, prefix: str = "") -> Dict[str, float]:
    """Means over every process's episodes (one all-reduce): tools/call_frequency (tool calls per episode, TRL's
    name), tools/failure_frequency (failed calls / calls, TRL's), episodes/turns (sampled turns per episode),
    episodes/truncated_fraction and episodes/truncated_count (episodes ended by the budget), tools/truncated_results
    (results cut to --max_tool_result_tokens)."""
    sums = {"calls": sum(e.tool_calls for e in episodes), "failures": sum(e.tool_failures for e in episodes),
            "turns": sum(e.turns for e in episodes), "truncated": sum(e.truncated for e in episodes),
            "cut": sum(e.truncated_results for e in episodes), "episodes": len(episodes)}
    totals = ru.global_means(accelerator, sums, 1)  # sums over processes
    return {f"{prefix}tools/call_frequency": totals["calls"] / max(totals["episodes"], 1),
            f"{prefix}tools/failure_frequency": totals["failures"] / max(totals["calls"], 1),
            f"{prefix}episodes/turns": totals["turns"] / max(totals["episodes"], 1),
            f"{prefix}episodes/truncated_fraction": totals["truncated"] / max(totals["episodes"], 1),
            f"{prefix}episodes/truncated_count": totals["truncated"], f"{prefix}tools/truncated_results": totals["cut"]}
