"""sft.py on tool-calling conversations: the tokens are those an episode samples (du.tokenize_conversation against
episodes.py's appended sequence), the loss is on the assistant turns only (zero gradient on tool results), and it
equals a per-token cross-entropy computed independently on the unpadded conversation."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import QWEN_TEMPLATE
from test_episodes import CALL, PROMPT, lookup, play, toolset_of
from torch import nn

import policy_common as pc
from plumbing import data_utils as du
from plumbing.errors import UserError
from sft import completion_token_stats, prompt_completion_pairs, sft_loss, tokenize_demonstrations


def test_conversation_tokens_are_the_sampled_episode(qwen_tokenizer):
    """An episode played token-in/token-out (prompt | sampled call | tool tokens | sampled answer), its conversation
    then tokenised for SFT: the same tokens, and the loss mask is the episode's action mask."""
    toolset = toolset_of(lookup)
    [episode] = play(qwen_tokenizer, toolset, [[CALL, "c f k<|im_end|>"]])
    prompt_ids, completion_ids, completion_mask = du.tokenize_conversation(qwen_tokenizer, PROMPT + episode.messages,
                                                                           toolset.schemas)
    assert prompt_ids == episode.prompt_ids
    assert completion_ids == episode.response_ids
    assert completion_mask == episode.action_mask
    assert any(completion_mask) and not all(completion_mask)


def test_conversation_template_errors(qwen_tokenizer):
    conversation = PROMPT + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": {"box": "4 8 2"}}}]},
        {"role": "tool", "name": "lookup", "content": "k c f"}, {"role": "assistant", "content": "c f k"}]
    broken = copy.deepcopy(qwen_tokenizer)  # drops earlier turns' tool calls: not prefix-preserving
    broken.chat_template = QWEN_TEMPLATE.replace("message.tool_calls or []",
                                                 "(message.tool_calls if loop.last else []) or []")
    with pytest.raises(UserError, match="prefix of its continuation"):
        du.tokenize_conversation(broken, conversation)
    no_eos = copy.deepcopy(qwen_tokenizer)  # ends assistant turns without <|im_end|>
    no_eos.chat_template = QWEN_TEMPLATE.replace("{%- endfor %}{{- '<|im_end|>\\n' }}", "{%- endfor %}{{- '\\n' }}")
    assert no_eos.chat_template != QWEN_TEMPLATE
    with pytest.raises(UserError, match="without the EOS token"):
        du.tokenize_conversation(no_eos, conversation)
    with pytest.raises(UserError, match="assistant message"):
        du.tokenize_conversation(qwen_tokenizer, conversation[1:])


@pytest.fixture(scope="module")
def tool_rows(toy_tools_world):
    """The toy tool world's tokenizer, policy and a few demonstration rows as sft.py builds them: two that call the
    tool (one with a typo'd box) and two direct answers, with the conversations they came from."""
    import datasets

    from plumbing import models

    tokenizer = models.load_tokenizer(toy_tools_world["policy"])
    data = datasets.load_from_disk(toy_tools_world["sft_dataset"])["train"]
    called = [i for i in range(64) if len(data[i]["messages"]) > 2][:2]
    direct = [i for i in range(64) if len(data[i]["messages"]) == 2][:2]
    data = data.select(called + direct)
    pairs = prompt_completion_pairs(data, "toy_tools")
    rows, dropped = tokenize_demonstrations(tokenizer, pairs, max_prompt_length=16, max_length=64, name="toy_tools")
    assert dropped == 0 and len(rows) == 4
    return tokenizer, rows, data


def test_tool_rows_match_the_world_builders_tokens(tool_rows):
    """The rows equal toy_tools.conversation_ids (the builder's rule: the whole conversation tokenised at once, each
    assistant message's tokens through its EOS trained), which is how the toy tool policy was trained."""
    from toy_worlds import toy_tools

    tokenizer, rows, data = tool_rows
    for row, example in zip(rows, data):
        messages = [{k: v for k, v in m.items() if v is not None} for m in example["messages"]]
        ids, mask = toy_tools.conversation_ids(tokenizer, messages, example["tools"])
        assert row["prompt"] + row["completion"] == ids
        assert [False] * len(row["prompt"]) + row["completion_mask"] == mask
    assert not all(rows[0]["completion_mask"])  # the tool result is in the completion, untrained


class KeepLogits(nn.Module):
    """The model, keeping its full logits (B, L, V) with their gradient."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        out.logits.retain_grad()
        self.logits = out.logits
        return out


def test_loss_is_on_assistant_tokens_only_and_equals_independent_cross_entropy(tool_rows, toy_tools_world):
    from transformers import AutoModelForCausalLM

    tokenizer, rows, _ = tool_rows
    pad = tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(toy_tools_world["policy"]).float().eval()
    wrapped = KeepLogits(model)
    token_nll, _, mask = completion_token_stats(wrapped, pc.Forward(pad), rows, pad, "cpu")
    num_tokens = sum(sum(r["completion_mask"]) for r in rows)
    loss = sft_loss(token_nll, mask, num_tokens)
    loss.backward()

    # independent: each conversation alone, unpadded, cross-entropy on the masked targets
    total = 0.0
    for row in rows:
        ids = torch.tensor([row["prompt"] + row["completion"]])
        labels = torch.tensor([-100] * len(row["prompt"]) + [t if m else -100 for t, m in
                                                             zip(row["completion"], row["completion_mask"])])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()
        total += F.cross_entropy(logits[:-1], labels[1:], reduction="sum").item()
    assert loss.item() == pytest.approx(total / num_tokens, rel=1e-5)

    # the gradient: zero on every logit that predicts a tool-result token, nonzero on those predicting assistant ones
    context_length = max(len(r["prompt"]) for r in rows)
    grad = wrapped.logits.grad.abs().sum(-1)[:, context_length - 1:-1]  # (B, R): position predicting completion j
    completion = torch.zeros_like(mask)
    for i, r in enumerate(rows):
        completion[i, :len(r["completion"])] = True
    tool = completion & ~mask
    assert tool.sum() > 0 and (grad[tool] == 0).all()
    assert (grad[mask] > 0).all()


def test_sft_runs_on_the_tool_world(toy_tools_world, tmp_path):
    """`python sft.py --model toy_tools`: the tool world's conversations load and train end to end (its alias
    defaults), none dropped, and the model is saved."""
    from conftest import read_metrics, run_script

    out = str(tmp_path / "sft_tools")
    run_script("sft.py", "--model", "toy_tools", "--max_steps", "3", "--eval_steps", "0", "--max_eval_examples", "64",
               "--output_dir", out)
    rows = read_metrics(out)
    assert rows[0]["data/dropped"] == 0 and rows[0]["data/train_examples"] > 2000
    assert "eval/gold_score" not in rows[0]  # single-turn gold is not measured on tool conversations
    assert all(r["num_tokens"] > 0 for r in rows if r["step"] > 0)
    assert all(r["eval/loss"] < 2.0 for r in rows if "eval/loss" in r)  # the SFT policy already knows these
    assert os.path.exists(os.path.join(out, "model", "config.json"))
