"""Supervised fine-tuning (SFT): maximum likelihood of demonstrations, the first stage of RLHF (Stiennon et al. 2020,
https://arxiv.org/abs/2009.01325; Ouyang et al. 2022, https://arxiv.org/abs/2203.02155). Trains a policy on (prompt,
completion) demonstrations, or whole tool-calling conversations, with no reference, no reward and no sampling:
    loss = - sum of log pi(y_t | x, y_<t) over the step's completion tokens y_t / the number of those tokens
Real-scale defaults: the TL;DR SFT of Huang et al. 2024 (https://arxiv.org/abs/2403.17031). Data formats and
implementation choices: docs/offline.md; metrics: docs/metrics.md.

    python sft.py                     # toy task, on a CPU: the toy SFT policy learns to sort
    python sft.py --model toy_tools   # the toy tool world's conversations, the loss on the assistant turns
    accelerate launch sft.py --model EleutherAI/pythia-1b-deduped --dataset tldr    # benchmark/tldr/sft.sh
"""

import json
import os
import random
from dataclasses import dataclass
from typing import Literal

import torch

import policy_common as pc
from plumbing import accumulation as acc
from plumbing import data_utils as du
from plumbing import forwards as fw
from plumbing import greedy_eval as ge
from plumbing import models, vision
from plumbing import run_utils as ru
from plumbing import throughput as tp
from plumbing import train_loop as tl
from plumbing.errors import UserError

# Toy-task values (applied only to flags not given on the command line); the dataclass holds the TL;DR defaults.
ALIAS_DEFAULTS = {
    "toy": dict(learning_rate=3e-4, per_device_train_batch_size=64, gradient_accumulation_steps=1,
                per_device_eval_batch_size=256, num_train_epochs=1.0, warmup_ratio=0.1, weight_decay=0.0,
                eval_steps=16, max_prompt_length=8, max_length=16, response_length=8, num_eval_prompts=256,
                max_eval_examples=0),
    # the toy tool world (toy_tools.py): its demonstration conversations, the loss on the assistant turns only
    "toy_tools": dict(learning_rate=1e-4, per_device_train_batch_size=64, gradient_accumulation_steps=1,
                      per_device_eval_batch_size=256, num_train_epochs=1.0, warmup_ratio=0.1, weight_decay=0.0,
                      eval_steps=16, max_prompt_length=16, max_length=64, response_length=24, num_eval_prompts=0,
                      max_eval_examples=0),
}
# toy_hard (toy_task.SETTINGS): the toy defaults and budget, with room for its longer prompts and answers
ALIAS_DEFAULTS["toy_hard"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=10, max_length=22, response_length=10)
# toy_vision (toy_vision.py): the right answers about its pictures, room for a prompt's image tokens
ALIAS_DEFAULTS["toy_vision"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=None, max_length=16, response_length=3)


@dataclass
class Args(tl.TrainFlags, tl.EpochFlags, models.PolicyFlags, du.DataFlags, ge.GenerationFlags):
    # shared flags whose default differs here (Huang et al. 2024's TL;DR SFT)
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 4
    eval_steps: int = 200
    num_eval_prompts: int = 256

    # SFT
    max_eval_examples: int = 2000
    """held-out examples scored for eval/loss and eval/token_accuracy: the first this many (0 = all)"""
    toy_demonstrations: Literal["sorted", "imperfect"] = "sorted"
    """--dataset toy only: completions are the sorted answer, or the toy world's own noisy demonstrations (seeded)"""


# ALGO LOGIC: the loss, its normalisation over the optimizer step, and the per-token statistics it reads
def sft_loss(token_nll, mask, tokens_per_micro_batch: float):
    """(b, R) completion-token NLLs and mask -> this micro-batch's loss: its token sum / `tokens_per_micro_batch`
    (= the step's completion tokens / (processes x micro-batches)). accelerate divides each micro-batch's loss by
    the accumulation steps and DDP averages processes, so the step's gradient is that of (the sum of every completion
    token's NLL in the step) / (their number): a token mean over the global batch, not a mean of micro-batch means.
    Each completion token weighs the same whichever micro-batch it falls in, so --gradient_accumulation_steps and the
    number of processes leave the gradient unchanged (as TRL's num_items_in_batch, and grpo.py's dapo loss)."""
    return token_nll.masked_fill(~mask, 0.0).sum() / tokens_per_micro_batch


