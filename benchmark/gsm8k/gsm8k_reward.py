"""GSM8K answer checker, shipped as reward functions for the RL scripts (`--reward_funcs path.py:function`).

A completion is correct when the LAST number in it equals the reference answer, numerically:
  - reference: the number after `####` in a GSM8K solution ("... #### 1,234" -> 1234), or a bare number;
  - completion: the last number anywhere in it ("#### 72", "\\boxed{72}", "The answer is $72.00." all give 72);
    thousands separators ("1,234"), a `$` sign, decimals and a leading minus ("-3", not the dash of "3-5") are read;
  - both are normalised before comparing: "5.50" == "5.5", "18.0" == "18", "1,234" == "1234", "-0" == "0".
This is the "flexible" rule of verl's GSM8K scorer (the last number wins), not its strict one (only "#### n").

Reward functions are called by keyword, as TRL calls them (see reward_sources.py):
    gsm8k_accuracy(prompts=[...], completions=[...], completion_ids=[...], answer=[...]) -> [1.0 | 0.0, ...]
    format_reward(completions=[...]) -> [0.1 | 0.0, ...]
Completions are text, or for conversational data [{"role": "assistant", "content": text}] (the last message's
content is read). Usage, on data made by benchmark/gsm8k/prepare_data.py:
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset data/gsm8k \\
        --reward_funcs benchmark/gsm8k/gsm8k_reward.py:gsm8k_accuracy
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import List, Optional

# A number: an optional minus (not after a letter, digit or ")": "3-5" is 3 and 5), an optional "$", digits with
# thousands separators ("1,234,567") or without ("1234"), an optional decimal part ("18." keeps no decimal part).
_NUMBER = re.compile(r"(?:(?<![\w).])-)?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)")
_LEADING_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
FINAL_ANSWER_MARKERS = ("####", "\\boxed{")


def normalise_number(text: str) -> Optional[str]:
    """Canonical form of a number: no commas, `$` or spaces, no trailing zeros ("5.50" -> "5.5", "18.0" -> "18")."""
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def reference_answer(text: str) -> Optional[str]:
    """The normalised number after the last `####` of a GSM8K reference solution; None when absent."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].replace(",", "").replace("$", "").replace(" ", "").strip()
    match = _LEADING_NUMBER.match(tail)
    return normalise_number(match.group(0)) if match else None


def last_number(text: str) -> Optional[str]:
    """The normalised last number of a completion ("#### 72", "\\boxed{72}", "is $72.00." -> "72"); None if none."""
    numbers = _NUMBER.findall(text)
    return normalise_number(numbers[-1]) if numbers else None


def completion_text(completion) -> str:
    """Text of a completion: the string itself, or the content of the last message of a conversational one."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        return completion[-1].get("content") or ""
    raise TypeError(f"a completion must be text or a list of messages, got {type(completion).__name__}")


def normalise_reference(answer) -> str:
    """The `answer` column's value as a normalised number: a full solution with `####`, or a bare number."""
    text = str(answer)
    value = reference_answer(text) if "####" in text else normalise_number(text.strip())
    if value is None:
        raise ValueError(f"reference answer {answer!r} has no number (expected '... #### <number>' or a number)")
    return value


def gsm8k_accuracy(prompts, completions, answer, **kwargs) -> List[float]:
    """1.0 where the completion's last number equals the reference answer (after normalising both), else 0.0."""
    if len(completions) != len(answer):
        raise ValueError(f"{len(completions)} completions but {len(answer)} answers")
    return [float(last_number(completion_text(c)) == normalise_reference(a)) for c, a in zip(completions, answer)]


def format_reward(completions, **kwargs) -> List[float]:
    """0.1 where the completion marks a final answer (`####` or `\\boxed{`), else 0.0: a small shaping bonus."""
    return [0.1 if any(m in completion_text(c) for m in FINAL_ANSWER_MARKERS) else 0.0 for c in completions]
