"""The micro-batches of one optimizer step and their gradient accumulation, chosen once at setup (`micro_batches`).

By default, accelerate's idiom: a process's rows of a step in gradient_accumulation_steps micro-batches of
per_device_train_batch_size rows, each forward and backward under `accelerator.accumulate`, every loss divided by the
accumulation steps inside `accelerator.backward` (`MicroBatches`). A loop reads

    for rows in micro_batches.split(step_rows, token_counts):
        with micro_batches.accumulate():
            loss = ...
            micro_batches.backward(loss)

With --token_budget N the same lines split by length instead (`TokenBudget`): as many rows as fit N real tokens per
forward, longest first (first-fit decreasing), so long rows travel in small micro-batches and short ones in large. The
count then varies with the step and the process: every process takes the largest (one all-reduce), gradients sync
across processes only after the last micro-batch (DDP's no_sync before it), and each micro-batch's loss is weighted by
its share of the step's loss instead of 1 / gradient_accumulation_steps, so the step's gradient is the same however
the rows are split (tests/test_accumulation.py). What a share is depends on how the loss is normalised, which `split`
is told (`mean_over`): a mean over the micro-batch's rows, a mean over some count per row (its tokens), or already
normalised by the step's totals."""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence, Union

import torch


def budget_groups(lengths: Sequence[int], budget: int, count: int = 0) -> list:
    """Item lengths (real tokens) -> micro-batches, lists of item positions in ascending order: first-fit
    decreasing into bins of `budget` tokens (an item longer than the budget has a bin of its own); then, while there
    are fewer than `count` bins, the bin of most tokens among those with two items or more is halved (its items
    dealt alternately, longest first, so the halves weigh about the same). Bins are returned heaviest first."""
    free, groups = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((b for b, room in enumerate(free) if room >= lengths[i]), len(free))
        if b == len(free):
            free.append(budget)
            groups.append([])
        free[b] -= lengths[i]
        groups[b].append(i)
    while len(groups) < count:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            raise ValueError(f"{len(lengths)} items cannot make {count} micro-batches")
        group = max(splittable, key=lambda g: sum(lengths[i] for i in g))
        groups.remove(group)
        ordered = sorted(group, key=lambda i: -lengths[i])
        groups += [ordered[0::2], ordered[1::2]]
    groups = [sorted(g) for g in groups]
    return sorted(groups, key=lambda g: -sum(lengths[i] for i in g))


def micro_batches(args, accelerator, model) -> "MicroBatches":
    """The run's micro-batches: accelerate's equal ones, or sized by --token_budget. `model`: the prepared model
    whose gradients accumulate."""
    if args.token_budget is None:
        return MicroBatches(accelerator, model)
    return TokenBudget(accelerator, model, args.token_budget)


class MicroBatches:
    """A step's items in gradient_accumulation_steps equal micro-batches, in order, under accelerate's accumulation.
    `split` each step, iterate for each micro-batch's items, run its forward and backward inside `accumulate()` and
    call `backward(loss)` instead of accelerator.backward."""

    def __init__(self, accelerator, model):
        self.accelerator, self.model = accelerator, model
        self.batches, self.current = [], -1

    def split(self, items, token_counts=None, *, group_size: int = 1,
              mean_over: Union[str, torch.Tensor, None] = "rows") -> "MicroBatches":
        """This process's items of a step (a 1-D index tensor or a list, the same number on every process) ->
        these micro-batches, to iterate. `token_counts[item]` (real tokens), `group_size` (consecutive items that
        share an encoding: a prompt's samples) and `mean_over` (how each micro-batch's loss is normalised: "rows", a
        mean over its items; a tensor of a count per item, a mean over those, e.g. its tokens; None, by the step's
        totals already) matter only to --token_budget's split (`TokenBudget`)."""
        steps = self.accelerator.gradient_accumulation_steps
        size = len(items) // steps
        self.batches = [items[m * size:(m + 1) * size] for m in range(steps)]
        return self

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for self.current, batch in enumerate(self.batches):
            yield batch

    def accumulate(self):
        """The context of the current micro-batch's forward and backward."""
        return self.accelerator.accumulate(self.model)

    def weight(self) -> float:
        """The current micro-batch's weight in the step's means: 1 / gradient_accumulation_steps, as accelerate weighs
        every micro-batch."""
        return 1 / self.accelerator.gradient_accumulation_steps

    def logged(self, value: torch.Tensor) -> torch.Tensor:
        """A term of the current micro-batch's loss as logged, detached: its mean over the step's micro-batches is the
        step's."""
        return value.detach()

    def mean_term(self, coef: Optional[float]) -> Optional[float]:
        """The coefficient of a loss term that is the current micro-batch's own mean (grpo.py's entropy bonus) beside a
        loss `split` was told is normalised otherwise: as given here, where every micro-batch weighs the same."""
        return coef

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """accelerator.backward of the current micro-batch's `loss` (divided by gradient_accumulation_steps inside);
        returns logged(loss)."""
        self.accelerator.backward(loss)
        return self.logged(loss)


