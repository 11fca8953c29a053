"""The toy world: gold scorer by hand, a deterministic build, a useful reward model, an improvable SFT policy."""

import ast
import filecmp
import json
import os

import pytest

import toy_task


def test_gold_score_hand_worked():
    assert toy_task.gold_score("c a b =", " a b c") == 1.0
    assert toy_task.gold_score("c a b =", " c a b") == 0.0  # the lazy copy: no position right
    assert toy_task.gold_score("c a b =", " a c b") == pytest.approx(1 / 3)
    assert toy_task.gold_score("c a b =", " a b") == pytest.approx(2 / 3)  # one missing
    assert toy_task.gold_score("c a b =", " a b c d") == pytest.approx(3 / 4)  # one extra
    assert toy_task.gold_score("c a b =", " a b c [EOS]") == 1.0  # special tokens ignored
    assert toy_task.gold_score("c a b =", "") == 0.0


def test_target_completion_is_sorted():
    assert toy_task.target_completion("f b k c =") == " b c f k"


def test_reward_model_beats_chance_and_sft_has_room(toy):
    report = json.load(open(os.path.join(toy["root"], "report.json")))
    # figures at seed 0: pairwise accuracy ~0.88, SFT greedy gold ~0.47, SFT sampled gold ~0.46
    assert report["reward_model_heldout_pair_accuracy"] > 0.75
    assert 0.2 < report["sft_gold_greedy"] < 0.75
    assert 0.2 < report["sft_gold_sampled_T1"] < 0.75
    for name in ("policy", "reward", "tokenizer", "prompt_dataset", "preference_dataset", "unpaired_dataset"):
        assert os.path.isdir(toy[name]), name


def _all_files(root):
    """Every file of a build; `datasets` map caches (cache-*.arrow) that tools may add later are not build output."""
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files
                  if not (f.startswith("cache-") and f.endswith(".arrow")))


def test_build_is_deterministic_and_cached(toy, fresh_toy_run):
    """A second build with the same seed (into a fresh cache folder, by a new user's first `python rloo.py`) writes
    byte-identical files; asking for it again reuses it."""
    cache = fresh_toy_run[2]
    built = [p for p in os.listdir(cache) if os.path.isdir(os.path.join(cache, p)) and ".tmp-" not in p]
    assert built == [toy_task.folder_name(0)], os.listdir(cache)
    mtimes = {f: os.path.getmtime(os.path.join(cache, built[0], f)) for f in _all_files(os.path.join(cache, built[0]))}
    again = toy_task.build(seed=0, cache_dir=cache, verbose=False)  # reused, not rebuilt
    assert again["root"] == os.path.join(cache, built[0])
    assert {f: os.path.getmtime(os.path.join(again["root"], f)) for f in mtimes} == mtimes
    files = _all_files(toy["root"])
    assert files == _all_files(again["root"])
    _, mismatch, errors = filecmp.cmpfiles(toy["root"], again["root"], files, shallow=False)
    assert not mismatch and not errors, mismatch
    assert not [p for p in os.listdir(cache) if ".tmp-" in p]


def test_half_written_cache_is_rebuilt_not_used(tmp_path, monkeypatch):
    """A folder without report.json (a build that died) is rebuilt; a failed build leaves no folder behind."""
    half = tmp_path / toy_task.folder_name(7)
    (half / "sft").mkdir(parents=True)
    calls = []

    def fake_build(root, seed, verbose):  # stands in for the one-minute training; the caching logic is real
        calls.append(seed)
        open(os.path.join(root, "report.json"), "w").write("{}")

    monkeypatch.setattr(toy_task, "_build_into", fake_build)
    paths = toy_task.build(seed=7, cache_dir=str(tmp_path), verbose=False)
    assert calls == [7] and os.path.exists(os.path.join(paths["root"], "report.json"))
    assert not (half / "sft").exists()
    toy_task.build(seed=7, cache_dir=str(tmp_path), verbose=False)
    assert calls == [7]  # reused

    def dying_build(root, seed, verbose):
        open(os.path.join(root, "partial"), "w").write("x")
        raise KeyboardInterrupt

    monkeypatch.setattr(toy_task, "_build_into", dying_build)
    with pytest.raises(KeyboardInterrupt):
        toy_task.build(seed=8, cache_dir=str(tmp_path), verbose=False)
    assert not [p for p in os.listdir(tmp_path) if "seed8" in p and not p.endswith(".lock")]


def test_imports_nothing_from_the_project():
    """toy_task builds with plain transformers code: it imports no project module (the project's helpers import it,
    never the other way round), so changes to them cannot change the cached world."""
    root = os.path.dirname(os.path.abspath(toy_task.__file__))
    project = {os.path.splitext(f)[0] for f in os.listdir(root) if f.endswith(".py")}
    tree = ast.parse(open(toy_task.__file__).read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & project, imported & project


def test_gold_scorer_lookup(toy):
    assert toy_task.gold_scorer("toy") is toy_task.gold_score
    assert toy_task.gold_scorer(toy["prompt_dataset"]) is toy_task.gold_score
    assert toy_task.gold_scorer("trl-lib/tldr") is None
