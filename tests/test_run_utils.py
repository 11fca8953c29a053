"""run_utils: run plumbing (data, run folder, processes, logging, checkpoints) against hand-worked examples."""

import json
import math
import os
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import run_two_processes, worker_accelerator
from test_policy_common import _save_tiny_tokenizer, lm, tiny_config  # noqa: F401  (the `lm` fixture)
from transformers import AutoModelForCausalLM, GPTNeoXForCausalLM

from plumbing import data_utils as du
from plumbing import metrics_log as ml
from plumbing import models
from plumbing import run_utils as ru
from plumbing import train_loop as tl
from plumbing.errors import UserError


# --------------------------------------------------------------------------------------------- saving
def test_save_then_reload_gives_identical_logits(tmp_path, lm):  # noqa: F811  (`lm`: the fixture imported above)
    _save_tiny_tokenizer(tmp_path / "tok", with_pad=True)
    tokenizer = models.load_tokenizer(str(tmp_path / "tok"))
    tl.save_model(None, lm, tokenizer, str(tmp_path / "model"))
    assert os.path.exists(tmp_path / "model" / "model.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, lm(input_ids=ids).logits)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p]


def test_peft_save_adapter_and_merged(tmp_path):
    torch.manual_seed(13)
    base = GPTNeoXForCausalLM(tiny_config()).eval()
    base.save_pretrained(tmp_path / "base")
    policy = models.add_lora(base, r=4, alpha=8, dropout=0.0, target_modules=["query_key_value"])
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
    tl.save_model(None, policy, None, str(tmp_path / "adapter"))
    assert os.path.exists(tmp_path / "adapter" / "adapter_model.safetensors")
    tl.save_model(None, policy, None, str(tmp_path / "merged"), merge_peft=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    # the in-memory policy still has its adapter after a merged save
    assert any("lora_A" in n for n, _ in policy.named_parameters())


def test_atomic_dir_keeps_old_folder_on_failure(tmp_path):
    target = tmp_path / "ckpt"
    with tl.atomic_dir(str(target)) as tmp:
        open(os.path.join(tmp, "a.txt"), "w").write("first")
    with pytest.raises(RuntimeError):
        with tl.atomic_dir(str(target)) as tmp:
            open(os.path.join(tmp, "a.txt"), "w").write("half")
            raise RuntimeError("killed mid-write")
    assert open(target / "a.txt").read() == "first"
    assert os.listdir(tmp_path) == ["ckpt"]


# --------------------------------------------------------------------------------------------- data
def test_tokenize_prompt_completion_truncation_rule(toy):
    tokenizer = models.load_tokenizer(toy["policy"])

    def ids(s):
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    prompt_ids, completion_ids = du.tokenize_prompt_completion(tokenizer, "a b c d =", " a b c", 3, 6)
    assert prompt_ids == ids("c d =")  # prompt keeps its last 3 tokens
    assert completion_ids == ids(" a b c")  # 6 - 3 = 3 tokens: EOS truncated away
    prompt_ids, completion_ids = du.tokenize_prompt_completion(tokenizer, "a b =", " a b", 5, 10)
    assert completion_ids == ids(" a b") + [tokenizer.eos_token_id]
    _, completion_ids = du.tokenize_prompt_completion(tokenizer, "a b c d =", " a", 5, 5)
    assert completion_ids == []  # nothing of the completion survives: callers drop and count the row


def test_tokenize_prompts_refuses_long_prompts(toy):
    tokenizer = models.load_tokenizer(toy["policy"])
    assert len(du.tokenize_prompts(tokenizer, ["a b ="], 3)[0]) == 3
    with pytest.raises(UserError, match="prompt 1 has 4 tokens, more than --max_prompt_length 3"):
        du.tokenize_prompts(tokenizer, ["a b =", "a b c ="], 3)


def test_load_dataset_sources_and_errors(tmp_path, toy):
    rows = [{"prompt": "a b =", "chosen": " a b", "rejected": " b a"}] * 3
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    ds = du.load_preference_dataset(str(jsonl), "train")
    assert ds.column_names == ["prompt", "chosen", "rejected"] and len(ds) == 3
    toy_pref = du.load_preference_dataset("toy", "test")
    du.require_columns(toy_pref, ["prompt", "chosen", "rejected"], "toy")
    assert len(du.load_prompt_dataset(toy["prompt_dataset"], "test")) == 256
    with pytest.raises(UserError, match=r"missing column\(s\) \['label'\]"):
        du.require_columns(ds, ["prompt", "label"], "d.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError):
        du.load_preference_dataset(str(tmp_path / "empty.jsonl"), "train")
    with pytest.raises(UserError, match="not found"):
        du.load_preference_dataset(str(tmp_path / "missing.json"), "train")
    with pytest.raises(UserError, match="no split 'validation'"):
        du.load_prompt_dataset("toy", "validation")


def test_render_conversational(toy):
    tokenizer = models.load_tokenizer(toy["policy"])
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}={% endif %}")
    prompt = [{"role": "user", "content": "b a"}]
    assert du.render_prompt(tokenizer, prompt) == "b a ="
    assert du.render_prompt(tokenizer, "b a =") == "b a ="
    assert du.is_conversational(prompt) and not du.is_conversational("x")


def eot_tokenizer(turn_end: str):
    """A word-level tokenizer whose EOS is `<eot>` ("\\n" a token of its own), with a chat template that writes each
    turn as `<|role|> CONTENT` + turn_end and `<|assistant|> ` as the generation prompt."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "<eot>", "[UNK]", "<|user|>", "<|assistant|>", "<|end|>", "\n", "a", "b", "c"]
    tok = Tokenizer(tokenizer_models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_tokens([AddedToken("\n", normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="<eot>", unk_token="[UNK]")
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}" + turn_end +
                               "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    return tokenizer


# ids of eot_tokenizer's words, to write expected token lists by hand
EOT, USER, ASSISTANT, END, NL, A, B, C = 1, 3, 4, 5, 6, 7, 8, 9
PROMPT = [{"role": "user", "content": "c a b"}]
COMPLETION = [{"role": "assistant", "content": "a b c"}]


def scripts_completion_ids(tokenizer, prompt, completion):
    """The completion tokens that sft.py, reward.py (both modes), dpo.py, kto.py and distill.py train on for one
    (prompt, completion) with room to spare; SFT's completion mask checked to cover all of them."""
    from datasets import Dataset

    import distill
    import dpo
    import reward
    import sft

    (row,), _ = sft.tokenize_demonstrations(tokenizer, [(prompt, completion, None, None)], 16, 32, "hand")
    assert row["completion_mask"] == [True] * len(row["completion"])  # the loss covers the EOS
    pairs = Dataset.from_list([{"prompt": prompt, "chosen": completion, "rejected": completion}])
    unpaired = Dataset.from_list([{"prompt": prompt, "completion": completion, "label": True}])
    (reward_row,), _ = reward.tokenize_pairs(tokenizer, pairs, 16, 32, "tokens", "hand")
    (dpo_row,), _ = dpo.tokenize_preferences(tokenizer, pairs, 16, 32, "hand")
    (kto_row,), _ = du.tokenize_unpaired(unpaired, tokenizer, 16, 32, "hand")
    return dict(sft=row["completion"], reward_tokens=reward_row["chosen"],
                reward_text=reward.reward_input_ids(tokenizer, prompt, completion, 16, 32, "text")[1],
                dpo=dpo_row["rejected"], kto=kto_row["completion_ids"],
                distill=distill.dataset_completions(unpaired, [0], tokenizer, 32)[0])


@pytest.mark.parametrize("turn_end", ["<eot>\n", "<eot>"])
def test_a_template_that_ends_turns_with_eos_gets_no_second_eos(turn_end):
    tokenizer = eot_tokenizer(turn_end)
    assert tokenizer.eos_token_id == EOT and tokenizer.convert_tokens_to_ids(["\n", "c"]) == [NL, C]
    prompt_ids, completion_ids = du.tokenize_prompt_completion(tokenizer, PROMPT, COMPLETION, 16, 32)
    assert prompt_ids == [USER, C, A, B] + [EOT] + [NL] * (turn_end == "<eot>\n") + [ASSISTANT]
    assert completion_ids == [A, B, C, EOT]  # not a b c <eot> \n <eot>: cut after the template's EOS
    ids = scripts_completion_ids(tokenizer, PROMPT, COMPLETION)
    rendered = [A, B, C, EOT] + [NL] * (turn_end == "<eot>\n")  # text mode: as rendered, nothing appended
    assert ids == dict(sft=[A, B, C, EOT], reward_tokens=[A, B, C, EOT], reward_text=rendered, dpo=[A, B, C, EOT],
                       kto=[A, B, C, EOT], distill=[A, B, C, EOT])
    # the same tokens and mask as the multi-turn path (tokenize_conversation), which cuts each turn after its EOS
    assert du.tokenize_conversation(tokenizer, PROMPT + COMPLETION) == (prompt_ids, completion_ids, [True] * 4)
    # truncation keeps the completion's first tokens: a cut completion has no EOS
    assert du.tokenize_prompt_completion(tokenizer, PROMPT, COMPLETION, 16, len(prompt_ids) + 3)[1] == [A, B, C]


def test_the_toy_tool_template_which_ends_turns_with_eos_agrees_with_tokenize_conversation():
    from toy_worlds import toy_tools

    tokenizer = toy_tools.make_tokenizer()  # assistant turns end with "[EOS] "
    prompt, completion = [{"role": "user", "content": "sort box 4 8 2"}], [{"role": "assistant", "content": "a b c"}]
    prompt_ids, completion_ids = du.tokenize_prompt_completion(tokenizer, prompt, completion, 64, 128)
    assert completion_ids == tokenizer("a b c [EOS]", add_special_tokens=False)["input_ids"]  # one EOS
    assert du.tokenize_conversation(tokenizer, prompt + completion) == (prompt_ids, completion_ids, [True] * 4)


@pytest.mark.parametrize("turn_end,rendered", [("\n", [A, B, C, NL]),  # the turn ends without EOS
                                               ("<eot> <|end|>\n", [A, B, C, EOT, END, NL])])  # EOS, then more
def test_eos_is_appended_to_text_and_to_templates_that_do_not_end_turns_with_it(turn_end, rendered):
    tokenizer = eot_tokenizer(turn_end)
    ids = scripts_completion_ids(tokenizer, PROMPT, COMPLETION)
    assert ids == dict(sft=rendered + [EOT], reward_tokens=rendered + [EOT], reward_text=rendered,
                       dpo=rendered + [EOT], kto=rendered + [EOT], distill=rendered + [EOT])
    text = scripts_completion_ids(tokenizer, "c a b =", " a b c")  # plain text: EOS appended, template unused
    assert text == dict(sft=[A, B, C, EOT], reward_tokens=[A, B, C, EOT], reward_text=[A, B, C], dpo=[A, B, C, EOT],
                        kto=[A, B, C, EOT], distill=[A, B, C, EOT])


def test_toy_task_tokens_are_its_text_plus_eos(toy):
    """The toy task's data is text: every script trains on the text's tokens + EOS, cut by the truncation rule."""
    import distill
    import reward
    import sft

    tokenizer = models.load_tokenizer(toy["policy"])
    ids, eos = (lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]), tokenizer.eos_token_id
    demos = sft.toy_demonstrations("test", "imperfect", seed=1).select(range(64))
    pairs = du.load_preference_dataset("toy", "test").select(range(64))
    prompts, completions = list(demos["prompt"]), list(demos["completion"])
    pair_prompts, chosen, rejected = list(pairs["prompt"]), list(pairs["chosen"]), list(pairs["rejected"])
    assert all(isinstance(v, str) for v in prompts + completions + pair_prompts + chosen + rejected)
    for max_prompt_length, max_length in ((16, 32), (5, 9)):  # everything fits; prompts and completions cut
        def expected(prompt, completion, end=[eos]):
            prompt_ids = ids(prompt)[-max_prompt_length:]
            return prompt_ids, (ids(completion) + end)[:max_length - len(prompt_ids)]

        rows, _ = sft.tokenize_demonstrations(tokenizer, sft.prompt_completion_pairs(demos, "toy"), max_prompt_length,
                                              max_length, "toy")
        assert [(r["prompt"], r["completion"]) for r in rows] == [expected(p, c) for p, c in zip(prompts, completions)]
        for mode, end in (("tokens", [eos]), ("text", [])):
            rows, _ = reward.tokenize_pairs(tokenizer, pairs, max_prompt_length, max_length, mode, "toy")
            assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [
                (*expected(p, w, end), expected(p, lose, end)[1])
                for p, w, lose in zip(pair_prompts, chosen, rejected)]
    assert distill.dataset_completions(demos, range(64), tokenizer, 5) == [(ids(c) + [eos])[:5] for c in completions]


# --------------------------------------------------------------------------------------------- runs
def test_metrics_logger_appends_refuses_and_resumes(tmp_path):
    out = str(tmp_path / "run")
    logger = ml.MetricsLogger(out, {"lr": 1.0})
    logger.log({"loss": torch.tensor(0.5), "lr": 1.0}, step=1)
    logger.log({"loss": 0.25}, step=2)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert rows == [{"step": 1, "loss": 0.5, "lr": 1.0}, {"step": 2, "loss": 0.25}]
    assert json.load(open(os.path.join(out, "args.json"))) == {"lr": 1.0}
    with pytest.raises(UserError, match="already holds a run"):
        ml.MetricsLogger(out, {"lr": 1.0})
    ml.MetricsLogger(out, {"lr": 1.0}, resume_step=1)
    assert [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))] == [1]
    ml.MetricsLogger(str(tmp_path / "other"), {}, is_main_process=False).log({"x": 1}, step=1)
    assert not os.path.exists(tmp_path / "other")


