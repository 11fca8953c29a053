"""The toy vision world: an offline image question-answering task for vision-language models that builds on a CPU in
about a minute (`build()`; `--model toy_vision` where a script takes images).

Task: a 28 x 28 picture holds one square of one of four colours (red, green, blue, yellow) in its left or right half,
on a noisy grey background. The prompt is one of two questions, the same text for every picture: "what color is the
shape ?" or "where is the shape ?"; the answer is one word ("green", "left") then EOS, and it can be read only from
the picture: a policy that does not see it scores at chance (1/4 for colours, 1/2 for sides).

Gold score (`gold_score(row, completion)`): 1 when the completion's first word is the row's `answer`, else 0.

What gets built (deterministically from a seed, cached beside the other toy worlds, `vision-v1-*`):
- sft/: a tiny LLaVA (transformers' LlavaForConditionalGeneration: a one-layer CLIP vision tower, a projector and a
  two-layer Llama; vLLM serves the family too) with its processor (CLIP's image processor, a word-level tokenizer whose
  `<image>` stands for 4 image tokens, one per 14-pixel patch, and a chat template), trained on biased demonstrations:
  the demonstrators call green "blue" and yellow "red" more often than not (DEMO_BIAS) and say "left" for most
  right-hand squares, so the SFT policy sees (it beats chance, and its samples are often right) but greedy decoding
  follows the bias on half the pictures: room for RL to learn what the gold reward wants and the demonstrations did
  not show.
- datasets (save_to_disk, train/test, conversational prompts with an image part, an `image` column of
  datasets.Image, `answer` and `question`): prompt/ (`prompt`, `image`, `answer`, `question`), preference/ (`prompt`,
  `image`, `chosen`, `rejected`: the right answer against a wrong one, assistant messages) and unpaired/ (`prompt`,
  `image`, `completion`, `label`). prompt/test is the fixed held-out set.
- report.json: the SFT policy's greedy and sampled gold on prompt/test, and its greedy gold with every picture
  replaced by a blank one (the "blind" control: it should sit near chance).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import time

import torch
import torch.nn.functional as F

BUILDER_VERSION = 3  # bump whenever the build or anything it calls changes (2: unpaired completions as messages; 3:
# 900 SFT steps, after which the SFT policy reads the square's side: at 300 it read the colour only, so no method could
# learn the side within a short run and every one stopped at the same greedy answers; attention heads 32 wide, the
# narrowest vLLM's CPU attention takes)
SIZE, PATCH = 28, 14  # pixels of a picture, of a patch: 2 x 2 patches, 4 image tokens
COLORS = {"red": (210, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 210), "yellow": (225, 205, 40)}
SIDES = ("left", "right")
QUESTIONS = {"color": "what color is the shape ?", "side": "where is the shape ?"}
CONFUSED = {"green": "blue", "yellow": "red", "right": "left"}  # what demonstrators say instead, DEMO_BIAS of the time
DEMO_BIAS = 0.55
SFT_STEPS, SFT_BATCH, SFT_LR = 900, 64, 3e-3
WORDS = ["USER:", "ASSISTANT:", *" ".join(QUESTIONS.values()).split(), *COLORS, *SIDES]
SPECIAL = ["[PAD]", "[EOS]", "[UNK]", "<image>"]
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- 'USER: ' if m['role'] == 'user' else 'ASSISTANT: ' }}"
    "{%- if m['content'] is string %}{{- m['content'] + ' ' }}{%- else %}{%- for part in m['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<image> ' }}{%- else %}{{- part['text'] + ' ' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- if m['role'] == 'assistant' %}{{- '[EOS] ' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'ASSISTANT: ' }}{%- endif %}")


# ---------------------------------------------------------------------------------------------------------
# The task and its gold scorer
# ---------------------------------------------------------------------------------------------------------
def draw(color: str | None, side: str, rng: random.Random):
    """A SIZE x SIZE RGB picture: grey noise, and (unless `color` is None: the blank control) a square of `color`,
    9-14 pixels wide (as wide as the half at most: 14), somewhere in the `side` half."""
    from PIL import Image

    image = Image.new("RGB", (SIZE, SIZE))
    image.putdata([tuple(rng.randint(110, 150) for _ in range(3)) for _ in range(SIZE * SIZE)])
    if color is not None:
        width = rng.randint(9, 14)
        left = rng.randint(0, SIZE // 2 - width) + (SIZE // 2 if side == "right" else 0)
        top = rng.randint(0, SIZE - width)
        image.paste(COLORS[color], (left, top, left + width, top + width))
    return image


def prompt(question: str) -> list:
    """The conversational prompt of a question kind: one user turn, the picture then the question."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[question]}]}]


