"""The toy tool world (toy_tools.py): the lookup tool, the gold scorer by hand, a chat template whose tokens only
append (what the multi-turn episodes rely on), and a built SFT policy that calls the tool sometimes and leaves RL
room."""

import json
import os
import random

import pytest

from toy_worlds import toy_tools

BOX = "0 0 0"  # holds f j h e (sorted: e f h j)
CALL_JSON = '{"name": "lookup", "arguments": {"box": "0 0 0"}}'
CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"box": BOX}}}
CONVERSATION = [{"role": "user", "content": f"sort box {BOX}"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "name": "lookup", "content": "f j h e"},
                {"role": "assistant", "content": "e f h j"}]


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tools.make_tokenizer()


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _render(tokenizer, messages, generation=False, tools=True):
    return tokenizer.apply_chat_template(messages, tools=toy_tools.tool_schemas() if tools else None, tokenize=False,
                                         add_generation_prompt=generation)


# ---------------------------------------------------------------------------------------------------------
# The tool and the gold scorer
# ---------------------------------------------------------------------------------------------------------
def test_hidden_letters_are_fixed_per_box():
    assert toy_tools.hidden_letters(BOX) == list("fjhe")  # a changed box would silently change every build
    assert toy_tools.hidden_letters("4 8 2") == list("jcfbgd")
    sizes = set()
    for n in range(1000):
        letters = toy_tools.hidden_letters(" ".join(f"{n:03d}"))
        assert len(set(letters)) == len(letters) and set(letters) <= set("abcdefghijkl")
        sizes.add(len(letters))
    assert sizes == {3, 4, 5, 6}


def test_lookup_returns_the_stored_order_and_refuses_other_boxes():
    assert toy_tools.lookup(BOX) == "f j h e"
    for bad in ["000", "0 0", "0 0 0 0", "0  0 0", " 0 0 0", "0 0 0 ", "a b c", "0,0,0", 0]:
        with pytest.raises(ValueError, match="no box"):
            toy_tools.lookup(bad)
    assert json.loads(toy_tools.tool_result('{"name": "lookup", "arguments": {"box": "0 0"}}')) == {
        "error": "ValueError: no box '0 0'"}
    assert toy_tools.tool_result(CALL_JSON) == "f j h e"
    for bad in ['{"name": "lookup"', '{"name": "other", "arguments": {"box": "0 0 0"}}',
                '{"name": "lookup", "arguments": {"crate": "0 0 0"}}']:
        assert set(json.loads(toy_tools.tool_result(bad))) == {"error"}


def test_lookup_schema():
    from transformers.utils import get_json_schema

    schema = get_json_schema(toy_tools.lookup)
    assert toy_tools.tool_schemas() == [schema]
    assert schema["type"] == "function" and schema["function"]["name"] == "lookup"
    assert schema["function"]["parameters"]["properties"]["box"]["type"] == "string"
    assert schema["function"]["parameters"]["required"] == ["box"]


@pytest.mark.parametrize("completion, expected", [
    ("e f h j", 1.0),
    (" e f h j [EOS]", 1.0),
    ("f j h e", 0.25),  # the lazy copy of the tool's order: only h is in place
    ("e f h j k", 0.8),  # 4 matches / 5 letters
    ("e f h", 0.75),
    ("e f x 7 h j", 1.0),  # only the letters a..l count
    ("", 0.0),
    (f"<tool_call> {CALL_JSON} </tool_call> <tool> f j h e <assistant> e f h j", 1.0),  # a whole decoded episode
    (f"<tool_call> {CALL_JSON} </tool_call> [EOS] <tool> f j h e <assistant> f j h e [EOS]", 0.25),
    (f"<assistant> <tool_call> {CALL_JSON} </tool_call> <tool> f j h e <assistant> <tool_call> {CALL_JSON} "
     "</tool_call>", 0.0),  # ended on a call: no answer
    (f"<tool_call> {CALL_JSON} </tool_call> <tool> e f h j", 0.0),  # the tool's letters are not an answer
    ("<tool_call> {\"name\": \"lookup\", \"arguments\": {\"box\": \"e f", 0.0),  # an unclosed call is dropped
])
def test_gold_score_by_hand(completion, expected):
    assert toy_tools.gold_score(f"sort box {BOX}", completion) == pytest.approx(expected)


