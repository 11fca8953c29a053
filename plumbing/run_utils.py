"""Run plumbing shared by the algorithm scripts: arguments and model aliases, the usage-error guard, lengths fitted
to the model, the accelerator and seeding, the run folder, and agreement between processes (even shares, global
means, finite checks). Nothing here is algorithm logic, and nothing here computes with a model. Data is
data_utils.py, metrics and what a run prints metrics_log.py, checkpoints and the optimizer step train_loop.py.

Collectives (work that every process must do together) happen only in the functions that say so, each called
once per step by every process, never a number of times that depends on one process's data.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import inspect
import math
import os
import random
import re
import sys
import time
import typing
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

import policy_common as pc
from plumbing import data_utils as du
from plumbing import metrics_log as ml
from plumbing import models, vision
from plumbing.errors import UserError

# Model aliases: short names for the public TL;DR checkpoints behind the published RLOO/PPO/DPO runs (Huang et al.
# 2024, "The N+ Implementation Details of RLHF with PPO"; TRL documentation); `toy` is the toy task's.
MODEL_ALIASES = {  # alias -> (SFT policy, reward model, dataset alias)
    f"pythia-{size}": (f"cleanrl/EleutherAI_pythia-{size}-deduped__sft__tldr",
                       f"cleanrl/EleutherAI_pythia-{size}-deduped__reward__tldr", "tldr")
    for size in ("1b", "2.8b", "6.9b")
}


def resolve_model(name: str) -> str:
    """`--model` / `--ref_model` -> a hub id or local folder: `toy` / `toy_hard` build (or reuse) that toy world's
    SFT policy, `pythia-1b|2.8b|6.9b` name the TL;DR SFT checkpoints; anything else is returned unchanged."""
    if name in du.TOY_WORLDS:
        return du.toy_world(name)["policy"]
    if name == du.TOY_TOOLS_ALIAS:
        return du.toy_tools_world()["policy"]
    if name == du.TOY_VISION_ALIAS:
        return du.toy_vision_world()["policy"]
    return MODEL_ALIASES[name][0] if name in MODEL_ALIASES else name


def reference_from_flags(args, policy, tokenizer, policy_path: str, accelerator, forwards,
                         reference_free: bool = False) -> pc.Reference:
    """`policy_common.create_reference` from a script's flags: --ref_model (an alias resolved as --model's),
    --use_peft, --bf16 / --fp16 / --cast_lm_head_to_fp32, --trust_remote_code; the reference's forward chosen from
    the run's `forwards` (forwards.py)."""
    return pc.create_reference(policy, tokenizer, forwards.lm, policy_name=policy_path, use_peft=args.use_peft,
                               ref_model=resolve_model(args.ref_model) if args.ref_model else None,
                               reference_free=reference_free, accelerator=accelerator,
                               precision=models.Precision.from_args(args),
                               trust_remote_code=args.trust_remote_code)


def resolve_reward_model(name: str) -> str:
    """`--reward_model` -> a hub id or local folder (`toy`, `toy_hard`: that world's reward model; `pythia-*`:
    TL;DR's)."""
    if name in du.TOY_WORLDS:
        return du.toy_world(name)["reward"]
    return MODEL_ALIASES[name][1] if name in MODEL_ALIASES else name


def default_reward_model(model: str) -> str:
    """The reward model paired with a `--model` alias (toy -> toy RM, pythia-1b -> its TL;DR RM)."""
    if model in du.TOY_WORLDS or model in MODEL_ALIASES:
        return model
    if model in (du.TOY_TOOLS_ALIAS, du.TOY_VISION_ALIAS):
        raise UserError(f"--model {model} has no reward model: its reward is the verifiable gold score "
                        "(--reward_funcs gold)")
    raise UserError(f"--reward_model is required when --model is {model!r} (no paired reward model is known)")


def default_teacher(model: str) -> str:
    """The teacher paired with a `--model` alias (toy, toy_hard, toy_vision -> that toy world's teacher)."""
    if model in (*du.TOY_WORLDS, du.TOY_VISION_ALIAS):
        return model
    raise UserError(f"--teacher_model is required when --model is {model!r} (no paired teacher is known)")


