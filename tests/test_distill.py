"""distill.py: the generalized JSD against TRL 1.16's generalized_jsd_loss and a slow float64 loop, its forward and
reverse KL gradients against their closed forms, the policy-gradient form by hand, and the start-up errors."""

import math

import pytest
import torch

from distill import generalized_jsd, pg_token_loss
from plumbing.errors import UserError

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def random_logits(seed, shape=(3, 5, 11), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale, torch.randn(*shape, generator=g) * scale


def slow_jsd(student_logits, teacher_logits, beta):
    """The definition, one position and one token at a time, in float64."""
    out = torch.zeros(student_logits.shape[:-1], dtype=torch.float64)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in student_logits.shape[:-1]]):
        s = torch.softmax(student_logits[tuple(index)].double(), -1).tolist()
        t = torch.softmax(teacher_logits[tuple(index)].double(), -1).tolist()
        m = [beta * tv + (1 - beta) * sv for sv, tv in zip(s, t)]

        def kl(p, q):
            return sum(pv * math.log(pv / qv) for pv, qv in zip(p, q) if pv > 0)

        out[tuple(index)] = beta * kl(t, m) + (1 - beta) * kl(s, m)
    return out


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_generalized_jsd_is_the_definition(beta):
    """0 < beta < 1 (at 0 and 1 the mixture is one of the two and the JSD vanishes: those are defined as the KLs, as
    GKD's limits and TRL do; next test)."""
    student, teacher = random_logits(0)
    expected = slow_jsd(student, teacher, beta)
    assert torch.allclose(generalized_jsd(student, teacher, beta).double(), expected, atol=1e-5)


def test_beta_zero_and_one_are_forward_and_reverse_kl():
    student, teacher = random_logits(1)
    s, t = torch.log_softmax(student.double(), -1), torch.log_softmax(teacher.double(), -1)
    forward = (t.exp() * (t - s)).sum(-1)  # KL(teacher || student)
    reverse = (s.exp() * (s - t)).sum(-1)  # KL(student || teacher)
    assert torch.allclose(generalized_jsd(student, teacher, 0.0).double(), forward, atol=1e-5)
    assert torch.allclose(generalized_jsd(student, teacher, 1.0).double(), reverse, atol=1e-5)
    assert (generalized_jsd(student, teacher, 0.5) <= math.log(2) + 1e-6).all()  # JSD is bounded by log 2


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_trl_generalized_jsd_loss(beta, temperature):
    """TRL 1.16's GKDTrainer.generalized_jsd_loss on the same logits, padding positions labelled -100: its batchmean
    is our masked per-token mean."""
    trl_gkd = pytest.importorskip("trl.experimental.gkd")
    student, teacher = random_logits(2, scale=2.0)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, 1:] = False
    labels = torch.where(mask, 1, -100)
    ours = generalized_jsd(student / temperature, teacher / temperature, beta)
    ours = ours[mask].sum() / mask.sum()
    theirs = trl_gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta,
                                                     temperature=temperature)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)


