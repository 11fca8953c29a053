"""Tool calls: read from a sampled turn in the chat format of the model's template, and run (TRL 1.16's rules).

The format is chosen once, at start-up (`call_format`): the tokenizer's own parser when it has a response template
(transformers >= 5.13 `parse_response`, e.g. set by TRL's `add_response_schema`), else the first of these that reads
back a call rendered by the chat template:
    hermes   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen 2.5/3, Hermes), or inside them
             `<function=name><parameter=key>value</parameter></function>` (Qwen 3.5, Qwen3-Coder, Nemotron 3)
    llama3   the whole turn one JSON object {"name": ..., "parameters": {...}} (Llama 3.1-3.3), after <|python_tag|>
    mistral  `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]` (v3 tokenizers) or
             `[TOOL_CALLS]name[ARGS]{...}` once per call (v11+: Mistral Small 3.2, Magistral, Devstral)
    gpt_oss  harmony: `to=functions.name ... <|message|>{...}<|call|>` (a calling turn ends at <|call|>, not the EOS:
             <|call|> then also ends a turn)
A template that renders tools but whose calls none of these reads stops the run at start-up, naming the template.

Every call, however it was written, goes through `normalise_call`: missing or null arguments are {} (a valid
no-argument call, TRL's rule), arguments as a JSON string are decoded; a call without a name, a non-object call or
arguments that are not an object become {"error": why}. `call_tool` runs a call (sync or async tool) under a timeout;
every failure is a tool message {"error": ...} the model reads next turn, counted in tools/failure_frequency, never
an exception. TRL keeps a malformed call as plain text and ends the episode; here the model is told, and the failure
counted, because a malformed call is a failed tool use the researcher wants to see in the metrics.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from typing import Callable, Dict, List, Optional, Tuple

from plumbing import run_utils as ru
from plumbing.errors import UserError

TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
MISTRAL_CALL = re.compile(r"^\s*([^\[\s]+?)(?:\[CALL_ID\]\s*(\w+))?\[ARGS\](.*)$", re.DOTALL)
HARMONY_CALL = re.compile(r"to=functions\.([^\s<]+)(.*?)<\|message\|>(.*?)(?:<\|call\|>|$)", re.DOTALL)
HARMONY_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.DOTALL)


def normalise_call(raw) -> dict:
    """One parsed call in any shape ({"function": {...}} or flat {"name", "arguments" | "parameters"}, an "id"
    kept) -> {"type": "function", "function": {"name", "arguments": dict}} or {"error": why}."""
    if not isinstance(raw, dict):
        return {"error": f"a tool call must be a JSON object with a name, got {_short(raw)}"}
    function = raw.get("function", raw)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        return {"error": f"a tool call needs a name, got {_short(raw)}"}
    arguments = function.get("arguments", function.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else None
        except ValueError:
            return {"error": f"the arguments of {function['name']} are not JSON: {_short(arguments)}"}
    arguments = {} if arguments is None else arguments
    if not isinstance(arguments, dict):
        return {"error": f"the arguments of {function['name']} must be an object, got {_short(arguments)}"}
    call = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    return {**call, "id": raw["id"]} if isinstance(raw.get("id"), str) else call


def _short(value, width: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value) if _jsonable(value) else repr(value)
    return repr(text if len(text) <= width else text[:width - 3] + "...")


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _json_prefix(text: str):
    """The JSON value at the start of `text` (what follows it, e.g. an end token, ignored). ValueError if none."""
    return json.JSONDecoder().raw_decode(text.lstrip())[0]


# ---------------------------------------------------------------------------------------------------------
# The formats: (text without special tokens, text with them, parameter_types) -> (raw calls or error calls, content)
# ---------------------------------------------------------------------------------------------------------
def parameter_types(schemas: Optional[List[dict]]) -> Dict[str, Dict[str, set]]:
    """Tool schemas (transformers' get_json_schema) -> {tool name: {parameter: the JSON types it declares}}."""
    types = {}
    for schema in schemas or []:
        function = schema.get("function", schema)
        properties = (function.get("parameters") or {}).get("properties") or {}
        declared = {key: prop.get("type") for key, prop in properties.items() if isinstance(prop, dict)}
        types[function.get("name")] = {key: set(t) if isinstance(t, list) else {t} for key, t in declared.items()}
    return types


def _xml_value(value: str, declared: Optional[set]):
    """A Qwen 3.5 <parameter> value (text) -> the tool's declared type: text for a string (as TRL's parser and vLLM's
    qwen3_coder one: "75001" stays a string for a `zip: str`), else JSON where it parses, else the text."""
    if declared and "string" in declared:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _hermes(text: str, raw_text: str, types: Optional[dict] = None) -> Tuple[list, str]:
    calls = []
    for block in TOOL_CALL_BLOCK.findall(text):
        function = XML_FUNCTION.search(block)
        if function is not None:  # Qwen 3.5's XML: each value read as its parameter's declared type
            name = function.group(1).strip()
            declared = (types or {}).get(name, {})
            arguments = {key.strip(): _xml_value(value, declared.get(key.strip()))
                         for key, value in XML_PARAMETER.findall(function.group(2))}
            calls.append({"name": name, "arguments": arguments})
            continue
        try:
            calls.append(json.loads(block.strip()))
        except ValueError as e:
            calls.append({"error": f"could not parse the tool call {block.strip()[:80]!r}: {e}"})
    content = TOOL_CALL_BLOCK.sub("", text)
    if "<tool_call>" in content:
        calls.append({"error": "a <tool_call> block is not closed"})
    return calls, content.strip()


def _llama3(text: str, raw_text: str, types: Optional[dict] = None) -> Tuple[list, str]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not re.match(r'^\{\s*"name"\s*:', body):
        return [], text.strip()
    try:
        call, end = json.JSONDecoder().raw_decode(body)
    except ValueError as e:
        return [{"error": f"could not parse the tool call {body[:80]!r}: {e}"}], ""
    rest = body[end:].strip().lstrip(";").strip()
    if rest.startswith("{"):  # Llama 3's format holds one call a turn: a second is an error the model reads
        return [call, {"error": f"the Llama 3 tool format takes one call per turn, a second came: {rest[:80]!r}"}], ""
    return [call], ""


def _mistral(text: str, raw_text: str, types: Optional[dict] = None) -> Tuple[list, str]:
    if "[TOOL_CALLS]" not in raw_text:
        return [], text.strip()
    head, *parts = raw_text.split("[TOOL_CALLS]")
    calls = []
    for part in parts:
        try:
            if part.lstrip().startswith("["):  # v3: a JSON list of calls
                listed = _json_prefix(part)
                calls += listed if isinstance(listed, list) else [listed]
                continue
            match = MISTRAL_CALL.match(part)
            if match is None:
                raise ValueError("expected name[ARGS]{...}")
            call = {"name": match.group(1), "arguments": _json_prefix(match.group(3))}
            calls.append({**call, "id": match.group(2)} if match.group(2) else call)
        except ValueError as e:
            calls.append({"error": f"could not parse the tool call {part.strip()[:80]!r}: {e}"})
    return calls, head


def _gpt_oss(text: str, raw_text: str, types: Optional[dict] = None) -> Tuple[list, str]:
    calls = []
    for name, _, arguments in HARMONY_CALL.findall(raw_text):
        try:
            calls.append({"name": name, "arguments": _json_prefix(arguments) if arguments.strip() else {}})
        except ValueError as e:
            calls.append({"error": f"could not parse the arguments of {name}: {arguments.strip()[:80]!r}: {e}"})
    final = HARMONY_FINAL.search(raw_text)
    return calls, final.group(1).strip() if final else ("" if calls else text.strip())


FORMATS: Dict[str, Callable] = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral, "gpt_oss": _gpt_oss}


