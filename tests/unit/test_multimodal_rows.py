"""Pixel inputs laid out by row (GRPO/RLOO batches with images are cut by rows) and prompts in TRL's structured shape
for reward functions: `alignkit.data.multimodal`, on hand-made tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from alignkit.data.multimodal import ImageProcessing, flat_image_inputs, multimodal_messages


def processing(image_processor) -> ImageProcessing:
    """An `ImageProcessing` whose "images" are their names and whose image processor is `image_processor`."""
    images = ImageProcessing.__new__(ImageProcessing)
    images.processor = SimpleNamespace(image_processor=image_processor)
    images.load = lambda path: path
    return images


VALUES = {"a": 1.0, "b": 2.0, "c": 3.0}


def llava_like(images, return_tensors):
    """One entry per image: `[images, 2]`, image x filled with its value."""
    return {"pixel_values": torch.tensor([[VALUES[i]] * 2 for i in images]), "image_sizes": [[1, 1]] * len(images)}


def idefics_like(images, return_tensors):
    """One batch entry holding every image: `[1, images, 2]` and a mask alike."""
    values = torch.tensor([[VALUES[i]] * 2 for i in images])[None]
    return {"pixel_values": values, "pixel_attention_mask": torch.ones_like(values, dtype=torch.long)}


def test_row_layout_and_back_hand_computed():
    """Rows [[a], [], [b, c]]: `[3 rows, 2 slots, 2]` with zeros in the empty slots, counts [1, 0, 2]; rows [2, 0]
    flatten to the images b, c, a in that order; rows [1] have none."""
    rows = processing(llava_like).row_pixel_inputs([["a"], [], ["b", "c"]])
    assert rows["image_counts"].tolist() == [1, 0, 2]
    assert rows["pixel_values"].tolist() == [[[1, 1], [0, 0]], [[0, 0], [0, 0]], [[2, 2], [3, 3]]]
    assert "image_sizes" not in rows  # not a tensor: not passed on
    assert flat_image_inputs(rows, torch.tensor([2, 0]))["pixel_values"].tolist() == [[2, 2], [3, 3], [1, 1]]
    assert flat_image_inputs(rows, slice(1, 2)) == {}
    assert flat_image_inputs(rows)["pixel_values"].tolist() == [[1, 1], [2, 2], [3, 3]]


def test_one_batch_entry_of_all_images_is_spread_per_image():
    """Idefics3's processor gives `[1, images, ...]` for a flat list; each image becomes `[1, ...]` of its own, so
    rows flatten to `[images, 1, ...]`, which Idefics3's model reads as the same images in the same order."""
    rows = processing(idefics_like).row_pixel_inputs([["c"], ["a", "b"]])
    assert rows["pixel_values"].shape == (2, 2, 1, 2)
    flat = flat_image_inputs(rows)
    assert flat["pixel_values"].tolist() == [[[3, 3]], [[1, 1]], [[2, 2]]]
    assert flat["pixel_attention_mask"].shape == (3, 1, 2)


def test_a_layout_without_an_image_axis_is_refused():
    def patches(images, return_tensors):  # Qwen2-VL-like: patches of every image concatenated
        return {"pixel_values": torch.zeros(7 * len(images), 4)}

    with pytest.raises(ValueError, match=r"pixel_values has shape \(14, 4\), not one entry per image \(2 images\)"):
        processing(patches).row_pixel_inputs([["a"], ["b"]])


def test_multimodal_messages_fill_placeholders_in_order():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "<image>Compare with <image>"}]
    assert multimodal_messages(messages, ["A", "B"]) == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image", "image": "A"}, {"type": "text", "text": "Compare with "},
                                     {"type": "image", "image": "B"}]}]
    assert messages[1]["content"] == "<image>Compare with <image>"  # the rows are left as they were
