"""What benchmark/speed.py's runners (speed.py for ours, speed_trl.py, speed_baselines.py) share: the two settings
(the toy task with each script's toy defaults, or TL;DR shapes on CPU-sized random-weight stand-ins), the
hyper-parameters both implementations get in each, and how a step time is read from the times steps end."""

from __future__ import annotations

import functools
import importlib
import os
import tempfile

TRL_ALGOS = ("rloo", "dpo", "kto", "grpo", "distill")  # TRL 1.16 has no PPOTrainer; distill: DistillationTrainer
BASELINES = ("generation", "sharing:toy", "sharing:tldr", "logprobs:selective:toy", "logprobs:full:toy",
             "logprobs:selective:pythia", "logprobs:full:pythia")  # the measurements of speed_baselines.py

# TL;DR shapes (Huang et al. 2024; TRL's TL;DR runs): ~400-token prompts, 53-token responses, RLOO k=4, DPO pairs;
# GRPO with RLOO's shapes (16 completions per step, 4 per prompt), TRL's and grpo.py's default beta 0 (no reference).
TLDR = dict(prompt_tokens=400, response_length=53, vocab=3072, layers=8, width=256, rloo_k=4, rloo_batch=16,
            dpo_batch=4, kto_batch=8, temperature=0.7, grpo_generations=4, grpo_batch=16, grpo_beta=0.0,
            distill_batch=16, teacher_layers=8, teacher_width=512)


# Long completions (benchmark/memory.py, issue 33): a small GPT-NeoX with Pythia's 50,304-word vocabulary, so the
# output layer and everything computed from its logits dominate memory; settings long512, long1024, long2048.
LONG = dict(prompt_tokens=32, lengths=(512, 1024, 2048), vocab=50304, layers=2, width=64, teacher_layers=2,
            teacher_width=128, rloo_k=4, rloo_batch=8, grpo_generations=4, grpo_batch=8, dpo_batch=2, sft_batch=8,
            distill_batch=8)


def long_length(setting: str):
    """The completion length of a long setting ('long1024' -> 1024), None for any other setting."""
    return int(setting[4:]) if setting.startswith("long") else None


