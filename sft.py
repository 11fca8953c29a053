"""Supervised fine-tuning (SFT): maximum likelihood of demonstrations, the first stage of RLHF (Stiennon et al. 2020,
https://arxiv.org/abs/2009.01325; Ouyang et al. 2022, https://arxiv.org/abs/2203.02155).

Trains a policy on (prompt, completion) demonstrations with no reference, no reward and no sampling:
    loss = - sum of log pi(y_t | x, y_<t) over the completion tokens y_t of the optimizer step's examples
           / the number of those completion tokens
- Prompt tokens carry no loss: the prompt is context only (TRL's SFTTrainer default for prompt-completion data,
  `completion_only_loss`). Huang et al.'s sft.py (below) trained on the query tokens as well.
- Every completion ends with one EOS, so the policy learns where to stop: appended to text, and to messages unless
  the chat template already ends the assistant turn with EOS (then cut after it; du.tokenize_completion). Then
  du.tokenize_prompt_completion: the prompt keeps its last --max_prompt_length tokens, the completion its first
  --max_length minus prompt tokens (a cut completion has no EOS). An example with an empty prompt or nothing left of
  its completion is dropped and counted.
- Normalisation: a token mean over the whole optimizer step (every micro-batch of every process), not a mean of
  micro-batch means: each completion token weighs the same whichever micro-batch it falls in, so
  --gradient_accumulation_steps and the number of processes leave the gradient unchanged (as TRL's
  num_items_in_batch, and grpo.py's dapo loss). `sft_loss` and `accumulate_gradients` hold the arithmetic.

Data: columns `prompt` and `completion` (text, or lists of {role, content} messages rendered with the chat template
as in dpo.py), or one `messages` column: every message but the last is the prompt, the last (an assistant message)
the completion. Tool-calling conversations (a `messages` row with tool calls, tool messages or several assistant
turns, or a `tools` column of JSON schemas, TRL's format) train whole: the prompt is the messages before the first
assistant turn, rendered with the tools; the loss is on each assistant turn's tokens through its EOS, not on tool
results (du.tokenize_conversation: the same tokens and mask an episode of grpo.py/rloo.py samples, so SFT and RL
agree token for token). `--model toy_tools` trains on the toy tool world's conversations. `--dataset toy`: the toy
world has no demonstrations on disk, so `toy_demonstrations` builds them in memory from its prompt dataset: by default the correct answer (the letters sorted, toy_task.target_completion), so
fine-tuning the toy SFT policy (greedy gold 0.47) on them teaches it the task; `--toy_demonstrations imperfect` gives
the toy world's own noisy demonstrations (toy_task.imperfect_demonstration, seeded), the kind its SFT policy learned.

    python sft.py              # toy task, on a CPU: the toy SFT policy learns to sort
    accelerate launch sft.py --model EleutherAI/pythia-1b-deduped --dataset tldr    # benchmark/tldr/sft.sh

Real-scale defaults: the TL;DR SFT of Huang et al. 2024 ("The N+ Implementation Details of RLHF with PPO",
https://arxiv.org/abs/2403.17031; summarize_from_feedback_details/sft.py and sbatches/sft.sbatch): learning rate
3e-6, one epoch, 128 examples per step (there: 1 per GPU x 16 accumulation steps x 8 GPUs; here 4 x 4 x 8), AdamW
with eps 1e-5 and torch's default weight decay 0.01, summaries of at most 53 tokens. Differences: a linear schedule
(theirs: cosine, no warmup; here --warmup_ratio 0), gradient clipping at 1.0, and the prompt masking above.

Logged each step: loss (the token mean above, nats per completion token); token_accuracy (completion tokens whose
most likely token is the demonstrated one); num_tokens (completion tokens in the step's loss, all processes);
grad_norm; lr; epoch; nonfinite/skipped; time/*. Each evaluation (before training, every --eval_steps, after the last
step) logs eval/loss and eval/token_accuracy (token means over held-out examples) and, where the dataset has a gold
scorer (the toy task; not tool conversations, whose gold needs the tool: grpo.py and rloo.py play them),
eval/gold_score of greedy completions of held-out prompts, with a few samples printed. Step 0
also holds data/* counts (data/dropped: examples truncation left without prompt or completion).
"""

import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from transformers import get_scheduler

