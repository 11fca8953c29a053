"""Images in prompts (plumbing/vision.py) on the toy vision world's tiny LLaVA: the world itself (the SFT policy sees,
a blind one does not), the start-up errors, and that every forward and generation path hands each row its own
images: a batch against each row alone (shuffled rows, micro-batches, chunks, the chunked output layer, gradient for
some rows), the vision tower counted running, the sampled log-probs equal to a forward's with images, and a rollout's
micro-batches carrying their rows' images. Whole runs: tests/test_vision.py's last tests (rloo.py, grpo.py)."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, run_distributed, run_script, without_wall_clock

import policy_common as pc
from plumbing import data_utils as du
from plumbing import models, vision
from plumbing.errors import UserError
from plumbing.forwards import Forwards
from toy_worlds import toy_vision as tv


@pytest.fixture(scope="module")
def llava(toy_vision):
    """The world's SFT policy, its tokenizer and processor (a Vision), and 8 held-out rows with their prompts' ids."""
    from transformers import AutoConfig

    tokenizer = models.load_tokenizer(toy_vision["policy"])
    policy = models.load_causal_lm(toy_vision["policy"], tokenizer).eval()
    data = du.load_prompt_dataset(toy_vision["prompt_dataset"], "test")
    v = vision.Vision.from_data(toy_vision["policy"], AutoConfig.from_pretrained(toy_vision["policy"]),
                                data.column_names, "toy_vision")
    rows = [data[i] for i in range(8)]
    return SimpleNamespace(tokenizer=tokenizer, policy=policy, vision=v, rows=rows, ids=v.encode_rows(rows))


def batch_of(llava, rows, answers=None):
    """[left-padded prompt | answer, EOS] rows and their image inputs; answers: the rows' own by default."""
    tok = llava.tokenizer
    queries = pc.pad_sequences(llava.vision.encode_rows(rows), tok.pad_token_id, "left")
    answers = answers or [row["answer"] for row in rows]
    responses = pc.pad_sequences([tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                                  for a in answers], tok.pad_token_id, "right")
    return torch.cat([queries, responses], 1), queries.shape[1], llava.vision.rows_inputs(rows)


# ---------------------------------------------------------------------------------------------------------
# The world
# ---------------------------------------------------------------------------------------------------------
def test_gold_score_hand_worked():
    row = {"answer": "green"}
    assert tv.gold_score("", " green", row) == 1.0 and tv.gold_score("", "green [EOS]", row) == 1.0
    assert tv.gold_score("", " blue green", row) == 0.0 and tv.gold_score("", "", row) == 0.0
    assert du.gold_scorer("toy_vision") is tv.gold_score


def test_world_sees_but_leaves_room(toy_vision):
    """The SFT policy beats chance on held-out pictures but is far from solving them (the demonstrators' bias), and
    with blank pictures it falls back toward chance: its answers come from what it sees."""
    import json
    import os

    with open(os.path.join(toy_vision["root"], "report.json")) as f:
        report = json.load(f)
    assert report["chance"] + 0.1 < report["sft_gold_greedy"] < 0.85
    assert report["sft_gold_greedy_blind"] < report["sft_gold_greedy"] - 0.1


# ---------------------------------------------------------------------------------------------------------
# Start-up errors
# ---------------------------------------------------------------------------------------------------------
def test_text_only_model_given_images_stops_in_one_line(toy):
    config = SimpleNamespace()
    with pytest.raises(UserError, match="has an 'image' column but --model .* is a text-only model"):
        vision.Vision.from_data(toy["policy"], config, ["prompt", "image"], "mine")
    assert vision.Vision.from_data(toy["policy"], config, ["prompt"], "mine") is None  # no images: text as before


def test_scripts_without_images_refuse_image_data(toy_vision):
    data = du.load_prompt_dataset(toy_vision["prompt_dataset"], "test")
    with pytest.raises(UserError, match="has an 'image' column: this script does not take images yet"):
        du.text_only(data, "toy_vision")


def test_prompt_must_place_each_image(llava):
    row = dict(llava.rows[0], prompt="what color is the shape ?")  # no image placeholder
    with pytest.raises(UserError, match=r"places 0 image\(s\) .* holds 1"):
        llava.vision.encode_rows([row])


# ---------------------------------------------------------------------------------------------------------
# Every path hands each row its own images
# ---------------------------------------------------------------------------------------------------------
def test_images_reach_the_model(llava):
    """The same token ids with the other rows' pictures score differently: the pixels are read."""
    query_responses, context, images = batch_of(llava, llava.rows)
    forward = Forwards(llava.tokenizer.pad_token_id).lm(llava.policy)
    with torch.no_grad():
        own = forward.logprobs(llava.policy, query_responses, context, images=images)
        swapped = forward.logprobs(llava.policy, query_responses, context, images=images[::-1])
    assert (own - swapped).abs().max() > 1e-3