def completion_token_stats(model, forward: pc.Forward, rows, pad_token_id: int, device):
    """rows -> per completion token (b, R): negative log-likelihood under `model` (run by its `forward`), whether the
    most likely token is the demonstrated one, and the mask of the tokens trained on (False on padding and, in tool
    conversations, on tool results). Only the positions that predict completion tokens are computed: no prompt token
    is a target (the prompt is context only, TRL's SFTTrainer default `completion_only_loss`; Huang et al.'s sft.py
    trained on the query tokens as well)."""
    query_responses, context_length = du.concatenated_inputs(rows, pad_token_id, completions=("completion",))
    completion_mask = pc.pad_sequences([[int(m) for m in r["completion_mask"]] for r in rows], 0, "right").bool()
    query_responses = query_responses.to(device)  # (b, Lq + R): prompts left-padded, completions right-padded
    completions = query_responses[:, context_length:]  # (b, R)
    # the full softmax, as TRL's SFTTrainer: pad is never a target, so maximum likelihood pushes its probability
    # down and the checkpoint does not emit it under samplers that do not suppress it (the RL scripts mask it)
    token_logprobs, top1 = forward.map_logits(model, query_responses, context_length, token_logprob_and_top1,
                                              completions, mask_pad=False, images=vision.batch_inputs(rows))  # (b, R)
    mask = (completions != pad_token_id) & completion_mask.to(completions.device)
    return -token_logprobs, top1 & mask, mask


def token_logprob_and_top1(logits: torch.Tensor, tokens: torch.Tensor):
    """(n, V) logits, (n,) tokens -> ((n,) log softmax(logits)[token], (n,) whether the token is the most likely)."""
    return pc.selective_logprobs(logits, tokens), logits.detach().argmax(-1) == tokens


def accumulate_gradients(policy, forward, accelerator, micro_batches, rows, batch_index, pad_token_id: int,
                         token_counts=None):
    """Accumulate one optimizer step's gradients over the examples rows[batch_index] (every process's, in order; this
    process's micro-batches: `micro_batches`, acc.MicroBatches, or sized by --token_budget: `token_counts[i]` real
    tokens each). Returns the step's loss and token_accuracy (after ru.reduce_metrics: token means over the whole
    batch) and num_tokens. The token count comes from `rows`, which every process holds: no collective."""
    world, steps = accelerator.num_processes, accelerator.gradient_accumulation_steps
    num_tokens = sum(sum(rows[i]["completion_mask"]) for i in batch_index)  # loss tokens of the step, all processes
    tokens_per_micro_batch = num_tokens / (world * steps)
    sums = {"loss": 0.0, "token_accuracy": 0.0}
    for index in micro_batches.split(tl.process_items(batch_index, accelerator), token_counts, mean_over=None):
        with micro_batches.accumulate():
            token_nll, correct, mask = completion_token_stats(policy, forward, [rows[i] for i in index], pad_token_id,
                                                              accelerator.device)
            loss = sft_loss(token_nll, mask, tokens_per_micro_batch)
            micro_batches.backward(loss)  # normalised by the step's tokens: the micro-batches' losses add up
        # this process's part of the step's means; ru.reduce_metrics averages processes: token means over the batch
        sums["loss"] += loss.item() / steps
        sums["token_accuracy"] += correct.sum().item() / (tokens_per_micro_batch * steps)
    return sums, num_tokens


# Data: demonstrations -> (prompt, completion) -> token ids
def toy_demonstrations(split: str, kind: str, seed: int, world: str = "toy"):
    """A toy world's SFT data (`world`: toy, toy_hard), built in memory: the prompts of its prompt dataset's `split`,
    each with the sorted answer (`kind` "sorted", toy_task.target_completion) or one of that world's noisy
    demonstrations ("imperfect", toy_task.imperfect_demonstration: a fixed draw per seed and split). Returns a
    datasets.Dataset with columns prompt, completion."""
    import datasets

    from toy_worlds import toy_task

    prompts = du.load_prompt_dataset(world, split)["prompt"]
    if kind == "sorted":
        completions = [toy_task.target_completion(p) for p in prompts]
    else:
        rng = random.Random(f"toy-demonstrations:{split}:{seed}")
        completions = [toy_task.imperfect_demonstration(p, rng, toy_task.SETTINGS[world]) for p in prompts]
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions})