def slow_top_k_jsd(student_logits, teacher_logits, beta, k, add_tail):
    """TRL IW-OPD's top-k divergence by its definition, one position at a time, in float64: the support is the
    teacher's top k (beta 0), the student's (beta 1) or both (between); probabilities from the whole vocabulary;
    a tail bucket of 1 - their sum on each side, or both renormalised over the support."""
    out = torch.zeros(student_logits.shape[:-1], dtype=torch.float64)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in student_logits.shape[:-1]]):
        s = torch.softmax(student_logits[tuple(index)].double(), -1).tolist()
        t = torch.softmax(teacher_logits[tuple(index)].double(), -1).tolist()
        top = lambda p: sorted(range(len(p)), key=lambda i: -p[i])[:k]  # noqa: E731
        support = sorted(set(top(t) if beta < 1 else []) | set(top(s) if beta > 0 else []))
        s_sup, t_sup = [s[i] for i in support], [t[i] for i in support]
        if add_tail:
            s_sup, t_sup = s_sup + [1 - sum(s_sup)], t_sup + [1 - sum(t_sup)]
        else:
            s_sup, t_sup = [v / sum(s_sup) for v in s_sup], [v / sum(t_sup) for v in t_sup]

        def kl(p, q):
            return sum(pv * math.log(pv / qv) for pv, qv in zip(p, q) if pv > 0)

        if beta in (0.0, 1.0):
            out[tuple(index)] = kl(t_sup, s_sup) if beta == 0 else kl(s_sup, t_sup)
        else:
            m = [beta * tv + (1 - beta) * sv for sv, tv in zip(s_sup, t_sup)]
            out[tuple(index)] = beta * kl(t_sup, m) + (1 - beta) * kl(s_sup, m)
    return out


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_top_k_is_trls_iw_opd_support(beta, add_tail, k):
    if k == 1 and not add_tail:
        return  # refused at start-up (test_invalid_flags): one token, renormalised, is always 0
    student, teacher = random_logits(3, shape=(2, 3, 9))
    expected = slow_top_k_jsd(student, teacher, beta, k, add_tail)
    assert torch.allclose(generalized_jsd(student, teacher, beta, k, add_tail).double(), expected, atol=1e-5)
    assert torch.allclose(generalized_jsd(student, teacher, beta, top_k=9), generalized_jsd(student, teacher, beta),
                          atol=1e-6)  # k = V: the whole vocabulary


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("add_tail", [True, False])
def test_top_k_equals_trl_iw_opd(beta, add_tail):
    """TRL 1.16's IWOPDTrainer.generalized_jsd_loss (experimental/iw_opd) with loss_top_k and loss_add_tail, on the
    same padded logits."""
    iw_opd = pytest.importorskip("trl.experimental.iw_opd.iw_opd_trainer")
    student, teacher = random_logits(5, scale=2.0)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 2:] = False
    ours = generalized_jsd(student, teacher, beta, 3, add_tail)
    theirs = iw_opd.IWOPDTrainer.generalized_jsd_loss(student, teacher, labels=torch.where(mask, 1, -100), beta=beta,
                                                       top_k=3, add_tail=add_tail)
    assert (ours[mask].sum() / mask.sum()).item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)


def test_reverse_kl_sees_student_mass_outside_the_teachers_top_k():
    """The audit's case: the student puts 0.935 on a token the teacher gives 0.0007. Restricted to the teacher's top-2
    (the old rule) the reverse KL and its gradient were 0; over the student's top-2 with the tail (TRL's rule) the
    loss is the full reverse KL's order, and the gradient pushes the student off that token."""
    student_p = torch.tensor([0.935, 0.03249, 0.03249, 0.00001, 0.00001], dtype=torch.float64)
    teacher_p = torch.tensor([0.0007, 0.49964, 0.49964, 0.00001, 0.00001], dtype=torch.float64)
    student = student_p.log().float().view(1, 1, 5).requires_grad_()
    teacher = teacher_p.log().float().view(1, 1, 5)
    full = (student_p * (student_p.log() - teacher_p.log())).sum().item()  # the whole vocabulary's: 6.55
    loss = generalized_jsd(student, teacher, 1.0, top_k=2)
    expected = slow_top_k_jsd(student.detach(), teacher, 1.0, 2, True).item()
    assert loss.item() == pytest.approx(expected, rel=1e-4) and loss.item() > 0.9 * full
    loss.sum().backward()
    assert student.grad[0, 0, 0] > 0  # descending lowers the student's mass where the teacher has little
    # the teacher's top-2 renormalised (what --loss_top_k did before, at every beta) sees nothing
    index = teacher.topk(2, -1).indices
    old = generalized_jsd(student.detach().gather(-1, index), teacher.gather(-1, index), 1.0)
    assert old.item() < 1e-5


