"""Copy-and-modify is the product's main use: `cp rloo.py rloo_myidea.py` must pass the tests and run with no other
edit. The layout and flag tests state rules, so a copy is checked like the original (here: in a copy of the
repository holding copies of rloo.py and grpo.py), and a copy runs from its own file name. Copies that change the
algorithm run too, without touching the shared code: the three edits below were each a trap once (a per-token
advantage in rloo under a sampler of other weights, a loss term over the reference's whole distribution in grpo, a
new loss type in dpo)."""

import json
import math
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


def edited_copy(folder, script: str, name: str, edits) -> str:
    """`script` copied to folder/name with each (old, new) edit applied; `old` must occur in it exactly once."""
    with open(os.path.join(ROOT, script)) as f:
        text = f.read()
    for old, new in edits:
        assert text.count(old) == 1, f"{script} no longer holds {old!r} once: update this test's edit"
        text = text.replace(old, new)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(text)
    return path


# rloo.py with a baseline per token position: each token's advantage is its return-to-go minus the mean of the other
# samples' at that position, a (B, R) advantage where rloo.py's sequence view has (B,)
PER_TOKEN_BASELINE = [(
    "        advantages = rlhf_reward - baseline\n",
    "        returns = token_level_returns(scores, kl, response_mask, kl_coef)  # (B, R)\n"
    "        grouped = returns.view(-1, rloo_k, returns.shape[1])  # (P, k, R)\n"
    "        others = (grouped.sum(1, keepdim=True) - grouped) / (rloo_k - 1)  # the other samples' mean, per token\n"
    "        advantages = (grouped - others).reshape(returns.shape) * response_mask\n")]

# grpo.py with KL(pi || pi_ref) over the whole vocabulary at each trained token added to the loss
FULL_VOCABULARY_KL = [(
    "                    losses.append(micro_batches.backward(loss))\n",
    "                    policy_logp = sampler.forward.logits(policy, micro.query_responses,\n"
    "                                                         micro.context_length).log_softmax(-1)  # (b, R, V)\n"
    "                    ref_logp = reference.logits(micro.query_responses, micro.context_length).log_softmax(-1)\n"
    "                    full_kl = pc.masked_mean((policy_logp.exp() * (policy_logp - ref_logp)).sum(-1),\n"
    "                                             loss_mask[mb])\n"
    "                    loss = loss + 0.1 * full_kl\n"
    "                    mb_stats['objective/full_kl'] = full_kl.detach()\n"
    "                    losses.append(micro_batches.backward(loss))\n")]

# dpo.py with one more loss type: APO-zero (D'Oosterlinck et al. 2024)
NEW_LOSS_TYPE = [
    ('loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"',
     'loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "apo_zero"] = "sigmoid"'),
    ("    else:\n        raise UserError(f\"unknown --loss_type {loss_type!r}\")\n",
     "    elif loss_type == \"apo_zero\":\n"
     "        losses = 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)\n"
     "    else:\n        raise UserError(f\"unknown --loss_type {loss_type!r}\")\n")]


def test_the_rules_hold_for_copied_scripts(tmp_path):
    clone = repository_copy(tmp_path / "clone")
    for script in ("rloo", "grpo"):
        shutil.copy(os.path.join(clone, f"{script}.py"), os.path.join(clone, f"{script}_myidea.py"))
    edited_copy(clone, "dpo.py", "dpo_apo.py", NEW_LOSS_TYPE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layout.py",
                           "tests/test_shared_flags.py"], cwd=clone, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-o", "addopts=", "-q",
                                "tests/test_layout.py"], cwd=clone, capture_output=True, text=True).stdout
    assert "rloo_myidea" in collected and "dpo_apo" in collected  # the copies were among the scripts checked


def test_a_copied_script_runs_under_its_own_name(toy, tmp_path):
    copy = tmp_path / "rloo_myidea.py"
    shutil.copy(os.path.join(ROOT, "rloo.py"), copy)
    out = str(tmp_path / "run")
    run_script(str(copy), "--max_steps", "2", "--num_eval_prompts", "16", "--output_dir", out, env={"PYTHONPATH": ROOT})
    with open(os.path.join(out, "args.json")) as f:
        assert json.load(f)["exp_name"] == "rloo_myidea"
    assert [row["step"] for row in read_metrics(out)] == [0, 1, 2]
    assert os.path.exists(os.path.join(out, "model", "model.safetensors"))


def test_a_per_token_advantage_in_rloo_runs_on_stale_samples(toy, tmp_path):
    """The importance weights take the shape of the loss terms they weigh, not of a flag: a per-token advantage gets
    one weight per token (AReaL's token_mask by default for stale samples) with --max_staleness 1."""
    copy = edited_copy(tmp_path, "rloo.py", "rloo_per_token.py", PER_TOKEN_BASELINE)
    out = str(tmp_path / "run")
    run_script(copy, "--max_steps", "3", "--max_staleness", "1", "--num_eval_prompts", "16", "--output_dir", out,
               env={"PYTHONPATH": ROOT})
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    for row in rows[2:]:  # batches 2 and 3 were sampled by earlier weights: weighted per token
        assert "async/is_masked_frac" in row and 0 < row["async/is_weight_mean"] < 10
        assert math.isfinite(row["loss/policy"]) and row["objective/advantage_std"] > 0


def test_a_loss_term_over_the_reference_distribution_in_grpo(toy, tmp_path):
    """Reference.logits and Forward.logits give the whole next-token distributions: a copy adds KL(pi || pi_ref) over
    the vocabulary without editing shared code. Before the first update the policy is the reference: the KL is 0."""
    copy = edited_copy(tmp_path, "grpo.py", "grpo_full_kl.py", FULL_VOCABULARY_KL)
    out = str(tmp_path / "run")
    run_script(copy, "--max_steps", "3", "--num_eval_prompts", "16", "--output_dir", out, env={"PYTHONPATH": ROOT})
    rows = {row["step"]: row for row in read_metrics(out)}
    assert abs(rows[1]["objective/full_kl"]) < 1e-5  # one model's distribution against the same one's
    assert rows[3]["objective/full_kl"] > rows[1]["objective/full_kl"] and math.isfinite(rows[3]["loss/policy"])


def test_a_new_loss_type_in_dpo(toy, tmp_path):
    """A loss type added in a copy of dpo.py takes its flag and runs: APO-zero's loss is 1 where the policy is still
    the reference (both log-ratios 0)."""
    copy = edited_copy(tmp_path, "dpo.py", "dpo_apo.py", NEW_LOSS_TYPE)
    out = str(tmp_path / "run")
    run_script(copy, "--loss_type", "apo_zero", "--max_steps", "3", "--num_eval_prompts", "16", "--max_eval_pairs",
               "64", "--output_dir", out, env={"PYTHONPATH": ROOT})
    rows = {row["step"]: row for row in read_metrics(out)}
    assert abs(rows[1]["loss"] - 1.0) < 1e-4 and all(math.isfinite(rows[s]["loss"]) for s in (2, 3))


def test_the_readme_shows_the_grpo_copy():
    """README "Try an idea" shows this file's grpo edit, line for line (so the one shown is the one that runs)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    anchor, edited = FULL_VOCABULARY_KL[0]
    assert edited.replace(anchor, "") in readme