def make_item(rng: random.Random) -> dict:
    """A random row: its question kind, picture and answer."""
    color, side, question = rng.choice(list(COLORS)), rng.choice(SIDES), rng.choice(list(QUESTIONS))
    return {"question": question, "image": draw(color, side, rng), "answer": color if question == "color" else side}


def demonstration(answer: str, rng: random.Random) -> str:
    """What a biased demonstrator answers: the confused word DEMO_BIAS of the time, where there is one."""
    return CONFUSED[answer] if answer in CONFUSED and rng.random() < DEMO_BIAS else answer


def gold_score(prompt: str, completion: str, row: dict) -> float:
    """1.0 when the completion's first answer word (a colour or a side) is the dataset row's `answer`, else 0.0; the
    prompt's text is the same for every picture, so it does not count."""
    words = [w for w in completion.split() if w in COLORS or w in SIDES]
    return float(bool(words) and words[0] == row["answer"])


def gold_scorer(dataset: str):
    """The gold scorer for `toy_vision` or a path inside one of its builds (a `vision-*` folder of the toy cache),
    else None."""
    from toy_worlds import toy_task

    if dataset == "toy_vision":
        return gold_score
    relative = os.path.relpath(os.path.abspath(dataset), os.path.abspath(toy_task.cache_root()))
    return gold_score if relative.startswith("vision-") else None


