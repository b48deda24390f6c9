"""Packing: bin assignment, row layout, and a packed step equal to the unpacked one."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from alignkit.config import TrainingArguments
from alignkit.data.packing import PackedCollator, pack_dataset, pack_lengths
from alignkit.stages.sft import SFTTrainer


def test_pack_lengths_best_fit_decreasing():
    """Capacity 10, lengths [6, 5, 4, 3, 2] (indices 0..4) placed longest first:
    6 -> new bin A (4 left); 5 -> new bin B (5 left); 4 -> tightest fit A (0 left);
    3 -> B (2 left); 2 -> B (0 left). Bins: [0, 2], [1, 3, 4]. An over-long example gets its own bin.
    """
    assert pack_lengths([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]
    assert pack_lengths([12, 3], 10) == [[0], [1]]
    for bin_ in pack_lengths([random.Random(i).randint(1, 9) for i in range(50)], 16):
        assert sum(random.Random(i).randint(1, 9) for i in bin_) <= 16


def test_pack_dataset_row_layout_and_collator():
    """Two examples in one row: positions restart, the second example's first label becomes -100;
    the collator pads positions 0, 1, ... so padding is a block of its own, labels -100, mask 0."""
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]],
                            "labels": [[-100, 2, 3], [4, 5], [-100, -100, 8, 9]]})
    packed = pack_dataset(ds, cutoff_len=5)
    rows = sorted(packed.to_list(), key=lambda r: r["input_ids"])
    assert rows[0] == {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, 3, -100, 5],
                       "position_ids": [0, 1, 2, 0, 1], "attention_mask": [1] * 5}
    assert rows[1]["input_ids"] == [6, 7, 8, 9] and rows[1]["position_ids"] == [0, 1, 2, 3]
    batch = PackedCollator(pad_token_id=0)(rows)
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 3, 0]
    assert batch["labels"][1].tolist() == [-100, -100, 8, 9, -100]
    assert batch["attention_mask"][1].tolist() == [1, 1, 1, 1, 0]


def step(model_dir, tmp_path, dataset, batch_size, collator, attn_implementation):
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn_implementation)
    args = TrainingArguments(output_dir=str(tmp_path / f"run{batch_size}"), per_device_train_batch_size=batch_size,
                             max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                             max_grad_norm=0.0, report_to="none", remove_unused_columns=False, save_strategy="no",
                             use_cpu=True, logging_steps=1)
    before = copy.deepcopy(model.state_dict())
    result = SFTTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator).train()
    return result.training_loss, {k: before[k] - v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_step_equals_unpacked(tiny_model_dir, tmp_path, attn_implementation):
    """8 examples in one padded batch vs the same examples packed into rows of <= 24 tokens:
    same loss (1e-4) and same SGD update (1e-4). If attention leaked across examples, or a packed
    example's first token were a target, the losses would differ by far more (checked below)."""
    from tests.unit.test_sft_trainer import make_rows, pad_right

    examples = make_rows(seed=1, lengths=(4, 14), prompts=(1, 3))
    packed = pack_dataset(examples, cutoff_len=24)
    assert len(packed) < len(examples)  # several examples share a row
    unpacked_loss, unpacked_update = step(tiny_model_dir, tmp_path, examples, 8, pad_right, attn_implementation)
    packed_loss, packed_update = step(tiny_model_dir, tmp_path, packed, len(packed), PackedCollator(2),
                                      attn_implementation)
    assert packed_loss == pytest.approx(unpacked_loss, abs=1e-4)
    for name, update in unpacked_update.items():
        torch.testing.assert_close(packed_update[name], update, atol=1e-4, rtol=0, msg=name)

    # Without position resets the examples would see each other: the loss must then differ.
    leaky = packed.map(lambda row: {"position_ids": list(range(len(row["input_ids"])))})
    leaky_loss, _ = step(tiny_model_dir, tmp_path, leaky, len(packed), PackedCollator(2), attn_implementation)
    assert abs(leaky_loss - unpacked_loss) > 1e-3
