"""The parts of a training loop every script repeats: the optimizer step (clip, finite check, step or skip or stop,
the LR schedule), the adaptive KL coefficient, checkpoints (written atomically, resumed exactly; periodic and on a
signal), the final save of the model. Collectives happen only where a docstring says so, and every process makes
them together.

Every script keeps its checkpointed state in one dict with the same keys: `step` (finished steps: rollout batches
in the RL scripts, optimizer steps in the others) and `nonfinite_skipped` (steps skipped by --skip_nonfinite); the
RL scripts add `episode` (completions trained on), `prompts_seen` (the data position) and `kl_coef` (the KL
coefficient: kl_coef in rloo/ppo, beta in grpo; it moves with --kl_target).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from plumbing import data_utils as du
from plumbing import metrics_log as ml
from plumbing import models, vision
from plumbing import run_utils as ru
from plumbing.errors import UserError, require_positive


@dataclass
class TrainFlags:
    """The run: its name and folder, logging, the optimizer step, evaluation and checkpoint cadence (every script)."""
    exp_name: Optional[str] = None
    """the name of this experiment (None = the script's file name)"""
    seed: int = 1
    """seed of the experiment (each process adds its index; a run repeats exactly)"""
    output_dir: Optional[str] = None
    """where metrics, checkpoints and the model go; None = runs/<run_name>, or the run folder of --resume_from"""
    track: bool = False
    """log to Weights & Biases as well as metrics.jsonl"""
    wandb_project: str = "policy-rlhf"
    """the wandb project name"""
    verbose: bool = False
    """show the libraries' own logs and progress bars (quiet by default: the run's own lines and bar only)"""
    learning_rate: float = 3e-6
    """AdamW learning rate (the peak of the schedule; it decays linearly to 0)"""
    per_device_train_batch_size: int = 8
    """rows per micro-batch (forward/backward) on each process (RL: completions; DPO: pairs; KTO: examples)"""
    gradient_accumulation_steps: int = 8
    """micro-batches accumulated into one optimizer step"""
    token_budget: Optional[int] = None
    """size micro-batches by length: as many rows as fit this many real tokens (prompt + completion) per forward,
    longest first, instead of per_device_train_batch_size rows; an optimizer step keeps per_device_train_batch_size x
    gradient_accumulation_steps rows per process (TRL AsyncGRPO's name; pairs with --padding_free)"""
    max_steps: Optional[int] = None
    """stop after this many steps (RL: rollout batches; DPO/KTO: optimizer steps); the lr schedule ends there"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    skip_nonfinite: bool = False
    """skip (and count) a step whose loss or gradient norm is not finite, instead of checkpointing and stopping"""
    eval_steps: int = 0
    """evaluate before training, every this many steps, and after the last step (0 = before and after only)"""
    num_samples_printed: int = 4
    """evaluation samples printed per evaluation"""
    save_steps: int = 0
    """write a resumable checkpoint every this many steps (0 = none)"""
    resume_from: Optional[str] = None
    """checkpoint folder to resume from, exactly (data order, RNG, optimizer, schedule)"""

    def check(self) -> None:
        """One-line errors before anything loads."""
        require_positive(self, "learning_rate", "max_grad_norm", "per_device_train_batch_size",
                         "gradient_accumulation_steps", "max_steps", "token_budget")
        if self.token_budget and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            raise UserError("--token_budget varies the micro-batches per step, but DeepSpeed's engine fixes their "
                            "count at start: leave --token_budget out under DeepSpeed")
        for name in ("eval_steps", "save_steps"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class EpochFlags:
    """Passes over a fixed dataset (sft, reward, dpo, kto): epochs, warmup, weight decay, lengths, evaluation batch."""
    num_train_epochs: float = 1.0
    """passes over the training data (fractional allowed); sets the learning-rate schedule"""
    warmup_ratio: float = 0.0
    """fraction of the steps with a linear warmup of the learning rate (then linear decay to 0)"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_length: int = 640
    """prompt + completion tokens in training, completions cut from the right (a default is lowered to fit the model)"""
    per_device_eval_batch_size: int = 8
    """held-out rows (pairs, examples or prompts) per evaluation forward on each process"""

    def check(self) -> None:
        require_positive(self, "num_train_epochs", "per_device_eval_batch_size")
        if not 0 <= self.warmup_ratio < 1 or self.weight_decay < 0:
            raise UserError(f"need 0 <= --warmup_ratio < 1 and --weight_decay >= 0, got {self.warmup_ratio} and "
                            f"{self.weight_decay}")
        if not 1 <= (getattr(self, "max_prompt_length", None) or 1) < self.max_length:
            raise UserError(f"need 1 <= --max_prompt_length < --max_length, got {self.max_prompt_length} and "
                            f"{self.max_length}")


@dataclass
class KLControlFlags:
    """The adaptive KL controller (Ziegler et al. 2019, `adaptive_kl_coef`) of the RL scripts' KL coefficient."""
    kl_target: Optional[float] = None
    """adaptive KL controller target (sequence KL to the reference, nats); None = a fixed coefficient"""
    kl_horizon: int = 10_000
    """adaptive KL controller horizon in episodes"""

    def check(self) -> None:
        require_positive(self, "kl_target", "kl_horizon")


@contextlib.contextmanager
def atomic_dir(path: str):
    """Yield a temporary sibling folder to write into; on success it replaces `path` in one rename, so a
    reader never sees a half-written folder. On failure the temporary folder is removed."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = f"{path}.old-{os.getpid()}"
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save_model(accelerator, model: nn.Module, tokenizer, path: str, merge_peft: bool = False,
               submodule: Optional[str] = None) -> None:
    """Save `model` (+ tokenizer) to `path` atomically, safetensors, loadable by `from_pretrained`.
    `model` is the object given to `accelerator.prepare` (under ZeRO-3 its shards are gathered); `submodule`
    names a child to save on its own (e.g. "policy" of a policy+value wrapper). A PEFT model saves its adapter;
    with `merge_peft` the merged full weights are saved instead. A vision-language model's folder keeps its processor
    (the image processor with the tokenizer), so it loads as it was given."""
    if accelerator is not None:
        accelerator.wait_for_everyone()
        state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards on the main process
        is_main = accelerator.is_main_process
    else:
        state_dict, is_main = None, True
    if not is_main:
        return
    base = models.unwrap(model)
    if submodule is not None:
        base = getattr(base, submodule)
        if state_dict is not None:
            state_dict = {k[len(submodule) + 1:]: v for k, v in state_dict.items() if k.startswith(submodule + ".")}
    with atomic_dir(path) as tmp:
        if merge_peft and hasattr(base, "merge_and_unload"):
            merged = copy.deepcopy(base).merge_and_unload()
            merged.save_pretrained(tmp, safe_serialization=True)
        else:
            base.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        vision.save_processor(getattr(models.causal_lm(base), "config", None), tmp)


def save_checkpoint(accelerator, path: str, extra_state: dict, scheduler=None, extra_files=None) -> None:
    """Atomically write a resumable checkpoint: accelerate state (model weights as safetensors, optimizer, RNG
    states of every process) plus `extra_state` (step, data position, ...) and the LR scheduler's state as
    JSON in trainer_state.json (JSON, not pickle: resuming never unpickles objects). extra_files(folder): called on
    every process to write its own files into the checkpoint (e.g. run_ahead.py's pending batches)."""
    if scheduler is not None:
        extra_state = {**extra_state, "_scheduler": _jsonable(scheduler.state_dict())}
    accelerator.wait_for_everyone()
    path = os.path.abspath(path)
    tmp = f"{path}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp, safe_serialization=True)
    if extra_files is not None:
        extra_files(tmp)
    accelerator.wait_for_everyone()  # every rank's RNG file is in tmp before the rename
    if accelerator.is_main_process:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(extra_state, f)
        old = f"{path}.old"
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def stop_on_nonfinite(accelerator, output_dir: str, step: int, state: dict, scheduler=None, **values) -> None:
    """Write `state` (the one before this step) to <output_dir>/checkpoint-nonfinite and stop with one line naming
    the step and `values` (e.g. loss, grad norm). Every process calls it together, after `all_finite` said no."""
    save_checkpoint(accelerator, os.path.join(output_dir, "checkpoint-nonfinite"), state, scheduler)
    shown = ", ".join(f"{name.replace('_', ' ')} {ml.to_float(value)}" for name, value in values.items())
    raise UserError(f"non-finite {shown} at step {step}; the state before it is in {output_dir}/checkpoint-nonfinite "
                    "(--skip_nonfinite skips such steps)")


@contextlib.contextmanager
def checkpoint_on_error(error_type, accelerator, output_dir: str, state: dict, scheduler=None):
    """Run the block; if it raises `error_type` (an error every process raises together, e.g. a reward function's),
    first keep the finished steps: `state` (that of the last finished step, `state["step"]` > 0) goes to
    <output_dir>/checkpoint-<step>, named in a note, then the error propagates."""
    try:
        yield
    except error_type:
        if state["step"] > 0:
            path = os.path.join(output_dir, f"checkpoint-{state['step']}")
            save_checkpoint(accelerator, path, state, scheduler)
            accelerator.print(f"note: the {state['step']} finished step(s) are in {path} (--resume_from it)")
        raise


def load_checkpoint(accelerator, path: str, scheduler=None) -> dict:
    """Restore what `save_checkpoint` wrote (into the prepared model/optimizer and `scheduler`); returns its
    `extra_state`. Tensors load through safetensors / torch.load(weights_only=True) inside accelerate."""
    state_file = os.path.join(path, "trainer_state.json")
    if not os.path.exists(state_file):
        raise UserError(f"--resume_from {path!r} is not a checkpoint (no trainer_state.json)")
    accelerator.load_state(path)
    with open(state_file) as f:
        state = json.load(f)
    scheduler_state = state.pop("_scheduler", None)
    if scheduler is not None:
        if scheduler_state is None:
            raise UserError(f"checkpoint {path!r} holds no LR scheduler state")
        scheduler.load_state_dict(scheduler_state)
    return state


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else None


class StopSignal:
    """Turn SIGTERM / Ctrl-C into a flag the training loop checks between steps (`agreed`), so it can write a
    checkpoint and exit cleanly instead of dying mid-step."""

    def __init__(self):
        self.received = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def agreed(self, accelerator) -> bool:
        """True when any process received a signal (one all-reduce, every process once per step): all processes
        then write the (collective) checkpoint and stop together."""
        flag = torch.tensor([float(self.received is not None)], device=accelerator.device)
        if accelerator.num_processes > 1:
            flag = accelerator.reduce(flag, reduction="max")
        return bool(flag.item())



def start_or_resume(args, accelerator, model, optimizer, scheduler, output_dir: str, state: dict):
    """The start of every script's training: `state` (its fresh state dict) updated in place from --resume_from's
    checkpoint when there is one (the weights, optimizer, schedule and every process's RNG restored with it), the
    run's metrics logger (a resumed run keeps its rows up to the checkpoint's step) and its OptimizerStep.
    Returns (logger, optimizer_step)."""
    if args.resume_from:
        state.update(load_checkpoint(accelerator, args.resume_from, scheduler))
    logger = ml.run_logger(args, accelerator, output_dir, resume_step=state["step"] if args.resume_from else None)
    return logger, OptimizerStep(accelerator, model, optimizer, scheduler, args, output_dir,
                                 skipped=state["nonfinite_skipped"])

class OptimizerStep:
    """The end of every optimizer step, the same in every script: clip the accumulated gradients to
    --max_grad_norm, check that the loss and the gradient norm are finite on every process (one all-reduce), then
    step the optimizer, or skip the step and count it (--skip_nonfinite), or write checkpoint-nonfinite and stop with
    the step named. The LR schedule moves one step either way: its unit is the optimizer step in every script (as
    TRL's), so the learning rate depends only on the optimizer steps taken, however a batch is split into epochs,
    mini-batches and micro-batches. Then the gradients are zeroed. `lr` is the rate the last step used, `skipped`
    the steps skipped so far (a resumed run starts from its checkpoint's count). Under --fp16 the gradients are
    unscaled before the clip, and a step whose gradients overflowed at the current loss scale (a finite loss) is the
    scaler's to skip (it halves the scale), counted in `overflows`, not an error."""

    def __init__(self, accelerator, model, optimizer, scheduler, args, output_dir: str, skipped: int = 0):
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.max_grad_norm, self.skip_nonfinite, self.output_dir = args.max_grad_norm, args.skip_nonfinite, output_dir
        self.skipped, self.lr = skipped, scheduler.get_last_lr()[0]
        self.scaler, self.overflows = accelerator.scaler, 0

    def metrics(self) -> dict:
        """lr (the rate the last step used); under --fp16 fp16/loss_scale and fp16/overflow_skipped (steps whose
        gradients overflowed at the scale then, so far in this process's run)."""
        if self.scaler is None:
            return {"lr": self.lr}
        return {"lr": self.lr, "fp16/loss_scale": self.scaler.get_scale(), "fp16/overflow_skipped": self.overflows}

    def __call__(self, loss, state: dict, step: int):
        """`loss`: this process's loss (a number or tensor, e.g. the accumulated micro-batches' stacked); `state`: the
        run's state before this step (what checkpoint-nonfinite holds); `step`: the step's number, for the message.
        Every process calls this together. Returns the gradient norm (None under DeepSpeed, which clips itself)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer.optimizer)
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if ru.all_finite(self.accelerator, loss, grad_norm):
            self.optimizer.step()
        elif self.scaler is not None and ru.all_finite(self.accelerator, loss):
            self.optimizer.step()  # the scaler finds the overflow, skips the update and halves the scale
            self.overflows += 1
        elif self.skip_nonfinite:
            self.skipped += 1
        else:
            self.optimizer.zero_grad()
            stop_on_nonfinite(self.accelerator, self.output_dir, step, state, self.scheduler, loss=loss,
                              grad_norm=grad_norm)
        self.lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.optimizer.zero_grad()
        return grad_norm


def adamw_linear_decay(model: nn.Module, learning_rate: float, num_steps: int, eps: float = 1e-5,
                       weight_decay: float = 0.0):
    """The RL scripts' optimizer and schedule: AdamW over `model`'s trainable parameters, its rate decaying linearly
    from learning_rate to 0 over num_steps optimizer steps. Returns (optimizer, scheduler); give the optimizer to
    accelerate.prepare, not the scheduler (accelerate would step it once per process; checkpoints carry it as JSON)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate, eps=eps,
                                  weight_decay=weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1.0 - s / num_steps))


