"""reward_sources.py: the reward model read as tokens or as text (with the forward chosen for it from the run's
forwards.Forwards), reward functions, weights, and their errors; checked against independent computations (the reward
model's own transformers forward, hand-worked sums), then through rloo.py and ppo.py as a user runs them (one process
and two)."""

import asyncio
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, run_script, run_script_in_process, worker_accelerator
from test_scale import run_distributed

import policy_common as pc
from plumbing import data_utils as du
from plumbing import forwards, models
from plumbing import prompt_sharing as ps
from plumbing import reward_sources as rs
from plumbing import run_utils as ru
from plumbing.errors import UserError


def toy_batch(toy, completions):
    """query_responses [left-padded prompt | completion + EOS, right-padded] for toy prompts, the rows, and the
    policy tokenizer."""
    tokenizer = models.load_tokenizer(toy["policy"])
    prompts = ["f b k c =", "a c b =", "l k j i h g =", "d e f ="][:len(completions)]
    queries = pc.pad_sequences(du.tokenize_prompts(tokenizer, prompts), tokenizer.pad_token_id, "left")
    responses = pc.pad_sequences([tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                                  for c in completions], tokenizer.pad_token_id, "right")
    return torch.cat([queries, responses], 1), queries.shape[1], [{"prompt": p} for p in prompts], tokenizer


COMPLETIONS = [" b c f k", " c a b", " g h i j k l", " d e f f"]
REPEATS = ps.Repeats(rows=64, rows_per_prompt=4, prompt_length=8, response_length=8)  # worth sharing prompts


def permuted_reward_model(toy, path):
    """The toy reward model with another tokenizer: the same words under other ids (reversed), no pad token, no
    record of its convention. Its embedding rows are permuted to match, so on the same text it computes exactly
    what the toy reward model computes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, GPTNeoXForSequenceClassification, PreTrainedTokenizerFast

    old = AutoTokenizer.from_pretrained(toy["reward"]).get_vocab()
    words = ["[EOS]", "[UNK]"] + sorted((w for w in old if not w.startswith("[")), reverse=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", unk_token="[UNK]").save_pretrained(path)
    model = GPTNeoXForSequenceClassification.from_pretrained(toy["reward"], dtype=torch.float32)
    rows = model.gpt_neox.embed_in.weight.data[[old[w] for w in words]].clone()
    model.resize_token_embeddings(len(words))
    model.gpt_neox.embed_in.weight.data.copy_(rows)
    model.config.pad_token_id = None
    del model.config.reward_model_input
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def other_vocab_rm(toy, tmp_path_factory):
    return permuted_reward_model(toy, str(tmp_path_factory.mktemp("other_vocab") / "rm"))


def hf_score(model, tokenizer, texts):
    """Independent: transformers' own sequence-classification forward, one text at a time (no padding)."""
    return torch.stack([model(torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]])).logits[0, 0]
                        for t in texts])


# ---------------------------------------------------------------------------------------------------------
# tokens and text agree where they must
# ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_tokens_without_eos_equal_text_and_text_equals_the_models_own_forward(toy):
    query_responses, context_length, rows, tokenizer = toy_batch(toy, COMPLETIONS)
    reward_model = models.load_scalar_model(toy["reward"], tokenizer).eval()
    as_tokens = rs.Rewards(tokenizer, reward_model, tokenizer, "tokens")
    as_text = rs.Rewards(tokenizer, reward_model, tokenizer, "text")
    no_eos = query_responses.masked_fill(query_responses == tokenizer.eos_token_id, tokenizer.pad_token_id)
    text_scores, _ = as_text(query_responses, context_length, rows)
    assert torch.allclose(as_tokens(no_eos, context_length, rows)[0], text_scores, atol=1e-5)
    texts = [r["prompt"] + c for r, c in zip(rows, COMPLETIONS)]
    assert torch.allclose(text_scores, hf_score(reward_model, tokenizer, texts), atol=1e-5)
    # with EOS (tokens mode, the toy reward model's convention) the model reads another position: other scores
    eos_texts = [t + " [EOS]" for t in texts]
    assert torch.allclose(as_tokens(query_responses, context_length, rows)[0],
                          hf_score(reward_model, tokenizer, eos_texts), atol=1e-5)
    # the forward chosen for rows that repeat prompts, told they do (shared=True): the same scores
    shared = rs.Rewards(tokenizer, reward_model, tokenizer, "tokens",
                        forward=ps.SharedPromptScalarForward(tokenizer.pad_token_id))
    assert torch.allclose(shared(query_responses, context_length, rows, shared=True)[0],
                          hf_score(reward_model, tokenizer, eos_texts), atol=1e-5)
    assert not torch.allclose(text_scores, hf_score(reward_model, tokenizer, eos_texts), atol=1e-2)


