"""How much of a stale batch's importance mass does each --vllm_importance_sampling_mode drop, at the completion
lengths real runs use? (issue 47: the --max_staleness default)

    python benchmark/stale_weights.py     # one toy run (~1 min on 2 cores), the model -> results/stale_weights.md

A stale completion (sampled by the weights of an earlier step, --max_staleness N > 0) is weighted by r = pi_prox /
pi_behav per token (token_*), or by the product over its tokens (sequence_*). The per-token drift between two
consecutive steps' weights is measured on the toy task: `python grpo.py --seed 1 --max_staleness 1` logs
async/logprob_diff, the mean |log r| per token, at every step. The toy's completions have 8 tokens; real ones have
hundreds or thousands. To see those lengths, the per-token log-ratios are modelled as independent normals whose
mean absolute value is the measured drift, with mean -sigma^2 / 2 so that E[r] = 1, as for samples of the behaviour
policy. A completion of L tokens then has log r ~ N(-L sigma^2 / 2, L sigma^2). With an upper bound c (clip_max 3, no
lower bound: the defaults), *_mask zeroes r > c. The share of the importance mass E[r] it drops is, in closed form,
Phi((L sigma^2 / 2 - ln c) / (sigma sqrt(L))); token_mask is the same at L = 1. A Monte Carlo draw checks the formula.
Independence is the model's assumption: correlated token drifts would widen the sequence ratios further.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "stale_weights.md")
LENGTHS = (8, 512, 2048)
CLIP_MAX = 3.0


def dropped_mass(drift: float, length: int, clip_max: float = CLIP_MAX) -> float:
    """The share of E[r] a mask at r > clip_max drops, for `length` independent normal token log-ratios of mean
    absolute value `drift` (module docstring)."""
    sigma = drift * math.sqrt(math.pi / 2)  # E|X| = sigma sqrt(2 / pi) for X ~ N(0, sigma^2); the mean is negligible
    if sigma == 0:
        return 0.0
    spread = sigma * math.sqrt(length)
    return 0.5 * (1 + math.erf((spread ** 2 / 2 - math.log(clip_max)) / spread / math.sqrt(2)))


def dropped_mass_sampled(drift: float, length: int, draws: int = 20000, seed: int = 0) -> float:
    """The same share by Monte Carlo: `draws` completions of `length` token log-ratios."""
    sigma = drift * math.sqrt(math.pi / 2)
    g = torch.Generator().manual_seed(seed)
    log_r = (torch.randn(draws, length, generator=g, dtype=torch.float64) * sigma - sigma ** 2 / 2).sum(1)
    r = log_r.exp()
    return (r * (r > CLIP_MAX)).sum().item() / r.sum().item()


def stale_steps(out: str) -> list:
    """The metrics rows of the stale steps of a toy grpo run with --max_staleness 1 (its default mode, token_mask)."""
    subprocess.run([sys.executable, "grpo.py", "--seed", "1", "--max_staleness", "1", "--eval_steps", "0",
                    "--output_dir", out], cwd=ROOT, check=True, capture_output=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "async/logprob_diff" in r]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        rows = stale_steps(os.path.join(tmp, "run"))
    drifts = sorted(r["async/logprob_diff"] for r in rows)
    points = {"median step": statistics.median(drifts), "90th percentile step": drifts[int(0.9 * (len(drifts) - 1))],
              "largest step": drifts[-1]}
    lines = [f"# Stale samples: the importance mass each mask drops ({datetime.date.today()})", "",
             "`python benchmark/stale_weights.py` (the model: its docstring). Per-token drift |log pi_prox - log "
             f"pi_behav| of `python grpo.py --seed 1 --max_staleness 1` on the toy task, over its {len(drifts)} "
             f"stale steps; mask at r > {CLIP_MAX:g} (the default clip_max, no lower bound). Share of the importance "
             "mass dropped (closed form; Monte Carlo in brackets):", "",
             "| drift (mean abs log-ratio per token) | token_mask | " +
             " | ".join(f"sequence_mask, {n} tokens" for n in LENGTHS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in LENGTHS) + " |"]
    for name, drift in points.items():
        cells = [f"{dropped_mass(drift, n):.1%} ({dropped_mass_sampled(drift, n):.1%})" for n in LENGTHS]
        lines.append(f"| {name}: {drift:.4f} | {dropped_mass(drift, 1):.1%} | " + " | ".join(cells) + " |")
    masked, largest = max(r["async/is_masked_frac"] for r in rows), max(r["async/is_weight_max"] for r in rows)
    lines += ["", f"In the toy run itself (8-token completions, token_mask): at most {masked:.1%} of a step's tokens "
              f"masked, largest weight {largest:.2f}.",
              "", "token_mask drops a token only when its own ratio leaves the bounds; sequence_mask drops a whole "
              "completion when the product of its ratios does, which at a few hundred tokens and more happens to "
              "a large share of a stale batch as soon as the policy moves. Hence the default with --max_staleness "
              "> 0 and a per-token loss: token_mask (AReaL's rule); sequence_mask stays TRL's default for samples "
              "of the same weights by vLLM, whose ratios come from kernel rounding, not from an update."]
    with open(RESULTS, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