@pytest.mark.parametrize("path", ["plain", "chunked_head", "row_chunks", "grad_rows"])
def test_a_batch_scores_each_row_as_alone(llava, path):
    """Shuffled rows, scored together on each path, give each row the log-probs it gets alone with its picture."""
    pad = llava.tokenizer.pad_token_id
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    rows = [llava.rows[i] for i in order]
    query_responses, context, images = batch_of(llava, rows)
    forward = Forwards(pad, chunk_tokens=3 if path == "chunked_head" else 0).lm(llava.policy)
    assert forward.masked_token_ids == (llava.tokenizer.convert_tokens_to_ids("<image>"),) == (3,)  # never sampled
    with torch.no_grad():
        if path == "row_chunks":
            together = forward.logprobs_no_grad(llava.policy, query_responses, context, chunk_size=3, images=images)
        else:
            together = forward.logprobs(llava.policy, query_responses, context, images=images,
                                        grad_rows=3 if path == "grad_rows" else None)
        for i, row in enumerate(rows):
            alone_qr, alone_context, alone_images = batch_of(llava, [row])
            alone = pc.Forward(pad, masked_token_ids=(3,)).logprobs(llava.policy, alone_qr, alone_context,
                                                                   images=alone_images)
            n = alone.shape[1]
            torch.testing.assert_close(together[i, :n], alone[0], atol=1e-5, rtol=1e-4)


def test_vision_tower_runs_in_forward_and_generation(llava):
    """A hook on the vision tower counts the pictures it encodes: each forward and each generate call encodes the
    batch's (once per call: generation's decode steps reuse the prefill's image tokens)."""
    seen = []
    tower = llava.policy.model.vision_tower
    handle = tower.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        query_responses, context, images = batch_of(llava, llava.rows[:4])
        with torch.no_grad():
            pc.Forward(llava.tokenizer.pad_token_id).logprobs(llava.policy, query_responses, context, images=images)
        assert seen == [4]
        config = pc.make_generation_config(llava.tokenizer, 3)
        queries = query_responses[:, :context]
        pc.batch_generation(llava.policy, queries, llava.tokenizer.pad_token_id, llava.tokenizer.eos_token_id,
                            config, 2, images=images)
        assert seen == [4, 2, 2]  # two chunks of two rows
    finally:
        handle.remove()


def test_sampled_logprobs_equal_a_forward_with_images(llava):
    """The old-log-probs invariant with images: generation's log-probs of its samples are a fresh forward's."""
    tok = llava.tokenizer
    queries = pc.pad_sequences(llava.ids, tok.pad_token_id, "left").repeat_interleave(4, 0)
    images = llava.vision.rows_inputs(llava.rows, repeats=4)
    torch.manual_seed(0)
    query_responses, sampled = pc.batch_generation(llava.policy, queries, tok.pad_token_id, tok.eos_token_id,
                                                   pc.make_generation_config(tok, 3), 8, images=images)
    mask = query_responses[:, queries.shape[1]:] != tok.pad_token_id
    recomputed = pc.Forward(tok.pad_token_id).logprobs_no_grad(llava.policy, query_responses, queries.shape[1],
                                                               images=images)
    assert (recomputed - sampled)[mask].abs().max() < 1e-4
    blank = llava.vision.rows_inputs(llava.rows, blank=True, repeats=4)
    with torch.no_grad():
        blind = pc.Forward(tok.pad_token_id).logprobs(llava.policy, query_responses, queries.shape[1], images=blank)
    assert (blind - recomputed)[mask].abs().max() > 1e-3  # a blank picture is another input


def test_image_tokens_are_never_sampled(llava):
    """A sampled <image> would be read as a picture that is not there (the forward then fails: more image tokens
    than images): the forward masks it as it masks pad, and the sampler's generation config suppresses it."""
    tok = llava.tokenizer
    forward = Forwards(tok.pad_token_id).lm(llava.policy)
    query_responses, context, images = batch_of(llava, llava.rows)
    with torch.no_grad():
        logits = forward.logits(llava.policy, query_responses, context, images=images)
    assert (logits[..., 3] <= logits.amax(-1) - 1e4 + 1e-2).all()
    config = pc.make_generation_config(tok, 3, suppress=forward.masked_token_ids)
    assert config.suppress_tokens == [tok.pad_token_id, 3]
    queries = query_responses[:, :context].repeat_interleave(8, 0)
    sampled, _ = pc.batch_generation(llava.policy, queries, tok.pad_token_id, tok.eos_token_id, config, 64,
                                     images=[i for i in images for _ in range(8)])
    assert not (sampled[:, context:] == 3).any()


