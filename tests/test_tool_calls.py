"""Tool calls as models write them (tool_calls.py): every chat format users bring is detected from its template and
read back, malformed calls of every shape become error turns (never an exception), async tools are awaited, and a
tool result longer than --max_tool_result_tokens is cut.

Templates: Llama 3.1's and GPT-OSS's as their models ship them (tests/chat_templates/, copied from TRL's
trl/chat_templates, Apache-2.0); Mistral's v3 and v11 tool formats and Qwen 3.5's XML calls written here after the
models' templates (the parts that render tools). Each runs on a character-level tokenizer built here, and episodes are
played by a scripted sampler whose turns are what the template itself renders, so the expected tokens are known.
"""

import json
import os
import time
import types

import pytest
from conftest import QWEN_TEMPLATE, char_tokenizer

from plumbing import episodes as ep
from plumbing import tool_calls as tc
from plumbing.errors import UserError

TEMPLATES = os.path.join(os.path.dirname(__file__), "chat_templates")


def lookup(box: str) -> str:
    """Look up the letters kept in a box.

    Args:
        box: the box number
    """
    return {"4 8 2": "k c f"}.get(box, "a")


def ping() -> str:
    """Answer pong (a tool without arguments)."""
    return "pong"


def postcode(zip: str, count: int, exact: bool = False) -> str:
    """Describe a postcode (a string of digits, as a tool declares it).

    Args:
        zip: the postcode, digits kept as written
        count: how many to describe
        exact: match the postcode exactly
    """
    return json.dumps({"zip": zip, "count": count, "exact": exact})


async def slow_lookup(box: str) -> dict:
    """Look up the letters kept in a box, asynchronously.

    Args:
        box: the box number
    """
    await __import__("asyncio").sleep(0.01)
    if box == "hang":
        await __import__("asyncio").sleep(30)
    return {"letters": lookup(box)}


MISTRAL_V3 = r"""{{- bos_token }}
{%- for message in messages %}
  {%- if message.role == 'user' %}
    {%- if loop.first and tools %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
    {{- '[INST] ' + message.content + '[/INST]' }}
  {%- elif message.role == 'assistant' and message.tool_calls %}
    {{- '[TOOL_CALLS] [' }}
    {%- for call in message.tool_calls %}
      {%- if call.id is not defined or call.id | length != 9 %}
        {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
      {{- '{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson)
          + ', "id": "' + call.id + '"}' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
    {%- endfor %}{{- ']' + eos_token }}
  {%- elif message.role == 'assistant' %}{{- ' ' + message.content + eos_token }}
  {%- elif message.role == 'tool' %}
    {%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
      {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
    {{- '[TOOL_RESULTS] {"content": ' + (message.content | tojson) + ', "call_id": "' + message.tool_call_id
        + '"}[/TOOL_RESULTS]' }}
  {%- endif %}
{%- endfor %}"""

MISTRAL_V11 = r"""{{- bos_token }}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'user' %}{{- '[INST]' + message.content + '[/INST]' }}
  {%- elif message.role == 'assistant' %}{{- message.content }}
    {%- for call in message.tool_calls or [] %}
      {{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' + (call.function.arguments | tojson) }}
    {%- endfor %}{{- eos_token }}
  {%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
  {%- endif %}
{%- endfor %}"""

