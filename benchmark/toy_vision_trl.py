"""grpo.py against TRL 1.16's GRPOTrainer on the toy vision world (issue 64: "grpo's gain is at least TRL's on the
same world, model, prompts and budget"). Per seed: (a) `python grpo.py --model toy_vision --seed S`, as a user runs it;
(b) TRL's GRPOTrainer on the same SFT policy folder (the tiny LLaVA and its LlavaProcessor as processing_class), the
same training prompts (the prompt dataset's train split: conversational `prompt` with an image part and the `image`
column, as TRL takes them), the same gold reward and grpo.py's toy_vision hyper-parameters mapped to
GRPOConfig (`trl_config`; what cannot be matched is listed in UNMATCHED). Both policies are then scored by one
evaluation, grpo.py's own (plumbing/evaluation.py `evaluate_policy`, run by `evaluate_folder`): greedy completions
of the first num_eval_prompts held-out prompts (prompt dataset, test split) with their images (eval/gold_score) and
with blank grey images of the same size (eval/gold_score_blind, the blind control), scored by toy_vision.gold_score.

TRL stays out of the main environment: a venv that sees the main packages, TRL installed into it without dependencies.

    python -m venv --system-site-packages /work/trlenv
    /work/trlenv/bin/pip install --no-deps -r benchmark/requirements-bench.txt          # trl==1.16.0
    OMP_NUM_THREADS=1 /work/trlenv/bin/python benchmark/toy_vision_trl.py --seeds 1 2 3 --out /tmp/toy_vision_trl

The evaluation path is checked on every seed: grpo.py's evaluation of the SFT folder and of ours' saved final model,
rerun this way, must equal the step-0 and last evaluation grpo.py logged (results.json `same_evaluation`); TRL's prompt
token ids and pixel values must equal grpo.py's (`check_prompt_inputs`, else the benchmark stops). Besides the budget's
end, the gold after --curve_steps steps (ours: a second, identical run of grpo.py with --eval_steps 4, whose end must
equal the first's; TRL: its policy saved after those steps) and each final policy's greedy answers per right answer
(`greedy_answers`: which questions are learned).

Runs one at a time, seeds in turn; ours is a child process, TRL runs in this process. Times: wall s, ours the child's
(start-up, nine held-out evaluations, training, saving), TRL's the trainer's construction, training and saving (no
evaluation: its policy is evaluated afterwards by a grpo.py child, not counted); train s, ours the sum of its steps'
perf/step_seconds (evaluations left out), TRL's train_runtime. Writes OUT/results.json and prints markdown tables;
finished runs under OUT are reused (--force reruns them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # TRL's telemetry at trainer start
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

UNMATCHED = [
    "data order: grpo.py draws its prompts with plumbing.data_utils.data_positions(seed), TRL with its RepeatSampler "
    "(seeded by --seed): the same training split and prompts per step (16), different prompts in each step",
    "sampling randomness: each implementation seeds and draws its own samples (same temperature, top_k 0, top_p 1)",
    "pad token: grpo.py never samples the pad token (suppressed, with the image token) and its log-probs are those of "
    "the distribution sampled (pad and image token masked out of the softmax); TRL suppresses the image token only "
    "(a sampled pad is an ordinary completion token) and takes log-probs over the whole vocabulary",
    "missing-EOS penalty: TRL has no option for it; the TRL reward function subtracts it (gold - 1.0 when the "
    "completion_ids TRL passes hold no EOS), which is what grpo.py's --missing_eos_penalty 1.0 does to the reward",
    "TRL's reward reads the completion decoded to text (special tokens skipped), ours the same text through the "
    "conversational `gold` wrapper: the same string reaches toy_vision.gold_score",
]


def hyper_parameters(seed: int):
    """grpo.py's arguments for `--model toy_vision --seed S` (its Args defaults with the toy_vision alias values), as
    grpo.py parses and validates them."""
    import grpo
    from plumbing import run_utils as ru

    args = ru.parse_args(grpo.Args, grpo.ALIAS_DEFAULTS, argv=["--model", "toy_vision", "--seed", str(seed)])
    grpo.validate(args)
    return args


def read_metrics(folder: str) -> list:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def eval_rows(rows: list) -> dict:
    """{step: (gold, blind)} of a run's evaluations."""
    return {r["step"]: (r["eval/gold_score"], r.get("eval/gold_score_blind")) for r in rows if "eval/gold_score" in r}


