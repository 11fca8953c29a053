"""One evaluation for every algorithm on the toy task, independent of what each script logs.

For a policy (a saved `model/` folder, a checkpoint folder, or the SFT starting point) on the toy task's
held-out prompts (prompt dataset, test split, 256 prompts):
  gold_score   mean toy_task.gold_score of GREEDY completions (the ground truth, in [0, 1])
  rm_score     mean toy reward-model score of the same greedy completions (the proxy that RL optimises)
  kl           sequence KL(pi || pi_sft), estimated as mean_y [log pi(y|x) - log pi_sft(y|x)] summed over the
               completion tokens, y SAMPLED from pi at temperature 1 (`samples_per_prompt` per prompt, fixed
               seed): an unbiased (k1) estimate of the KL the RL objectives penalise
  eos_rate, response_length   of the greedy completions

    python benchmark/uniform_eval.py runs/some_run/model [more folders ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import policy_common as pc  # noqa: E402
from plumbing import data_utils as du  # noqa: E402
from plumbing import models  # noqa: E402
from plumbing import prompt_sharing as ps  # noqa: E402
from toy_worlds import toy_task  # noqa: E402


class ToyEvaluator:
    """Holds the toy tokenizer, the SFT reference, the reward model and the held-out prompts; call
    `evaluate(policy)` on any causal LM with the toy vocabulary."""

    def __init__(self, toy_seed: int = 0, num_prompts: int = 256, samples_per_prompt: int = 4, seed: int = 1234,
                 setting: str = "toy"):
        paths = toy_task.build(seed=toy_seed, verbose=False, setting=setting)
        self.response_length = toy_task.SETTINGS[setting].max_new_tokens  # the scripts' --response_length there
        self.tokenizer = models.load_tokenizer(paths["policy"])
        self.sft_path = paths["policy"]
        self.reference = models.load_causal_lm(paths["policy"], self.tokenizer).eval()
        self.reward_model = models.load_scalar_model(paths["reward"], self.tokenizer).eval()
        self.prompts = list(du.load_prompt_dataset(paths["prompt_dataset"], "test")["prompt"][:num_prompts])
        self.queries = pc.pad_sequences(du.tokenize_prompts(self.tokenizer, self.prompts), self.tokenizer.pad_token_id,
                                        "left")
        self.samples_per_prompt, self.seed = samples_per_prompt, seed
        # the KL samples repeat each prompt samples_per_prompt times: encode it once when that saves enough
        share_prompts = ps.worth_sharing(len(self.prompts) * samples_per_prompt, samples_per_prompt,
                                         self.queries.shape[1], self.response_length)
        pad = self.tokenizer.pad_token_id  # log-probs at temperature 1, as the KL samples are drawn
        self.forward = (ps.SharedPromptForward if share_prompts else pc.Forward)(pad)
        self.reward_forward = pc.ScalarForward(pad)

    def load_policy(self, path: str):
        """A saved model folder (`DIR/model`), or an accelerate checkpoint folder holding model.safetensors
        (loaded into the SFT architecture; PPO's `policy.` prefix and value-head weights are handled)."""
        if os.path.exists(os.path.join(path, "config.json")):
            return models.load_causal_lm(path, self.tokenizer).eval()
        from safetensors.torch import load_file

        files = [f for f in ("model.safetensors", "pytorch_model.bin") if os.path.exists(os.path.join(path, f))]
        if not files:
            raise FileNotFoundError(f"{path}: neither a model folder nor a checkpoint with model.safetensors")
        state = load_file(os.path.join(path, files[0])) if files[0].endswith(".safetensors") else torch.load(
            os.path.join(path, files[0]), map_location="cpu")
        model = models.load_causal_lm(self.sft_path, self.tokenizer)
        wanted = set(model.state_dict())
        for prefix in ("", "policy.", "module.", "module.policy.", "base_model.model."):
            candidate = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if wanted <= set(candidate):
                model.load_state_dict({k: candidate[k] for k in wanted})
                return model.eval()
        raise KeyError(f"{path}: checkpoint weights do not match the toy policy (LoRA checkpoints are not supported)")

    @torch.no_grad()
    def evaluate(self, policy) -> dict:
        tok, pad, eos = self.tokenizer, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        context_length = self.queries.shape[1]
        greedy = pc.make_generation_config(tok, self.response_length, greedy=True)
        query_responses, _ = pc.batch_generation(policy, self.queries, pad, eos, greedy, chunk_size=512)
        responses = query_responses[:, context_length:]
        completions = [tok.decode(r, skip_special_tokens=True) for r in responses]
        gold = [toy_task.gold_score(p, c) for p, c in zip(self.prompts, completions)]
        rm = self.reward_forward.rewards(self.reward_model, query_responses)

        # sampled sequence KL to the SFT policy (fixed seed: the same draw for every policy evaluated)
        torch.manual_seed(self.seed)
        sampling = pc.make_generation_config(tok, self.response_length, temperature=1.0)
        queries = self.queries.repeat_interleave(self.samples_per_prompt, 0)
        sampled, _ = pc.batch_generation(policy, queries, pad, eos, sampling, chunk_size=1024, forward=self.forward)
        mask = sampled[:, context_length:] != pad
        logp = self.forward.logprobs(policy, sampled, context_length)
        ref_logp = self.forward.logprobs(self.reference, sampled, context_length)
        kl = ((logp - ref_logp) * mask).sum(1)
        return {
            "gold_score": sum(gold) / len(gold), "rm_score": rm.mean().item(), "kl": kl.mean().item(),
            "eos_rate": (responses == eos).any(1).float().mean().item(),
            "response_length": (responses != pad).sum(1).float().mean().item(),
            "num_prompts": len(self.prompts), "kl_samples": int(mask.shape[0]),
            "example": {"prompt": self.prompts[0], "completion": completions[0]},
        }

    def evaluate_path(self, path: str) -> dict:
        return self.evaluate(self.load_policy(path))

    def evaluate_sft(self) -> dict:
        return self.evaluate(self.reference)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", help="model or checkpoint folders (none: evaluate the SFT policy)")
    parser.add_argument("--num_prompts", type=int, default=256)
    parser.add_argument("--samples_per_prompt", type=int, default=4)
    parser.add_argument("--setting", default="toy", choices=list(toy_task.SETTINGS), help="which toy world")
    args = parser.parse_args()
    evaluator = ToyEvaluator(num_prompts=args.num_prompts, samples_per_prompt=args.samples_per_prompt,
                             setting=args.setting)
    results = {p: evaluator.evaluate_path(p) for p in args.paths} or {"sft": evaluator.evaluate_sft()}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
