"""Images in training rows, for vision-language models: found, checked, turned into tokens and pixels.

Rows name their images as LLaMA-Factory and TRL write them:

- LLaMA-Factory: an `images` column (or the column `dataset_info.json` maps as `images`) holding a list of
  paths (or one path); each image sits where an `<image>` placeholder stands in the text (sharegpt
  `conversations`, alpaca `instruction`/`input`), in order. This is its `mllm_demo` layout.
- TRL: an `images` column beside `messages` / `prompt` whose content parts hold `{"type": "image"}` where an
  image goes; `formats` writes such a part as the `<image>` placeholder, so both shapes meet here.

A relative path is read from `dataset_dir` (LLaMA-Factory's `media_dir` default). Every image is opened and
decoded when the rows are converted, before the model loads, so a missing or unreadable file, or a row whose
placeholders do not match its images, stops the run with the file and row named (`RowError`, which the loader
places).

Tokens: the model's processor decides how many tokens an image becomes (a fixed count for LLaVA, one per
merged patch for Qwen2-VL, tiles for Idefics3). `ImageProcessing.expansion` runs the processor once on the
placeholder text of the model with that image and keeps the token ids it produced; tokenisation splices them
where the `<image>` placeholder stood, so prompt and reply chunks are still tokenised apart and label masks stay
positional. Image tokens never carry loss (`mask_image_labels`). Pixels are made in the collator
(`ImageCollator`) from the same image files with the same resizing, so the tokens and the features agree.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path
from typing import Any, Sequence

from ..constants import IGNORE_INDEX
from ..errors import RowError, describe_value

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
IMAGE_COLUMN = "images"
# What an image is written as in the model's own text, where it differs from the processor's image token:
# Qwen2-VL family models find an image's span by its vision-start token, so the placeholder carries both ends.
MODEL_IMAGE_TEXT = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
}


def row_image_paths(row: dict, column: str, media_dir: str) -> list[str]:
    """The image paths of one row (absolute, relative ones read from `media_dir`); [] when it has none.

    Raises:
        RowError: the column holds something other than a path or a list of paths.
    """
    value = row.get(column)
    if value in (None, "", []):
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise RowError(column, f"expected an image path or a list of image paths, got {describe_value(value)}. "
                               "Images are given as files (relative paths are read from dataset_dir).")
    return [v if os.path.isabs(v) else str(Path(media_dir) / v) for v in values]


def count_placeholders(example: dict) -> int:
    """How many `<image>` placeholders the text of a canonical example holds (messages, prompt and replies)."""
    texts: list[str] = []
    for key in ("messages", "prompt"):
        texts += [m.get("content") or "" for m in example.get(key) or []]
    texts += [example[key] for key in ("chosen", "rejected", "completion") if isinstance(example.get(key), str)]
    return sum(text.count(IMAGE_PLACEHOLDER) for text in texts)


def check_row_images(example: dict, paths: list[str], column: str, kind: str) -> None:
    """Every image readable, and one `<image>` placeholder per image, in the prompt for pairs and prompts.

    Raises:
        RowError: naming the image file (missing, not a readable image) or the two counts.
    """
    placeholders = count_placeholders(example)
    if placeholders != len(paths):
        raise RowError(column, f"{len(paths)} image(s) but {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) in the "
                               f"text; put one {IMAGE_PLACEHOLDER} (or a {{\"type\": \"image\"}} content part) where "
                               "each image goes, in the order of the images list.")
    if kind in ("preference", "unpaired", "prompt"):
        replies = [example[k] for k in ("chosen", "rejected", "completion") if isinstance(example.get(k), str)]
        if any(IMAGE_PLACEHOLDER in reply for reply in replies):
            raise RowError(column, f"an {IMAGE_PLACEHOLDER} placeholder stands in a reply; the images of a "
                                   "preference or prompt row belong to the prompt, which the replies share.")
    for i, path in enumerate(paths):
        open_image(path, f"{column}[{i}]")


def open_image(path: str, field_name: str = IMAGE_COLUMN):
    """The image at `path` decoded and in RGB.

    Raises:
        RowError: the file is missing or is not an image PIL can decode.
    """
    from PIL import Image, UnidentifiedImageError

    if not os.path.isfile(path):
        raise RowError(field_name, f"image file {path} does not exist (relative paths are read from dataset_dir).")
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise RowError(field_name, f"image file {path} cannot be read as an image ({err}).") from None


def resize_to_pixel_bounds(image, max_pixels: int, min_pixels: int):
    """Scale `image` so its area lies in [min_pixels, max_pixels], keeping its aspect (LLaMA-Factory's rule)."""
    area = image.width * image.height
    if area > max_pixels:
        factor = math.sqrt(max_pixels / area)
    elif area < min_pixels:
        factor = math.sqrt(min_pixels / area)
    else:
        return image
    size = (max(1, int(image.width * factor)), max(1, int(image.height * factor)))
    return image.resize(size)


class ImageProcessing:
    """A vision-language model's processor, as the data layer uses it.

    Args:
        processor: the model's `ProcessorMixin` (`AutoProcessor`), holding a tokenizer and an image processor.
        model_type: the model config's `model_type` (`MODEL_IMAGE_TEXT` picks the image text for it).
        max_pixels, min_pixels: `image_max_pixels` / `image_min_pixels`.
    """

    def __init__(self, processor, model_type: str, max_pixels: int, min_pixels: int) -> None:
        self.processor = processor
        self.model_type = model_type
        self.max_pixels = max_pixels
        self.min_pixels = min_pixels
        self.image_text = MODEL_IMAGE_TEXT.get(model_type, processor.image_token)
        tokenizer = processor.tokenizer
        self.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)

    def fingerprint(self) -> dict[str, Any]:
        """What changes the tokens of an image (for the tokenisation cache key)."""
        return {"model_type": self.model_type, "image_text": self.image_text, "max_pixels": self.max_pixels,
                "min_pixels": self.min_pixels, "image_processor": self.processor.image_processor.to_json_string()}

    def save(self, output_dir: str) -> None:
        """Write the processor (image processor and tokenizer) beside a trained model, so it reloads as trained."""
        self.processor.save_pretrained(output_dir)

    def load(self, image):
        """The image at `image` (a path), or an image already open (PIL, e.g. from an API request), in RGB and
        resized to the pixel bounds."""
        image = open_image(image) if isinstance(image, str) else image.convert("RGB")
        return resize_to_pixel_bounds(image, self.max_pixels, self.min_pixels)

    @functools.lru_cache(maxsize=4096)
    def expansion(self, path: str) -> tuple[int, ...]:
        """The token ids the image at `path` becomes in this model's text."""
        return self.image_expansion(path)

    def image_expansion(self, image) -> tuple[int, ...]:
        """The token ids `image` (a path or an open image, `load`) becomes in this model's text."""
        out = self.processor(text=[self.image_text], images=[[self.load(image)]])
        return tuple(out["input_ids"][0])

    def special_ids(self, expansions: Sequence[Sequence[int]]) -> set[int]:
        """The special-token ids among `expansions`: the positions that never carry loss."""
        special = set(self.processor.tokenizer.all_special_ids) | {self.image_token_id}
        return {i for ids in expansions for i in ids if i in special}

    @functools.cached_property
    def image_token_ids(self) -> list[int]:
        """The special ids an image becomes in the text (the image token; for Idefics3 also the tokens around it), from
        the processor's expansion of a blank image: what a generated completion must never hold."""
        from PIL import Image

        side = max(1, math.isqrt(self.min_pixels))
        blank = resize_to_pixel_bounds(Image.new("RGB", (side, side)), self.max_pixels, self.min_pixels)
        ids = self.processor(text=[self.image_text], images=[[blank]])["input_ids"][0]
        return sorted(self.special_ids([ids]))

    def pixel_inputs(self, paths: Sequence[Any]) -> dict[str, Any]:
        """The image processor's tensors (`pixel_values` and what the model takes with them) for `paths` (or open
        images, `load`), in order."""
        images = [self.load(p) for p in paths]
        return dict(self.processor.image_processor(images=images, return_tensors="pt"))

    def row_pixel_inputs(self, row_paths: Sequence[Sequence[Any]]) -> dict[str, Any]:
        """The pixel inputs of N rows' images laid out by row, so a batch can be cut by rows (`flat_image_inputs`).

        The image processor runs once on every image (padded alike, as the collator's batch would be); each of its
        tensors is then put image-first and spread over the rows: `[N, K, ...]`, K the most images of one row, zeros
        where a row has fewer, with `image_counts` `[N]`. An Idefics3-style processor returns `[1, images, ...]`
        (one batch entry holding every image); its images become `[images, 1, ...]`, which its model takes alike.
        Example: rows [[a], [], [b, c]] give `pixel_values` `[3, 2, 3, H, W]` and `image_counts` [1, 0, 2].

        Raises:
            ValueError: a tensor of the processor has no axis of one entry per image (e.g. Qwen2-VL's patches).
        """
        import torch

        counts = [len(paths) for paths in row_paths]
        flat = self.pixel_inputs([p for paths in row_paths for p in paths]) if sum(counts) else {}
        total, width = sum(counts), max(counts, default=0)
        out: dict[str, Any] = {"image_counts": torch.tensor(counts, dtype=torch.long)}
        for key, value in flat.items():
            if not torch.is_tensor(value):
                continue
            if value.dim() >= 2 and value.size(0) == 1 and value.size(1) == total and total != 1:
                value = value[0].unsqueeze(1)  # [1, images, ...] -> [images, 1, ...]
            if value.size(0) != total:
                raise ValueError(f"the image processor's {key} has shape {tuple(value.shape)}, not one entry per image "
                                 f"({total} images); this model's images cannot be spread over rows.")
            rows = value.new_zeros(len(counts), width, *value.shape[1:])
            rows[torch.arange(width)[None, :] < torch.tensor(counts)[:, None]] = value
            out[key] = rows
        return out