def resolve_teacher(name: str) -> str:
    """`--teacher_model` -> a hub id or local folder (`toy`, `toy_hard`, `toy_vision`: that toy world's teacher, built
    on first use)."""
    return du.toy_teacher(name) if name in (*du.TOY_WORLDS, du.TOY_VISION_ALIAS) else name


def default_dataset(model: str) -> str:
    """The dataset paired with a `--model` alias (toy -> toy, pythia-* -> tldr)."""
    if model in (*du.TOY_WORLDS, du.TOY_TOOLS_ALIAS, du.TOY_VISION_ALIAS):
        return model
    if model in MODEL_ALIASES:
        return MODEL_ALIASES[model][2]
    raise UserError(f"--dataset is required when --model is {model!r} (no paired dataset is known)")


_LOADED_FILES: Dict[str, object] = {}  # path -> module: a file named by several flags is imported once


# the toy worlds' modules sat at the root before the layout by role: specs written then (--tools toy_tools:lookup) work
MOVED_MODULES = {"toy_tools": "toy_worlds.toy_tools", "toy_task": "toy_worlds.toy_task"}


def load_object(spec: str, flag: str, alternatives: str = "") -> object:
    """`path/to/file.py:name` or `package.module:name` -> that object (a function, a class), for the flags that name
    user code (--reward_funcs, --tools, --environment). Anything that cannot be found or imported is a one-line
    UserError naming `flag`; a missing name is returned as None (the caller names what it expected)."""
    import importlib
    import importlib.util

    where, _, attribute = spec.rpartition(":")
    if not where or not attribute:
        raise UserError(f"{flag} {spec!r}: not {alternatives}path/to/file.py:name or package.module:name")
    if where.endswith(".py"):
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise UserError(f"{flag} {spec!r}: file {where!r} not found")
        if path not in _LOADED_FILES:
            module_spec = importlib.util.spec_from_file_location(
                f"{flag.strip('-')}_{os.path.basename(where)[:-3]}", path)
            module = importlib.util.module_from_spec(module_spec)
            try:
                module_spec.loader.exec_module(module)
            except Exception as e:
                raise UserError(f"{flag} {spec!r}: importing {where!r} raised {type(e).__name__}: "
                                f"{models.first_line(e)}") from None
            _LOADED_FILES[path] = module
        module = _LOADED_FILES[path]
    else:
        try:
            module = importlib.import_module(MOVED_MODULES.get(where, where))
        except Exception as e:
            raise UserError(f"{flag} {spec!r}: cannot import {where!r} ({type(e).__name__}: "
                            f"{models.first_line(e)})") from None
    return getattr(module, attribute, None)


def parse_args(args_cls, alias_defaults: Optional[Dict[str, dict]] = None, argv: Optional[List[str]] = None):
    """The script's `Args` from the command line: flat `--snake_case` flags, grouped in `--help` (`cli_class`).
    `alias_defaults` maps a `--model` alias (e.g. "toy") to tuned defaults for that alias; each applies only where the
    flag was not given on the command line, so the dataclass defaults stay those of the real-scale path. The flags
    given on the command line are kept in `args.given_flags` (not a field: not saved with the config) for
    `fit_length`. --exp_name defaults to the script's file name. Each flag group's `check` then runs: one-line
    UserErrors for bad values, before anything loads."""
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    parsed = tyro.cli(cli_class(args_cls), args=argv, use_underscores=True)
    own, *groups = [getattr(parsed, f.name) for f in dataclasses.fields(parsed)]
    values = {f.name: getattr(own, f.name) for f in dataclasses.fields(own)}  # the grouped ones at their defaults
    values.update({f.name: getattr(group, f.name) for group in groups for f in dataclasses.fields(group)})
    args = args_cls(**values)
    given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    given |= {name[3:] for name in given if name.startswith("no_")}
    # a flag given also drops the alias's values of the flags it replaces (ALIAS_REPLACES: --environment, the tools)
    replaced = given | {other for group in type(args).__mro__ for flag, others in
                        vars(group).get("ALIAS_REPLACES", {}).items() if flag in given for other in others}
    for field, value in (alias_defaults or {}).get(getattr(args, "model", None), {}).items():
        if field not in replaced:
            setattr(args, field, value)
    args.given_flags = frozenset(given)
    if getattr(args, "exp_name", "") is None:
        args.exp_name = os.path.splitext(os.path.basename(sys.modules[args_cls.__module__].__file__))[0]
    check_flags(args)
    quiet_libraries(getattr(args, "verbose", True))
    return args


