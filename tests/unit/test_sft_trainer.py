"""SFTTrainer on the tiny model with hand-built tokenised rows: gradient accumulation, prediction_step."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from alignkit.config import GeneratingArguments, TrainingArguments
from alignkit.stages.sft import SFTTrainer, sft_loss


def make_rows(n: int = 8, seed: int = 0, lengths=(6, 20), prompts=(2, 5)) -> Dataset:
    """Rows of 6..20 tokens whose first 2..5 tokens are prompt (-100), so target counts differ per row."""
    rng = random.Random(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        length, prompt = rng.randint(*lengths), rng.randint(*prompts)
        ids = [rng.randint(3, 200) for _ in range(length)]
        rows["input_ids"].append(ids)
        rows["attention_mask"].append([1] * length)
        rows["labels"].append([-100] * prompt + ids[prompt:])
    return Dataset.from_dict(rows)


def pad_right(features, pad_token_id: int = 2):
    """A right-padding collator for the tests (the project's lives in alignkit.data.collator)."""
    width = max(len(f["input_ids"]) for f in features)
    out = {"input_ids": [], "attention_mask": [], "labels": []}
    for f in features:
        gap = width - len(f["input_ids"])
        out["input_ids"].append(list(f["input_ids"]) + [pad_token_id] * gap)
        out["attention_mask"].append(list(f["attention_mask"]) + [0] * gap)
        out["labels"].append(list(f["labels"]) + [-100] * gap)
    return {k: torch.tensor(v) for k, v in out.items()}


def train_one_step(model_dir, tmp_path, dataset, batch_size: int, accumulation: int, **extra):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"bs{batch_size}_ga{accumulation}"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=1.0,  # so a parameter change equals minus the gradient
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        logging_steps=1,
        report_to="none",
        remove_unused_columns=False,
        save_strategy="no",
        use_cpu=True,
        seed=0,
        **extra,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, data_collator=extra.pop("collator", pad_right))
    before = copy.deepcopy(model.state_dict())
    result = trainer.train()
    grads = {k: before[k] - v for k, v in model.state_dict().items()}
    return result.training_loss, grads


def test_gradient_accumulation_equivalence(tiny_model_dir, tmp_path):
    """8 rows in one micro-batch vs 8 micro-batches of 1: same loss, same SGD update (= gradient).

    Both normalise by the step's target-token count. The check is sharp because a mean of per-row
    means (what dividing each micro-batch by its own count and then by 8 gives) differs for these rows.
    """
    dataset = make_rows()
    loss_8x1, grads_8x1 = train_one_step(tiny_model_dir, tmp_path, dataset, 8, 1)
    loss_1x8, grads_1x8 = train_one_step(tiny_model_dir, tmp_path, dataset, 1, 8)
    assert loss_8x1 == pytest.approx(loss_1x8, abs=1e-5)
    for name, grad in grads_8x1.items():
        torch.testing.assert_close(grads_1x8[name], grad, atol=1e-5, rtol=0, msg=name)
    assert max(g.abs().max().item() for g in grads_8x1.values()) > 1e-3  # a step did happen

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        per_row = [sft_loss(model(input_ids=torch.tensor([r])).logits, torch.tensor([lab])).item()
                   for r, lab in zip(dataset["input_ids"], dataset["labels"])]
    mean_of_means = sum(per_row) / len(per_row)
    assert abs(mean_of_means - loss_8x1) > 1e-3, "rows too uniform to tell the normalisations apart"


def test_accumulation_on_a_cpu_suggests_the_one_batch(tiny_model_dir, tmp_path, caplog):
    """1 row x 8 micro-batches on a CPU: one info line names the equivalent batch (8 rows x 1, the same examples
    per step, as the test above shows); 8 x 1 says nothing, nor does a stage whose loss is per micro-batch."""
    from alignkit.stages.base import StageTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    def built(cls, batch, accumulation):
        caplog.clear()
        args = TrainingArguments(output_dir=str(tmp_path / "hint"), per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=accumulation, report_to="none", use_cpu=True)
        with caplog.at_level("INFO", logger="alignkit.stages.base"):
            cls(model=model, args=args)
        return [r.getMessage() for r in caplog.records if "gradient_accumulation_steps=" in r.getMessage()]

    said = built(SFTTrainer, 1, 8)
    assert len(said) == 1 and "gradient_accumulation_steps=8 at per_device_train_batch_size=1" in said[0]
    assert "per_device_train_batch_size=8 with gradient_accumulation_steps=1" in said[0]
    assert built(SFTTrainer, 8, 1) == []
    assert built(StageTrainer, 1, 8) == []


def make_generation_trainer(model_dir, tmp_path, tokenizer, max_new_tokens=5):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = TrainingArguments(output_dir=str(tmp_path / "gen"), predict_with_generate=True, report_to="none",
                             remove_unused_columns=False, use_cpu=True)
    return SFTTrainer(model=model, args=args, processing_class=tokenizer,
                      generating_args=GeneratingArguments(max_new_tokens=max_new_tokens))


@pytest.mark.parametrize("side", ["left", "right"])
def test_prediction_step_returns_only_new_tokens(tiny_model_dir, tiny_tokenizer, tmp_path, side):
    """Batched generation from prompts of different lengths, padded on `side`, equals generating each
    prompt alone and cutting its prompt off."""
    trainer = make_generation_trainer(tiny_model_dir, tmp_path, tiny_tokenizer)
    prompts = [[5, 17, 30, 44, 9, 2], [7, 8, 2]]  # a real eos (== pad) inside the short prompt
    width = max(map(len, prompts))
    ids, mask = [], []
    for p in prompts:
        gap = [2] * (width - len(p))
        ids.append(p + gap if side == "right" else gap + p)
        m = [1] * len(p)
        mask.append(m + [0] * len(gap) if side == "right" else [0] * len(gap) + m)
    labels = torch.tensor([[11, 12, -100], [13, 14, 15]])
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": labels}
    loss, new_tokens, returned_labels = trainer.prediction_step(trainer.model, batch, prediction_loss_only=False)
    assert loss is None
    assert torch.equal(returned_labels, labels)
    assert new_tokens.shape[1] <= 5
    for row, prompt in enumerate(prompts):
        alone = trainer.model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                                       pad_token_id=2, eos_token_id=2)[0, len(prompt):].tolist()
        got = new_tokens[row].tolist()[: len(alone)]
        assert got == alone, (row, got, alone)


def test_save_predictions_round_trip(tiny_model_dir, tiny_tokenizer, tmp_path):
    """The file has one JSON object per example with prompt, predict and label decoded."""
    import json
    from types import SimpleNamespace

    import numpy as np

    trainer = make_generation_trainer(tiny_model_dir, tmp_path, tiny_tokenizer)
    prompt_ids = [tiny_tokenizer("What is 12 plus 7?")["input_ids"], tiny_tokenizer("Name a colour")["input_ids"]]
    answer_ids = [tiny_tokenizer("19")["input_ids"], tiny_tokenizer("green")["input_ids"]]
    width = max(map(len, answer_ids))
    padded = np.array([a + [-100] * (width - len(a)) for a in answer_ids])
    dataset = Dataset.from_dict({"input_ids": prompt_ids, "labels": answer_ids})
    results = SimpleNamespace(predictions=padded[::-1].copy(), label_ids=padded)
    path = trainer.save_predictions(dataset, results)
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert records == [
        {"prompt": "What is 12 plus 7?", "predict": "green", "label": "19"},
        {"prompt": "Name a colour", "predict": "19", "label": "green"},
    ]