from plumbing import data_utils as du
from plumbing import greedy_eval as ge
from plumbing import models
import policy_common as pc
from plumbing import run_utils as ru
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


def validate(args: Args) -> None:
    if not 1 <= (1 if args.max_prompt_length is None else args.max_prompt_length) < args.max_length:
        raise UserError(f"need 1 <= --max_prompt_length < --max_length, got {args.max_prompt_length} and "
                        f"{args.max_length}")
    if args.response_length < 1 or args.num_eval_prompts < 0 or args.max_eval_examples < 0:
        raise UserError("--response_length must be >= 1, --num_eval_prompts and --max_eval_examples >= 0")
    if args.learning_rate <= 0 or args.max_grad_norm <= 0 or args.num_train_epochs <= 0 or args.weight_decay < 0:
        raise UserError("--learning_rate, --max_grad_norm and --num_train_epochs must be > 0, --weight_decay >= 0")
    if not 0 <= args.warmup_ratio < 1 or (args.max_steps is not None and args.max_steps < 1):
        raise UserError(f"need 0 <= --warmup_ratio < 1 and --max_steps >= 1, got {args.warmup_ratio}, {args.max_steps}")
    if min(args.per_device_train_batch_size, args.per_device_eval_batch_size, args.gradient_accumulation_steps) < 1:
        raise UserError("batch sizes and --gradient_accumulation_steps must be >= 1")


# Data: demonstrations -> (prompt, completion) -> token ids
def toy_demonstrations(split: str, kind: str, seed: int, world: str = "toy"):
    """A toy world's SFT data (`world`: toy, toy_hard), built in memory: the prompts of its prompt dataset's `split`,
    each with the sorted answer (`kind` "sorted") or one of that world's noisy demonstrations ("imperfect", a fixed
    draw per seed and split). Returns a datasets.Dataset with columns prompt, completion."""
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
    """`split` of the SFT data: the toy demonstrations for `toy`, the tool world's conversations for `toy_tools`,
    else the dataset (alias `tldr` = trl-lib/tldr, whose columns are prompt and completion; a hub id, folder or files)
    with its columns checked."""
    if args.dataset in du.TOY_WORLDS:
        return toy_demonstrations(split, args.toy_demonstrations, args.seed, args.dataset)
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
    """Rows -> [(prompt, completion, tools)], prompt and completion text or lists of messages. A `messages` row is
    cut before its last message, which must be the assistant's; a tool conversation (is_tool_conversation) before
    its first assistant message, `tools` then its `tools` column (JSON schemas, or a JSON string of them) or [];
    else tools is None. Anything else is a UserError naming the row."""
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
        for column, value in (("prompt", prompt), ("completion", completion)):
            if not (isinstance(value, str) or du.is_conversational(value)):
                raise UserError(f"dataset {name!r} row {i} column {column!r}: expected text or a list of "
                                f"{{role, content}} messages, got {type(value).__name__}")
        pairs.append((prompt, completion, tools))
    return pairs


def tokenize_demonstrations(tokenizer, pairs, max_prompt_length: int, max_length: int, name: str):
    """[(prompt, completion, tools)] -> (rows, dropped): rows of token-id lists `prompt`, `completion` and the bool
    list `completion_mask` (True on the tokens trained on). A pair: the completion ending with EOS
    (du.tokenize_completion), cut by du.tokenize_prompt_completion's rule, every completion token trained. A tool
    conversation (tools not None): du.tokenize_conversation's tokens and mask (assistant turns only), cut by the same
    rule. An example with an empty prompt or no trained token left is dropped and counted. No example left is a
    UserError."""
    rows, dropped = [], 0
    for prompt, completion, tools in pairs:
        if tools is None:
            prompt_ids, completion_ids = du.tokenize_prompt_completion(tokenizer, prompt, completion,
                                                                       max_prompt_length, max_length)
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
        rows.append({"prompt": prompt_ids, "completion": completion_ids, "completion_mask": completion_mask})
    if not rows:
        raise UserError(f"dataset {name!r}: no example is left after truncation to --max_prompt_length "
                        f"{max_prompt_length} / --max_length {max_length} ({dropped} dropped)")
    return rows, dropped