def test_parse_args_alias_defaults_only_for_flags_not_given():
    from dataclasses import dataclass

    @dataclass
    class Args:
        model: str = "toy"
        """policy"""
        learning_rate: float = 3e-6
        """lr"""
        use_peft: bool = False
        """lora"""

    defaults = {"toy": {"learning_rate": 1e-3, "use_peft": True}}
    args = ru.parse_args(Args, defaults, argv=[])
    assert args.learning_rate == 1e-3 and args.use_peft
    args = ru.parse_args(Args, defaults, argv=["--learning_rate", "0.5", "--no_use_peft"])
    assert args.learning_rate == 0.5 and not args.use_peft
    args = ru.parse_args(Args, defaults, argv=["--model", "pythia-1b"])
    assert args.learning_rate == 3e-6


def test_seed_everything_per_process():
    ru.seed_everything(5, 0)
    a = torch.rand(3)
    ru.seed_everything(5, 0)
    assert torch.equal(a, torch.rand(3))
    ru.seed_everything(5, 1)
    assert not torch.equal(a, torch.rand(3))


def test_parse_args_records_the_flags_given_and_fit_length(capsys):
    from dataclasses import dataclass

    @dataclass
    class Args:
        model: str = "toy"
        """policy"""
        response_length: int = 53
        """new tokens"""

    args = ru.parse_args(Args, {"toy": {"response_length": 40}}, argv=[])
    assert args.response_length == 40 and args.given_flags == frozenset()
    assert ru.fit_length(args, "response_length", 30, "the longest prompt") == 30  # a default is lowered
    assert args.response_length == 30 and "lowered from 40 to 30" in capsys.readouterr().out
    assert ru.fit_length(args, "response_length", None, "no limit") == 30
    args = ru.parse_args(Args, {}, argv=["--response_length", "40"])
    assert args.given_flags == {"response_length"}
    with pytest.raises(UserError, match="--response_length 40 does not fit: the longest prompt leaves 30"):
        ru.fit_length(args, "response_length", 30, "the longest prompt")
    args = ru.parse_args(Args, {}, argv=[])
    with pytest.raises(UserError, match="leaves 0 positions"):  # real prompts that leave no room
        ru.fit_length(args, "response_length", -3, "a 35-token prompt in 32 positions")


