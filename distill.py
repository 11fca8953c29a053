"""On-policy distillation (GKD): Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (https://arxiv.org/abs/2306.13649), and its policy-gradient form (verl; Thinking Machines 2025,
"On-Policy Distillation"). Per step: the student samples the completions (with probability --lmbda; else the dataset's
or the teacher's), the teacher scores every token, and the student steps on a per-token divergence to it (--loss gkd:
generalized JSD, --beta 0 forward KL .. 1 reverse KL; --loss pg: REINFORCE on log p_teacher - log p_student). Flags:
TRL's DistillationConfig / GKDConfig; details: docs/distillation.md; metrics: docs/metrics.md.

    python distill.py                               # the toy teacher into the toy SFT policy, on a CPU
    python distill.py --model toy_vision            # images: the toy vision teacher into the toy LLaVA policy
    accelerate launch distill.py --model <student> --teacher_model <teacher> --dataset <prompts>
"""
import functools
import math
import os
import random
from dataclasses import dataclass
from typing import List, Literal, Optional

import torch
import torch.nn.functional as F

import policy_common as pc
from plumbing import accumulation as acc
from plumbing import data_utils as du
from plumbing import evaluation as ev
from plumbing import models
from plumbing import reward_sources as rs
from plumbing import rollout as ro
from plumbing import run_utils as ru
from plumbing import throughput as tp
from plumbing import train_loop as tl
from plumbing import vision as pv
from plumbing import vllm_generation as vg
from plumbing.errors import RolloutError, UserError


@dataclass
class Args(tl.TrainFlags, models.PolicyFlags, du.DataFlags, ro.RolloutFlags, rs.RewardFunctionFlags, vg.VLLMFlags):
    # shared flags whose default differs here (TRL's DistillationConfig)
    learning_rate: float = 1e-6
    total_episodes: int = 100_000
    response_length: int = 256

    # distillation (names and defaults of TRL's DistillationConfig / GKDConfig)
    teacher_model: Optional[str] = None
    """teacher: alias (toy: the toy world's teacher), hub id or folder; same vocabulary; None = the one paired"""
    loss: Literal["gkd", "pg"] = "gkd"
    """gkd: generalized JSD of the next-token distributions; pg: REINFORCE on log p_teacher - log p_student"""
    beta: float = 1.0
    """the divergence (TRL's GKD beta): 0 = forward KL(teacher || student), 1 = reverse KL, 0.5 = JSD"""
    lmbda: float = 1.0
    """fraction of steps whose completions the student samples (the rest: dataset completions, or the teacher's)"""
    seq_kd: bool = False
    """off-policy steps train on teacher-sampled completions (sequence-level KD) instead of the dataset's"""
    loss_top_k: int = 0
    """gkd: the divergence over k tokens (TRL's IW-OPD): the teacher's top-k at beta 0, the student's at 1, their
    union between (0 = the whole vocabulary)"""
    loss_add_tail: bool = True
    """with --loss_top_k: one more bucket holds the mass outside the k tokens (else both renormalised over them)"""
    cliprange: float = 0.2
    """clip range of the policy's importance ratio"""


# Toy-tuned defaults, applied only to flags not given on the command line (docs/toy_worlds.md).
ALIAS_DEFAULTS = {"toy": dict(
    total_episodes=2048, learning_rate=3e-4, per_device_train_batch_size=64, gradient_accumulation_steps=1,
    response_length=8, max_prompt_length=8, eval_steps=8, num_eval_prompts=256, local_rollout_forward_batch_size=256)}
# toy_hard (toy_task.SETTINGS): the toy defaults and budget, with room for its longer prompts and answers
ALIAS_DEFAULTS["toy_hard"] = dict(ALIAS_DEFAULTS["toy"], max_prompt_length=10, response_length=10)
# toy_vision (toy_vision.py): its teacher (a wider LLaVA of the student's family, trained on the right answers), room
# for a prompt's image tokens; reading the square's side takes the student longer than its colour: 192 steps
ALIAS_DEFAULTS["toy_vision"] = dict(ALIAS_DEFAULTS["toy"], teacher_model="toy_vision", max_prompt_length=None,
                                    response_length=3, learning_rate=1e-3, total_episodes=12288, eval_steps=32)