def prompt_completion_batch(rows, pad_token_id: int):
    """b rows -> (query_responses (b, Lq + R), context_length Lq, completion_mask (b, R) bool): prompts LEFT-padded
    to Lq, completions RIGHT-padded to R, so every completion starts at position Lq (pc.forward_logits's layout);
    the mask is the rows' completion_mask, False on padding."""
    prompts = pc.pad_sequences([r["prompt"] for r in rows], pad_token_id, "left")  # (b, Lq)
    completions = pc.pad_sequences([r["completion"] for r in rows], pad_token_id, "right")  # (b, R)
    completion_mask = pc.pad_sequences([[int(m) for m in r["completion_mask"]] for r in rows], 0, "right").bool()
    return torch.cat([prompts, completions], 1), prompts.shape[1], completion_mask


def completion_token_stats(model, rows, pad_token_id: int, device, chunk_tokens: Optional[int] = 0):
    """rows -> per completion token (b, R): negative log-likelihood under `model`, whether the most likely token
    is the demonstrated one, and the mask of the tokens trained on (False on padding and, in tool conversations, on
    tool results). Only the positions that predict completion tokens are computed: no prompt token is a target;
    the output layer runs on `chunk_tokens` of them at a time (--logprob_chunk_tokens; 0: all at once)."""
    query_responses, context_length, completion_mask = prompt_completion_batch(rows, pad_token_id)
    query_responses = query_responses.to(device)
    completions = query_responses[:, context_length:]  # (b, R)
    # the full softmax, as TRL's SFTTrainer: pad is never a target, so maximum likelihood pushes its probability
    # down and the checkpoint does not emit it under samplers that do not suppress it (the RL scripts mask it)
    token_logprobs, top1 = pc.map_response_logits(model, query_responses, context_length, pad_token_id,
                                                  token_logprob_and_top1, completions, mask_pad=False,
                                                  chunk_tokens=chunk_tokens)  # (b, R) each
    mask = (completions != pad_token_id) & completion_mask.to(completions.device)
    return -token_logprobs, top1 & mask, mask


def token_logprob_and_top1(logits: torch.Tensor, tokens: torch.Tensor):
    """(n, V) logits, (n,) tokens -> ((n,) log softmax(logits)[token], (n,) whether the token is the most likely)."""
    return pc.selective_logprobs(logits, tokens), logits.detach().argmax(-1) == tokens


# ALGO LOGIC: the loss and its normalisation
def sft_loss(token_nll, mask, tokens_per_micro_batch: float):
    """(b, R) completion-token NLLs and mask -> this micro-batch's loss: its token sum / `tokens_per_micro_batch`
    (= the step's completion tokens / (processes x micro-batches)). accelerate divides each micro-batch's loss by
    the accumulation steps and DDP averages processes, so the step's gradient is that of (the sum of every completion
    token's NLL in the step) / (their number): a token mean over the global batch."""
    return token_nll.masked_fill(~mask, 0.0).sum() / tokens_per_micro_batch


def accumulate_gradients(policy, accelerator, rows, batch_index, local_micro_batch_size: int, pad_token_id: int,
                         chunk_tokens: Optional[int] = 0):
    """Accumulate one optimizer step's gradients over the examples rows[batch_index] (every process's, in order):
    micro-batch m of process p is slice (m, p). Returns the step's loss and token_accuracy (after ru.reduce_metrics:
    token means over the whole batch) and num_tokens. The token count comes from `rows`, which every process holds:
    no collective. `chunk_tokens`: --logprob_chunk_tokens."""
    world, steps = accelerator.num_processes, accelerator.gradient_accumulation_steps
    num_tokens = sum(sum(rows[i]["completion_mask"]) for i in batch_index)  # loss tokens of the step, all processes
    tokens_per_micro_batch = num_tokens / (world * steps)
    sums = {"loss": 0.0, "token_accuracy": 0.0}
    for micro in range(steps):
        start = (micro * world + accelerator.process_index) * local_micro_batch_size
        index = batch_index[start:start + local_micro_batch_size]
        with accelerator.accumulate(policy):
            token_nll, correct, mask = completion_token_stats(policy, [rows[i] for i in index], pad_token_id,
                                                              accelerator.device, chunk_tokens)
            loss = sft_loss(token_nll, mask, tokens_per_micro_batch)
            accelerator.backward(loss)  # divided by gradient_accumulation_steps inside
        # this process's part of the step's means; ru.reduce_metrics averages processes: token means over the batch
        sums["loss"] += loss.item() / steps
        sums["token_accuracy"] += correct.sum().item() / (tokens_per_micro_batch * steps)
    return sums, num_tokens