@torch.no_grad()
def test_text_mode_with_another_tokenizer_scores_the_same_text(toy, other_vocab_rm):
    query_responses, context_length, rows, tokenizer = toy_batch(toy, COMPLETIONS)
    args = SimpleNamespace(reward_funcs=None, reward_model=other_vocab_rm, reward_model_input=None,
                           reward_weights=None, trust_remote_code=False, bf16=False, fp16=False)
    vocabulary, pad = dict(tokenizer.get_vocab()), tokenizer.pad_token_id
    sources = rs.load_rewards(args, tokenizer, forwards.Forwards(pad, repeats=REPEATS), "toy", "toy", [],
                              SimpleNamespace(device="cpu", print=print, state=SimpleNamespace()))
    assert sources.mode == "text" and sources.names == ["reward_model"]
    assert tokenizer.get_vocab() == vocabulary and tokenizer.pad_token_id == pad  # the policy's tokenizer untouched
    assert sources.reward_tokenizer.pad_token_id is not None  # given one for scoring (it had none)
    # re-tokenised text repeats no prompt and pads with the reward model's own pad token
    assert type(sources.forward) is pc.ScalarForward
    assert sources.forward.pad_token_id == sources.reward_tokenizer.pad_token_id
    toy_model = models.load_scalar_model(toy["reward"], tokenizer).eval()
    same_text = rs.Rewards(tokenizer, toy_model, tokenizer, "text")(query_responses, context_length, rows)[0]
    scores, per_source = sources(query_responses, context_length, rows)
    assert torch.allclose(scores, same_text, atol=1e-5) and torch.equal(per_source[:, 0], scores)


@torch.no_grad()
def test_conversational_prompts_go_through_the_reward_models_chat_template(toy):
    """Messages: the reward model reads its own chat template over the prompt's messages plus the completion as the
    assistant's message; reward functions get the messages and [{"role": "assistant", ...}] completions."""
    query_responses, context_length, _, tokenizer = toy_batch(toy, COMPLETIONS[:2])
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in ("f b k c =", "a c b =")]
    reward_tokenizer = models.load_tokenizer(toy["reward"])
    reward_tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    reward_model = models.load_scalar_model(toy["reward"], reward_tokenizer).eval()
    seen = {}

    def spy(prompts, completions):
        seen.update(prompts=prompts, completions=completions)
        return [0.0, 0.0]

    sources = rs.Rewards(tokenizer, reward_model, reward_tokenizer, "text", [rs.RewardFunction("spy", spy)])
    scores, _ = sources(query_responses, context_length, rows)
    expected = hf_score(reward_model, reward_tokenizer, ["f b k c = b c f k ", "a c b = c a b "])
    assert torch.allclose(scores, expected, atol=1e-5)
    assert seen["prompts"] == [r["prompt"] for r in rows]
    assert seen["completions"] == [[{"role": "assistant", "content": "b c f k"}],
                                   [{"role": "assistant", "content": "c a b"}]]


