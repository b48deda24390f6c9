"""The shipped DeepSpeed and accelerate configs, dry-run as far as this CPU allows: DeepSpeed itself needs an
accelerator (and is not installed), so its version check is stubbed and transformers' own filling of the
`"auto"` values is run; the FSDP config is read by accelerate's config loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DS_CONFIGS = {"ds_z0_config.json": 0, "ds_z2_config.json": 2, "ds_z3_config.json": 3, "ds_z3_offload_config.json": 3}


def _trainer_deepspeed_config(hf_deepspeed, path: str):
    """transformers' `HfTrainerDeepSpeedConfig` logic over accelerate's config reader, without DeepSpeed.

    Without DeepSpeed installed transformers gives its config class a bare `object` base; this rebuilds it on
    accelerate's `HfDeepSpeedConfig` (what it inherits when DeepSpeed is there). Its `__init__` is skipped
    because it registers the config process-wide (which would turn ZeRO-3 on for every later test).
    """
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    methods = {}
    for cls in (hf_deepspeed.HfDeepSpeedConfig, hf_deepspeed.HfTrainerDeepSpeedConfig):
        methods.update({k: v for k, v in vars(cls).items() if k not in ("__init__", "__dict__", "__weakref__")})
    config = type("TrainerDeepSpeedConfig", (HfDeepSpeedConfig,), methods)(path)
    config._dtype, config.mismatches = None, []
    return config


@pytest.mark.parametrize("name, stage", sorted(DS_CONFIGS.items()))
def test_deepspeed_config_gets_every_auto_value_from_the_training_arguments(name, stage, tiny_model_dir,
                                                                           tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.integrations import deepspeed as hf_deepspeed

    from alignkit.config.parse import parse_config

    args = parse_config({"output_dir": str(tmp_path), "per_device_train_batch_size": 2,
                         "gradient_accumulation_steps": 4, "max_grad_norm": 0.5}).training
    config = _trainer_deepspeed_config(hf_deepspeed, str(EXAMPLES / "deepspeed" / name))
    config.trainer_config_process(args)
    config.trainer_config_finalize(args, AutoModelForCausalLM.from_pretrained(tiny_model_dir), num_training_steps=10)
    assert "auto" not in json.dumps(config.config)
    assert config.config["zero_optimization"]["stage"] == stage and config.is_zero3() == (stage == 3)
    assert config.is_offload() == name.endswith("offload_config.json")
    assert (config.config["train_micro_batch_size_per_gpu"], config.config["gradient_accumulation_steps"],
            config.config["train_batch_size"], config.config["gradient_clipping"]) == (2, 4, 8, 0.5)
    assert config.config["fp16"]["enabled"] is False and config.config["bf16"]["enabled"] is False  # fp32 on a CPU
    if stage == 3:
        hidden = 64  # the tiny model: buckets sized from its hidden size as transformers documents
        assert config.config["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * hidden * hidden)
        assert config.config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_accelerate_fsdp_config_loads_as_fsdp2():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    config = load_config_from_file(str(EXAMPLES / "accelerate" / "fsdp_config.yaml"))
    assert config.distributed_type == DistributedType.FSDP
    assert config.fsdp_config["fsdp_version"] == 2 and config.num_processes == 2 and not config.use_cpu