class TokenBudget(MicroBatches):
    """--token_budget: a step's items in micro-batches of at most `token_budget` real tokens, whole groups packed
    first-fit decreasing, the same count on every process (module docstring)."""

    def __init__(self, accelerator, model, token_budget: int):
        super().__init__(accelerator, model)
        self.token_budget, self.shares, self.shown = token_budget, [], False

    def split(self, items, token_counts=None, *, group_size: int = 1,
              mean_over: Union[str, torch.Tensor, None] = "rows") -> "TokenBudget":
        """Splitting is one all-reduce (every process calls this together)."""
        accelerator = self.accelerator
        group_size = group_size if len(items) % group_size == 0 else 1  # a step of part-groups: rows apart
        positions = [list(range(g, g + group_size)) for g in range(0, len(items), group_size)]
        item_list = items.tolist() if torch.is_tensor(items) else list(items)
        counts = token_counts.tolist() if torch.is_tensor(token_counts) else token_counts
        lengths = [sum(counts[item_list[p]] for p in group) for group in positions]
        groups = budget_groups(lengths, self.token_budget)
        if accelerator.num_processes > 1:  # every process the same count: DDP syncs once, after the last
            count = torch.tensor([len(groups)], device=accelerator.device)
            groups = budget_groups(lengths, self.token_budget, int(accelerator.gather(count).max()))
        picked = [[p for g in group for p in positions[g]] for group in groups]
        self.batches = [items[torch.tensor(p, device=items.device)] if torch.is_tensor(items) else
                        [item_list[i] for i in p] for p in picked]
        self.shares = [self.share(batch, items, mean_over) for batch in self.batches]
        if not self.shown:  # once a run: what the budget made of the first step
            self.shown = True
            accelerator.print(f"--token_budget {self.token_budget}: the first step's {len(items)} rows per process in "
                              f"{len(self.batches)} micro-batches of {min(map(len, picked))}-{max(map(len, picked))}")
        return self

    @staticmethod
    def share(batch, items, mean_over) -> Optional[Union[float, torch.Tensor]]:
        """A micro-batch's part of the step's loss: its items' share (a mean over rows), its count's share (a mean
        over tokens), or None (a loss normalised by the step's totals: its micro-batches' losses add up)."""
        if mean_over is None:
            return None
        if isinstance(mean_over, str):
            return len(batch) / len(items)
        return mean_over[batch].sum() / mean_over[items].sum().clamp(min=1)

    def accumulate(self):
        """DDP's no_sync on every micro-batch but the last (whose backward all-reduces the summed gradients)."""
        last = self.current == len(self.batches) - 1
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)

    def weight(self) -> float:
        """The current micro-batch's share of the step (1 / gradient_accumulation_steps for a loss normalised by the
        step's totals, which accelerate's division then undoes)."""
        share = self.shares[self.current]
        return 1 / self.accelerator.gradient_accumulation_steps if share is None else share

    def logged(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach() * (self.weight() * len(self.batches))

    def mean_term(self, coef: Optional[float]) -> Optional[float]:
        """Beside a loss normalised by the step's totals (every micro-batch weighted 1 / gradient_accumulation_steps,
        however many there are), a mean term is rescaled to enter the step as its mean over the micro-batches, as with
        accelerate's equal ones (issue 63: it was multiplied by micro-batches / gradient_accumulation_steps)."""
        if coef is None or self.shares[self.current] is not None:
            return coef
        return coef * self.accelerator.gradient_accumulation_steps / len(self.batches)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """accelerate divides by gradient_accumulation_steps: the product is weight()."""
        self.accelerator.backward(loss * (self.weight() * self.accelerator.gradient_accumulation_steps))
        return self.logged(loss)
