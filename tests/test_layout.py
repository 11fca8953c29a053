"""The layout the README states, as rules (no list of names, so a copied script such as rloo_myidea.py passes):
the root holds runnable scripts and policy_common.py; the shared code lives in plumbing/, the toy worlds in
toy_worlds/; imports go one way (scripts -> policy_common and plumbing -> toy_worlds), with no cycle among the shared
modules and nothing policy_common builds on building on shared code itself; no shared module above 500 lines; one import
path for UserError."""

import ast
import glob
import os

import pytest
from conftest import ROOT

SHARED_ROOT_MODULE = "policy_common"
PACKAGES = ("plumbing", "toy_worlds")


def module_name(path: str) -> str:
    """plumbing/rollout.py -> plumbing.rollout; rloo.py -> rloo."""
    relative = os.path.relpath(path, ROOT)[:-len(".py")]
    return relative.replace(os.sep, ".")


ROOT_FILES = sorted(glob.glob(os.path.join(ROOT, "*.py")))
SCRIPTS = [module_name(p) for p in ROOT_FILES if module_name(p) != SHARED_ROOT_MODULE]
SHARED = [SHARED_ROOT_MODULE] + [module_name(p) for package in PACKAGES
                                 for p in sorted(glob.glob(os.path.join(ROOT, package, "*.py")))
                                 if not p.endswith("__init__.py")]
PROJECT = set(SCRIPTS) | set(SHARED)


def source(module: str) -> str:
    with open(os.path.join(ROOT, *module.split(".")) + ".py") as f:
        return f.read()


def project_imports(module: str) -> set:
    """The project modules `module` imports, anywhere in its code (module level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(source(module))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # from plumbing import rollout
    return names & PROJECT


def test_the_root_holds_runnable_scripts_and_policy_common():
    for module in SCRIPTS:
        text = source(module)
        assert 'if __name__ == "__main__":' in text and "def main(" in text, (
            f"{module}.py sits at the root but is not a runnable script: shared code goes into plumbing/")
    assert {"rloo", "grpo", "ppo", "dpo", "kto", "sft", "reward", "distill"} <= set(SCRIPTS)


def test_every_package_says_what_lives_there():
    for package in PACKAGES:
        with open(os.path.join(ROOT, package, "__init__.py")) as f:
            assert ast.get_docstring(ast.parse(f.read())), f"{package}/__init__.py has no docstring"
    for module in SHARED:
        assert ast.get_docstring(ast.parse(source(module))), f"{module} has no module docstring"


@pytest.mark.parametrize("module", SCRIPTS)
def test_scripts_import_shared_code_not_each_other(module):
    others = project_imports(module) & (set(SCRIPTS) - {module})
    assert not others, f"{module}.py imports the scripts {sorted(others)}: a script reads from one file"


@pytest.mark.parametrize("module", SHARED)
def test_shared_code_imports_no_script(module):
    scripts = project_imports(module) & set(SCRIPTS)
    assert not scripts, f"{module} imports the scripts {sorted(scripts)}: imports go from the scripts down"


@pytest.mark.parametrize("module", [m for m in SHARED if m.startswith("toy_worlds.")])
def test_toy_worlds_import_only_each_other(module):
    outside = {name for name in project_imports(module) if not name.startswith("toy_worlds.")}
    assert not outside, f"{module} imports {sorted(outside)}: a toy world builds with plain library code"


def test_shared_modules_import_without_a_cycle():
    graph = {module: project_imports(module) & set(SHARED) for module in SHARED}
    state = {}  # module -> "visiting" | "done"

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "visiting", "import cycle: " + " -> ".join(path + [module])
        state[module] = "visiting"
        for name in sorted(graph[module]):
            visit(name, path + [module])
        state[module] = "done"

    for module in SHARED:
        visit(module, [])


def test_policy_common_sits_below_what_builds_on_it():
    """Imports run one way, with no arrow back up: what policy_common (the plain forward, generation, the reference)
    imports from plumbing (models.py: loading models and looking inside them) builds on leaves only, modules that
    import no project module but plumbing.errors (errors.py; precision.py, what a model is loaded to compute in). The
    faster forwards (prompt sharing, packing, the chunked output layer) import policy_common, never the reverse, and
    plumbing/forwards.py chooses among them."""
    leaves = {m for m in SHARED if project_imports(m) & set(SHARED) <= {"plumbing.errors"}}
    below = project_imports(SHARED_ROOT_MODULE) & set(SHARED)
    assert below, "policy_common imports no shared module at all: update this test"
    for module in below:
        under = project_imports(module) & set(SHARED)
        assert under <= leaves, (f"policy_common imports {module}, which imports {sorted(under - leaves)}: what "
                                 "policy_common builds on must build on leaves only")


@pytest.mark.parametrize("module", [m for m in SHARED if not m.startswith("toy_worlds.")])
def test_shared_modules_stay_small(module):
    lines = source(module).count("\n")
    assert lines <= 500, f"{module}: {lines} lines; split it by subject"


def test_user_error_has_one_import_path():
    paths = ROOT_FILES + glob.glob(os.path.join(ROOT, "plumbing", "*.py")) + glob.glob(
        os.path.join(ROOT, "tests", "test_*.py"))
    for path in paths:
        if path == __file__:
            continue
        text = open(path).read()
        for other in ("pc.UserError", "ru.UserError", "from policy_common import UserError",
                      "from plumbing.run_utils import UserError"):
            assert other not in text, f"{os.path.basename(path)}: {other} (UserError comes from plumbing.errors)"
