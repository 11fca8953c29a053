"""A TRL-style environment for the toy tool world (`--model toy_tools`): one instance per episode, `reset(**row)`, its
public methods are the policy's tools, `get_reward()` one more reward source. benchmark/same_runs.py runs grpo.py with
it (`--environment benchmark/toy_environment.py:LookupBox --tools None`; --environment alone also replaces the
alias's tool)."""

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
