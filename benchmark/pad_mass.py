"""How much probability does the pad token hold, and what did scoring with it cost? (issue 20, item 1)

    python benchmark/pad_mass.py            # toy SFT policy and the TL;DR-shaped stand-in -> results/pad_mass.md

Sampling suppresses the pad token, so completions come from p(token) / (1 - p(pad)). Before, the forward passes
(old log-probs, the reference, the gradient) scored the unsuppressed p instead: every response token's log-prob
was low by -log(1 - p(pad)). Now `policy_common.Forward.logits` masks pad as sampling does. For sampled completions
this prints the pad token's probability at the response positions, the per-sequence log-prob gap it made (sampling
minus the unmasked forward), and the largest difference between the sampling log-probs and today's forward
(float rounding only).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import policy_common as pc  # noqa: E402
from plumbing import data_utils as du  # noqa: E402
from plumbing import models  # noqa: E402


@torch.no_grad()
def measure(policy_path: str, dataset: str, split: str, num_prompts: int, k: int, response_length: int,
            temperature: float, chunk: int) -> dict:
    torch.manual_seed(0)
    tokenizer = models.load_tokenizer(policy_path)
    model = models.load_causal_lm(policy_path, tokenizer).eval()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts = du.load_prompt_dataset(dataset, split)["prompt"][:num_prompts]
    queries = pc.pad_sequences(du.tokenize_prompts(tokenizer, prompts), pad, "left").repeat_interleave(k, 0)
    config = pc.make_generation_config(tokenizer, response_length, temperature)
    query_responses, sampled = pc.batch_generation(model, queries, pad, eos, config, chunk)
    C = queries.shape[1]
    forward = pc.Forward(pad, temperature)
    mask = query_responses[:, C:] != pad
    p_pad, unmasked, masked = [], [], []
    for i in range(0, len(query_responses), chunk):
        rows = query_responses[i:i + chunk]
        raw = forward.logits(model, rows, C, mask_pad=False)  # the unmasked distribution
        p_pad.append(raw.softmax(-1)[..., pad])
        unmasked.append(pc.selective_logprobs(raw, rows[:, C:]))
        masked.append(forward.logprobs(model, rows, C))
    p_pad, unmasked, masked = torch.cat(p_pad)[mask], torch.cat(unmasked), torch.cat(masked)
    gap = ((sampled - unmasked) * mask).sum(1)  # per sequence: sum over tokens of -log(1 - p(pad))
    return {"sequences": len(query_responses), "tokens": int(mask.sum()), "p_pad_mean": p_pad.mean().item(),
            "p_pad_max": p_pad.max().item(), "gap_mean": gap.mean().item(), "gap_max": gap.max().item(),
            "after_max_diff": (sampled - masked)[mask].abs().max().item()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results", "pad_mass.md"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    import tempfile

    from speed_settings import TLDR, build_tldr_shaped

    from toy_worlds import toy_task

    toy = toy_task.build(verbose=False)
    tldr = build_tldr_shaped(os.path.join(tempfile.gettempdir(), "policy_rlhf_speed_tldr_v2"))
    settings = {
        "toy SFT policy (256 held-out prompts x 4, 8 new tokens, T = 1.0)":
            measure(toy["policy"], toy["prompt_dataset"], "test", 256, 4, 8, 1.0, 256),
        f"TL;DR-shaped stand-in (random weights, vocabulary {TLDR['vocab']}; 4 prompts of {TLDR['prompt_tokens']} "
        f"tokens x 4, {TLDR['response_length']} new tokens, T = {TLDR['temperature']})":
            measure(tldr["policy"], tldr["prompt_dataset"], "train", 4, 4, TLDR["response_length"],
                    TLDR["temperature"], 16),
    }
    lines = ["# Pad-token probability: what scoring the unsuppressed distribution cost", "",
             f"Written by `python benchmark/pad_mass.py` on {datetime.date.today()}. Completions sampled with pad "
             "suppressed; 'before' = the forward without masking (as every forward scored until issue 20), 'after' = "
             "`pc.Forward.logprobs` today (pad masked as in sampling).", "",
             "| policy | sequences (tokens) | p(pad) mean / max per token | before: log-prob gap per sequence, mean / "
             "max (nats) | after: largest difference from the sampling log-probs |",
             "| --- | --- | --- | --- | --- |"]
    for name, m in settings.items():
        lines.append(f"| {name} | {m['sequences']} ({m['tokens']}) | {m['p_pad_mean']:.2e} / {m['p_pad_max']:.2e} | "
                     f"{m['gap_mean']:.2e} / {m['gap_max']:.2e} | {m['after_max_diff']:.1e} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