def run_grpo(argv: list, folder: str, log: str) -> float:
    """`python grpo.py ARGV --output_dir FOLDER` as a child process, its output into LOG; returns its wall seconds."""
    start = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py"), *argv, "--output_dir", folder],
                              cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"grpo.py {' '.join(argv)} failed ({done.returncode}): see {log}")
    return time.perf_counter() - start


def run_ours(seed: int, out: str, force: bool, extra: tuple = (), name: str = "ours") -> dict:
    """grpo.py at the toy_vision defaults (+ `extra` flags) into OUT/NAME/seedS: step-0 and final held-out gold and
    blind gold from its metrics.jsonl, and the gold at every evaluation."""
    folder = os.path.join(out, name, f"seed{seed}")
    record = os.path.join(folder, "wall.json")
    if force or not os.path.exists(record):
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        wall = run_grpo(["--model", "toy_vision", "--seed", str(seed), *extra], folder, folder + ".log")
        with open(record, "w") as f:
            json.dump({"wall_s": wall}, f)
    rows = read_metrics(folder)
    evals = eval_rows(rows)
    first, last = min(evals), max(evals)
    with open(record) as f:
        wall = json.load(f)["wall_s"]
    return dict(start=evals[first][0], end=evals[last][0], blind=evals[last][1], start_blind=evals[first][1],
                steps=last, wall_s=wall, train_s=sum(r.get("perf/step_seconds", 0.0) for r in rows),
                curve={step: gold for step, (gold, _) in sorted(evals.items())},
                model=os.path.join(folder, "model"))


def evaluate_folder(policy: str, hp, out: str, force: bool) -> dict:
    """grpo.py's held-out evaluation of a saved policy folder (model and processor): `grpo.py --model FOLDER` on the
    toy vision prompt dataset with the toy_vision values that shape the evaluation (num_eval_prompts,
    response_length, chunk rows, reward), for one step; its step-0 row is the evaluation of FOLDER's weights, before any
    update. Returns {gold, blind}."""
    from plumbing import data_utils as du

    folder = os.path.join(out, "eval")
    if force or not os.path.exists(os.path.join(folder, "metrics.jsonl")):
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.makedirs(out, exist_ok=True)
        argv = ["--model", policy, "--dataset", du.toy_vision_world()["prompt_dataset"], "--reward_funcs", "gold",
                "--num_eval_prompts", str(hp.num_eval_prompts), "--response_length", str(hp.response_length),
                "--local_rollout_forward_batch_size", str(hp.local_rollout_forward_batch_size),
                "--per_device_train_batch_size", str(hp.per_device_train_batch_size), "--gradient_accumulation_steps",
                "1", "--num_generations", str(hp.num_generations), "--beta", "0", "--max_steps", "1",
                "--eval_steps", "0", "--seed", str(hp.seed)]
        run_grpo(argv, folder, folder + ".log")
    gold, blind = eval_rows(read_metrics(folder))[0]
    return dict(gold=gold, blind=blind)