def adaptive_kl_coef(kl_coef: float, current_kl: float, n_episodes: int, target: Optional[float], horizon: int):
    """The next KL coefficient (Ziegler et al. 2019), the same controller for every RL script: unchanged when
    `target` is None, else kl_coef * (1 + clip(KL / target - 1, -0.2, 0.2) * n_episodes / horizon). Each step moves it
    by at most 0.2 * n_episodes / horizon of itself: a horizon of a few steps' episodes holds the KL near the
    target."""
    if target is None:
        return kl_coef
    proportional_error = min(max(current_kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + proportional_error * n_episodes / horizon)


def checkpoint_or_stop(accelerator, args, output_dir: str, state: dict, scheduler, stop: StopSignal,
                       total_steps: int, extra_files=None) -> bool:
    """After step `state["step"]`: write checkpoint-<step> every --save_steps steps, and when a stop signal reached
    any process before the last step (one all-reduce: every process calls this once per step). Returns True when the
    run should stop now (the checkpoint is written; the caller closes its logger and returns). extra_files: as
    `save_checkpoint`'s."""
    step = state["step"]
    stopping = stop.agreed(accelerator) and step < total_steps  # at the last step: finish normally
    if (args.save_steps and step % args.save_steps == 0) or stopping:
        save_checkpoint(accelerator, os.path.join(output_dir, f"checkpoint-{step}"), dict(state), scheduler,
                        extra_files)
    if stopping:
        accelerator.print(f"{stop.received or 'a stop signal'} received: checkpoint-{step} written, stopping "
                          "(--resume_from it)")
    return stopping


# ---------------------------------------------------------------------------------------------------------
# The offline scripts (sft, reward, dpo, kto): lengths fitted before any model loads; passes over a fixed dataset
# ---------------------------------------------------------------------------------------------------------
def fit_lengths(args, tokenizer, model_path: str, prompts, held_out_prompts=(), tools=None,
                cut_held_out: bool = False) -> list:
    """The offline scripts' lengths, fitted to the data and to the positions of the model at `model_path` (from its
    config: ru.model_positions) before any model loads (ru.fit_length: a default is lowered with a note, a value given
    on the command line that does not fit is a UserError):
    1. --max_length into the model's positions;
    2. --max_prompt_length, when None, from the data: the longest of `prompts` (text or messages rendered with the chat
       template and tools[i] when given, or vision.ImageSource; others are skipped here, tokenising the rows fails on
       them) and `held_out_prompts`; then lowered to leave one completion token of --max_length;
    3. the held-out prompts (completed greedily at each evaluation) as token ids: a prompt longer than
       --max_prompt_length is a UserError (du.tokenize_prompts), or with `cut_held_out` (kto.py) keeps its last
       --max_prompt_length tokens (prompts with images are never cut);
    4. --response_length, when there are held-out prompts (with `cut_held_out`: always), into the positions the longest
       of them leaves (with `cut_held_out`: the positions --max_prompt_length leaves).
    Returns the held-out prompts' token ids."""
    positions = ru.model_positions(model_path, args.trust_remote_code)
    ru.fit_length(args, "max_length", positions, "the model's max_position_embeddings")
    if args.max_prompt_length is None:
        tools = [None] * len(prompts) if tools is None else tools
        texts = {du.render_prompt(tokenizer, prompt, prompt_tools)
                 for prompt, prompt_tools in [*zip(prompts, tools), *((p, None) for p in held_out_prompts)]
                 if isinstance(prompt, str) or du.is_conversational(prompt)}
        ids = tokenizer(sorted(texts), add_special_tokens=False)["input_ids"] if texts else []
        ids += [p.prompt_ids() for p in [*prompts, *held_out_prompts] if isinstance(p, vision.ImageSource)]
        args.max_prompt_length = max((len(prompt_ids) for prompt_ids in ids), default=1)
    ru.fit_length(args, "max_prompt_length", args.max_length - 1,
                  f"one completion token of --max_length {args.max_length}")
    if held_out_prompts and isinstance(held_out_prompts[0], vision.ImageSource):  # never cut: refused when longer
        held_out, longest = [p.prompt_ids(args.max_prompt_length) for p in held_out_prompts], args.max_prompt_length
    elif cut_held_out:
        held_out = [ids[-args.max_prompt_length:] for ids in du.tokenize_prompts(tokenizer, held_out_prompts)]
        longest = args.max_prompt_length
    else:
        held_out = du.tokenize_prompts(tokenizer, held_out_prompts, args.max_prompt_length)
        longest = max((len(ids) for ids in held_out), default=None)
    if longest is not None:
        ru.fit_length(args, "response_length", None if positions is None else positions - longest,
                      f"held-out prompts of up to {longest} tokens in the model's {positions} positions")
    return held_out


def process_items(batch_index: list, accelerator) -> list:
    """This process's items of an optimizer step's items `batch_index` (every process's, in order), its micro-batches
    one after another (acc.MicroBatches splits them): micro-batch m of process p is the (m x processes + p)-th slice
    of len(batch_index) / (processes x accumulation steps) items, so that the step's items and their order are the
    same for any number of processes."""
    world, steps = accelerator.num_processes, accelerator.gradient_accumulation_steps
    size = len(batch_index) // (world * steps)
    return [i for m in range(steps) for i in batch_index[(m * world + accelerator.process_index) * size:][:size]]


class EpochLoop:
    """The passes over a fixed training set of the offline scripts (sft, reward, dpo, kto): `num_items` items (rows;
    kto.py: micro-batches of examples), `batch_size` of them (every process's) per optimizer step. An epoch is
    steps_per_epoch = num_items // batch_size steps (the remainder is left out); the run is --num_train_epochs of them
    (at least one step), at most --max_steps: `total_steps`. Epoch e visits the items in du.epoch_permutation(num_items,
    --seed, e), the same on every process, so a step's items depend on its number alone and a resumed run continues
    the same order. Also the learning-rate schedule, the metrics every step logs and when to evaluate."""

    def __init__(self, args, num_items: int, batch_size: int, unit: str, rows_per_item: int = 1,
                 per_step_time: bool = False):
        """`unit`: what time/<unit>_per_second counts, `rows_per_item` of them per item; `per_step_time` (kto.py): time
        each step alone (time/step_seconds) instead of the run since it (or its resume) started (time/elapsed)."""
        self.num_items, self.batch_size, self.seed, self.eval_steps = num_items, batch_size, args.seed, args.eval_steps
        self.steps_per_epoch = num_items // batch_size
        if self.steps_per_epoch == 0:
            world = batch_size // (args.per_device_train_batch_size * args.gradient_accumulation_steps)
            raise UserError(f"{num_items} training {unit} are fewer than one batch of {batch_size} (per_device_train_"
                            f"batch_size {args.per_device_train_batch_size} x {world} processes x "
                            "gradient_accumulation_steps)")
        total_steps = max(1, int(self.steps_per_epoch * args.num_train_epochs))
        self.total_steps = min(total_steps, args.max_steps) if args.max_steps else total_steps
        self.warmup_steps = math.ceil(args.warmup_ratio * self.total_steps)
        self.unit, self.rows_per_step, self.per_step_time = unit, batch_size * rows_per_item, per_step_time
        self.order = (None, [])  # (epoch, its permutation)

    def scheduler(self, optimizer):
        """The learning rate's schedule, stepped once per optimizer step: linear warmup over ceil(--warmup_ratio x
        total_steps) steps, then linear decay to 0 at total_steps (transformers' "linear"). Not for
        accelerator.prepare, which would step it on every process; checkpoints carry its state."""
        from transformers import get_scheduler  # transformers loads slowly: only when a script needs it

        return get_scheduler("linear", optimizer, num_warmup_steps=self.warmup_steps,
                             num_training_steps=self.total_steps)

    def steps(self, start_step: int):
        """The steps still to run, start_step + 1 .. total_steps (numbered from 1); time/* counts from here."""
        self.start_time, self.start_step = time.time(), start_step
        for step in range(start_step + 1, self.total_steps + 1):
            self.step_start = time.time()
            yield step

    def batch_index(self, step: int) -> list:
        """The items of step `step` (numbered from 1): the next batch_size of its epoch's permutation."""
        epoch, position = divmod(step - 1, self.steps_per_epoch)
        if self.order[0] != epoch:
            self.order = (epoch, du.epoch_permutation(self.num_items, self.seed, epoch))
        return self.order[1][position * self.batch_size:(position + 1) * self.batch_size]

    def metrics(self, step: int, optimizer_step: OptimizerStep) -> dict:
        """What every step logs besides the algorithm's own: lr, epoch (passes so far, fractional), nonfinite/skipped,
        and time/elapsed and time/<unit>_per_second since the loop started (per_step_time: time/step_seconds and
        time/<unit>_per_second of this step); under --fp16 the loss scale (OptimizerStep.metrics)."""
        metrics = {**optimizer_step.metrics(), "epoch": step / self.steps_per_epoch,
                   "nonfinite/skipped": optimizer_step.skipped}
        if self.per_step_time:
            seconds = time.time() - self.step_start
            return {**metrics, "time/step_seconds": seconds,
                    f"time/{self.unit}_per_second": self.rows_per_step / seconds}
        seconds = time.time() - self.start_time
        return {**metrics, "time/elapsed": seconds,
                f"time/{self.unit}_per_second": (step - self.start_step) * self.rows_per_step / seconds}

    def evaluate_now(self, step: int) -> bool:
        """Evaluate after step `step`? Every --eval_steps steps (0: never in between) and after the last."""
        return step == self.total_steps or bool(self.eval_steps and step % self.eval_steps == 0)


def gather_in_order(items: list, compute, accelerator) -> torch.Tensor:
    """compute(share) -> a tensor with one row per item of `share`, run on this process's even share of `items`
    (ru.even_share: every process makes the same model calls); every process's rows gathered (one collective) and put
    back in the order of `items`: (len(items), ...) on every process. E.g. reference log-probs computed once."""
    share, _ = ru.even_share(items, accelerator)
    rows = accelerator.gather(compute(share))  # (processes x len(share), ...): process 0's rows, then process 1's...
    rows = rows.view(accelerator.num_processes, len(share), *rows.shape[1:]).transpose(0, 1)  # share position-major
    return rows.reshape(-1, *rows.shape[2:])[:len(items)]
