"""Shared test fixtures: the toy world (built once, cached), runners for the scripts (as subprocesses: forked from an
interpreter that has imported the libraries, or a new `python`; and in this process for runs that stop early with a
usage error), runs several tests share (`shared_run`), and the fast tier.

The fast tier (`python -m pytest -m "not slow"`) leaves out every test that starts a process (a script run, a
2-process launch, a benchmark, a vLLM engine) or uses a fixture or helper that does, found from their source at
collection time (so a new test lands in the right tier without a marker); `tests/test_smoke.py`'s one tiny run per
script is kept in (`@pytest.mark.fast`). `@pytest.mark.slow` marks any other test as slow by hand."""

import contextlib
import inspect
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def toy():
    """Paths of the built toy world (builds it on first use, about a minute on 2 cores)."""
    from toy_worlds import toy_task

    return toy_task.build(verbose=False)


@pytest.fixture(scope="session")
def toy_hard():
    """Paths of the built harder toy world (`--model toy_hard`, toy_task.SETTINGS; builds it on first use, about 40 s
    on 2 cores), cached beside the toy world under $TOY_TASK_CACHE like it."""
    from toy_worlds import toy_task

    return toy_task.build(verbose=False, setting="toy_hard")


@pytest.fixture(scope="session")
def toy_teacher(toy):
    """Paths of the toy world's teacher (toy_task.build_teacher; builds it on first use, under a minute on 2 cores),
    cached beside the toy world under $TOY_TASK_CACHE like it."""
    from toy_worlds import toy_task

    return toy_task.build_teacher(verbose=False)


@pytest.fixture(scope="session")
def toy_tools_world():
    """Paths of the built toy tool world (toy_tools.py; builds it on first use, about 70 s on 2 cores), cached beside
    the toy world under $TOY_TASK_CACHE like it."""
    from toy_worlds import toy_tools

    return toy_tools.build(verbose=False)


@pytest.fixture(scope="session")
def toy_vision():
    """Paths of the built toy vision world (toy_vision.py: a tiny LLaVA answering questions about pictures; builds it on
    first use), cached beside the toy world under $TOY_TASK_CACHE like it."""
    from toy_worlds import toy_vision

    return toy_vision.build(verbose=False)


@pytest.fixture(scope="session")
def fresh_toy_run(tmp_path_factory):
    """A new user's first `python rloo.py` (10 steps), on a machine without the toy world: built by that run into an
    empty cache. Returns (the CompletedProcess, the run's output folder, the cache folder). Shared by the test of
    what the run prints and the test that a second build equals the first byte for byte (one build, not two)."""
    tmp = tmp_path_factory.mktemp("fresh_toy")
    out, cache = str(tmp / "run"), str(tmp / "cache")
    proc = run_script("rloo.py", "--max_steps", "10", "--eval_steps", "5", "--num_eval_prompts", "16",
                      "--output_dir", out, env={"TOY_TASK_CACHE": cache}, fresh=True)  # all a user sees
    return proc, out, cache


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """`shared_run(script, *args, processes=1)` -> (CompletedProcess, output folder): `python <script> <args>
    --output_dir <a new folder>` (on `processes` processes: run_distributed), run on the first call and shared for the
    session by every test that makes the same call: a run several tests or files check or compare their own run with
    (test_smoke.py's tiny runs are the plain runs of test_packing.py, test_chunked_head.py and test_accumulation.py).
    Tests only read its folder."""
    runs = {}

    def run(script: str, *args: str, processes: int = 1):
        key = (script, args, processes)
        if key not in runs:
            out = str(tmp_path_factory.mktemp("shared_" + os.path.basename(script).removesuffix(".py")) / "run")
            if processes == 1:
                runs[key] = run_script(script, *args, "--output_dir", out), out
            else:
                runs[key] = run_distributed(script, *args, "--output_dir", out, nproc=processes), out
        return runs[key]

    return run


TINY = {  # script -> flags keeping the held-out evaluation to a few items
    "sft.py": ["--num_eval_prompts", "8", "--max_eval_examples", "16"],
    "reward.py": ["--max_eval_pairs", "16"],
    "dpo.py": ["--num_eval_prompts", "8", "--max_eval_pairs", "16"],
    "kto.py": ["--num_eval_prompts", "8", "--num_eval_examples", "64"],
    "rloo.py": ["--num_eval_prompts", "8"],
    "grpo.py": ["--num_eval_prompts", "8"],
    "ppo.py": ["--num_eval_prompts", "8"],
    "distill.py": ["--num_eval_prompts", "8"],
}


