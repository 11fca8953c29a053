"""The sampler-trainer mismatch at each precision (precision.py): how far the log-probs a sampler reports for the tokens
it sampled are from the trainer's forward on the same tokens, at the same weights. Samplers: a colocated vLLM engine
(the CPU build here, vLLM's own kernels and KV cache) and HF generate (the trainer's model with a KV cache). Settings:
float32; bfloat16 (--bf16); bfloat16 with the output layer in float32 (--cast_lm_head_to_fp32: the trainer's and the
engine's, vLLM's head_dtype), and with the trainer's alone (TRL 1.16's cast_lm_head_to_fp32); float16 (--fp16:
autocast on float32 weights, the engine in float16), with and without the float32 output layer. Shapes: the toy
world (its SFT policy and prompts, 8-token completions, temperature 1) and TL;DR-like (benchmark/speed_settings.py's
random-weight GPT-NeoX stand-in: 8 layers, width 256, 3,072 words, 400-token prompts, 53-token completions at
temperature 0.7, its output layer scaled so that the next-token distribution is as peaked as a trained model's;
float16 is emulated on a CPU without AVX512-FP16, so it is measured at the toy shape only there).

Per setting: mean |log pi_sampler - log pi_trainer| per token, its largest, the KL(sampler || trainer) per token
(k3 estimator), and the share of tokens and of completions that importance weights bounded by TRL 1.16's default
[0, 3] would truncate (token_truncate) or mask (sequence_mask): importance_sampling.py's metrics, as the scripts log
them (vllm/*, hf/*).

    python benchmark/precision_mismatch.py --out benchmark/results/precision_mismatch.md      # ~10 minutes on 2 cores
    python benchmark/precision_mismatch.py --shapes toy --settings bf16 bf16+head --out /tmp/m.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.dirname(HERE), HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

SETTINGS = {  # name -> (dtype, the trainer's output layer in float32, the vLLM engine's)
    "fp32": ("float32", False, False), "bf16": ("bfloat16", False, False),
    "bf16+head": ("bfloat16", True, True),  # --bf16 --cast_lm_head_to_fp32
    "bf16+trainer_head": ("bfloat16", True, False),  # TRL 1.16's cast_lm_head_to_fp32: the trainer's head only
    "fp16": ("float16", False, False), "fp16+head": ("float16", True, True)}
HEAD_SCALE = 12.0  # the TL;DR stand-in's output layer x this: sampled-token entropy ~2-4 nats, as a trained LM's


def shape(name: str) -> dict:
    """The model folder, prompts (token ids), samples per prompt, completion length and temperature of a shape."""
    import torch

    from plumbing import data_utils as du
    from plumbing import models

    if name == "toy":
        path = du.toy_world("toy")["policy"]
        tokenizer = models.load_tokenizer(path)
        data = du.load_prompt_dataset("toy", "test")
        prompts = du.tokenize_prompts(tokenizer, data["prompt"][:32], None)
        return dict(path=path, prompts=prompts, k=4, response_length=8, temperature=1.0)
    import speed_settings as settings

    source = settings.build_tldr_shaped(os.path.join("/tmp", "policy_rlhf_speed_tldr_v2"))
    path = os.path.join("/tmp", "policy_rlhf_precision_mismatch_tldr")
    if not os.path.exists(os.path.join(path, "config.json")):
        tokenizer = models.load_tokenizer(source["policy"])
        model = models.load_causal_lm(source["policy"], tokenizer)
        with torch.no_grad():
            models.output_layer(model).weight.mul_(HEAD_SCALE)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    tokenizer = models.load_tokenizer(path)
    data = du.load_prompt_dataset(source["prompt_dataset"], "train")
    prompts = du.tokenize_prompts(tokenizer, data["prompt"][:8], None)
    return dict(path=path, prompts=prompts, k=4, response_length=settings.TLDR["response_length"],
                temperature=settings.TLDR["temperature"])


def mismatch(trainer, sampler, mask) -> dict:
    """The scripts' metrics of sampler log-probs against the trainer's, plus the largest difference."""
    import policy_common as pc
    from plumbing.importance_sampling import ImportanceSampling, importance_sampling_stats

    token = importance_sampling_stats(trainer, sampler, mask, ImportanceSampling("token_truncate", sampler="m"))
    sequence = importance_sampling_stats(trainer, sampler, mask, ImportanceSampling("sequence_mask", sampler="m"))
    return {"logprob_diff": float(token["m/logprob_diff"]), "max_diff": float((trainer - sampler).abs()[mask].max()),
            "kl": float(token["m/kl"]), "tokens_truncated": float(token["m/is_truncated_frac"]),
            "completions_masked": float(sequence["m/is_masked_frac"]), "tokens": int(mask.sum()),
            "entropy": float(pc.masked_mean(-sampler, mask))}


def measure(shape_name: str, setting: str) -> dict:
    import torch
    from accelerate import Accelerator

    import policy_common as pc
    from plumbing import models
    from plumbing import vllm_generation as vg
    from plumbing.forwards import Forwards
    from plumbing.precision import Precision

    torch.manual_seed(0)
    s = shape(shape_name)
    tokenizer = models.load_tokenizer(s["path"])
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    dtype, trainer_head, engine_head = SETTINGS[setting]
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    policy = models.load_causal_lm(s["path"], tokenizer, Precision(dtype, trainer_head)).eval().to(accelerator.device)
    queries = pc.pad_sequences(s["prompts"], pad, "left").repeat_interleave(s["k"], 0).to(accelerator.device)
    context, config = queries.shape[1], pc.make_generation_config(tokenizer, s["response_length"], s["temperature"])
    forward = Forwards(pad, s["temperature"]).lm(policy)
    row = {"shape": shape_name, "setting": setting, "rows": len(queries)}
    start = time.perf_counter()
    generator = vg.VLLMGenerator(policy, tokenizer, accelerator, max_model_len=context + s["response_length"],
                                 rows_per_call=len(queries), seed=0, precision=Precision(dtype, engine_head))
    query_responses, behaviour = generator.generate(policy, 0, queries, config)
    query_responses, behaviour = query_responses.to(accelerator.device), behaviour.to(accelerator.device)
    generator.close()
    mask = query_responses[:, context:] != pad
    trainer = forward.logprobs_no_grad(policy, query_responses, context, chunk_size=16)
    row["vllm"] = mismatch(trainer, behaviour, mask)
    query_responses, sampled = pc.batch_generation(policy, queries, pad, eos, config, 16, forward=forward)
    mask = query_responses[:, context:] != pad
    trainer = forward.logprobs_no_grad(policy, query_responses, context, chunk_size=16)
    row["hf"] = mismatch(trainer, sampled, mask)
    row["seconds"] = time.perf_counter() - start
    return row


def table(rows: list) -> str:
    lines = ["| shape | setting | sampler | mean \\|diff\\| | max \\|diff\\| | KL per token | tokens truncated | "
             "completions masked | tokens | sampled entropy |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        for sampler in ("vllm", "hf"):
            m = row[sampler]
            lines.append(f"| {row['shape']} | {row['setting']} | {sampler} | {m['logprob_diff']:.2e} | "
                         f"{m['max_diff']:.2e} | {m['kl']:.1e} | {m['tokens_truncated']:.4f} | "
                         f"{m['completions_masked']:.3f} | {m['tokens']} | {m['entropy']:.2f} |")
    return "\n".join(lines)


def header(argv: list) -> str:
    """What made the table: the command, the machine, the library versions."""
    import platform

    import torch
    import vllm

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{platform.processor() or 'CPU'}, " \
        f"{os.cpu_count()} cores, bfloat16 {'native' if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 'emulated'}"
    return (f"# Sampler-trainer mismatch by precision\n\n`python benchmark/precision_mismatch.py {' '.join(argv)}`"
            f" ({device}; torch {torch.__version__}, vLLM {vllm.__version__}). Per token of the sampled completions: "
            "mean and largest |log pi_sampler - log pi_trainer|, KL(sampler || trainer) (k3), the share of tokens "
            "token_truncate at TRL's [0, 3] would truncate and of completions sequence_mask would mask; the sampled "
            "tokens' mean -log-prob (entropy). Settings: benchmark/precision_mismatch.py's docstring; "
            "docs/precision.md reads them.\n\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["toy", "tldr"], choices=["toy", "tldr"])
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", default=None, help="markdown table (and .json beside it); default: print only")
    args = parser.parse_args()
    import torch

    emulated_fp16 = not torch.cuda.is_available() and not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    rows = []
    for shape_name in args.shapes:
        for setting in args.settings:
            if shape_name != "toy" and setting.startswith("fp16") and emulated_fp16:
                continue  # minutes per forward in emulated float16 at this shape
            rows.append(measure(shape_name, setting))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            f.write(header(sys.argv[1:]) + table(rows) + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