def test_convention_follows_flag_then_record_then_vocabulary():
    assert rs.reward_model_input(None, None, True, "rm") == "tokens"
    assert rs.reward_model_input(None, None, False, "rm") == "text"
    assert rs.reward_model_input(None, "text", True, "rm") == "text"  # the record wins over the vocabulary
    assert rs.reward_model_input("tokens", "text", True, "rm") == "tokens"  # the flag wins over the record
    with pytest.raises(UserError, match="cannot read the policy's token ids"):
        rs.reward_model_input("tokens", None, False, "rm")
    with pytest.raises(UserError, match="records reward_model_input tokens"):
        rs.reward_model_input(None, "tokens", False, "rm")


def test_the_toy_reward_model_records_tokens(toy):
    assert ru.model_config(toy["reward"]).reward_model_input == "tokens"


# ---------------------------------------------------------------------------------------------------------
# reward functions: calling, None, weights, statistics, errors
# ---------------------------------------------------------------------------------------------------------
def test_overlong_penalty_hand_worked_and_equal_to_trl():
    # --response_length 10, --overlong_buffer_length 4: no penalty up to 6 tokens, then -1/4 per token, -1 at 10
    completion_ids = [[7] * n for n in range(13)]
    sampled_lengths = list(range(13))  # without tools every token of a completion was sampled
    expected = [0.0] * 7 + [-0.25, -0.5, -0.75, -1.0, -1.0, -1.0]  # past the budget: -1
    overlong = rs.overlong_penalty(10, 4, 1.0)
    assert overlong.name == "overlong"
    assert overlong.fn(sampled_lengths=sampled_lengths) == expected
    assert rs.overlong_penalty(10, 4, 0.5).fn(sampled_lengths=sampled_lengths) == [0.5 * v for v in expected]
    trl_rewards = pytest.importorskip("trl.rewards")
    assert overlong.fn(sampled_lengths=sampled_lengths) == trl_rewards.get_soft_overlong_punishment(10, 4)(
        completion_ids=completion_ids)
    for bad in ((10, 0, 1.0), (10, 10, 1.0), (10, 4, -1.0)):
        with pytest.raises(UserError, match="--overlong_buffer_length"):
            rs.overlong_penalty(*bad)


def test_overlong_is_one_more_source_and_keeps_the_paired_reward_model(toy):
    tokenizer = models.load_tokenizer(toy["policy"])
    accelerator = SimpleNamespace(device="cpu", print=lambda *a: None, state=SimpleNamespace())
    args = SimpleNamespace(reward_funcs=None, reward_model=None, reward_model_input=None, reward_weights=[2.0],
                           trust_remote_code=False, bf16=False, fp16=False, response_length=8, overlong_buffer_length=3,
                           overlong_penalty_factor=1.0)
    sources = rs.load_rewards(args, tokenizer, forwards.Forwards(tokenizer.pad_token_id, repeats=REPEATS), "toy",
                              "toy", [], accelerator)
    assert sources.names == ["reward_model", "overlong"]  # shaping alone does not replace the reward model
    assert type(sources.forward) is ps.SharedPromptScalarForward  # the toy reward model reads the policy's tokens
    query_responses, context_length, rows, _ = toy_batch(toy, COMPLETIONS)
    scores, per_source = sources(query_responses, context_length, rows)
    torch.testing.assert_close(sources(query_responses, context_length, rows, shared=True)[1], per_source)
    lengths = (query_responses[:, context_length:] != tokenizer.pad_token_id).sum(1)
    penalty = torch.clamp((5 - lengths) / 3, -1.0, 0.0)  # start = 8 - 3
    torch.testing.assert_close(per_source[:, 1], penalty)
    torch.testing.assert_close(scores, 2.0 * per_source[:, 0] + penalty)  # weight 2 named, overlong's 1