def tiny_args(script: str) -> list:
    """The flags of `script`'s tiny run on the toy: 2 steps, evaluated before the first and after the last on a few
    held-out items (TINY). test_smoke.py checks that run; the tests of a flag that must not change the numbers
    (--padding_free, --logprob_chunk_tokens, --token_budget, --cache_implementation) compare theirs with it."""
    return ["--max_steps", "2", "--eval_steps", "0", *TINY[script]]


# rloo on 2 processes for 2 steps: the plain run test_packing.py and test_accumulation.py compare their flag's with
TWO_PROCESS_RLOO = ["--max_steps", "2", "--per_device_train_batch_size", "16", "--num_eval_prompts", "8"]


def script_env(threads: int = 2) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               WANDB_MODE="disabled", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    return env


def run_script(script: str, *args: str, check: bool = True, threads: int = 2, timeout: int = 600,
               env: dict | None = None, fresh: bool = False):
    """Run `python <script> <args>` from the repository root (`env`: variables over script_env's); returns the
    CompletedProcess (text output). The process is forked from a preloaded interpreter (`Preloaded`: the libraries
    imported, nothing of the project) unless `fresh`, a --use_vllm run, or an environment the preloaded interpreter
    was not started with: a new `python` then, as a user starts it."""
    env = {**script_env(threads), **(env or {})}
    argv = [os.path.join(ROOT, script), *args]
    preloaded = None if fresh or "--use_vllm" in args else Preloaded.get(threads, env)
    if preloaded is not None:
        proc = preloaded.run(argv, env, timeout)
    else:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


# The preloaded interpreter: a `python` that imports the libraries the scripts use (torch, transformers, accelerate,
# datasets, peft, ...: about 5 of a short run's 8 seconds on 2 cores), then forks a child per run. The child sets the
# run's environment, arguments, working folder, sys.path (the script's folder, then PYTHONPATH's) and output files,
# reseeds `random` and numpy's global generator from the OS as a new process does, runs the script as __main__
# (runpy), then exits as the interpreter does: non-daemon threads joined, atexit handlers run, the exit code of its
# SystemExit (1 and the traceback for an uncaught exception). Nothing of the project is imported before the fork.
PRELOADED = r"""
import atexit, json, os, runpy, signal, sys, threading, time, traceback
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
import numpy, torch, transformers, tokenizers, safetensors.torch, tyro, datasets, accelerate, peft
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
import transformers.generation.utils, transformers.models.gpt_neox.modeling_gpt_neox
from accelerate import Accelerator
BASE_PATH = list(sys.path)
requests, replies = os.fdopen(0, "r"), os.dup(1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)


def child(request):
    os.setpgid(0, 0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.close(replies)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[:] = [os.path.dirname(script)] + [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep)
                                               if p] + BASE_PATH
    import random
    random.seed()
    numpy.random.seed()
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            child(request)
        finally:
            os._exit(70)
    deadline, timed_out = time.monotonic() + request["timeout"], False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            timed_out = True
            os.killpg(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    code = os.waitstatus_to_exitcode(status)
    os.write(replies, (json.dumps({"returncode": code, "timed_out": timed_out}) + "\n").encode())
"""

# what a run may set that the preloaded libraries do not read at import (the project's own variables, wandb's: it is
# imported in the run); any other difference from the preloaded interpreter's environment gets a new `python`
RUN_ONLY_VARIABLES = ("TOY_TASK_CACHE", "PYTHONPATH", "PYTEST_CURRENT_TEST", "PROMPTS_LOG", "MARK_DIR", "WANDB_")


