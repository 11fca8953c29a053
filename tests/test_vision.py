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
    with pytest.raises(UserError, match="has an 'image' column: this script does not take images"):
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


def two_picture_row(llava, a: int, b: int) -> dict:
    """A row whose prompt shows two pictures (held-out rows a and b), as a TRL user's `images` column holds them."""
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what color is the shape ?"}]
    return {"prompt": [{"role": "user", "content": content}], "answer": llava.rows[b]["answer"],
            "images": [llava.rows[a]["image"], llava.rows[b]["image"]]}


def test_several_pictures_per_prompt_each_row_as_alone(llava):
    """Rows with two pictures beside rows with one, shuffled: the processor expands each placeholder (4 image tokens
    each), the inputs of a batch are its rows' pictures in row order, and each row scores as it does alone."""
    two = vision.Vision(llava.vision.processor, "images", "toy_vision")
    rows = [two_picture_row(llava, 0, 1), {**llava.rows[2], "images": [llava.rows[2]["image"]]},
            two_picture_row(llava, 3, 4), two_picture_row(llava, 5, 5)]
    ids = two.encode_rows(rows)
    assert [row.count(3) for row in ids] == [8, 4, 8, 8]
    pad, tok = llava.tokenizer.pad_token_id, llava.tokenizer
    answers = pc.pad_sequences([tok("red", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]] * len(rows),
                               pad, "right")
    queries = pc.pad_sequences(ids, pad, "left")
    images = two.rows_inputs(rows)
    assert [r["pixel_values"].shape[0] for r in images] == [2, 1, 2, 2]
    with torch.no_grad():
        together = pc.Forward(pad, masked_token_ids=(3,)).logprobs(
            llava.policy, torch.cat([queries, answers], 1), queries.shape[1], images=images)
        for i, row in enumerate(rows):
            alone = pc.Forward(pad, masked_token_ids=(3,)).logprobs(
                llava.policy, torch.cat([torch.tensor([ids[i]]), answers[:1]], 1), len(ids[i]),
                images=two.rows_inputs([row]))
            torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=1e-4)
        swapped = pc.Forward(pad, masked_token_ids=(3,)).logprobs(  # the second picture of row 0 is read too
            llava.policy, torch.cat([queries[:1], answers[:1]], 1), queries.shape[1],
            images=two.rows_inputs([two_picture_row(llava, 0, 6)]))
    assert (swapped[0] - together[0]).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------------------
# The offline scripts' rows (sft, dpo, kto): images held undecoded, encoded per micro-batch
# ---------------------------------------------------------------------------------------------------------
def test_offline_rows_carry_their_pictures_through_a_shuffled_batch(llava, toy_vision):
    """dpo.py's pairs with images (du.with_images, tokenize_preferences): the pictures are held as the dataset's bytes,
    the prompt ids are the processor's (each placeholder expanded, never cut), and a shuffled batch of pairs scores each
    pair as it does alone (vision.batch_inputs in du.concatenated_inputs' order: chosen rows, then rejected)."""
    import dpo

    data = du.load_preference_dataset("toy_vision", "test").select(range(6))
    examples = du.with_images(data, llava.vision)
    assert isinstance(examples[0]["image"], dict) and examples[0]["image"]["bytes"]  # undecoded
    rows, dropped = dpo.tokenize_preferences(llava.tokenizer, examples, 64, 80, "toy_vision")
    assert dropped == 0 and rows[0]["prompt"] == llava.vision.encode(data[0]["prompt"], [data[0]["image"]])[0]
    with pytest.raises(UserError, match="longer than --max_prompt_length 8 .prompts with images are not cut"):
        dpo.tokenize_preferences(llava.tokenizer, du.with_images(data, llava.vision), 8, 80, "toy_vision")
    pad = llava.tokenizer.pad_token_id
    forward = pc.Forward(pad, masked_token_ids=(3,))

    def logps(batch):
        query_responses, context = du.concatenated_inputs(batch, pad)
        with torch.no_grad():
            token_logprobs = forward.logprobs(llava.policy, query_responses, context,
                                              images=vision.batch_inputs(batch, copies=2))
        return dpo.completion_sums(token_logprobs, query_responses, context, pad)[0].view(2, -1)  # chosen; rejected

    order = [4, 1, 5, 0, 3, 2]
    together = logps([rows[i] for i in order])
    for j, i in enumerate(order):
        torch.testing.assert_close(together[:, j], logps([rows[i]])[:, 0], atol=1e-5, rtol=1e-4)
    query_responses, context = du.concatenated_inputs(rows, pad)
    with torch.no_grad():  # blank pictures: other scores (the pictures are read)
        blind = forward.logprobs(llava.policy, query_responses, context,
                                 images=vision.batch_inputs(rows, copies=2, blank=True))
    assert (dpo.completion_sums(blind, query_responses, context, pad)[0].view(2, -1) - logps(rows)).abs().max() > 1e-3