def test_weighted_sum_with_none_and_statistics_hand_worked(toy):
    query_responses, context_length, rows, tokenizer = toy_batch(toy, COMPLETIONS[:3])
    for row, answer in zip(rows, ["x", "y", "z"]):
        row["answer"] = answer
    seen = {}

    def first(prompts, completions, answer):  # no **kwargs: gets only what it names
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [1.0, None, 3]

    def second(completions, **kwargs):
        seen.update(kwargs=sorted(kwargs))
        return [0.5, True, None]

    sources = rs.Rewards(tokenizer, functions=[rs.RewardFunction("first", first), rs.RewardFunction("second", second)],
                         weights=[2.0, -1.0])
    scores, per_source = sources(query_responses, context_length, rows)
    assert scores.tolist() == [2 * 1.0 - 0.5, -1.0, 2 * 3.0]  # None adds nothing
    assert torch.isnan(per_source[1, 0]) and torch.isnan(per_source[2, 1])
    assert seen["prompts"] == ["f b k c =", "a c b =", "l k j i h g ="] and seen["answer"] == ["x", "y", "z"]
    assert seen["completions"] == ["b c f k", "c a b", "g h i j k l"]  # decoded, EOS and pads skipped
    assert seen["kwargs"] == ["answer", "completion_ids", "log_extra", "log_metric", "prompts", "trainer_state"]
    metrics = sources.metrics(per_source)
    assert metrics["reward/first/mean"] == pytest.approx(2.0) and metrics["reward/first/std"] == pytest.approx(1.0)
    assert metrics["reward/second/mean"] == pytest.approx(0.75) and metrics["reward/second/std"] == pytest.approx(0.25)
    unscored = sources.metrics(torch.tensor([[float("nan"), 1.0]]))
    assert "reward/first/mean" not in unscored and unscored["reward/second/mean"] == 1.0


def test_trl_reward_arguments_and_async_functions(toy):
    """TRL 1.16 passes trainer_state, log_metric and log_extra; an async function is awaited."""
    query_responses, context_length, rows, tokenizer = toy_batch(toy, COMPLETIONS[:3])

    def shaped(prompts, completions, completion_ids, trainer_state, log_metric, log_extra):
        progress = trainer_state.global_step / trainer_state.max_steps
        log_metric("shaping/progress", progress)
        log_metric("shaping/progress", progress + 1.0)  # two calls in a step: their mean is logged
        log_extra("length", [len(ids) for ids in completion_ids])
        return [progress] * len(completions)

    async def judge(completions, **kwargs):  # an async judge (an LLM call in real use)
        await asyncio.sleep(0)
        return [float(len(c.split())) for c in completions]

    sources = rs.Rewards(tokenizer, functions=[rs.RewardFunction("shaped", shaped), rs.RewardFunction("judge", judge)],
                         max_steps=10)
    _, per_source = sources(query_responses, context_length, rows, step=3)
    assert per_source[:, 0].tolist() == pytest.approx([0.3] * 3)
    assert per_source[:, 1].tolist() == [4.0, 3.0, 6.0]  # "b c f k", "c a b", "g h i j k l"
    metrics = sources.metrics(per_source)
    assert metrics["shaping/progress"] == pytest.approx((0.3 + 1.3) / 2)
    responses = query_responses[:, context_length:]
    assert sources.take_extra_columns() == {"length": (responses != tokenizer.pad_token_id).sum(1).tolist()}
    assert "shaping/progress" not in sources.metrics(per_source) and sources.take_extra_columns() == {}  # read once
    sources(query_responses, context_length, rows, step=10)  # an evaluation's call: logged under eval/
    assert sources.metrics(per_source, prefix="eval/reward/")["eval/shaping/progress"] == pytest.approx(1.5)


def test_trl_extra_arguments_are_not_mistaken_for_columns(tmp_path):
    path = tmp_path / "trl_funcs.py"
    path.write_text("def r(prompts, completions, trainer_state, log_extra, log_metric, completion_ids):\n"
                    "    return [0.0] * len(completions)\n")
    args = SimpleNamespace(reward_funcs=[f"{path}:r"], reward_model=None, reward_model_input=None, reward_weights=None)
    datasets = [SimpleNamespace(column_names=["prompt"])]
    sources = rs.load_rewards(args, None, forwards.Forwards(0), "toy", "toy", datasets, None)
    assert sources.names == ["r"]