def tokenize_with_images(tokenizer, texts: list[str], expansions: Sequence[Sequence[int]]) -> list[list[int]]:
    """Tokenise `texts` (without special tokens added) with each `<image>` placeholder replaced by the next of
    `expansions`, in order across the texts."""
    queue = list(expansions)
    out = []
    for text in texts:
        pieces = text.split(IMAGE_PLACEHOLDER)
        piece_ids = tokenizer(pieces, add_special_tokens=False)["input_ids"]
        ids: list[int] = list(piece_ids[0])
        for more in piece_ids[1:]:
            ids += list(queue.pop(0)) + list(more)
        out.append(ids)
    return out


def mask_image_labels(input_ids: list[int], labels: list[int], image_ids: set[int]) -> list[int]:
    """`labels` with -100 wherever `input_ids` holds an image's special token (image pads, vision start/end)."""
    return [IGNORE_INDEX if token in image_ids else label for token, label in zip(input_ids, labels)]


def image_tokens_whole(input_ids: list[int], expansions: Sequence[Sequence[int]], image_token_id: int) -> bool:
    """Whether `input_ids` still holds every image token of `expansions` (cutoff_len may have cut into one)."""
    return input_ids.count(image_token_id) == sum(list(ids).count(image_token_id) for ids in expansions)