def check_flags(args) -> None:
    """Each flag group `args` mixes in checks its own flags (its `check`: one-line UserErrors for bad values, before
    anything loads); the script's `validate` then checks the script's own."""
    for group in type(args).__mro__[1:]:
        if "check" in vars(group):
            group.check(args)


def cli_class(args_cls):
    """The dataclass tyro parses for `args_cls`: one field per flag group `args_cls` mixes in (its direct dataclass
    bases, e.g. TrainFlags) and one for the script's own flags, each shown as a group of `--help` with its docstring,
    their prefixes omitted so that every flag keeps its flat name. Every default is `args_cls`'s, a script's
    overrides of a group's defaults included."""
    import tyro

    defaults, types = args_cls(), typing.get_type_hints(args_cls, include_extras=True)
    groups = [base for base in args_cls.__bases__ if dataclasses.is_dataclass(base)]
    grouped = {f.name for group in groups for f in dataclasses.fields(group)}

    def default(cls):  # cls's fields at the script's defaults
        return lambda: cls(**{f.name: getattr(defaults, f.name) for f in dataclasses.fields(cls)})

    # the script's own flags: args_cls with the grouped ones hidden (tyro reads the help from args_cls' source)
    own = dataclasses.make_dataclass(args_cls.__name__, [
        (f.name, tyro.conf.Suppress[types[f.name]], dataclasses.field(default=getattr(defaults, f.name)))
        for f in dataclasses.fields(args_cls) if f.name in grouped], bases=(args_cls,))
    script = os.path.basename(sys.modules[args_cls.__module__].__file__)
    own.__doc__ = f"{script}'s own flags"
    fields = [(re.sub(r"\W", "_", script[:-len(".py")]) if cls is own else cls.__name__, tyro.conf.OmitArgPrefixes[cls],
               dataclasses.field(default_factory=default(cls))) for cls in (own, *groups)]
    return dataclasses.make_dataclass(f"{args_cls.__name__}Groups", fields)


def quiet_libraries(verbose: bool) -> None:
    """Unless `verbose`: transformers, datasets, huggingface_hub, accelerate and DeepSpeed log errors only and show no
    progress bars of their own (the run's own lines and bar say what happens). DeepSpeed, which accelerate imports
    anyway, is imported here with logging off: its import warns "Setting accelerator to CPU" on every CPU run."""
    if verbose:
        return
    import logging

    import datasets
    import huggingface_hub
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    logging.disable(logging.WARNING)
    try:
        from deepspeed.accelerator import get_accelerator

        get_accelerator()
    except Exception:  # DeepSpeed is optional at run time
        pass
    finally:
        logging.disable(logging.NOTSET)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


@contextlib.contextmanager
def main_in_this_process(argv: List[str]):
    """For a script's main() run inside another program (the tests' usage-error runs, benchmark/script_shape.py):
    within the block sys.argv is `argv`, as `python <script> <args>` sets it; after it, sys.argv, the random
    generators (Python's, numpy's, torch's) and the SIGTERM / SIGINT handlers (a run installs its own) are as
    before."""
    import signal

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    saved, sys.argv = sys.argv, list(argv)
    try:
        yield
    finally:
        sys.argv = saved
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def main_guard(main: Callable[[], None]) -> None:
    """Run `main()`; a `UserError` becomes a one-line message on stderr and exit code 2 (no traceback).
    A process of a multi-process run leaves with os._exit after running the exit handlers, skipping C++ teardown: DDP
    keeps the gloo group and its threads alive past destroy_process_group (torch 2.13), and tearing them down at
    exit aborted finished 2-process CPU runs now and then ("terminate called without an active exception", exit -6)
    after every file was written. A finished run first waits for every process and destroys the group; after a
    usage error, which may be this process's alone, no collective call is made."""
    code = 0
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        if code:
            sys.exit(code)
        return
    if code == 0:
        torch.distributed.barrier()  # the main process saves last; no process leaves before it is done
        torch.distributed.destroy_process_group()
    atexit._run_exitfuncs()  # e.g. wandb's and vLLM's clean-ups, which os._exit would skip
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fit_length(args, flag: str, room: Optional[int], why: str) -> int:
    """Fit the length flag `args.<flag>` into `room` positions (None = no limit) and return it. A default (or
    an alias's default) is lowered to fit, with a note; a value given on the command line that does not fit
    is a UserError naming the flag, the limit and `why` it is that."""
    value = getattr(args, flag)
    if room is None or value <= room:
        return value
    if room < 1 or flag in getattr(args, "given_flags", ()):
        raise UserError(f"--{flag} {value} does not fit: {why} leaves {max(room, 0)} positions")
    print(f"note: --{flag} lowered from {value} to {room} ({why})", flush=True)
    setattr(args, flag, room)
    return room