def test_unpaired_pairs_keep_their_pictures(toy_vision):
    """kto.py given preference pairs with images: both rows of a pair show the pair's picture."""
    data = du.load_preference_dataset("toy_vision", "test").select(range(3))
    unpaired = du.to_unpaired(data, "toy_vision")
    assert unpaired["label"] == [True, False] * 3
    pictures = [image.tobytes() for image in unpaired["image"]]
    assert pictures[0] == pictures[1] == data[0]["image"].tobytes() != pictures[2] == pictures[3]


# ---------------------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["sft.py", "dpo.py", "kto.py"])
def test_offline_script_learns_from_what_it_sees(toy_vision, tmp_path, script):
    """One epoch of --model toy_vision's data (sft: the right answers; dpo: right against wrong; kto: unpaired
    examples, about half right), seed 1: the held-out greedy gold rises well above the SFT start (0.56 -> 0.98, 0.95,
    0.98 here) while the blind control (blank pictures) stays near chance (0.37), far below it."""
    out = str(tmp_path / script)
    run_script(script, "--model", "toy_vision", "--seed", "1", "--eval_steps", "0", "--num_eval_prompts", "128",
               "--output_dir", out)
    rows = [row for row in read_metrics(out) if "eval/gold_score" in row]
    start, end = rows[0], rows[-1]
    assert end["eval/gold_score"] > start["eval/gold_score"] + 0.2, (start["eval/gold_score"], end["eval/gold_score"])
    assert end["eval/gold_score_blind"] < end["eval/gold_score"] - 0.3


def test_token_budget_micro_batches_carry_their_rows_pictures(toy_vision, tmp_path):
    """dpo.py with images: micro-batches sized by --token_budget (other rows together) give the fixed micro-batches'
    steps: each micro-batch's image inputs are its own rows'."""
    runs = {}
    for name, flags in (("fixed", ["--gradient_accumulation_steps", "4", "--per_device_train_batch_size", "8"]),
                        ("budget", ["--token_budget", "150"])):
        out = str(tmp_path / name)
        run_script("dpo.py", "--model", "toy_vision", "--max_steps", "2", "--eval_steps", "0", "--num_eval_prompts",
                   "0", *flags, "--output_dir", out, threads=1)
        runs[name] = [row for row in read_metrics(out) if row["step"] > 0 and "loss" in row]
    assert len(runs["fixed"]) == len(runs["budget"]) == 2
    for a, b in zip(runs["fixed"], runs["budget"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"],
                                                                                                  rel=1e-4)


# ---------------------------------------------------------------------------------------------------------
# Whole runs: the RL scripts
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["grpo.py", "rloo.py"])
def test_script_learns_from_what_it_sees(toy_vision, tmp_path, script):
    """40 steps of --model toy_vision (its defaults: the gold reward; seed 1): the held-out greedy gold rises well
    above the SFT start (0.56 -> 0.97 by step 32 here) while the blind control (blank pictures) stays far below it,
    near chance (0.37); finite metrics, and the log-prob check (sampled against recomputed, with images) passed at
    step 1."""
    out = str(tmp_path / script)
    run_script(script, "--model", "toy_vision", "--seed", "1", "--total_episodes", str(64 * 40), "--eval_steps", "0",
               "--num_eval_prompts", "128", "--output_dir", out)
    rows = read_metrics(out)
    assert all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float))
    start, end = rows[0], rows[-1]
    assert end["eval/gold_score"] > start["eval/gold_score"] + 0.25, (start["eval/gold_score"], end["eval/gold_score"])
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
                                   ("reward.py", [], "this script does not take images")):
        proc = run_script(script, "--model", "toy_vision", "--max_steps", "1", *flags, "--output_dir",
                          str(tmp_path / script), check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-500:]


