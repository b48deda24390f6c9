"""Parity with TRL 1.16's SFTTrainer: same tiny model, same tokens -> same loss, gradients and updates.

The conversations are TRL's prompt-completion layout. alignkit reads them through its own data layer and
TRL tokenises them itself with `completion_only_loss` (its default for prompt-completion data); the first
test shows both arrive at the same input ids and the same label mask (-100 on the prompt, targets on the
reply, its `<|im_end|>` and ChatML's trailing newline), so the trainers below see identical tokens.

TRL runs with its padded collator (`padding_free=False`) as the oracle; alignkit is checked with
`padding_free` on (one row of the batch's real tokens, the default) and off (the padded batch).
Both divide the summed token loss by the step's target-token count (`num_items_in_batch`), so one
micro-batch's loss is its token-loss sum over the count of the whole step.
"""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from alignkit.config.parse import parse_config
from alignkit.data import get_dataset
from alignkit.data.collator import SupervisedCollator
from alignkit.stages.sft import SFTTrainer

pytestmark = pytest.mark.parity
trl = pytest.importorskip("trl")

# Replies of different lengths, so the padded batch has padding and the padding-free row real boundaries.
EXAMPLES = [
    ("What is 12 plus 7?", "12 plus 7 is 19."),
    ("Name a colour.", "green"),
    ("Why is the sky blue?", "Sunlight scatters off air molecules."),
    ("Translate to French: good morning.", "Bonjour."),
]
ROWS = [{"prompt": [{"role": "user", "content": p}], "completion": [{"role": "assistant", "content": c}]}
        for p, c in EXAMPLES]
# Settings both trainers must share for a training-step comparison (TRL's SFTConfig changes some defaults).
TRAINING = {"learning_rate": 1e-3, "lr_scheduler_type": "constant", "weight_decay": 0.0, "max_grad_norm": 1.0,
            "seed": 0, "logging_steps": 1, "gradient_checkpointing": False, "bf16": False, "use_cpu": True,
            "report_to": "none", "save_strategy": "no", "disable_tqdm": True}


def _ours(tiny_model_dir, tiny_tokenizer, tmp_path, padding_free, **training):
    data = tmp_path / "sft_trl.json"
    data.write_text(json.dumps(ROWS))
    config = parse_config({"stage": "sft", "do_train": True, "finetuning_type": "full",
                           "model_name_or_path": tiny_model_dir, "dataset": str(data),
                           "output_dir": str(tmp_path / "ours"), "padding_free": padding_free, **TRAINING, **training})
    dataset = get_dataset(config, tiny_tokenizer, "supervised")["train_dataset"]
    return SFTTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), args=config.training,
                      data_collator=SupervisedCollator(tiny_tokenizer), train_dataset=dataset,
                      processing_class=tiny_tokenizer)


def _theirs(tiny_model_dir, tiny_tokenizer, tmp_path, **training):
    from trl import SFTConfig
    from trl import SFTTrainer as TRLSFTTrainer

    args = SFTConfig(output_dir=str(tmp_path / "trl"), padding_free=False, max_length=None, dataset_num_proc=None,
                     completion_only_loss=True, **TRAINING, **training)
    return TRLSFTTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), args=args,
                         train_dataset=Dataset.from_list(ROWS), processing_class=tiny_tokenizer)


def _step_loss(trainer, rows):
    """Loss of one micro-batch holding `rows`, normalised by the step count as `Trainer.train` does."""
    batch = trainer._prepare_inputs(trainer.data_collator(rows))
    num_items_in_batch = trainer._get_num_items_in_batch([batch], trainer.args.device)
    trainer.model.train()
    return trainer.compute_loss(trainer.model, batch, num_items_in_batch=num_items_in_batch), num_items_in_batch


def test_same_tokens_and_label_mask_as_trl(tiny_model_dir, tiny_tokenizer, tmp_path):
    ours = _ours(tiny_model_dir, tiny_tokenizer, tmp_path, padding_free=True)
    theirs = _theirs(tiny_model_dir, tiny_tokenizer, tmp_path)
    assert ours.train_dataset["input_ids"] == theirs.train_dataset["input_ids"]
    assert ours.train_dataset["labels"] == theirs.train_dataset["labels"]
    for ids, labels in zip(ours.train_dataset["input_ids"], ours.train_dataset["labels"]):
        # The reply, its <|im_end|> and the newline after it are the targets; the prompt is not.
        targets = [token for token in labels if token != -100]
        assert targets == ids[len(ids) - len(targets):]
        assert targets[-2:] == [tiny_tokenizer.eos_token_id, tiny_tokenizer.convert_tokens_to_ids("\u010a")]