def trl_config(hp, output_dir: str, max_steps: int):
    """trl.GRPOConfig with grpo.py's values (`hp`): one generation of per_device_train_batch_size completions
    (num_generations per prompt) and one optimizer step per step, as grpo.py on one process; the optimizer and schedule
    of grpo.py (torch AdamW, eps 1e-5, no weight decay, no warm-up, linear decay to 0 over the run, clipping at
    max_grad_norm); the policy and TRL's reference copy of it loaded in float32, dropout off, as grpo.py's."""
    import trl

    if hp.gradient_accumulation_steps != 1 or hp.num_iterations != 1:
        raise SystemExit("this comparison maps one grpo.py step to one TRL generation + optimizer step")
    config = trl.GRPOConfig(
        output_dir=output_dir, max_steps=max_steps, seed=hp.seed, learning_rate=hp.learning_rate,
        per_device_train_batch_size=hp.per_device_train_batch_size, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=hp.num_generations, max_completion_length=hp.response_length,
        temperature=hp.temperature, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, beta=hp.beta,
        epsilon=hp.epsilon, epsilon_high=hp.epsilon_high, loss_type=hp.loss_type, scale_rewards=hp.scale_rewards,
        importance_sampling_level=hp.importance_sampling_level, num_iterations=hp.num_iterations,
        mask_truncated_completions=hp.mask_truncated_completions, use_bias_correction_kl=hp.use_bias_correction_kl,
        top_entropy_quantile=hp.top_entropy_quantile, off_policy_mask_threshold=hp.off_policy_mask_threshold,
        multi_objective_aggregation=hp.multi_objective_aggregation, max_grad_norm=hp.max_grad_norm,
        optim="adamw_torch", adam_epsilon=1e-5, weight_decay=0.0, lr_scheduler_type="linear", warmup_steps=0,
        disable_dropout=True, model_init_kwargs={"dtype": "float32"}, bf16=False, use_cpu=True,
        gradient_checkpointing=False, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False)
    assert config.generation_batch_size == hp.per_device_train_batch_size, config.generation_batch_size
    return config


