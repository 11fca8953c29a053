"""What a run shows and keeps of its metrics: metrics.jsonl in the run folder (always) and wandb (with --track), the
progress bar or line, one line per evaluation, the sample tables, and the summary at the end. Only the main process
writes; nothing here talks to other processes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, is_dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from plumbing.errors import UserError


def used_folder_error(folder: str) -> UserError:
    """The one refusal of a fresh run's folder that already holds a run (output_dir's, and MetricsLogger's for
    direct users)."""
    return UserError(f"{folder!r} already holds a run (metrics.jsonl); choose another --output_dir or pass "
                     "--resume_from")


def config_dict(args) -> dict:
    """Args dataclass (or namespace, or dict) -> plain dict for args.json and wandb."""
    if isinstance(args, dict):
        return dict(args)
    return asdict(args) if is_dataclass(args) else dict(vars(args))


class MetricsLogger:
    """Append one JSON object per `log` call to `<output_dir>/metrics.jsonl` (always), and send the same
    metrics to wandb when `track` is on. Only the main process writes; others are no-ops. Nothing is written
    before the first row (args.json and the folder come with it), so a run that fails before its first
    evaluation leaves no run folder. The wandb API key is never written anywhere by this class."""

    def __init__(self, output_dir: str, args, is_main_process: bool = True, track: bool = False,
                 wandb_project: str = "policy-rlhf", run_name: Optional[str] = None,
                 resume_step: Optional[int] = None):
        """A fresh run refuses an output folder that already holds metrics (it is never overwritten); a
        resumed run (`resume_step` = the checkpoint's step) keeps the rows up to that step."""
        self.active, self.track = is_main_process, track and is_main_process
        self.output_dir, self.path, self.started = output_dir, os.path.join(output_dir, "metrics.jsonl"), False
        self.bar, self.samples_shown = None, 0
        self.config, self.wandb_project, self.run_name = config_dict(args), wandb_project, run_name
        if self.active and os.path.exists(self.path):
            if resume_step is None:
                raise used_folder_error(output_dir)
            with open(self.path) as f:
                rows = [line for line in f if json.loads(line)["step"] <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(rows)

    def _start(self) -> None:
        """Create the folder, write args.json, start wandb: once, at the first row."""
        if self.started:
            return
        self.started = True
        os.makedirs(self.output_dir, exist_ok=True)
        with open(os.path.join(self.output_dir, "args.json"), "w") as f:
            json.dump(self.config, f, indent=2, default=str)
        if self.track:
            import wandb

            wandb.init(project=self.wandb_project, name=self.run_name, config=self.config, dir=self.output_dir)
            wandb.run.log_code(".", include_fn=lambda p: p.endswith(".py"))

    def progress(self, total: int, done: int, items_per_step: int, items: str, keys: Sequence[str]) -> None:
        """Show the run's progress from now on: steps done / `total`, `items`/s (e.g. episodes), and the latest
        values of `keys` (e.g. objective/scores, eval/gold_score). A bar updated in place on a terminal; elsewhere
        (CI, a redirected log) a plain line at every tenth of the run."""
        if self.active:
            self.bar = Progress(total, done, items_per_step, items, keys)

    def _print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def log(self, metrics: Dict[str, float], step: int) -> None:
        if not self.active:
            return
        self._start()
        row = {"step": step, **{k: to_float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.track:
            import wandb

            wandb.log(row, step=step)
        shown = {k[5:]: v for k, v in row.items() if k.startswith("eval/") and not k.endswith("/std")
                 and isinstance(v, (int, float))}
        if shown:  # one line per evaluation
            self._print(f"eval @ step {step}: " + "  ".join(f"{k} {short_number(v)}" for k, v in shown.items()))
        if self.bar is not None and step > 0:
            self.bar.update(step, row)

    def log_samples(self, name: str, rows: List[Dict[str, object]], step: int, count: int = 4) -> None:
        """`count` of `rows` as a compact table, printed, and a wandb Table when tracking. Every script's rows have
        the same shape: dicts with the keys prompt, completion, then score (a reward) and gold (the task's gold
        score) where the script has them. Each call shows the next `count` rows (rotating through them), so
        successive evaluations of the same held-out set show different prompts."""
        if not self.active or not rows or count < 1:
            return
        start = self.samples_shown % len(rows)
        rows = (rows[start:] + rows[:start])[:count]
        self.samples_shown += count
        keys = list(dict.fromkeys(k for row in rows for k in row))  # a reward function's log_extra may add columns
        rows = [{k: row.get(k, "") for k in keys} for row in rows]
        widths = {k: 36 if isinstance(rows[0][k], str) else 8 for k in keys}

        def cell(value, width: int) -> str:
            return (short_number(value) if isinstance(value, (int, float)) else str(value).replace("\n", " "))[:width]

        self._print(("  " + " | ".join(k[:w].ljust(w) for k, w in widths.items())).rstrip())
        for row in rows:
            self._print(("  " + " | ".join(cell(row[k], w).ljust(w) for k, w in widths.items())).rstrip())
        if self.track and rows:
            import wandb

            self._start()
            wandb.log({name: wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}, step=step)

    def close(self, model_path: Optional[str] = None) -> None:
        """End the run: close the bar, print the summary (the first and last evaluation of metrics.jsonl, steps, wall
        time, where the model and metrics are, how to plot them), finish wandb."""
        if self.bar is not None:
            self.bar.close()
        if self.active and os.path.exists(self.path):
            print(self._summary(model_path), flush=True)
        if self.track and self.started:
            import wandb

            wandb.finish()

    def _summary(self, model_path: Optional[str]) -> str:
        with open(self.path) as f:
            rows = [json.loads(line) for line in f]
        evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
        lines = [f"summary: step {rows[-1]['step']}, {time.time() - PROCESS_START:.0f} s since the run started"]
        if evals:
            first, last = evals[0], evals[-1]
            keys = [k for k in SUMMARY_KEYS if k in first and k in last] or \
                [k for k in first if k.startswith("eval/") and k in last and not k.endswith("/std")][:5]
            width = max(len(k) for k in keys) if keys else 0
            lines += [f"  {k.ljust(width)}  {short_number(first[k])} -> {short_number(last[k])}   "
                      f"(step {first['step']} -> {last['step']})" for k in keys]
        perf = perf_line(rows)
        if perf:
            lines.append(perf)
        if model_path:
            lines.append(f"  model:   {model_path}")
        lines += [f"  metrics: {self.path}", f"  plot:    python benchmark/plot.py {self.output_dir}"]
        return "\n".join(lines)


def perf_line(rows: list) -> Optional[str]:
    """The run summary's perf line: medians over the steps of tokens/s, generation share and MFU; the largest peak
    memory. None when no row has perf/* metrics."""
    def values(key):
        return [r[key] for r in rows if key in r]

    if not values("perf/tokens_per_second"):
        return None
    parts = [f"{statistics.median(values('perf/tokens_per_second')):,.0f} tokens/s"]
    if values("perf/generation_share"):
        parts.append(f"generation {statistics.median(values('perf/generation_share')):.0%} of the step")
    if values("perf/mfu"):
        parts.append(f"MFU {statistics.median(values('perf/mfu')):.1%}")
    parts.append(f"peak memory {max(values('perf/peak_memory_gib')):.2f} GiB")
    return "  perf:    " + ", ".join(parts) + " (medians over the steps)"


def run_logger(args, accelerator, output_dir: str, resume_step: Optional[int] = None) -> MetricsLogger:
    """The run's MetricsLogger: the main process writes to `output_dir` (the run's name for wandb is its folder's
    name), with wandb when --track (project --wandb_project); `resume_step`: the checkpoint's step when resuming."""
    return MetricsLogger(output_dir, args, accelerator.is_main_process, args.track, args.wandb_project,
                         os.path.basename(os.path.normpath(output_dir)), resume_step=resume_step)


PROCESS_START = time.time()  # the summary's wall time counts from here (imported at start-up)
SUMMARY_KEYS = ("eval/gold_score", "eval/scores", "eval/kl", "eval/loss", "eval/accuracy", "eval/rewards/accuracies",
                "eval/rewards/margins")


def short_number(value) -> str:
    """A number as the run's lines show it: integers whole, others to 4 significant digits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"


class Progress:
    """Steps done / total with a rate and a few metrics: a tqdm bar on a terminal, else a plain line at every tenth of
    the run (no carriage returns in a log file)."""

    def __init__(self, total: int, done: int, items_per_step: int, items: str, keys: Sequence[str]):
        self.total, self.done, self.items_per_step, self.items, self.keys = total, done, items_per_step, items, keys
        self.start, self.start_step, self.latest = time.time(), done, {}
        self.every = max(1, total // 10)
        self.bar = None
        if sys.stdout.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=done, unit="step", dynamic_ncols=True)

    def update(self, step: int, row: dict) -> None:
        self.latest.update({k if k.startswith("eval/") else k.split("/")[-1]: row[k] for k in self.keys if k in row})
        rate = (step - self.start_step) * self.items_per_step / max(time.time() - self.start, 1e-9)
        shown = {self.items + "/s": f"{rate:.0f}", **{k: short_number(v) for k, v in self.latest.items()}}
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(step - self.done)
        elif step % self.every == 0 or step == self.total:
            print(f"step {step}/{self.total} ({100 * step // self.total}%)  " +
                  "  ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
        self.done = step

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def is_wall_clock(key: str) -> bool:
    """Does metric `key` measure the machine rather than the run: time/*, perf/* and the *_seconds ones
    (async/trainer_wait_seconds, ...), which two runs of the same seed do not share?"""
    return key.startswith(("time/", "perf/")) or key.endswith("_seconds")


def to_float(v):
    """A tensor or numpy scalar as a plain Python number (anything else unchanged)."""
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v