# ALGO LOGIC: the distillation losses, pure functions of tensors (tested in tests/test_distill.py)
def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    top_k: int = 0, add_tail: bool = True) -> torch.Tensor:
    """(b, R, V) student and teacher logits (temperature already applied) -> (b, R) per-token generalized JSD
    beta KL(T || M) + (1 - beta) KL(S || M) with M = beta T + (1 - beta) S; beta 0 is KL(T || S) (forward), 1 is
    KL(S || T) (reverse). 0 < top_k < V: over a support of tokens (`top_k_support`). The teacher's side carries no
    gradient."""
    teacher_logits = teacher_logits.detach()
    student, teacher = F.log_softmax(student_logits.float(), -1), F.log_softmax(teacher_logits.float(), -1)
    if 0 < top_k < student.shape[-1]:
        student, teacher = top_k_support(student, teacher, beta, top_k, add_tail)

    def kl(p, q):  # KL(p || q) per position, from log-probs; 0 log 0 = 0
        return (p.exp() * (p - q)).nan_to_num(0.0).sum(-1)

    if beta == 0:
        return kl(teacher, student)
    if beta == 1:
        return kl(student, teacher)
    mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log(1 - beta)]), 0)
    return beta * kl(teacher, mixture) + (1 - beta) * kl(student, mixture)


def top_k_support(student: torch.Tensor, teacher: torch.Tensor, beta: float, k: int, add_tail: bool):
    """(b, R, V) log-probs -> the same over k support tokens, -inf elsewhere, as TRL's IW-OPD defines the support:
    the teacher's top-k for the forward KL (beta 0), the student's for the reverse KL (beta 1; mass the student puts
    where the teacher has little is what that KL penalises), their union for the JSD between. With `add_tail`, a
    (V+1)-th bucket holds each distribution's mass outside the support, log(1 - sum) (so k = 1 does not give 0), else
    both are renormalised over the support."""
    tops = ([teacher] if beta < 1 else []) + ([student] if beta > 0 else [])
    support = torch.zeros_like(student, dtype=torch.bool)
    for logprobs in tops:
        support.scatter_(-1, logprobs.detach().topk(k, -1).indices, True)
    student, teacher = student.masked_fill(~support, -math.inf), teacher.masked_fill(~support, -math.inf)
    if not add_tail:
        return student.log_softmax(-1), teacher.log_softmax(-1)

    def with_tail(logprobs):  # TRL's _add_tail_bucket: the support's mass kept below 1
        inside = logprobs.logsumexp(-1, keepdim=True).clamp(max=-1e-7)
        return torch.cat([logprobs, torch.log(-torch.expm1(inside))], -1)

    return with_tail(student), with_tail(teacher)


def pg_token_loss(new_logprobs, old_logprobs, teacher_logprobs, epsilon: float, is_weights=None):
    """(b, R) log-probs of the sampled tokens under the student now, the student that sampled them, and the teacher ->
    (b, R) clipped REINFORCE loss with per-token advantage A_t = log p_T(y_t) - log p_S_old(y_t) (detached):
    -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon) A), ratio = exp(new - old); times is_weights when vLLM
    sampled. Its gradient at ratio 1 is -A_t grad log p_S(y_t): descending it lowers the reverse KL."""
    advantages = (teacher_logprobs - old_logprobs).detach()
    ratio = torch.exp(new_logprobs - old_logprobs)
    loss = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * advantages)
    return loss if is_weights is None else loss * is_weights