def load_demonstrations(args: Args, split: str):
    """`split` of the SFT data: the toy demonstrations for `toy`, the tool world's conversations for `toy_tools`, the
    right answers for `toy_vision`, else the dataset (alias `tldr` = trl-lib/tldr, whose columns are prompt and
    completion; a hub id, folder or files) with its columns checked."""
    if args.dataset in du.TOY_WORLDS:
        return toy_demonstrations(split, args.toy_demonstrations, args.seed, args.dataset)
    if args.dataset == du.TOY_VISION_ALIAS:  # its pictures' right answers, as the assistant's message
        data = du.load_prompt_dataset(args.dataset, split)
        return data.add_column("completion", [[{"role": "assistant", "content": a}] for a in data["answer"]])
    name = du.toy_tools_world()["sft_dataset"] if args.dataset == du.TOY_TOOLS_ALIAS else args.dataset
    data = du.load_prompt_dataset(name, split)
    if "messages" not in data.column_names:
        du.require_columns(data, ["prompt", "completion"], args.dataset)
    return data


def is_tool_conversation(messages: list, tools) -> bool:
    """A `messages` row trained as a whole conversation (du.tokenize_conversation): it has tools, tool calls, tool
    messages or several assistant turns. Other rows are (prompt, last assistant message) pairs."""
    assistants = [m for m in messages if m.get("role") == "assistant"]
    return bool(tools) or len(assistants) > 1 or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def prompt_completion_pairs(data, name: str) -> list:
    """Rows (du.with_images) -> [(prompt, completion, tools, images)], prompt and completion text or lists of messages.
    A `messages` row is cut before its last message, which must be the assistant's; a tool conversation
    (is_tool_conversation) before its first assistant message, `tools` then its `tools` column (JSON schemas, or a JSON
    string of them) or []; else tools is None. `images`: the prompt's (vision.ImageSource), None for text. Anything
    else is a UserError naming the row."""
    pairs = []
    for i, example in enumerate(data):
        tools = None
        if "prompt" in example and "completion" in example:
            prompt, completion = example["prompt"], example["completion"]
        else:
            messages = example["messages"]
            if not (du.is_conversational(messages) and len(messages) >= 2 and messages[-1].get("role") == "assistant"):
                raise UserError(f"dataset {name!r} row {i} column 'messages': expected a list of two or more "
                                "{role, content} messages ending with the assistant's")
            tools = example.get("tools")
            tools = json.loads(tools) if isinstance(tools, str) else tools
            if is_tool_conversation(messages, tools):
                first = next(j for j, m in enumerate(messages) if m.get("role") == "assistant")
                if first == 0:
                    raise UserError(f"dataset {name!r} row {i} column 'messages': the conversation starts with an "
                                    "assistant message (no prompt)")
                prompt, completion, tools = messages[:first], messages[first:], list(tools or [])
            else:
                prompt, completion, tools = messages[:-1], messages[-1:], None
        du.require_text_or_messages({"prompt": prompt, "completion": completion}, name, i)
        images = example.get("images")
        if images is not None and tools is not None:
            raise UserError(f"dataset {name!r} row {i}: a tool conversation with images is not supported; give "
                            "single-turn demonstrations with images, or tool conversations without")
        pairs.append((prompt, completion, tools, images and images.with_prompt(prompt)))
    return pairs