def gold_reward_fn(eos_token_id: int, missing_eos_penalty):
    """A TRL reward function: toy_vision.gold_score of each completion's text against its row's `answer` (TRL passes
    the dataset's columns as keyword lists), minus grpo.py's missing-EOS penalty when the completion has no EOS."""
    from toy_worlds import toy_vision

    def gold(prompts, completions, completion_ids, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [toy_vision.gold_score("", text, {"answer": a}) for text, a in zip(texts, answer)]
        if missing_eos_penalty:
            scores = [s - missing_eos_penalty * (eos_token_id not in ids) for s, ids in zip(scores, completion_ids)]
        return scores

    return gold


def check_prompt_inputs(trainer, train, processor, policy_path: str, n: int = 32) -> None:
    """TRL's prompt token ids and pixel values (its `_tokenize_prompts` on the first `n` training rows, their images put
    into the messages as TRL's `_generate_and_score_completions` does) equal grpo.py's (plumbing.vision.Vision.encode);
    stops the benchmark if not."""
    import torch
    from trl.data_utils import prepare_multimodal_messages

    from plumbing.vision import Vision

    rows = [train[i] for i in range(n)]
    prompts = [prepare_multimodal_messages(row["prompt"], images=[row["image"]]) for row in rows]
    prompt_ids, _, fields = trainer._tokenize_prompts(prompts)
    vision = Vision(processor, "image", policy_path)
    ours = [vision.encode(row["prompt"], vision.images_of(row)) for row in rows]
    if [list(ids) for ids in prompt_ids] != [ids for ids, _ in ours]:
        raise SystemExit(f"TRL's prompt ids differ from grpo.py's: {prompt_ids[0]} vs {ours[0][0]}")
    pixels = torch.cat([inputs["pixel_values"] for _, inputs in ours])
    if not torch.equal(torch.stack([torch.as_tensor(p) for p in fields["pixel_values"]]), pixels):
        raise SystemExit("TRL's pixel values differ from grpo.py's")


def run_trl(seed: int, out: str, force: bool, max_steps=None, curve_steps=()) -> dict:
    """TRL's GRPOTrainer on grpo.py's toy_vision setting for `seed`; saves the policy and processor into
    OUT/trl/seedS/model (and OUT/trl/seedS/stepN after each of `curve_steps`), its log history beside them. Returns
    {wall_s, steps, model, curve_models: {step: folder}}."""
    import torch
    import transformers

    folder = os.path.join(out, "trl", f"seed{seed}")
    record = os.path.join(folder, "wall.json")
    if not force and os.path.exists(record):
        with open(record) as f:
            return json.load(f)
    import datasets
    import trl
    from transformers import AutoProcessor

    from plumbing import data_utils as du

    hp = hyper_parameters(seed)
    batch_size = hp.per_device_train_batch_size  # one process
    steps = max_steps or -(-hp.total_episodes // batch_size)
    world = du.toy_vision_world()
    train = datasets.load_from_disk(world["prompt_dataset"])["train"]
    train = train.select_columns(["prompt", "image", "answer"])
    processor = AutoProcessor.from_pretrained(world["policy"])
    config = trl_config(hp, folder, steps)
    print(f"[toy_vision_trl] TRL {trl.__version__} seed {seed}: {steps} steps x {batch_size} completions "
          f"({hp.num_generations} per prompt), lr {hp.learning_rate}, beta {hp.beta}, loss {hp.loss_type}", flush=True)
    curve_models = {step: os.path.join(folder, f"step{step}") for step in curve_steps if step < steps}

    class SaveAt(transformers.TrainerCallback):  # the policy after the curve's steps (~0.05 s each, in the wall time)
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step in curve_models:
                model.save_pretrained(curve_models[state.global_step])
                processor.save_pretrained(curve_models[state.global_step])

    start = time.perf_counter()
    trainer = trl.GRPOTrainer(
        model=world["policy"], args=config,
        reward_funcs=gold_reward_fn(processor.tokenizer.eos_token_id, hp.missing_eos_penalty), train_dataset=train,
        processing_class=processor, callbacks=[SaveAt()])
    check_prompt_inputs(trainer, train, processor, world["policy"])
    trainer.train()
    model_dir = os.path.join(folder, "model")
    trainer.save_model(model_dir)
    processor.save_pretrained(model_dir)
    wall = time.perf_counter() - start
    train_s = next(r["train_runtime"] for r in trainer.state.log_history if "train_runtime" in r)
    result = dict(wall_s=wall, train_s=train_s, steps=trainer.state.global_step, model=model_dir,
                  curve_models=curve_models, torch_threads=torch.get_num_threads())
    with open(os.path.join(folder, "log_history.json"), "w") as f:
        json.dump(trainer.state.log_history, f)
    with open(record, "w") as f:
        json.dump(result, f)
    return result


def greedy_answers(policy: str) -> dict:
    """A diagnosis beside the gold: {right answer: {first word answered: count}} of a policy's greedy answers to the
    held-out pictures (toy_vision.answer, the world's own report helper: all test rows)."""
    import collections

    import datasets
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from plumbing import data_utils as du
    from toy_worlds import toy_vision

    test = datasets.load_from_disk(du.toy_vision_world()["prompt_dataset"])["test"]
    items = [dict(question=r["question"], image=r["image"].convert("RGB"), answer=r["answer"]) for r in test]
    model = LlavaForConditionalGeneration.from_pretrained(policy, dtype="float32").eval()
    said = toy_vision.answer(model, AutoProcessor.from_pretrained(policy), items, greedy=True)
    counts = collections.defaultdict(collections.Counter)
    for item, text in zip(items, said):
        counts[item["answer"]][(text.split() or [""])[0]] += 1
    return {answer: dict(c) for answer, c in sorted(counts.items())}


def mean_spread(values: list) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}"


def table(results: dict) -> str:
    """The markdown tables: per seed and mean ± population std, then the gold at the curve's steps."""
    lines = ["| seed | implementation | start gold | end gold | gain | end blind | wall s | train s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    seeds = results["seeds"]
    for seed, r in seeds.items():
        for name in ("grpo.py", "TRL"):
            x = r[name]
            lines.append(f"| {seed} | {name} | {x['start']:.3f} | {x['end']:.3f} | {x['end'] - x['start']:+.3f} | "
                         f"{x['blind']:.3f} | {x['wall_s']:.0f} | {x['train_s']:.1f} |")
    for name in ("grpo.py", "TRL"):
        xs = [r[name] for r in seeds.values()]
        lines.append(f"| mean ± std | {name} | {mean_spread([x['start'] for x in xs])} | "
                     f"{mean_spread([x['end'] for x in xs])} | {mean_spread([x['end'] - x['start'] for x in xs])} | "
                     f"{mean_spread([x['blind'] for x in xs])} | {mean_spread([x['wall_s'] for x in xs])} | "
                     f"{mean_spread([x['train_s'] for x in xs])} |")
    steps = sorted({int(k) for r in seeds.values() for k in r["TRL"]["curve"]})
    if steps:
        lines += ["", "| seed | implementation | " + " | ".join(f"step {k}" for k in steps) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in steps) + " |"]
        for seed, r in seeds.items():
            ours = r["grpo.py"].get("curve_every", r["grpo.py"]["curve"])
            for name, curve in (("grpo.py", ours), ("TRL", r["TRL"]["curve"])):
                curve = {int(k): v for k, v in curve.items()}
                lines.append(f"| {seed} | {name} | " + " | ".join(
                    f"{curve[k]:.3f}" if k in curve else "" for k in steps) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", default="/tmp/toy_vision_trl", help="output folder (runs, results.json)")
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    parser.add_argument("--curve_steps", type=int, nargs="*", default=[4, 8, 12, 16],
                        help="also the held-out gold after these steps: ours from a second run with --eval_steps "
                             "(their gcd), TRL's from its policy saved then (none: skip)")
    parser.add_argument("--trl_max_steps", type=int, default=None, help="cap TRL's steps (a smoke test)")
    args = parser.parse_args()
    import math

    import torch
    import transformers
    import trl

    from plumbing import data_utils as du

    results = dict(command=" ".join([sys.executable, *sys.argv]), versions=dict(
        torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__), unmatched=UNMATCHED,
        seeds={})
    for seed in args.seeds:
        hp = hyper_parameters(seed)
        ours = run_ours(seed, args.out, args.force)
        theirs = run_trl(seed, args.out, args.force, args.trl_max_steps, args.curve_steps)
        seed_dir = os.path.join(args.out, "trl", f"seed{seed}")
        sft = evaluate_folder(du.toy_vision_world()["policy"], hp, os.path.join(args.out, "sft"), args.force)
        trl_end = evaluate_folder(theirs["model"], hp, seed_dir, args.force)
        trl_curve = {int(step): evaluate_folder(folder, hp, folder, args.force)["gold"]
                     for step, folder in theirs["curve_models"].items()}
        # the one evaluation path: grpo.py's own numbers for the SFT policy and its final model, re-read
        ours_end = evaluate_folder(ours["model"], hp, os.path.join(args.out, "ours", f"seed{seed}_reeval"), args.force)
        check = dict(sft=(sft["gold"], sft["blind"]) == (ours["start"], ours["start_blind"]),
                     ours_final=(ours_end["gold"], ours_end["blind"]) == (ours["end"], ours["blind"]))
        if args.curve_steps:  # the same training, evaluated more often (greedy evaluation draws no random numbers)
            ours_every = run_ours(seed, args.out, args.force, ("--eval_steps", str(math.gcd(
                *args.curve_steps))), name="ours_curve")
            ours["curve_every"] = ours_every["curve"]
            check["ours_curve_run_same_end"] = (ours_every["end"], ours_every["blind"]) == (ours["end"], ours["blind"])
        results["seeds"][str(seed)] = {
            "grpo.py": ours, "TRL": dict(start=sft["gold"], end=trl_end["gold"], blind=trl_end["blind"],
                                         start_blind=sft["blind"], steps=theirs["steps"], wall_s=theirs["wall_s"],
                                         train_s=theirs["train_s"],
                                         model=theirs["model"], curve={0: sft["gold"], **trl_curve,
                                                                       theirs["steps"]: trl_end["gold"]}),
            "same_evaluation": check,
            "greedy_answers": {"grpo.py": greedy_answers(ours["model"]), "TRL": greedy_answers(theirs["model"])}}
        print(f"[toy_vision_trl] seed {seed}: ours {ours['start']:.3f} -> {ours['end']:.3f} (blind {ours['blind']:.3f},"
              f" {ours['wall_s']:.0f}s); TRL {sft['gold']:.3f} -> {trl_end['gold']:.3f} (blind {trl_end['blind']:.3f}"
              f", {theirs['wall_s']:.0f}s); evaluation cross-check {check}", flush=True)
    results["sft_greedy_answers"] = greedy_answers(du.toy_vision_world()["policy"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(table(results))


if __name__ == "__main__":
    main()