def token_terms(student_logits, teacher_chunk, tokens, *, teacher, teacher_forward, teacher_hidden: bool, args):
    """A chunk of n completion positions (Forward.map_logits' fn): the student's (n, V) logits / temperature, the
    teacher's logits there (or its hidden states, `teacher_hidden`: its output layer then runs on this chunk only,
    `teacher_forward.head_logits`) and the (n,) tokens -> (divergence (gkd; zeros for pg), the student's log-prob of
    each token, the teacher's, the student's entropy), each (n,). Only the divergence (gkd) or the student's log-probs
    (pg) carry a gradient."""
    teacher_logits = teacher_forward.head_logits(teacher, teacher_chunk) if teacher_hidden else teacher_chunk
    divergence = (generalized_jsd(student_logits, teacher_logits, args.beta, args.loss_top_k, args.loss_add_tail)
                  if args.loss == "gkd" else torch.zeros_like(tokens, dtype=torch.float))
    with torch.no_grad():
        teacher_logprobs = pc.selective_logprobs(teacher_logits, tokens)
        student_entropy = pc.entropy_from_logits(student_logits.detach())
    # the sampled tokens' log-probs: pg's loss; gkd's metrics only, so no graph (a graph the loss does not use would
    # keep each chunk's recomputed logits alive until the backward ends)
    with torch.set_grad_enabled(torch.is_grad_enabled() and args.loss == "pg"):
        new_logprobs = pc.selective_logprobs(student_logits, tokens)
    return divergence, new_logprobs, teacher_logprobs, student_entropy


def teacher_outputs(teacher, teacher_forward, query_responses, context_length: int, row_chunks, hidden: bool,
                    images=None) -> torch.Tensor:
    """(B, T) and the rows' image inputs (None: text) -> for the rows of `row_chunks` (index tensors, one forward
    each), the teacher's (b, R, V) logits / temperature at the response positions (pad masked), or with `hidden` its
    (b, R, H) last hidden states there (its forward's `head_logits` turns a chunk into those logits)."""
    def outputs(rows):
        if not hidden:
            return teacher_forward.logits(teacher, query_responses[rows], context_length,
                                          images=pv.row_images(images, rows))
        return teacher_forward.outputs(teacher, query_responses[rows], context_length, hidden=True,
                                       images=pv.row_images(images, rows))

    return torch.cat([outputs(rows) for rows in row_chunks])


def validate(args: Args) -> int:
    """Check the distillation flags (each flag group checked its own in ru.parse_args); returns the completions per
    process per step."""
    if not 0 <= args.beta <= 1 or not 0 <= args.lmbda <= 1:
        raise UserError(f"--beta and --lmbda must be in [0, 1], got {args.beta} and {args.lmbda}")
    if args.loss == "pg" and (args.lmbda < 1 or args.loss_top_k):
        raise UserError("--loss pg is on-policy REINFORCE on the sampled tokens: it needs --lmbda 1 and no "
                        "--loss_top_k")
    if args.cliprange <= 0 or args.loss_top_k < 0:
        raise UserError("--cliprange must be > 0, --loss_top_k >= 0")
    if args.loss_top_k == 1 and not args.loss_add_tail:
        raise UserError("--loss_top_k 1 without --loss_add_tail compares two distributions on one token: the loss is "
                        "always 0; use --loss_top_k >= 2 or keep the tail bucket (--loss_add_tail)")
    return args.per_device_train_batch_size * args.gradient_accumulation_steps


def load_teacher(args, tokenizer, accelerator, vision: Optional[pv.Vision] = None):
    """The frozen teacher: --teacher_model (None: the one paired with --model), its vocabulary the student's and its
    positions enough for prompt + completion (--max_prompt_length + --response_length); with images (`vision`), a
    vision-language model of the student's family that reads the student's image inputs; one-line errors name both
    models otherwise."""
    name = args.teacher_model or ru.default_teacher(args.model)
    path = ru.resolve_teacher(name)
    if vision is not None:
        check_teacher_images(name, path, vision, args.trust_remote_code)
    teacher_tokenizer = models.load_tokenizer(path, trust_remote_code=args.trust_remote_code)
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"the teacher {name!r} has another vocabulary than the student {args.model!r} ("
                        f"{len(teacher_tokenizer)} vs {len(tokenizer)} tokens): distillation compares next-token "
                        "distributions token by token, so they must share one")
    positions_needed = args.max_prompt_length + args.response_length
    positions = ru.model_positions(path, args.trust_remote_code)
    if positions is not None and positions < positions_needed:
        raise UserError(f"the teacher {name!r} has {positions} positions, fewer than a prompt + completion of "
                        f"{positions_needed} tokens (--max_prompt_length + --response_length): lower them")
    teacher = models.load_causal_lm(path, tokenizer, models.Precision.from_args(args),
                                    trust_remote_code=args.trust_remote_code)
    return models.prepare_frozen(teacher, accelerator)