def model_config(name: str, trust_remote_code: bool = False):
    """The config of the model `name` (hub id or folder), without loading weights."""
    from transformers import AutoConfig

    return models.from_pretrained(AutoConfig, name, trust_remote_code=trust_remote_code)


def with_images(args, policy_path: str, name: str, *datasets) -> tuple:
    """The offline scripts' images, read once at setup: (the run's vision.Vision, from the first of `datasets`: None
    when it has no image column, a one-line error for a model that cannot take them; then each of `datasets` as
    du.with_images makes it: unchanged for text, its rows with their prompts' images otherwise)."""
    images = vision.Vision.from_data(policy_path, model_config(policy_path, args.trust_remote_code),
                                     datasets[0].column_names, name, args.trust_remote_code)
    return (images, *(du.with_images(data, images) for data in datasets))


def model_positions(name: str, trust_remote_code: bool = False) -> Optional[int]:
    """How many positions the model `name` (hub id or folder) attends to, from its config (no weights loaded):
    max_position_embeddings, or None when the config sets no limit."""
    return getattr(model_config(name, trust_remote_code), "max_position_embeddings", None)


# ---------------------------------------------------------------------------------------------------------
# Runs: seeding, run folder, metrics, saving, checkpoints
# ---------------------------------------------------------------------------------------------------------
def make_accelerator(args):
    """The run's Accelerator, accumulating --gradient_accumulation_steps micro-batches. On a machine without a GPU, a
    multi-process launch (torchrun or accelerate launch) runs real ranks over gloo; a DeepSpeed launch keeps its engine
    (ZeRO code paths run on a CPU too). Under --fp16 it carries the loss scaler (precision.py), which its backward,
    optimizer step and checkpoints then use. For a vision-language --model, DDP looks for parameters a step leaves
    without gradient (a vision tower's unused last norm: LLaVA reads CLIP's hidden states before it)."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    use_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    precision = models.Precision.from_args(args)
    if use_deepspeed and precision.dtype == "float16":
        raise UserError("--fp16 under DeepSpeed: its engine scales the loss itself; use --bf16")
    model = getattr(args, "model", None)
    unused = bool(model) and vision.is_vision_model(model_config(resolve_model(model), args.trust_remote_code))
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              cpu=not torch.cuda.is_available() and not use_deepspeed,
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=unused)])
    accelerator.scaler = precision.loss_scaler(accelerator.device)
    if precision.emulated():
        accelerator.print(precision.emulated())
    accelerator.print(f"[accelerate] {accelerator.distributed_type.value}, {accelerator.num_processes} process(es), "
                      f"device {accelerator.device}")
    return accelerator


def seed_everything(seed: int, process_index: int = 0) -> int:
    """Seed python, numpy and torch with seed + process_index (each process samples differently, runs
    repeat exactly). Returns the per-process seed."""
    local_seed = seed + process_index
    random.seed(local_seed)
    np.random.seed(local_seed % 2**32)
    torch.manual_seed(local_seed)
    return local_seed


def run_name(script: str, dataset: str, seed: int) -> str:
    """`<dataset>__<script>__<seed>__<unix time>`, as in CleanRL."""
    return f"{os.path.basename(dataset.rstrip('/'))}__{script}__{seed}__{int(time.time())}"


def output_dir(args, dataset: str, accelerator) -> str:
    """The run folder, the same on every process: `--output_dir` if given; else the folder that holds
    `--resume_from` (a resumed run continues in place); else runs/<run_name> with the main process's clock.
    A fresh run refuses a folder that already holds a run (metrics.jsonl) on every process together, before any
    process writes: the main process looks and tells the others (broadcasts: every process calls this once, at the
    same point)."""
    from accelerate.utils import broadcast_object_list

    if args.resume_from:
        return args.output_dir or os.path.dirname(os.path.abspath(args.resume_from))
    if args.output_dir:
        folder = args.output_dir
    else:
        folder = os.path.join("runs", broadcast_object_list([run_name(args.exp_name, dataset, args.seed)])[0])
    used = os.path.exists(os.path.join(folder, "metrics.jsonl")) if accelerator.process_index == 0 else None
    if broadcast_object_list([used])[0]:
        raise ml.used_folder_error(folder)
    return folder


# ---------------------------------------------------------------------------------------------------------
# Processes: even shares, global means, agreement. Each function here is called by every process the same
# number of times (once per step or evaluation), so the collectives inside always match.
# ---------------------------------------------------------------------------------------------------------
def even_share(items: Sequence, accelerator):
    """This process's share of `items` (every num_processes-th item, from its index), padded by repeating an
    item so that every process gets the same number: they then make the same model calls (DDP syncs buffers
    and ZeRO-3 gathers weights in every forward). Returns (mine, n_real): only mine[:n_real] count."""
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = list(items[rank::world])
    n_real, size = len(mine), -(-len(items) // world)
    return mine + [items[0]] * (size - n_real), n_real


@torch.no_grad()


def global_means(accelerator, sums: Dict[str, float], count: float) -> Dict[str, float]:
    """{name: sum over this process's items}, item count -> {name: sum over all processes / total count}
    (one all-reduce)."""
    keys = sorted(sums)
    totals = torch.tensor([float(sums[k]) for k in keys] + [float(count)], dtype=torch.float64,
                          device=accelerator.device)
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    return {k: v / max(totals[-1].item(), 1.0) for k, v in zip(keys, totals[:-1].tolist())}


def global_mean_std(values: torch.Tensor, accelerator=None):
    """(B,) values, NaN where none -> their mean and unbiased std over every process's (two all-reduces)."""
    scored = ~values.isnan()
    sums = torch.stack([values[scored].sum(), scored.sum().to(values.dtype)])
    sums = sums if accelerator is None else accelerator.reduce(sums, reduction="sum")
    squares = ((values[scored] - sums[0] / sums[1]) ** 2).sum()
    squares = squares if accelerator is None else accelerator.reduce(squares, reduction="sum")
    return sums[0] / sums[1], (squares / (sums[1] - 1).clamp(min=1)).sqrt()


def global_sum(accelerator, value: float) -> float:
    """The sum of `value` over all processes (one all-reduce)."""
    total = torch.tensor([float(value)], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, reduction="sum")
    return total.item()


def awaited(value):
    """`value`, or when it is awaitable (an async tool's, reward function's or environment method's result) its
    result, run to the end in an event loop of its own (asyncio.run takes a coroutine only, hence the wrapper)."""
    if not inspect.isawaitable(value):
        return value

    async def wait():
        return await value

    return asyncio.run(wait())


def is_finite(value) -> bool:
    """True for a finite number or tensor (all elements), and for None: the gradient norm that accelerate returns
    under DeepSpeed may be None (DeepSpeed clips, and steps, inside `accelerator.backward`)."""
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return math.isfinite(float(value))


def all_finite(accelerator, *values) -> bool:
    """True when every value (numbers, tensors, or None for a grad norm DeepSpeed keeps to itself) is finite on
    every process (one all-reduce): all processes then skip or stop together."""
    bad = torch.tensor([float(not all(is_finite(v) for v in values))], device=accelerator.device)
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, reduction="max")
    return not bad.item()


def reduce_metrics(accelerator, metrics: Dict[str, float]) -> Dict[str, float]:
    """Average a dict of scalars across processes (one all-reduce for the whole dict)."""
    if accelerator is None or accelerator.num_processes == 1:
        return {k: ml.to_float(v) for k, v in metrics.items()}
    keys = sorted(metrics)
    values = torch.tensor([float(ml.to_float(metrics[k])) for k in keys], device=accelerator.device)
    values = accelerator.reduce(values, reduction="mean")
    return dict(zip(keys, values.tolist()))
