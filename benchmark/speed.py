"""Speed and memory benchmark: seconds per training step by phase, generation throughput, peak memory; each
figure next to a baseline measured in the same run, and (optionally) next to TRL on the identical setting.

    python benchmark/speed.py                    # ours (rloo ppo dpo kto) + baselines + TRL if installed
    python benchmark/speed.py --no_trl --steps 5 # quicker, ours and the baselines only
    python benchmark/speed.py --setting tldr --algos rloo dpo kto --no_baselines --steps 4 --warmup 1 \
        --out benchmark/results/speed_tldr.md    # TL;DR shapes (400-token prompts) on random-weight stand-ins
    pip install -r benchmark/requirements-bench.txt   # TRL, benchmark-only (never imported by the scripts)

Every measurement runs in its own child process (`speed.py --worker KIND`), one at a time, so that peak
memory (the child's peak resident set size, its VmHWM polled from /proc) belongs to that measurement alone.
Step times on a shared machine move by 20-30% from run to run, so every training measurement runs --rounds
times, ours and TRL alternating; the run with the median step time is reported, with the range of the paired
(back-to-back) ratios.

Ours: the real script (`rloo.py` ...) runs in the child, on the toy task with its toy defaults (--setting toy)
or on TL;DR-shaped stand-ins (--setting tldr, see build_tldr_shaped), for --warmup + --steps optimizer steps;
the policy_common helpers it calls are wrapped with timers:
  generation       time inside pc.batch_generation
  scoring/ref      time inside no-grad forwards: pc.forward_logits / response_logprobs / selective_logprobs /
                   entropy_from_logits / scalar_forward / get_reward and Reference.logprobs (old and reference
                   log-probs, reward and value scores, KTO's KL-term forwards)
  update           the rest of the step: forwards with gradient, losses, backward, optimizer
  model work       (across phases) time inside any transformers model call, backward and the optimizer step
A step's time is the interval between the script's consecutive metrics rows, minus any time spent in its
evaluation functions (module-level `evaluate*`), averaged over the --steps steps after --warmup.

TRL (RLOOTrainer, DPOTrainer, KTOTrainer; TRL 1.16 has no PPOTrainer): the same SFT policy, reward
model, data and hyper-parameters (batch, k, response length, temperature, lr, beta, clip range), step time =
interval between on_step_end callbacks; phases from wrapped trainer methods and modules (`_generate`;
`_generate_and_score_completions` minus generation; the reference model's forward, `compute_ref_log_probs`
and KTO's no-grad `_compute_kl_logps`).

Baselines (same run): generation tokens/s of pc.batch_generation against a naive per-example
`model.generate` loop; shared-prompt encoding against plain full-row passes (toy batch and TL;DR shapes);
pc.response_logprobs (forward_logits + row-chunked selective_logprobs) against a plain forward + full
log_softmax + gather, on the toy batch and on Pythia-shaped logits (vocab 50304).
Results: benchmark/results/speed.md (and speed.json); speed_tldr.md for --setting tldr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

ALGOS = ("rloo", "ppo", "dpo", "kto")
TRL_ALGOS = ("rloo", "dpo", "kto")
TARGET = {"rloo": 0.5, "dpo": 0.7, "kto": 0.7}  # our step time / TRL's, at most (issue 8)
PHASES = ("generation", "scoring", "update")
LOAD0 = os.getloadavg()[0]


from toy import wait_measuring  # noqa: E402  (child peak memory, shared with the toy harness)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------------------
# Phase timers
# ---------------------------------------------------------------------------------------------------------
class PhaseTimer:
    """Accumulates time per phase. A call nested in a call of the same phase counts once (the outermost);
    calls of different phases may nest (then the caller subtracts). Nothing counts while inside an
    evaluation (phase "eval", whose own time is accumulated separately)."""

    def __init__(self):
        self.totals = {"generation": 0.0, "scoring": 0.0, "model": 0.0, "eval": 0.0}
        self.depth = {k: 0 for k in self.totals}

    def wrap(self, fn, phase, when=None):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.depth[phase] or (phase != "eval" and self.depth["eval"]) or (when is not None and not when()):
                return fn(*args, **kwargs)
            start = time.perf_counter()
            self.depth[phase] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth[phase] -= 1
                self.totals[phase] += time.perf_counter() - start
        return wrapper

    def snapshot(self) -> dict:
        return dict(self.totals, t=time.perf_counter())


def step_stats(marks: list, warmup: int) -> dict:
    """marks: [(step, snapshot)] at the end of each step -> mean seconds per step and per phase over the steps
    after `warmup` (eval time removed)."""
    marks = sorted({step: snap for step, snap in marks}.items())  # last mark per step
    deltas = []
    for (s0, a), (s1, b) in zip(marks, marks[1:]):
        if s1 <= warmup:
            continue
        n = s1 - s0
        total = (b["t"] - a["t"] - (b["eval"] - a["eval"])) / n
        gen, score = (b["generation"] - a["generation"]) / n, (b["scoring"] - a["scoring"]) / n
        model = (b.get("model", 0.0) - a.get("model", 0.0)) / n
        deltas.append(dict(step=total, generation=gen, scoring=score, update=total - gen - score, model=model, n=n))
    if not deltas:
        raise RuntimeError(f"no steps measured after warmup {warmup} (marks at steps {[s for s, _ in marks]})")
    weight = sum(d["n"] for d in deltas)
    out = {k: sum(d[k] * d["n"] for d in deltas) / weight for k in ("step", *PHASES, "model")}
    out["steps_measured"] = weight
    return out


# ---------------------------------------------------------------------------------------------------------
# Settings: the toy task (each script's toy defaults), or TL;DR shapes on CPU-sized random-weight stand-ins
# ---------------------------------------------------------------------------------------------------------
# TL;DR shapes (Huang et al. 2024; TRL's TL;DR runs): ~400-token prompts, 53-token responses, RLOO k=4, DPO pairs.
TLDR = dict(prompt_tokens=400, response_length=53, vocab=3072, layers=8, width=256, rloo_k=4, rloo_batch=16,
            dpo_batch=4, kto_batch=8, temperature=0.7)


def tldr_model_config():
    """The GPT-NeoX shape of the TL;DR stand-ins (pad 0, EOS 1)."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=TLDR["vocab"], hidden_size=TLDR["width"], num_hidden_layers=TLDR["layers"],
                         num_attention_heads=4, intermediate_size=4 * TLDR["width"], max_position_embeddings=512,
                         hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=1, pad_token_id=0)