def check_teacher_images(name: str, path: str, vision: pv.Vision, trust_remote_code: bool) -> None:
    """The data has images, which the student's processor turned into image tokens and pixel inputs: the teacher must
    read both as the student does (a VLM of its family, the same image tokens and image processor)."""
    from transformers import AutoProcessor

    config, student = (ru.model_config(p, trust_remote_code) for p in (path, vision.model_name))
    if not pv.is_vision_model(config):
        raise UserError(f"--teacher_model {name!r} is a text-only model ({type(config).__name__}) but the data has "
                        f"images (its {vision.column!r} column): give a vision-language teacher of the student's "
                        "family")
    try:
        images = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code).image_processor.to_dict()
    except (OSError, ValueError, AttributeError):  # no image processor beside the teacher
        images = None
    if (config.model_type, pv.image_token_ids(config), images) != (
            student.model_type, pv.image_token_ids(student), vision.processor.image_processor.to_dict()):
        raise UserError(f"--teacher_model {name!r} ({config.model_type}) does not read the student's images as "
                        f"--model {vision.model_name!r} ({student.model_type}) does (another family, image token or "
                        "image processor): distillation with images needs one family and processor")


def off_policy_completions(args, data, tokenizer, teacher, prompts_seen: int, local_batch_size: int, accelerator):
    """An off-policy step's batch: this process's next local_batch_size prompts of the data stream with the teacher's
    samples (--seq_kd) or their `completion` column (`dataset_completions`). Returns (query_responses (B, Lq + R),
    Lq, the rows' image inputs (B,) or None for text)."""
    pad = tokenizer.pad_token_id
    indices = du.data_positions(len(data.train_prompts), args.seed,
                                prompts_seen + accelerator.process_index * local_batch_size, local_batch_size)
    queries = pc.pad_sequences([data.train_prompts[i] for i in indices], pad, "left").to(accelerator.device)
    images = data.vision and data.vision.rows_inputs([data.train[i] for i in indices])
    if args.seq_kd:  # the teacher never samples an image placeholder (a picture that is not there)
        config = pc.make_generation_config(tokenizer, args.response_length, args.temperature,
                                           cache_implementation=args.cache_implementation,
                                           suppress=pv.image_token_ids(models.causal_lm(teacher).config))
        query_responses, _ = pc.batch_generation(teacher, queries, pad, tokenizer.eos_token_id, config,
                                                 args.local_rollout_forward_batch_size, accelerator, images=images)
        return query_responses, queries.shape[1], images
    completions = dataset_completions(data.train, indices, tokenizer, args.response_length)
    completions = pc.pad_sequences(completions, pad, "right").to(accelerator.device)
    return torch.cat([queries, completions], 1), queries.shape[1], images


def dataset_completions(data, indices, tokenizer, response_length: int) -> List[List[int]]:
    """Off-policy completions of the training rows `indices`: their `completion` column (text, or messages rendered
    after the prompt) ending with one EOS (du.tokenize_completion), cut to response_length tokens."""
    rows = [data[i] for i in indices]
    return [du.tokenize_completion(tokenizer, row["prompt"], row["completion"])[:response_length] for row in rows]