def tokenize_demonstrations(tokenizer, pairs, max_prompt_length: int, max_length: int, name: str):
    """[(prompt, completion, tools, images)] -> (rows, dropped): rows of token-id lists `prompt`, `completion`, the bool
    list `completion_mask` (True on the tokens trained on) and the prompt's `images` where it has them. A pair: the
    completion ending with EOS (du.tokenize_completion), cut by du.tokenize_prompt_completion's rule, every completion
    token trained. A tool conversation (tools not None): du.tokenize_conversation's tokens and mask (each assistant
    turn through its EOS, not the tool results), cut by the same rule. An example with an empty prompt or no trained
    token left is dropped and counted. No example left is a UserError."""
    rows, dropped = [], 0
    for prompt, completion, tools, images in pairs:
        if tools is None:
            prompt_ids, completion_ids = du.tokenize_prompt_completion(tokenizer, prompt, completion,
                                                                       max_prompt_length, max_length, images=images)
            completion_mask = [True] * len(completion_ids)
        else:
            prompt_ids, completion_ids, completion_mask = du.tokenize_conversation(tokenizer, prompt + completion,
                                                                                   tools)
            prompt_ids = prompt_ids[-max_prompt_length:]
            keep = max(0, max_length - len(prompt_ids))
            completion_ids, completion_mask = completion_ids[:keep], completion_mask[:keep]
        if not prompt_ids or not any(completion_mask):
            dropped += 1
            continue
        rows.append({"prompt": prompt_ids, "completion": completion_ids, "completion_mask": completion_mask,
                     **({"images": images} if images else {})})
    if not rows:
        raise UserError(f"dataset {name!r}: no example is left after truncation to --max_prompt_length "
                        f"{max_prompt_length} / --max_length {max_length} ({dropped} dropped)")
    return rows, dropped


@torch.no_grad()
def evaluate(args, accelerator, policy, forward, held_out, logger, step):
    """Held-out demonstrations (`held_out.rows`) -> eval/loss, eval/token_accuracy (token means over every process's
    examples; each process takes an even share, so all make the same model calls); greedy completions of the held-out
    prompts -> eval/gold_score (when the task has a gold scorer) and the sample table."""
    pad = held_out.tokenizer.pad_token_id
    policy.eval()
    indices, n_real = ru.even_share(list(range(len(held_out.rows))), accelerator)
    sums, tokens = {"eval/loss": 0.0, "eval/token_accuracy": 0.0}, 0
    for i in range(0, len(indices), args.per_device_eval_batch_size):
        chunk = indices[i:i + args.per_device_eval_batch_size]
        token_nll, correct, mask = completion_token_stats(policy, forward, [held_out.rows[j] for j in chunk], pad,
                                                          accelerator.device)
        keep = max(0, n_real - i)  # only the first n_real rows of the share count
        sums["eval/loss"] += token_nll[:keep].masked_fill(~mask[:keep], 0.0).sum().item()
        sums["eval/token_accuracy"] += correct[:keep].sum().item()
        tokens += mask[:keep].sum().item()
    metrics = {**ru.global_means(accelerator, sums, tokens),
               **ge.held_out_completions(policy, held_out, args, accelerator, logger, step)}
    policy.train()
    return metrics


def validate(args: Args) -> None:
    """SFT's own flags (each flag group checked its own in ru.parse_args)."""
    if args.max_eval_examples < 0:
        raise UserError(f"--max_eval_examples must be >= 0, got {args.max_eval_examples}")


