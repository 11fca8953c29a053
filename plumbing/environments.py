"""Environments (TRL 1.16's `environment_factory` contract, read by episodes.py): an environment is what a factory
(a class, or any callable) returns: `reset(**row)`, public methods that are tools, an optional `get_reward()`. Here:
its tools, the checked probe instance made at start-up, and the pool of instances reused across steps."""

from __future__ import annotations

import inspect
from typing import Callable, List, Sequence

from plumbing.errors import UserError


def environment_tools(environment) -> List[Callable]:
    """An environment instance's tools: its public methods other than reset and get_reward (TRL's rule)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def probe_environment(factory, spec: str):
    """One instance from an --environment factory (TRL's probe), checked: a callable that returns an object with
    reset(**row). UserError otherwise."""
    if not callable(factory):
        raise UserError(f"--environment {spec!r}: not a class or a function returning an environment")
    try:
        instance = factory()
    except Exception as e:
        raise UserError(f"--environment {spec!r}: {getattr(factory, '__name__', spec)}() raised "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not callable(getattr(instance, "reset", None)):
        raise UserError(f"--environment {spec!r}: the environment has no reset(**row) method")
    return instance


class EnvironmentPool:
    """The environment instances of a run, reused across steps (TRL's "construct once, reset often"): as many of
    each environment as one call needs at once."""

    def __init__(self, toolset):  # an episodes.Toolset
        self.toolset, self.instances = toolset, {}  # environment name (None: the one) -> instances

    def for_rows(self, rows: Sequence[dict]) -> list:
        """One instance per row, of the row's environment (None without one), each handed out once per call."""
        if not self.toolset.has_environment:
            return [None] * len(rows)
        handed, out = {}, []
        for row in rows:
            name = self.toolset.environment_name(row)
            pool, used = self.instances.setdefault(name, []), handed.get(name, 0)
            if used == len(pool):
                pool.append(self.toolset.new_environment(name))
            out.append(pool[used])
            handed[name] = used + 1
        return out