def test_aliases_resolve_without_importing_the_toy_task_until_named(toy):
    assert ru.resolve_model("pythia-1b") == "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr"
    assert ru.resolve_reward_model("pythia-1b") == "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr"
    assert ru.resolve_model("org/some-model") == "org/some-model"
    assert ru.resolve_model("toy") == toy["policy"] and ru.resolve_reward_model("toy") == toy["reward"]
    assert ru.default_dataset("pythia-2.8b") == "tldr" and ru.default_reward_model("toy") == "toy"
    with pytest.raises(UserError, match="--dataset is required"):
        ru.default_dataset("org/some-model")
    assert ru.model_positions(toy["policy"]) == 64


def test_epoch_permutation_is_seeded_per_epoch():
    a = du.epoch_permutation(50, seed=1, epoch=0)
    assert sorted(a) == list(range(50)) and a == du.epoch_permutation(50, seed=1, epoch=0)
    assert a != du.epoch_permutation(50, seed=1, epoch=1) and a != du.epoch_permutation(50, seed=2, epoch=0)
    # no seed+epoch aliasing
    assert du.epoch_permutation(50, seed=1, epoch=1) != du.epoch_permutation(50, seed=2, epoch=0)


def test_data_positions_read_the_permutations_pass_after_pass():
    first = du.data_positions(10, seed=1, start=0, count=10)
    assert sorted(first) == list(range(10))
    assert first == du.epoch_permutation(10, 1, 0)  # the data order every script shares
    assert du.data_positions(10, seed=1, start=25, count=3) == du.epoch_permutation(10, 1, 2)[5:8]
    assert du.data_positions(10, 1, 3, 12) == (first + du.data_positions(10, 1, 10, 10))[3:15]
    assert du.data_positions(10, seed=2, start=0, count=10) != first


