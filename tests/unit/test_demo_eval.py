"""The demo's held-out checks: the exact-card check and the mean loss per reply token (issues 10 and 32)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from alignkit.config.parse import parse_config
from alignkit.data import get_dataset
from alignkit.demo import (DEMO_CUTOFF_LEN, DEMO_DATASET, DEMO_EVAL_DATASET, NUM_PROMPTS, card_matches, demo_data_dir,
                           format_report, held_out_loss)
from alignkit.model.loader import load_tokenizer

ROWS = [{"instruction": "What is 3 plus 4?", "output": "3 plus 4 is 7."},
        {"instruction": "Name a colour.", "output": "Green, like grass in spring."},
        {"instruction": "Translate to French: good morning.", "output": "Bonjour."}]


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps(ROWS))
    (tmp_path / "dataset_info.json").write_text(json.dumps({DEMO_EVAL_DATASET: {"file_name": "eval.json"}}))
    return tmp_path


def test_held_out_loss_is_the_token_weighted_mean_of_per_row_losses(tiny_model_dir, data_dir):
    """Row i has n_i reply tokens and transformers' loss l_i (their mean NLL), so the demo's number must be
    sum(l_i * n_i) / sum(n_i): the mean over every reply token, not the mean of the row means."""
    config = parse_config({"model_name_or_path": tiny_model_dir, "dataset": DEMO_EVAL_DATASET,
                           "dataset_dir": str(data_dir), "cutoff_len": 256})
    rows = get_dataset(config, load_tokenizer(config.model), "supervised")["train_dataset"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    weighted, tokens = 0.0, 0
    with torch.no_grad():
        for row in rows:
            labels = torch.tensor([row["labels"]])
            n = int((labels[:, 1:] != -100).sum())  # a label at position 0 has no prediction
            weighted += model(input_ids=torch.tensor([row["input_ids"]]), labels=labels).loss.item() * n
            tokens += n
    loss, counted = held_out_loss(config.model, data_dir, batch_size=2)  # two batches, padded
    assert counted == tokens
    assert loss == pytest.approx(weighted / tokens, rel=1e-5)


def test_held_out_loss_sees_the_adapter(tiny_model_dir, data_dir, tmp_path, save_perturbed_adapter):
    save_perturbed_adapter(tiny_model_dir, tmp_path / "adapter")
    base = parse_config({"model_name_or_path": tiny_model_dir})
    tuned = parse_config({"model_name_or_path": tiny_model_dir, "adapter_name_or_path": str(tmp_path / "adapter")})
    assert held_out_loss(tuned.model, data_dir)[0] != pytest.approx(held_out_loss(base.model, data_dir)[0], rel=1e-3)


def test_card_matches_only_the_exact_card():
    reference = '{"name": "Esme Mbeki", "age": 29, "city": "Tampere", "job": "nurse"}'
    assert card_matches(reference, reference)
    assert card_matches('  {"job": "nurse", "city": "Tampere", "age": 29,  "name": "Esme Mbeki"}\n', reference)
    for wrong in ['{"name": "Esme Mbeki", "age": "29", "city": "Tampere", "job": "nurse"}',  # age as a string
                  '{"name": "Esme Mbeki", "age": 29, "city": "Tampere", "occupation": "nurse"}',  # renamed field
                  '{"name": "Esme Mbeki", "age": 29, "city": "Tampere"}',  # missing field
                  '```json\n' + reference + '\n```',  # fenced
                  "Here is the card: " + reference,  # prose around it
                  "Name: Esme Mbeki\nAge: 29", ""]:
        assert not card_matches(wrong, reference), wrong


def test_the_report_puts_both_answers_and_their_check_side_by_side():
    prompts = [{"prompt": "Make a contact card for this person.\nFrom Oslo: Ana Quint, baker, age 40.",
                "reference": '{"name": "Ana Quint", "age": 40, "city": "Oslo", "job": "baker"}'}] * 2
    before = ["Sure! Here is a contact card\nfor Ana.", "Ana Quint, Oslo"]
    after = [prompts[0]["reference"], '{"name": "Ana Quint", "age": 41, "city": "Oslo", "job": "baker"}']
    report = format_report(prompts, before, after, loss_before=2.34567, loss_after=0.12345)
    assert "[1] From Oslo: Ana Quint, baker, age 40." in report
    assert "before  fail    Sure! Here is a contact card ⏎ for Ana." in report
    assert f"after   PASS    {after[0]}" in report and f"after   fail    {after[1]}" in report
    rows = {line[:36].strip(): line[36:].split() for line in report.splitlines()[-3:]}
    assert rows == {"exact contact card (held-out)": ["0/2", "1/2"],
                    "loss per reply token (held-out)": ["2.346", "0.123"],
                    "perplexity (held-out)": ["10.44", "1.13"]}


def test_the_shipped_card_data_is_learnable_and_held_out():
    """Every reply is the card of the person in its note (values copied from it), and no held-out person
    is trained on; the instruction never names the fields, so only training teaches them."""
    data_dir = demo_data_dir()
    rows = {name: json.loads((data_dir / f"{name}.json").read_text(encoding="utf-8"))
            for name in (DEMO_DATASET, DEMO_EVAL_DATASET)}
    assert len(rows[DEMO_EVAL_DATASET]) >= NUM_PROMPTS
    for row in rows[DEMO_DATASET] + rows[DEMO_EVAL_DATASET]:
        card = json.loads(row["output"])
        assert list(card) == ["name", "age", "city", "job"] and isinstance(card["age"], int)
        assert all(str(value) in row["input"] for value in card.values()), row
        assert not any(field in row["instruction"].lower() for field in card)
    trained = {json.loads(row["output"])["name"] for row in rows[DEMO_DATASET]}
    assert not trained & {json.loads(row["output"])["name"] for row in rows[DEMO_EVAL_DATASET]}


def test_the_card_data_loads_through_its_registry_entries(tiny_tokenizer):
    """Every row becomes one example whose trained tokens are exactly its card. With the bundled tokenizer the
    longest row, system prompt included, is 95 tokens, inside DEMO_CUTOFF_LEN; the tiny test tokenizer splits
    words finer, so it is given room here."""
    assert DEMO_CUTOFF_LEN >= 96
    data_dir = demo_data_dir()
    for name in (DEMO_DATASET, DEMO_EVAL_DATASET):
        rows = json.loads((data_dir / f"{name}.json").read_text(encoding="utf-8"))
        config = parse_config({"stage": "sft", "dataset": name, "dataset_dir": str(data_dir), "cutoff_len": 512})
        examples = get_dataset(config, tiny_tokenizer, "supervised")["train_dataset"]
        assert len(examples) == len(rows)
        for example, row in zip(examples, rows):
            reply = tiny_tokenizer.decode([t for t in example["labels"] if t != -100])
            assert reply == row["output"] + "<|im_end|>\n", row
