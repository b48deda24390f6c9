"""A LLaMA-Factory KTO config runs as written: its key names and values, its `dataset_info.json` format
with a `kto_tag` column, two optimizer steps on the tiny model through `alignkit train`.

The YAML mirrors LLaMA-Factory's `examples/train_lora/qwen3_lora_kto.yaml` (one example per device with
gradient accumulation, `pref_beta`, `lora_target: all`, cosine schedule, ...) with the model, data and
output paths changed, `max_steps: 2` added, and the KTO weights and `pref_ftx` set so that every KTO key of
LLaMA-Factory is exercised. The data files are written here in the shapes of its `kto_en_demo`
(sharegpt `messages` + boolean `label`) and `ultrafeedback_kto` (alpaca prompt/completion + `label`) entries.
"""

from __future__ import annotations

import json
import math

import pytest

from alignkit.cli import main

pytestmark = pytest.mark.compat

QA = [("What is 2 plus 2?", "2 plus 2 is 4.", "It is 7."), ("Name a colour.", "green", "Tuesday"),
      ("The capital of France?", "Paris.", "Tokyo."), ("Say hello.", "Hello!", "42")]

LF_KTO_YAML = """\
### model
model_name_or_path: {model}
trust_remote_code: true

### method
stage: kto
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
pref_beta: 0.1
kto_chosen_weight: 1.0
kto_rejected_weight: 1.2
pref_ftx: 0.1

### dataset
dataset: {dataset}
dataset_dir: {data_dir}
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: {output_dir}
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 5.0e-6
num_train_epochs: 3.0
max_steps: 2
lr_scheduler_type: cosine
ddp_timeout: 180000000
"""


def write_lf_kto_data(data_dir) -> None:
    """`dataset_info.json` with LLaMA-Factory's two KTO entry shapes, and their files (20 rows each)."""
    sharegpt, alpaca = [], []
    for i in range(20):
        prompt, good, bad = QA[i % len(QA)]
        desirable = i % 5 != 0  # unbalanced, as real KTO data usually is
        sharegpt.append({"messages": [{"role": "user", "content": f"{prompt} ({i})"},
                                      {"role": "assistant", "content": good if desirable else bad}],
                         "label": desirable})
        alpaca.append({"prompt": f"{prompt} [{i}]", "completion": good if desirable else bad, "label": desirable})
    (data_dir / "kto_demo.json").write_text(json.dumps(sharegpt, indent=2))
    (data_dir / "kto_alpaca.json").write_text(json.dumps(alpaca, indent=2))
    (data_dir / "dataset_info.json").write_text(json.dumps({
        "kto_demo": {"file_name": "kto_demo.json", "formatting": "sharegpt",
                     "columns": {"messages": "messages", "kto_tag": "label"},
                     "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                              "assistant_tag": "assistant"}},
        "kto_alpaca": {"file_name": "kto_alpaca.json",
                       "columns": {"prompt": "prompt", "response": "completion", "kto_tag": "label"}},
    }, indent=2))


@pytest.mark.parametrize("dataset", ["kto_demo", "kto_demo,kto_alpaca"])
def test_llamafactory_kto_config_trains_two_steps(tiny_model_dir, tmp_path, dataset):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_lf_kto_data(data_dir)
    config = tmp_path / "llama3_lora_kto.yaml"
    config.write_text(LF_KTO_YAML.format(model=tiny_model_dir, dataset=dataset, data_dir=data_dir,
                                         output_dir=tmp_path / "out"))
    assert main(["train", str(config)]) == 0
    out = tmp_path / "out"
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    # logging_steps: 10 logs no step of a 2-step run; the run's summary carries the mean loss.
    train_loss = json.loads((out / "train_results.json").read_text())["train_loss"]
    assert math.isfinite(train_loss) and train_loss > 0
    assert (out / "adapter_model.safetensors").is_file()
