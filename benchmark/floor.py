"""The floor under a training step: the model work of the passes a script's step still makes, timed bare.

    python benchmark/floor.py                      # toy and TL;DR shapes -> benchmark/results/floor.md
    python benchmark/floor.py --setting tldr --repeats 3

For each algorithm and setting of benchmark/speed.py (the same models, batch shapes and prompt-sharing decisions
as the scripts), this times the model calls one step of ours makes, each alone, with nothing around them:
  rloo   generate (the sampled log-probs are the old ones) | reference log-probs | reward | forward + backward | AdamW
  grpo   generate | reference log-probs (beta > 0 only) | reward | forward + backward | AdamW
  dpo    reference log-probs | forward + backward (chosen and rejected, each prompt once) | AdamW
  kto    reference log-probs | forward + backward (own completions; the mismatched ones without gradient) | AdamW
  distill  generate | teacher logits | forward + backward (the student's logits, the divergence) | AdamW
Their sum is the step time ours could reach with no loss, bookkeeping or framework around the model: divided by
TRL's step from the latest speed.py report of the setting (results/speed*.json) it is the ratio that no trimming of
the rest can beat; only fewer or cheaper passes move it. Median of --repeats timings after one warm-up each.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from speed_settings import hyper, setting_paths  # noqa: E402

ALGOS = ("rloo", "grpo", "dpo", "kto", "distill")
REPEATS = {"toy": 20, "tldr": 5}  # timed calls of each pass, by setting, unless --repeats


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def flags(setting: str, algo: str) -> dict:
    """The hyper-parameters the script runs with in `setting` (its toy defaults, or speed_settings' TL;DR values
    over the script's defaults)."""
    import importlib

    module = importlib.import_module(algo)
    values = dataclasses.asdict(module.Args())  # the script's defaults, its flag groups' included
    values.update(hyper(setting, algo))
    if values.get("local_rollout_forward_batch_size") is None:
        values["local_rollout_forward_batch_size"] = values["per_device_train_batch_size"]
    return values


def measure(setting: str, algo: str, repeats: int) -> dict:
    """{pass name: median seconds} of one step's model calls."""
    import torch
    from datasets import load_from_disk

    import kto
    import policy_common as pc
    from plumbing import models
    from plumbing import prompt_sharing as ps

    torch.manual_seed(0)
    paths = setting_paths(setting)
    tokenizer = models.load_tokenizer(paths["policy"])
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    policy = models.load_causal_lm(paths["policy"], tokenizer)
    models.disable_dropout(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-7)
    f = flags(setting, algo)
    temperature = f.get("temperature", 1.0)
    passes = {}

    def update(loss_fn):  # forward + backward of the loss, then the optimizer step, timed apart
        def backward():
            loss_fn().backward()

        passes["forward + backward"] = timed(backward, repeats)
        passes["AdamW step"] = timed(lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=False)), repeats)

    if algo in ("rloo", "grpo"):
        k = f["rloo_k"] if algo == "rloo" else f["num_generations"]
        B, R = f["per_device_train_batch_size"], f["response_length"]
        chunk = f["local_rollout_forward_batch_size"]
        prompts = load_from_disk(paths["prompt_dataset"])["train"]["prompt"][:B // k]
        queries = pc.pad_sequences([tokenizer(p)["input_ids"] for p in prompts], pad, "left").repeat_interleave(k, 0)
        share = f["share_prompts"] and ps.worth_sharing(min(B, chunk), k, queries.shape[1], R)
        forward = (ps.SharedPromptForward if share else pc.Forward)(pad, temperature)  # the output layer unchunked
        reward_forward = (ps.SharedPromptScalarForward if share else pc.ScalarForward)(pad)
        config = pc.make_generation_config(tokenizer, R, temperature)
        query_responses, _ = pc.batch_generation(policy, queries, pad, eos, config, chunk, forward=forward)
        ctx = queries.shape[1]
        passes["generate"] = timed(lambda: pc.batch_generation(policy, queries, pad, eos, config, chunk,
                                                               forward=forward), repeats)
        if algo == "rloo" or f["beta"] > 0:
            reference = pc.Reference("copy", forward, model=models.load_causal_lm(paths["policy"], tokenizer))
            passes["reference log-probs"] = timed(lambda: reference.logprobs(query_responses, ctx, chunk), repeats)
        reward = models.load_scalar_model(paths["reward"], tokenizer)
        with torch.no_grad():
            passes["reward"] = timed(lambda: reward_forward.rewards(reward, query_responses, ctx), repeats)
        responses = query_responses[:, ctx:]
        update(lambda: (pc.selective_logprobs(forward.logits(policy, query_responses, ctx), responses)
                        * (responses != pad)).sum())
        return passes

    if algo == "distill":  # one completion per prompt (nothing to share), the whole vocabulary (no top-k)
        import distill

        B, R, chunk = f["per_device_train_batch_size"], f["response_length"], f["local_rollout_forward_batch_size"]
        prompts = load_from_disk(paths["prompt_dataset"])["train"]["prompt"][:B]
        queries = pc.pad_sequences([tokenizer(p)["input_ids"] for p in prompts], pad, "left")
        config = pc.make_generation_config(tokenizer, R, temperature)
        query_responses, _ = pc.batch_generation(policy, queries, pad, eos, config, chunk)
        ctx = queries.shape[1]
        passes["generate"] = timed(lambda: pc.batch_generation(policy, queries, pad, eos, config, chunk), repeats)
        teacher = models.load_causal_lm(paths["teacher"], tokenizer)
        teacher.eval()
        forward = pc.Forward(pad, temperature)
        with torch.no_grad():
            teacher_logits = forward.logits(teacher, query_responses, ctx)
            passes["teacher logits"] = timed(lambda: forward.logits(teacher, query_responses, ctx), repeats)
        mask = query_responses[:, ctx:] != pad
        update(lambda: (distill.generalized_jsd(forward.logits(policy, query_responses, ctx), teacher_logits,
                                                f["beta"]) * mask).sum())
        return passes

    # DPO and KTO: prompts and completions from the setting's datasets, each prompt twice (chosen / rejected,
    # own / mismatched), prompts left-padded and completions right-padded as the scripts collate them
    Lq, R = f["max_prompt_length"], f["max_length"] - f["max_prompt_length"]
    n = f["per_device_train_batch_size"]
    if algo == "dpo":
        rows = load_from_disk(paths["preference_dataset"])["train"].select(range(n))
        completions = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    else:
        rows = load_from_disk(paths["unpaired_dataset"])["train"].select(range(n))
        completions = [r["completion"] for r in rows]
        completions += completions[-1:] + completions[:-1]  # the mismatched pair (x_k, y_{k-1})
    encode = lambda text, limit: tokenizer(text, add_special_tokens=False)["input_ids"][:limit]  # noqa: E731
    prompt_ids = [encode(r["prompt"], None)[-Lq:] for r in rows] * 2  # cut from the left, as the scripts
    completion_ids = [encode(c, R - 1) + [eos] for c in completions]
    query_responses = torch.cat([pc.pad_sequences(prompt_ids, pad, "left"),
                                 pc.pad_sequences(completion_ids, pad, "right")], 1)  # (2n, Lq' + R')
    ctx = query_responses.shape[1] - max(map(len, completion_ids))
    if algo == "dpo":
        share = f["share_prompts"] and ps.worth_sharing(2 * n, 2, Lq, R)
        forward = (ps.SharedPromptForward if share else pc.Forward)(pad)
        reference = pc.Reference("copy", forward, model=models.load_causal_lm(paths["policy"], tokenizer))
        passes["reference log-probs"] = timed(lambda: reference.logprobs(query_responses, ctx, 2 * n), repeats)
        responses = query_responses[:, ctx:]
        update(lambda: (forward.logprobs(policy, query_responses, ctx) * (responses != pad)).sum())
    else:  # kto.py's decision: each prompt encoded once (joint) where its forwards share prompts
        kto_args = kto.Args(**{field.name: f[field.name] for field in dataclasses.fields(kto.Args)})
        kto_args.padding_free, kto_args.logprob_chunk_tokens = False, 0  # unpacked, the output layer whole
        forward = kto.kto_forwards(kto_args, pad).lm(policy)
        joint = forward.shares_prompts
        reference = pc.Reference("copy", forward, model=models.load_causal_lm(paths["policy"], tokenizer))
        with torch.no_grad():
            passes["reference log-probs"] = timed(lambda: kto.completion_logprob_sums(
                reference.logprobs, query_responses, ctx, pad, joint), repeats)
        update(lambda: kto.policy_logprob_sums(policy, forward, query_responses, ctx, pad, joint)[:n].sum())
    return passes


def trl_steps(setting: str) -> dict:
    """{algo: (ours' step, TRL's step, report date)} from the latest speed.py reports of the setting."""
    names = {"toy": ("speed.json",), "tldr": ("speed_tldr.json",)}[setting]
    steps = {}
    for name in names:
        path = os.path.join(HERE, "results", name)
        if not os.path.exists(path):
            continue
        results = json.load(open(path))["results"]
        for algo in ALGOS:
            ours, trl = results.get(f"ours:{algo}", {}), results.get(f"trl:{algo}", {})
            if algo not in steps and "step" in ours and "step" in trl:
                steps[algo] = (ours["step"], trl["step"], name)
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", nargs="+", default=["toy", "tldr"], choices=("toy", "tldr"))
    parser.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    parser.add_argument("--repeats", type=int, help="timed calls of each pass (median), after a warm-up; default "
                        f"{REPEATS['toy']} (toy), {REPEATS['tldr']} (tldr)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "floor.md"),
                        help="the report; a path ending in .json gets {setting: {algo: {passes, step}}} in seconds "
                             "instead (benchmark/speed.py --floor runs this script so, between its TRL rounds)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.out.endswith(".json"):
        results = {}
        for setting in args.setting:
            for algo in args.algos:
                passes = measure(setting, algo, args.repeats or REPEATS[setting])
                results.setdefault(setting, {})[algo] = dict(passes=passes, step=sum(passes.values()))
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        return
    lines = ["# The floor under a step: model work of the passes that remain", "",
             f"Written by `python benchmark/floor.py {' '.join(sys.argv[1:])}` on {datetime.date.today().isoformat()}"
             f"; {args.threads} threads, median of "
             f"{args.repeats or ' / '.join(f'{n} ({setting})' for setting, n in REPEATS.items())}"
             " timings after a warm-up. "
             "Each pass timed bare, "
             "alone (benchmark/floor.py's docstring). 'floor / TRL' divides the sum by TRL's step from the speed "
             "report named (a different process and minute: an estimate, good to the machine's ~10-20% noise).", ""]
    for setting in args.setting:
        steps = trl_steps(setting)
        lines += [f"## {setting}", "", "| algorithm | passes (ms) | floor (ms) | ours' step (ms) | TRL's step (ms) | "
                  "floor / TRL | ours / TRL | report |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for algo in args.algos:
            print(f"[floor] {setting} {algo}", flush=True)
            passes = measure(setting, algo, args.repeats or REPEATS[setting])
            floor = sum(passes.values())
            detail = ", ".join(f"{name} {1000 * t:.1f}" for name, t in passes.items())
            ours, trl, report = steps.get(algo, (None, None, "-"))
            cells = ("-", "-", "-", "-") if trl is None else (f"{1000 * ours:.1f}", f"{1000 * trl:.1f}",
                                                             f"{floor / trl:.2f}x", f"{ours / trl:.2f}x")
            lines.append(f"| {algo} | {detail} | {1000 * floor:.1f} | " + " | ".join(cells) + f" | {report} |")
        lines.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