class _Processes:
    """What ru needs of an Accelerator, for one process out of `num_processes` (no collectives)."""

    def __init__(self, num_processes=1, process_index=0):
        self.num_processes, self.process_index, self.device = num_processes, process_index, torch.device("cpu")


def test_even_share_gives_every_process_the_same_number_of_items():
    items = list(range(5))
    shares = [ru.even_share(items, _Processes(3, rank)) for rank in range(3)]
    assert [len(share) for share, _ in shares] == [2, 2, 2]
    assert [n for _, n in shares] == [2, 2, 1]
    assert sorted(x for share, n in shares for x in share[:n]) == items  # each item counted exactly once
    few = [ru.even_share([7], _Processes(2, rank)) for rank in range(2)]
    assert few == [([7], 1), ([7], 0)]  # a process with no item still runs one (discarded) item
    assert ru.even_share(items, _Processes()) == (items, 5)


def mean_std_values(rank=None):
    """Each process's values for ru.global_mean_std, NaN where none (rank None: both processes' together)."""
    values = [torch.tensor([1.0, float("nan"), 4.0, 2.5]), torch.tensor([float("nan"), 10.0, -3.0, float("nan")])]
    return torch.cat(values) if rank is None else values[rank]


def _processes_worker(rank, port, results):
    with worker_accelerator(rank, port) as accelerator:
        # uneven items: 3 on process 0, 1 on process 1; the same calls on both
        sums, count = ({"x": 1.0 + 2.0 + 3.0}, 3) if rank == 0 else ({"x": 10.0}, 1)
        stop = tl.StopSignal()
        stop.received = "SIGTERM" if rank == 1 else None
        if rank == 1:
            time.sleep(1.2)  # its own clock would name another run folder
        args = SimpleNamespace(output_dir=None, resume_from=None, exp_name="rloo", seed=1)
        results[rank] = (ru.global_means(accelerator, sums, count),
                         ru.all_finite(accelerator, 1.0, torch.tensor([2.0])),
                         ru.all_finite(accelerator, float("nan") if rank == 0 else 1.0, None),
                         stop.agreed(accelerator), ru.output_dir(args, "toy", accelerator),
                         [x.item() for x in ru.global_mean_std(mean_std_values(rank), accelerator)])