def tldr_model_config(layers: int = TLDR["layers"], width: int = TLDR["width"], vocab: int = TLDR["vocab"],
                      positions: int = 512):
    """The GPT-NeoX shape of the TL;DR stand-ins (pad 0, EOS 1); the teacher's is wider, LONG's have more positions."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers,
                         num_attention_heads=4, intermediate_size=4 * width, max_position_embeddings=positions,
                         hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=1, pad_token_id=0)


def word_tokenizer(vocab: int):
    """The stand-ins' word-level tokenizer: [PAD] 0, [EOS] 1, [UNK] 2, then the words w0 w1 ... up to `vocab` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(["[PAD]", "[EOS]", "[UNK]", *words])},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def save_policy_and_reward(out: dict, tokenizer, config) -> None:
    """A random-weight GPT-NeoX policy and reward model of `config` (seed the caller's), each with `tokenizer`, into
    out['policy'] and out['reward']."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    for model, name in ((GPTNeoXForCausalLM(config), "policy"),
                        (GPTNeoXForSequenceClassification(GPTNeoXConfig(**config.to_dict(), num_labels=1)), "reward")):
        model.save_pretrained(out[name])
        tokenizer.save_pretrained(out[name])


def build_tldr_shaped(root: str) -> dict:
    """Random-weight GPT-NeoX policy and reward model (8 layers, width 256, vocabulary 3072: transformer layers do
    about 8x the work of the output layer, as in Pythia-1B), a word-level tokenizer, prompts of TLDR['prompt_tokens']
    words and preference pairs with TLDR['response_length']-token completions. Timing only: nothing here learns.
    Built once into `root` (seeded, so identical for ours and TRL)."""
    import random

    import torch

    from toy_worlds.toy_task import save_dataset

    out = {k: os.path.join(root, k) for k in ("policy", "reward", "prompt_dataset", "preference_dataset",
                                              "unpaired_dataset", "teacher")}
    if os.path.exists(os.path.join(root, "done")):
        if not os.path.exists(os.path.join(out["teacher"], "config.json")):  # a build from before the teacher
            build_tldr_teacher(out["policy"], out["teacher"])
        return out
    rng = random.Random(0)
    torch.manual_seed(0)
    words = [f"w{i}" for i in range(TLDR["vocab"] - 3)]
    tokenizer = word_tokenizer(TLDR["vocab"])
    save_policy_and_reward(out, tokenizer, tldr_model_config())
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    R = TLDR["response_length"] - 1  # + EOS
    prompts = {split: [text(TLDR["prompt_tokens"]) for _ in range(n)] for split, n in (("train", 256), ("test", 8))}
    save_dataset({s: [{"prompt": p} for p in ps] for s, ps in prompts.items()}, out["prompt_dataset"])
    save_dataset({s: [{"prompt": p, "chosen": " " + text(R), "rejected": " " + text(R)} for p in ps]
                  for s, ps in prompts.items()}, out["preference_dataset"])
    save_dataset({s: [{"prompt": p, "completion": " " + text(R), "label": i % 2 == 0} for i, p in enumerate(ps)]
                  for s, ps in prompts.items()}, out["unpaired_dataset"])
    build_tldr_teacher(out["policy"], out["teacher"])
    open(os.path.join(root, "done"), "w").close()
    return out


def build_tldr_teacher(policy_dir: str, out: str) -> None:
    """The distillation teacher stand-in: a random-weight GPT-NeoX of TLDR['teacher_layers'] layers and width
    TLDR['teacher_width'] (~3.5x the student's parameters, as Pythia-2.8B to 1B), the student's tokenizer; seeded."""
    import torch
    from transformers import AutoTokenizer, GPTNeoXForCausalLM

    torch.manual_seed(1)
    GPTNeoXForCausalLM(tldr_model_config(TLDR["teacher_layers"], TLDR["teacher_width"])).save_pretrained(out)
    AutoTokenizer.from_pretrained(policy_dir).save_pretrained(out)


def build_long_shaped(root: str, length: int) -> dict:
    """Random-weight GPT-NeoX policy, reward model and teacher of LONG's shapes (vocabulary 50,304), a word-level
    tokenizer, LONG['prompt_tokens']-word prompts and, for `length`, preference pairs and SFT examples whose
    completions are `length` tokens (EOS included). Timing and memory only: nothing learns. Seeded; built once."""
    import random

    import torch
    from transformers import GPTNeoXForCausalLM

    from toy_worlds.toy_task import save_dataset

    names = ("policy", "reward", "teacher", "prompt_dataset", f"preference_dataset_{length}", f"sft_dataset_{length}")
    out = {k: os.path.join(root, k) for k in names}
    out["preference_dataset"], out["sft_dataset"] = out[f"preference_dataset_{length}"], out[f"sft_dataset_{length}"]
    if os.path.exists(os.path.join(root, f"done_{length}")):
        return out
    words = [f"w{i}" for i in range(LONG["vocab"] - 3)]
    if not os.path.exists(os.path.join(root, "done")):
        torch.manual_seed(0)
        tokenizer = word_tokenizer(LONG["vocab"])
        config = functools.partial(tldr_model_config, vocab=LONG["vocab"],
                                   positions=max(LONG["lengths"]) + 2 * LONG["prompt_tokens"])
        save_policy_and_reward(out, tokenizer, config(LONG["layers"], LONG["width"]))
        GPTNeoXForCausalLM(config(LONG["teacher_layers"], LONG["teacher_width"])).save_pretrained(out["teacher"])
        tokenizer.save_pretrained(out["teacher"])
        rng = random.Random(0)
        prompts = {split: [" ".join(rng.choice(words) for _ in range(LONG["prompt_tokens"])) for _ in range(n)]
                   for split, n in (("train", 64), ("test", 2))}
        save_dataset({s: [{"prompt": p} for p in ps] for s, ps in prompts.items()}, out["prompt_dataset"])
        open(os.path.join(root, "done"), "w").close()
    rng = random.Random(length)
    text = lambda: " " + " ".join(rng.choice(words) for _ in range(length - 1))  # noqa: E731  (+ EOS)
    prompts = {split: [" ".join(rng.choice(words) for _ in range(LONG["prompt_tokens"])) for _ in range(n)]
               for split, n in (("train", 16), ("test", 2))}
    save_dataset({s: [{"prompt": p, "chosen": text(), "rejected": text()} for p in ps] for s, ps in prompts.items()},
                 out["preference_dataset"])
    save_dataset({s: [{"prompt": p, "completion": text()} for p in ps] for s, ps in prompts.items()},
                 out["sft_dataset"])
    open(os.path.join(root, f"done_{length}"), "w").close()
    return out


def setting_paths(setting: str) -> dict:
    if long_length(setting):
        return build_long_shaped(os.path.join(tempfile.gettempdir(), "policy_rlhf_memory_long_v1"),
                                 long_length(setting))
    if setting == "toy":
        from toy_worlds import toy_task

        return dict(toy_task.build(verbose=False), teacher=toy_task.build_teacher(verbose=False)["teacher"])
    return build_tldr_shaped(os.path.join(tempfile.gettempdir(), "policy_rlhf_speed_tldr_v2"))


def hyper(setting: str, algo: str) -> dict:
    """The hyper-parameters both implementations get (ours as flags, TRL as config fields)."""
    if setting == "toy":
        return dict(importlib.import_module(algo).ALIAS_DEFAULTS["toy"])
    if long_length(setting):
        return long_hyper(long_length(setting), algo)
    common = dict(gradient_accumulation_steps=1, response_length=TLDR["response_length"], max_prompt_length=448)
    if algo == "rloo":
        return dict(common, per_device_train_batch_size=TLDR["rloo_batch"], rloo_k=TLDR["rloo_k"], learning_rate=3e-6,
                    kl_coef=0.05, temperature=TLDR["temperature"], local_rollout_forward_batch_size=TLDR["rloo_batch"])
    if algo == "dpo":
        return dict(common, per_device_train_batch_size=TLDR["dpo_batch"], learning_rate=5e-7, beta=0.1,
                    max_length=512, warmup_ratio=0.1)
    if algo == "kto":
        return dict(common, per_device_train_batch_size=TLDR["kto_batch"], learning_rate=5e-7, beta=0.1,
                    desirable_weight=1.0, undesirable_weight=1.0, max_length=512)
    if algo == "grpo":  # the algorithm's flags spelled out (grpo.py's defaults = TRL 1.16's GRPOConfig defaults)
        return dict(common, per_device_train_batch_size=TLDR["grpo_batch"], num_generations=TLDR["grpo_generations"],
                    learning_rate=3e-6, temperature=TLDR["temperature"], beta=TLDR["grpo_beta"], epsilon=0.2,
                    loss_type="dapo", scale_rewards="group", importance_sampling_level="token", num_iterations=1,
                    local_rollout_forward_batch_size=TLDR["grpo_batch"])
    if algo == "distill":  # TRL's DistillationConfig defaults: on-policy, reverse KL (beta 1), temperature 1
        return dict(common, per_device_train_batch_size=TLDR["distill_batch"], learning_rate=3e-6, beta=1.0,
                    temperature=1.0, local_rollout_forward_batch_size=TLDR["distill_batch"])
    raise ValueError(f"--setting tldr measures {', '.join(TRL_ALGOS)}, not {algo}")


def long_hyper(length: int, algo: str) -> dict:
    """The long settings' hyper-parameters (the issue's GRPO setting: 4 generations x 2 prompts, beta 0; the others
    the same 8 rows a step, DPO 2 pairs; fp32, one optimizer step per step)."""
    L, P = length, LONG["prompt_tokens"]
    common = dict(gradient_accumulation_steps=1, response_length=L, max_prompt_length=P)
    if algo == "rloo":
        return dict(common, per_device_train_batch_size=LONG["rloo_batch"], rloo_k=LONG["rloo_k"], learning_rate=3e-6,
                    kl_coef=0.05, temperature=1.0, local_rollout_forward_batch_size=LONG["rloo_batch"])
    if algo == "grpo":
        return dict(common, per_device_train_batch_size=LONG["grpo_batch"], num_generations=LONG["grpo_generations"],
                    learning_rate=3e-6, temperature=1.0, beta=0.0, epsilon=0.2, loss_type="dapo",
                    scale_rewards="group", importance_sampling_level="token", num_iterations=1,
                    local_rollout_forward_batch_size=LONG["grpo_batch"])
    if algo == "dpo":
        return dict(common, per_device_train_batch_size=LONG["dpo_batch"], learning_rate=5e-7, beta=0.1,
                    max_length=P + L, warmup_ratio=0.1)
    if algo == "sft":
        return dict(common, per_device_train_batch_size=LONG["sft_batch"], learning_rate=3e-6, max_length=P + L,
                    weight_decay=0.0)
    if algo == "distill":
        return dict(common, per_device_train_batch_size=LONG["distill_batch"], learning_rate=3e-6, beta=1.0,
                    temperature=1.0, local_rollout_forward_batch_size=LONG["distill_batch"])
    raise ValueError(f"the long settings measure rloo grpo dpo sft distill, not {algo}")


def grpo_value(setting: str, key: str):
    """A GRPO hyper-parameter as grpo.py runs it in `setting`: the setting's value, else grpo.py's default (the toy
    alias leaves most of the algorithm's flags at their defaults)."""
    import grpo

    return hyper(setting, "grpo").get(key, getattr(grpo.Args, key))


def optimizer_steps_per_step(setting: str, algo: str) -> int:
    """TRL optimizer steps in one of our steps: grpo.py's step (a metrics row) is one generated batch and its
    num_iterations optimizer steps; every other script's step is one optimizer step, as TRL's."""
    return grpo_value(setting, "num_iterations") if algo == "grpo" else 1


def ours_flags(setting: str, algo: str, paths: dict) -> list:
    """The setting's flags for `<algo>.py`: for the toy task its toy defaults with a small evaluation (outside
    the timed steps either way)."""
    if setting == "toy":
        return ["--num_eval_prompts", "16"]
    data = paths[{"rloo": "prompt_dataset", "grpo": "prompt_dataset", "dpo": "preference_dataset",
                  "kto": "unpaired_dataset", "distill": "prompt_dataset", "sft": "sft_dataset"}[algo]]
    flags = ["--model", paths["policy"], "--dataset", data, "--num_eval_prompts", "0" if algo == "sft" else "2"]
    if algo == "distill":
        flags += ["--teacher_model", paths["teacher"]]
    if algo in ("rloo", "grpo"):
        flags += ["--reward_model", paths["reward"]]
    if algo == "dpo":
        flags += ["--max_eval_pairs", "2" if long_length(setting) else "4"]
    if algo == "sft":
        flags += ["--max_eval_examples", "2"]
    if algo == "kto":
        flags += ["--num_eval_examples", "8", "--per_device_eval_batch_size", str(TLDR["kto_batch"])]
    for k, v in hyper(setting, algo).items():
        flags += [f"--{k}", str(v)]
    return flags


SETTING_TEXT = {
    "toy": "Setting: the toy task with each script's toy defaults (the same model and batch for every row of an "
           "algorithm; GRPO: 64 completions per step, 4 per prompt, beta 0.2, so a reference model in both, loss "
           "dapo, one optimizer step per generated batch; distillation: the toy teacher (2.4M parameters) into the toy "
           "SFT policy (0.4M), on-policy, reverse KL, 64 completions of 8 tokens per step).",
    "tldr": f"Setting: TL;DR shapes on CPU-sized random-weight stand-ins (`--setting tldr`): prompts of "
            f"{TLDR['prompt_tokens']} tokens, responses of {TLDR['response_length']}; RLOO k={TLDR['rloo_k']} with "
            f"{TLDR['rloo_batch']} completions per step; GRPO {TLDR['grpo_generations']} completions per prompt, "
            f"{TLDR['grpo_batch']} per step, beta {TLDR['grpo_beta']} (TRL's and grpo.py's default: "
            f"{'no reference model' if TLDR['grpo_beta'] == 0 else 'a reference model'} in either), loss dapo, one "
            f"optimizer step per generated batch; DPO {TLDR['dpo_batch']} pairs and KTO {TLDR['kto_batch']} examples "
            f"per step; distillation {TLDR['distill_batch']} on-policy completions per step, reverse KL, from a "
            f"teacher of {TLDR['teacher_layers']} layers, width {TLDR['teacher_width']}; a GPT-NeoX policy and reward "
            f"model of {TLDR['layers']} layers, width {TLDR['width']}, "
            f"vocabulary {TLDR['vocab']} (transformer layers ~8x the output layer's work, as in Pythia-1B). Timing "
            "only: nothing learns.",
}


def seconds_per_step(step_ends: dict, warmup: int, steps: int) -> float:
    """{step: time the step ended} -> mean seconds per step over steps warmup+1 .. warmup+steps."""
    missing = [s for s in (warmup, warmup + steps) if s not in step_ends]
    if missing:
        raise RuntimeError(f"no end time for step(s) {missing} (steps seen: {sorted(step_ends)})")
    return (step_ends[warmup + steps] - step_ends[warmup]) / steps