class ImageCollator:
    """Wraps a text collator: adds the pixel inputs of the batch's images, in the order their tokens appear.

    A pairwise batch (chosen rows, then rejected rows) repeats each pair's prompt images for its rejected row.

    Args:
        collator: the text collator (supervised, pairwise, unpaired).
        images: the model's `ImageProcessing`.
        pairwise: the batch holds each feature twice (chosen then rejected).
    """

    def __init__(self, collator, images: ImageProcessing, pairwise: bool = False) -> None:
        self.collator = collator
        self.images = images
        self.pairwise = pairwise

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        paths = [list(f.get(IMAGE_COLUMN) or []) for f in features]
        batch = self.collator([{k: v for k, v in f.items() if k != IMAGE_COLUMN} for f in features])
        if self.pairwise:
            paths = paths + paths
        flat = [p for row in paths for p in row]
        if flat:
            batch.update(self.images.pixel_inputs(flat))
        return batch


def image_collator(collator, images: ImageProcessing, *, pairwise: bool = False, stepping_aside: Sequence[str] = ()):
    """`collator` wrapped in an `ImageCollator`; one info line names the settings that step aside for images
    (`stepping_aside`: the ones switched on, e.g. `padding_free`, `packing`)."""
    if stepping_aside:
        logger.info("Vision-language model: %s off (rows with images cannot carry their pixel_values that way); "
                    "batches are padded.", " and ".join(stepping_aside))
    return ImageCollator(collator, images, pairwise=pairwise)


