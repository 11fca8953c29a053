"""benchmark/gsm8k/: the GSM8K answer checker (reward functions) on realistic solutions and completions, the data
conversion of prepare_data.py (no network: an in-memory dataset), and `bash -n` on the GPU-only launch scripts."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

GSM8K = os.path.join(ROOT, "benchmark", "gsm8k")
sys.path.insert(0, GSM8K)

import gsm8k_reward as gr  # noqa: E402
import prepare_data  # noqa: E402

# Reference solutions in GSM8K's format (calculator annotations <<...>>, final answer after ####).
NATALIA = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
           "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
WENG = ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
        "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10")
HOUSE = ("The house cost 80,000 + 50,000 = $<<80000+50000=130000>>130,000.\n"
         "He sold it for 130,000 * 2.5 = $<<130000*2.5=325000>>325,000.\n"
         "So he made 325,000 - 130,000 = $<<325000-130000=195000>>195,000.\n#### 195,000")
TEMPERATURE = ("It fell 5 + 8 = <<5+8=13>>13 degrees from 10 degrees.\n"
               "So it is now 10 - 13 = <<10-13=-3>>-3 degrees.\n#### -3")
PRICE = "Each pen costs 11 / 2 = $<<11/2=5.50>>5.50.\n#### 5.50"


@pytest.mark.parametrize("solution, expected", [
    (NATALIA, "72"), (WENG, "10"), (HOUSE, "195000"), (TEMPERATURE, "-3"), (PRICE, "5.5"),
    ("#### 1,234", "1234"), ("#### $18.0", "18"), ("####  18 dollars", "18"),
    ("Natalia sold 72 clips.", None), ("#### none", None),
])
def test_reference_answer(solution, expected):
    assert gr.reference_answer(solution) == expected


@pytest.mark.parametrize("completion, expected", [
    ("48 / 2 = 24 in May, 48 + 24 = 72 in all. The answer is 72.", "72"),   # trailing period is punctuation
    ("He made 325,000 - 130,000 = $195,000.\n#### 195,000", "195000"),      # thousands separators
    ("The total is $1,234.00", "1234"),                                     # $, separators, .00
    ("So the pens cost 5.50 each, and the answer is \\boxed{5.5}", "5.5"),
    ("Step 1: 5 + 8 = 13.\nStep 2: 10 - 13 = -3.\n#### -3", "-3"),         # negative
    ("It is between 3-5 degrees", "5"),                                     # a dash is not a minus
    ("18.0 apples", "18"),
    ("The answer is \\boxed{18} after 2 steps", "2"),                       # the last number wins, boxed or not
    ("I do not know.", None), ("", None),
])
def test_last_number(completion, expected):
    assert gr.last_number(completion) == expected


def test_gsm8k_accuracy_text_completions():
    """Full solutions and bare numbers as references; right, wrong-last, absent, formatted and negative answers."""
    completions = [
        "In May she sold 48/2 = 24 clips, so 48 + 24 = 72 in total. The answer is 72.",  # right, trailing period
        "She sold 24 clips in May and 72 altogether, i.e. 24 more than in May: 24",     # right number, not last
        "He made $195,000.00 in profit.",                                                # right, $ and separators
        "The temperature is now \\boxed{-3} degrees.",                                   # right, boxed negative
        "Each pen costs 5.5 dollars.",                                                   # 5.5 == 5.50
        "I cannot solve this.",                                                          # no number
        "#### 10",                                                                       # right, bare reference
        "#### 11",                                                                       # wrong
    ]
    answers = [NATALIA, NATALIA, HOUSE, TEMPERATURE, PRICE, WENG, "10", "10"]
    scores = gr.gsm8k_accuracy(prompts=["q"] * 8, completions=completions, completion_ids=[[1]] * 8, answer=answers)
    assert scores == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert all(isinstance(s, float) for s in scores)


def test_gsm8k_accuracy_conversational():
    """Conversational completions: the content of the last (assistant) message is read."""
    prompts = [[{"role": "user", "content": "How many clips?"}]] * 3
    completions = [[{"role": "assistant", "content": "48 + 24 = 72\n#### 72"}],
                   [{"role": "assistant", "content": "#### 71"}],
                   [{"role": "assistant", "content": None}]]
    scores = gr.gsm8k_accuracy(prompts=prompts, completions=completions, answer=["72", "72", "72"])
    assert scores == [1.0, 0.0, 0.0]
    assert gr.completion_text(completions[0]) == "48 + 24 = 72\n#### 72"
    assert gr.completion_text([{"role": "assistant", "content": "Let me think."},
                               {"role": "assistant", "content": "#### 72"}]) == "#### 72"


def test_gsm8k_accuracy_rejects_bad_input():
    """A reference without a number, or mismatched lengths, is an error rather than a silent 0."""
    with pytest.raises(ValueError, match="no number"):
        gr.gsm8k_accuracy(prompts=["q"], completions=["72"], answer=["seventy-two"])
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        gr.gsm8k_accuracy(prompts=["q", "q"], completions=["72", "72"], answer=["72"])
    with pytest.raises(TypeError):
        gr.gsm8k_accuracy(prompts=["q"], completions=[72], answer=["72"])


def test_format_reward():
    completions = ["So #### 72", "\\boxed{72}", "The answer is 72.", [{"role": "assistant", "content": "#### 3"}]]
    assert gr.format_reward(prompts=["q"] * 4, completions=completions) == [0.1, 0.1, 0.0, 0.1]


def test_loads_as_reward_function():
    """reward_sources.py loads the checker from its path (as --reward_funcs path.py:function) and it scores a batch."""
    from plumbing import reward_sources

    fn = reward_sources.load_reward_function(os.path.join(GSM8K, "gsm8k_reward.py") + ":gsm8k_accuracy", "data/gsm8k")
    assert fn.fn(prompts=["q", "q"], completions=["#### 72", "#### 7"], completion_ids=[[1], [2]],
                 answer=["72", "72"]) == [1.0, 0.0]


def test_to_row():
    row = prepare_data.to_row({"question": "Natalia sold clips to 48 of her friends in April. How many?",
                               "answer": NATALIA})
    assert row == {"prompt": [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April. How many?"
                               "\nLet's think step by step and output the final answer after \"####\"."}],
                   "answer": "72"}
    assert prepare_data.to_row({"question": "q", "answer": HOUSE})["answer"] == "195000"
    with pytest.raises(ValueError, match="####"):
        prepare_data.to_row({"question": "q", "answer": "no final answer"})


def test_convert_is_a_prompt_dataset(tmp_path):
    """convert() on an in-memory GSM8K DatasetDict: columns prompt/answer only, saved and loaded back as the RL
    scripts load a prompt dataset (train split, test split for evaluation)."""
    datasets = pytest.importorskip("datasets")
    from plumbing import data_utils
    source = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"question": ["How many clips?", "How much profit?"],
                                             "answer": [NATALIA, HOUSE]}),
        "test": datasets.Dataset.from_dict({"question": ["How cold?"], "answer": [TEMPERATURE]}),
    })
    prepare_data.convert(source).save_to_disk(str(tmp_path / "gsm8k"))
    train = data_utils.load_prompt_dataset(str(tmp_path / "gsm8k"), "train")
    test = data_utils.load_prompt_dataset(str(tmp_path / "gsm8k"), "test")
    assert sorted(train.column_names) == ["answer", "prompt"]
    assert train["answer"] == ["72", "195000"] and test["answer"] == ["-3"]
    assert test["prompt"][0][0]["role"] == "user" and test["prompt"][0][0]["content"].startswith("How cold?\n")


@pytest.mark.parametrize("script", ["grpo_1gpu.sh", "grpo_8gpu.sh"])
def test_launch_scripts_syntax(script):
    path = os.path.join(GSM8K, script)
    proc = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = open(path).read()
    assert "set -euo pipefail" in text and "gsm8k_reward.py:gsm8k_accuracy" in text
    assert "--reward_model_input" not in text