def test_forwards_step_aside_for_a_vision_model(llava, capsys):
    forward = Forwards(llava.tokenizer.pad_token_id, padding_free=True).lm(llava.policy)
    assert type(forward) is pc.Forward
    assert "takes images: its forwards run without --padding_free" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["grpo.py", "rloo.py"])
def test_script_learns_from_what_it_sees(toy_vision, tmp_path, script):
    """24 steps of --model toy_vision (its defaults: the gold reward; seed 1): the held-out greedy gold rises well
    above the SFT start (0.55 -> 0.82 here by step 16, both scripts) while the blind control (blank pictures) stays
    far below it, near chance (0.36); finite metrics, and the log-prob check (sampled against recomputed, with
    images) passed at step 1."""
    out = str(tmp_path / script)
    run_script(script, "--model", "toy_vision", "--seed", "1", "--total_episodes", str(64 * 24), "--eval_steps", "0",
               "--num_eval_prompts", "128", "--output_dir", out)
    rows = read_metrics(out)
    assert all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float))
    start, end = rows[0], rows[-1]
    assert end["eval/gold_score"] > start["eval/gold_score"] + 0.15, (start["eval/gold_score"], end["eval/gold_score"])
    assert end["eval/gold_score_blind"] < end["eval/gold_score"] - 0.25
    assert rows[1]["rollout/logprob_check"] < 1e-3


def test_lora_on_the_language_model_and_a_saved_model_keeps_its_processor(toy_vision, tmp_path):
    """--use_peft on a VLM (PEFT has no default for it): the adapter is on the language model's linear layers only
    (TRL's convention: the vision tower and projector frozen), the reference is the adapter-off base, and the saved
    folder (merged) holds the processor, so it trains again as a VLM."""
    import json
    import os

    out = str(tmp_path / "lora")
    run_script("grpo.py", "--model", "toy_vision", "--use_peft", "--lora_r", "8", "--max_steps", "2", "--eval_steps",
               "0", "--num_eval_prompts", "16", "--output_dir", out)
    with open(os.path.join(out, "model", "adapter_config.json")) as f:
        targets = json.load(f)["target_modules"]
    assert targets and all(".language_model." in f".{name}." for name in targets)
    assert os.path.exists(os.path.join(out, "model", "processor_config.json"))
    rows = read_metrics(out)
    assert abs(rows[1]["objective/kl"]) < 1e-3 and rows[1]["rollout/logprob_check"] < 1e-3  # base = start


def test_resume_with_images_equals_the_uninterrupted_run(toy_vision, tmp_path):
    """A run stopped at checkpoint-2 and resumed gives the uninterrupted run's steps 3 and 4 (each row's pictures
    recomputed from the data stream's position, as the prompts are)."""
    args = ["--model", "toy_vision", "--max_steps", "4", "--save_steps", "2", "--eval_steps", "0",
            "--num_eval_prompts", "16", "--seed", "3"]
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    run_script("grpo.py", *args, "--output_dir", full, threads=1)
    run_script("grpo.py", *args, "--output_dir", resumed, "--resume_from", f"{full}/checkpoint-2", threads=1)
    a, b = without_wall_clock(read_metrics(full)), without_wall_clock(read_metrics(resumed))
    assert [r["step"] for r in b][-2:] == [3, 4]
    for x, y in zip(a[-2:], b[-2:]):
        assert x.keys() == y.keys()
        for k in x:
            assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-6), k


def test_two_processes_with_images(toy_vision, tmp_path):
    """grpo.py on 2 processes with images and an uneven held-out split (15 prompts): each process samples its own
    prompts with their pictures; the run finishes with finite numbers and the blind control."""
    out = str(tmp_path / "two")
    run_distributed("grpo.py", "--model", "toy_vision", "--max_steps", "2", "--per_device_train_batch_size", "16",
                    "--eval_steps", "0", "--num_eval_prompts", "15", "--output_dir", out)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float))
    assert "eval/gold_score_blind" in rows[-1]


def test_unsupported_paths_refuse_images_in_one_line(toy_vision, tmp_path):
    for script, flags, message in (("ppo.py", [], "this script with images"),
                                   ("grpo.py", ["--use_vllm"], "--use_vllm with images")):
        proc = run_script(script, "--model", "toy_vision", "--max_steps", "1", *flags, "--output_dir",
                          str(tmp_path / script), check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-500:]


def test_multimodal_rotary_models_are_refused_in_one_line():
    """Qwen2.5-VL places image tokens with 3-D rotary positions, which the forwards do not compute yet: refused at
    start-up rather than trained with its images misplaced."""
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(text_config=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                               rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}))
    with pytest.raises(UserError, match="multimodal rotary positions"):
        vision.Vision.from_data("Qwen/Qwen2.5-VL-3B-Instruct", config, ["prompt", "images"], "mine")
