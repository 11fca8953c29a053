"""Win rate of a trained policy's TL;DR summaries against the reference summaries, judged by an LLM behind any
OpenAI-compatible chat endpoint; without a judge, a reward-model comparison instead (clearly labelled).

    # judge with an OpenAI-compatible endpoint (key read from the environment variable named by --api_key_env)
    python benchmark/judge.py --model runs/rloo_tldr/model --judge_base_url https://api.openai.com/v1 \
        --judge_model gpt-4o-mini --num_examples 1000
    # no judge available: reward-model scores of policy and reference summaries
    python benchmark/judge.py --model runs/rloo_tldr/model --reward_model pythia-1b
    # judge summaries generated elsewhere (e.g. with vLLM): a .jsonl with prompt, completion, reference
    python benchmark/judge.py --completions_file summaries.jsonl --judge_base_url http://localhost:8000/v1 \
        --judge_model M

Published numbers to compare with (TRL documentation, RLOO and PPO trainer pages, "Benchmark experiments": 1000
examples of trl-lib/tldr validation, greedy summaries, GPT-4o-mini judge): Pythia-1B SFT 33.0%, RLOO 51.2%,
PPO 64.7%. Position bias: the policy's summary is shown first or second at random (seeded), and the judge's
answer is mapped back. Not run on this project's machines (no GPU, no network): checked for syntax and argument
parsing only (tests/test_benchmark.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Our own wording of the usual TL;DR pairwise-judging prompt (in the spirit of the DPO paper's GPT-4 prompt).
JUDGE_PROMPT = """You compare two summaries of a Reddit post.

Post:
{post}

Summary A:
{a}

Summary B:
{b}

