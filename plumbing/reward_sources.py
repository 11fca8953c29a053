"""Where the reward of a completion comes from: a reward model, reward functions, or both, weighted; and the
missing-EOS penalty. Read by rollout.py for the RL scripts (rloo.py, grpo.py, ppo.py); nothing here is algorithm
logic: a rollout asks for one number per completion, and the script logs the parts.

How the reward model reads a completion (`--reward_model_input`):
  tokens  the policy's token ids of prompt + completion, EOS included, scored at the last non-pad token: the
          convention of reward models trained with EOS appended (the TL;DR reward models of Huang et al. 2024,
          this project's toy reward model, TRL's RewardTrainer). Needs the policy's vocabulary.
  text    prompt + completion decoded to text (special tokens skipped; conversational data: the
          prompt's messages plus the completion as the assistant's, through the reward model's chat template),
          re-tokenised by the reward model's own tokenizer without special tokens, right-padded, scored at the last
          token: the convention of TRL's RLOO and GRPO trainers. Any tokenizer; the reward model never sees EOS.
  Default: what the reward model's config records (`reward_model_input`, written by this project when it trains
  one), else tokens when it shares the policy's vocabulary, else text. Read at a position it was never trained
  on, a reward model returns noise, silently: see docs/rewards.md.

Reward functions (`--reward_funcs`): `gold` (the dataset's ground-truth scorer, where it has one: the toy task),
`path/to/file.py:function` or `package.module:function`, called as TRL calls them, by keyword:
    fn(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list of float or None
`prompts` are the dataset's prompts (text, or messages; with an environment, after its reset text), `completions` the
decoded completions (text, or [{"role": "assistant", "content": text}] for conversational data), `completion_ids`
their token ids (EOS included; tool episodes: tool results included), `sampled_lengths` how many of them the policy
sampled (not TRL's: tool results not counted; given only to a function that names it), `columns` the dataset's other
columns for those rows (e.g. answer=[...]). Also TRL's: `trainer_state` (transformers' TrainerState: global_step, the
optimizer steps taken when the batch was sampled, and max_steps), `log_metric(name, value)` (averaged over the step's
calls and every process, logged as `name`, or `eval/name` from an evaluation) and `log_extra(column, values)` (one
value per row: extra columns of the eval/samples table; training batches have no completions table here). A function
may be `async def` (awaited). A function without **kwargs is given only the arguments it names. None
means "this function does not score this row": it adds nothing to the row's reward and is left out of its
reward/<name> statistics. A function is code the user named on the command line; nothing is ever loaded from a
dataset or a hub repository as code.

The reward of a row = sum over sources of weight * score (`--reward_weights`: the reward model first, then each
function in order; 1.0 each by default).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, List, Literal, Optional, Sequence

import torch

import policy_common as pc
from plumbing import data_utils as du
from plumbing import models
from plumbing import run_utils as ru
from plumbing.errors import RolloutError, UserError
from plumbing.forwards import Forwards

BUILTINS = ("gold",)
REWARD_MODEL = "reward_model"  # the reward model's name in reward/<name> metrics


@dataclass
class RewardFunctionFlags:
    """Reward functions (TRL's signature) and the weights of the reward sources."""
    # the user's reward functions replace a --model alias's, weights included
    ALIAS_REPLACES = {"reward_funcs": ("reward_weights",)}
    reward_funcs: Optional[List[str]] = None
    """reward functions: gold (the dataset's scorer), path/to/file.py:function or package.module:function; given,
    they replace a --model alias's reward functions"""
    reward_weights: Optional[List[float]] = None
    """one weight per reward source (the reward model first, then each function); None = 1.0 each"""


@dataclass
class RewardFlags(RewardFunctionFlags):
    """Rewards (`load_rewards`): a reward model and/or reward functions, weighted; DAPO's overlong shaping."""
    reward_model: Optional[str] = None
    """reward model: alias, hub id or local folder; None = the one paired with --model (none with --reward_funcs)"""
    reward_model_input: Optional[Literal["tokens", "text"]] = None
    """reward model reads tokens (the policy's ids + EOS) or text (re-tokenised); None = its record, else by vocab"""
    overlong_buffer_length: int = 0
    """DAPO's overlong shaping: a penalty rising linearly over the last this many tokens before --response_length
    (reward source `overlong`, weight 1; 0 = off)"""
    overlong_penalty_factor: float = 1.0
    """the overlong penalty at --response_length tokens is -this (DAPO: 1.0)"""


class RewardFunctionError(RolloutError):
    """A reward function raised or returned something unusable (every process raises it together)."""


# ---------------------------------------------------------------------------------------------------------
# Reward functions: loading by name, calling, checking what comes back
# ---------------------------------------------------------------------------------------------------------
class RewardFunction:
    """A user's reward function and what its signature accepts: `name` (for metrics and errors), `fn`,
    `takes_kwargs` (has **kwargs: gets every column), `named` (keyword arguments it names), `required` (those
    without a default: the data must supply them)."""

    def __init__(self, name: str, fn: Callable, shaping: bool = False):
        self.shaping = shaping  # a penalty (overlong), not a verdict on the answer: left out of `Rewards.correct`
        try:
            parameters = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            raise UserError(f"reward function {name!r} has no inspectable signature") from None
        self.name, self.fn = name, fn
        self.takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in parameters)
        keyword = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self.named = {p.name for p in keyword}
        self.required = [p.name for p in keyword if p.default is p.empty]
        if "completions" not in self.named and not self.takes_kwargs:
            raise UserError(f"reward function {name!r} must take completions= (signature: "
                            "fn(prompts, completions, **columns) -> list of float or None)")