def image_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The image processor's entries of a collated batch (`pixel_values`, `image_grid_thw`, `image_sizes`,
    `pixel_attention_mask`, ...), to pass to the model beside the token ids; {} for a text batch."""
    return {k: v for k, v in batch.items() if k.startswith(("pixel_", "image_"))}


def flat_image_inputs(row_inputs: dict[str, Any], rows=None) -> dict[str, Any]:
    """The model's pixel inputs for some rows of `ImageProcessing.row_pixel_inputs`' layout (`rows`: an index or
    slice; None: all), their images in row order as the image tokens come; {} when those rows have no image.

    Example: `image_counts` [1, 0, 2] and rows [2, 0] give the pixel rows of images (2, 0), (2, 1), (0, 0)."""
    import torch

    counts = row_inputs["image_counts"] if rows is None else row_inputs["image_counts"][rows]
    if not int(counts.sum()):
        return {}
    out = {}
    for key, value in row_inputs.items():
        if key == "image_counts":
            continue
        value = value if rows is None else value[rows]
        real = torch.arange(value.size(1), device=counts.device)[None, :] < counts[:, None]
        out[key] = value[real.to(value.device)]
    return out


def multimodal_messages(messages: Sequence[dict[str, Any]], images: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages whose `<image>` placeholders are filled, in TRL's structured shape: each content a list of parts,
    `{"type": "image", "image": <image>}` where a placeholder stood (the next of `images`, in order) and
    `{"type": "text", "text": ...}` for the text around it (empty text left out). TRL's GRPOTrainer hands its reward
    functions the prompts of an image batch so (`prepare_multimodal_messages`).

    Example: `[{"role": "user", "content": "<image>What?"}]`, images [img] ->
    `[{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What?"}]}]`.
    """
    queue = list(images)
    out = []
    for message in messages:
        pieces = (message.get("content") or "").split(IMAGE_PLACEHOLDER)
        parts: list[dict[str, Any]] = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
        for piece in pieces[1:]:
            parts.append({"type": "image", "image": queue.pop(0)})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append(dict(message, content=parts))
    return out


def has_images(dataset) -> bool:
    """Whether a tokenised dataset carries an `images` column with at least one image."""
    return dataset is not None and IMAGE_COLUMN in dataset.column_names and any(dataset[IMAGE_COLUMN])


__all__ = ["IMAGE_PLACEHOLDER", "IMAGE_COLUMN", "MODEL_IMAGE_TEXT", "row_image_paths", "count_placeholders",
           "check_row_images", "open_image", "resize_to_pixel_bounds", "ImageProcessing", "tokenize_with_images",
           "mask_image_labels", "image_tokens_whole", "ImageCollator", "image_collator", "image_inputs",
           "flat_image_inputs", "multimodal_messages", "has_images"]