def test_kl_gradients_match_their_closed_forms():
    """d KL(T || S) / d z_S = p_S - p_T; d KL(S || T) / d z_S = p_S (log p_S - log p_T - KL(S || T)); the teacher
    gets no gradient."""
    student, teacher = random_logits(4)
    for beta, closed_form in ((0.0, lambda s, t: s.exp() - t.exp()),
                              (1.0, lambda s, t: s.exp() * (s - t - (s.exp() * (s - t)).sum(-1, keepdim=True)))):
        z = student.clone().double().requires_grad_(True)
        zt = teacher.clone().double().requires_grad_(True)
        generalized_jsd(z, zt, beta).sum().backward()
        s, t = torch.log_softmax(student.double(), -1), torch.log_softmax(teacher.double(), -1)
        assert torch.allclose(z.grad, closed_form(s, t).to(z.grad.dtype), atol=1e-5)
        assert zt.grad is None or (zt.grad == 0).all()


def test_pg_token_loss_hand_worked():
    """Two tokens: advantages log p_T - log p_S_old = -0.5 and +1.0. At ratio 1 the loss is -A; with new log-probs
    moved by +0.3 (ratio e^0.3 = 1.35 > 1.2) the positive-advantage token is clipped at 1.2, the negative one is not
    (min picks the unclipped -1.35 * -0.5 = 0.675)."""
    old = torch.tensor([[-1.0, -2.0]])
    teacher = torch.tensor([[-1.5, -1.0]])
    assert torch.allclose(pg_token_loss(old.clone(), old, teacher, 0.2), torch.tensor([[0.5, -1.0]]))
    new = old + 0.3
    ratio = math.exp(0.3)
    expected = torch.tensor([[ratio * 0.5, -1.2 * 1.0]])
    assert torch.allclose(pg_token_loss(new, old, teacher, 0.2), expected, atol=1e-6)
    # the gradient at ratio 1 is -A d log p_S: descending raises log p_S where the teacher likes the token more
    new = old.clone().requires_grad_(True)
    pg_token_loss(new, old, teacher, 0.2).sum().backward()
    assert torch.allclose(new.grad, torch.tensor([[0.5, -1.0]]))


@pytest.mark.parametrize("flags,match", [(["--beta", "1.5"], "--beta and --lmbda"),
                                         (["--loss", "pg", "--lmbda", "0.5"], "needs --lmbda 1"),
                                         (["--loss_top_k", "-1"], "--loss_top_k >= 0"),
                                         (["--loss_top_k", "1", "--no_loss_add_tail"], "the loss is always 0")])
def test_invalid_flags(flags, match):
    from conftest import run_script_in_process

    proc = run_script_in_process("distill.py", *flags)
    assert proc.returncode == 2 and match in proc.stderr


def save_teacher(tmp_path, tokenizer, positions=64, extra_token=False):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    if extra_token:
        tokenizer.add_tokens(["[EXTRA]"])
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=positions)
    GPTNeoXForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


def test_teacher_with_another_vocabulary_or_too_few_positions_is_refused(toy, tmp_path):
    from conftest import run_script_in_process

    from plumbing import models

    other = save_teacher(tmp_path / "vocab", models.load_tokenizer(toy["policy"]), extra_token=True)
    proc = run_script_in_process("distill.py", "--teacher_model", other)
    assert proc.returncode == 2 and "another vocabulary" in proc.stderr and other in proc.stderr
    short = save_teacher(tmp_path / "short", models.load_tokenizer(toy["policy"]), positions=8)
    proc = run_script_in_process("distill.py", "--teacher_model", short)
    assert proc.returncode == 2 and "has 8 positions" in proc.stderr
    with pytest.raises(UserError, match="--teacher_model is required"):
        from plumbing import run_utils

        run_utils.default_teacher("some/model")


# ---------------------------------------------------------------------------------------------------------
# Runs: the toy teacher distilled into the toy SFT policy closes >= 80% of their gold gap, on 1 and 2 processes; a
# run resumed from a checkpoint equals the uninterrupted one (on- and off-policy steps both taken)
# ---------------------------------------------------------------------------------------------------------
def gap_closed(rows, toy_teacher):
    import json

    with open(toy_teacher["report"]) as f:
        teacher_gold = json.load(f)["teacher_gold_greedy"]
    evals = [r for r in rows if "eval/gold_score" in r]
    before, after = evals[0]["eval/gold_score"], evals[-1]["eval/gold_score"]
    return (after - before) / (teacher_gold - before)