@torch.no_grad()
def evaluate(args, accelerator, policy, held_out, logger, step):
    """Held-out demonstrations (`held_out.rows`) -> eval/loss, eval/token_accuracy (token means over every process's
    examples); greedy completions of the held-out prompts -> eval/gold_score (when the task has a gold scorer) and
    the sample table."""
    pad = held_out.tokenizer.pad_token_id
    policy.eval()
    indices, n_real = ru.even_share(list(range(len(held_out.rows))), accelerator)
    sums, tokens = {"eval/loss": 0.0, "eval/token_accuracy": 0.0}, 0
    for i in range(0, len(indices), args.per_device_eval_batch_size):
        chunk = indices[i:i + args.per_device_eval_batch_size]
        token_nll, correct, mask = completion_token_stats(policy, [held_out.rows[j] for j in chunk], pad,
                                                          accelerator.device, args.logprob_chunk_tokens)
        keep = max(0, n_real - i)  # only the first n_real rows of the share count
        sums["eval/loss"] += token_nll[:keep].masked_fill(~mask[:keep], 0.0).sum().item()
        sums["eval/token_accuracy"] += correct[:keep].sum().item()
        tokens += mask[:keep].sum().item()
    metrics = ru.global_means(accelerator, sums, tokens)
    gold, samples = ge.held_out_completions(policy, held_out, args.response_length, args.per_device_eval_batch_size,
                                            accelerator)
    policy.train()
    logger.log_samples("eval/samples", samples, step, args.num_samples_printed)
    return {**metrics, **gold}