def build_tldr_shaped(root: str) -> dict:
    """Random-weight GPT-NeoX policy and reward model (8 layers, width 256, vocabulary 3072: transformer layers do
    about 8x the work of the output layer, as in Pythia-1B), a word-level tokenizer, prompts of TLDR['prompt_tokens']
    words and preference pairs with TLDR['response_length']-token completions. Timing only: nothing here learns.
    Built once into `root` (seeded, so identical for ours and TRL)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification,
                              PreTrainedTokenizerFast)

    import torch
    from toy_task import _save_dataset

    out = {k: os.path.join(root, k) for k in ("policy", "reward", "prompt_dataset", "preference_dataset",
                                              "unpaired_dataset")}
    if os.path.exists(os.path.join(root, "done")):
        return out
    rng = random.Random(0)
    torch.manual_seed(0)
    words = [f"w{i}" for i in range(TLDR["vocab"] - 3)]
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[EOS]", "[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")
    config = tldr_model_config()
    for cls, name in ((GPTNeoXForCausalLM, "policy"), (GPTNeoXForSequenceClassification, "reward")):
        model = cls(config) if name == "policy" else cls(GPTNeoXConfig(**config.to_dict(), num_labels=1))
        model.save_pretrained(out[name])
        tokenizer.save_pretrained(out[name])
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    R = TLDR["response_length"] - 1  # + EOS
    prompts = {split: [text(TLDR["prompt_tokens"]) for _ in range(n)] for split, n in (("train", 256), ("test", 8))}
    _save_dataset({s: [{"prompt": p} for p in ps] for s, ps in prompts.items()}, out["prompt_dataset"])
    _save_dataset({s: [{"prompt": p, "chosen": " " + text(R), "rejected": " " + text(R)} for p in ps]
                   for s, ps in prompts.items()}, out["preference_dataset"])
    _save_dataset({s: [{"prompt": p, "completion": " " + text(R), "label": i % 2 == 0} for i, p in enumerate(ps)]
                   for s, ps in prompts.items()}, out["unpaired_dataset"])
    open(os.path.join(root, "done"), "w").close()
    return out


def setting_paths(setting: str) -> dict:
    if setting == "toy":
        import toy_task

        return toy_task.build(verbose=False)
    return build_tldr_shaped(os.path.join(tempfile.gettempdir(), "policy_rlhf_speed_tldr_v2"))


def hyper(setting: str, algo: str) -> dict:
    """The hyper-parameters both implementations get (ours as flags, TRL as config fields)."""
    if setting == "toy":
        return dict(importlib.import_module(algo).ALIAS_DEFAULTS["toy"])
    common = dict(gradient_accumulation_steps=1, response_length=TLDR["response_length"], max_prompt_length=512)
    if algo == "rloo":
        return dict(common, per_device_train_batch_size=TLDR["rloo_batch"], rloo_k=TLDR["rloo_k"], learning_rate=3e-6,
                    kl_coef=0.05, temperature=TLDR["temperature"], local_rollout_forward_batch_size=TLDR["rloo_batch"])
    if algo == "dpo":
        return dict(common, per_device_train_batch_size=TLDR["dpo_batch"], learning_rate=5e-7, beta=0.1,
                    max_length=512, max_prompt_length=448, warmup_ratio=0.1)
    if algo == "kto":
        return dict(common, per_device_train_batch_size=TLDR["kto_batch"], learning_rate=5e-7, beta=0.1,
                    desirable_weight=1.0, undesirable_weight=1.0, max_length=512, max_prompt_length=448)
    raise SystemExit(f"--setting tldr measures rloo, dpo and kto, not {algo}")


def ours_flags(setting: str, algo: str, paths: dict) -> list:
    if setting == "toy":
        return []
    h = hyper(setting, algo)
    data = paths[{"rloo": "prompt_dataset", "dpo": "preference_dataset", "kto": "unpaired_dataset"}[algo]]
    flags = ["--model", paths["policy"], "--dataset", data, "--num_eval_prompts", "2"]
    if algo == "rloo":
        flags += ["--reward_model", paths["reward"]]
    if algo == "dpo":
        flags += ["--max_eval_pairs", "4"]
    if algo == "kto":
        flags += ["--num_eval_examples", "8", "--per_device_eval_batch_size", str(TLDR["kto_batch"])]
    for k, v in h.items():
        flags += [f"--{k}", str(v)]
    return flags


def time_model_work(timer: PhaseTimer) -> None:
    """Phase "model": time inside the outermost call of any transformers model (forward passes, generation's
    forwards included), in Tensor.backward and in torch optimizer steps: the work both implementations must do.
    The rest of a step (sampling loop, losses, bookkeeping, framework overhead) is what code can trim."""
    import torch
    import transformers

    transformers.PreTrainedModel.__call__ = timer.wrap(torch.nn.Module.__call__, "model")
    torch.Tensor.backward = timer.wrap(torch.Tensor.backward, "model")
    for opt in (torch.optim.AdamW, torch.optim.Adam):
        opt.step = timer.wrap(opt.step, "model")


# ---------------------------------------------------------------------------------------------------------
# Workers (each runs in its own process)
# ---------------------------------------------------------------------------------------------------------
def worker_ours(algo: str, steps: int, warmup: int, setting: str = "toy") -> dict:
    """Run the real `<algo>.py` in this process with timed policy_common helpers."""
    import torch

    import policy_common as pc

    timer = PhaseTimer()
    time_model_work(timer)
    no_grad = lambda: not torch.is_grad_enabled()  # noqa: E731
    pc.batch_generation = timer.wrap(pc.batch_generation, "generation")
    for name in ("forward_logits", "response_logprobs", "selective_logprobs", "entropy_from_logits", "scalar_forward",
                 "get_reward"):
        setattr(pc, name, timer.wrap(getattr(pc, name), "scoring", when=no_grad))
    pc.Reference.logprobs = timer.wrap(pc.Reference.logprobs, "scoring")
    module = importlib.import_module(algo)
    for name in dir(module):
        if name.startswith("evaluate") and callable(getattr(module, name)):
            setattr(module, name, timer.wrap(getattr(module, name), "eval"))
    marks, setup = [], {}
    original_log = pc.MetricsLogger.log

    def log(self, metrics, step):
        if not setup:
            setup["rss_mib"] = rss_mib()
        original_log(self, metrics, step)
        marks.append((step, timer.snapshot()))

    pc.MetricsLogger.log = log
    with tempfile.TemporaryDirectory() as tmp:
        argv = [f"{algo}.py", "--output_dir", os.path.join(tmp, "run"), "--seed", "1", "--max_steps",
                str(warmup + steps), "--eval_steps", "0", "--num_eval_prompts", "16",
                *ours_flags(setting, algo, setting_paths(setting))]
        sys.argv = argv
        torch.manual_seed(0)
        with contextlib.redirect_stdout(sys.stderr):
            module.main()
        with open(os.path.join(tmp, "run", "args.json")) as f:
            run_args = json.load(f)
    stats = step_stats(marks, warmup)
    settings = {k: run_args.get(k) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "rloo_k", "num_mini_batches", "num_ppo_epochs",
        "response_length", "temperature", "learning_rate", "kl_coef", "beta", "max_length", "local_rollout_forward_batch_size")
        if run_args.get(k) is not None}
    return dict(stats, setup_rss_mib=setup.get("rss_mib"), command=" ".join(argv), settings=settings)


def _trl_env():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")


def worker_trl(algo: str, steps: int, warmup: int, setting: str = "toy") -> dict:
    """TRL's trainer on the toy task with our toy defaults translated to its config."""
    _trl_env()
    import datasets
    import torch
    import transformers
    import trl

    import policy_common as pc

    paths = setting_paths(setting)
    tokenizer = pc.load_tokenizer(paths["policy"])
    model = pc.load_causal_lm(paths["policy"], tokenizer)
    timer = PhaseTimer()
    time_model_work(timer)
    marks, setup = [], {}

    class Marks(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            setup["rss_mib"] = rss_mib()
            marks.append((0, timer.snapshot()))

        def on_step_end(self, args, state, control, **kwargs):
            marks.append((state.global_step, timer.snapshot()))

    common = dict(output_dir=None, max_steps=warmup + steps, report_to="none", save_strategy="no", logging_steps=10**6,
                  bf16=False, gradient_checkpointing=False, use_cpu=True, seed=1, disable_tqdm=True,
                  dataloader_num_workers=0, lr_scheduler_type="linear", max_grad_norm=1.0, weight_decay=0.0)
    unmatched = []
    with tempfile.TemporaryDirectory() as tmp:
        common["output_dir"] = tmp
        if algo == "rloo":
            import rloo

            d = hyper(setting, "rloo")
            config = trl.RLOOConfig(
                **common, per_device_train_batch_size=d["per_device_train_batch_size"], gradient_accumulation_steps=1,
                num_generations=d["rloo_k"], max_completion_length=d["response_length"], temperature=d["temperature"],
                top_p=1.0, top_k=0, learning_rate=d["learning_rate"], beta=d["kl_coef"], num_iterations=1,
                epsilon=rloo.Args.cliprange, normalize_advantages=False, adam_epsilon=1e-5, warmup_steps=0,
                steps_per_generation=1, log_completions=False)
            dataset = datasets.load_from_disk(paths["prompt_dataset"], keep_in_memory=True)["train"]
            trainer = trl.RLOOTrainer(model=model, reward_funcs=paths["reward"], args=config, train_dataset=dataset,
                                      processing_class=tokenizer, callbacks=[Marks()])
            cls = type(trainer)
            cls._generate = timer.wrap(cls._generate, "generation")
            cls._generate_and_score_completions = timer.wrap(cls._generate_and_score_completions, "scoring")
            unmatched = ["missing-EOS penalty (ours: score - 1.0 without EOS; TRL has no such option)",
                         "TRL scores completions by decoding them to text and re-tokenizing for the reward model "
                         "(same ids with the word-level tokenizers used here)"]
        elif algo == "dpo":
            import dpo

            d = hyper(setting, "dpo")
            config = trl.DPOConfig(
                **common, per_device_train_batch_size=d["per_device_train_batch_size"], gradient_accumulation_steps=1,
                learning_rate=d["learning_rate"], beta=d["beta"], loss_type=["sigmoid"], max_length=d["max_length"],
                warmup_steps=d["warmup_ratio"], precompute_ref_log_probs=False)
            dataset = datasets.load_from_disk(paths["preference_dataset"], keep_in_memory=True)["train"]
            trainer = trl.DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                                     callbacks=[Marks()])
            # the reference forward is a direct self.ref_model(...) call inside _compute_loss
            trainer.ref_model.forward = timer.wrap(trainer.ref_model.forward, "scoring")
        elif algo == "kto":
            import kto

            d = hyper(setting, "kto")
            config = trl.KTOConfig(
                **common, per_device_train_batch_size=d["per_device_train_batch_size"], gradient_accumulation_steps=1,
                learning_rate=d["learning_rate"], beta=d["beta"], desirable_weight=d["desirable_weight"],
                undesirable_weight=d["undesirable_weight"], max_length=d["max_length"],
                warmup_steps=kto.Args.warmup_ratio, precompute_ref_log_probs=False)
            dataset = datasets.load_from_disk(paths["unpaired_dataset"], keep_in_memory=True)["train"]
            trainer = trl.KTOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                                     callbacks=[Marks()])
            cls = type(trainer)
            cls.compute_ref_log_probs = timer.wrap(cls.compute_ref_log_probs, "scoring")
            cls._compute_kl_logps = timer.wrap(cls._compute_kl_logps, "scoring")  # no-grad policy forward, KL pairs
            trainer.ref_model.forward = timer.wrap(trainer.ref_model.forward, "scoring")
        else:
            raise ValueError(algo)
        torch.manual_seed(0)
        with contextlib.redirect_stdout(sys.stderr):
            trainer.train()
    stats = step_stats(marks, warmup)
    if algo == "rloo":  # _generate_and_score_completions includes _generate: scoring is the remainder
        stats["scoring"] -= stats["generation"]
        stats["update"] = stats["step"] - stats["generation"] - stats["scoring"]
    return dict(stats, setup_rss_mib=setup.get("rss_mib"), trl_version=trl.__version__, unmatched=unmatched)