QWEN35 = r"""
{%- if tools %}{{- '<|im_start|>system\n# Tools' }}{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '<|im_end|>\n' }}{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'user' %}{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
  {%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\n' + message.content }}
    {%- for call in message.tool_calls or [] %}
      {{- '<tool_call>\n<function=' + call.function.name + '>\n' }}
      {%- for key, value in call.function.arguments | items %}
        {{- '<parameter=' + key + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' }}
      {%- endfor %}{{- '</function>\n</tool_call>' }}
    {%- endfor %}{{- '<|im_end|>\n' }}
  {%- elif message.role == 'tool' %}
    {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

UNREADABLE = r"""
{%- for message in messages %}
  {%- if message.role == 'user' %}{{- 'USER: ' + message.content + '</s>' }}
  {%- elif message.role == 'assistant' %}{{- 'ASSISTANT: ' + message.content }}
    {%- for call in message.tool_calls or [] %}{{- 'CALL ' + call.function.name + '(' }}
      {%- for key, value in call.function.arguments | items %}{{- key + '=' + value }}{%- endfor %}{{- ')' }}
    {%- endfor %}{{- '</s>' }}
  {%- elif message.role == 'tool' %}{{- 'RESULT: ' + message.content + '</s>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'ASSISTANT: ' }}{%- endif %}"""


def read(name):
    with open(os.path.join(TEMPLATES, name)) as f:
        return f.read()


def tokenizers():
    """name -> (tokenizer, the format it must be read in)."""
    llama_specials = ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"]
    return {
        "qwen2.5": (char_tokenizer(QWEN_TEMPLATE, "<|im_end|>", ["<|im_start|>"], ["<tool_call>", "</tool_call>"]),
                    "hermes"),
        "qwen3.5": (char_tokenizer(QWEN35, "<|im_end|>", ["<|im_start|>"], ["<tool_call>", "</tool_call>"]),
                    "hermes"),
        "llama3.1": (char_tokenizer(read("llama3_1.jinja"), "<|eot_id|>", llama_specials,
                                    bos_token="<|begin_of_text|>"), "llama3"),
        "mistral_v3": (char_tokenizer(MISTRAL_V3, "</s>", ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                                           "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                                      bos_token="<s>"), "mistral"),
        "mistral_v11": (char_tokenizer(MISTRAL_V11, "</s>", ["[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]",
                                                             "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                                             "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                                       bos_token="<s>"), "mistral"),
        "gpt_oss": (char_tokenizer(read("gpt_oss.jinja"), "<|return|>", ["<|start|>", "<|end|>", "<|message|>",
                                                                        "<|channel|>", "<|constrain|>", "<|call|>"]),
                    "gpt_oss"),
    }


def scripted(tokenizer, turns):
    """A sampler writing fixed turns (text), one per call, to a single episode."""
    state = {"turn": 0}

    def generate(sequences, budgets, first_turn):
        ids = tokenizer(turns[state["turn"]], add_special_tokens=False)["input_ids"][:budgets[0]]
        state["turn"] += 1
        return [ids], [[-1.0] * len(ids)], None

    return generate


def play(tokenizer, toolset, turns, prompt, **kwargs):
    episodes = ep.start_episodes([prompt], [{"prompt": prompt}], toolset, tokenizer, [None], max_prompt_length=10_000)
    kwargs = {"context_limit": 100_000, "max_tool_calling_iterations": None, "tool_timeout": 5.0, **kwargs}
    return ep.run_episodes(episodes, scripted(tokenizer, turns), tokenizer, toolset, response_length=2000,
                           **kwargs)[0]


def cut_after_stop(tokenizer, text, stop_ids):
    """`text` up to and including its last turn-ending token (what is sampled; the template's text after it is not)."""
    stops = [tokenizer.convert_ids_to_tokens(i) for i in set(stop_ids) | {tokenizer.eos_token_id}]
    end = max(text.rindex(t) + len(t) for t in stops if t in text)
    return text[:end]


def rendered_turns(tokenizer, messages, stop_ids):
    """The text the template writes for each assistant message of `messages` (after the one before it): what a
    model trained on this template samples."""
    out = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            after = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
            assert after.startswith(before)
            out.append(cut_after_stop(tokenizer, after[len(before):], stop_ids))
    return out


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3.5", "llama3.1", "mistral_v3", "mistral_v11", "gpt_oss"])
def test_each_format_is_detected_and_its_calls_run_token_for_token(name):
    tokenizer, expected_format = tokenizers()[name]
    toolset = ep.load_toolset(types.SimpleNamespace(tools=[f"{__file__}:lookup"], environment=None), tokenizer)
    assert toolset.call_format == expected_format
    prompt = [{"role": "user", "content": "sort box 4 8 2"}]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"box": "4 8 2"}}}
    if name == "mistral_v3":
        call["id"] = "a1b2c3d4e"
    conversation = prompt + [{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "name": "lookup", "content": "k c f",
                              **({"tool_call_id": "a1b2c3d4e"} if name == "mistral_v3" else {})},
                             {"role": "assistant", "content": "c f k"}]
    turns = rendered_turns(tokenizer, conversation, toolset.stop_ids)
    episode = play(tokenizer, toolset, turns, prompt)
    assert (episode.tool_calls, episode.tool_failures, episode.turns, episode.truncated) == (1, 0, 2, False)
    assert episode.messages[0]["tool_calls"] == [call]
    assert episode.messages[1]["content"] == "k c f" and episode.messages[2]["content"] == "c f k"
    # token in, token out: the episode is the template's rendering of its conversation
    expected = cut_after_stop(tokenizer, tokenizer.apply_chat_template(conversation, tokenize=False,
                                                                       tools=toolset.schemas), toolset.stop_ids)
    assert tokenizer.decode(episode.prompt_ids + episode.response_ids) == expected


def test_gpt_oss_harmony_calls_and_their_turn_end():
    # harmony writes the recipient before or after the channel; both read, and the final channel is the content
    for turn in ['<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{"box": "4 8 2"}<|call|>',
                 ' to=functions.lookup<|channel|>commentary json<|message|>{"box": "4 8 2"}<|call|>']:
        calls, _ = tc._gpt_oss(turn, turn)
        assert [tc.normalise_call(c) for c in calls] == [
            {"type": "function", "function": {"name": "lookup", "arguments": {"box": "4 8 2"}}}]
    final = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>c f k<|return|>"
    assert tc._gpt_oss(final, final) == ([], "c f k")
    # a calling turn ends at <|call|>, not at the EOS (<|return|>): both end a turn
    tokenizer, _ = tokenizers()["gpt_oss"]
    toolset = ep.load_toolset(types.SimpleNamespace(tools=[f"{__file__}:lookup"], environment=None), tokenizer)
    assert toolset.stop_ids == [tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    # a template whose calling turn ends in plain text could never end a sampled call's turn
    no_end = QWEN_TEMPLATE.replace("{%- endfor %}{{- '<|im_end|>\\n' }}",
                                   "{%- endfor %}{{- '' if message.tool_calls else '<|im_end|>\\n' }}")
    assert no_end != QWEN_TEMPLATE
    tokenizer = char_tokenizer(no_end, "<|im_end|>", ["<|im_start|>"], ["<tool_call>", "</tool_call>"])
    with pytest.raises(UserError, match=r"ends a tool-calling turn with .*</tool_call>', not a special token"):
        ep.load_toolset(types.SimpleNamespace(tools=[f"{__file__}:lookup"], environment=None), tokenizer)


def test_a_template_whose_calls_cannot_be_read_stops_at_start_up_naming_it():
    tokenizer = char_tokenizer(UNREADABLE, "</s>")
    tokenizer.name_or_path = "my-org/call-syntax-model"
    with pytest.raises(UserError, match=r"my-org/call-syntax-model writes a tool call as 'CALL lookup\(x=sentinel"):
        ep.load_toolset(types.SimpleNamespace(tools=[f"{__file__}:lookup"], environment=None), tokenizer)


@pytest.mark.parametrize("raw, expected", [
    ({"name": "ping"}, {"type": "function", "function": {"name": "ping", "arguments": {}}}),  # Qwen 3.5: no args
    ({"name": "ping", "arguments": None}, {"type": "function", "function": {"name": "ping", "arguments": {}}}),
    ({"name": "f", "arguments": '{"a": 1}'}, {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}),
    ({"name": "f", "parameters": {"a": 1}}, {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}),
    ({"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f", "arguments": {}}}),
    ({"name": "f", "arguments": {}, "id": "abc"}, {"type": "function", "function": {"name": "f", "arguments": {}},
                                                   "id": "abc"}),
    ({"arguments": {"a": 1}}, "needs a name"),
    ({"name": 3}, "needs a name"),
    ({"function": "f"}, "needs a name"),
    ([1, 2], "must be a JSON object"),
    ("lookup", "must be a JSON object"),
    ({"name": "f", "arguments": [1]}, "must be an object"),
    ({"name": "f", "arguments": "{oops"}, "not JSON"),
])
def test_normalise_call_by_hand(raw, expected):
    call = tc.normalise_call(raw)
    if isinstance(expected, dict):
        assert call == expected
    else:
        assert set(call) == {"error"} and expected in call["error"]


# TRL's response template for Qwen 3 (trl/chat_template_utils.py qwen3_template), as TRL's add_response_schema sets it
QWEN3_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


@pytest.mark.parametrize("response_template", [False, True], ids=["our_parser", "parse_response"])
def test_malformed_calls_of_every_shape_become_error_turns(response_template):
    tokenizer = char_tokenizer(QWEN_TEMPLATE, "<|im_end|>", ["<|im_start|>"], ["<tool_call>", "</tool_call>"])
    if response_template:
        if not hasattr(tokenizer, "parse_response"):
            pytest.skip("transformers < 5.13 has no parse_response")
        tokenizer.response_template = QWEN3_RESPONSE_TEMPLATE
    args = types.SimpleNamespace(tools=[f"{__file__}:lookup", f"{__file__}:ping"], environment=None)
    toolset = ep.load_toolset(args, tokenizer)
    assert toolset.call_format == ("response_template" if response_template else "hermes")
    prompt = [{"role": "user", "content": "sort box 4 8 2"}]
    turns = ['<tool_call>\n{"name": "ping"}\n</tool_call><|im_end|>',  # no arguments: a valid call (TRL)
             '<tool_call>\n{"arguments": {"box": "4 8 2"}}\n</tool_call><|im_end|>',  # no name
             '<tool_call>\n["lookup", "4 8 2"]\n</tool_call><|im_end|>',  # not an object
             '<tool_call>\n{"name": "lookup", "arguments": ["4 8 2"]}\n</tool_call><|im_end|>',  # arguments a list
             '<tool_call>\n{"name": "lookup", "arguments": {"box": "4 8 2"}\n</tool_call><|im_end|>',  # bad JSON
             "c f k<|im_end|>"]
    episode = play(tokenizer, toolset, turns, prompt)
    results = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert results[0] == "pong"
    assert all(json.loads(r).get("error") for r in results[1:]), results
    assert (episode.tool_calls, episode.tool_failures, episode.turns) == (5, 4, 6)
    metrics = ep.episode_metrics([episode], types.SimpleNamespace(num_processes=1, device="cpu"))
    assert metrics["tools/failure_frequency"] == pytest.approx(4 / 5)


def test_async_tools_are_awaited_under_the_timeout():
    tools = {"slow_lookup": slow_lookup, "ping": ping}
    call = {"type": "function", "function": {"name": "slow_lookup", "arguments": {"box": "4 8 2"}}}
    assert tc.call_tool(tools, call, timeout=5.0) == ('{"letters": "k c f"}', False)
    call["function"]["arguments"] = {"box": "hang"}
    start = time.time()
    result, failed = tc.call_tool(tools, call, timeout=0.5)
    assert failed and json.loads(result) == {"error": "slow_lookup timed out after 0.5 s"} and time.time() - start < 5
    # an async tool's schema is read like a sync one's, and it runs inside an episode
    tokenizer = char_tokenizer(QWEN_TEMPLATE, "<|im_end|>", ["<|im_start|>"], ["<tool_call>", "</tool_call>"])
    toolset = ep.load_toolset(types.SimpleNamespace(tools=[f"{__file__}:slow_lookup"], environment=None), tokenizer)
    turns = ['<tool_call>\n{"name": "slow_lookup", "arguments": {"box": "4 8 2"}}\n</tool_call><|im_end|>',
             "c f k<|im_end|>"]
    episode = play(tokenizer, toolset, turns, [{"role": "user", "content": "sort box 4 8 2"}])
    assert episode.messages[1]["content"] == '{"letters": "k c f"}' and episode.tool_failures == 0


def test_tool_results_are_cut_to_max_tool_result_tokens():
    tokenizer = char_tokenizer(QWEN_TEMPLATE, "<|im_end|>", ["<|im_start|>"], ["<tool_call>", "</tool_call>"])
    # one token per character here: 10 tokens cut to 4, the marker saying how many went
    assert tc.truncate_result(tokenizer, "abcdefghij", 4) == ("abcd... [6 tokens truncated]", True)
    assert tc.truncate_result(tokenizer, "abcd", 4) == ("abcd", False)
    assert tc.truncate_result(tokenizer, "abcdefghij", None) == ("abcdefghij", False)
    toolset = ep.load_toolset(types.SimpleNamespace(tools=[f"{__file__}:lookup"], environment=None), tokenizer)
    turns = ['<tool_call>\n{"name": "lookup", "arguments": {"box": "4 8 2"}}\n</tool_call><|im_end|>',
             "c f k<|im_end|>"]
    episode = play(tokenizer, toolset, turns, [{"role": "user", "content": "sort box 4 8 2"}],
                   max_tool_result_tokens=3)
    assert episode.messages[1]["content"] == "k c... [2 tokens truncated]" and episode.truncated_results == 1
    metrics = ep.episode_metrics([episode], types.SimpleNamespace(num_processes=1, device="cpu"))
    assert metrics["tools/truncated_results"] == 1 and metrics["episodes/truncated_count"] == 0
    with pytest.raises(UserError, match="--max_tool_result_tokens must be >= 1"):
        ep.ToolFlags(max_tool_result_tokens=0).check()


def test_generation_stops_at_every_turn_end():
    """HF generate takes the list as the config's eos_token_id; vLLM as its stop_token_ids."""
    from transformers import GenerationConfig

    from plumbing import vllm_generation as vg

    tokenizer, _ = tokenizers()["gpt_oss"]
    call, eos = tokenizer.convert_tokens_to_ids("<|call|>"), tokenizer.eos_token_id
    assert vg.stop_token_ids(GenerationConfig(eos_token_id=[eos, call]), tokenizer) == [eos, call]
    assert vg.stop_token_ids(GenerationConfig(eos_token_id=eos), tokenizer) == [eos]


def test_qwen35_xml_values_take_the_tools_declared_types():
    """Issue 63: Qwen 3.5's <parameter> values are text; each is read as its parameter's declared type (TRL's parser
    and vLLM's qwen3_coder parser keep a `zip: str` of digits a string; before, every value was JSON-decoded and the
    tool got the int 75001). Undeclared parameters stay JSON where they parse."""
    tokenizer, _ = tokenizers()["qwen3.5"]
    toolset = ep.load_toolset(types.SimpleNamespace(tools=[f"{__file__}:postcode"], environment=None), tokenizer)
    assert toolset.call_format == "hermes"
    call = ("<tool_call>\n<function=postcode>\n<parameter=zip>\n75001\n</parameter>\n<parameter=count>\n3\n"
            "</parameter>\n<parameter=exact>\ntrue\n</parameter>\n<parameter=extra>\n[1, 2]\n</parameter>\n"
            "</function>\n</tool_call>")
    calls, _ = tc._hermes(call, call, tc.parameter_types(toolset.schemas))
    assert calls == [{"name": "postcode", "arguments": {"zip": "75001", "count": 3, "exact": True, "extra": [1, 2]}}]
    assert tc._hermes(call, call)[0][0]["arguments"]["zip"] == 75001  # without the schemas: JSON where it parses
    episode = play(tokenizer, toolset, [call.replace("<parameter=extra>\n[1, 2]\n</parameter>\n", "") + "<|im_end|>",
                                        "done<|im_end|>"], [{"role": "user", "content": "describe 75001"}])
    assert episode.tool_failures == 0
    assert json.loads(episode.messages[1]["content"]) == {"zip": "75001", "count": 3, "exact": True}


def test_llama3_second_call_in_one_turn_is_an_error_turn():
    """Issue 63: Llama 3's format holds one call a turn; a second one (as `; ` or a new line after the first) ran the
    first and dropped the second silently. Now the first runs and the second is an error the model reads next turn."""
    tokenizer, _ = tokenizers()["llama3.1"]
    toolset = ep.load_toolset(types.SimpleNamespace(tools=[f"{__file__}:lookup"], environment=None), tokenizer)
    first = '{"name": "lookup", "parameters": {"box": "4 8 2"}}'
    for separator in ("; ", "\n"):
        turn = first + separator + '{"name": "lookup", "parameters": {"box": "1"}}<|eot_id|>'
        episode = play(tokenizer, toolset, [turn, "c f k<|eot_id|>"], [{"role": "user", "content": "sort box 4 8 2"}])
        results = [m["content"] for m in episode.messages if m["role"] == "tool"]
        assert (episode.tool_calls, episode.tool_failures) == (2, 1)
        assert results[0] == "k c f" and "one call per turn" in json.loads(results[1])["error"]
    calls, _ = tc._llama3(first, first + "<|eot_id|>")  # one call: as before
    assert calls == [json.loads(first)]