def _strip_special(tokenizer, text: str) -> str:
    for token in sorted(tokenizer.all_special_tokens, key=len, reverse=True):
        text = text.replace(token, "")
    return text.strip()


def parse_turn(tokenizer, turn_ids: List[int], prefix_ids: List[int], schemas: List[dict],
               call_format: str = "hermes") -> dict:
    """A sampled turn's token ids -> an assistant message {"role", "content", "tool_calls"?}; each tool call
    normalised (`normalise_call`): {"type": "function", "function": {"name", "arguments"}} or {"error": why}."""
    text = tokenizer.decode(turn_ids, skip_special_tokens=True)
    if call_format != "response_template":
        return read_turn(tokenizer, text, tokenizer.decode(turn_ids, skip_special_tokens=False), call_format,
                         parameter_types(schemas))
    try:
        parsed = tokenizer.parse_response(turn_ids, prefix=prefix_ids, tools=schemas)
    except Exception as e:  # noqa: BLE001 - the tokenizer's parser failing on a malformed turn is data
        calls = [{"error": f"could not parse the tool call ({type(e).__name__})"}] if "tool_call" in text else []
        parsed = {"content": text, "tool_calls": calls}
    parsed = parsed if isinstance(parsed, dict) else {"content": text}
    calls = parsed.get("tool_calls")
    content = parsed.get("content")
    message = {**{k: v for k, v in parsed.items() if k != "tool_calls"},  # e.g. reasoning_content kept
               "role": "assistant", "content": content if isinstance(content, str) else ""}
    return _with_calls(message, calls if isinstance(calls, list) or calls is None else [calls])