def load_reward_function(spec: str, dataset: str) -> RewardFunction:
    """`gold` | `path/to/file.py:function` | `package.module:function` -> RewardFunction. Anything that cannot be
    found or imported is a UserError here, at start-up."""
    if spec == "gold":
        scorer = du.gold_scorer(dataset)
        if scorer is None:
            raise UserError(f"--reward_funcs gold: dataset {dataset!r} has no ground-truth scorer (the toy task has "
                            "one); name a function as path/to/file.py:function or package.module:function")

        def gold(prompts, completions, **columns):  # conversations: the last user and assistant messages' text
            rows = [{key: values[i] for key, values in columns.items() if isinstance(values, list)}
                    for i in range(len(prompts))]  # the data columns (not trainer_state, log_metric, log_extra)
            return [scorer(last_content(prompt, "user"), last_content(completion, "assistant"), row)
                    for prompt, completion, row in zip(prompts, completions, rows)]

        return RewardFunction("gold", gold)
    fn = ru.load_object(spec, "--reward_funcs", f"a built-in ({', '.join(BUILTINS)}), nor ")
    if not callable(fn):
        raise UserError(f"--reward_funcs {spec!r}: {spec.rpartition(':')[0]!r} has no function "
                        f"{spec.rpartition(':')[2]!r}")
    return RewardFunction(spec.rpartition(":")[2], fn)


def last_content(value, role: str) -> str:
    """Text as is; of a list of messages, the content of the last one with `role` ("" if none)."""
    if not du.is_conversational(value):
        return value
    return next((m.get("content") or "" for m in reversed(value) if m.get("role") == role), "")


def environment_reward(environment: type) -> RewardFunction:
    """An --environment class's get_reward() as one more reward source, named after the class (TRL's rule). A
    get_reward that names `prompt` or `completion` (ours, not TRL's) gets its episode's prompt (after reset) and
    conversation: what an environment needs to score the final answer (environment_libraries.py's verifiers one)."""
    named = set(inspect.signature(environment.get_reward).parameters) & {"prompt", "completion"}

    def get_reward(environments, prompts=None, completions=None, **columns):
        episode = lambda i: {k: v[i] for k, v in (("prompt", prompts), ("completion", completions)) if k in named}  # noqa: E731
        values = [e.get_reward(**episode(i)) if type(e) is environment else None for i, e in enumerate(environments)]
        return [ru.awaited(v) for v in values]  # an async get_reward (TRL's too)

    return RewardFunction(environment.__name__, get_reward)