Which summary captures the most important points of the post more accurately and concisely, without
unimportant or invented details? Answer with a single letter: A or B."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_argument_group("what to judge")
    src.add_argument("--model", help="policy to generate summaries with: alias (pythia-1b...), hub id or folder")
    src.add_argument("--completions_file", help=".jsonl with prompt, completion, reference (skips generation)")
    src.add_argument("--dataset", default="trl-lib/tldr", help="prompt/reference dataset (columns prompt, completion)")
    src.add_argument("--split", default="validation", help="dataset split (TRL's published evaluation: validation)")
    src.add_argument("--num_examples", type=int, default=1000, help="first N examples of the split")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--response_length", type=int, default=53, help="max new tokens per summary")
    gen.add_argument("--max_prompt_length", type=int, default=512)
    gen.add_argument("--batch_size", type=int, default=32, help="prompts per generation call")
    gen.add_argument("--bf16", action="store_true", help="bfloat16 weights (GPU)")
    judge = parser.add_argument_group("judge (OpenAI-compatible chat completions endpoint)")
    judge.add_argument("--judge_base_url", help="e.g. https://api.openai.com/v1 or http://localhost:8000/v1; "
                                                "none = reward-model fallback")
    judge.add_argument("--judge_model", default="gpt-4o-mini")
    judge.add_argument("--api_key_env", default="OPENAI_API_KEY",
                       help="name of the environment variable holding the key")
    judge.add_argument("--max_retries", type=int, default=5)
    judge.add_argument("--timeout", type=float, default=60.0)
    fallback = parser.add_argument_group("reward-model fallback (and extra report when a judge is used)")
    fallback.add_argument("--reward_model", help="alias/hub id/folder; default: the one paired with --model if known")
    parser.add_argument("--seed", type=int, default=0, help="seed of the A/B order")
    parser.add_argument("--output", default=None, help="write per-example rows (.jsonl) and the summary (.json) here")
    args = parser.parse_args(argv)
    if not args.model and not args.completions_file:
        parser.error("give --model (to generate summaries) or --completions_file")
    if args.num_examples < 1 or args.response_length < 1 or args.batch_size < 1:
        parser.error("--num_examples, --response_length and --batch_size must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------------------
def load_examples(args) -> list:
    """[{prompt, reference}] of the first --num_examples rows."""
    from plumbing import data_utils as du

    ds = du.load_prompt_dataset(args.dataset, args.split)
    du.require_columns(ds, ["prompt", "completion"], args.dataset)
    ds = ds.select(range(min(args.num_examples, len(ds))))
    return [{"prompt": r["prompt"], "reference": r["completion"]} for r in ds]


def generate(args, examples: list) -> list:
    """Greedy summaries of the policy, as the published evaluations."""
    import torch

    import policy_common as pc
    from plumbing import data_utils as du
    from plumbing import models
    from plumbing import run_utils as ru

    name = ru.resolve_model(args.model)
    tokenizer = models.load_tokenizer(name)
    model = models.load_causal_lm(name, tokenizer, models.Precision("bfloat16" if args.bf16 else "float32")).eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    config = pc.make_generation_config(tokenizer, args.response_length, greedy=True)
    prompts = du.tokenize_prompts(tokenizer, [e["prompt"] for e in examples], args.max_prompt_length)
    for i in range(0, len(examples), args.batch_size):
        queries = pc.pad_sequences(prompts[i:i + args.batch_size], tokenizer.pad_token_id, "left").to(device)
        query_responses, _ = pc.batch_generation(model, queries, tokenizer.pad_token_id, tokenizer.eos_token_id, config,
                                                 args.batch_size)
        for j, response in enumerate(query_responses[:, queries.shape[1]:]):
            examples[i + j]["completion"] = tokenizer.decode(response, skip_special_tokens=True)
        print(f"[judge] generated {min(i + args.batch_size, len(examples))}/{len(examples)}", flush=True)
    return examples


# ---------------------------------------------------------------------------------------------------------
# Judging
# ---------------------------------------------------------------------------------------------------------
def ask_judge(args, api_key: str, post: str, a: str, b: str) -> str | None:
    """'A', 'B', or None when the answer cannot be read."""
    body = json.dumps({"model": args.judge_model, "temperature": 0, "max_tokens": 2,
                       "messages": [{"role": "user", "content": JUDGE_PROMPT.format(post=post.strip(), a=a.strip(),
                                                                                     b=b.strip())}]}).encode()
    request = urllib.request.Request(args.judge_base_url.rstrip("/") + "/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    for attempt in range(args.max_retries):
        try:
            with urllib.request.urlopen(request, timeout=args.timeout) as response:
                answer = json.load(response)["choices"][0]["message"]["content"].strip().upper()
            return answer[:1] if answer[:1] in ("A", "B") else None
        except (urllib.error.URLError, TimeoutError, KeyError, json.JSONDecodeError) as e:
            if attempt == args.max_retries - 1:
                raise SystemExit(f"judge endpoint failed after {args.max_retries} tries: {e}")
            time.sleep(2 ** attempt)
    return None


def judge_all(args, examples: list) -> dict:
    api_key = os.environ.get(args.api_key_env, "")
    rng = random.Random(args.seed)
    wins = parsed = 0
    for k, e in enumerate(examples):
        policy_first = rng.random() < 0.5
        a, b = (e["completion"], e["reference"]) if policy_first else (e["reference"], e["completion"])
        answer = ask_judge(args, api_key, e["prompt"], a, b)
        e["judge_answer"], e["policy_first"] = answer, policy_first
        if answer is not None:
            parsed += 1
            e["policy_wins"] = (answer == "A") == policy_first
            wins += e["policy_wins"]
        if (k + 1) % 100 == 0:
            print(f"[judge] {k + 1}/{len(examples)} judged, win rate so far {wins / max(parsed, 1):.3f}", flush=True)
    return {"judge_model": args.judge_model, "win_rate": wins / max(parsed, 1), "judged": parsed,
            "unreadable_answers": len(examples) - parsed}


def reward_model_report(args, examples: list) -> dict:
    """Mean reward-model score of the policy's and of the reference summaries, and how often the policy's is
    higher. A proxy (the RL objective itself), NOT comparable with judge win rates."""
    import torch

    import policy_common as pc
    from plumbing import models
    from plumbing import run_utils as ru

    name = args.reward_model or (ru.default_reward_model(args.model) if args.model else None)
    if name is None:
        raise SystemExit("no judge and no --reward_model: nothing to evaluate with")
    path = ru.resolve_reward_model(name)
    tokenizer = models.load_tokenizer(path)
    model = models.load_scalar_model(path, tokenizer, models.Precision("bfloat16" if args.bf16 else "float32")).eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    forward = pc.ScalarForward(tokenizer.pad_token_id)

    @torch.no_grad()
    def scores(key):
        out = []
        for i in range(0, len(examples), args.batch_size):
            rows = []
            for e in examples[i:i + args.batch_size]:
                q = tokenizer(e["prompt"], add_special_tokens=False)["input_ids"][-args.max_prompt_length:]
                r = tokenizer(e[key], add_special_tokens=False)["input_ids"][:args.response_length]
                rows.append((q, r + [tokenizer.eos_token_id]))
            queries = pc.pad_sequences([q for q, _ in rows], tokenizer.pad_token_id, "left")
            responses = pc.pad_sequences([r for _, r in rows], tokenizer.pad_token_id, "right")
            out += forward.rewards(model, torch.cat([queries, responses], 1).to(device)).tolist()
        return out

    policy, reference = scores("completion"), scores("reference")
    for e, p, r in zip(examples, policy, reference):
        e["rm_policy"], e["rm_reference"] = p, r
    return {"reward_model": name, "rm_score_policy": sum(policy) / len(policy),
            "rm_score_reference": sum(reference) / len(reference),
            "rm_win_rate": sum(p > r for p, r in zip(policy, reference)) / len(policy)}


def main(argv=None):
    args = parse_args(argv)
    if args.completions_file:
        with open(args.completions_file) as f:
            examples = [json.loads(line) for line in f if line.strip()][:args.num_examples]
        missing = [k for k in ("prompt", "completion", "reference") if k not in examples[0]]
        if missing:
            raise SystemExit(f"{args.completions_file}: rows lack {missing}")
    else:
        examples = generate(args, load_examples(args))
    summary = {"model": args.model or args.completions_file, "dataset": f"{args.dataset}:{args.split}",
               "num_examples": len(examples)}
    if args.judge_base_url:
        summary.update(judge_all(args, examples))
        print(f"Model win rate: {100 * summary['win_rate']:.2f}% ({summary['judged']} judged by {args.judge_model})")
    if not args.judge_base_url or args.reward_model:
        summary.update(reward_model_report(args, examples))
        print(f"No judge win rate{' requested' if args.judge_base_url else ''}: reward model {summary['reward_model']} "
              f"scores policy {summary['rm_score_policy']:.3f} vs reference {summary['rm_score_reference']:.3f}; "
              f"policy higher on {100 * summary['rm_win_rate']:.1f}% (a proxy, not comparable with judge win rates)")
    if args.output:
        base = os.path.splitext(args.output)[0]
        with open(base + ".jsonl", "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in examples)
        with open(base + ".json", "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