# ---------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------
def make_processor():
    """The processor: CLIP's image processor at SIZE pixels (PIL backend: no torchvision needed), a word-level
    tokenizer with `<image>` and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + sorted(set(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]",
                                        extra_special_tokens={"image_token": "<image>"})
    tokenizer.chat_template = CHAT_TEMPLATE
    images = CLIPImageProcessorPil(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE, patch_size=PATCH,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def make_model(processor):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = processor.tokenizer
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                       tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=SIZE, patch_size=PATCH, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids(
        "<image>"), vision_feature_select_strategy="default", vision_feature_layer=-1, projector_hidden_act="gelu",
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    return LlavaForConditionalGeneration(config)


def encode(processor, items: list, completions: list | None = None) -> dict:
    """Processor inputs of items' prompts (left-padded), with `completions` (words, EOS appended) after them when
    given: input_ids, attention_mask, pixel_values, and `prompt_length` (the prompt columns)."""
    tokenizer = processor.tokenizer
    texts = [processor.apply_chat_template(prompt(item["question"]), add_generation_prompt=True) for item in items]
    batch = processor(text=texts, images=[[item["image"]] for item in items], return_tensors="pt", padding=True,
                      padding_side="left")
    batch["prompt_length"] = batch["input_ids"].shape[1]
    if completions is not None:
        ids = [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for c in completions]
        width = max(len(i) for i in ids)
        responses = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids])
        batch["input_ids"] = torch.cat([batch["input_ids"], responses], 1)
        batch["attention_mask"] = torch.cat([batch["attention_mask"], (responses != tokenizer.pad_token_id).long()], 1)
    return batch


def train(model, processor, rng: random.Random, steps: int, target):
    """`steps` AdamW steps on fresh items (SFT_BATCH each), the completion of each `target(answer, rng)`; loss on the
    answer and its EOS. The recipe of both the SFT policy (biased demonstrations) and the teacher (right answers)."""
    pad = processor.tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30) * (1 - s / steps))
    model.train()
    for _ in range(steps):
        items = [make_item(rng) for _ in range(SFT_BATCH)]
        batch = encode(processor, items, [target(item["answer"], rng) for item in items])
        length = batch.pop("prompt_length")
        logits = model(**batch).logits
        labels = batch["input_ids"][:, length:].masked_fill(batch["input_ids"][:, length:] == pad, -100)
        loss = F.cross_entropy(logits[:, length - 1:-1].reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model.eval()


def train_sft(processor, rng: random.Random):
    """SFT_STEPS steps (`train`) on biased demonstrations of fresh items."""
    return train(make_model(processor), processor, rng, SFT_STEPS, demonstration)


@torch.no_grad()
def answer(model, processor, items: list, greedy: bool, chunk: int = 256) -> list:
    """The model's completions (decoded, special tokens dropped) of the items' prompts."""
    from transformers import GenerationConfig

    tokenizer = processor.tokenizer
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    config = GenerationConfig(max_new_tokens=3, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, suppress_tokens=[tokenizer.pad_token_id], **sampling)
    out = []
    for i in range(0, len(items), chunk):
        batch = encode(processor, items[i:i + chunk])
        length = batch.pop("prompt_length")
        ids = model.generate(**batch, generation_config=config)
        out += [tokenizer.decode(row, skip_special_tokens=True) for row in ids[:, length:]]
    return out


def mean_gold(items: list, completions: list) -> float:
    return sum(gold_score("", c, item) for item, c in zip(items, completions)) / len(items)


def save_dataset(splits: dict, path: str) -> None:
    """{split: rows} -> a save_to_disk DatasetDict at `path`, its `image` column datasets.Image (PNG bytes), its files
    a function of the rows only."""
    from datasets import Dataset, DatasetDict, Features, Image, Value

    dd = DatasetDict()
    for split, rows in splits.items():
        encoded = []
        for row in rows:
            png = io.BytesIO()
            row["image"].save(png, format="PNG")
            encoded.append({**row, "image": {"bytes": png.getvalue(), "path": None}})
        columns = {k: Value("string") for k in rows[0]
                   if k not in ("image", "prompt", "chosen", "rejected", "completion", "label")}
        features = Features({**{k: v for k, v in Dataset.from_list([
            {k: v for k, v in rows[0].items() if k != "image"}]).features.items()}, **columns, "image": Image()})
        ds = Dataset.from_list(encoded, features=features)
        digest = hashlib.sha256(b"".join(json.dumps({k: v for k, v in r.items() if k != "image"}, sort_keys=True)
                                         .encode() + r["image"]["bytes"] for r in encoded)).hexdigest()[:16]
        ds._fingerprint = digest  # deterministic files: the default fingerprint is random
        dd[split] = ds
    dd.save_to_disk(path)


def _build_into(root: str, seed: int, verbose: bool) -> dict:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    t0 = time.time()
    log = (lambda *a: print("[toy_vision]", *a, flush=True)) if verbose else (lambda *a: None)
    processor = make_processor()
    sft = train_sft(processor, rng)
    sft.save_pretrained(os.path.join(root, "sft"), safe_serialization=True)
    processor.save_pretrained(os.path.join(root, "sft"))
    log(f"sft trained ({time.time() - t0:.0f}s)")

    splits = {"train": [make_item(rng) for _ in range(2048)], "test": [make_item(rng) for _ in range(256)]}
    rows = {s: [{"prompt": prompt(i["question"]), **i} for i in items] for s, items in splits.items()}
    save_dataset(rows, os.path.join(root, "prompt"))
    wrong = {a: [w for w in (COLORS if a in COLORS else SIDES) if w != a] for a in [*COLORS, *SIDES]}
    save_dataset({s: [{"prompt": r["prompt"], "image": r["image"],
                       "chosen": [{"role": "assistant", "content": r["answer"]}],
                       "rejected": [{"role": "assistant", "content": rng.choice(wrong[r["answer"]])}]}
                      for r in split_rows] for s, split_rows in rows.items()}, os.path.join(root, "preference"))
    save_dataset({s: [{"prompt": r["prompt"], "image": r["image"],
                       "completion": [{"role": "assistant", "content": c}], "label": c == r["answer"]}
                      for r in split_rows for c in [rng.choice([r["answer"], *wrong[r["answer"]][:1]])]]
                  for s, split_rows in rows.items()}, os.path.join(root, "unpaired"))

    test = splits["test"]
    blank = [{**item, "image": draw(None, "left", rng)} for item in test]
    report = {"builder_version": BUILDER_VERSION, "seed": seed,
              "sft_gold_greedy": round(mean_gold(test, answer(sft, processor, test, greedy=True)), 4),
              "sft_gold_sampled_T1": round(mean_gold(test, answer(sft, processor, test, greedy=False)), 4),
              "sft_gold_greedy_blind": round(mean_gold(blank, answer(sft, processor, blank, greedy=True)), 4),
              "chance": round(sum(1 / 4 if i["question"] == "color" else 1 / 2 for i in test) / len(test), 4),
              "n_prompt_train": len(splits["train"]), "n_prompt_test": len(test),
              "parameters": sum(p.numel() for p in sft.parameters())}
    with open(os.path.join(root, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    log(f"built in {time.time() - t0:.0f}s: {report}")
    return report


def paths(root: str) -> dict:
    return {"root": root, "policy": os.path.join(root, "sft"), "prompt_dataset": os.path.join(root, "prompt"),
            "preference_dataset": os.path.join(root, "preference"), "unpaired_dataset": os.path.join(root, "unpaired")}


def folder_name(seed: int) -> str:
    import transformers

    return f"vision-v{BUILDER_VERSION}-seed{seed}-torch{torch.__version__}-transformers{transformers.__version__}"


def build(seed: int = 0, cache_dir: str | None = None, verbose: bool = True) -> dict:
    """Build the toy vision world once per (seed, builder version, library releases) and return its paths (the toy
    worlds' cache: toy_task.cached_build)."""
    from toy_worlds import toy_task

    root = os.path.join(cache_dir or toy_task.cache_root(), folder_name(seed))
    toy_task.cached_build(root, lambda tmp: _build_into(tmp, seed, verbose))
    return paths(root)


# ---------------------------------------------------------------------------------------------------------
# The teacher (distill.py --model toy_vision): the student's family, processor and vocabulary, trained on the right
# answers, so it reads the pictures as the demonstrators did not
# ---------------------------------------------------------------------------------------------------------
TEACHER_VERSION = 1  # bump whenever the teacher's build changes (its folder also names the world's BUILDER_VERSION)
TEACHER_STEPS = 200
TEACHER_SIZE = {"text_config": dict(hidden_size=128, intermediate_size=256),  # the student: 64, 128
                "vision_config": dict(hidden_size=64, intermediate_size=128)}  # the student: 32, 64
PROCESSOR_FILES = ("chat_template.jinja", "processor_config.json", "tokenizer.json", "tokenizer_config.json")


def make_teacher_model(processor):
    """`make_model`'s LLaVA, wider (TEACHER_SIZE): the student's family, image token and processor."""
    from transformers import LlavaForConditionalGeneration

    config = make_model(processor).config
    for part, sizes in TEACHER_SIZE.items():
        getattr(config, part).update(sizes)
    return LlavaForConditionalGeneration(config)


def train_teacher(processor, rng: random.Random):
    """TEACHER_STEPS steps (`train`) on the right answers of fresh items (no DEMO_BIAS)."""
    return train(make_teacher_model(processor), processor, rng, TEACHER_STEPS, lambda answer, rng: answer)


def _build_teacher_into(root: str, seed: int, world: dict, verbose: bool) -> dict:
    import shutil

    from datasets import load_from_disk
    from transformers import AutoProcessor

    rng = random.Random(f"vision-teacher-{seed}")  # an item stream of its own, not the world's
    torch.manual_seed(seed)
    t0 = time.time()
    log = (lambda *a: print("[toy_vision teacher]", *a, flush=True)) if verbose else (lambda *a: None)
    teacher_dir = os.path.join(root, "teacher")
    os.makedirs(teacher_dir)
    for name in PROCESSOR_FILES:  # the student's processor files as they are: one tokenizer, one image processor
        shutil.copyfile(os.path.join(world["policy"], name), os.path.join(teacher_dir, name))
    processor = AutoProcessor.from_pretrained(teacher_dir)
    teacher = train_teacher(processor, rng)
    teacher.save_pretrained(teacher_dir, safe_serialization=True)
    log(f"teacher trained ({time.time() - t0:.0f}s)")

    test = load_from_disk(world["prompt_dataset"])["test"].to_list()
    from PIL import Image

    test = [{**row, "image": Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB")} for row in test]
    blank = [{**row, "image": draw(None, "left", rng)} for row in test]
    with open(os.path.join(world["root"], "report.json")) as f:
        student = json.load(f)
    report = {"teacher_version": TEACHER_VERSION, "builder_version": BUILDER_VERSION, "seed": seed,
              "teacher_gold_greedy": round(mean_gold(test, answer(teacher, processor, test, greedy=True)), 4),
              "teacher_gold_greedy_blind": round(mean_gold(blank, answer(teacher, processor, blank, greedy=True)), 4),
              "student_sft_gold_greedy": student["sft_gold_greedy"], "chance": student["chance"],
              "teacher_steps": TEACHER_STEPS, "teacher_size": TEACHER_SIZE, "n_prompt_test": len(test),
              "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
              "student_parameters": student["parameters"], "build_seconds": round(time.time() - t0, 1)}
    with open(os.path.join(root, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    log(f"teacher built in {time.time() - t0:.0f}s: {report}")
    return report


def teacher_folder_name(seed: int) -> str:
    """The teacher's cache folder, beside the world's: teacher and world versions, seed, library releases."""
    import transformers

    return (f"vision-teacher-v{TEACHER_VERSION}-world{BUILDER_VERSION}-seed{seed}-torch{torch.__version__}"
            f"-transformers{transformers.__version__}")


def build_teacher(seed: int = 0, cache_dir: str | None = None, verbose: bool = True) -> dict:
    """Build the toy vision world's teacher once per (seed, versions, library releases), after the world itself
    (`build`, same seed and cache: the teacher copies its processor and reports on its test split), and return its
    paths: root, teacher (the folder distill.py loads), report (report.json: its greedy gold, and blind)."""
    from toy_worlds import toy_task

    cache_dir = cache_dir or toy_task.cache_root()
    root = os.path.join(cache_dir, teacher_folder_name(seed))
    if not os.path.exists(os.path.join(root, "report.json")):
        world = build(seed, cache_dir, verbose)
        toy_task.cached_build(root, lambda tmp: _build_teacher_into(tmp, seed, world, verbose))
    return {"root": root, "teacher": os.path.join(root, "teacher"), "report": os.path.join(root, "report.json")}