def overlong_penalty(response_length: int, buffer_length: int, factor: float) -> RewardFunction:
    """DAPO's overlong reward shaping (Yu et al. 2025, eq. 13; TRL's get_soft_overlong_punishment, times a factor)
    as a reward source named `overlong`: 0 for a completion of at most L = response_length - buffer_length tokens,
    then a linear penalty factor * (L - |y|) / buffer_length down to -factor at response_length. |y| counts the
    tokens the policy sampled (EOS included), what --response_length bounds: in a tool episode the tool results are
    not counted (TRL's get_soft_overlong_punishment counts them: an ideal tool episode would be penalised)."""
    if not 0 < buffer_length < response_length or factor < 0:
        raise UserError(f"--overlong_buffer_length must be in (0, --response_length = {response_length}) and "
                        f"--overlong_penalty_factor >= 0, got {buffer_length} and {factor}")
    start = response_length - buffer_length

    def overlong(sampled_lengths, **columns):
        return [factor * max(-1.0, min(0.0, (start - n) / buffer_length)) for n in sampled_lengths]

    return RewardFunction("overlong", overlong, shaping=True)


def _short(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


NAMED_ONLY = {"sampled_lengths"}  # arguments TRL does not pass: given to a function only when it names them


def call_reward_function(function: RewardFunction, arguments: Dict[str, list]) -> tuple:
    """Call `function` on a batch (`arguments`: prompts, completions, completion_ids and the data columns, one list
    entry per row). Returns (values, None): a float or None per row; or (None, message) naming the function and the
    first bad row when it raises, returns the wrong number of values, or a value that is not a finite number."""
    arguments = {k: v for k, v in arguments.items()  # **kwargs gets everything TRL passes; ours only when named
                 if k in function.named or (function.takes_kwargs and k not in NAMED_ONLY)}
    lists = {k: v for k, v in arguments.items() if isinstance(v, list)}  # not trainer_state, log_metric, log_extra
    n = len(arguments["completions"]) if "completions" in arguments else len(next(iter(lists.values()), []))

    def row(i: int) -> str:
        prompt = arguments.get("prompts", [None] * n)[i]
        return f"row {i} (prompt {_short(prompt)}, completion {_short(arguments['completions'][i])})"

    try:
        values = ru.awaited(function.fn(**arguments))  # an async function: awaited (TRL's too)
    except Exception as e:
        first = next((i for i in range(n) if _raises(function, {**arguments, **{k: v[i:i + 1] for k, v in
                                                                                 lists.items()}})), None)
        where = "" if first is None else f" on {row(first)}"
        return None, f"reward function {function.name!r} raised {type(e).__name__}: {models.first_line(e)}{where}"
    try:
        values = list(values)
    except TypeError:
        return None, f"reward function {function.name!r} returned {type(values).__name__}, not a list of {n} values"
    if len(values) != n:
        return None, f"reward function {function.name!r} returned {len(values)} values for {n} rows"
    out = []
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if value is not None and not (isinstance(value, numbers.Real) and math.isfinite(float(value))):
            return None, (f"reward function {function.name!r} returned {_short(value, 30)} for {row(i)}: not a finite "
                          "number (None means: not scored)")
        out.append(None if value is None else float(value))
    return out, None


def _raises(function: RewardFunction, arguments: Dict[str, list]) -> bool:
    try:
        ru.awaited(function.fn(**arguments))
    except Exception:
        return True
    return False


# ---------------------------------------------------------------------------------------------------------
# The reward sources of a run, combined
# ---------------------------------------------------------------------------------------------------------
class Rewards:
    """The run's reward sources: an optional frozen reward model (read per `mode`: "tokens" or "text") with the
    forward chosen for it (`forward`: plumbing/forwards.py; None: the plain one), reward functions, one weight per
    source. `names` are the sources' metric names, reward model first."""

    def __init__(self, tokenizer, reward_model=None, reward_tokenizer=None, mode: str = "tokens",
                 functions: Sequence[RewardFunction] = (), weights: Optional[Sequence[float]] = None,
                 path: Optional[str] = None, required: bool = True, max_steps: int = 0,
                 forward: Optional[pc.ScalarForward] = None):
        from transformers import TrainerState

        self.tokenizer, self.reward_model, self.reward_tokenizer = tokenizer, reward_model, reward_tokenizer
        if forward is None and reward_model is not None:  # reward functions alone need no forward (nor tokenizer)
            forward = pc.ScalarForward((tokenizer if mode == "tokens" or reward_tokenizer is None
                                        else reward_tokenizer).pad_token_id)
        self.forward = forward
        self.trainer_state = TrainerState(max_steps=max_steps)  # what reward functions get as trainer_state
        self.logged_metrics, self.extra_columns = defaultdict(list), {}  # log_metric's and log_extra's, not yet read
        self.mode, self.path = mode, path  # path: where the reward model was loaded from
        self.functions = list(functions)
        names = ([REWARD_MODEL] if reward_model is not None else []) + [f.name for f in self.functions]
        self.names = [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]
        if not self.names and required:  # required=False: a run that only logs rewards (distill.py) may have none
            raise UserError("no reward: give a --reward_model, --reward_funcs, or both")
        offset = int(reward_model is not None)  # the verdicts: the functions' columns, shaping aside
        self.verdict_columns = [offset + i for i, f in enumerate(self.functions) if not f.shaping]
        weights = [1.0] * len(self.names) if weights is None else list(weights)
        if len(weights) != len(self.names):
            raise UserError(f"--reward_weights has {len(weights)} value(s) for {len(self.names)} reward source(s) "
                            f"({', '.join(self.names)})")
        self.weights = torch.tensor(weights, dtype=torch.float32)

    @torch.no_grad()
    def __call__(self, query_responses: torch.Tensor, context_length: int, rows: Sequence[dict], accelerator=None,
                 chunk_size: Optional[int] = None, shared: bool = False, episodes: Optional[list] = None,
                 step: Optional[int] = None):
        """Score B completions. query_responses (B, T) = [left-padded query | response, right-padded];
        `rows` the B dataset rows (dicts with `prompt` and any other columns) the queries came from; `episodes`
        (multi-turn, episodes.py): reward functions see each episode's conversation as its completion, and
        `environments=` its environment instances; a reward model reads the episode's whole token sequence (tool
        results included) as the response: as tokens, scored at its last token; as text, decoded as one completion.
        `shared`: the rows repeat prompts as the run's forwards were chosen for (the rollout's samples of a prompt;
        False: rows that do not, evaluation's), so its reward model may encode each prompt once.
        Returns (scores (B,), per_source (B, S)): per_source holds each source's score, NaN where a function
        returned None; scores = sum over sources of weight * score, NaNs left out (0 for a row no source scored).
        With reward functions every process must call this together (their failure is agreed: one all-reduce).
        `step`: optimizer steps taken when the batch was sampled (trainer_state.global_step)."""
        responses = query_responses[:, context_length:]
        if step is not None:
            self.trainer_state.global_step = step
        columns = []
        if self.reward_model is not None:
            columns.append(self._model_scores(query_responses, context_length, rows, chunk_size, shared))
        if self.functions:
            arguments = self._arguments(responses, rows, episodes)
            message = None
            for function in self.functions:
                values, message = call_reward_function(function, arguments)
                if message is not None:
                    break
                columns.append(torch.tensor([math.nan if v is None else v for v in values]))
            self._agree(message, accelerator)
        per_source = torch.stack([c.float().to(query_responses.device) for c in columns], 1) if columns else \
            query_responses.new_zeros(len(query_responses), 0, dtype=torch.float32)  # (B, S)
        scores = torch.nansum(per_source * self.weights.to(per_source.device), 1)  # (B,)
        return scores, per_source

    def correct(self, per_source: torch.Tensor) -> torch.Tensor:
        """(B, S) per-source scores -> (B,) bool: the completion is correct, a verifier's "pass": every reward
        function that scored it (the reward model and shaping aside) gave >= 1, and at least one did."""
        verdicts = per_source[:, self.verdict_columns]  # (B, F)
        return ((verdicts >= 1.0) | verdicts.isnan()).all(1) & ~verdicts.isnan().all(1)

    def _model_scores(self, query_responses, context_length, rows, chunk_size, shared):
        chunk = chunk_size or query_responses.shape[0]
        if self.mode == "tokens":
            forward = self.forward if shared else self.forward.unshared()
            return torch.cat([forward.rewards(self.reward_model, query_responses[i:i + chunk], context_length)
                              for i in range(0, query_responses.shape[0], chunk)])
        texts = [self._text(query_response, context_length, row["prompt"])
                 for query_response, row in zip(query_responses, rows)]
        reward_pad, scores = self.reward_tokenizer.pad_token_id, []
        for i in range(0, len(texts), chunk):
            ids = [self.reward_tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts[i:i + chunk]]
            batch = pc.pad_sequences(ids, reward_pad, "right").to(query_responses.device)
            scores.append(self.forward.rewards(self.reward_model, batch))
        return torch.cat(scores)

    def _text(self, query_response: torch.Tensor, context_length: int, prompt) -> str:
        """The text the reward model reads in `text` mode (see the module docstring)."""
        pad = self.tokenizer.pad_token_id
        if du.is_conversational(prompt):
            response = query_response[context_length:]
            completion = self.tokenizer.decode(response[response != pad], skip_special_tokens=True)
            messages = list(prompt) + [{"role": "assistant", "content": completion}]
            return self.reward_tokenizer.apply_chat_template(messages, tokenize=False)
        # decoded in one go: decoding prompt and completion apart can drop the space between them (word-level
        # tokenizers decode " b c" as "b c")
        return self.tokenizer.decode(query_response[query_response != pad], skip_special_tokens=True)

    def _arguments(self, responses: torch.Tensor, rows: Sequence[dict], episodes=None) -> Dict[str, list]:
        """The keyword arguments of a reward-function call for these rows (see the module docstring)."""
        pad = self.tokenizer.pad_token_id
        completion_ids = [response[response != pad].tolist() for response in responses]
        completions = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        if episodes is not None:  # the conversation of each episode: assistant turns and tool messages
            completions = [list(episode.messages) for episode in episodes]
        elif du.is_conversational(rows[0]["prompt"]):
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        arguments = {column: [row[column] for row in rows] for column in rows[0] if column != "prompt"}
        if episodes is not None and any(episode.environment is not None for episode in episodes):
            arguments["environments"] = [episode.environment for episode in episodes]
        prompts = [row["prompt"] for row in rows]
        if episodes is not None:  # the prompt as the episode began: after the environment's reset text (TRL)
            prompts = [p if episode.prompt is None else episode.prompt for p, episode in zip(prompts, episodes)]
        arguments.update(prompts=prompts, completions=completions, completion_ids=completion_ids,
                         sampled_lengths=[len(ids) for ids in completion_ids] if episodes is None else
                         [episode.sampled for episode in episodes],
                         trainer_state=self.trainer_state, log_metric=self.log_metric, log_extra=self.log_extra)
        return arguments

    def log_metric(self, name: str, value: float) -> None:
        """TRL's log_metric for reward functions: a scalar, averaged over the step's calls (see `metrics`)."""
        self.logged_metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """TRL's log_extra for reward functions: one value per row of the call, a column of the samples table."""
        self.extra_columns[column] = list(values)

    def take_extra_columns(self) -> Dict[str, list]:
        """The columns log_extra gave since the last call (then forgotten)."""
        columns, self.extra_columns = self.extra_columns, {}
        return columns

    @staticmethod
    def _agree(message: Optional[str], accelerator) -> None:
        """Raise RewardFunctionError on every process when a reward function failed on any (one all-reduce), so
        that no process is left waiting for the others in a collective."""
        failed = torch.tensor([float(message is not None)])
        if accelerator is not None and accelerator.num_processes > 1:
            failed = accelerator.reduce(failed.to(accelerator.device), reduction="max").cpu()
        if failed.item():
            raise RewardFunctionError(message or "a reward function failed on another process (its error is above)")

    def metrics(self, per_source: torch.Tensor, accelerator=None, prefix: str = "reward/") -> Dict[str, float]:
        """{prefix<name>/mean, prefix<name>/std} of each source over every process's scored rows of `per_source`
        (B, S) (one all-reduce; every process calls it together). A source that scored no row is left out."""
        scored = ~per_source.isnan()
        values = per_source.nan_to_num(0.0).double()
        sums = torch.stack([values.sum(0), (values ** 2).sum(0), scored.sum(0).double()])  # (3, S)
        if accelerator is not None and accelerator.num_processes > 1:
            sums = accelerator.reduce(sums.to(accelerator.device), reduction="sum")
        out = self._logged_means(accelerator, prefix[:-len("reward/")] if prefix.endswith("reward/") else "")
        for (total, squares, count), name in zip(sums.T.tolist(), self.names):
            if count > 0:
                mean = total / count
                out[f"{prefix}{name}/mean"] = mean
                out[f"{prefix}{name}/std"] = math.sqrt(max(squares / count - mean ** 2, 0.0))
        return out


    def _logged_means(self, accelerator, prefix: str) -> Dict[str, float]:
        """{prefix + name: mean of the values log_metric gave since the last call, over every process} (the values
        are gathered as objects: a function may log on some processes only)."""
        logged, self.logged_metrics = self.logged_metrics, defaultdict(list)
        if accelerator is not None and accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            merged = defaultdict(list)
            for process in gather_object([dict(logged)]):
                for name, values in process.items():
                    merged[name] += values
            logged = merged
        return {f"{prefix}{name}": sum(values) / len(values) for name, values in sorted(logged.items()) if values}


def penalise_missing_eos(scores: torch.Tensor, truncated: torch.Tensor, penalty: Optional[float]) -> torch.Tensor:
    """(B,) scores, (B,) bool `truncated` (the completion, or the episode's last turn, was cut by the budget before
    its EOS) -> scores minus `penalty` there (--missing_eos_penalty, the "EOS trick" of TRL and Huang et al. 2024,
    whose N+ details replace such scores by a constant instead); None: unchanged."""
    if penalty is None:
        return scores
    return torch.where(truncated, scores - penalty, scores)


# ---------------------------------------------------------------------------------------------------------
# Start-up: the run's reward sources from its flags
# ---------------------------------------------------------------------------------------------------------
def reward_model_input(flag: Optional[str], recorded: Optional[str], same_vocabulary: bool, path: str) -> str:
    """The reward model's input convention: `flag` if given (tokens needs the policy's vocabulary), else the one
    recorded in its config, else tokens when it shares the policy's vocabulary, else text."""
    mode = flag or recorded or ("tokens" if same_vocabulary else "text")
    if mode not in ("tokens", "text"):
        raise UserError(f"reward model {path!r} records reward_model_input {mode!r}; expected tokens or text")
    if mode == "tokens" and not same_vocabulary:
        why = "--reward_model_input tokens" if flag else f"reward model {path!r} records reward_model_input tokens"
        raise UserError(f"{why}, but its tokenizer differs from the policy's: it cannot read the policy's token ids "
                        "(--reward_model_input text re-tokenises the text, without EOS)")
    return mode


def load_rewards(args, tokenizer, forwards: Forwards, model_alias: str, dataset: str, datasets: Sequence, accelerator,
                 environments: Sequence[type] = (), max_steps: int = 0) -> Rewards:
    """The run's Rewards from the shared flags `--reward_model` (None = the one paired with --model, or none when
    --reward_funcs are given), `--reward_model_input`, `--reward_funcs`, `--reward_weights`; the reward model's forward
    chosen from the run's `forwards` (in text mode: its own pad token, its rows repeating nothing). Checks, at start-up,
    that every column a function requires is in each of `datasets`, and that conversational data read as text
    has a chat template. The reward model gets a pad token of its own if it has none (the policy's is untouched)."""
    functions = [load_reward_function(spec, dataset) for spec in args.reward_funcs or []]
    functions += [environment_reward(environment) for environment in environments or ()
                  if callable(getattr(environment, "get_reward", None))]  # --environment's own reward (TRL's rule)
    for function in functions:
        supplied = {"prompts", "completions", "completion_ids", "environments", "sampled_lengths", "trainer_state",
                    "log_metric", "log_extra"}
        for data in datasets:
            missing = [name for name in function.required if name not in supplied | set(data.column_names)]
            if missing:
                raise UserError(f"reward function {function.name!r} needs column(s) {missing}; dataset {dataset!r} "
                                f"has {data.column_names}")
    name = args.reward_model or (None if functions else ru.default_reward_model(model_alias))
    if getattr(args, "overlong_buffer_length", 0):  # shaping, not a reward: the paired reward model stays
        functions.append(overlong_penalty(args.response_length, args.overlong_buffer_length,
                                          args.overlong_penalty_factor))
    weights, named = args.reward_weights, len(args.reward_funcs or []) + (name is not None)
    if weights is not None and len(weights) == named:  # the sources the flags added: weight 1 unless named (TRL)
        weights = list(weights) + [1.0] * (len(functions) - len(args.reward_funcs or []))
    if name is None:
        if args.reward_model_input is not None:
            raise UserError("--reward_model_input is given but there is no reward model")
        return Rewards(tokenizer, functions=functions, weights=weights, max_steps=max_steps)
    path = ru.resolve_reward_model(name)
    reward_tokenizer = models.load_tokenizer(path, trust_remote_code=args.trust_remote_code)
    same_vocabulary = reward_tokenizer.get_vocab() == tokenizer.get_vocab()
    recorded = getattr(ru.model_config(path, args.trust_remote_code), "reward_model_input", None)
    mode = reward_model_input(args.reward_model_input, recorded, same_vocabulary, path)
    conversational = bool(datasets) and du.is_conversational(datasets[0][0]["prompt"])
    if mode == "text" and conversational and reward_tokenizer.chat_template is None:
        raise UserError(f"conversational data read as text needs a chat template; reward model {path!r} has none")
    model = models.load_scalar_model(path, tokenizer if mode == "tokens" else reward_tokenizer,
                                     models.Precision.from_args(args), trust_remote_code=args.trust_remote_code)
    why = ("--reward_model_input" if args.reward_model_input else "its config's record" if recorded
           else "same vocabulary as the policy" if same_vocabulary else "another vocabulary")
    accelerator.print(f"reward model {path} reads {mode} ({why})")
    if mode == "text":
        forwards = forwards.replace(pad_token_id=reward_tokenizer.pad_token_id, repeats=None)
    model = models.prepare_frozen(model, accelerator)
    return Rewards(tokenizer, model, reward_tokenizer, mode, functions, weights, path, max_steps=max_steps,
                   forward=forwards.scalar(model))  # its forward chosen where it runs