@pytest.fixture(scope="module")
def tiny_qwen2_vl():
    """A Qwen2-VL of random weights (2 text layers, 1 vision block; transformers' Qwen2VLForConditionalGeneration) and
    its processor (Qwen2-VL's image processor, PIL backend: 14-pixel patches merged 2 x 2, so a 28 x 28 picture is one
    image token and a 56 x 56 one four; a word-level tokenizer with Qwen's special tokens and a chat template)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen2VLProcessor,
    )
    from transformers.processing_utils import ProcessorMixin

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
               "<|video_pad|>", "[UNK]"]
    vocab = {t: i for i, t in enumerate(special + "user assistant what color is the shape ? red green".split())}
    backend = Tokenizer(tokenizer_models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                        unk_token="[UNK]", extra_special_tokens={"image_token": "<|image_pad|>",
                                                                                 "video_token": "<|video_pad|>"})
    template = ("{%- for m in messages %}{{- '<|im_start|> ' + m['role'] + ' ' }}{%- for part in m['content'] %}"
                "{%- if part['type'] == 'image' %}{{- '<|vision_start|> <|image_pad|> <|vision_end|> ' }}"
                "{%- else %}{{- part['text'] + ' ' }}{%- endif %}{%- endfor %}{{- '<|im_end|> ' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|im_start|> assistant ' }}{%- endif %}")
    tokenizer.chat_template = template
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56)
    with pytest.MonkeyPatch.context() as patch:  # its video processor would need torchvision, absent here
        check = ProcessorMixin.check_argument_for_proper_class
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if arg is None else check(self, name, arg))
        processor = Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    return SimpleNamespace(model=model, tokenizer=tokenizer, vision=vision.Vision(processor, "image", "tiny-qwen2-vl"))


def test_qwen2_vl_multimodal_positions(tiny_qwen2_vl):
    """Qwen2-VL places image tokens with 3-D rotary positions (time, height, width), computed by the model from the
    ids, the attention mask, image_grid_thw and mm_token_type_ids: pictures of different sizes (1, 2 and 4 image
    tokens), rows left-padded to each other. The sampled log-probs equal a forward's, each row scores as it does
    alone, and 1-D positions (what the forwards passed before) would have given other numbers."""
    from PIL import Image

    q = tiny_qwen2_vl
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color is the shape ?"}]}]
    rows = [{"prompt": prompt, "image": Image.new("RGB", size, color)} for size, color in
            (((28, 28), (200, 10, 10)), ((56, 56), (10, 200, 10)), ((28, 56), (10, 10, 200)), ((56, 28), (90, 90, 9)))]
    ids = q.vision.encode_rows(rows)
    assert [row.count(5) for row in ids] == [1, 4, 2, 2]  # <|image_pad|> tokens, one per 2 x 2 merged patches
    images = [inputs for inputs in q.vision.rows_inputs(rows) for _ in range(3)]
    pad = q.tokenizer.pad_token_id
    queries = pc.pad_sequences(ids, pad, "left").repeat_interleave(3, 0)
    forward = Forwards(pad).lm(q.model)
    torch.manual_seed(1)
    query_responses, sampled = pc.batch_generation(q.model, queries, pad, q.tokenizer.eos_token_id,
                                                   pc.make_generation_config(q.tokenizer, 4, suppress=(5, 6)), 12,
                                                   images=images)
    context = queries.shape[1]
    mask = query_responses[:, context:] != pad
    with torch.no_grad():
        scored = forward.logprobs(q.model, query_responses, context, images=images)
        assert (scored - sampled)[mask].abs().max() < 1e-4
        for i in range(0, len(query_responses), 3):
            start = int((query_responses[i, :context] == pad).sum())
            alone = forward.logprobs(q.model, query_responses[i:i + 1, start:], context - start, images=images[i:i + 1])
            torch.testing.assert_close(alone[0][mask[i]], scored[i][mask[i]], atol=1e-5, rtol=1e-4)
        attention_mask, positions = pc.padding_inputs(query_responses, pad)
        one_d = q.model(input_ids=query_responses.masked_fill(attention_mask == 0, 0), attention_mask=attention_mask,
                        position_ids=positions, **vision.model_inputs(images, positions.device)).logits
    one_d = torch.log_softmax(one_d[:, context - 1:-1], -1).gather(-1, query_responses[:, context:, None])[..., 0]
    assert (one_d - scored)[mask].abs().max() > 1e-3