def test_gold_score_reads_the_box_from_any_prompt(tokenizer):
    rendered = _render(tokenizer, CONVERSATION[:1], generation=True)
    assert toy_tools.gold_score(rendered, "e f h j") == 1.0
    assert toy_tools.gold_score(" box\n0  0 0 ", "e f h j") == 1.0
    assert toy_tools.gold_score("sort the letters", "e f h j") == 0.0
    assert toy_tools.gold_score("sort box 0 0", "e f h j") == 0.0


def test_gold_scorer_lookup(tmp_path):
    from plumbing import data_utils as du
    from toy_worlds import toy_task

    assert toy_tools.gold_scorer("toy_tools") is toy_tools.gold_score
    assert du.gold_scorer("toy_tools") is toy_tools.gold_score
    inside = os.path.join(toy_task.cache_root(), toy_tools.folder_name(0), "prompt")
    assert toy_tools.gold_scorer(inside) is du.gold_scorer(inside) is toy_tools.gold_score
    assert toy_tools.gold_scorer(os.path.join(toy_task.cache_root(), toy_task.folder_name(0), "prompt")) is None
    assert toy_tools.gold_scorer("toy") is None and toy_tools.gold_scorer(str(tmp_path)) is None


# ---------------------------------------------------------------------------------------------------------
# The chat template: one token per word, and tokens that only append
# ---------------------------------------------------------------------------------------------------------
def test_template_renders_the_documented_text(tokenizer):
    assert _render(tokenizer, CONVERSATION) == (
        f"<tools> lookup </tools> <user> sort box {BOX} <assistant> <tool_call> {CALL_JSON} </tool_call> [EOS] "
        "<tool> f j h e <assistant> e f h j [EOS] ")
    assert _render(tokenizer, CONVERSATION[:1], tools=False, generation=True) == f"<user> sort box {BOX} <assistant> "
    # arguments as a JSON string, and calls without the "function" wrapper, render the same
    as_text = json.dumps({"box": BOX})
    for call in [{"type": "function", "function": {"name": "lookup", "arguments": as_text}},
                 {"name": "lookup", "arguments": {"box": BOX}}, {"name": "lookup", "arguments": as_text}]:
        messages = [CONVERSATION[0], {"role": "assistant", "content": "", "tool_calls": [call]}]
        assert _render(tokenizer, messages) == _render(tokenizer, CONVERSATION[:2])


def test_template_only_appends_token_for_token(tokenizer):
    full = _ids(tokenizer, _render(tokenizer, CONVERSATION))
    assert tokenizer.unk_token_id not in full
    prompt = _ids(tokenizer, _render(tokenizer, CONVERSATION[:1], generation=True))
    call_turn = _ids(tokenizer, f"<tool_call> {CALL_JSON} </tool_call> [EOS]")
    assert tokenizer.convert_ids_to_tokens(call_turn) == [
        "<tool_call>", '{"name":', '"lookup",', '"arguments":', '{"box":', '"0', "0", '0"}}', "</tool_call>", "[EOS]"]
    # the tool suffix as the episode loop computes it: the rendering after the call turn's [EOS], up to the next
    # generation prompt included
    head = _ids(tokenizer, _render(tokenizer, CONVERSATION[:2]))
    with_tool = _ids(tokenizer, _render(tokenizer, CONVERSATION[:3], generation=True))
    assert with_tool[:len(head)] == head and head[-1] == tokenizer.eos_token_id
    suffix = with_tool[len(head):]
    assert suffix == _ids(tokenizer, "<tool> f j h e <assistant>")
    answer = _ids(tokenizer, "e f h j [EOS]")
    assert full == prompt + call_turn + suffix + answer
    assert head == prompt + call_turn

    # a sampled call turn decodes to the exact JSON between the tags
    text = tokenizer.decode(call_turn, skip_special_tokens=True)
    inner = text.split("<tool_call>")[1].split("</tool_call>")[0].strip()
    assert inner == CALL_JSON and json.loads(inner) == {"name": "lookup", "arguments": {"box": BOX}}
    rendered = _render(tokenizer, CONVERSATION)
    assert tokenizer.decode(full, skip_special_tokens=True) == rendered.replace(" [EOS]", "").strip()