def worker_generation(repeats: int) -> dict:
    """Tokens/s of pc.batch_generation (one batched call) against a naive per-example model.generate loop, on
    the RLOO toy batch (16 prompts x k=4, 8 new tokens, temperature 1)."""
    import torch

    import policy_common as pc
    import rloo
    import toy_task
    from uniform_eval import ToyEvaluator  # noqa: F401  (same loading path)

    d = rloo.ALIAS_DEFAULTS["toy"]
    paths = toy_task.build(verbose=False)
    tok = pc.load_tokenizer(paths["policy"])
    model = pc.load_causal_lm(paths["policy"], tok).eval()
    prompts = pc.load_any_dataset(paths["prompt_dataset"], "prompt", "train")["prompt"][:d["per_device_train_batch_size"] // d["rloo_k"]]
    ids = pc.tokenize_prompts(tok, prompts, 64)
    queries = pc.pad_sequences(ids, tok.pad_token_id, "left").repeat_interleave(d["rloo_k"], 0)
    config = pc.make_generation_config(tok, d["response_length"], d["temperature"])
    pad, eos = tok.pad_token_id, tok.eos_token_id

    def batched():
        qr, _ = pc.batch_generation(model, queries, pad, eos, config, d["local_rollout_forward_batch_size"])
        return int((qr[:, queries.shape[1]:] != pad).sum())

    @torch.no_grad()
    def naive():
        n = 0
        for row in queries:
            q = row[row != pad].unsqueeze(0)
            out = model.generate(input_ids=q, attention_mask=torch.ones_like(q), generation_config=config)
            n += int((out[0, q.shape[1]:] != pad).sum())
        return n

    results = {}
    for name, fn in (("batch_generation", batched), ("naive_loop", naive)):
        fn()  # warm-up
        torch.manual_seed(0)
        start, tokens = time.perf_counter(), 0
        for _ in range(repeats):
            tokens += fn()
        elapsed = time.perf_counter() - start
        results[name] = dict(tokens_per_s=tokens / elapsed, seconds_per_batch=elapsed / repeats, tokens=tokens)
    results["batch"] = f"{queries.shape[0]} sequences ({len(ids)} prompts x k={d['rloo_k']}), {d['response_length']} new tokens"
    return results


def worker_sharing(shape: str, repeats: int) -> dict:
    """Shared-prompt encoding (each distinct query once, its key/value cache reused by the rows that repeat it)
    against plain full-row passes, same model and batch, in one process: no-grad log-probs, forward + backward,
    and batch_generation's prefill. `toy`: the RLOO toy batch (16 prompts x k=4) on the toy policy. `tldr`: TL;DR
    shapes (4 prompts x k=2, 400-token prompts, 53-token responses) on a randomly initialised GPT-NeoX whose
    transformer layers do about 8x the work of its output layer, as in Pythia-1B (8 layers, width 256,
    vocabulary 3072; a CPU-sized stand-in): the saving is set by shapes and that proportion, not by weights."""
    import torch

    import policy_common as pc

    torch.manual_seed(0)
    if shape == "toy":
        import rloo
        import toy_task

        d = rloo.ALIAS_DEFAULTS["toy"]
        paths = toy_task.build(verbose=False)
        tok = pc.load_tokenizer(paths["policy"])
        model = pc.load_causal_lm(paths["policy"], tok)
        prompts = pc.load_any_dataset(paths["prompt_dataset"], "prompt", "train")["prompt"][:d["per_device_train_batch_size"] // d["rloo_k"]]
        queries = pc.pad_sequences(pc.tokenize_prompts(tok, prompts, 64), tok.pad_token_id, "left")
        k, R, pad, eos = d["rloo_k"], d["response_length"], tok.pad_token_id, tok.eos_token_id
    else:
        from transformers import GPTNeoXForCausalLM

        pad, eos, k, R = 0, 1, 2, TLDR["response_length"]
        model = GPTNeoXForCausalLM(tldr_model_config())
        queries = torch.randint(2, TLDR["vocab"], (4, TLDR["prompt_tokens"]))
    queries = queries.repeat_interleave(k, 0)
    responses = torch.randint(2, model.config.vocab_size, (queries.shape[0], R))
    query_responses, ctx = torch.cat([queries, responses], 1), queries.shape[1]
    config = pc.make_generation_config(types.SimpleNamespace(pad_token_id=pad, eos_token_id=eos, bos_token_id=eos),
                                       R if shape == "toy" else 8, 1.0)

    def timed(fn):
        fn()  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats

    def logprobs(share):
        with torch.no_grad():
            pc.response_logprobs(model, query_responses, ctx, pad, share_prompts=share)

    def train(share):
        pc.response_logprobs(model, query_responses, ctx, pad, share_prompts=share).sum().backward()

    def generate(share):
        saved = pc.SHARE_MIN_POSITIONS
        pc.SHARE_MIN_POSITIONS = saved if share else float("inf")
        try:
            pc.batch_generation(model, queries, pad, eos, config, queries.shape[0])
        finally:
            pc.SHARE_MIN_POSITIONS = saved

    out = {"what": f"{queries.shape[0]} rows = {queries.shape[0] // k} prompts x k={k}, query {ctx} + response {R} "
                   f"tokens, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters",
           "shares": pc.shared_queries(query_responses, ctx) is not None}
    for name, fn, mode in (("no-grad log-probs", logprobs, "eval"), ("forward + backward", train, "train"),
                           (f"generation ({config.max_new_tokens} new tokens)", generate, "eval")):
        getattr(model, mode)()
        out[name] = {"shared": timed(lambda: fn(True)), "plain": timed(lambda: fn(False))}
    return out


def worker_logprobs(variant: str, shape: str, repeats: int) -> dict:
    """Time and peak extra memory of response log-probs: `selective` = pc.response_logprobs (or
    pc.selective_logprobs on given logits), `full` = logits.log_softmax(-1).gather(...)."""
    import torch

    import policy_common as pc

    torch.manual_seed(0)
    if shape == "toy":  # the RLOO toy batch through the toy policy: forward + log-probs, no grad
        import toy_task

        paths = toy_task.build(verbose=False)
        tok = pc.load_tokenizer(paths["policy"])
        model = pc.load_causal_lm(paths["policy"], tok).eval()
        prompts = pc.load_any_dataset(paths["prompt_dataset"], "prompt", "train")["prompt"][:64]
        q = pc.pad_sequences(pc.tokenize_prompts(tok, prompts, 64), tok.pad_token_id, "left")
        responses = torch.randint(3, len(tok), (q.shape[0], 8))
        qr, ctx, pad = torch.cat([q, responses], 1), q.shape[1], tok.pad_token_id

        @torch.no_grad()
        def run():
            if variant == "selective":
                return pc.response_logprobs(model, qr, ctx, pad)
            logits = pc.forward_logits(model, qr, ctx, pad)
            return logits.log_softmax(-1).gather(-1, qr[:, ctx:].unsqueeze(-1)).squeeze(-1)
        what = f"toy policy forward + log-probs, {qr.shape[0]} x {qr.shape[1]} tokens, vocab {len(tok)}"
    else:  # Pythia-shaped logits: B=16 completions of R=53 tokens, vocab 50304 (TL;DR setting), float32
        B, R, V = 16, 53, 50304
        logits = torch.randn(B, R, V)
        tokens = torch.randint(0, V, (B, R))

        @torch.no_grad()
        def run():
            if variant == "selective":
                return pc.selective_logprobs(logits, tokens)
            return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        what = f"log-probs from given logits {B} x {R} x {V} (float32, {B * R * V * 4 / 2**20:.0f} MiB)"
    before = rss_mib()
    run()  # warm-up; also sets the peak
    extra = peak_rss_mib() - before
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return dict(seconds=(time.perf_counter() - start) / repeats, peak_extra_mib=max(extra, 0.0), what=what)


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------
def run_worker(kind: str, args, threads: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--worker_out", out, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--setting", args.setting]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    log_path = out[:-5] + ".log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        code, peak, _ = wait_measuring(proc)
    if code != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        print(f"[speed] worker {kind} failed (exit {code}):\n{tail}", file=sys.stderr, flush=True)
        return {"error": f"exit {code}: " + (tail.strip().splitlines() or ['?'])[-1][:300]}
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    os.remove(log_path)
    result.update(peak_rss_mib=peak, wall_s=time.perf_counter() - start)
    print(f"[speed] {kind}: {json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, list))})}",
          flush=True)
    return result


def trl_available() -> str | None:
    try:
        import importlib.metadata as md

        return md.version("trl")
    except Exception:
        return None


def machine() -> str:
    import torch

    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f", {int(f.readline().split()[1]) / 2**20:.0f} GiB RAM"
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} logical CPUs{mem}, {gpu}; Python {platform.python_version()}, torch "
            f"{torch.__version__}, transformers {_version('transformers')}, accelerate {_version('accelerate')}; "
            f"{platform.system()} {platform.release()}")


