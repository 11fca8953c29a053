"""Images in prompts, as TRL users have them: an `image` or `images` column (PIL images, file paths, or
datasets.Image), prompts in conversational form with `{"type": "image"}` parts or plain text holding the model's image
placeholder, several images per prompt.

`Vision.from_data` decides once at setup: None when the data has no image column (every text path unchanged); a
one-line error when it has one and the model is text-only (no vision config), or when the model's processor cannot
place the images; else the model's processor, which turns each prompt and its images into token ids (each image
placeholder expanded to the model's image tokens) and the image inputs its forward takes (`pixel_values`, and what
other families need: `image_grid_thw`, `image_sizes`, ...). Those inputs are kept per row (`RowImages`: a dict of
tensors whose first dimension counts that row's images, or None for a row without any), travel with the row through
the rollout and its micro-batches, and are put together for one model call by `model_inputs`.

A leaf module: it imports no project module but errors.py (policy_common's forwards call `model_inputs`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from plumbing.errors import UserError

IMAGE_COLUMNS = ("images", "image")  # TRL 1.16's names: a list of images per row, or one
RowImages = Optional[Dict[str, torch.Tensor]]  # one row's image inputs (first dimension: its images), or None


def image_column(columns: Sequence[str]) -> Optional[str]:
    """The data's image column (`images` or `image`), None when it has none."""
    return next((c for c in IMAGE_COLUMNS if c in columns), None)


def is_vision_model(config) -> bool:
    """Does the model config describe a vision-language model (a vision tower beside the language model)?"""
    return getattr(config, "vision_config", None) is not None


def places_own_positions(model) -> bool:
    """Does `model` (or the model a wrapper holds) compute its own position ids, from the token ids, the attention mask
    and the image inputs? Qwen2-VL and its successors place image tokens with multimodal rotary positions (3-D ids:
    time, height, width), which 1-D positions counting tokens would misplace."""
    config = getattr(getattr(model, "module", model), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return "mrope_section" in rope


def image_token_ids(config) -> tuple:
    """The ids a vision-language model uses as image (and video) placeholders, which sampling must never emit (a
    sampled one would be read as a picture that is not there); () for a text model."""
    names = ("image_token_id", "image_token_index", "video_token_id")
    return tuple(sorted({getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)}))


def save_processor(config, folder: str) -> None:
    """Into a saved vision-language model's `folder`: the processor of the model it was loaded from (config's
    `_name_or_path`), so the folder loads as a VLM again; nothing for a text model."""
    if is_vision_model(config) and config._name_or_path:
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(config._name_or_path).save_pretrained(folder)


def model_inputs(images: Optional[Sequence[RowImages]], device: torch.device, model=None, input_ids=None,
                 position_ids=None) -> dict:
    """The image inputs of one model call over rows whose image inputs are `images` (one entry per row, in row
    order; None or all-None: a text-only call): each key's tensors concatenated along their first dimension (images,
    or Qwen2-VL's patches). With the call's `input_ids`: its positions too, `position_ids` (ours: counting real tokens;
    None: the model's own), except for a call with images to a `model` that places its own (places_own_positions):
    then `mm_token_type_ids` (1 on image tokens), from which it computes its 3-D ids (generate's decoding steps too)."""
    rows = [r for r in images or () if r is not None]
    inputs = {key: torch.cat([r[key] for r in rows]).to(device) for key in rows[0]} if rows else {}
    if inputs and model is not None and places_own_positions(model):
        config = getattr(model, "module", model).config
        return {**inputs, "mm_token_type_ids": (input_ids == config.image_token_id).int()}
    return {**inputs, **({} if position_ids is None else {"position_ids": position_ids})}


def row_images(images: Optional[Sequence[RowImages]], rows) -> Optional[List[RowImages]]:
    """The image inputs of `rows` (a slice, or a tensor / list of indices) of a batch, None for a text batch."""
    if images is None:
        return None
    if isinstance(rows, slice):
        return list(images[rows])
    return [images[i] for i in (rows.tolist() if torch.is_tensor(rows) else rows)]