def test_played_episode_is_the_rendered_conversation(tokenizer):
    """Token in, token out on the toy template: an episode played by episodes.run_episodes (a scripted sampler writes
    the call turn and the answer; the lookup tool answers) is exactly the template's rendering of the finished
    conversation, and the action mask is the assistant turns (the template is append-only)."""
    from test_episodes import play

    from plumbing import episodes as ep

    toolset = ep.Toolset([toy_tools.lookup], None, toy_tools.tool_schemas())
    [episode] = play(tokenizer, toolset, [[f"<tool_call> {CALL_JSON} </tool_call> [EOS]", "e f h j [EOS]"]],
                     prompts=(CONVERSATION[:1],))
    assert episode.tool_calls == 1 and episode.tool_failures == 0 and not episode.truncated
    assert episode.messages[1] == {"role": "tool", "name": "lookup", "content": "f j h e"}
    assert episode.prompt_ids + episode.response_ids == _ids(tokenizer, _render(tokenizer, CONVERSATION[:1]
                                                                                 + episode.messages))
    ids, mask = toy_tools.conversation_ids(tokenizer, CONVERSATION[:1] + episode.messages, toy_tools.tool_schemas())
    assert [False] * len(episode.prompt_ids) + episode.action_mask == mask


def test_conversation_mask_is_the_assistant_turns(tokenizer):
    ids, mask = toy_tools.conversation_ids(tokenizer, CONVERSATION, toy_tools.tool_schemas())
    trained = [token for token, m in zip(tokenizer.convert_ids_to_tokens(ids), mask) if m]
    assert trained == ["<tool_call>", '{"name":', '"lookup",', '"arguments":', '{"box":', '"0', "0", '0"}}',
                       "</tool_call>", "[EOS]", "e", "f", "h", "j", "[EOS]"]


def test_demonstrations():
    rng = random.Random(0)
    tool, typo, answers = 0, 0, []
    for n in range(2000):
        box = " ".join(f"{n % 1000:03d}")
        messages = toy_tools.demonstration(box, rng)
        assert messages[0] == {"role": "user", "content": f"sort box {box}"}
        assert messages[-1]["role"] == "assistant" and set(messages[-1]["content"].split()) <= set("abcdefghijkl")
        if len(messages) == 4:
            tool += 1
            asked = messages[1]["tool_calls"][0]["function"]["arguments"]["box"]
            assert messages[2]["content"] == toy_tools.lookup(asked)
            typo += asked != box
            answers.append(messages[-1]["content"].split() == sorted(messages[2]["content"].split()))
        else:
            assert len(messages) == 2 and messages[1]["content"].split() == sorted(messages[1]["content"].split())
    assert abs(tool / 2000 - toy_tools.P_TOOL) < 0.05
    assert 0.03 < typo / tool < 0.15
    assert 0.25 < sum(answers) / len(answers) < 0.6  # sorted 30%, plus copies that happened to be sorted


# ---------------------------------------------------------------------------------------------------------
# The build (once per test session, cached)
# ---------------------------------------------------------------------------------------------------------
def test_sft_policy_calls_the_tool_sometimes_and_leaves_rl_room(toy_tools_world):
    report = json.load(open(os.path.join(toy_tools_world["root"], "report.json")))
    assert 0.25 <= report["sft_tool_call_rate_sampled"] <= 0.65, report
    assert report["sft_tool_success_rate_sampled"] >= 0.9, report  # it copies the box's digits into valid JSON
    assert report["sft_tool_right_box_rate_sampled"] >= 0.8, report
    assert report["sft_gold_with_tool_sampled"] > report["sft_gold_without_tool_sampled"] + 0.1, report  # RL's signal
    assert report["sft_gold_sampled"] < 0.35, report  # always lookup-then-sort scores 1.0
    assert report["sft_gold_greedy"] < 0.5, report  # greedy: a lazy copy of the tool's letters, not the answer
    for name in ("policy", "tokenizer", "prompt_dataset", "sft_dataset"):
        assert os.path.isdir(toy_tools_world[name]), name