def _first_step_matches(ours, theirs) -> float:
    """One micro-batch of all rows: the same step count, loss (1e-5) and gradients; returns the loss."""
    rows = [ours.train_dataset[i] for i in range(len(ROWS))]
    trl_rows = [theirs.train_dataset[i] for i in range(len(ROWS))]
    our_loss, our_count = _step_loss(ours, rows)
    their_loss, their_count = _step_loss(theirs, trl_rows)
    assert int(our_count) == int(their_count) == sum(sum(t != -100 for t in r["labels"][1:]) for r in rows)
    assert our_loss.item() == pytest.approx(their_loss.item(), abs=1e-5)

    our_loss.backward()
    their_loss.backward()
    their_grads = dict(theirs.model.named_parameters())
    for name, param in ours.model.named_parameters():
        torch.testing.assert_close(param.grad, their_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    return their_loss.item()


@pytest.mark.parametrize("padding_free", [True, False])
def test_first_step_loss_and_gradients_match_trl(tiny_model_dir, tiny_tokenizer, tmp_path, padding_free):
    ours = _ours(tiny_model_dir, tiny_tokenizer, tmp_path, padding_free=padding_free)
    theirs = _theirs(tiny_model_dir, tiny_tokenizer, tmp_path)
    loss = _first_step_matches(ours, theirs)
    # A random tiny model predicts about uniformly over its vocabulary: the loss is near log(vocab) and far from 0.
    assert loss == pytest.approx(torch.log(torch.tensor(float(len(tiny_tokenizer)))).item(), rel=0.1)


@pytest.mark.parametrize("padding_free", [True, False])
def test_label_smoothing_first_step_matches_trl(tiny_model_dir, tiny_tokenizer, tmp_path, padding_free):
    """`label_smoothing_factor: 0.3`, which TRL applies through transformers' `LabelSmoother` over the step's
    target count: the same loss and gradients, and a loss other than the plain one."""
    ours = _ours(tiny_model_dir, tiny_tokenizer, tmp_path, padding_free=padding_free, label_smoothing_factor=0.3)
    theirs = _theirs(tiny_model_dir, tiny_tokenizer, tmp_path, label_smoothing_factor=0.3)
    smoothed = _first_step_matches(ours, theirs)
    plain, _ = _step_loss(_theirs(tiny_model_dir, tiny_tokenizer, tmp_path),
                          [theirs.train_dataset[i] for i in range(len(ROWS))])
    assert abs(smoothed - plain.item()) > 1e-4


@pytest.mark.parametrize("padding_free", [True, False])
def test_training_steps_match_trl(tiny_model_dir, tiny_tokenizer, tmp_path, padding_free):
    """Two optimiser steps of 2 micro-batches x 2 rows: the logged losses (the second after one update) and
    the final weights agree, so loss scaling under gradient accumulation agrees too.

    Plain SGD, not AdamW: Adam divides each step by sqrt(v), so an element whose gradient is about 0 moves by
    up to the learning rate on float rounding alone (a different but equally exact summation order, e.g. the
    padding-free layout), and an elementwise weight comparison would then test rounding, not the loss."""
    schedule = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 2,
                "optim": "sgd"}
    ours = _ours(tiny_model_dir, tiny_tokenizer, tmp_path, padding_free=padding_free, **schedule)
    theirs = _theirs(tiny_model_dir, tiny_tokenizer, tmp_path, **schedule)
    ours.train()
    theirs.train()

    our_losses = [r["loss"] for r in ours.state.log_history if "loss" in r]
    their_losses = [r["loss"] for r in theirs.state.log_history if "loss" in r]
    assert len(our_losses) == len(their_losses) == 2
    assert our_losses == pytest.approx(their_losses, abs=1e-5)
    assert our_losses[1] < our_losses[0]  # the step trained on these same 4 rows lowered their loss
    their_params = dict(theirs.model.named_parameters())
    for name, param in ours.model.named_parameters():
        torch.testing.assert_close(param, their_params[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda detail, name=name: f"{name}: {detail}")
