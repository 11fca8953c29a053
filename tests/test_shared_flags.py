"""Flags are declared once. The flags several scripts share live in flag groups beside the code that reads them
(plumbing's TrainFlags, ModelFlags, RolloutFlags, ...), mixed into each script's `Args`; a script declares its own
flags and may change a group flag's default, never its help. Every script at the root is checked, so a copied or new
script is too."""

import ast
import contextlib
import dataclasses
import glob
import importlib
import io
import os
import re
from collections import defaultdict

import pytest
from conftest import ROOT

SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))
                 if os.path.basename(p) != "policy_common.py")
# algorithm flags whose meaning is the algorithm's own, so each script's help says what it means there
PER_SCRIPT_MEANING = {"beta", "loss_type", "reward_model_input"}


def args_class(script: str):
    return importlib.import_module(script).Args


def groups(script: str) -> list:
    return [base for base in args_class(script).__bases__ if dataclasses.is_dataclass(base)]


def own_flags(script: str) -> dict:
    """{field: (annotation, help or None)} of the fields written in the script's `Args` body, read from source."""
    with open(os.path.join(ROOT, f"{script}.py")) as f:
        tree = ast.parse(f.read())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args")
    flags = {}
    for i, node in enumerate(cls.body):
        if isinstance(node, ast.AnnAssign):
            doc = cls.body[i + 1] if i + 1 < len(cls.body) else None
            is_doc = isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value,
                                                                                                     str)
            flags[node.target.id] = (ast.unparse(node.annotation), doc.value.value.strip() if is_doc else None)
    return flags


def test_the_algorithm_scripts_are_all_found():
    assert {"sft", "reward", "rloo", "ppo", "grpo", "dpo", "kto", "distill"} <= set(SCRIPTS)


def test_every_group_flag_has_a_help_line():
    for group in {group for script in SCRIPTS for group in groups(script)}:
        assert group.__doc__, f"{group.__name__} has no docstring (its --help title)"
        for cls in group.__mro__:
            if dataclasses.is_dataclass(cls):
                with open(importlib.import_module(cls.__module__).__file__) as f:
                    tree = ast.parse(f.read())
                body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
                fields = [n.target.id for n in body if isinstance(n, ast.AnnAssign)]
                documented = [n.target.id for i, n in enumerate(body) if isinstance(n, ast.AnnAssign)
                              and i + 1 < len(body) and isinstance(body[i + 1], ast.Expr)]
                missing = set(fields) - set(documented)
                assert fields == documented, f"{cls.__name__}: fields without a docstring {missing}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_declares_its_own_flags_and_only_overrides_group_defaults(script):
    grouped = {f.name: group for group in groups(script) for f in dataclasses.fields(group)}
    for name, (_, doc) in own_flags(script).items():
        if name in grouped:
            assert doc is None, (f"{script}.py re-documents --{name}: its help is {grouped[name].__name__}'s; a script "
                                 "may change a group flag's default only")
        else:
            assert doc, f"{script}.py: --{name} has no docstring"


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_flag_is_in_two_groups(script):
    seen = {}
    for group in groups(script):
        for f in dataclasses.fields(group):
            assert f.name not in seen, f"--{f.name} is in {seen[f.name]} and {group.__name__}"
            seen[f.name] = group.__name__


@pytest.mark.parametrize("script", SCRIPTS)
def test_args_stay_a_knob_panel(script):
    """A script's `Args` holds its own flags and the defaults it overrides: about 60 lines at most."""
    with open(os.path.join(ROOT, f"{script}.py")) as f:
        tree = ast.parse(f.read())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args")
    assert cls.end_lineno - cls.lineno + 1 <= 65, f"{script}.py's Args is {cls.end_lineno - cls.lineno + 1} lines"


def help_text(script: str) -> str:
    from plumbing import run_utils as ru

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        ru.parse_args(args_class(script), argv=["--help"])
    return out.getvalue()


def flag_help(text: str, flag: str) -> str:
    """The help `--help` prints under --flag, its default left out (a script may change a group flag's default). A
    flag's line starts two spaces in (a terminal's box border counted as a space), the lines of its help further."""
    lines = [line.replace("\u2502", " ") for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if re.match(rf"  --{flag}\b(?![-_])", line))
    words = re.split(r"\s{2,}", lines[start].strip(), maxsplit=1)[1:]  # its help may start beside the flag
    for line in lines[start + 1:]:
        if not line.startswith("    ") or not line.strip():
            break
        words.append(line.strip())
    return re.sub(r"\(default: .*?\)|\s+", " ", " ".join(words)).strip()


def test_group_flags_read_the_same_in_every_script():
    """A shared group's flag shows the same help in every script's --help (only its default may differ): the flags
    every script shares are worded once. A script's own flags are its to word, so a copy that rewords one of its
    own (or a script whose --beta means something else: PER_SCRIPT_MEANING) is not compared with the others."""
    texts = {script: help_text(script) for script in SCRIPTS}
    seen = defaultdict(lambda: defaultdict(list))  # flag -> help -> scripts
    for script in SCRIPTS:
        for group in groups(script):
            for f in dataclasses.fields(group):
                seen[f.name][flag_help(texts[script], f.name)].append(script)
    drift = {name: dict(d) for name, d in seen.items() if len(d) > 1}
    assert not drift, f"group flags whose help differs between scripts: {drift}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_every_flag_once_grouped(script):
    text = help_text(script)
    for f in dataclasses.fields(args_class(script)):
        assert len(re.findall(rf"--{f.name}\b(?![-_])", text)) >= 1, f"--{f.name} missing from {script}.py --help"
    for group in groups(script):
        assert f"{group.__name__} options" in text
    assert f"{script}.py's own flags" in text