def require_no_images(images: Optional[Sequence[RowImages]], forward: str) -> None:
    """A forward that does not carry image inputs (packing, prompt sharing: forwards.py steps them aside for images)
    refuses them rather than scoring the rows blind."""
    if images is not None and any(r is not None for r in images):
        raise ValueError(f"the {forward} forward does not carry image inputs (forwards.py should not choose it)")


def load_image(value):
    """A PIL image in RGB from what a dataset holds: a PIL image, a datasets.Image dict ({"bytes"|"path"}) or a
    file path."""
    from PIL import Image

    if isinstance(value, dict):
        import io

        value = Image.open(io.BytesIO(value["bytes"])) if value.get("bytes") else value["path"]
    if isinstance(value, str):
        try:
            value = Image.open(value)
        except OSError as e:
            raise UserError(f"could not open image {value!r}: {e}") from None
    return value.convert("RGB")


class Vision:
    """A run's images (see the module docstring): `processor` (the model's: image processor and tokenizer),
    `column` (the data's image column), `model_name` (for messages)."""

    def __init__(self, processor, column: str, model_name: str):
        self.processor, self.column, self.model_name = processor, column, model_name

    @classmethod
    def from_data(cls, model_name: str, config, columns: Sequence[str], dataset_name: str,
                  trust_remote_code: bool = False) -> Optional["Vision"]:
        """None without an image column; a one-line UserError for a text-only model given images, or a processor
        that cannot place them; else the model's processor, loaded once."""
        column = image_column(columns)
        if column is None:
            return None
        if not is_vision_model(config):
            raise UserError(f"dataset {dataset_name!r} has an {column!r} column but --model {model_name!r} is a "
                            f"text-only model ({type(config).__name__}, no vision config): give a vision-language "
                            "model, or data without images")
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(model_name, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise UserError(f"--model {model_name!r}: could not load its processor ({e})".splitlines()[0]) from None
        if getattr(processor, "image_processor", None) is None or not getattr(processor, "image_token", None):
            raise UserError(f"--model {model_name!r}: its processor ({type(processor).__name__}) has no image "
                            f"processor or image token, so the {column!r} column's images cannot be placed")
        return cls(processor, column, model_name)

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    def images_of(self, row: dict) -> list:
        """The PIL images of a dataset row (its image column: one image, or a list)."""
        value = row.get(self.column)
        values = [] if value is None else value if isinstance(value, (list, tuple)) else [value]
        return [load_image(v) for v in values]

    def encode(self, prompt, images: list, max_prompt_length: Optional[int] = None):
        """One prompt (text, or a conversation rendered with the processor's chat template) and its images ->
        (token ids with each image placeholder expanded, RowImages or None). The prompt must place as many images as
        the row has."""
        if not isinstance(prompt, str):
            prompt = self.processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        placed = prompt.count(self.processor.image_token)
        if placed != len(images):
            raise UserError(f"a prompt places {placed} image(s) ({self.processor.image_token!r}) but its row's "
                            f"{self.column!r} holds {len(images)}: {prompt[:80]!r}")
        inputs = self.processor(text=[prompt], images=[images] if images else None, return_tensors="pt")
        ids = inputs.pop("input_ids")[0].tolist()
        for per_token in ("attention_mask", "token_type_ids", "mm_token_type_ids"):  # the model derives them from ids
            inputs.pop(per_token, None)
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            raise UserError(f"a prompt with its image tokens is {len(ids)} tokens, longer than --max_prompt_length "
                            f"{max_prompt_length}")
        return ids, (dict(inputs) if images else None)

    def encode_rows(self, rows: Sequence[dict], max_prompt_length: Optional[int] = None) -> List[List[int]]:
        """The token ids of the rows' prompts, each image placeholder expanded (the image inputs are computed again
        for the rows a step samples, `row_inputs`: a dataset's worth of pixels is never held)."""
        return [self.encode(row["prompt"], self.images_of(row), max_prompt_length)[0] for row in rows]

    def row_inputs(self, row: dict, blank: bool = False) -> RowImages:
        """The image inputs of one dataset row's prompt; `blank`: of blank images the same size instead (the "blind"
        control of an evaluation: what the policy answers without seeing)."""
        images = self.images_of(row)
        if blank:
            from PIL import Image

            images = [Image.new("RGB", image.size, (128, 128, 128)) for image in images]
        return self.encode(row["prompt"], images)[1]

    def rows_inputs(self, rows: Sequence[dict], blank: bool = False, repeats: int = 1) -> List[RowImages]:
        """`row_inputs` of each row, repeated `repeats` times in a row (a prompt's samples share its inputs)."""
        return [inputs for row in rows for inputs in [self.row_inputs(row, blank)] * repeats]

    def undecoded(self, data):
        """A datasets.Dataset with its image column read as the files' bytes (datasets.Image(decode=False)): the
        offline scripts keep every row, and a dataset's worth of decoded pictures would not fit in memory."""
        from datasets import Image, List, Sequence

        feature = data.features.get(self.column)
        if isinstance(feature, Image):
            return data.cast_column(self.column, Image(decode=False))
        if isinstance(feature, (List, Sequence)) and isinstance(feature.feature, Image):
            return data.cast_column(self.column, List(Image(decode=False)))
        return data

    def source(self, row: dict) -> "ImageSource":
        """An offline dataset row's images, with its prompt (`ImageSource`)."""
        return ImageSource(self, row)

    def refuse(self, *features) -> None:
        """A one-line error for the first (flag, asked) of `features` that was asked for and does not take images
        yet."""
        for flag, asked in features:
            if asked:
                raise UserError(f"{flag} with images (the data's {self.column!r} column): not supported yet (sft, dpo, "
                                "kto, rloo, grpo and distill take images)")


class ImageSource:
    """One offline example's prompt with its images, as the dataset holds them (undecoded: `Vision.undecoded`), and
    the rest of its dataset row (`row`: what a gold scorer reads). The offline scripts (sft, dpo, kto) keep one in each
    tokenised row under `images` and encode it when a micro-batch needs it (`batch_inputs`): the pixels of one batch
    are held at a time, never a dataset's."""

    def __init__(self, vision: Vision, row: dict):
        self.vision, self.row, self._ids = vision, row, None

    def prompt_ids(self, max_prompt_length: Optional[int] = None) -> List[int]:
        """The prompt's token ids, each image placeholder expanded (computed once); longer than `max_prompt_length`
        is a UserError: a prompt with images is never cut (a cut would split an image's tokens)."""
        if self._ids is None:
            self._ids = self.vision.encode(self.row["prompt"], self.vision.images_of(self.row))[0]
        if max_prompt_length is not None and len(self._ids) > max_prompt_length:
            raise UserError(f"a prompt with its image tokens is {len(self._ids)} tokens, longer than "
                            f"--max_prompt_length {max_prompt_length} (prompts with images are not cut)")
        return self._ids

    def inputs(self, blank: bool = False) -> RowImages:
        """The image inputs of the prompt (`blank`: of blank images the same size, Vision.row_inputs)."""
        return self.vision.row_inputs(self.row, blank)

    def with_prompt(self, prompt) -> "ImageSource":
        """The same row's images before another prompt (sft.py's `messages` rows: the conversation before the last
        message)."""
        return ImageSource(self.vision, {**self.row, "prompt": prompt})


def batch_inputs(rows: Sequence[dict], copies: int = 1, blank: bool = False) -> Optional[List[RowImages]]:
    """The image inputs of offline `rows` (each holding its ImageSource under `images`, or none: text) in the row order
    of data_utils.concatenated_inputs: the rows' own, repeated `copies` times (one per completion); None for text."""
    if not rows or rows[0].get("images") is None:
        return None
    return [row["images"].inputs(blank) for row in rows] * copies


def vllm_prompt(ids: List[int], images: Optional[list], image_token_ids: Sequence[int]) -> dict:
    """vLLM's prompt of one row: its token ids; with `images` (its PIL images) these as multi_modal_data, and each
    image's run of placeholder tokens (`image_token_ids`; as many per image: LLaVA's) as one placeholder: vLLM expands
    the placeholders of a token prompt itself (given expanded ones, it expands the first again)."""
    if not images:
        return {"prompt_token_ids": ids}
    placeholders = [i for i, token in enumerate(ids) if token in image_token_ids]
    dropped = set(placeholders) - set(placeholders[::max(len(placeholders) // len(images), 1)])
    return {"prompt_token_ids": [t for i, t in enumerate(ids) if i not in dropped],
            "multi_modal_data": {"image": images}}
