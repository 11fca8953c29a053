"""Copy-and-modify is the product's main use: `cp rloo.py rloo_myidea.py` must pass the tests and run with no other
edit. The layout and flag tests state rules, so a copy is checked like the original (here: in a copy of the
repository holding `rloo_myidea.py` and `grpo_myidea.py`), and a copy runs from its own file name."""

import json
import os
import shutil
import subprocess
import sys

from conftest import ROOT, read_metrics, run_script


def repository_copy(folder) -> str:
    """The repository's files (tracked, and new ones git does not ignore) copied into `folder`."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.join(folder, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(folder, name))
    return str(folder)


def test_the_rules_hold_for_copied_scripts(tmp_path):
    clone = repository_copy(tmp_path / "clone")
    for script in ("rloo", "grpo"):
        shutil.copy(os.path.join(clone, f"{script}.py"), os.path.join(clone, f"{script}_myidea.py"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layout.py",
                           "tests/test_shared_flags.py"], cwd=clone, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "rloo_myidea" in subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-o", "addopts=",
                                            "-q", "tests/test_layout.py"], cwd=clone, capture_output=True,
                                           text=True).stdout  # the copies were among the scripts checked


def test_a_copied_script_runs_under_its_own_name(toy, tmp_path):
    copy = tmp_path / "rloo_myidea.py"
    shutil.copy(os.path.join(ROOT, "rloo.py"), copy)
    out = str(tmp_path / "run")
    run_script(str(copy), "--max_steps", "2", "--num_eval_prompts", "16", "--output_dir", out, env={"PYTHONPATH": ROOT})
    with open(os.path.join(out, "args.json")) as f:
        assert json.load(f)["exp_name"] == "rloo_myidea"
    assert [row["step"] for row in read_metrics(out)] == [0, 1, 2]
    assert os.path.exists(os.path.join(out, "model", "model.safetensors"))
