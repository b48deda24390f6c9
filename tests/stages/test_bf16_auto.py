"""`bf16: auto` end to end: a training run on the tiny model trains under the precision its probe chose, records
it, and a resumed run keeps it (`alignkit.model.precision`)."""

from __future__ import annotations

import json

import pytest
import torch

from alignkit.callbacks import read_log
from alignkit.config import parse as parse_module
from alignkit.model import precision
from alignkit.train import run_train
from tests.helpers import tiny_config


def _sft_config(tiny_model_dir, tmp_path, **keys):
    rows = [{"instruction": f"What is {i} plus {i}?", "output": str(2 * i)} for i in range(8)]
    (tmp_path / "qa.json").write_text(json.dumps(rows))
    return tiny_config(tiny_model_dir, tmp_path / "out", stage="sft", do_train=True, finetuning_type="lora",
                       lora_rank=4, dataset=str(tmp_path / "qa.json"), cutoff_len=32, per_device_train_batch_size=4,
                       learning_rate=1e-3, save_strategy="steps", save_steps=1, **{"max_steps": 2, **keys})


@pytest.mark.parametrize("figures, want_bf16", [({"fp32_s": 2.0, "bf16_s": 1.0}, True),
                                                ({"fp32_s": 1.0, "bf16_s": 1.0}, False)])
def test_a_training_run_follows_the_probe_and_its_resume_keeps_the_choice(tiny_model_dir, tmp_path, monkeypatch,
                                                                        figures, want_bf16):
    monkeypatch.setattr(parse_module, "_cpu_has_bf16", lambda: True)
    monkeypatch.setattr("alignkit.env.cpu_supports_bf16", lambda: True)
    monkeypatch.setenv(precision.PROBE_ENV, "on")
    monkeypatch.setattr(precision, "measure", lambda model: dict(figures))
    seen = []

    def record_autocast(module, inputs):
        seen.append(torch.is_autocast_enabled("cpu"))

    from alignkit.stages import sft as sft_module

    real_trainer = sft_module.SFTTrainer

    class Recording(real_trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            # Inside the model's forward, where accelerate's autocast applies: the output layer's input.
            hook = self.model.get_output_embeddings().register_forward_pre_hook(record_autocast)
            try:
                return super().compute_loss(model, inputs, *args, **kwargs)
            finally:
                hook.remove()

    monkeypatch.setattr(sft_module, "SFTTrainer", Recording)
    run_train(_sft_config(tiny_model_dir, tmp_path))
    out = tmp_path / "out"
    record = json.loads((out / precision.CHOICE_FILE).read_text())
    assert record["bf16"] is want_bf16 and record["reason"].startswith("probe:")
    assert seen == [want_bf16] * 2
    assert all(r["loss"] == r["loss"] for r in read_log(out) if "loss" in r)
    # Resumed on a machine whose probe would now say the opposite: the run keeps its recorded precision.
    monkeypatch.setattr(precision, "measure", lambda model: {"fp32_s": figures["bf16_s"], "bf16_s": figures["fp32_s"]})
    seen.clear()
    run_train(_sft_config(tiny_model_dir, tmp_path, max_steps=3))
    assert seen == [want_bf16]