def main() -> None:
    # 1. arguments: validate and derive the batch size once
    args = ru.parse_args(Args, ALIAS_DEFAULTS)
    validate(args)
    args.dataset = args.dataset or ru.default_dataset(args.model)
    policy_path = ru.resolve_model(args.model)
    accelerator = ru.make_accelerator(args)
    batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    ru.seed_everything(args.seed, accelerator.process_index)

    # 2. tokenizer and data (before the model loads): demonstrations, held-out prompts for the gold score, lengths
    # fitted to the data and the model, token ids, the epochs' order
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=args.trust_remote_code)
    images, *data = ru.with_images(args, policy_path, args.dataset, load_demonstrations(args, "train"),
                                   load_demonstrations(args, args.eval_split))  # the prompts' images (None: text)
    train_pairs, eval_pairs = (prompt_completion_pairs(split, args.dataset) for split in data)
    if args.max_eval_examples:
        eval_pairs = eval_pairs[:args.max_eval_examples]
    scorer = du.gold_scorer(args.dataset) if args.num_eval_prompts else None
    # completed greedily (single-turn: a tool conversation's prompt is not; grpo.py/rloo.py evaluate whole episodes);
    # a prompt with images is measured and completed with them (its vision.ImageSource)
    eval_prompts = [s or p for p, _, tools, s in eval_pairs[:args.num_eval_prompts] if tools is None] if scorer else []
    prompts, _, tools, sources = zip(*train_pairs, *eval_pairs)
    eval_queries = tl.fit_lengths(args, tokenizer, policy_path, [s or p for p, s in zip(prompts, sources)],
                                  eval_prompts, tools=tools)
    train_rows, dropped = tokenize_demonstrations(tokenizer, train_pairs, args.max_prompt_length, args.max_length,
                                                  args.dataset)
    eval_rows, eval_dropped = tokenize_demonstrations(tokenizer, eval_pairs, args.max_prompt_length, args.max_length,
                                                      f"{args.dataset}:{args.eval_split}")
    held_out = du.HeldOut(eval_rows, eval_queries, tokenizer, scorer, images and eval_prompts)
    loop = tl.EpochLoop(args, len(train_rows), batch_size, "examples")

    # 3. the policy (+ LoRA with --use_peft)
    policy = models.load_policy(policy_path, tokenizer, args)

    # 4. optimizer (eps 1e-5 as in Huang et al.'s sft.py), schedule, the run folder, the state (resumed from
    # --resume_from), the logger
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate,
                                  eps=1e-5, weight_decay=args.weight_decay)
    scheduler = loop.scheduler(optimizer)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    forward = fw.Forwards.from_args(args, tokenizer.pad_token_id).lm(policy)  # chosen once placed (forwards.py)
    output_dir = ru.output_dir(args, args.dataset, accelerator)
    state = dict(step=0, nonfinite_skipped=0)
    logger, optimizer_step = tl.start_or_resume(args, accelerator, policy, optimizer, scheduler, output_dir, state)
    # not eval/loss: the bar names a key by its last part, so it would show as loss (each evaluation prints a line)
    logger.progress(loop.total_steps, state["step"], batch_size, "examples",
                    ("loss", "token_accuracy", "eval/gold_score"))
    if not args.resume_from:  # step 0: data counts and the evaluation before training
        metrics = evaluate(args, accelerator, policy, forward, held_out, logger, 0)
        logger.log({"data/train_examples": len(train_rows), "data/dropped": dropped,
                    "data/eval_examples": len(eval_rows), "data/eval_dropped": eval_dropped, **metrics}, step=0)

    stop = tl.StopSignal()
    policy.train()
    meter = tp.StepMeter(accelerator, models.unwrap(policy))  # perf/*
    micro_batches = acc.micro_batches(args, accelerator, policy)  # or sized by --token_budget
    row_tokens = [du.row_tokens(row, completions=("completion",)) for row in train_rows]
    for step in loop.steps(state["step"]):
        meter.start()
        # 5. one optimizer step over the next `batch_size` examples of the epoch's order, micro-batches accumulated
        sums, num_tokens = accumulate_gradients(policy, forward, accelerator, micro_batches, train_rows,
                                                loop.batch_index(step), tokenizer.pad_token_id, row_tokens)
        grad_norm = optimizer_step(sums["loss"], state, step)  # clip, check, step, schedule
        state.update(step=step, nonfinite_skipped=optimizer_step.skipped)

        # 6. log, evaluate every eval_steps steps and after the last
        metrics = ru.reduce_metrics(accelerator, {**sums, **({} if grad_norm is None else {"grad_norm": grad_norm})})
        metrics.update({"num_tokens": num_tokens, **loop.metrics(step, optimizer_step),
                        **meter.metrics(sum(row_tokens[i] for i in loop.batch_index(step)))})
        if loop.evaluate_now(step):
            metrics.update(evaluate(args, accelerator, policy, forward, held_out, logger, step))
        logger.log(metrics, step=step)

        # 7. checkpoints: periodic, and on SIGTERM / Ctrl-C on any process (then every process stops cleanly)
        if tl.checkpoint_or_stop(accelerator, args, output_dir, state, scheduler, stop, loop.total_steps):
            logger.close()
            return

    # 8. final save
    tl.save_model(accelerator, policy, tokenizer, os.path.join(output_dir, "model"), merge_peft=args.merge_peft)
    logger.close(os.path.join(output_dir, "model"))


if __name__ == "__main__":
    ru.main_guard(main)