def main():
    # 1. arguments: validate and derive every batch size once
    args = ru.parse_args(Args, ALIAS_DEFAULTS)
    local_batch_size = validate(args)
    accelerator = ru.make_accelerator(args)
    batch_size = local_batch_size * accelerator.num_processes
    num_total_batches = min(math.ceil(args.total_episodes / batch_size), args.max_steps or math.inf)
    ru.seed_everything(args.seed, accelerator.process_index)

    # 2. tokenizer and data: prompts tokenised once; completions fitted into the model's positions after them
    policy_path = ru.resolve_model(args.model)
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=args.trust_remote_code)
    data = ro.load_prompt_data(args, tokenizer, policy_path, images=True)  # images: the forwards carry them
    if args.lmbda < 1 and not args.seq_kd:
        du.require_columns(data.train, ["completion"], data.name)  # the off-policy steps' completions
    if args.reward_funcs is None and data.held_out.gold is not None:
        args.reward_funcs = ["gold"]  # evaluated and logged, never trained on
    output_dir = ru.output_dir(args, data.name, accelerator)

    # 3. models: the student (+LoRA), the frozen teacher; reward functions (logged only); each one's forward (logits /
    #    temperature; packed, the output layer in chunks, ...), chosen once (plumbing/forwards.py)
    forwards = ro.rollout_forwards(args, tokenizer.pad_token_id, samples_per_prompt=1)
    teacher = load_teacher(args, tokenizer, accelerator, data.vision)
    teacher_forward = forwards.lm(teacher)
    policy = models.load_policy(policy_path, tokenizer, args)
    reward_sources = rs.Rewards(tokenizer, functions=[rs.load_reward_function(spec, data.name)
                                                      for spec in args.reward_funcs or []], weights=args.reward_weights,
                                required=False)

    # 4. optimizer, linear decay per step, checkpointable state, the sampler
    optimizer, scheduler = tl.adamw_linear_decay(policy, args.learning_rate, num_total_batches)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    forward = forwards.lm(policy)  # chosen once placed
    state = dict(step=0, episode=0, prompts_seen=0, nonfinite_skipped=0)
    logger, optimizer_step = tl.start_or_resume(args, accelerator, policy, optimizer, scheduler, output_dir, state)
    logger.progress(num_total_batches, state["step"], batch_size, "episodes",
                    ("loss/distill", "objective/teacher_kl", "eval/gold_score"))
    micro_batches = acc.micro_batches(args, accelerator, policy)  # or sized by --token_budget
    sampler = ro.Sampler(args, accelerator, tokenizer, policy, forward, reward_sources, None,
                         prompts=data.train_prompts, rows=data.train, samples_per_prompt=1,
                         prompts_per_process=local_batch_size, max_prompt_length=args.max_prompt_length,
                         weights_version=state["step"], vision=data.vision)
    pad, chunk = tokenizer.pad_token_id, args.local_rollout_forward_batch_size
    stop = tl.StopSignal()
    if state["step"] == 0:
        logger.log(ev.evaluate_policy(sampler, data.held_out, logger, 0), step=0)

    meter = tp.StepMeter(accelerator, models.unwrap(policy), episode=state["episode"])  # perf/*
    while state["step"] < num_total_batches:
        step = state["step"] + 1
        meter.start()
        # 5. the batch's completions: the student's samples (probability lmbda; the same draw on every process), else
        #    the dataset's or, with --seq_kd, the teacher's
        on_policy = random.Random(f"distill-{args.seed}-{step}").random() < args.lmbda
        if on_policy:
            with tl.checkpoint_on_error(RolloutError, accelerator, output_dir, dict(state), scheduler):
                batch = sampler.rollout(state["prompts_seen"], weights_version=state["step"],
                                        old_logprobs=args.loss == "pg")
            query_responses, context_length, response_mask, images = batch.query_responses, batch.context_length, \
                batch.response_mask, batch.images
        else:
            query_responses, context_length, images = off_policy_completions(
                args, data, tokenizer, teacher, state["prompts_seen"], local_batch_size, accelerator)
            response_mask = query_responses[:, context_length:] != pad
        global_tokens = ru.global_sum(accelerator, response_mask.sum().item())
        tokens_per_micro_batch = global_tokens / (accelerator.num_processes * args.gradient_accumulation_steps)

        # 6. the teacher's view of every completion token, then one optimizer step over the micro-batches
        losses, teacher_kl, entropy, is_stats = [], [], [], {}
        for mb in micro_batches.split(torch.arange(local_batch_size, device=accelerator.device),
                                      (query_responses != pad).sum(1), mean_over=None):  # normalised by step tokens
            tokens, mask = query_responses[mb, context_length:], response_mask[mb]
            # the teacher's logits, or where its output layer runs in chunks its last hidden states (the output layer
            # then runs a chunk of positions at a time, beside the student's), no grad, a chunk of rows at a time
            teacher_hidden = teacher_forward.chunked(teacher, tokens.numel())
            with torch.no_grad():
                teacher_out = teacher_outputs(teacher, teacher_forward, query_responses, context_length,
                                              mb.split(chunk), teacher_hidden, images)
            terms = functools.partial(token_terms, teacher=teacher, teacher_forward=teacher_forward,
                                      teacher_hidden=teacher_hidden, args=args)

            with micro_batches.accumulate():
                divergence, new_logprobs, teacher_logprobs, token_entropy = forward.map_logits(
                    policy, query_responses[mb], context_length, terms, teacher_out, tokens,
                    images=pv.row_images(images, mb))  # (b, R) each
                if args.loss == "gkd":
                    token_loss = divergence
                else:
                    micro = batch.subset(mb)  # sampled by vLLM: each token weighted by pi_old / pi_behaviour
                    for key, value in micro.importance_sampling_stats(micro.old_logprobs).items():
                        is_stats.setdefault(key, []).append(value)
                    token_loss = pg_token_loss(new_logprobs, micro.old_logprobs, teacher_logprobs, args.cliprange,
                                               micro.importance_weights(micro.old_logprobs))
                loss = token_loss.masked_fill(~mask, 0.0).sum() / max(tokens_per_micro_batch, 1.0)
                losses.append(micro_batches.backward(loss))  # normalised by the step's tokens: the losses add up
            teacher_kl.append(((new_logprobs.detach() - teacher_logprobs) * mask).sum())
            entropy.append((token_entropy * mask).sum())
        optimizer_step(torch.stack(losses), state, step)
        state.update(step=step, episode=state["episode"] + batch_size, nonfinite_skipped=optimizer_step.skipped,
                     prompts_seen=state["prompts_seen"] + batch_size)

        # 7. log (per-token means, averaged over processes), evaluate every eval_steps and after the last
        local_tokens = max(response_mask.sum().item(), 1)
        metrics = ru.reduce_metrics(accelerator, {  # each micro-batch's loss is its share of the global token mean
            "loss/distill": torch.stack(losses).mean(),
            "objective/entropy": torch.stack(entropy).sum() / local_tokens,
            "val/response_length": response_mask.sum(1).float().mean(), "val/on_policy": float(on_policy),
            "nonfinite/skipped": float(state["nonfinite_skipped"]),
            **({"objective/teacher_kl": torch.stack(teacher_kl).sum() / local_tokens} if on_policy else {}),
            **({"objective/scores": batch.scores.mean()} if on_policy and reward_sources.names else {}),
            **{key: torch.stack(values).mean() for key, values in is_stats.items()},
        })
        if on_policy:
            metrics.update(batch.metrics)
        metrics.update({**optimizer_step.metrics(), **meter.batch_metrics(
            query_responses, pad, batch.metrics if on_policy else None, episode=state["episode"])})
        if (args.eval_steps and step % args.eval_steps == 0) or step == num_total_batches:
            metrics.update(ev.evaluate_policy(sampler, data.held_out, logger, step))
        logger.log(metrics, step=step)

        # 8. checkpoints: periodic, and on SIGTERM / Ctrl-C on any process (then every process stops cleanly)
        if tl.checkpoint_or_stop(accelerator, args, output_dir, state, scheduler, stop, num_total_batches):
            sampler.close()
            logger.close()
            return

    # 9. final save
    sampler.close()
    tl.save_model(accelerator, policy, tokenizer, os.path.join(output_dir, "model"), merge_peft=args.merge_peft)
    logger.close(os.path.join(output_dir, "model"))


if __name__ == "__main__":
    ru.main_guard(main)
