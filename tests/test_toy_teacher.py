"""The toy world's teacher (toy_task.build_teacher): the student's tokenizer, a larger model, a greedy gold score far
above the SFT policy's that an independent measurement confirms, and a cache that is reused."""

import filecmp
import json
import os
import time

from toy_worlds import toy_task


def test_teacher_shares_the_students_tokenizer_and_positions(toy, toy_teacher):
    from transformers import AutoConfig, AutoTokenizer

    teacher_tok = AutoTokenizer.from_pretrained(toy_teacher["teacher"])
    student_tok = AutoTokenizer.from_pretrained(toy["policy"])
    assert teacher_tok.get_vocab() == student_tok.get_vocab()
    assert (teacher_tok.pad_token_id, teacher_tok.eos_token_id) == (student_tok.pad_token_id, student_tok.eos_token_id)
    files = sorted(os.listdir(toy["tokenizer"]))
    _, mismatch, errors = filecmp.cmpfiles(toy["tokenizer"], toy_teacher["teacher"], files, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
    teacher, student = AutoConfig.from_pretrained(toy_teacher["teacher"]), AutoConfig.from_pretrained(toy["policy"])
    for field in ("vocab_size", "max_position_embeddings", "pad_token_id", "eos_token_id", "bos_token_id"):
        assert getattr(teacher, field) == getattr(student, field), field


def test_teacher_is_larger_and_far_better_than_the_student(toy, toy_teacher):
    from transformers import AutoModelForCausalLM

    report = json.load(open(toy_teacher["report"]))
    teacher = AutoModelForCausalLM.from_pretrained(toy_teacher["teacher"])
    student = AutoModelForCausalLM.from_pretrained(toy["policy"])
    assert report["teacher_parameters"] == sum(p.numel() for p in teacher.parameters())
    assert report["student_parameters"] == sum(p.numel() for p in student.parameters())
    assert report["teacher_parameters"] > report["student_parameters"]
    world = json.load(open(os.path.join(toy["root"], "report.json")))
    assert report["student_sft_gold_greedy"] == world["sft_gold_greedy"]
    assert report["teacher_gold_greedy"] >= 0.9
    assert report["teacher_gold_greedy"] - report["student_sft_gold_greedy"] >= 0.3


def test_teacher_greedy_gold_measured_again(toy, toy_teacher):
    """64 held-out prompts, one at a time (no padding) through plain `generate`: the recorded gold holds."""
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy_teacher["teacher"])
    model = AutoModelForCausalLM.from_pretrained(toy_teacher["teacher"]).eval()
    prompts = load_from_disk(toy["prompt_dataset"])["test"]["prompt"][:64]
    golds, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # one row of a tiny model at a time: a second thread only adds synchronisation
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=toy_task.MAX_NEW_TOKENS, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)
                completion = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                golds.append(toy_task.gold_score(prompt, completion))
    finally:
        torch.set_num_threads(threads)
    report = json.load(open(toy_teacher["report"]))
    assert abs(sum(golds) / len(golds) - report["teacher_gold_greedy"]) <= 0.1, (sum(golds) / len(golds), report)


def test_teacher_build_is_cached(toy_teacher):
    """Asking again returns the same folder at once and rewrites nothing."""
    root = toy_teacher["root"]
    mtimes = {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files}
    start = time.time()
    again = toy_task.build_teacher(verbose=False)
    assert time.time() - start < 2.0
    assert again == toy_teacher
    assert {f: os.path.getmtime(f) for f in mtimes} == mtimes
    assert os.path.basename(root) == toy_task.teacher_folder_name(0)
