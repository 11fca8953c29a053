"""The toy world: gold scorer by hand, a deterministic build, a useful reward model, an improvable SFT policy."""

import ast
import filecmp
import json
import os

import pytest
import torch

from toy_worlds import toy_task


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

    def fake_build(root, seed, verbose, setting):  # stands in for the one-minute training; the caching logic is real
        calls.append(seed)
        open(os.path.join(root, "report.json"), "w").write("{}")

    monkeypatch.setattr(toy_task, "_build_into", fake_build)
    paths = toy_task.build(seed=7, cache_dir=str(tmp_path), verbose=False)
    assert calls == [7] and os.path.exists(os.path.join(paths["root"], "report.json"))
    assert not (half / "sft").exists()
    toy_task.build(seed=7, cache_dir=str(tmp_path), verbose=False)
    assert calls == [7]  # reused

    def dying_build(root, seed, verbose, setting):
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
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & project, imported & project


def test_gold_scorer_lookup(toy):
    assert toy_task.gold_scorer("toy") is toy_task.gold_score
    assert toy_task.gold_scorer(toy["prompt_dataset"]) is toy_task.gold_score
    assert toy_task.gold_scorer("trl-lib/tldr") is None
    assert toy_task.gold_scorer("toy_hard") is toy_task.gold_score


def test_gold_score_with_repeated_letters_hand_worked():
    assert toy_task.target_completion("c a c b =") == " a b c c"
    assert toy_task.gold_score("c a c b =", " a b c c") == 1.0
    assert toy_task.gold_score("c a c b =", " a b c") == pytest.approx(3 / 4)  # the repeat dropped at the end
    assert toy_task.gold_score("a c a b =", " a b c") == pytest.approx(1 / 4)  # dropped early: the rest shifts
    assert toy_task.gold_score("a c a b =", " a a b c") == 1.0


def test_toy_prompts_and_demonstrations_are_unchanged_by_the_settings():
    """The standard world draws exactly what it drew before settings existed (its builds stay byte-identical):
    the same random calls in the same order as this independent copy of the original two functions."""
    import random

    def original_prompt(rng):
        return " ".join(rng.sample(toy_task.LETTERS, rng.randint(3, 6))) + " ="

    def original_demonstration(prompt, rng):
        letters = toy_task.prompt_letters(prompt)
        u = rng.random()
        if u < 0.55:
            return " " + " ".join(letters)
        answer = sorted(letters)
        if u >= 0.85:
            kind = rng.choice(["swap", "replace", "drop"])
            i = rng.randrange(len(answer) - 1)
            if kind == "swap":
                answer[i], answer[i + 1] = answer[i + 1], answer[i]
            elif kind == "replace":
                answer[i] = rng.choice([c for c in toy_task.LETTERS if c not in answer])
            else:
                del answer[i]
        return " " + " ".join(answer)

    ours, theirs = random.Random(5), random.Random(5)
    for _ in range(500):
        p = toy_task.make_prompt(ours)
        assert p == original_prompt(theirs)
        assert toy_task.imperfect_demonstration(p, ours) == original_demonstration(p, theirs)


def test_toy_hard_prompts_repeat_letters_and_demonstrators_drop_repeats():
    import random

    hard = toy_task.SETTINGS["toy_hard"]
    rng = random.Random(0)
    prompts = [toy_task.make_prompt(rng, hard) for _ in range(3000)]
    lengths = [len(toy_task.prompt_letters(p)) for p in prompts]
    assert min(lengths) == 5 and max(lengths) == 8
    with_repeats = [p for p in prompts if len(set(toy_task.prompt_letters(p))) < len(toy_task.prompt_letters(p))]
    # P(a repeat among n draws from 12 letters): 0.62 at n=5 .. 0.95 at n=8, about 0.82 on average
    assert 0.75 < len(with_repeats) / len(prompts) < 0.9
    copies = dropped = kept = 0
    for p in with_repeats:
        demo = toy_task.imperfect_demonstration(p, rng, hard).split()
        letters = toy_task.prompt_letters(p)
        if demo == letters:
            copies += 1
        elif demo == sorted(set(letters)):
            dropped += 1
        elif demo == sorted(letters):
            kept += 1
    n = len(with_repeats)
    assert 0.5 < copies / n < 0.6  # 55% lazy copies
    # of the 45% sorted answers, 70% drop the repeats; 15% of all carry a mistake on top (neither bucket)
    assert 0.18 < dropped / n < 0.24 and 0.06 < kept / n < 0.12
    assert toy_task.SETTINGS["toy_hard"].max_new_tokens == 10


def test_toy_hard_world_and_scripts_on_it(toy_hard, tmp_path):
    """The harder world: a folder of its own, a reward model trained on the short prompts' pairs only (and worse on
    the long ones, where the policy can exploit it), an SFT policy far below the ceiling; scripts run on it through
    `--model toy_hard` alone (its tuned lengths; KTO's class weights derived from its imbalanced labels)."""
    from conftest import read_metrics, run_script

    assert os.path.basename(toy_hard["root"]) == toy_task.folder_name(0, "toy_hard") != toy_task.folder_name(0)
    with open(os.path.join(toy_hard["root"], "report.json")) as f:
        report = json.load(f)
    # seed 0: 1,553 of 3,097 pairs, accuracy 0.80 short / 0.68 long, SFT greedy gold 0.35, 7% desirable
    assert report["setting"] == "toy_hard"
    assert report["n_preference_train_reward_model"] < 0.7 * report["n_preference_train"]
    assert report["reward_model_heldout_pair_accuracy_short"] > report["reward_model_heldout_pair_accuracy_long"]
    assert 0.2 < report["sft_gold_greedy"] < 0.5 and report["unpaired_desirable_fraction_train"] < 0.2
    for script, flags in (("rloo.py", ["--num_eval_prompts", "16"]),
                          ("kto.py", ["--num_eval_prompts", "16", "--num_eval_examples", "64"])):
        out = str(tmp_path / script)
        proc = run_script(script, "--model", "toy_hard", "--max_steps", "2", "--eval_steps", "0", *flags,
                          "--output_dir", out)
        rows = read_metrics(out)
        assert [r["step"] for r in rows if "eval/gold_score" in r] == [0, 2]
        with open(os.path.join(out, "args.json")) as f:
            args = json.load(f)
        assert args["response_length"] == toy_task.SETTINGS["toy_hard"].max_new_tokens
        if script == "kto.py":  # n_undesirable / n_desirable, not the toy world's fixed 3.0
            assert args["desirable_weight"] > 5 and "loss weights: desirable" in proc.stdout + proc.stderr


def test_a_build_leaves_the_callers_generator_as_it_was(tmp_path):
    """A seeded run that builds a toy world on first use (in its own process, after seeding) must then sample as a
    run that finds the world cached: the build draws from a forked torch generator."""
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)

    def build_into(folder):
        torch.manual_seed(0)  # as the builders do
        torch.rand(100)
        with open(os.path.join(folder, "report.json"), "w") as f:
            f.write("{}")

    toy_task.cached_build(str(tmp_path / "world"), build_into)
    assert os.path.exists(tmp_path / "world" / "report.json")
    assert torch.equal(torch.rand(4), expected)