def test_global_means_and_agreement_over_two_processes():
    results = run_two_processes(_processes_worker)
    assert results[0] == results[1]  # the same folder name on both, from the main process's clock
    assert results[0][:4] == ({"x": 4.0}, True, False, True) and results[0][4].startswith("runs/toy__rloo__1__")
    # the mean and unbiased std of both processes' values, NaNs left out: those of all 5 values in one process
    scored = [1.0, 4.0, 2.5, 10.0, -3.0]
    mean = sum(scored) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in scored) / 4)
    assert results[0][5] == pytest.approx([mean, std], rel=1e-6)
    assert [x.item() for x in ru.global_mean_std(mean_std_values())] == pytest.approx([mean, std], rel=1e-6)
    one = _Processes()
    assert ru.global_means(one, {"x": 6.0}, 3) == {"x": 2.0}
    assert ru.all_finite(one, 1.0, None) and not ru.all_finite(one, torch.tensor([1.0, float("inf")]))
    assert not tl.StopSignal().agreed(one)


def test_output_dir_refuses_a_folder_holding_a_run_unless_resuming(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path), resume_from=None, exp_name="rloo", seed=1)
    assert ru.output_dir(args, "toy", _Processes()) == str(tmp_path)  # an empty (or other) folder is fine
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="already holds a run"):
        ru.output_dir(args, "toy", _Processes())
    args.resume_from = str(tmp_path / "checkpoint-2")
    assert ru.output_dir(args, "toy", _Processes()) == str(tmp_path)


def test_output_dir_resume_continues_in_place(tmp_path):
    args = SimpleNamespace(output_dir=None, resume_from=str(tmp_path / "runs" / "x" / "checkpoint-4"),
                           exp_name="rloo", seed=1)
    assert ru.output_dir(args, "toy", _Processes()) == str(tmp_path / "runs" / "x")
    args.output_dir = str(tmp_path / "mine")
    assert ru.output_dir(args, "toy", _Processes()) == str(tmp_path / "mine")
