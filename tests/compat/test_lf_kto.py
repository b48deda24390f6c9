"""A LLaMA-Factory KTO config runs as written: its key names and values, its `dataset_info.json` format
with a `kto_tag` column, two optimizer steps on the tiny model through `alignkit train`.

The YAML is the tier's (`lf_config` in conftest.py: the keys and values of LLaMA-Factory's
`examples/train_lora/qwen3_lora_kto.yaml`, one example per device with gradient accumulation, `pref_beta`,
`lora_target: all`, cosine schedule, ...) with the KTO weights and `pref_ftx` added. The data files are written here in the shapes of its `kto_en_demo`
(sharegpt `messages` + boolean `label`) and `ultrafeedback_kto` (alpaca prompt/completion + `label`) entries.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from alignkit.config.parse import read_config

pytestmark = pytest.mark.compat

QA = [("What is 2 plus 2?", "2 plus 2 is 4.", "It is 7."), ("Name a colour.", "green", "Tuesday"),
      ("The capital of France?", "Paris.", "Tokyo."), ("Say hello.", "Hello!", "42")]

def add_lf_kto_data(lf_data) -> None:
    """LLaMA-Factory's two KTO entry shapes in the tier's `dataset_info.json` (20 rows each)."""
    sharegpt, alpaca = [], []
    for i in range(20):
        prompt, good, bad = QA[i % len(QA)]
        desirable = i % 5 != 0  # unbalanced, as real KTO data usually is
        sharegpt.append({"messages": [{"role": "user", "content": f"{prompt} ({i})"},
                                      {"role": "assistant", "content": good if desirable else bad}],
                         "label": desirable})
        alpaca.append({"prompt": f"{prompt} [{i}]", "completion": good if desirable else bad, "label": desirable})
    lf_data.add("kto_demo", "kto_demo.json", sharegpt, formatting="sharegpt",
                columns={"messages": "messages", "kto_tag": "label"},
                tags={"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"})
    lf_data.add("kto_alpaca", "kto_alpaca.json", alpaca,
                columns={"prompt": "prompt", "response": "completion", "kto_tag": "label"})


@pytest.mark.parametrize("dataset", ["kto_demo", "kto_demo,kto_alpaca"])
def test_llamafactory_kto_config_trains_two_steps(lf_config, lf_data, run_alignkit, dataset):
    """The tier's LLaMA-Factory config (its kto example's keys, `warmup_ratio` and `bf16` included) plus the
    KTO weights and `pref_ftx`, so that every KTO key of LLaMA-Factory is exercised."""
    add_lf_kto_data(lf_data)
    config = lf_config("kto", dataset, kto_chosen_weight=1.0, kto_rejected_weight=1.2, pref_ftx=0.1,
                       drop=("val_size", "per_device_eval_batch_size", "eval_strategy", "eval_steps"))
    proc = run_alignkit(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = Path(read_config(config).training.output_dir)
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    # logging_steps: 10 logs no step of a 2-step run; the run's summary carries the mean loss.
    train_loss = json.loads((out / "train_results.json").read_text())["train_loss"]
    assert math.isfinite(train_loss) and train_loss > 0
    assert (out / "adapter_model.safetensors").is_file()
