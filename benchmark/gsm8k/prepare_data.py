"""Convert the hub dataset openai/gsm8k (config "main": `question`, `answer`) into this project's prompt-dataset form:
a save_to_disk DatasetDict with splits train (7473 rows) and test (1319 rows) and columns
  prompt  [{"role": "user", "content": question + INSTRUCTION}]  (conversational: the chat template applies)
  answer  the reference's final number, normalised as gsm8k_reward.py compares it ("1,234" -> "1234")
so that `--dataset data/gsm8k --reward_funcs benchmark/gsm8k/gsm8k_reward.py:gsm8k_accuracy` trains on the train
split and evaluates on the test split (--eval_split test, the default). Needs the internet (run it on the GPU machine):
    python benchmark/gsm8k/prepare_data.py --out data/gsm8k
"""

from __future__ import annotations

import argparse

from gsm8k_reward import reference_answer

SOURCE, CONFIG = "openai/gsm8k", "main"
INSTRUCTION = "\nLet's think step by step and output the final answer after \"####\"."


def to_row(example: dict) -> dict:
    """One GSM8K example ({"question", "answer": solution "... #### n"}) -> {"prompt": messages, "answer": "n"}."""
    answer = reference_answer(example["answer"])
    if answer is None:
        raise ValueError(f"GSM8K solution without a '#### <number>' final answer: {example['answer']!r}")
    return {"prompt": [{"role": "user", "content": example["question"] + INSTRUCTION}], "answer": answer}


def convert(source):
    """DatasetDict of GSM8K splits -> the same splits with columns `prompt` and `answer` (see to_row)."""
    import datasets

    # the source's `answer` (the full solution) is replaced by its final number; `question` goes into `prompt`
    return datasets.DatasetDict({split: ds.map(to_row, remove_columns=["question"]) for split, ds in source.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/gsm8k", help="folder the DatasetDict is saved to (default: %(default)s)")
    args = parser.parse_args()

    import datasets

    converted = convert(datasets.load_dataset(SOURCE, CONFIG))
    converted.save_to_disk(args.out)
    print(f"saved {args.out}: " + ", ".join(f"{split} {len(ds)} rows" for split, ds in converted.items()))


if __name__ == "__main__":
    main()
