"""Micro-benchmarks of benchmark/speed.py: the shared helpers against plain code, same model and batch, each
timed around the calls (one warm-up call, then the mean over --repeats). Run by speed.py, one kind per child
process (peak memory is that process's); the result is written as JSON to --out.

  generation               pc.batch_generation (one batched call, prompts shared as rloo.py decides) against a
                           naive per-example model.generate loop, on the RLOO toy batch (16 prompts x k=4)
  sharing:toy|tldr         prompt_sharing.SharedPromptForward against the plain policy_common.Forward: no-grad
                           log-probs, forward + backward, and generation. toy: the RLOO toy batch on the toy policy;
                           tldr: TL;DR shapes (4 prompts x k=2, 400-token prompts, 53-token responses) on a
                           random-weight GPT-NeoX whose layers do about 8x the work of its output layer, as in
                           Pythia-1B (speed_settings.py): the saving is set by shapes and that proportion, not by
                           weights
  logprobs:VARIANT:SHAPE   VARIANT selective = pc.Forward.logprobs (toy) or pc.selective_logprobs (pythia), full =
                           logits.log_softmax(-1).gather(...); SHAPE toy = the toy policy's forward on 64 prompts,
                           pythia = given logits of 16 x 53 x 50304 (TL;DR completions, Pythia's vocabulary)

    python benchmark/speed_baselines.py sharing:toy --repeats 3 --out /tmp/sharing.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.dirname(HERE), HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import speed_settings as settings  # noqa: E402
import torch  # noqa: E402
from toy import vm_hwm_mib  # noqa: E402

import policy_common as pc  # noqa: E402
from plumbing import data_utils as du  # noqa: E402
from plumbing import models  # noqa: E402
from plumbing import prompt_sharing as ps  # noqa: E402


def mean_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def toy_rloo_batch():
    """(toy policy, tokenizer, queries (prompts, Lq) of one RLOO toy step, rloo's toy defaults)."""
    import rloo

    d = rloo.ALIAS_DEFAULTS["toy"]
    paths = settings.setting_paths("toy")
    tok = models.load_tokenizer(paths["policy"])
    model = models.load_causal_lm(paths["policy"], tok)
    prompts = du.load_prompt_dataset(paths["prompt_dataset"], "train")["prompt"][
        :d["per_device_train_batch_size"] // d["rloo_k"]]
    return model, tok, pc.pad_sequences(du.tokenize_prompts(tok, prompts), tok.pad_token_id, "left"), d


def generation(repeats: int) -> dict:
    model, tok, queries, d = toy_rloo_batch()
    model.eval()
    queries = queries.repeat_interleave(d["rloo_k"], 0)
    config = pc.make_generation_config(tok, d["response_length"], d["temperature"])
    pad, eos = tok.pad_token_id, tok.eos_token_id
    share = ps.worth_sharing(len(queries), d["rloo_k"], queries.shape[1], d["response_length"])
    forward = (ps.SharedPromptForward if share else pc.Forward)(pad, d["temperature"])
    tokens = {}

    def batched():
        qr, _ = pc.batch_generation(model, queries, pad, eos, config, d["local_rollout_forward_batch_size"],
                                    forward=forward)
        tokens["batch_generation"] = int((qr[:, queries.shape[1]:] != pad).sum())

    @torch.no_grad()
    def naive():
        n = 0
        for row in queries:
            q = row[row != pad].unsqueeze(0)
            out = model.generate(input_ids=q, attention_mask=torch.ones_like(q), generation_config=config)
            n += int((out[0, q.shape[1]:] != pad).sum())
        tokens["naive_loop"] = n

    result = {"batch": f"{queries.shape[0]} sequences ({queries.shape[0] // d['rloo_k']} prompts x k={d['rloo_k']}), "
                       f"{d['response_length']} new tokens"}
    for name, fn in (("batch_generation", batched), ("naive_loop", naive)):
        torch.manual_seed(0)
        seconds = mean_seconds(fn, repeats)
        result[name] = dict(tokens_per_s=tokens[name] / seconds, seconds_per_batch=seconds, tokens=tokens[name])
    return result


def sharing(shape: str, repeats: int) -> dict:
    torch.manual_seed(0)
    if shape == "toy":
        model, tok, queries, d = toy_rloo_batch()
        k, R, pad, eos = d["rloo_k"], d["response_length"], tok.pad_token_id, tok.eos_token_id
    else:
        from transformers import GPTNeoXForCausalLM

        pad, eos, k, R = 0, 1, 2, settings.TLDR["response_length"]
        model = GPTNeoXForCausalLM(settings.tldr_model_config())
        queries = torch.randint(2, settings.TLDR["vocab"], (4, settings.TLDR["prompt_tokens"]))
    queries = queries.repeat_interleave(k, 0)
    responses = torch.randint(2, model.config.vocab_size, (queries.shape[0], R))
    query_responses, ctx = torch.cat([queries, responses], 1), queries.shape[1]
    config = pc.make_generation_config(types.SimpleNamespace(pad_token_id=pad, eos_token_id=eos, bos_token_id=eos),
                                       R if shape == "toy" else 8, 1.0)

    forwards = {True: ps.SharedPromptForward(pad), False: pc.Forward(pad)}  # shared against plain

    def logprobs(share):
        with torch.no_grad():
            forwards[share].logprobs(model, query_responses, ctx)

    def train(share):
        forwards[share].logprobs(model, query_responses, ctx).sum().backward()

    def generate(share):
        pc.batch_generation(model, queries, pad, eos, config, queries.shape[0], forward=forwards[share])

    passes = {}
    for name, fn, training in (("no-grad log-probs", logprobs, False), ("forward + backward", train, True),
                               (f"generation ({config.max_new_tokens} new tokens)", generate, False)):
        model.train(training)
        passes[name] = {"shared": mean_seconds(lambda: fn(True), repeats),
                        "plain": mean_seconds(lambda: fn(False), repeats)}
    return {"what": f"{queries.shape[0]} rows = {queries.shape[0] // k} prompts x k={k}, query {ctx} + response {R} "
                    f"tokens, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters",
            "worth_sharing": ps.worth_sharing(queries.shape[0], k, ctx, R), "passes": passes}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    """Restart this process's peak resident size (VmHWM) from its current size (Linux: /proc/self/clear_refs),
    so that a peak read afterwards is that of the code in between, not of anything before it (building the inputs
    alone can peak above the measurement). False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def logprobs(variant: str, shape: str, repeats: int) -> dict:
    """Time and peak extra memory (over the resident size before the first call) of response log-probs."""
    torch.manual_seed(0)
    if shape == "toy":  # 64 toy prompts with random 8-token responses through the toy policy, no grad
        paths = settings.setting_paths("toy")
        tok = models.load_tokenizer(paths["policy"])
        model = models.load_causal_lm(paths["policy"], tok).eval()
        prompts = du.load_prompt_dataset(paths["prompt_dataset"], "train")["prompt"][:64]
        q = pc.pad_sequences(du.tokenize_prompts(tok, prompts), tok.pad_token_id, "left")
        qr, ctx, pad = torch.cat([q, torch.randint(3, len(tok), (q.shape[0], 8))], 1), q.shape[1], tok.pad_token_id
        forward = pc.Forward(pad)

        @torch.no_grad()
        def run():
            if variant == "selective":
                return forward.logprobs(model, qr, ctx)
            logits = forward.logits(model, qr, ctx)
            return logits.log_softmax(-1).gather(-1, qr[:, ctx:].unsqueeze(-1)).squeeze(-1)
        what = f"toy policy forward + log-probs, {qr.shape[0]} x {qr.shape[1]} tokens, vocab {len(tok)}"
    else:  # Pythia-shaped logits: B=16 completions of R=53 tokens, vocab 50304 (TL;DR setting), float32
        B, R, V = 16, 53, 50304
        logits, tokens = torch.randn(B, R, V), torch.randint(0, V, (B, R))

        @torch.no_grad()
        def run():
            if variant == "selective":
                return pc.selective_logprobs(logits, tokens)
            return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        what = f"log-probs from given logits {B} x {R} x {V} (float32, {B * R * V * 4 / 2**20:.0f} MiB)"
    before = rss_mib()
    reset_peak_rss()
    seconds = mean_seconds(run, repeats)  # the warm-up call sets the peak
    peak = vm_hwm_mib(os.getpid())  # the lifetime peak (ru_maxrss) where /proc cannot tell
    peak_extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if peak is None else peak) - before
    return dict(seconds=seconds, peak_extra_mib=max(peak_extra, 0.0), what=what)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=settings.BASELINES)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls after one warm-up call")
    parser.add_argument("--out", required=True, help="where the result JSON goes")
    args = parser.parse_args()
    kind = args.kind.split(":")
    if kind[0] == "generation":
        result = generation(args.repeats)
    elif kind[0] == "sharing":
        result = sharing(kind[1], max(3, args.repeats // 3) if kind[1] == "tldr" else args.repeats)
    else:
        result = logprobs(kind[1], kind[2], args.repeats)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