def main() -> None:
    # TRY NOT TO MODIFY: arguments, sizes, seeding
    args = ru.parse_args(Args, ALIAS_DEFAULTS)
    validate(args)
    args.dataset = args.dataset or ru.default_dataset(args.model)
    policy_path = ru.resolve_model(args.model)
    accelerator = ru.make_accelerator(args.gradient_accumulation_steps)
    world_size = accelerator.num_processes
    local_micro_batch_size = args.per_device_train_batch_size
    batch_size = local_micro_batch_size * world_size * accelerator.gradient_accumulation_steps  # examples per step
    ru.seed_everything(args.seed, accelerator.process_index)

    # 1. data: demonstrations, held-out prompts (gold score), lengths fitted to the model, token ids (before the
    # model loads)
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=args.trust_remote_code)
    train_pairs = prompt_completion_pairs(load_demonstrations(args, "train"), args.dataset)
    eval_pairs = prompt_completion_pairs(load_demonstrations(args, args.eval_split), args.dataset)
    if args.max_eval_examples:
        eval_pairs = eval_pairs[:args.max_eval_examples]
    scorer = du.gold_scorer(args.dataset) if args.num_eval_prompts else None
    # completed greedily (single-turn: a tool conversation's prompt is not; grpo.py/rloo.py evaluate whole episodes)
    eval_prompts = [p for p, _, tools in eval_pairs[:args.num_eval_prompts] if tools is None] if scorer else []
    positions = ru.model_positions(policy_path, args.trust_remote_code)
    ru.fit_length(args, "max_length", positions, "the model's max_position_embeddings")
    if args.max_prompt_length is None:  # the longest prompt
        args.max_prompt_length = max(len(tokenizer(du.render_prompt(tokenizer, p, tools), add_special_tokens=False)
                                         .input_ids) for p, _, tools in [*train_pairs, *eval_pairs])
    ru.fit_length(args, "max_prompt_length", args.max_length - 1,
                  f"one completion token of --max_length {args.max_length}")
    train_rows, dropped = tokenize_demonstrations(tokenizer, train_pairs, args.max_prompt_length, args.max_length,
                                                  args.dataset)
    eval_rows, eval_dropped = tokenize_demonstrations(tokenizer, eval_pairs, args.max_prompt_length, args.max_length,
                                                      f"{args.dataset}:{args.eval_split}")
    eval_queries = du.tokenize_prompts(tokenizer, eval_prompts, args.max_prompt_length)
    if eval_queries:
        longest = max(len(q) for q in eval_queries)
        ru.fit_length(args, "response_length", None if positions is None else positions - longest,
                      f"a held-out prompt of {longest} tokens in the model's {positions}")
    steps_per_epoch = len(train_rows) // batch_size
    if steps_per_epoch == 0:
        raise UserError(f"{len(train_rows)} training examples are fewer than one batch of {batch_size} (per_device_"
                        f"train_batch_size {local_micro_batch_size} x {world_size} processes x "
                        "gradient_accumulation_steps)")
    total_steps = min(max(1, int(steps_per_epoch * args.num_train_epochs)), args.max_steps or math.inf)

    held_out = du.HeldOut(eval_rows, eval_queries, tokenizer, scorer)

    # 2. the policy (+ LoRA with --use_peft), optimizer, schedule (not given to prepare: accelerate would step it on
    # every process; checkpoints save it). eps 1e-5 as in Huang et al.'s sft.py.
    policy = models.load_policy(policy_path, tokenizer, args)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate,
                                  eps=1e-5, weight_decay=args.weight_decay)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=math.ceil(args.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    policy, optimizer = accelerator.prepare(policy, optimizer)

    # 3. the run folder (every input is valid by now), the state (resumed from --resume_from), the logger
    output_dir = ru.output_dir(args, args.dataset, accelerator)
    state = dict(step=0, nonfinite_skipped=0)
    logger, optimizer_step = tl.start_or_resume(args, accelerator, policy, optimizer, scheduler, output_dir, state)
    # not eval/loss: the bar names a key by its last part, so it would show as loss (each evaluation prints a line)
    logger.progress(total_steps, state["step"], batch_size, "examples", ("loss", "token_accuracy", "eval/gold_score"))

    # 4. step 0 (not again when resuming): data counts and the evaluation before training
    if not args.resume_from:
        metrics = evaluate(args, accelerator, policy, held_out, logger, 0)
        logger.log({"data/train_examples": len(train_rows), "data/dropped": dropped,
                    "data/eval_examples": len(eval_rows), "data/eval_dropped": eval_dropped, **metrics}, step=0)

    # 5. training: every optimizer step takes the next `batch_size` examples of the epoch's permutation (the same
    # global order for any number of processes)
    stop = tl.StopSignal()
    start_time, start_step = time.time(), state["step"]
    policy.train()
    while state["step"] < total_steps:
        step = state["step"] + 1
        epoch, position = divmod(step - 1, steps_per_epoch)
        if step - 1 == start_step or position == 0:
            order = du.epoch_permutation(len(train_rows), args.seed, epoch)  # same on every process
        batch_index = order[position * batch_size:(position + 1) * batch_size]
        sums, num_tokens = accumulate_gradients(policy, accelerator, train_rows, batch_index, local_micro_batch_size,
                                                tokenizer.pad_token_id, args.logprob_chunk_tokens)
        grad_norm = optimizer_step(sums["loss"], state, step)  # clip, check, step, schedule
        state.update(step=step, nonfinite_skipped=optimizer_step.skipped)

        # 6. log, evaluate every eval_steps steps and after the last
        metrics = ru.reduce_metrics(accelerator, {**sums, **({} if grad_norm is None else {"grad_norm": grad_norm})})
        metrics.update({"num_tokens": num_tokens, "lr": optimizer_step.lr, "epoch": step / steps_per_epoch,
                        "nonfinite/skipped": state["nonfinite_skipped"], "time/elapsed": time.time() - start_time,
                        "time/examples_per_second": (step - start_step) * batch_size / (time.time() - start_time)})
        if step == total_steps or (args.eval_steps and step % args.eval_steps == 0):
            metrics.update(evaluate(args, accelerator, policy, held_out, logger, step))
        logger.log(metrics, step=step)

        # 7. checkpoints: periodic, and on SIGTERM / Ctrl-C on any process (then every process stops cleanly)
        if tl.checkpoint_or_stop(accelerator, args, output_dir, state, scheduler, stop, total_steps):
            logger.close()
            return

    # 8. final save
    tl.save_model(accelerator, policy, tokenizer, os.path.join(output_dir, "model"), merge_peft=args.merge_peft)
    logger.close(os.path.join(output_dir, "model"))


if __name__ == "__main__":
    ru.main_guard(main)
