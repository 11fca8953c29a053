"""Multi-turn episodes (episodes.py): the sequence trained on is the sequence sampled (token in, token out), tool
results are masked out of the loss, tool failures become messages, and a TRL-style environment written here works.

The real-model template is written in conftest.py (the qwen_tokenizer fixture): Qwen 2.5's tool format
(`<|im_start|>`/`<|im_end|>` turns, a newline after each `<|im_end|>`, calls as `<tool_call>\\n{json}\\n</tool_call>`,
results as a user turn of `<tool_response>` blocks), on a character-level tokenizer. Episodes are played by a
scripted sampler (fixed turns) so that the expected tokens are known; the model-level tests use a real tiny GPT-NeoX.
"""

import json
import textwrap
import time
import types

import pytest
import torch
from conftest import QWEN_TEMPLATE

import policy_common as pc
from plumbing import episodes as ep
from plumbing import reward_sources as rs
from plumbing.errors import UserError


def lookup(box: str) -> str:
    """Look up the letters kept in a box.

    Args:
        box: the box number
    """
    if box == "hang":
        time.sleep(30)
    if box == "boom":
        raise RuntimeError("the box exploded")
    return {"4 8 2": "k c f"}.get(box, "a")


def toolset_of(*tools):
    return ep.Toolset(list(tools), None, [ep._schema(t, "--tools") for t in tools])


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def scripted(tokenizer, turns_by_row):
    """A sampler that writes fixed turns: turns_by_row[i][t] is row i's t-th turn (text ending with EOS). Rows are
    matched by their first tokens (the prompt); behaviour log-probs are -(position in the turn + 1); no entropy."""
    calls = {}

    def generate(sequences, budgets, first_turn):
        turns, logprobs = [], []
        for sequence, max_new_tokens in zip(sequences, budgets):
            row = next(i for i, prompt in enumerate(scripted.prompts) if sequence[:len(prompt)] == prompt)
            t = calls.get(row, 0)
            calls[row] = t + 1
            ids = encode(tokenizer, turns_by_row[row][t])[:max_new_tokens]
            turns.append(ids)
            logprobs.append([-(j + 1.0) for j in range(len(ids))])
        return turns, logprobs, None

    return generate


CALL = '<tool_call>\n{"name": "lookup", "arguments": {"box": "4 8 2"}}\n</tool_call><|im_end|>'
PROMPT = [{"role": "user", "content": "sort box 4 8 2"}]