class Preloaded:
    """One preloaded interpreter per thread count (OMP_NUM_THREADS / MKL_NUM_THREADS are read at torch's import),
    started on first use with script_env's environment and stopped when the session ends."""
    started: dict = {}

    def __init__(self, threads: int):
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="preloaded-")
        self.env = {k: v for k, v in script_env(threads).items() if k != "PYTEST_CURRENT_TEST"}
        self.log = open(os.path.join(self.folder, "interpreter.log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-c", PRELOADED], cwd=ROOT, env=self.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.runs = 0

    @classmethod
    def get(cls, threads: int, env: dict):
        """The preloaded interpreter for `threads` if `env` differs from its environment only in RUN_ONLY_VARIABLES,
        else None."""
        preloaded = cls.started.get(threads)
        if preloaded is None or preloaded.proc.poll() is not None:
            preloaded = cls.started[threads] = cls(threads)
        if any(env.get(k) != preloaded.env.get(k) for k in set(env) | set(preloaded.env)
               if not k.startswith(RUN_ONLY_VARIABLES)):
            return None
        return preloaded

    def run(self, argv: list, env: dict, timeout: float) -> subprocess.CompletedProcess:
        self.runs += 1
        out, err = (os.path.join(self.folder, f"{self.runs}.{name}") for name in ("out", "err"))
        request = dict(argv=argv, env=env, cwd=ROOT, stdout=out, stderr=err, timeout=timeout)
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = json.loads(self.proc.stdout.readline())
        except (OSError, ValueError):  # the interpreter died (its log tells why): a new `python` for this run
            return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        with open(out) as f, open(err) as g:
            stdout, stderr = f.read(), g.read()
        os.remove(out)
        os.remove(err)
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, stdout, stderr)
        return subprocess.CompletedProcess([sys.executable, *argv], reply["returncode"], stdout, stderr)

    @classmethod
    def stop_all(cls):
        for preloaded in cls.started.values():
            preloaded.proc.stdin.close()
            preloaded.proc.wait(60)
            preloaded.log.close()
        cls.started.clear()


def pytest_sessionfinish(session, exitstatus):
    Preloaded.stop_all()


