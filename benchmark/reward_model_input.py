"""Which input convention does a reward model expect? Score held-out preference pairs both ways and compare.

    python benchmark/reward_model_input.py --reward_model toy --dataset toy
    python benchmark/reward_model_input.py --reward_model path/to/rm --dataset my_pairs.jsonl --split train

`tokens`: prompt + completion + EOS, scored at the EOS (how rloo.py / ppo.py read it with --reward_model_input
tokens); `text`: prompt + completion without EOS, scored at the last token (--reward_model_input text). Both are
tokenised here by the reward model's own tokenizer. A reward model ranks chosen above rejected more often when read
the way it was trained; read the other way it scores a position it never learned (see README "Rewards").
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import policy_common as pc  # noqa: E402
from plumbing import data_utils as du  # noqa: E402
from plumbing import models  # noqa: E402
from plumbing import run_utils as ru  # noqa: E402


@torch.no_grad()
def pair_accuracies(reward_path: str, dataset: str, split: str, num_pairs: int, batch_size: int = 64) -> dict:
    """{"tokens": accuracy, "text": accuracy, "pairs": n}: how often chosen outscores rejected, read each way."""
    tokenizer = models.load_tokenizer(reward_path)
    model = models.load_scalar_model(reward_path, tokenizer).eval()
    data = du.load_preference_dataset(dataset, split)
    du.require_columns(data, ["prompt", "chosen", "rejected"], dataset)
    data = data.select(range(min(num_pairs, len(data))))
    texts = []  # chosen, rejected, chosen, rejected, ...
    for row in data:
        prompt = du.render_prompt(tokenizer, row["prompt"])
        texts += [prompt + du.render_completion(tokenizer, row["prompt"], row[c]) for c in ("chosen", "rejected")]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    out, forward = {"pairs": len(data)}, pc.ScalarForward(tokenizer.pad_token_id)
    for mode, suffix in (("tokens", [tokenizer.eos_token_id]), ("text", [])):
        scores = torch.cat([forward.rewards(model, pc.pad_sequences([x + suffix for x in ids[i:i + batch_size]],
                                                                    tokenizer.pad_token_id, "right"))
                            for i in range(0, len(ids), batch_size)])
        out[mode] = (scores[0::2] > scores[1::2]).float().mean().item()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward_model", required=True, help="alias (toy, pythia-1b, ...), hub id or folder")
    parser.add_argument("--dataset", required=True, help="preference data (prompt, chosen, rejected): alias, id, files")
    parser.add_argument("--split", default="test")
    parser.add_argument("--num_pairs", type=int, default=512)
    args = parser.parse_args(argv)
    path = ru.resolve_reward_model(args.reward_model)
    result = pair_accuracies(path, args.dataset, args.split, args.num_pairs)
    recorded = getattr(ru.model_config(path), "reward_model_input", None)
    print(f"{path}: chosen ranked above rejected on {result['pairs']} pairs: read as tokens (with EOS) "
          f"{result['tokens']:.3f}, read as text (no EOS) {result['text']:.3f}; its config records: {recorded}")
    best = max(("tokens", "text"), key=lambda m: result[m])
    print(f"-> --reward_model_input {best}" + ("" if abs(result["tokens"] - result["text"]) > 0.02 else
                                               " (the two are close: check how it was trained)"))
    return result


if __name__ == "__main__":
    ru.main_guard(main)