def test_distill_closes_the_gap_to_the_teacher(toy_teacher, shared_run):
    from conftest import read_metrics

    # the default run (seed 1 is the default): the one test_learning.py checks at the default budget
    _, out = shared_run("distill.py", "--seed", "1")
    rows = read_metrics(out)
    assert gap_closed(rows, toy_teacher) >= 0.8
    on_policy = [r for r in rows if r.get("val/on_policy") == 1.0]
    assert len(on_policy) == len(rows) - 1  # --lmbda 1: every step sampled by the student
    assert on_policy[-1]["objective/teacher_kl"] < 0.5 * on_policy[0]["objective/teacher_kl"]


def test_distill_on_two_processes(toy_teacher, tmp_path):
    from conftest import read_metrics
    from test_scale import run_distributed

    out = str(tmp_path / "distill2")
    run_distributed("distill.py", "--per_device_train_batch_size", "32", "--output_dir", out)
    assert gap_closed(read_metrics(out), toy_teacher) >= 0.8


def test_resume_equals_the_uninterrupted_run(toy_teacher, tmp_path):
    import os
    import shutil

    from conftest import read_metrics, run_script, without_wall_clock
    from safetensors.torch import load_file

    flags = ["--max_steps", "4", "--save_steps", "2", "--lmbda", "0.5", "--seq_kd", "--eval_steps", "2",
             "--num_eval_prompts", "32", "--seed", "5"]
    full = str(tmp_path / "full")
    run_script("distill.py", "--output_dir", full, *flags)
    rows = read_metrics(full)
    assert {r["val/on_policy"] for r in rows if r["step"] > 0} == {0.0, 1.0}  # both kinds of step are taken
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(full, "checkpoint-2"), os.path.join(resumed, "checkpoint-2"))
    with open(os.path.join(full, "metrics.jsonl")) as f, open(os.path.join(resumed, "metrics.jsonl"), "w") as g:
        g.writelines(f.readlines()[:3])  # steps 0..2, as the first run had written them at its checkpoint
    run_script("distill.py", "--output_dir", resumed, "--resume_from", os.path.join(resumed, "checkpoint-2"), *flags)
    full_rows, resumed_rows = without_wall_clock(rows), without_wall_clock(read_metrics(resumed))
    assert [r["step"] for r in resumed_rows] == [0, 1, 2, 3, 4]
    for a, b in zip(full_rows, resumed_rows):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["step"], k)
    weights = [load_file(os.path.join(folder, "model", "model.safetensors")) for folder in (full, resumed)]
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Images (toy_vision.py): the teacher reads the rollout's pictures, a text-only teacher is refused, the student learns
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def toy_vision_teacher(toy_vision):
    """Paths of the toy vision world's teacher (toy_vision.build_teacher; builds it on first use, under a minute)."""
    from toy_worlds import toy_vision as tv

    return tv.build_teacher(verbose=False)


