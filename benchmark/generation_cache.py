"""HF generate on transformers' dynamic key/value cache against a static one (--cache_implementation static).

    python benchmark/generation_cache.py      # the 104M spread-length world -> results/generation_cache.md
    python benchmark/generation_cache.py --size 8 256 3072 --out benchmark/results/generation_cache_7m.md

The dynamic cache grows by concatenation: at every new token each layer's keys and values are copied whole into a
tensor one position longer, so a completion of R tokens after a prompt of Lq copies about R x (Lq + R/2) positions
per row and layer. The static cache (policy_common.batch_generation makes one of exactly Lq + R positions per call)
is written in place, one position per token. This times `batch_generation` as an RL step calls it, on
padding_free.py's spread-length world (prompts of 64 to 448 tokens, completions ending at EOS after 15-19 tokens on
average, cut at 53; the policy of --size, the 104M one by default): RLOO's and GRPO's TL;DR batch, 4 prompts x 4
samples (prompt sharing prefills the cache), and 16 distinct prompts (no sharing). Each round times every setting
with both caches, in alternating order, the same seeds, one process, alone; the report gives the median seconds a
batch, the static / dynamic ratio of each round and its median, and whether both caches sampled the same tokens.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from padding_free import build_spread_world, world_folder  # noqa: E402
from speed import machine  # noqa: E402
from speed_settings import TLDR  # noqa: E402

import policy_common as pc  # noqa: E402
from plumbing import data_utils as du  # noqa: E402
from plumbing import models  # noqa: E402
from plumbing import prompt_sharing as ps  # noqa: E402

SETTINGS = {"4 prompts x 4 samples, shared prefill": (4, 4), "16 distinct prompts": (16, 1)}  # (prompts, k)
CACHES = ("dynamic", "static")


@torch.no_grad()
def time_batches(model, tokenizer, prompts: list, k: int, cache: str, batches: int) -> tuple:
    """Seconds per `batch_generation` call over `batches` batches of len(prompts) // batches prompts x k samples
    (the rollout's layout: left-padded, each prompt k times in a row), and the sampled tokens."""
    pad, eos, per = tokenizer.pad_token_id, tokenizer.eos_token_id, len(prompts) // batches
    config = pc.make_generation_config(tokenizer, TLDR["response_length"], TLDR["temperature"],
                                       cache_implementation=cache)
    forward = ps.SharedPromptForward(pad) if k > 1 else pc.Forward(pad)  # k > 1: each prompt's prefill encoded once
    seconds, samples = [], []
    for b in range(batches):
        queries = pc.pad_sequences(prompts[b * per:(b + 1) * per], pad, "left").repeat_interleave(k, 0)
        torch.manual_seed(b)
        start = time.perf_counter()
        query_responses, _ = pc.batch_generation(model, queries, pad, eos, config, len(queries), forward=forward)
        seconds.append(time.perf_counter() - start)
        samples.append(query_responses)
    return statistics.mean(seconds), samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", nargs=3, type=int, default=[12, 768, 12288], metavar=("LAYERS", "WIDTH", "VOCAB"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=3, help="batches timed per setting, cache and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "generation_cache.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size = tuple(args.size)
    paths = build_spread_world(world_folder(size), size)
    tokenizer = models.load_tokenizer(paths["policy"])
    model = models.load_causal_lm(paths["policy"], tokenizer).eval()
    prompts = du.tokenize_prompts(tokenizer, du.load_prompt_dataset(paths["prompt_dataset"], "train")["prompt"])
    time_batches(model, tokenizer, prompts[:4], 1, "dynamic", 1)  # warm-up
    seconds = {(s, c): [] for s in SETTINGS for c in CACHES}
    same = {s: True for s in SETTINGS}
    for round_ in range(args.rounds):
        for setting, (n, k) in SETTINGS.items():
            chosen = prompts[round_ * 64:round_ * 64 + n * args.batches]
            outputs = {}
            for cache in (CACHES if round_ % 2 == 0 else CACHES[::-1]):
                mean_seconds, outputs[cache] = time_batches(model, tokenizer, chosen, k, cache, args.batches)
                seconds[setting, cache].append(mean_seconds)
                print(f"[generation_cache] round {round_ + 1} {setting} {cache}: {seconds[setting, cache][-1]:.2f} s",
                      flush=True)
            same[setting] &= all(torch.equal(a, b) for a, b in zip(*outputs.values()))
    lines = [f"# HF generate: dynamic vs static key/value cache (benchmark/generation_cache.py, "
             f"{datetime.date.today()})",
             "", f"Machine: {machine()}; {args.threads} threads; {args.rounds} rounds of {args.batches} batches per "
             f"setting and cache; policy: {size[0]} layers, width {size[1]}, vocabulary {size[2]}.", "",
             __doc__.split("\n\n")[2].strip(), "",
             "| setting | dynamic s/batch | static s/batch | static / dynamic (median; rounds) | same samples |",
             "| --- | --- | --- | --- | --- |"]
    for setting in SETTINGS:
        dynamic, static = seconds[setting, "dynamic"], seconds[setting, "static"]
        ratios = [s / d for s, d in zip(static, dynamic)]
        lines.append(f"| {setting} | {statistics.median(dynamic):.2f} | {statistics.median(static):.2f} | "
                     f"**{statistics.median(ratios):.2f}** ({', '.join(f'{r:.2f}' for r in ratios)}) | "
                     f"{'yes' if same[setting] else 'no'} |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
