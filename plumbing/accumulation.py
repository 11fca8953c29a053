"""The micro-batches of one optimizer step and their gradient accumulation. By default a process's rows of a step are
split into gradient_accumulation_steps micro-batches of per_device_train_batch_size rows (accelerate's accumulation,
as before). With --token_budget N they are split by length instead: as many rows as fit N real tokens per forward,
longest first (first-fit decreasing), so long rows travel in small micro-batches and short ones in large. The count
then varies with the step and the process: every process takes the largest (one all-reduce), gradients sync across
processes only after the last micro-batch (DDP's no_sync before it), and each micro-batch's loss is weighted by its
share of the step's loss instead of 1 / gradient_accumulation_steps, so the step's gradient is the same however the
rows are split (tests/test_accumulation.py)."""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

_shown = False  # the first budgeted split was printed


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


class MicroBatches:
    """One optimizer step's micro-batches on this process. Iterate for each micro-batch's items; run its forward and
    backward inside `accumulate()` and call `backward(loss, share)` instead of accelerator.backward."""

    def __init__(self, accelerator, model, items, token_counts=None, token_budget: Optional[int] = None,
                 group_size: int = 1):
        """`items`: this process's items of the step (a 1-D index tensor or a list), the same number on every
        process. Without `token_budget`: gradient_accumulation_steps equal slices, in order. With it: whole groups
        of `group_size` consecutive items (a prompt's samples, which share its encoding) packed into micro-batches
        of at most `token_budget` real tokens, `token_counts[item]` each. Budgeted splitting is one all-reduce
        (every process calls this together)."""
        self.accelerator, self.model, self.budgeted = accelerator, model, token_budget is not None
        self.num_items, self.current = len(items), -1
        steps = accelerator.gradient_accumulation_steps
        if not self.budgeted:
            size = len(items) // steps
            self.batches = [items[m * size:(m + 1) * size] for m in range(steps)]
            return
        group_size = group_size if len(items) % group_size == 0 else 1  # a step of part-groups: rows apart
        positions = [list(range(g, g + group_size)) for g in range(0, len(items), group_size)]
        item_list = items.tolist() if torch.is_tensor(items) else list(items)
        counts = token_counts.tolist() if torch.is_tensor(token_counts) else token_counts
        lengths = [sum(counts[item_list[p]] for p in group) for group in positions]
        groups = budget_groups(lengths, token_budget)
        if accelerator.num_processes > 1:  # every process the same count: DDP syncs once, after the last
            count = torch.tensor([len(groups)], device=accelerator.device)
            groups = budget_groups(lengths, token_budget, int(accelerator.gather(count).max()))
        picked = [[p for g in group for p in positions[g]] for group in groups]
        self.batches = [items[torch.tensor(p, device=items.device)] if torch.is_tensor(items) else
                        [item_list[i] for i in p] for p in picked]
        global _shown
        if not _shown:  # once a run: what the budget made of the first step
            _shown = True
            accelerator.print(f"--token_budget {token_budget}: the first step's {len(items)} rows per process in "
                              f"{len(self.batches)} micro-batches of {min(map(len, picked))}-{max(map(len, picked))}")

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for self.current, batch in enumerate(self.batches):
            yield batch

    def row_share(self) -> float:
        """The current micro-batch's items / the step's: its share of a loss that is a mean over rows."""
        return len(self.batches[self.current]) / self.num_items

    def accumulate(self):
        """The context of the current micro-batch's forward and backward: accelerate's accumulate, or with a token
        budget DDP's no_sync on every micro-batch but the last (whose backward all-reduces the summed gradients)."""
        if not self.budgeted:
            return self.accelerator.accumulate(self.model)
        last = self.current == len(self.batches) - 1
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)

    def weight(self, share: Optional[float] = None) -> float:
        """The current micro-batch's weight in the step: `share`, its part of the step's loss (row_share() for a
        mean over rows, its loss tokens / the step's for a token mean), or None for a loss already normalised by the
        step's totals (its micro-batches' losses add up): 1 / gradient_accumulation_steps, as accelerate weighs
        every micro-batch (they are equal without a token budget, and `share` is then not used)."""
        steps = self.accelerator.gradient_accumulation_steps
        return 1 / steps if share is None or not self.budgeted else share

    def logged(self, value: torch.Tensor, share: Optional[float] = None) -> torch.Tensor:
        """A term of the current micro-batch's loss as logged, detached: its mean over the step's micro-batches is the
        step's (`value` itself without a token budget, where the micro-batches weigh the same)."""
        return value.detach() if not self.budgeted else value.detach() * (self.weight(share) * len(self.batches))

    def backward(self, loss: torch.Tensor, share: Optional[float] = None) -> torch.Tensor:
        """Backward of the current micro-batch's `loss` weighted as weight(share); returns logged(loss, share)."""
        if not self.budgeted:
            self.accelerator.backward(loss)  # divided by gradient_accumulation_steps inside
        else:  # accelerate divides by gradient_accumulation_steps: the product is weight(share)
            self.accelerator.backward(loss * (self.weight(share) * self.accelerator.gradient_accumulation_steps))
        return self.logged(loss, share)
