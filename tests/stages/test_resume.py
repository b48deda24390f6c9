"""Running again into an output_dir with checkpoints resumes from the last complete one."""

import json
from pathlib import Path

import pytest

from alignkit.config.parse import parse_config
from alignkit.errors import DataError
from alignkit.errors import ConfigError
from alignkit.train import resolve_resume, run_train


def _sft_config(tiny_model_dir, out, tmp_path, **extra):
    data = tmp_path / "sft.json"
    if not data.exists():
        rows = [{"instruction": f"What is {i} plus {i}?", "output": f"{i} plus {i} is {2 * i}."} for i in range(16)]
        data.write_text(json.dumps(rows))
    values = {"stage": "sft", "do_train": True, "model_name_or_path": tiny_model_dir, "dataset": str(data),
              "output_dir": str(out), "per_device_train_batch_size": 4, "save_steps": 1, "learning_rate": 1e-3,
              "seed": 0, "disable_tqdm": True}
    values.update(extra)
    return parse_config(values)


def test_rerun_resumes_and_overwrite_starts_afresh(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    run_train(_sft_config(tiny_model_dir, out, tmp_path, max_steps=2))
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()

    config = _sft_config(tiny_model_dir, out, tmp_path, max_steps=3)
    resolve_resume(config)
    assert Path(config.training.resume_from_checkpoint).name == "checkpoint-2"
    run_train(_sft_config(tiny_model_dir, out, tmp_path, max_steps=3))
    state = json.loads((out / "trainer_state.json").read_text())
    logged_steps = [r["step"] for r in state["log_history"] if "loss" in r]
    assert logged_steps == [1, 2, 3]  # steps 1-2 restored from the checkpoint, only step 3 trained anew
    records = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["current_steps"] for r in records if "loss" in r] == [1, 2, 3]  # the log is appended to

    fresh = _sft_config(tiny_model_dir, out, tmp_path, max_steps=1, overwrite_output_dir=True)
    resolve_resume(fresh)
    assert fresh.training.resume_from_checkpoint is None


def test_overwrite_forgets_the_finished_run(tiny_model_dir, tmp_path):
    """A run started afresh over a finished one, then killed, must not be taken for finished on rerun."""
    out = tmp_path / "run"
    run_train(_sft_config(tiny_model_dir, out, tmp_path, max_steps=2))
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    # The fresh run is 'killed' before it trains: an error in the stage after the overwrite step.
    with pytest.raises(DataError):
        run_train(_sft_config(tiny_model_dir, out, tmp_path, max_steps=2, overwrite_output_dir=True,
                              dataset=str(tmp_path / "missing.json")))
    assert not (out / "trainer_state.json").exists() and not list(out.glob("checkpoint-*"))


def test_resume_from_checkpoint_true_without_checkpoint_is_an_error(tiny_model_dir, tmp_path):
    config = _sft_config(tiny_model_dir, tmp_path / "empty", tmp_path, max_steps=1, resume_from_checkpoint="true")
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resolve_resume(config)
