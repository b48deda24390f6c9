"""LLaMA-Factory's example configs for pt, sft, rm, dpo (LoRA) and full SFT, as it writes them, run for two
steps through `alignkit train`; a `deepspeed` key without DeepSpeed stops with an error naming the extra.

Each case is one `alignkit train` process (see conftest.py for the config and data written).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.compat

# Starting 4 DataLoader workers (LLaMA-Factory's value) costs seconds a case on a 2-core CI machine, and
# torch warns about it there; the sft case keeps the value, the others use none.
NO_WORKERS = {"dataloader_num_workers": 0}
# What stderr may say beyond progress bars and INFO lines: the bf16 decision for a CPU without bf16 hardware,
# and torch's note that 4 DataLoader workers exceed the cores of a small machine (the user can act on both).
EXPECTED_WARNINGS = (
    re.compile(r"^\[WARNING\|alignkit\.config\.parse\] bf16=true: this CPU has no bf16 hardware"),
    re.compile(r"UserWarning: This DataLoader will create 4 worker processes in total"),
)


def _warnings(stderr: str) -> list[str]:
    """The lines of stderr that warn, without the ones expected here."""
    lines = [line for line in stderr.splitlines()
             if re.search(r"warn|\bMISSING\b|LOAD REPORT|Traceback|error", line, re.IGNORECASE)]
    return [line for line in lines if not any(pattern.search(line) for pattern in EXPECTED_WARNINGS)
            and "self.check_worker_number_rationality()" not in line and "warnings.warn(" not in line]


def _check_two_step_run(proc, config: Path, weights: str) -> Path:
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    assert (out / weights).is_file()
    # warmup_ratio, in every LLaMA-Factory example, is mapped and said once.
    assert proc.stderr.count("warmup_ratio=0.1 is read as warmup_steps=0.1") == 1
    # bf16: true is honoured (CPU with bf16 hardware) or trained in fp32 with one warning; said once either way.
    assert len(re.findall(r"bf16=true: ", proc.stderr)) == 1
    # val_size + eval_strategy steps: evaluated once, at the last step, and written.
    records = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["current_steps"] for r in records if "eval_loss" in r] == [2]
    assert json.loads((out / "eval_results.json").read_text())["eval_loss"] > 0
    assert _warnings(proc.stderr) == []
    return out


def test_lora_sft_on_alpaca(lf_config, run_alignkit):
    config = lf_config("sft", "alpaca_demo")
    _check_two_step_run(run_alignkit(config), config, "adapter_model.safetensors")


def test_lora_pt_on_a_text_column(lf_config, run_alignkit):
    config = lf_config("pt", "text_demo", **NO_WORKERS)
    _check_two_step_run(run_alignkit(config), config, "adapter_model.safetensors")


def test_lora_reward_model_on_ranking_pairs(lf_config, run_alignkit):
    config = lf_config("rm", "pairs_demo", **NO_WORKERS)
    out = _check_two_step_run(run_alignkit(config), config, "adapter_model.safetensors")
    assert "eval_accuracy" in json.loads((out / "eval_results.json").read_text())


def test_lora_dpo_on_ranking_pairs(lf_config, run_alignkit):
    config = lf_config("dpo", "pairs_demo", **NO_WORKERS)
    out = _check_two_step_run(run_alignkit(config), config, "adapter_model.safetensors")
    assert "eval_rewards/margins" in json.loads((out / "eval_results.json").read_text())


def test_full_sft_on_alpaca(lf_config, run_alignkit):
    """LLaMA-Factory's full example also names a DeepSpeed config, which needs GPUs (the next case)."""
    config = lf_config("sft", "alpaca_demo", finetuning_type="full", **NO_WORKERS)
    _check_two_step_run(run_alignkit(config), config, "model.safetensors")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="DeepSpeed is installed here")
def test_deepspeed_without_deepspeed_names_the_extra(lf_config, run_alignkit, tmp_path):
    ds_config = tmp_path / "ds_z3_config.json"
    ds_config.write_text(json.dumps({"train_batch_size": "auto", "zero_optimization": {"stage": 3}}))
    config = lf_config("sft", "alpaca_demo", name="sft_ds3", deepspeed=str(ds_config), **NO_WORKERS)
    proc = run_alignkit(config)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "PackageNotFoundError" not in proc.stderr
    assert f"alignkit: error: deepspeed='{ds_config}' needs DeepSpeed, which is not installed: pip install " \
           "'alignkit[deepspeed]'" in proc.stderr


def test_every_key_of_the_examples_parses(lf_config, lf_data):
    """The union of the keys in LLaMA-Factory's current and llama3-era LoRA / full examples for these stages
    (the eval block's alternative `eval_dataset` included), parsed in-process without running."""
    from alignkit.config.parse import read_config

    config = lf_config("dpo", "pairs_demo", eval_dataset="pairs_demo", drop=("val_size",))
    keys = set(yaml.safe_load(config.read_text()))
    assert keys == {
        "model_name_or_path", "trust_remote_code", "stage", "do_train", "finetuning_type", "lora_rank",
        "lora_target", "pref_beta", "pref_loss", "dataset", "dataset_dir", "template", "cutoff_len", "max_samples",
        "overwrite_cache", "preprocessing_num_workers", "dataloader_num_workers", "output_dir", "logging_steps",
        "save_steps", "plot_loss", "overwrite_output_dir", "save_only_model", "report_to",
        "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "num_train_epochs",
        "lr_scheduler_type", "warmup_ratio", "bf16", "ddp_timeout", "resume_from_checkpoint", "max_steps",
        "eval_dataset", "per_device_eval_batch_size", "eval_strategy", "eval_steps"}
    parsed = read_config(config)
    assert parsed.training.warmup_steps == 0.1 and parsed.method.pref_beta == 0.1
    assert parsed.data.eval_dataset == "pairs_demo" and parsed.training.do_eval
