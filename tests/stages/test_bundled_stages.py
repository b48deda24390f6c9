"""The `slow` tier: each stage for two steps on the real bundled model (SmolLM2-135M-Instruct).

These catch what a tiny random model cannot: the real tokenizer and chat template (pad == eos, an
injected system prompt), the real architecture's LoRA targets, and losses of a trained model.
"""

import json
import math
from pathlib import Path

import pytest

from alignkit.config.parse import parse_config
from alignkit.train import run_train

pytestmark = pytest.mark.slow
DATA_DIR = str(Path(__file__).resolve().parents[2] / "data")


def _run(bundled_model_dir, tmp_path, **values):
    base = {"model_name_or_path": bundled_model_dir, "do_train": True, "dataset_dir": DATA_DIR,
            "max_steps": 2, "per_device_train_batch_size": 2, "cutoff_len": 128, "max_samples": 8,
            "output_dir": str(tmp_path / "out"), "save_strategy": "no", "disable_tqdm": True}
    base.update(values)
    run_train(parse_config(base))
    out = Path(base["output_dir"])
    records = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert (out / "adapter_model.safetensors").is_file() and (out / "train_results.json").is_file()
    return records


def test_sft_on_bundled_model(bundled_model_dir, tmp_path):
    records = _run(bundled_model_dir, tmp_path, stage="sft", dataset="demo_sft")
    # An instruction-tuned model already predicts these short answers well: far below uniform (ln 49152 = 10.8).
    assert records[0]["loss"] < 4.0


def test_rm_on_bundled_model(bundled_model_dir, tmp_path):
    records = _run(bundled_model_dir, tmp_path, stage="rm", dataset="demo_pref")
    for r in [r for r in records if "loss" in r]:
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-5)
        assert r["rewards/accuracies"] in (0.0, 0.5, 1.0)  # 2 pairs a step
        # The loss is the mean of -log sigmoid(margin) over the step's pairs: at least its value at the mean
        # margin (Jensen: the function is convex).
        assert r["loss"] >= math.log1p(math.exp(-r["rewards/margins"])) - 1e-6


def test_dpo_on_bundled_model(bundled_model_dir, tmp_path):
    records = _run(bundled_model_dir, tmp_path, stage="dpo", dataset="demo_pref")
    first = records[0]
    # Step 1: the fresh adapter is zero, so the policy equals the reference: loss = ln 2, margins 0.
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-4)


def test_kto_on_bundled_model(bundled_model_dir, tmp_path):
    records = _run(bundled_model_dir, tmp_path, stage="kto", dataset="demo_kto",
                   train_sampling_strategy="sequential")
    first = records[0]
    # Step 1: the fresh adapter is zero, so the policy equals the reference: rewards and z0 are 0 and each
    # example's loss is 1 - sigmoid(0) = 0.5 (unit weights).
    assert first["loss"] == pytest.approx(0.5, abs=1e-5)
    assert first["kl"] == 0.0
