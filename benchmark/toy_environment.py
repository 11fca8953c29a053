"""The toy tool world (`--model toy_tools`) as a TRL 1.16 user writes it: an environment class (one instance per
episode, `reset(**row)`, its public methods the policy's tools, `get_reward()` one more reward source), its factory
function, a variant whose tool is async, and a reward function taking TRL's extra arguments. benchmark/same_runs.py
runs grpo.py with the class (`--environment benchmark/toy_environment.py:LookupBox --tools None`; --environment
alone also replaces the alias's tool); benchmark/toy_tool_world.py --variants trains with each."""

import asyncio

from toy_worlds import toy_tools


class LookupBox:
    """The tool world's lookup tool as an environment, rewarding each episode's successful lookups (at most one)."""

    def __init__(self):
        self.looked_up = 0

    def reset(self, **row):
        self.looked_up = 0

    def lookup(self, box: str) -> str:
        """Look up the letters kept in a box.

        Args:
            box: the box number, its digits separated by spaces, as written in the request (e.g. "4 8 2")

        Returns:
            The box's letters, separated by spaces.
        """
        letters = toy_tools.lookup(box)
        self.looked_up += 1
        return letters

    def get_reward(self) -> float:
        return float(min(self.looked_up, 1))


def make_lookup_box() -> LookupBox:
    """An environment factory function (TRL's environment_factory may be any callable returning an environment)."""
    return LookupBox()


class AsyncLookupBox(LookupBox):
    """LookupBox with an async tool: awaited under --tool_timeout like a sync one."""

    async def lookup(self, box: str) -> str:
        """Look up the letters kept in a box.

        Args:
            box: the box number, its digits separated by spaces, as written in the request (e.g. "4 8 2")

        Returns:
            The box's letters, separated by spaces.
        """
        await asyncio.sleep(0)
        letters = toy_tools.lookup(box)  # LookupBox's order: a lookup that raises is not counted
        self.looked_up += 1
        return letters


def gold_with_trl_arguments(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
    """The tool world's gold score as a reward function written for TRL 1.16's GRPOTrainer: it takes the extra
    arguments TRL passes, logs a metric and an extra column, and reads the trainer's step."""
    scores = []
    for prompt, completion in zip(prompts, completions):
        request = next(m["content"] for m in reversed(prompt) if m["role"] == "user")
        answer = next((m["content"] or "" for m in reversed(completion) if m["role"] == "assistant"), "")
        scores.append(toy_tools.gold_score(request, answer))
    log_metric("tool_world/exact", sum(s == 1.0 for s in scores) / len(scores))
    log_extra("step", [trainer_state.global_step] * len(scores))
    return scores
