"""A flag shared by several scripts means exactly the same thing in each: same name, type and help text (the
default value may differ per algorithm and per alias). Every algorithm script in the repository root that
defines a tyro `Args` dataclass is compared, so a script added later is checked too."""

import ast
import glob
import os
from collections import defaultdict

import pytest

from conftest import ROOT


def script_flags(path):
    """{field name: (type annotation, one-line help)} of the `Args` dataclass of a script, read from source."""
    tree = ast.parse(open(path).read())
    args = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args"), None)
    if args is None:
        return None
    flags, body = {}, args.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = body[i + 1] if i + 1 < len(body) else None
            has_doc = isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
            flags[node.target.id] = (ast.unparse(node.annotation), doc.value.value.strip() if has_doc else None)
    return flags


SCRIPTS = {os.path.basename(p): flags for p in sorted(glob.glob(os.path.join(ROOT, "*.py")))
           if (flags := script_flags(p)) is not None}


def test_the_algorithm_scripts_are_all_found():
    assert {"rloo.py", "ppo.py", "dpo.py", "kto.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_flag_has_a_help_line(script):
    missing = [name for name, (_, doc) in SCRIPTS[script].items() if not doc]
    assert not missing, f"{script}: fields without a docstring: {missing}"


def test_shared_flags_have_one_type_and_one_help_text():
    """One type and one help text per flag. The one exception: a Literal whose choices are the algorithm's own (e.g.
    --loss_type: DPO's losses, GRPO's aggregations) may list other choices per script, when the one help text names
    every script whose choices differ."""
    seen = defaultdict(dict)  # flag -> {(type, help): [scripts]}
    for script, flags in SCRIPTS.items():
        for name, (annotation, doc) in flags.items():
            literal = annotation.startswith("Literal[")
            seen[name].setdefault(("Literal" if literal else annotation, doc), []).append((script, annotation))
    drift = {name: definitions for name, definitions in seen.items() if len(definitions) > 1}
    for name, definitions in seen.items():
        for (kind, doc), users in definitions.items():
            choices = {annotation for _, annotation in users}
            if kind == "Literal" and len(choices) > 1:
                unnamed = [script for script, _ in users if script not in (doc or "")]
                if unnamed:
                    drift[name] = definitions
    report = "\n".join(f"--{name}:\n" + "\n".join(f"    {users}: {t} {h!r}" for (t, h), users in d.items())
                       for name, d in sorted(drift.items()))
    assert not drift, f"shared flags that differ between scripts:\n{report}"
