"""The built-in toy task: a complete, offline RLHF world that builds on a CPU in about a minute.

Task: a prompt is 3-6 distinct letters from a..l followed by "=", e.g. "f b k c =". The ideal completion is the
same letters sorted, " b c f k", then EOS.

Gold score of a completion (`gold_score`), in [0, 1]: the number of positions where the completion's letters
match the sorted letters, divided by max(len(target), len(completion)). Extra, missing, misplaced or foreign
letters all cost; only the exact sorted answer scores 1.

What gets built (deterministically from a seed, cached under $TOY_TASK_CACHE or ~/.cache/policy_rlhf/toy):
- tokenizer/: a word-level `tokenizers` tokenizer wrapped as a transformers fast tokenizer ([PAD], [EOS]).
- sft/: a tiny GPT-NeoX (Pythia architecture) causal LM trained on imperfect demonstrations (most of them a
  lazy copy of the prompt's letters, some sorted, some sorted with a mistake), so it writes task-shaped but
  mediocre completions: greedy decoding mostly copies, samples are sometimes right.
- reward/: a GPTNeoXForSequenceClassification (one label), initialised from the SFT weights and trained on
  gold-labelled pairs of the SFT policy's own samples, each text ended with EOS and scored there (its config
  records `reward_model_input: "tokens"`, which the RL scripts follow). A learned proxy: it can be over-optimised.
- datasets (save_to_disk, train/test splits): prompt/ (`prompt`), preference/ (`prompt`, `chosen`,
  `rejected`) and unpaired/ (`prompt`, `completion`, `label`: gold >= 0.75). prompt/test is the fixed
  held-out evaluation set.
- report.json: sizes, the reward model's held-out pairwise accuracy, the SFT policy's gold scores.

`toy_hard` (SETTINGS; `build(setting="toy_hard")`, `--model toy_hard`): the same builder on a harder task, where
methods end apart and below the ceiling: 5-8 letters drawn with repeats, demonstrators who also drop repeated letters
(`imperfect_demonstration`), and a reward model trained only on the pairs of prompts with at most 6 letters, which a
policy can exploit on the longer ones (report.json gives its accuracy on both). Its own cache folder (`toy_hard-v1-*`).

The teacher (`build_teacher`, for distillation; its own cache folder `teacher-*` beside the world's, built after it):
- teacher/: a larger GPT-NeoX (TEACHER_SIZE, the same vocabulary, positions and special tokens) with the world's
  tokenizer files, trained as the SFT policy but on clean demonstrations (the sorted answer) of prompts outside
  prompt/test: greedy decoding is nearly always right, where the SFT policy's mostly copies.
- report.json: the teacher's and the SFT policy's greedy gold on prompt/test, both parameter counts.

Use: `python -c "import toy_task; print(toy_task.build())"`, or any script with its defaults (`--model toy`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BUILDER_VERSION = 3  # bump whenever the build or anything it calls (generation, training) changes
TEACHER_VERSION = 1  # the same for build_teacher (its folder also names the BUILDER_VERSION of the world it reads)
TEACHER_SIZE = dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, intermediate_size=1024)
TEACHER_STEPS, TEACHER_BATCH_SIZE, TEACHER_LR = 150, 64, 2e-3
LETTERS = list("abcdefghijkl")
MIN_LETTERS, MAX_LETTERS = 3, 6
MAX_NEW_TOKENS = MAX_LETTERS + 2  # room for an answer, its EOS and one mistake
DESIRABLE_THRESHOLD = 0.75


@dataclass(frozen=True)
class Setting:
    """One toy world: its prompts, its demonstrators, and the data its reward model is trained on."""
    name: str  # the --model / --dataset alias
    version: int  # its builder version (the folder name's; bump when its build changes)
    min_letters: int
    max_letters: int
    repeats: bool  # letters drawn with replacement (a prompt may repeat a letter) or distinct
    rm_max_letters: int  # the reward model is trained on pairs of prompts with at most this many letters

    @property
    def max_new_tokens(self) -> int:
        return self.max_letters + 2  # room for an answer, its EOS and one mistake


# `toy`: the standard world. `toy_hard`: longer prompts with repeated letters, demonstrators with a systematic bug
# (they write each letter once: `imperfect_demonstration`), and a reward model trained on short prompts only, which
# the policy can exploit on the longer ones. Built by the same builder; each is its own cache folder.
SETTINGS = {"toy": Setting("toy", BUILDER_VERSION, MIN_LETTERS, MAX_LETTERS, repeats=False,
                           rm_max_letters=MAX_LETTERS),
            "toy_hard": Setting("toy_hard", 1, 5, 8, repeats=True, rm_max_letters=6)}
TOY = SETTINGS["toy"]


def cache_root() -> str:
    return os.environ.get("TOY_TASK_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "policy_rlhf", "toy"))


# ---------------------------------------------------------------------------------------------------------
# The task and its gold scorer
# ---------------------------------------------------------------------------------------------------------
def make_prompt(rng: random.Random, setting: Setting = TOY) -> str:
    n = rng.randint(setting.min_letters, setting.max_letters)
    letters = [rng.choice(LETTERS) for _ in range(n)] if setting.repeats else rng.sample(LETTERS, n)
    return " ".join(letters) + " ="


def prompt_letters(prompt: str) -> list:
    return [t for t in prompt.split() if t != "="]


def target_completion(prompt: str) -> str:
    return " " + " ".join(sorted(prompt_letters(prompt)))


def gold_score(prompt: str, completion: str, row: dict | None = None) -> float:
    """Ground truth in [0, 1]: position-wise matches against the sorted prompt letters, divided by the
    longer of target and completion. Special tokens in `completion` are ignored (`row`, the dataset row: unused)."""
    target = sorted(prompt_letters(prompt))
    response = [t for t in completion.split() if not (t.startswith("[") and t.endswith("]"))]
    if not response:
        return 0.0
    matches = sum(r == t for r, t in zip(response, target))
    return matches / max(len(target), len(response))


def imperfect_demonstration(prompt: str, rng: random.Random, setting: Setting = TOY) -> str:
    """What the (lazy, noisy) demonstrators wrote: 55% of the time the letters copied in prompt order, 30% the
    sorted answer, 15% the sorted answer with one mistake (two neighbours swapped, a letter replaced or
    dropped). The most likely demonstration is the lazy copy, so a policy imitating them decodes greedily to
    a mediocre answer while its samples contain the good one: room for preference learning and RL.
    `toy_hard`'s demonstrators have a systematic bug on top: 70% of their sorted answers write each letter once
    (a repeated letter is dropped), so the SFT policy learns to drop repeats and few of its samples keep them."""
    letters = prompt_letters(prompt)
    u = rng.random()
    if u < 0.55:
        return " " + " ".join(letters)
    answer = sorted(letters)
    if setting.repeats and rng.random() < 0.7:
        answer = sorted(set(letters))
    if u >= 0.85 and len(answer) > 1:
        kind = rng.choice(["swap", "replace", "drop"])
        i = rng.randrange(len(answer) - 1)
        if kind == "swap":
            answer[i], answer[i + 1] = answer[i + 1], answer[i]
        elif kind == "replace":
            answer[i] = rng.choice([c for c in LETTERS if c not in answer])
        else:
            del answer[i]
    return " " + " ".join(answer)


# ---------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------
def _make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[EOS]", "[UNK]", "=", *LETTERS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def _model_config(tokenizer, hidden_size: int = 128, num_hidden_layers: int = 2, num_attention_heads: int = 4,
                  intermediate_size: int = 512):
    """The SFT policy's GPT-NeoX (the default size) or the teacher's (TEACHER_SIZE): all else the same."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                         num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                         max_position_embeddings=64, rotary_pct=0.25,
                         hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
                         use_parallel_residual=True, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def _encode(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _pad(seqs, pad: int, side: str) -> torch.Tensor:
    """Token-id lists -> (B, max_len), padded on `side` ("left" for prompts, "right" for completions)."""
    width = max(len(s) for s in seqs)
    return torch.tensor([[pad] * (width - len(s)) + s if side == "left" else s + [pad] * (width - len(s))
                         for s in seqs])


def _mask_and_positions(ids: torch.Tensor, pad: int):
    """attention mask and position ids that count real tokens only (rows are [left pads | prompt | completion |
    right pads])."""
    mask = (ids != pad).long()
    return mask, (mask.cumsum(1) - 1).clamp(min=0)


def _train_causal_lm(model, tokenizer, batches, steps: int, lr: float = 2e-3):
    """`steps` AdamW steps of `model` on (prompts, completions) batches drawn from `batches`, each completion ended
    with EOS; loss on the completion tokens only."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * (1 - s / steps))
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.train()
    for _ in range(steps):
        prompts, completions = next(batches)
        q = _pad(_encode(tokenizer, prompts), pad, "left")
        r = _pad([ids + [eos] for ids in _encode(tokenizer, completions)], pad, "right")
        ids = torch.cat([q, r], 1)
        mask, pos = _mask_and_positions(ids, pad)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        labels = ids[:, q.shape[1]:].masked_fill(r == pad, -100)  # loss on completion tokens only
        loss = F.cross_entropy(logits[:, q.shape[1] - 1:-1].reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    model.eval()
    return model


def _train_sft(tokenizer, rng: random.Random, steps: int, batch_size: int, setting: Setting):
    from transformers import GPTNeoXForCausalLM

    def imperfect_batches():
        while True:
            prompts = [make_prompt(rng, setting) for _ in range(batch_size)]
            yield prompts, [imperfect_demonstration(p, rng, setting) for p in prompts]

    return _train_causal_lm(GPTNeoXForCausalLM(_model_config(tokenizer)), tokenizer, imperfect_batches(), steps)


def _train_teacher(tokenizer, rng: random.Random, avoid: set, setting: Setting):
    """The teacher: TEACHER_SIZE, trained as the SFT policy on clean demonstrations (the sorted answer) of prompts
    not in `avoid`."""
    from transformers import GPTNeoXForCausalLM

    def clean_batches():
        while True:
            prompts = []
            while len(prompts) < TEACHER_BATCH_SIZE:
                p = make_prompt(rng, setting)
                if p not in avoid:
                    prompts.append(p)
            yield prompts, [target_completion(p) for p in prompts]

    model = GPTNeoXForCausalLM(_model_config(tokenizer, **TEACHER_SIZE))
    return _train_causal_lm(model, tokenizer, clean_batches(), TEACHER_STEPS, lr=TEACHER_LR)


@torch.no_grad()
def _sample(model, tokenizer, prompts, greedy: bool, setting: Setting, chunk_size: int = 512):
    """Completions of `prompts` (pure temperature-1 sampling, or greedy), `chunk_size` prompts per `generate`."""
    from transformers import GenerationConfig

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    config = GenerationConfig(max_new_tokens=setting.max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                              bos_token_id=tokenizer.bos_token_id, suppress_tokens=[pad], **sampling)
    queries = _pad(_encode(tokenizer, prompts), pad, "left")
    completions = []
    for i in range(0, len(queries), chunk_size):
        query = queries[i:i + chunk_size]
        out = model.generate(input_ids=query, attention_mask=(query != pad).long(), generation_config=config)
        # generate pads every row after its EOS; decoding skips both
        completions += [" " + tokenizer.decode(r, skip_special_tokens=True) for r in out[:, query.shape[1]:]]
    return completions


def _rewards(model, tokenizer, texts) -> torch.Tensor:
    """Reward-model scores of whole texts (each ended with EOS), read at the last token: (B,)."""
    pad = tokenizer.pad_token_id
    ids = _pad([x + [tokenizer.eos_token_id] for x in _encode(tokenizer, texts)], pad, "right")
    mask, pos = _mask_and_positions(ids, pad)
    hidden = model.gpt_neox(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
    return model.score(hidden).squeeze(-1)[torch.arange(len(ids)), mask.sum(1) - 1]


def _train_reward(sft_dir, tokenizer, pairs, steps: int, batch_size: int, rng: random.Random):
    from transformers import GPTNeoXForSequenceClassification

    model = GPTNeoXForSequenceClassification.from_pretrained(sft_dir, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * (1 - s / steps))
    model.train()
    for _ in range(steps):
        batch = rng.sample(pairs, batch_size)
        rewards = _rewards(model, tokenizer, [p["prompt"] + c for p in batch for c in (p["chosen"], p["rejected"])])
        rewards = rewards.view(-1, 2)
        loss = -F.logsigmoid(rewards[:, 0] - rewards[:, 1]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    model.eval()
    return model


@torch.no_grad()
def _pair_accuracy(model, tokenizer, pairs) -> float:
    rewards = _rewards(model, tokenizer, [p["prompt"] + c for p in pairs for c in (p["chosen"], p["rejected"])])
    rewards = rewards.view(-1, 2)
    return (rewards[:, 0] > rewards[:, 1]).float().mean().item()


def _make_pairs(model, tokenizer, prompts, setting: Setting):
    """Two SFT samples per prompt, gold-labelled; ties (equal gold) are dropped."""
    completions = _sample(model, tokenizer, [p for p in prompts for _ in range(2)], greedy=False, setting=setting)
    pairs, samples = [], []
    for i, prompt in enumerate(prompts):
        a, b = completions[2 * i], completions[2 * i + 1]
        ga, gb = gold_score(prompt, a), gold_score(prompt, b)
        samples += [(prompt, a, ga), (prompt, b, gb)]
        if ga != gb:
            chosen, rejected = (a, b) if ga > gb else (b, a)
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs, samples


def save_dataset(splits: dict, path: str) -> None:
    """{split: rows} -> a `save_to_disk` DatasetDict at `path` whose files depend only on the rows."""
    from datasets import Dataset, DatasetDict

    dd = DatasetDict()
    for split, rows in splits.items():
        ds = Dataset.from_list(rows)
        digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
        ds._fingerprint = digest  # deterministic files: the default fingerprint is random
        dd[split] = ds
    dd.save_to_disk(path)


def _build_into(root: str, seed: int, verbose: bool, setting: Setting) -> dict:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    t0 = time.time()
    log = (lambda *a: print("[toy]", *a, flush=True)) if verbose else (lambda *a: None)

    tokenizer = _make_tokenizer()
    tokenizer.save_pretrained(os.path.join(root, "tokenizer"))

    # 1. SFT policy on imperfect demonstrations
    sft = _train_sft(tokenizer, rng, steps=600, batch_size=64, setting=setting)
    sft.save_pretrained(os.path.join(root, "sft"), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(root, "sft"))
    log(f"sft trained ({time.time() - t0:.0f}s)")

    # 2. prompts: train and a fixed held-out set (no overlap)
    seen, train_prompts, test_prompts = set(), [], []
    while len(test_prompts) < 256:
        p = make_prompt(rng, setting)
        if p not in seen:
            seen.add(p)
            test_prompts.append(p)
    while len(train_prompts) < 4096:
        p = make_prompt(rng, setting)
        if p not in seen:
            seen.add(p)
            train_prompts.append(p)

    # 3. gold-labelled preference pairs of the SFT policy's own samples, and a reward model on them
    pref_train, samples_train = _make_pairs(sft, tokenizer, train_prompts, setting)
    pref_test, samples_test = _make_pairs(sft, tokenizer, test_prompts, setting)
    log(f"pairs sampled ({time.time() - t0:.0f}s)")
    # the reward model's own pairs: those of prompts with at most rm_max_letters letters (toy: all of them)
    rm_pairs = [p for p in pref_train if len(prompt_letters(p["prompt"])) <= setting.rm_max_letters]
    reward = _train_reward(os.path.join(root, "sft"), tokenizer, rm_pairs, steps=500, batch_size=32, rng=rng)
    reward.config.reward_model_input = "tokens"  # trained reading token ids with EOS appended (see reward_sources.py)
    reward.save_pretrained(os.path.join(root, "reward"), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(root, "reward"))
    rm_accuracy = _pair_accuracy(reward, tokenizer, pref_test)
    log(f"reward model trained, held-out pairwise accuracy {rm_accuracy:.3f} ({time.time() - t0:.0f}s)")

    # 4. datasets in the standard formats
    save_dataset({"train": [{"prompt": p} for p in train_prompts], "test": [{"prompt": p} for p in test_prompts]},
                 os.path.join(root, "prompt"))
    save_dataset({"train": pref_train, "test": pref_test}, os.path.join(root, "preference"))
    unpaired = {split: [{"prompt": p, "completion": c, "label": g >= DESIRABLE_THRESHOLD} for p, c, g in samples]
                for split, samples in (("train", samples_train), ("test", samples_test))}
    save_dataset(unpaired, os.path.join(root, "unpaired"))

    sample_gold = sum(g for _, _, g in samples_test) / len(samples_test)
    greedy = _sample(sft, tokenizer, test_prompts, greedy=True, setting=setting)
    greedy_gold = sum(gold_score(p, c) for p, c in zip(test_prompts, greedy)) / len(test_prompts)
    report = {
        "builder_version": setting.version, "seed": seed,
        "reward_model_heldout_pair_accuracy": round(rm_accuracy, 4),
        "sft_gold_sampled_T1": round(sample_gold, 4), "sft_gold_greedy": round(greedy_gold, 4),
        "n_prompt_train": len(train_prompts), "n_prompt_test": len(test_prompts),
        "n_preference_train": len(pref_train), "n_preference_test": len(pref_test),
        "unpaired_desirable_fraction_train": round(sum(r["label"] for r in unpaired["train"])
                                                   / len(unpaired["train"]), 4),
    }
    if setting.name != "toy":
        short = [p for p in pref_test if len(prompt_letters(p["prompt"])) <= setting.rm_max_letters]
        long = [p for p in pref_test if len(prompt_letters(p["prompt"])) > setting.rm_max_letters]
        report.update(setting=setting.name, n_preference_train_reward_model=len(rm_pairs),
                      reward_model_heldout_pair_accuracy_short=round(_pair_accuracy(reward, tokenizer, short), 4),
                      reward_model_heldout_pair_accuracy_long=round(_pair_accuracy(reward, tokenizer, long), 4))
    with open(os.path.join(root, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    log(f"built in {time.time() - t0:.0f}s: {report}")
    return report


def paths(root: str) -> dict:
    return {
        "root": root, "policy": os.path.join(root, "sft"), "reward": os.path.join(root, "reward"),
        "tokenizer": os.path.join(root, "tokenizer"), "prompt_dataset": os.path.join(root, "prompt"),
        "preference_dataset": os.path.join(root, "preference"), "unpaired_dataset": os.path.join(root, "unpaired"),
    }


def folder_name(seed: int, setting: str = "toy") -> str:
    """The cache folder of a build: setting (none for `toy`), builder version, seed and the torch / transformers
    releases that made it (their files and numerics are those releases'; a build by others is not reused)."""
    import transformers

    s = SETTINGS[setting]
    prefix = "" if setting == "toy" else f"{setting}-"
    return f"{prefix}v{s.version}-seed{seed}-torch{torch.__version__}-transformers{transformers.__version__}"


def cached_build(root: str, build_into) -> None:
    """Make the cache folder `root` once: `build_into(tmp)` writes a temporary folder (report.json last), which is
    renamed into place whole, so a half-written cache is never used; concurrent builders (several processes of one
    run) wait on a file lock. Builds are deterministic with a fixed thread count: it is pinned for the build only. The
    caller's torch generator is left as it was (a seeded run that builds a world on first use then samples as one that
    finds it cached)."""
    from filelock import FileLock

    if os.path.exists(os.path.join(root, "report.json")):
        return
    os.makedirs(os.path.dirname(root), exist_ok=True)
    with FileLock(root + ".lock"):
        if not os.path.exists(os.path.join(root, "report.json")):
            tmp = f"{root}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                with torch.random.fork_rng(devices=[]):
                    build_into(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            finally:
                torch.set_num_threads(threads)
            shutil.rmtree(root, ignore_errors=True)
            os.rename(tmp, root)


def build(seed: int = 0, cache_dir: str | None = None, verbose: bool = True, setting: str = "toy") -> dict:
    """Build the toy world `setting` (a SETTINGS name) once per (seed, builder version, library releases:
    `folder_name`) and return its paths (`cached_build`: a finished build is a folder with report.json, never a
    half-written one)."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown toy setting {setting!r} (known: {', '.join(SETTINGS)})")
    root = os.path.join(cache_dir or cache_root(), folder_name(seed, setting))
    cached_build(root, lambda tmp: _build_into(tmp, seed, verbose, SETTINGS[setting]))
    return paths(root)


def _build_teacher_into(root: str, seed: int, world: dict, verbose: bool, setting: Setting) -> dict:
    from datasets import load_from_disk
    from transformers import AutoTokenizer, GPTNeoXForCausalLM

    rng = random.Random(f"teacher-{seed}")  # a prompt stream of its own, not the world's
    torch.manual_seed(seed)
    t0 = time.time()
    log = (lambda *a: print("[toy teacher]", *a, flush=True)) if verbose else (lambda *a: None)

    # the world's tokenizer files, as they are: AutoTokenizer loads the teacher's tokenizer as the student's
    teacher_dir = os.path.join(root, "teacher")
    os.makedirs(teacher_dir)
    for name in sorted(os.listdir(world["tokenizer"])):
        shutil.copyfile(os.path.join(world["tokenizer"], name), os.path.join(teacher_dir, name))
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)

    test_prompts = load_from_disk(world["prompt_dataset"])["test"]["prompt"]
    teacher = _train_teacher(tokenizer, rng, avoid=set(test_prompts), setting=setting)
    teacher.save_pretrained(teacher_dir, safe_serialization=True)
    log(f"teacher trained ({time.time() - t0:.0f}s)")

    greedy = _sample(teacher, tokenizer, test_prompts, greedy=True, setting=setting)
    teacher_gold = sum(gold_score(p, c) for p, c in zip(test_prompts, greedy)) / len(test_prompts)
    with open(os.path.join(world["root"], "report.json")) as f:
        student_gold = json.load(f)["sft_gold_greedy"]
    student = GPTNeoXForCausalLM.from_pretrained(world["policy"], dtype=torch.float32)
    report = {
        "teacher_version": TEACHER_VERSION, "builder_version": setting.version, "seed": seed,
        "teacher_gold_greedy": round(teacher_gold, 4), "student_sft_gold_greedy": student_gold,
        "teacher_parameters": teacher.num_parameters(), "student_parameters": student.num_parameters(),
        "teacher_size": TEACHER_SIZE, "teacher_steps": TEACHER_STEPS, "n_prompt_test": len(test_prompts),
        "build_seconds": round(time.time() - t0, 1),
    }
    if setting.name != "toy":
        report["setting"] = setting.name
    with open(os.path.join(root, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    log(f"built in {time.time() - t0:.0f}s: {report}")
    return report


def teacher_paths(root: str) -> dict:
    return {"root": root, "teacher": os.path.join(root, "teacher"), "report": os.path.join(root, "report.json")}


def teacher_folder_name(seed: int, setting: str = "toy") -> str:
    """The teacher's cache folder, beside the world's: `teacher-`, teacher version, the world's setting and builder
    version (the teacher reads its tokenizer and test prompts), seed, torch and transformers releases."""
    import transformers

    world = "toy" if setting == "toy" else f"{setting}-"
    return (f"teacher-v{TEACHER_VERSION}-{world}{SETTINGS[setting].version}-seed{seed}-torch{torch.__version__}"
            f"-transformers{transformers.__version__}")


def build_teacher(seed: int = 0, cache_dir: str | None = None, verbose: bool = True, setting: str = "toy") -> dict:
    """Build the teacher of the toy world `setting` once per (seed, versions, library releases:
    `teacher_folder_name`), after the world itself (`build`, same seed and cache), and return its paths. Cached as
    `build` caches (`cached_build`)."""
    cache_dir = cache_dir or cache_root()
    root = os.path.join(cache_dir, teacher_folder_name(seed, setting))
    if not os.path.exists(os.path.join(root, "report.json")):
        world = build(seed, cache_dir, verbose, setting)
        cached_build(root, lambda tmp: _build_teacher_into(tmp, seed, world, verbose, SETTINGS[setting]))
    return teacher_paths(root)


def gold_scorer(dataset: str):
    """The gold scorer for a dataset name or path if it is a toy world's (any setting), else None."""
    if dataset in SETTINGS or os.path.abspath(dataset).startswith(os.path.abspath(cache_root())):
        return gold_score
    return None


if __name__ == "__main__":
    print(json.dumps(build(), indent=2))