def test_built_datasets(toy_tools_world, tokenizer):
    from datasets import load_from_disk

    prompts = load_from_disk(toy_tools_world["prompt_dataset"])
    assert (len(prompts["train"]), len(prompts["test"])) == (744, 256)
    boxes = {split: {row["prompt"][0]["content"] for row in prompts[split]} for split in ("train", "test")}
    assert not boxes["train"] & boxes["test"] and len(boxes["train"] | boxes["test"]) == 1000
    assert prompts["test"][0]["prompt"] == [{"role": "user", "content": prompts["test"][0]["prompt"][0]["content"]}]

    sft_data = load_from_disk(toy_tools_world["sft_dataset"])
    assert (len(sft_data["train"]), len(sft_data["test"])) == (4 * 744, 256)
    for row in sft_data["test"].select(range(32)):
        assert row["tools"] == toy_tools.tool_schemas()
        rendered = tokenizer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
        assert tokenizer.unk_token_id not in _ids(tokenizer, rendered)
        assert rendered.startswith("<tools> lookup </tools> <user> sort box ") and rendered.endswith("[EOS] ")


def test_built_tokenizer_and_aliases(toy_tools_world, tokenizer):
    from transformers import AutoTokenizer

    from plumbing import data_utils as du
    from plumbing import run_utils as ru
    from plumbing.errors import UserError

    for folder in ("tokenizer", "policy"):
        saved = AutoTokenizer.from_pretrained(toy_tools_world[folder])
        assert saved.chat_template == toy_tools.CHAT_TEMPLATE and saved.get_vocab() == tokenizer.get_vocab()
        assert _render(saved, CONVERSATION) == _render(tokenizer, CONVERSATION)
    assert du.toy_tools_world() == toy_tools_world
    assert du.load_prompt_dataset("toy_tools", "test")[0]["prompt"][0]["content"].startswith("sort box ")
    assert ru.resolve_model("toy_tools") == toy_tools_world["policy"]
    assert ru.default_dataset("toy_tools") == "toy_tools"
    with pytest.raises(UserError, match="--reward_funcs gold"):
        ru.default_reward_model("toy_tools")


def test_overlong_shaping_counts_the_sampled_tokens_of_an_episode(tokenizer):
    """The ideal episode on a 5-letter box: 10 sampled tokens (the call, EOS) + 7 tool tokens (`<tool>`, 5 letters,
    `<assistant>`) + 6 sampled (the answer, EOS) = 16 sampled of 23. With the alias's --response_length 24 and
    --overlong_buffer_length 8 the penalty starts after 16 sampled tokens: none here (counting the tool tokens too,
    as completion_ids holds them, gave -0.875). One sampled token more costs 1/8."""
    from test_episodes import play

    from plumbing import episodes as ep
    from plumbing import reward_sources as rs

    boxes = [" ".join(f"{n:03d}") for n in range(1000)]
    boxes = [box for box in boxes if len(toy_tools.hidden_letters(box)) == 5][:2]
    turns = []
    for box, extra in zip(boxes, ("", " a")):  # the second answer one letter too long
        call = f'<tool_call> {{"name": "lookup", "arguments": {{"box": "{box}"}}}} </tool_call> [EOS]'
        turns.append([call, " ".join(sorted(toy_tools.hidden_letters(box))) + extra + " [EOS]"])
    prompts = [[{"role": "user", "content": f"sort box {box}"}] for box in boxes]
    toolset = ep.Toolset([toy_tools.lookup], None, toy_tools.tool_schemas())
    episodes = play(tokenizer, toolset, turns, prompts=prompts)
    assert [e.sampled for e in episodes] == [16, 17] and [len(e.response_ids) for e in episodes] == [23, 24]
    tensors = ep.episode_tensors(episodes, tokenizer.pad_token_id)
    sources = rs.Rewards(tokenizer, functions=[rs.overlong_penalty(24, 8, 1.0)])
    scores, _ = sources(tensors["query_responses"], tensors["context_length"], [{"prompt": p} for p in prompts],
                        episodes=episodes)
    assert scores.tolist() == [0.0, -0.125]