@pytest.mark.parametrize("returned, message", [
    (lambda n: [1.0] * (n - 1), "returned 2 values for 3 rows"),
    (lambda n: [1.0, "abc", 2.0],
     "returned 'abc' for row 1 (prompt 'a c b =', completion 'c a b'): not a finite number"),
    (lambda n: [1.0, 2.0, float("nan")], "returned nan for row 2"),
    (lambda n: 7, "returned int, not a list of 3 values"),
])
def test_bad_return_values_name_the_function_and_the_first_bad_row(toy, returned, message):
    query_responses, context_length, rows, tokenizer = toy_batch(toy, COMPLETIONS[:3])
    sources = rs.Rewards(tokenizer, functions=[rs.RewardFunction("mine", lambda prompts, completions: returned(3))])
    with pytest.raises(rs.RewardFunctionError, match="reward function 'mine' " + message.replace("(", r"\(")
                       .replace(")", r"\)")):
        sources(query_responses, context_length, rows)


def test_a_raising_function_is_reported_with_its_first_failing_row(toy):
    query_responses, context_length, rows, tokenizer = toy_batch(toy, COMPLETIONS[:3])

    def picky(prompts, completions):
        return [1.0 / (len(c.split()) - 3) for c in completions]  # the 3-letter completion divides by zero

    sources = rs.Rewards(tokenizer, functions=[rs.RewardFunction("picky", picky)])
    with pytest.raises(rs.RewardFunctionError,
                       match=r"'picky' raised ZeroDivisionError: .* on row 1 \(prompt 'a c b ="):
        sources(query_responses, context_length, rows)


def test_loading_functions_by_name_and_their_errors(tmp_path):
    path = tmp_path / "funcs.py"
    path.write_text("def length(prompts, completions, **kw):\n    return [len(c) for c in completions]\nvalue = 3\n")
    assert rs.load_reward_function(f"{path}:length", "toy").fn(prompts=["p"], completions=["ab"]) == [2]
    assert rs.load_reward_function("json:dumps", "toy").name == "dumps"  # package.module:function
    from plumbing import run_utils as ru
    from toy_worlds import toy_tools
    # a spec written before the toy worlds moved into toy_worlds/ still names the same function
    assert ru.load_object("toy_tools:lookup", "--tools") is ru.load_object("toy_worlds.toy_tools:lookup", "--tools") \
        is toy_tools.lookup
    gold = rs.load_reward_function("gold", "toy")
    assert gold.fn(prompts=["c a b ="], completions=[" a b c"]) == [1.0]
    for spec, message in [("gold", "has no ground-truth scorer"), ("nope", "not a built-in"),
                          (f"{tmp_path}/missing.py:f", "not found"), (f"{path}:absent", "has no function 'absent'"),
                          (f"{path}:value", "has no function 'value'"), ("no_such_module_x:f", "cannot import")]:
        with pytest.raises(UserError, match=message):
            rs.load_reward_function(spec, "trl-lib/tldr")
    with pytest.raises(UserError, match="must take completions="):
        rs.RewardFunction("f", lambda a, b: [])
    with pytest.raises(UserError, match="2 value\\(s\\) for 1 reward source"):
        rs.Rewards(None, functions=[rs.RewardFunction("f", lambda completions: [])], weights=[1.0, 2.0])


