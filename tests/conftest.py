"""Shared test fixtures: the toy world (built once, cached) and a runner for the scripts as subprocesses."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def toy():
    """Paths of the built toy world (builds it on first use, about a minute on 2 cores)."""
    import toy_task

    return toy_task.build(verbose=False)


def script_env(threads: int = 2) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               WANDB_MODE="disabled", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    return env


def run_script(script: str, *args: str, check: bool = True, threads: int = 2, timeout: int = 600):
    """Run `python <script> <args>` from the repository root; returns the CompletedProcess (text output)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, env=script_env(threads),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(output_dir: str) -> list:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


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
