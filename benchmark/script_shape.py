"""How each runnable script at the root reads, in numbers: its lines, its `Args` lines, the line where ALGO LOGIC
starts (and the fraction of the file before it), main's lines and deepest nesting (compound statements inside main:
for, while, if, with, try, nested def).

    python benchmark/script_shape.py          # a markdown table of every script at the root
"""

from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKS = (ast.For, ast.While, ast.If, ast.With, ast.Try, ast.FunctionDef, ast.AsyncFor, ast.AsyncWith)


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


def main() -> None:
    print("| script | lines | header | Args | ALGO LOGIC at | main | main depth |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in scripts():
        s = shape(path)
        print(f"| {s['script']} | {s['lines']} | {s['header']} | {s['args']} | {s['algo_logic']} "
              f"({s['algo_at']:.0%}) | {s['main']} | {s['main_depth']} |")


if __name__ == "__main__":
    main()
