"""DeepSpeed ZeRO-3 for real, where DeepSpeed is installed (skipped otherwise; it is not in the project's dev
environment): one process on the CPU (gloo), `examples/deepspeed/ds_z3_config.json`, against the same run without
DeepSpeed. What runs for real here: transformers' `zero.Init` loading (every weight partitioned as it loads), the
engine over the policy, the reference of a full fine-tuning policy loaded again partitioned and gathered with
`GatheredParameters` for each pass, and the merged base an `adapter_name_or_path` is loaded from. One process holds
every partition, so what this cannot show is sharding over several processes (or a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

ZERO3 = Path(__file__).resolve().parents[2] / "examples" / "deepspeed" / "ds_z3_config.json"


def test_dpo_full_finetuning_reference_under_zero3_equals_the_plain_run(dist):
    config = dist.config("dpo", finetuning_type="full", lora_rank=None, max_steps=3, per_device_train_batch_size=2,
                         learning_rate=1e-4, max_samples=16)
    plain = dist.train(config)
    zero3 = dist.train(config, f"deepspeed={ZERO3}", launcher="torchrun", nproc=1)
    dist.assert_same_losses(plain, zero3)
    dist.assert_same_weights(plain, zero3)


def test_ppo_lora_over_a_merged_sft_adapter_under_zero3_equals_the_plain_run(dist, tmp_path, tiny_model_dir,
                                                                            save_perturbed_adapter):
    """examples/ppo_lora.yaml's shape: the SFT adapter merged into a cached base (ZeRO-3) or in memory (plain), the
    RM trained over it as a named adapter."""
    sft, rm = tmp_path / "sft", tmp_path / "rm_sft"
    save_perturbed_adapter(tiny_model_dir, sft, seed=7)
    trained = save_perturbed_adapter(tiny_model_dir, rm, head="reward", seed=5, over=sft)
    with torch.no_grad():
        trained.base_model.model.score.modules_to_save["default"].weight.add_(0.5)
    trained.save_pretrained(rm)
    config = dist.config("ppo", adapter_name_or_path=str(sft), reward_model=str(rm), reward_model_type="lora",
                         dataset="demo_pref", max_samples=16, max_new_tokens=6, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, mini_batch_size=2, ppo_epochs=2, max_steps=2, optim="sgd",
                         learning_rate=0.05, max_grad_norm=0.5, save_steps=100)
    plain = dist.train(config)
    zero3 = dist.train(config, f"deepspeed={ZERO3}", launcher="torchrun", nproc=1)
    dist.assert_same_losses(plain, zero3)
    dist.assert_same_weights(plain, zero3)
    merged = [p for p in (zero3.home / "merged").iterdir() if p.is_dir()]
    assert len(merged) == 1 and not (plain.home / "merged").exists()
    assert json.loads((zero3.out / "base_adapters.json").read_text())["base_adapters"] == [str(sft.resolve())]
