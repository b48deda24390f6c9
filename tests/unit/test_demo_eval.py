"""The demo's held-out number: mean loss per reply token on `demo_sft_eval` (issue 10 item 10)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from alignkit.config.parse import parse_config
from alignkit.data import get_dataset
from alignkit.demo import DEMO_EVAL_DATASET, held_out_loss
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