# ---------------------------------------------------------------------------------------------------------
# through the scripts
# ---------------------------------------------------------------------------------------------------------
FUNCS = '''
import json, os

def exact(prompts, completions, answer):
    return [float(c.split() == a.split()) for c, a in zip(completions, answer)]

def every_other(completions, **columns):
    return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

def raises(prompts, completions, **columns):
    raise RuntimeError("broken checker")

def wrong_count(prompts, completions, **columns):
    return [0.0]

def not_numbers(prompts, completions, **columns):
    return ["high"] * len(completions)

def mark(prompts, completions, **columns):
    """Writes what this process scored, call by call, next to the run."""
    values = [float(len(c.split())) for c in completions]
    with open(os.path.join(os.environ["MARK_DIR"], f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
        f.write(json.dumps({"prompts": prompts, "values": values}) + "\\n")
    return values

CALLS = []

def fails_at_step_two(prompts, completions, **columns):
    CALLS.append(1)  # call 1: evaluation at step 0, call 2: step 1, call 3: step 2
    if len(CALLS) == 3:
        raise ValueError("bad row")
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def funcs(toy, tmp_path_factory):
    """A file of reward functions and a toy prompt dataset with an `answer` column."""
    from toy_worlds import toy_task

    root = tmp_path_factory.mktemp("funcs")
    (root / "funcs.py").write_text(FUNCS)
    data = du.load_prompt_dataset("toy", "train")
    for split, prompts in (("train", data["prompt"][:256]), ("test", du.load_prompt_dataset("toy", "test")["prompt"])):
        with open(root / f"{split}.jsonl", "w") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p, "answer": toy_task.target_completion(p)}) + "\n")
    return SimpleNamespace(file=str(root / "funcs.py"), train=str(root / "train.jsonl"), test=str(root / "test.jsonl"))


TINY = ["--max_steps", "2", "--per_device_train_batch_size", "16", "--num_eval_prompts", "8"]


def test_rloo_with_reward_model_and_functions_from_a_file(funcs, tmp_path):
    out = str(tmp_path / "run")
    # a dataset given as one json file is its own train split; evaluation reads it too (--eval_split train)
    run_script("rloo.py", "--reward_model", "toy", "--reward_funcs", f"{funcs.file}:exact", f"{funcs.file}:every_other",
               "--reward_weights", "1.0", "2.0", "0.5", "--dataset", funcs.train, "--eval_split", "train", *TINY,
               "--output_dir", out)
    rows = read_metrics(out)
    for source in ("reward_model", "exact", "every_other"):
        assert all(f"reward/{source}/mean" in r for r in rows if r["step"] > 0)
        assert f"eval/reward/{source}/mean" in rows[0]
    first = rows[0]
    weighted = (first["eval/reward/reward_model/mean"] + 2.0 * first["eval/reward/exact/mean"])  # every row scored
    # every_other scores 1.0 on 4 of the 8 held-out rows (one call), weighted 0.5: 0.25 on average
    assert first["eval/scores"] == pytest.approx(weighted + 0.25, abs=1e-5)
    assert first["eval/reward/every_other/mean"] == 1.0 and first["eval/reward/every_other/std"] == 0.0


def test_overlong_shaping_is_logged_as_its_own_source(toy, tmp_path):
    out = str(tmp_path / "overlong")
    # the toy's completions take 4-8 of its 8 tokens: a buffer of 4 penalises the longer ones
    run_script("grpo.py", "--overlong_buffer_length", "4", "--overlong_penalty_factor", "0.5", *TINY,
               "--output_dir", out)
    rows = read_metrics(out)
    train = [r for r in rows if r["step"] > 0]
    assert all("reward/reward_model/mean" in r and "reward/overlong/mean" in r for r in train)
    assert all(-0.5 <= r["reward/overlong/mean"] < 0 for r in train)  # some completions reach the buffer
    assert "eval/reward/overlong/mean" in rows[0]


BAD_SOURCES = [
    (["--reward_funcs", "{file}:raises"], "reward function 'raises' raised RuntimeError: broken checker on row 0"),
    (["--reward_funcs", "{file}:wrong_count"], "reward function 'wrong_count' returned 1 values for"),
    (["--reward_funcs", "{file}:not_numbers"], "returned 'high' for row 0"),
    (["--reward_funcs", "{file}:absent"], "has no function 'absent'"),
    (["--reward_funcs", "/no/such/file.py:f"], "not found"),
    (["--reward_funcs", "exact_match"], "not a built-in"),
    (["--reward_funcs", "{file}:exact", "--dataset", "toy"], "needs column(s) ['answer']"),
    (["--reward_funcs", "{file}:exact", "--reward_weights", "1", "2"], "2 value(s) for 1 reward source"),
    (["--reward_model_input", "tokens", "--reward_model", "{other}"], "cannot read the policy's token ids"),
]


# every case through rloo.py; the start-up checks are shared code, so ppo.py runs one function error
@pytest.mark.parametrize("script, flags, message", [("rloo.py", *case) for case in BAD_SOURCES] +
                         [("ppo.py", *BAD_SOURCES[0])])
def test_bad_reward_sources_fail_in_one_line_with_no_run_folder(funcs, other_vocab_rm, tmp_path, script, flags,
                                                                message):
    out = str(tmp_path / "never")
    flags = [f.format(file=funcs.file, other=other_vocab_rm) for f in flags]
    data = [] if "--dataset" in flags else ["--dataset", funcs.train, "--eval_split", "train"]
    proc = run_script_in_process(script, *flags, *data, *TINY, "--output_dir", out)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not os.path.exists(out)


def test_a_function_failing_mid_run_keeps_the_finished_steps(funcs, tmp_path):
    out = str(tmp_path / "run")
    proc = run_script("rloo.py", "--reward_funcs", f"{funcs.file}:fails_at_step_two", "--dataset", funcs.train,
                      "--eval_split", "train", *TINY, "--output_dir", out, check=False)
    assert proc.returncode == 2 and "reward function 'fails_at_step_two' raised ValueError: bad row" in proc.stderr
    assert [r["step"] for r in read_metrics(out)] == [0, 1]
    assert os.path.exists(os.path.join(out, "checkpoint-1", "trainer_state.json")), proc.stdout[-2000:]


@pytest.mark.parametrize("script", ["rloo.py", "ppo.py"])
def test_a_reward_model_with_another_tokenizer_trains(script, other_vocab_rm, tmp_path):
    out = str(tmp_path / "run")
    proc = run_script(script, "--reward_model", other_vocab_rm, *TINY, "--output_dir", out)
    assert "reads text (another vocabulary)" in proc.stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(math.isfinite(v) for r in rows for v in r.values())
    if script == "ppo.py":  # the value model reads the policy's ids: it starts from the policy, not this reward model
        assert f"value model from {ru.resolve_model('toy')}" in proc.stdout


def test_ppo_without_a_reward_model_starts_the_value_model_from_the_policy(toy, tmp_path):
    from safetensors.torch import load_file

    out = str(tmp_path / "run")
    proc = run_script("ppo.py", "--reward_funcs", "gold", *TINY, "--output_dir", out, "--save_value_model")
    assert f"value model from {toy['policy']}" in proc.stdout and "reward model" not in proc.stdout
    assert {"reward/gold/mean", "eval/reward/gold/mean"} <= set(read_metrics(out)[-1])
    value = load_file(os.path.join(out, "value_model", "model.safetensors"))
    policy = load_file(os.path.join(toy["policy"], "model.safetensors"))
    reward = load_file(os.path.join(toy["reward"], "model.safetensors"))
    backbone = [k for k in value if k.startswith("gpt_neox.") and "layers" in k]
    distance = lambda start: max((value[k] - start[k]).abs().max().item() for k in backbone)  # noqa: E731
    assert backbone and distance(policy) < 0.01 < 0.05 < distance(reward)  # 8 small updates away from the policy
    assert "score.weight" in value  # the new scalar head


def test_rloo_learns_from_the_gold_reward_alone(toy, tmp_path):
    """RL with a verifiable reward and no reward model: gold 0.47 -> ~0.96 by step 16 of the toy run."""
    out = str(tmp_path / "run")
    proc = run_script("rloo.py", "--reward_funcs", "gold", "--max_steps", "16", "--output_dir", out)
    assert "reward model" not in proc.stdout
    rows = read_metrics(out)
    assert rows[-1]["eval/gold_score"] > rows[0]["eval/gold_score"] + 0.3, [r.get("eval/gold_score") for r in rows]
    assert rows[-1]["eval/reward/gold/mean"] == pytest.approx(rows[-1]["eval/gold_score"], abs=1e-6)


def test_two_processes_score_their_own_rows_and_log_global_means(funcs, tmp_path):
    out, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    os.environ["MARK_DIR"] = str(marks)  # the spawned processes inherit it
    try:
        run_distributed("rloo.py", "--reward_model", "toy", "--reward_funcs", f"{funcs.file}:mark", "--max_steps", "2",
                        "--per_device_train_batch_size", "8", "--rloo_k", "4", "--num_eval_prompts", "2",
                        "--dataset", funcs.train, "--eval_split", "train", "--output_dir", str(out), timeout=400)
    finally:
        del os.environ["MARK_DIR"]
    calls = [[json.loads(line) for line in open(marks / f"rank{rank}.jsonl")] for rank in (0, 1)]
    assert len(calls[0]) == len(calls[1]) == 4  # evaluation, step 1, step 2, evaluation
    step1 = [calls[0][1], calls[1][1]]  # each process's rows of step 1
    assert set(step1[0]["prompts"]).isdisjoint(step1[1]["prompts"])  # each scored its own prompts
    values = torch.tensor(step1[0]["values"] + step1[1]["values"], dtype=torch.float64)
    row = next(r for r in read_metrics(str(out)) if r["step"] == 1)
    assert row["reward/mark/mean"] == pytest.approx(values.mean().item(), abs=1e-9)
    assert row["reward/mark/std"] == pytest.approx(values.std(unbiased=False).item(), abs=1e-9)


def _disagreeing_worker(rank, port, results, toy):
    with worker_accelerator(rank, port) as accelerator:
        query_responses, context_length, rows, tokenizer = toy_batch(toy, COMPLETIONS[rank * 2:rank * 2 + 2])

        def fails_on_rank_one(completions, **columns):
            if rank == 1:
                raise KeyError("only here")
            return [1.0] * len(completions)

        sources = rs.Rewards(tokenizer, functions=[rs.RewardFunction("fails_on_rank_one", fails_on_rank_one)])
        try:
            sources(query_responses, context_length, rows, accelerator)
            outcome = "returned"
        except rs.RewardFunctionError as e:
            outcome = str(e)

        def logs(completions, log_metric, **columns):  # log_metric on both processes, and on one only
            log_metric("both", float(rank))
            if rank == 1:
                log_metric("rank_one_only", 5.0)
            return [1.0] * len(completions)

        sources = rs.Rewards(tokenizer, functions=[rs.RewardFunction("logs", logs)])
        _, per_source = sources(query_responses, context_length, rows, accelerator)
        results[rank] = (outcome, sources.metrics(per_source, accelerator))


def test_a_function_failing_on_one_process_stops_both(toy):
    """No process is left waiting in a collective: the failure is agreed, and each process raises."""
    from conftest import run_two_processes

    (first, first_metrics), (second, second_metrics) = run_two_processes(_disagreeing_worker, toy)
    assert first == "a reward function failed on another process (its error is above)"
    assert second.startswith("reward function 'fails_on_rank_one' raised KeyError: 'only here' on row 0")
    # log_metric values are averaged over both processes, even a metric only one of them logged
    assert first_metrics["both"] == second_metrics["both"] == 0.5
    assert first_metrics["rank_one_only"] == second_metrics["rank_one_only"] == 5.0


def test_missing_eos_penalty():
    """--missing_eos_penalty: subtracted where a completion was truncated (no EOS), nothing with None."""
    truncated = torch.tensor([True, False, False])
    scores = torch.tensor([1.0, 1.0, -2.0])
    assert rs.penalise_missing_eos(scores, truncated, 2.5).tolist() == [-1.5, 1.0, -2.0]
    assert rs.penalise_missing_eos(scores, truncated, None).tolist() == [1.0, 1.0, -2.0]