def _version(name):
    try:
        import importlib.metadata as md

        return md.version(name)
    except Exception:
        return "?"


def median_run(runs: list) -> dict:
    """The run with the median step time (failed runs dropped), with every run's step time and, as
    `round_steps`, the step times in round order (None for a failed run) for paired ratios."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["step"])
    if not ok:
        return runs[-1]
    return dict(ok[(len(ok) - 1) // 2], round_steps=[r.get("step") for r in runs])


def paired_ratios(ours: dict, theirs: dict) -> list:
    """ours / TRL step time per round (the two ran back to back)."""
    pairs = zip(ours.get("round_steps", [ours["step"]]), theirs.get("round_steps", [theirs["step"]]))
    return [a / b for a, b in pairs if a and b]


def ms(x) -> str:
    return "n/a" if x is None else f"{1000 * x:.1f}"


def ratio(a, b) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def model_work_section(results: dict, algos) -> list:
    """How much of each step is model work (forward passes, backward, optimizer step) and how much is everything
    else; ours' model work over TRL's step is the ratio left if all the rest cost nothing."""
    lines = ["## Model work and the rest of the step (milliseconds)", "",
             "Model work = time inside the outermost call of any transformers model (generation's forwards "
             "included), in backward and in the optimizer step. It is the same computation in both "
             "implementations except where ours encodes a shared prompt once; the rest is the sampling loop, "
             "losses, bookkeeping and framework overhead.", "",
             "| algorithm | implementation | step | model work | the rest | ours' model work / TRL's step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for algo in algos:
        ours, theirs = results.get(f"ours:{algo}"), results.get(f"trl:{algo}")
        for impl, r in (("ours", ours), ("TRL", theirs)):
            if not r or "error" in r or "model" not in r:
                continue
            floor = ""
            if impl == "ours" and theirs and "error" not in theirs:
                floor = f"{r['model'] / theirs['step']:.2f}x (target <= {TARGET.get(algo, '-')}x)"
            lines.append(f"| {algo} | {impl} | {ms(r['step'])} | {ms(r['model'])} | {ms(r['step'] - r['model'])} | "
                         f"{floor} |")
    return lines + [""]


SETTING_TEXT = {
    "toy": "Setting: the toy task with each script's toy defaults (the same model and batch for every row of an "
           "algorithm).",
    "tldr": f"Setting: TL;DR shapes on CPU-sized random-weight stand-ins (`--setting tldr`): prompts of "
            f"{TLDR['prompt_tokens']} tokens, responses of {TLDR['response_length']}; RLOO k={TLDR['rloo_k']} with "
            f"{TLDR['rloo_batch']} completions per step, DPO {TLDR['dpo_batch']} pairs and KTO {TLDR['kto_batch']} "
            "examples per step; a GPT-NeoX policy "
            f"and reward model of {TLDR['layers']} layers, width {TLDR['width']}, vocabulary {TLDR['vocab']} "
            "(transformer layers ~8x the output layer's work, as in Pythia-1B). Timing only: nothing learns.",
}


def write_report(results: dict, args, path: str, trl_version) -> None:
    lines = ["# Speed and memory benchmark", "",
             f"Written by `python benchmark/speed.py {' '.join(sys.argv[1:])}` on {datetime.date.today().isoformat()}.",
             f"Machine: {machine()}. Each measurement in its own process, one at a time, {args.threads} threads; "
             f"a run's step time is the mean over {args.steps} steps after {args.warmup} warm-up steps; every "
             f"training measurement ran {getattr(args, 'rounds', 1)} times, ours and TRL alternating, and the run "
             f"with the median step time is shown; 1-min load average {LOAD0:.2f} at the start, "
             f"{os.getloadavg()[0]:.2f} at the end (other work on the machine inflates times).", "",
             SETTING_TEXT[getattr(args, "setting", "toy")] + " Peak memory = peak resident set size of the "
             "measuring process (whole process: Python, libraries, models, optimizer, activations); 'after setup' = "
             "resident size when training starts.", "",
             "## Seconds per training step, by phase (milliseconds)", "",
             "| algorithm | implementation | step | generation | scoring / reference | update | peak memory (MiB) | "
             "memory after setup (MiB) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for algo in args.algos:
        for impl in ("ours", "trl"):
            r = results.get(f"{impl}:{algo}")
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {algo} | {impl} | failed: {r['error']} | | | | | |")
                continue
            name = "ours" if impl == "ours" else f"TRL {r.get('trl_version', '')}"
            lines.append(f"| {algo} | {name} | {ms(r['step'])} | {ms(r['generation'])} | {ms(r['scoring'])} | "
                         f"{ms(r['update'])} | {r['peak_rss_mib']:.0f} | {r['setup_rss_mib'] or 0:.0f} |")
    lines += [""]
    if trl_version is None or args.no_trl:
        lines += ["TRL comparison skipped: " + ("`--no_trl` given." if args.no_trl else
                  "trl is not installed (`pip install -r benchmark/requirements-bench.txt`)."), ""]
    else:
        lines += ["## Ours over TRL (same run)", "",
                  "| algorithm | step time ratio | range over rounds | target | phase ratios (gen / scoring / update) | "
                  "peak memory ratio | target met | where the time goes |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for algo in args.algos:
            ours, theirs = results.get(f"ours:{algo}"), results.get(f"trl:{algo}")
            if algo not in TRL_ALGOS:
                lines.append(f"| {algo} | n/a | | | | | | TRL {trl_version} has no {algo.upper()} trainer |")
                continue
            if not ours or not theirs or "error" in ours or "error" in theirs:
                lines.append(f"| {algo} | n/a | | | | | | a measurement failed (see above) |")
                continue
            rounds = paired_ratios(ours, theirs)
            spread = f"{min(rounds):.2f}-{max(rounds):.2f}x" if len(rounds) > 1 else "-"
            step_ratio = ours["step"] / theirs["step"]
            mem_ratio = ours["peak_rss_mib"] / theirs["peak_rss_mib"]
            met = step_ratio <= TARGET[algo] and mem_ratio <= 1.0
            diffs = sorted(((ours[p] - theirs[p], p) for p in PHASES), reverse=True)
            if step_ratio <= 1.0:
                where = "faster; biggest saving: " + f"{diffs[-1][1]} ({ms(-diffs[-1][0])} ms/step less)"
            else:
                where = "slower; costliest phase: " + ", ".join(f"{p} +{ms(d)} ms" for d, p in diffs if d > 0)
            if step_ratio > TARGET[algo] and step_ratio <= 1.0:
                where += f"; short of the {TARGET[algo]}x target, remaining gap mostly in " + \
                         max(PHASES, key=lambda p: ours[p] - TARGET[algo] * theirs[p])
            phase = " / ".join(ratio(ours[p], theirs[p]) if theirs[p] > 1e-4 else "-" for p in PHASES)
            lines.append(f"| {algo} | {step_ratio:.2f}x | {spread} | <= {TARGET[algo]}x | {phase} | {mem_ratio:.2f}x | "
                         f"{'yes' if met else 'no'} | {where} |")
        notes = [f"- {algo}: " + "; ".join(results[f"trl:{algo}"].get("unmatched", []))
                 for algo in TRL_ALGOS if results.get(f"trl:{algo}", {}).get("unmatched")]
        lines += ["", "Settings that could not be matched exactly:", *notes,
                  "- The LR schedule: ours follows the full run length (then --max_steps cuts it), TRL's follows "
                  "max_steps; this changes learning rates, not step cost.",
                  "- TRL tokenizes text itself (prompt and completion tokenized separately, EOS appended); with the "
                  "word-level tokenizers used here this gives the same token ids.", ""]
        lines += model_work_section(results, args.algos)
    if any(k.startswith(("generation", "sharing:", "logprobs:")) for k in results):
        lines += ["## Baselines measured in the same run", ""]
    gen = results.get("generation")
    if gen and "error" not in gen:
        b, n = gen["batch_generation"], gen["naive_loop"]
        lines += [f"Generation ({gen['batch']}):", "",
                  "| method | tokens / s | s per batch | speed-up |", "| --- | --- | --- | --- |",
                  f"| `pc.batch_generation` (one batched call) | {b['tokens_per_s']:.0f} | {b['seconds_per_batch']:.3f} | "
                  f"{b['tokens_per_s'] / n['tokens_per_s']:.1f}x |",
                  f"| naive per-example `model.generate` loop | {n['tokens_per_s']:.0f} | {n['seconds_per_batch']:.3f} | "
                  "1.0x |", ""]
    for shape in ("toy", "tldr"):
        share = results.get(f"sharing:{shape}")
        if not share or "error" in share:
            continue
        lines += [f"Shared prompts ({share['what']}; each distinct query encoded once, its cache reused):", "",
                  "| pass | shared (ms) | plain (ms) | time ratio |", "| --- | --- | --- | --- |"]
        for name, t in share.items():
            if isinstance(t, dict):
                lines.append(f"| {name} | {1000 * t['shared']:.1f} | {1000 * t['plain']:.1f} | "
                             f"{t['shared'] / t['plain']:.2f}x |")
        lines += [""]
    for shape in ("toy", "pythia"):
        sel, full = results.get(f"logprobs:selective:{shape}"), results.get(f"logprobs:full:{shape}")
        if not sel or not full or "error" in sel or "error" in full:
            continue
        lines += [f"Response log-probs, {sel['what']}:", "",
                  "| method | ms | peak extra memory (MiB) | time ratio | memory ratio |", "| --- | --- | --- | --- | --- |",
                  f"| `pc.{'response_logprobs' if shape == 'toy' else 'selective_logprobs'}` (logsumexp in row chunks) | "
                  f"{1000 * sel['seconds']:.1f} | {sel['peak_extra_mib']:.0f} | {sel['seconds'] / full['seconds']:.2f}x | "
                  f"{ratio(sel['peak_extra_mib'], full['peak_extra_mib'])} |",
                  f"| plain full `log_softmax` + gather | {1000 * full['seconds']:.1f} | {full['peak_extra_mib']:.0f} | "
                  "1.00x | 1.00x |", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump({"machine": machine(), "argv": sys.argv[1:], "results": results}, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps per algorithm")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
    parser.add_argument("--repeats", type=int, default=10, help="repeats of each baseline micro-benchmark")
    parser.add_argument("--setting", default="toy", choices=("toy", "tldr"),
                        help="toy: each script's toy defaults; tldr: TL;DR shapes on random-weight stand-ins (rloo dpo kto)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating runs of every step measurement (ours, TRL, ours, ...); the median is reported")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of every measuring process")
    parser.add_argument("--no_trl", action="store_true", help="skip TRL even when it is installed")
    parser.add_argument("--no_baselines", action="store_true", help="skip the generation / log-prob baselines")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "speed.md"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker_out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:  # child process: one measurement, result as JSON
        kind = args.worker.split(":")
        if kind[0] == "ours":
            result = worker_ours(kind[1], args.steps, args.warmup, args.setting)
        elif kind[0] == "trl":
            result = worker_trl(kind[1], args.steps, args.warmup, args.setting)
        elif kind[0] == "generation":
            result = worker_generation(args.repeats)
        elif kind[0] == "sharing":
            result = worker_sharing(kind[1], max(3, args.repeats // 3) if kind[1] == "tldr" else args.repeats)
        elif kind[0] == "logprobs":
            result = worker_logprobs(kind[1], kind[2], args.repeats)
        else:
            raise SystemExit(f"unknown worker {args.worker}")
        with open(args.worker_out, "w") as f:
            json.dump(result, f)
        return

    trl_version = None if args.no_trl else trl_available()
    if not args.no_trl and trl_version is None:
        print("[speed] trl is not installed: TRL comparison skipped (pip install -r benchmark/requirements-bench.txt)",
              flush=True)
    kinds = []
    for algo in args.algos:
        kinds.append(f"ours:{algo}")
        if trl_version and algo in TRL_ALGOS:
            kinds.append(f"trl:{algo}")
    if not args.no_baselines:
        kinds += ["generation", "sharing:toy", "sharing:tldr", "logprobs:selective:toy", "logprobs:full:toy", "logprobs:selective:pythia",
                  "logprobs:full:pythia"]
    results, runs = {}, {}
    step_kinds = [k for k in kinds if k.startswith(("ours:", "trl:"))]
    for _ in range(args.rounds):  # ours and TRL alternate, so slow spells of the machine hit both
        for kind in step_kinds:
            runs.setdefault(kind, []).append(run_worker(kind, args, args.threads))
    for kind in step_kinds:
        results[kind] = median_run(runs[kind])
    for kind in kinds:
        if kind not in step_kinds:
            results[kind] = run_worker(kind, args, args.threads)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_report(results, args, args.out, trl_version)
    print(f"[speed] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
