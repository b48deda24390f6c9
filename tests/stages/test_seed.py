"""`seed` makes a run repeat bit for bit: every stage is seeded once, before its model and adapters exist."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignkit.config.parse import parse_config
from alignkit.train import run_train

DATA = Path(__file__).resolve().parents[2] / "data"
DATASETS = {"sft": "demo_sft", "rm": "demo_pref", "dpo": "demo_pref", "kto": "demo_kto"}


def _run(tiny_model_dir, out, stage, seed):
    config = parse_config({
        "stage": stage, "do_train": True, "model_name_or_path": tiny_model_dir, "dataset": DATASETS[stage],
        "dataset_dir": str(DATA), "cutoff_len": 96, "max_samples": 8, "per_device_train_batch_size": 2,
        "max_steps": 2, "learning_rate": 1e-3, "lora_dropout": 0.1, "save_strategy": "no", "seed": seed,
        "output_dir": str(out), "disable_tqdm": True,
    })
    run_train(config)
    return load_file(str(out / "adapter_model.safetensors"))


@pytest.mark.parametrize("stage", list(DATASETS))
def test_same_seed_same_weights_other_seed_other_weights(tiny_model_dir, tmp_path, stage):
    first = _run(tiny_model_dir, tmp_path / "a", stage, seed=3)
    again = _run(tiny_model_dir, tmp_path / "b", stage, seed=3)
    other = _run(tiny_model_dir, tmp_path / "c", stage, seed=4)
    assert sorted(first) == sorted(again)
    assert all(torch.equal(first[k], again[k]) for k in first)  # LoRA init, dropout and data order repeat
    assert any(not torch.equal(first[k], other[k]) for k in first)