def test_text_only_teacher_with_image_data_is_refused(toy_vision, tmp_path):
    from conftest import run_script_in_process

    from plumbing import models

    text_teacher = save_teacher(tmp_path, models.load_tokenizer(toy_vision["policy"]))  # the student's vocabulary
    proc = run_script_in_process("distill.py", "--model", "toy_vision", "--teacher_model", text_teacher)
    assert proc.returncode == 2
    assert f"--teacher_model {text_teacher!r} is a text-only model" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_teacher_reads_the_rollouts_pictures(toy_vision_teacher, tmp_path, monkeypatch):
    """A short run in this process with a forward hook on the teacher's vision tower: every completion's picture went
    through it (one image per row, each step's 64 rows; on the off-policy steps (--seq_kd) also when the teacher
    sampled them); and the teacher's outputs change with the picture."""
    from conftest import read_metrics, run_script_in_process

    import distill
    import policy_common as pc
    from plumbing import data_utils as du
    from plumbing import models, vision

    seen = []

    def load_teacher(*args, **kwargs):
        teacher = load(*args, **kwargs)
        teacher.model.vision_tower.register_forward_hook(lambda module, inputs, out: seen.append(len(inputs[0])))
        return teacher

    load = distill.load_teacher
    monkeypatch.setattr(distill, "load_teacher", load_teacher)
    out = str(tmp_path / "run")
    proc = run_script_in_process("distill.py", "--model", "toy_vision", "--max_steps", "4", "--lmbda", "0.5",
                                 "--seq_kd", "--seed", "5", "--num_eval_prompts", "8", "--output_dir", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    off_policy = [r["val/on_policy"] for r in read_metrics(out) if r["step"] > 0].count(0.0)
    assert 0 < off_policy < 4
    # 4 steps of 64 completions scored, `off_policy` steps of 64 sampled: one picture each (evaluation: the student's)
    assert sum(seen) == (4 + off_policy) * 64

    # the teacher's view of held-out answers (distill.teacher_outputs): right with the pictures, not with blank ones
    path = toy_vision_teacher["teacher"]
    tokenizer = models.load_tokenizer(path)
    teacher = models.load_causal_lm(path, tokenizer).eval()
    config = teacher.config
    pictures = vision.Vision.from_data(path, config, ["image"], "toy_vision")
    rows = du.load_prompt_dataset("toy_vision", "test").select(range(16)).to_list()
    queries = pc.pad_sequences(pictures.encode_rows(rows), tokenizer.pad_token_id, "left")
    answers = torch.tensor([[tokenizer.convert_tokens_to_ids(r["answer"]), tokenizer.eos_token_id] for r in rows])
    forward = pc.Forward(tokenizer.pad_token_id, 1.0, vision.image_token_ids(config))

    def answer_logprobs(blank: bool):
        with torch.no_grad():
            logits = distill.teacher_outputs(teacher, forward, torch.cat([queries, answers], 1), queries.shape[1],
                                             [torch.arange(len(rows))], False, pictures.rows_inputs(rows, blank))
        return pc.selective_logprobs(logits, answers)[:, 0]  # (16,) log p(the right answer word)

    seeing, blind = answer_logprobs(False), answer_logprobs(True)
    assert seeing.exp().mean() > 0.9 and blind.exp().mean() < 0.6


@pytest.mark.slow
def test_teacher_of_another_image_processor_is_refused(toy_vision, toy_vision_teacher):
    from transformers import AutoConfig, AutoProcessor

    import distill
    from plumbing import vision

    processor = AutoProcessor.from_pretrained(toy_vision["policy"])
    student = vision.Vision.from_data(toy_vision["policy"], AutoConfig.from_pretrained(toy_vision["policy"]),
                                      ["image"], "toy_vision")
    distill.check_teacher_images("toy_vision", toy_vision_teacher["teacher"], student, False)  # the same: accepted
    processor.image_processor.image_mean = [0.0, 0.0, 0.0]  # pixels the teacher would read otherwise
    with pytest.raises(UserError, match="does not read the student's images"):
        distill.check_teacher_images("toy_vision", toy_vision_teacher["teacher"],
                                     vision.Vision(processor, "image", toy_vision["policy"]), False)


def test_distill_with_images_learns(toy_vision_teacher, tmp_path):
    """16 steps at the toy_vision defaults: the student learns from the teacher to name the square's colour (held-out
    gold well above the SFT policy's) by reading the picture (with blank pictures it stays far below)."""
    from conftest import read_metrics, run_script

    out = str(tmp_path / "run")
    run_script("distill.py", "--model", "toy_vision", "--max_steps", "16", "--eval_steps", "16",
               "--num_eval_prompts", "128", "--output_dir", out)
    evals = [r for r in read_metrics(out) if "eval/gold_score" in r]
    start, end = evals[0], evals[-1]
    assert end["step"] == 16 and end["eval/gold_score"] >= start["eval/gold_score"] + 0.15
    assert end["eval/gold_score_blind"] <= end["eval/gold_score"] - 0.25
