"""Every stage trains under bf16 autocast on a CPU (`bf16: true`, what `bf16: auto` picks on a CPU with bf16
hardware): two steps on the tiny model, finite losses, and the model's layers really ran under autocast.

The suite's own runs are fp32 (`ALIGNKIT_PRECISION_PROBE=off`), so without this file no test ran a stage's forward,
or the online stages' decode engine (oneDNN-packed weights, `model.generation.packed_linears`), under autocast; on
an AMD EPYC with AVX512-BF16 the RLOO example then crashed in its first rollout inside oneDNN (bf16 activations
into an fp32 packed weight). The CPU's bf16 support is patched in, so the check runs on every CPU (autocast works
without bf16 hardware, only slower).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from alignkit.callbacks import read_log
from alignkit.config import parse as parse_module
from alignkit.train import run_train
from tests.helpers import tiny_config

DATA = Path(__file__).resolve().parents[2] / "data"
DATASETS = {"pt": "demo_pt", "sft": "demo_sft", "rm": "demo_pref", "dpo": "demo_pref", "kto": "demo_kto",
            "grpo": "demo_math", "rloo": "demo_math", "ppo": "demo_math", "distill": "demo_math",
            "online_dpo": "demo_math"}
REWARD_SOURCE = ("def token_sum_reward(completions, completion_ids, **kwargs):\n"
                 "    return [float(sum(ids) % 5) for ids in completion_ids]\n")


def _keys(stage: str, tiny_model_dir, tmp_path: Path) -> dict:
    keys = {"stage": stage, "do_train": True, "dataset": DATASETS[stage], "dataset_dir": str(DATA), "max_samples": 4,
            "cutoff_len": 128, "per_device_train_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3,
            "lora_rank": 4, "save_strategy": "no", "logging_steps": 1, "seed": 0, "bf16": True}
    if stage in ("grpo", "rloo", "online_dpo", "ppo"):
        reward = tmp_path / "token_reward.py"
        reward.write_text(REWARD_SOURCE)
        keys["reward_funcs"] = f"{reward}:token_sum_reward"
    if stage in ("grpo", "rloo"):
        keys.update(num_generations=2, max_completion_length=6)
    if stage in ("online_dpo", "ppo"):
        keys["max_new_tokens"] = 6
    if stage == "ppo":
        keys.update(ppo_epochs=1, mini_batch_size=2)
    if stage == "distill":
        keys.update(teacher_model_name_or_path=str(tiny_model_dir), max_completion_length=6)
    return keys


@pytest.mark.parametrize("stage", list(DATASETS))
def test_every_stage_trains_under_bf16_autocast_on_a_cpu(stage, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(parse_module, "_cpu_has_bf16", lambda: True)
    monkeypatch.setattr("alignkit.env.cpu_supports_bf16", lambda: True)
    out = tmp_path / "out"
    config = tiny_config(tiny_model_dir, out, **_keys(stage, tiny_model_dir, tmp_path))
    assert config.training.bf16 is True
    autocast = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, inputs: autocast.append((torch.is_autocast_enabled("cpu"), module.weight.dtype))
        if type(module) is torch.nn.Linear else None)
    try:
        run_train(config)
    finally:
        hook.remove()
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses
    assert any(on for on, _ in autocast), "no linear layer ran under bf16 autocast"
    # A linear layer with bf16 weights runs only under autocast (it could not multiply fp32 inputs otherwise);
    # distillation's frozen teacher keeps its linear weights in bf16 (`precision.bf16_frozen_linears`).
    assert all(on for on, dtype in autocast if dtype == torch.bfloat16)
    assert any(dtype == torch.bfloat16 for _, dtype in autocast) is (stage == "distill")