def run_distributed(script, *args, nproc=2, timeout=600):
    """`torchrun --standalone --nproc_per_node <nproc> <script> <args>` on the CPU (one thread per process: the two
    do not oversubscribe the two cores); returns the CompletedProcess, raises with its output's tail if it failed."""
    env = script_env(threads=1)
    env["ACCELERATE_USE_CPU"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_script_in_process(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run `script`'s main() through run_utils.main_guard in this process, with sys.argv as `python <script> <args>`
    sets it; returns a CompletedProcess (returncode: the exit code; stdout, stderr). For runs that stop early with a
    usage error (exit 2): a fresh process spends ~6 s importing torch and transformers, this process once. An
    unexpected exception propagates (the test fails with its traceback). The random generators and the SIGTERM /
    SIGINT handlers (a run installs its own) are restored after."""
    import importlib
    import io

    from plumbing import run_utils

    module = importlib.import_module(script.removesuffix(".py"))
    out, err, code = io.StringIO(), io.StringIO(), 0
    with run_utils.main_in_this_process([os.path.join(ROOT, script), *args]):
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                run_utils.main_guard(module.main)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())


def read_metrics(output_dir: str) -> list:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def without_wall_clock(rows: list) -> list:
    """metrics.jsonl rows without the keys that measure the machine (metrics_log.is_wall_clock: time/*, perf/*,
    *_seconds): what two runs of the same seed share."""
    from plumbing import metrics_log

    return [{k: v for k, v in row.items() if not metrics_log.is_wall_clock(k)} for row in rows]


def greedy_both(generator, model, tokenizer, queries, version):
    """Greedy completions of `queries` (8 new tokens) by a vLLM generator (engine or server) at weights `version`, and
    by HF generate on `model` in this process: (served, trainer)."""
    import policy_common as pc

    config = pc.make_generation_config(tokenizer, 8, greedy=True)
    served, _ = generator.generate(model, version, queries, config)
    trainer, _ = pc.batch_generation(model, queries, tokenizer.pad_token_id, tokenizer.eos_token_id, config,
                                     len(queries))
    return served, trainer


def perturbed_lora(base):
    """A LoRA of rank 4 around a copy of `base`, its adapter drawn at random (a trained-looking adapter: B is zero at
    initialisation), and a function that draws new adapter weights: (policy, perturb_adapter)."""
    import copy

    import torch

    from plumbing import models

    policy = models.add_lora(copy.deepcopy(base), r=4, alpha=8, dropout=0.0)

    def perturb_adapter():
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.3)

    perturb_adapter()
    return policy, perturb_adapter


def assert_same_numbers(got: dict, expected: dict, steps, keys, label: str = "") -> None:
    """Two runs' rows ({step: row}) that should agree to float rounding: each of `keys` that `got` logged at each of
    `steps` within rel 1e-4 (abs 1e-5) of `expected`'s."""
    for step in steps:
        for key in keys:
            if key in got[step]:
                assert got[step][key] == pytest.approx(expected[step][key], rel=1e-4, abs=1e-5), (label, step, key)


def run_two_processes(worker, *args) -> list:
    """Spawn `worker(rank, port, results, *args)` in two processes (a free local port for their gloo group);
    returns [results[0], results[1]], what each rank put in the shared `results` dict."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(port, results, *args), nprocs=2)
        return [results[0], results[1]]


@contextlib.contextmanager
def worker_accelerator(rank: int, port: int, **kwargs):
    """In a `run_two_processes` worker: one torch thread, the environment of rank `rank` of a 2-process gloo group on
    `port`, and an Accelerator on the CPU (`kwargs`: its arguments) for the block; the group destroyed after it."""
    import torch
    from accelerate import Accelerator

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", ACCELERATE_USE_CPU="1")
    accelerator = Accelerator(cpu=True, **kwargs)
    try:
        assert accelerator.num_processes == 2
        yield accelerator
    finally:
        torch.distributed.destroy_process_group()


STARTS_A_PROCESS = re.compile(r"\brun_script\(|\brun_two_processes\(|\brun_distributed\(|\bsubprocess\.|mp\.spawn\(|"
                              r"VLLMGenerator\(")  # a vLLM engine runs in a process of its own


def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _process_helpers(module) -> set:
    """Names of the module's own functions that start a process, directly or through another such function."""
    functions = {name: _source(f) for name, f in vars(module).items()
                 if inspect.isfunction(f) and f.__module__ == module.__name__}
    helpers = {name for name, source in functions.items() if STARTS_A_PROCESS.search(source)}
    while True:
        more = {name for name, source in functions.items() if name not in helpers
                and any(re.search(rf"\b{helper}\(", source) for helper in helpers)}
        if not more:
            return helpers
        helpers |= more


def _starts_a_process(function, helpers: set) -> bool:
    source = _source(function)
    return bool(STARTS_A_PROCESS.search(source)) or any(re.search(rf"\b{h}\(", source) for h in helpers)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of the fast tier (-m 'not slow'); set automatically for tests "
                                       "that start a process (conftest.py)")
    config.addinivalue_line("markers", "fast: in the fast tier although it starts a process (test_smoke.py)")


def pytest_collection_modifyitems(config, items):
    """Mark `slow` every test that starts a process, itself or through one of its fixtures, unless marked `fast`."""
    helpers = {}
    for item in items:
        if item.get_closest_marker("fast") or item.get_closest_marker("slow"):
            continue
        fixtures = [definition.func for definitions in item._fixtureinfo.name2fixturedefs.values()
                    for definition in definitions]
        for function in [item.function, *fixtures]:
            module = sys.modules.get(function.__module__)
            if module is not None and module.__name__ not in helpers:
                helpers[module.__name__] = _process_helpers(module)
            if _starts_a_process(function, helpers.get(function.__module__, set())):
                item.add_marker(pytest.mark.slow)
                break


# A real model family's chat template with tools, for the multi-turn tests (test_episodes.py, test_sft_tools.py)
QWEN_TEMPLATE = r"""
{%- if tools %}{{- '<|im_start|>system\n# Tools' }}{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '<|im_end|>\n' }}{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'user' %}{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
  {%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\n' + message.content }}
    {%- for call in message.tool_calls or [] %}
      {%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
      {{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson)
          + '}\n</tool_call>' }}
    {%- endfor %}{{- '<|im_end|>\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""


def char_tokenizer(template: str, eos_token: str, special_tokens=(), added_tokens=(), bos_token=None):
    """A tokenizer built here, offline: characters as tokens (printable ASCII and newline), `eos_token` and
    `special_tokens` special, `added_tokens` added (not special), `template` its chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["[PAD]", "[UNK]", "\n"] + [chr(c) for c in range(32, 127)]
    tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                        eos_token=eos_token, bos_token=bos_token,
                                        additional_special_tokens=list(special_tokens))
    tokenizer.add_tokens(list(added_tokens))
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def qwen_tokenizer():
    """Characters as tokens (printable ASCII and newline), <|im_start|> / <|im_end|> (EOS) special, <tool_call> and
    </tool_call> added tokens, the template above."""
    return char_tokenizer(QWEN_TEMPLATE, "<|im_end|>", ["<|im_start|>"], ["<tool_call>", "</tool_call>"])
