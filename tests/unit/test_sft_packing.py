"""Packing: bin assignment, row layout, and a packed step equal to the unpacked one."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from alignkit.config import TrainingArguments
from alignkit.data.packing import PackedCollator, pack_dataset, pack_lengths, unpack_rows
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


def test_unpack_rows_hand_computed():
    """The collated rows above back into one right-padded row per example, in packing order; the labels as packed
    (each example's first label -100). Rows that pack_dataset cannot have written are refused."""
    rows = [{"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, 3, -100, 5], "position_ids": [0, 1, 2, 0, 1],
             "attention_mask": [1] * 5},
            {"input_ids": [6, 7, 8, 9], "labels": [-100, -100, 8, 9], "position_ids": [0, 1, 2, 3],
             "attention_mask": [1] * 4}]
    batch = PackedCollator(pad_token_id=0)(rows)
    ids, mask, labels = unpack_rows(batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                                    batch["labels"])
    assert ids.tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert labels.tolist() == [[-100, 2, 3, -100], [-100, 5, -100, -100], [-100, -100, 8, 9]]
    # The targets and their count (over labels[:, 1:], as the Trainer counts) are the packed batch's.
    assert int((labels[:, 1:] != -100).sum()) == int((batch["labels"][:, 1:] != -100).sum()) == 5
    with pytest.raises(ValueError, match="first real token"):
        unpack_rows(batch["input_ids"], batch["position_ids"] + 1, batch["attention_mask"], batch["labels"])
    skipped = batch["position_ids"].clone()
    skipped[0, 2] = 3
    with pytest.raises(ValueError, match="count 0, 1, 2"):
        unpack_rows(batch["input_ids"], skipped, batch["attention_mask"], batch["labels"])


def test_packed_training_step_attends_each_example_alone(tiny_model_dir, tmp_path, monkeypatch):
    """A packed batch's training loss runs its examples padding-free: every sdpa call is one example's own
    (never a packed row's width), and the loss and gradients equal those of the rows run whole under their
    block-diagonal masks (padding_free=false), with the step's token count and without."""
    from tests.unit.test_padding_free import _count_sdpa_calls
    from tests.unit.test_sft_trainer import make_rows

    examples = make_rows(seed=3, lengths=(4, 14), prompts=(1, 3))
    packed = pack_dataset(examples, cutoff_len=24)
    batch = PackedCollator(pad_token_id=2)(packed.to_list())
    assert batch["input_ids"].size(0) < len(examples)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    num_items = torch.tensor(2 * int((batch["labels"][:, 1:] != -100).sum()))
    results = {}
    for padding_free in (False, True):
        args = TrainingArguments(output_dir=str(tmp_path / "sft"), report_to="none", use_cpu=True,
                                 remove_unused_columns=False, padding_free=padding_free)
        trainer = SFTTrainer(model=model, args=args)
        calls = _count_sdpa_calls(monkeypatch)
        for count in (num_items, None):
            model.zero_grad()
            loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=count)
            loss.backward()
            results[padding_free, count is None] = (loss.detach(), {n: p.grad.clone()
                                                                    for n, p in model.named_parameters()})
        monkeypatch.undo()
        layers = model.config.num_hidden_layers
        if padding_free:
            assert sorted(calls) == sorted(len(ids) for ids in examples["input_ids"] for _ in range(2 * layers))
        else:
            assert set(calls) == {batch["input_ids"].size(1)}
    for own_count in (False, True):
        (loss_p, grads_p), (loss_f, grads_f) = results[False, own_count], results[True, own_count]
        torch.testing.assert_close(loss_f, loss_p, atol=1e-5, rtol=0)
        for name, grad in grads_p.items():
            torch.testing.assert_close(grads_f[name], grad, atol=1e-5, rtol=1e-4, msg=name)


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
