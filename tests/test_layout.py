"""The layout the README states: imports go one way, from the scripts down through the shared modules; no shared
module above about 500 lines; one import path for UserError."""

import ast
import glob
import os

import pytest

from conftest import ROOT

SCRIPTS = ["sft", "reward", "rloo", "ppo", "grpo", "dpo", "kto", "distill"]
LAYERS = [SCRIPTS, ["run_ahead", "greedy_eval"], ["rollout"],
          ["reward_sources", "vllm_generation", "train_loop", "episodes"], ["run_utils"],
          ["metrics_log", "data_utils"], ["policy_common"], ["models", "prompt_sharing", "chunked_head", "toy_tools"], ["toy_task"], ["errors"]]
LAYER = {module: depth for depth, modules in enumerate(LAYERS) for module in modules}


def project_imports(module: str) -> set:
    tree = ast.parse(open(os.path.join(ROOT, module + ".py")).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names & set(LAYER)


def test_every_module_has_a_layer():
    modules = {os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "*.py"))}
    assert modules == set(LAYER), modules ^ set(LAYER)


@pytest.mark.parametrize("module", sorted(LAYER))
def test_imports_go_down(module):
    upward = [name for name in project_imports(module) if LAYER[name] <= LAYER[module]]
    assert not upward, f"{module} imports {upward}, which are not below it"


@pytest.mark.parametrize("module", sorted(set(LAYER) - set(SCRIPTS) - {"toy_task", "toy_tools"}))
def test_shared_modules_stay_small(module):
    with open(os.path.join(ROOT, module + ".py")) as f:
        assert sum(1 for _ in f) <= 520


def test_user_error_has_one_import_path():
    for path in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "tests", "test_*.py")):
        if path == __file__:
            continue
        text = open(path).read()
        for other in ("pc.UserError", "ru.UserError", "from policy_common import UserError",
                      "from run_utils import UserError"):
            assert other not in text, f"{os.path.basename(path)}: {other} (UserError comes from errors)"