def read_turn(tokenizer, text: str, raw_text: str, call_format: str, types: Optional[dict] = None) -> dict:
    """A turn's text (special tokens skipped; `raw_text`: kept) -> an assistant message, read in `call_format` (types:
    `parameter_types` of the tools, for formats whose values are text)."""
    calls, content = FORMATS[call_format](text, raw_text, types)
    return _with_calls({"role": "assistant", "content": content if call_format == "hermes" else
                        _strip_special(tokenizer, content)}, calls)


def _with_calls(message: dict, calls) -> dict:
    calls = [call if isinstance(call, dict) and set(call) == {"error"} else normalise_call(call)
             for call in calls or []]
    return {**message, **({"tool_calls": calls} if calls else {})}


# ---------------------------------------------------------------------------------------------------------
# Start-up: which format the chat template writes
# ---------------------------------------------------------------------------------------------------------
SENTINEL_ID = "call00000"  # Mistral's templates want 9 alphanumeric characters


def sentinel_conversation(tool_name: str) -> List[dict]:
    """user, assistant calling `tool_name`, tool result: what the start-up checks render."""
    call = {"type": "function", "id": SENTINEL_ID,
            "function": {"name": tool_name, "arguments": {"x": "sentinel_argument"}}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": tool_name, "tool_call_id": SENTINEL_ID, "content": "sentinel_result"}]


def call_format(tokenizer, tool_name: str) -> Tuple[str, List[int]]:
    """(the format the chat template writes tool calls in, the token ids that end a turn): a call to `tool_name`
    rendered by the template, read back by each parser in turn (see the module docstring). A turn ends at the EOS,
    and also at the special token a tool-calling turn ends with when that is not the EOS (GPT-OSS's <|call|>).
    UserError, naming the template, when no parser reads the call or the call's turn ends in no special token."""
    eos = [tokenizer.eos_token_id]
    if getattr(tokenizer, "response_template", None) is not None:
        return "response_template", eos
    user, assistant, _ = sentinel_conversation(tool_name)
    prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([user, assistant], tokenize=False)
    turn = full[len(prompt):] if full.startswith(prompt) else full
    template = getattr(tokenizer, "name_or_path", "") or "the tokenizer's"
    for name in FORMATS:  # read as text: a small vocabulary need not spell the sentinel call's argument
        message = read_turn(tokenizer, _strip_special(tokenizer, turn), turn, name)
        if [c.get("function") for c in message.get("tool_calls", [])] == [assistant["tool_calls"][0]["function"]]:
            end = turn.rstrip()
            if tokenizer.eos_token and end.endswith(tokenizer.eos_token):
                return name, eos
            last = next((t for t in tokenizer.all_special_tokens if end.endswith(t)), None)
            if last is None:
                raise UserError(f"the chat template of {template} ends a tool-calling turn with {end[-12:]!r}, not a "
                                f"special token: a sampled call could not end its turn ({name} format)")
            return name, eos + [tokenizer.convert_tokens_to_ids(last)]
    raise UserError(f"the chat template of {template} writes a tool call as {turn.strip()[:100]!r}, which no "
                    f"parser here reads ({', '.join(FORMATS)}): give the tokenizer a response_template "
                    "(transformers >= 5.13, e.g. TRL's add_response_schema) or use a template in one of these formats")


# ---------------------------------------------------------------------------------------------------------
# Running a call
# ---------------------------------------------------------------------------------------------------------
def call_tool(tools: Dict[str, Callable], call: dict, timeout: float):
    """Run one parsed tool call -> (result text, failed). A tool may be sync or async (awaited in its own event
    loop). Failures (parse error, unknown tool, bad arguments, an exception, no answer within `timeout` seconds)
    come back as JSON {"error": ...}; a hung call is left running in a daemon thread."""
    if "error" in call:
        return json.dumps({"error": call["error"]}), True
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    if name not in tools:
        return json.dumps({"error": f"unknown tool {name!r}; tools: {sorted(tools)}"}), True
    try:
        inspect.signature(tools[name]).bind(**arguments)
    except TypeError as e:
        return json.dumps({"error": f"bad arguments for {name}: {e}"}), True
    outcome = {}

    def run():
        try:
            outcome["result"] = ru.awaited(tools[name](**arguments))  # an async tool: awaited (TRL's too)
        except Exception as e:  # noqa: BLE001 - any tool failure becomes a message to the model
            outcome["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return json.dumps({"error": f"{name} timed out after {timeout:g} s"}), True
    if "error" in outcome:
        return json.dumps({"error": outcome["error"]}), True
    result = outcome["result"]
    return (json.dumps(result) if isinstance(result, (dict, list)) else str(result)), False


def truncate_result(tokenizer, content: str, max_tokens: Optional[int]) -> Tuple[str, bool]:
    """A tool result cut to its first `max_tokens` tokens, with a marker saying how many were cut -> (text, cut)."""
    if max_tokens is None:
        return content, False
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return content, False
    return tokenizer.decode(ids[:max_tokens]) + f"... [{len(ids) - max_tokens} tokens truncated]", True
