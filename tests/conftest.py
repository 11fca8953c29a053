"""Shared test fixtures: the toy world (built once, cached), runners for the scripts (as subprocesses, and in this
process for runs that stop early with a usage error), and the fast tier.

The fast tier (`python -m pytest -m "not slow"`) leaves out every test that starts a process (a script run, a
2-process launch, a benchmark, a vLLM engine) or uses a fixture or helper that does, found from their source at
collection time (so a new test lands in the right tier without a marker); `tests/test_smoke.py`'s one tiny run per
script is kept in (`@pytest.mark.fast`). `@pytest.mark.slow` marks any other test as slow by hand."""

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
def fresh_toy_run(tmp_path_factory):
    """A new user's first `python rloo.py` (10 steps), on a machine without the toy world: built by that run into an
    empty cache. Returns (the CompletedProcess, the run's output folder, the cache folder). Shared by the test of
    what the run prints and the test that a second build equals the first byte for byte (one build, not two)."""
    tmp = tmp_path_factory.mktemp("fresh_toy")
    out, cache = str(tmp / "run"), str(tmp / "cache")
    proc = run_script("rloo.py", "--max_steps", "10", "--eval_steps", "5", "--num_eval_prompts", "16",
                      "--output_dir", out, env={"TOY_TASK_CACHE": cache})
    return proc, out, cache


def script_env(threads: int = 2) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               WANDB_MODE="disabled", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    return env


def run_script(script: str, *args: str, check: bool = True, threads: int = 2, timeout: int = 600,
               env: dict | None = None):
    """Run `python <script> <args>` from the repository root (`env`: variables over script_env's); returns the
    CompletedProcess (text output)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT,
                          env={**script_env(threads), **(env or {})}, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_script_in_process(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run `script`'s main() through run_utils.main_guard in this process, with sys.argv as `python <script> <args>`
    sets it; returns a CompletedProcess (returncode: the exit code; stdout, stderr). For runs that stop early with a
    usage error (exit 2): a fresh process spends ~6 s importing torch and transformers, this process once. An
    unexpected exception propagates (the test fails with its traceback). The random generators and the SIGTERM /
    SIGINT handlers (a run installs its own) are restored after."""
    import contextlib
    import importlib
    import io
    import random
    import signal

    import numpy as np
    import torch

    from plumbing import run_utils

    module = importlib.import_module(script.removesuffix(".py"))
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    argv, sys.argv = sys.argv, [os.path.join(ROOT, script), *args]
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_utils.main_guard(module.main)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())


def read_metrics(output_dir: str) -> list:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


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