def play(tokenizer, toolset, turns, prompts=(PROMPT,), rows=None, response_length=200, **kwargs):
    rows = rows or [{"prompt": p} for p in prompts]
    episodes = ep.start_episodes(list(prompts), rows, toolset, tokenizer, [None] * len(rows), max_prompt_length=1000)
    scripted.prompts = [e.prompt_ids for e in episodes]
    kwargs = {"context_limit": 10_000, "max_tool_calling_iterations": None, "tool_timeout": 1.0, **kwargs}
    return ep.run_episodes(episodes, scripted(tokenizer, turns), tokenizer, toolset, response_length=response_length,
                           **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Token in, token out
# ---------------------------------------------------------------------------------------------------------
def test_episode_is_the_rendered_conversation_qwen_template(qwen_tokenizer):
    """The finished conversation rendered by the template = the sequence trained on, except the newline the template
    writes after the last <|im_end|>, which nobody sampled (a documented template property: the trainer's sequence
    stops at the EOS sampled). The action mask covers the sampled turns exactly; the tool tokens hold what the
    template writes between an EOS and the next generation (the newline after <|im_end|> included)."""
    toolset = toolset_of(lookup)
    [episode] = play(qwen_tokenizer, toolset, [[CALL, "c f k<|im_end|>"]])
    assert episode.turns == 2 and episode.tool_calls == 1 and episode.tool_failures == 0 and not episode.truncated
    assert episode.messages[1] == {"role": "tool", "name": "lookup", "content": "k c f"}
    rendered = encode(qwen_tokenizer, qwen_tokenizer.apply_chat_template(PROMPT + episode.messages,
                                                                          tools=toolset.schemas, tokenize=False))
    sequence = episode.prompt_ids + episode.response_ids
    assert rendered[:len(sequence)] == sequence
    assert rendered[len(sequence):] == encode(qwen_tokenizer, "\n")
    sampled = [t for t, a in zip(episode.response_ids, episode.action_mask) if a]
    assert sampled == encode(qwen_tokenizer, CALL) + encode(qwen_tokenizer, "c f k<|im_end|>")
    tool_text = qwen_tokenizer.decode([t for t, a in zip(episode.response_ids, episode.action_mask) if not a])
    assert tool_text == ("\n<|im_start|>user\n<tool_response>\nk c f\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    # the log-probs are the sampler's, on its tokens; 0 on the tool tokens
    turn = len(encode(qwen_tokenizer, CALL))
    assert episode.behaviour_logprobs[:turn] == [-(j + 1.0) for j in range(turn)]
    assert all(lp == 0.0 for lp, a in zip(episode.behaviour_logprobs, episode.action_mask) if not a)


def test_a_call_written_unlike_the_template_is_trained_as_sampled(qwen_tokenizer):
    """A call sampled without the template's newlines re-renders differently (the template re-serialises tool calls:
    documented); the sequence trained on keeps the sampled tokens, and only the call's own tokens differ."""
    compact = '<tool_call>{"name": "lookup", "arguments": {"box": "4 8 2"}}</tool_call><|im_end|>'
    [episode] = play(qwen_tokenizer, toolset_of(lookup), [[compact, "c f k<|im_end|>"]])
    assert episode.tool_calls == 1 and episode.tool_failures == 0
    turn = encode(qwen_tokenizer, compact)
    assert episode.response_ids[:len(turn)] == turn
    rendered = encode(qwen_tokenizer, qwen_tokenizer.apply_chat_template(PROMPT + episode.messages,
                                                                          tools=toolset_of(lookup).schemas,
                                                                          tokenize=False))
    assert rendered[:len(episode.prompt_ids)] == episode.prompt_ids
    assert rendered != episode.prompt_ids + episode.response_ids + encode(qwen_tokenizer, "\n")


def test_suffix_of_a_template_that_is_not_prefix_preserving_is_refused(qwen_tokenizer):
    import copy

    broken = copy.deepcopy(qwen_tokenizer)
    # drops the tool calls of an assistant turn once later messages follow it (as templates that strip history)
    broken.chat_template = QWEN_TEMPLATE.replace("message.tool_calls or []",
                                                 "(message.tool_calls if loop.last else []) or []")
    assert broken.chat_template != QWEN_TEMPLATE
    with pytest.raises(UserError, match="not prefix-preserving"):
        ep.tool_suffix_ids(broken, [{"role": "tool", "name": "lookup", "content": "k c f"}])
    with pytest.raises(UserError, match="does not support tools|not prefix-preserving"):
        ep.check_chat_template(broken)
    plain = copy.deepcopy(qwen_tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(UserError, match="does not support tools"):
        ep.check_chat_template(plain)


# ---------------------------------------------------------------------------------------------------------
# How episodes end; tool failures
# ---------------------------------------------------------------------------------------------------------
def test_budget_turn_limit_and_no_call_end_episodes(qwen_tokenizer):
    toolset = toolset_of(lookup)
    # a turn with no call ends it
    [e] = play(qwen_tokenizer, toolset, [["no tools<|im_end|>"]])
    assert e.turns == 1 and e.tool_calls == 0 and not e.truncated
    # the turn limit: the second turn's call is not executed
    [e] = play(qwen_tokenizer, toolset, [[CALL, CALL, CALL]], max_tool_calling_iterations=1)
    assert e.turns == 2 and e.tool_calls == 1 and not e.truncated
    # the budget counts sampled tokens over all turns: cut inside the second turn
    budget = len(encode(qwen_tokenizer, CALL)) + 3
    [e] = play(qwen_tokenizer, toolset, [[CALL, "c f k<|im_end|>"]], response_length=budget)
    assert e.truncated and e.turns == 2 and sum(e.action_mask) == budget
    assert len(e.response_ids) > budget  # the tool tokens are not counted in it
    # the context limit: no room for the tool result -> ended by the budget, the result not appended
    [e] = play(qwen_tokenizer, toolset, [[CALL]],
               context_limit=len(scripted.prompts[0]) + len(encode(qwen_tokenizer, CALL)) + 5)
    assert e.truncated and e.tool_calls == 1 and all(e.action_mask)


def test_tool_failures_become_messages(qwen_tokenizer):
    """Unknown tool, bad arguments, an exception, a hang (cut at --tool_timeout), unparseable JSON: each a tool
    message {"error": ...} the model reads next turn, counted; nothing raises."""
    def call(text):
        return f"<tool_call>\n{text}\n</tool_call><|im_end|>"

    turns = [call('{"name": "nope", "arguments": {}}'), call('{"name": "lookup", "arguments": {"crate": "1"}}'),
             call('{"name": "lookup", "arguments": {"box": "boom"}}'),
             call('{"name": "lookup", "arguments": {"box": "hang"}}'), call('{"name": "lookup", "arguments": {'),
             "done<|im_end|>"]
    start = time.time()
    [e] = play(qwen_tokenizer, toolset_of(lookup), [turns], tool_timeout=0.5, response_length=1000)
    assert time.time() - start < 10
    assert e.tool_calls == 5 and e.tool_failures == 5 and e.turns == 6
    errors = [json.loads(m["content"])["error"] for m in e.messages if m["role"] == "tool"]
    assert "unknown tool 'nope'" in errors[0]
    assert "bad arguments for lookup" in errors[1]
    assert errors[2] == "RuntimeError: the box exploded"
    assert errors[3] == "lookup timed out after 0.5 s"
    assert errors[4].startswith("could not parse the tool call")
    metrics = ep.episode_metrics([e], types.SimpleNamespace(num_processes=1, device="cpu"))
    assert metrics["tools/call_frequency"] == 5 and metrics["tools/failure_frequency"] == 1.0
    assert metrics["episodes/turns"] == 6


# ---------------------------------------------------------------------------------------------------------
# Masking: the tool tokens carry no gradient
# ---------------------------------------------------------------------------------------------------------
def hand_built_rollout(qwen_tokenizer):
    toolset = toolset_of(lookup)
    episodes = play(qwen_tokenizer, toolset, [[CALL, "c f k<|im_end|>"], ["no<|im_end|>"]],
                    prompts=(PROMPT, [{"role": "user", "content": "hi"}]))
    return ep.episode_tensors(episodes, qwen_tokenizer.pad_token_id)


def tiny_model(tokenizer):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=512, hidden_dropout=0.0,
                           attention_dropout=0.0)
    return GPTNeoXForCausalLM(config)


@pytest.mark.parametrize("script", ["grpo", "rloo"])
def test_loss_gradient_is_zero_on_tool_tokens(qwen_tokenizer, script):
    """The GRPO and RLOO losses of hand-built episodes, through a real model's logits: the gradient on every tool
    position is exactly zero, and not on the sampled positions."""
    t = hand_built_rollout(qwen_tokenizer)
    pad = qwen_tokenizer.pad_token_id
    model = tiny_model(qwen_tokenizer)
    qr, lq = t["query_responses"], t["context_length"]
    logits = pc.Forward(pad).logits(model, qr, lq)
    logits.retain_grad()
    new = pc.selective_logprobs(logits, qr[:, lq:])
    mask = (qr[:, lq:] != pad) & t["action_mask"]
    old = new.detach() + (0.1 if script == "grpo" else 0.0)  # rloo: one ratio per sequence, kept unclipped
    advantages = torch.tensor([1.0, -0.5])
    if script == "grpo":
        import grpo

        token_loss, _ = grpo.per_token_loss(new, old, new.detach(), advantages, mask, importance_sampling_level="token",
                                            epsilon=0.2, epsilon_high=0.2, beta=0.1)
        loss = grpo.aggregate_loss(token_loss, mask, "dapo", mask.shape[1], mask.sum().item())
    else:
        import rloo

        loss, _ = rloo.clipped_policy_loss(new, old, advantages, mask, 0.2)
    loss.backward()
    grad = logits.grad.abs().sum(-1)  # (B, R)
    tool = (qr[:, lq:] != pad) & ~t["action_mask"]
    assert tool.any() and (grad[tool] == 0).all()
    assert (grad[mask] > 0).all()


def test_per_token_loss_equals_trl_with_its_tool_mask(qwen_tokenizer):
    """The same episode tensors through TRL 1.16's GRPOTrainer._compute_loss (completion_mask x tool_mask) and ours
    (Rollout.response_mask: sampled tokens): equal losses and gradients."""
    pytest.importorskip("trl")
    from test_grpo import trl_loss

    import grpo

    t = hand_built_rollout(qwen_tokenizer)
    pad = qwen_tokenizer.pad_token_id
    responses = t["query_responses"][:, t["context_length"]:]
    completion_mask, tool_mask = (responses != pad).long(), t["action_mask"].long()
    b, r = responses.shape
    generator = torch.Generator().manual_seed(0)
    new = torch.randn(b, r, generator=generator) - 1
    old, ref = new + 0.3 * torch.randn(b, r, generator=generator), new + 0.2 * torch.randn(b, r, generator=generator)
    advantages = torch.tensor([0.7, -1.1])
    inputs = dict(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                  completion_ids=responses, completion_mask=completion_mask, tool_mask=tool_mask,
                  advantages=advantages, old_per_token_logps=old, ref_per_token_logps=ref,
                  num_items_in_batch=(completion_mask * tool_mask).sum())
    theirs_new = new.clone().requires_grad_(True)
    theirs, _ = trl_loss(theirs_new, torch.rand(b, r), inputs, loss_type="dapo", level="token", beta=0.04,
                         epsilon=0.2, epsilon_high=0.28, max_completion_length=r)
    ours_new = new.clone().requires_grad_(True)
    mask = (responses != pad) & t["action_mask"]
    token_loss, _ = grpo.per_token_loss(ours_new, old, ref, advantages, mask, importance_sampling_level="token",
                                        epsilon=0.2, epsilon_high=0.28, beta=0.04)
    ours = grpo.aggregate_loss(token_loss, mask, "dapo", r, mask.sum().item())
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    theirs.backward()
    ours.backward()
    torch.testing.assert_close(ours_new.grad, theirs_new.grad, atol=1e-6, rtol=1e-5)
    assert (ours_new.grad[completion_mask.bool() & ~t["action_mask"]] == 0).all()


# ---------------------------------------------------------------------------------------------------------
# A TRL-style environment, written here
# ---------------------------------------------------------------------------------------------------------
ENVIRONMENT = textwrap.dedent('''
    class LetterBox:
        """TRL's environment contract: reset(**row), public methods as tools, get_reward()."""

        def __init__(self):
            self.secret, self.opened = None, 0

        def reset(self, **row):
            self.secret, self.opened = row["secret"], 0
            return " (the box is closed)"

        def open_box(self, force: bool) -> str:
            """Open the box.

            Args:
                force: whether to force the lid
            """
            self.opened += 1
            return self.secret

        def get_reward(self) -> float:
            return float(self.opened)
''')


def test_trl_style_environment(qwen_tokenizer, tmp_path):
    path = tmp_path / "letter_env.py"
    path.write_text(ENVIRONMENT)
    args = types.SimpleNamespace(tools=None, environment=f"{path}:LetterBox")
    toolset = ep.load_toolset(args, qwen_tokenizer)
    assert toolset.names == ["open_box"] and toolset.schemas[0]["function"]["name"] == "open_box"
    rows = [{"prompt": PROMPT, "secret": "x y"}, {"prompt": [{"role": "user", "content": "open"}], "secret": "z"}]
    environments = [toolset.new_environment() for _ in rows]
    episodes = ep.start_episodes([r["prompt"] for r in rows], rows, toolset, qwen_tokenizer, environments, 1000)
    assert qwen_tokenizer.decode(episodes[0].prompt_ids).endswith("sort box 4 8 2 (the box is closed)<|im_end|>\n"
                                                                  "<|im_start|>assistant\n")
    call = '<tool_call>\n{"name": "open_box", "arguments": {"force": true}}\n</tool_call><|im_end|>'
    scripted.prompts = [e.prompt_ids for e in episodes]
    ep.run_episodes(episodes, scripted(qwen_tokenizer, [[call, "ok<|im_end|>"], [call, "ok<|im_end|>"]]),
                    qwen_tokenizer, toolset, response_length=500, context_limit=10_000,
                    max_tool_calling_iterations=None, tool_timeout=1.0)
    assert [m["content"] for m in episodes[0].messages if m["role"] == "tool"] == ["x y"]
    assert [m["content"] for m in episodes[1].messages if m["role"] == "tool"] == ["z"]
    # get_reward is one more reward source, named after the class; reward functions get environments=
    seen = {}

    def spy(completions, environments, **kwargs):
        seen["environments"], seen["completions"] = environments, completions
        return [0.5] * len(completions)

    rewards = rs.Rewards(qwen_tokenizer, functions=[rs.RewardFunction("spy", spy),
                                                     rs.environment_reward(toolset.environment)])
    assert rewards.names == ["spy", "LetterBox"]
    tensors = ep.episode_tensors(episodes, qwen_tokenizer.pad_token_id)
    scores, per_source = rewards(tensors["query_responses"], tensors["context_length"], rows, episodes=episodes)
    assert per_source[:, 1].tolist() == [1.0, 1.0] and scores.tolist() == [1.5, 1.5]
    assert seen["environments"] == environments
    assert seen["completions"][0][0]["tool_calls"][0]["function"] == {"name": "open_box", "arguments": {"force": True}}


def test_load_toolset_errors(qwen_tokenizer, tmp_path):
    bad = tmp_path / "bad_tools.py"
    bad.write_text("def no_doc(x):\n    return x\n\nclass NoReset:\n    def tool(self) -> str:\n        return ''\n")
    for spec, match in ((f"{bad}:no_doc", "cannot be shown to the model"), (f"{bad}:missing", "has no function")):
        with pytest.raises(UserError, match=match):
            ep.load_toolset(types.SimpleNamespace(tools=[spec], environment=None), qwen_tokenizer)
    with pytest.raises(UserError, match="no reset"):
        ep.load_toolset(types.SimpleNamespace(tools=None, environment=f"{bad}:NoReset"), qwen_tokenizer)
    assert ep.load_toolset(types.SimpleNamespace(tools=None, environment=None), qwen_tokenizer) is None
