"""How each runnable script at the root reads, in numbers: its lines, its `Args` lines, the line where ALGO LOGIC
starts (and the fraction of the file before it), main's lines and deepest nesting (compound statements inside main:
for, while, if, with, try, nested def).

And, measured (issue 62: "the number of shared definitions one default RLOO and GRPO step reaches"), how much of the
shared code (policy_common.py and plumbing/*.py) one training step of a script runs through: its main() runs in this
process on the toy task (`--max_steps 3 --eval_steps 0 --num_eval_prompts 16`, the toy world built under
~/.cache/policy_rlhf/toy on first use) under sys.setprofile, and every Python function or method of the shared code
called during the second training step is recorded: from the second call of plumbing.throughput.StepMeter.start to
the third (the step's rollout, advantages, update, logging and checkpoint check; the setup, the first step and every
evaluation left out). A definition is a function or method at module or class level, named by its module and
qualified name (policy_common.Forward.logprobs); a nested function, lambda or comprehension that runs counts as its
enclosing definition. Per script: the distinct definitions reached, the sum of their source lines (decorators to the
end of the def, as code.co_firstlineno and inspect.getsourcelines count them), and the modules they live in.

    python benchmark/script_shape.py                  # both tables: every script at the root; rloo and grpo reached
    python benchmark/script_shape.py --reached rloo   # the second table for rloo only
    python benchmark/script_shape.py --reached        # the first table only
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKS = (ast.For, ast.While, ast.If, ast.With, ast.Try, ast.FunctionDef, ast.AsyncFor, ast.AsyncWith)
REACHED_FLAGS = ("--max_steps", "3", "--eval_steps", "0", "--num_eval_prompts", "16")
STEP = 2  # the training step whose shared definitions are recorded


def nesting(node: ast.AST, depth: int = 0) -> int:
    """The deepest count of compound statements enclosing a statement under `node`."""
    deepest = depth
    for child in ast.iter_child_nodes(node):
        deepest = max(deepest, nesting(child, depth + isinstance(child, BLOCKS)))
    return deepest


def shape(path: str) -> dict:
    with open(path) as f:
        text = f.read()
    lines = text.split("\n")
    tree = ast.parse(text)
    top = {node.name: node for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    algo = next((i + 1 for i, line in enumerate(lines) if line.startswith("# ALGO LOGIC")), None)
    header = next(i for i, line in enumerate(lines) if line.startswith(("import ", "from ")))
    main, args = top.get("main"), top.get("Args")
    return dict(script=os.path.basename(path), lines=len(text.rstrip("\n").split("\n")), header=header,
                args=None if args is None else args.end_lineno - args.lineno + 2,  # + its @dataclass line
                algo_logic=algo, algo_at=None if algo is None else algo / len(lines),
                main=None if main is None else main.end_lineno - main.lineno + 1,
                main_depth=None if main is None else nesting(main))


def scripts() -> list:
    return sorted(p for p in glob.glob(os.path.join(ROOT, "*.py")) if os.path.basename(p) != "policy_common.py")


# ---- The shared definitions one training step reaches
def shared_module(filename: str):
    """The dotted module name of a file of the shared code (policy_common.py, plumbing/*.py), else None."""
    path = os.path.realpath(filename)
    if path == os.path.join(ROOT, "policy_common.py"):
        return "policy_common"
    if os.path.dirname(path) == os.path.join(ROOT, "plumbing") and path.endswith(".py"):
        return "plumbing." + os.path.basename(path)[:-3]
    return None


def outer_qualname(qualname: str) -> str:
    """The module- or class-level definition a code object belongs to: Forward.outputs.<locals>.plain ->
    Forward.outputs."""
    return qualname.split(".<locals>", 1)[0]


def definition_lines(code) -> int:
    """Source lines of the definition `code` belongs to (module or class level): from its first decorator to the end
    of the def."""
    import inspect

    qualname = outer_qualname(code.co_qualname)
    if qualname == code.co_qualname:
        return len(inspect.getsourcelines(code)[0])
    with open(code.co_filename) as f:
        tree = ast.parse(f.read())

    def find(body, prefix):  # the def named `qualname` among module-level and class-level statements
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + node.name
                if name == qualname and not isinstance(node, ast.ClassDef):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    return node.end_lineno - first + 1
                if isinstance(node, ast.ClassDef):
                    found = find(node.body, name + ".")
                    if found:
                        return found
        return None

    found = find(tree.body, "")
    if found is None:  # a module-level lambda or comprehension: its own lines
        return len(inspect.getsourcelines(code)[0])
    return found


def reached(script: str, flags=REACHED_FLAGS, step: int = STEP) -> dict:
    """Run `<script>.py`'s main() in this process with `flags` (plus a temporary --output_dir) and record the shared
    definitions called during training step `step` (between that call of StepMeter.start and the next). Returns
    {"definitions": {"module.qualname": lines}, "lines": their sum, "modules": sorted module names}. The random
    generators, the SIGTERM / SIGINT handlers and sys.argv are restored after (run_utils.main_in_this_process)."""
    import contextlib
    import importlib
    import io
    import tempfile
    import threading

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from plumbing import run_utils, throughput

    module = importlib.import_module(script.removesuffix(".py"))
    start_code = throughput.StepMeter.start.__code__
    starts, found, modules = [0], {}, {}  # found: "module.qualname" -> a code object of it

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code is start_code:
            starts[0] += 1
        if starts[0] != step:
            return
        name = modules.get(code.co_filename, False)
        if name is False:
            name = modules[code.co_filename] = shared_module(code.co_filename)
        if name is not None and code.co_name != "<module>":  # a module first imported now: no definition
            found.setdefault(f"{name}.{outer_qualname(code.co_qualname)}", code)

    out, code = io.StringIO(), 0
    with tempfile.TemporaryDirectory() as tmp, run_utils.main_in_this_process(
            [os.path.join(ROOT, f"{script}.py"), *flags, "--output_dir", os.path.join(tmp, "run")]):
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                threading.setprofile(profile)
                sys.setprofile(profile)
                try:
                    run_utils.main_guard(module.main)
                finally:
                    sys.setprofile(None)
                    threading.setprofile(None)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    if code:
        raise RuntimeError(f"{script}.py {' '.join(flags)} exited {code}:\n{out.getvalue()[-4000:]}")
    if starts[0] <= step:
        raise RuntimeError(f"{script}.py {' '.join(flags)}: StepMeter.start called {starts[0]} times, not past step "
                           f"{step}")
    definitions = {name: definition_lines(c) for name, c in sorted(found.items())}
    owners = {shared_module(c.co_filename) for c in found.values()}
    return dict(definitions=definitions, lines=sum(definitions.values()), modules=sorted(owners))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reached", nargs="*", default=["rloo", "grpo"], metavar="SCRIPT",
                        help="scripts whose shared definitions one training step reaches are measured (a second "
                             "table; none: the first table only)")
    parser.add_argument("--list", action="store_true", help="also list each script's definitions reached")
    args = parser.parse_args(argv)
    print("| script | lines | header | Args | ALGO LOGIC at | main | main depth |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in scripts():
        s = shape(path)
        print(f"| {s['script']} | {s['lines']} | {s['header']} | {s['args']} | {s['algo_logic']} "
              f"({s['algo_at']:.0%}) | {s['main']} | {s['main_depth']} |")
    if not args.reached:
        return
    results = {script: reached(script) for script in args.reached}
    print(f"\nShared definitions (policy_common.py, plumbing/*.py) reached by training step {STEP} of "
          f"`python <script> {' '.join(REACHED_FLAGS)}`:\n")
    print("| script | definitions reached | their lines | modules |")
    print("| --- | ---: | ---: | ---: |")
    for script, r in results.items():
        print(f"| {script}.py | {len(r['definitions'])} | {r['lines']} | {len(r['modules'])} |")
    if args.list:
        for script, r in results.items():
            print(f"\n{script}.py: " + ", ".join(f"{name} ({lines})" for name, lines in r["definitions"].items()))


if __name__ == "__main__":
    main()
