"""A run that crashes and is started again equals the run that never stopped, step for step.

For SFT and RM (LoRA, the default): one run trains 6 steps straight. A second run with the same config
into another output_dir crashes just after checkpoint-3 is written (a callback raises before step 4,
so nothing after the checkpoint is saved, as when the process is killed); running the same config again
finds checkpoint-3 and resumes. Each epoch is 4 steps, so the resumed run has to skip the rest of
epoch 1's batches in the right order and then shuffle epoch 2 as the straight run did.

The resumed run's logged loss, gradient norm and learning rate for steps 4-6 (trainer_log.jsonl, which
it appends to) and its saved adapter must equal the straight run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignkit.callbacks import read_log
from alignkit.train import run_train
from tests.helpers import tiny_config

STEPS, CHECKPOINT_STEP, BATCH = 6, 3, 4
COMPARED = ("loss", "grad_norm", "learning_rate")


def _data(tmp_path: Path, stage: str) -> str:
    """16 examples: 4 steps of 4 per epoch."""
    path = tmp_path / f"{stage}.json"
    if stage == "sft":
        rows = [{"instruction": f"What is {i} plus {i}?", "output": f"{i} plus {i} is {2 * i}."} for i in range(16)]
    else:
        rows = [{"prompt": f"What is {i} plus {i}?", "chosen": f"{i} plus {i} is {2 * i}.",
                 "rejected": f"{i} plus {i} is {2 * i + 3}, I think."} for i in range(16)]
    path.write_text(json.dumps(rows))
    return str(path)


def _config(stage, tiny_model_dir, data, out, **overrides):
    return tiny_config(**{
        "stage": stage, "do_train": True, "model_name_or_path": tiny_model_dir, "dataset": data,
        "output_dir": str(out), "per_device_train_batch_size": BATCH, "max_steps": STEPS, "save_steps": CHECKPOINT_STEP,
        "logging_steps": 1, "learning_rate": 5e-3, "lr_scheduler_type": "linear", "warmup_steps": 2,
        "lora_rank": 4, "cutoff_len": 64, "seed": 0, "disable_tqdm": True, **overrides,
    })


def _run(config, callbacks=None) -> None:
    run_train(config, callbacks=callbacks)


def _logged(out: Path) -> dict[int, dict]:
    records = [r for r in read_log(out) if "loss" in r]
    steps = [r["current_steps"] for r in records]
    assert steps == sorted(set(steps)), f"{out}: steps logged twice or out of order: {steps}"
    return {r["current_steps"]: {key: r[key] for key in COMPARED} for r in records}


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_resumed_run_logs_the_same_losses_and_saves_the_same_adapter(stage, tiny_model_dir, tmp_path,
                                                                     crash_before_step):
    data = _data(tmp_path, stage)
    straight_out, resumed_out = tmp_path / "straight", tmp_path / "resumed"
    _run(_config(stage, tiny_model_dir, data, straight_out))

    with pytest.raises(Exception, match="killed before step"):
        _run(_config(stage, tiny_model_dir, data, resumed_out), callbacks=[crash_before_step(CHECKPOINT_STEP + 1)])
    assert sorted(p.name for p in resumed_out.glob("checkpoint-*")) == [f"checkpoint-{CHECKPOINT_STEP}"]
    assert not (resumed_out / "adapter_model.safetensors").exists()  # the crash came before the final save
    assert sorted(_logged(resumed_out)) == list(range(1, CHECKPOINT_STEP + 1))

    config = _config(stage, tiny_model_dir, data, resumed_out)
    _run(config)
    assert Path(config.training.resume_from_checkpoint).name == f"checkpoint-{CHECKPOINT_STEP}"

    straight, resumed = _logged(straight_out), _logged(resumed_out)
    assert sorted(straight) == sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in COMPARED:
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=0, abs=1e-6), (step, key)
    # The losses move, so equal losses after the checkpoint are evidence, not a constant.
    assert len({round(straight[step]["loss"], 4) for step in straight}) == STEPS

    straight_weights = load_file(straight_out / "adapter_model.safetensors")
    resumed_weights = load_file(resumed_out / "adapter_model.safetensors")
    assert straight_weights.keys() == resumed_weights.keys()
    for name, weight in straight_weights.items():
        torch.testing.assert_close(resumed_weights[name], weight, rtol=0, atol=1e-6, msg=name)


def test_same_config_trains_the_same_sft_run(tiny_model_dir, tmp_path):
    """Two runs of one config (seed 0) take the same first step. The loss alone cannot show it (LoRA's B starts
    at zero, so the first loss is the base model's); the gradient norm depends on LoRA's random A."""
    data = _data(tmp_path, "sft")
    torch.manual_seed(1)  # whatever state the process is in, the config's seed should decide
    run_train(_config("sft", tiny_model_dir, data, tmp_path / "first", max_steps=1))
    torch.manual_seed(2)
    run_train(_config("sft", tiny_model_dir, data, tmp_path / "second", max_steps=1))
    first, second = _logged(tmp_path / "first"), _logged(tmp_path / "second")
    assert second[1]["grad_norm"] == pytest.approx(first[1]["grad_norm"], rel=0, abs=1e-6)
