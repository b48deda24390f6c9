"""LLaMA-Factory's kernel and speed keys: `flash_attn` mapped to `attn_implementation`, `upcast_layernorm`,
`disable_gradient_checkpointing`, and the ones refused with the reason (`fa2`, `enable_liger_kernel` and `use_unsloth`
on a CPU, `shift_attn` everywhere); every key of this lane in `--help-keys`."""

from __future__ import annotations

import pytest
import torch

from alignkit.config import FinetuningArguments, ModelArguments
from alignkit.config.parse import all_keys, parse_config
from alignkit.errors import ConfigError

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusals")


def test_every_new_key_is_in_help_keys():
    keys = {key for group in all_keys().values() for key in group}
    for key in ("quantization_bit", "quantization_method", "quantization_type", "double_quantization",
                "quantization_device_map", "use_dora", "use_rslora", "pissa_init", "pissa_iter", "pissa_convert",
                "loraplus_lr_ratio", "loraplus_lr_embedding", "flash_attn", "shift_attn", "enable_liger_kernel",
                "use_unsloth", "upcast_layernorm", "disable_gradient_checkpointing", "mask_history", "enable_thinking", "rope_scaling",
                "model_max_length", "image_max_pixels", "image_min_pixels", "freeze_vision_tower",
                "freeze_multi_modal_projector", "freeze_language_model"):
        assert key in keys, key


@cpu_only
def test_kernel_keys_refused_on_a_cpu_with_the_reason():
    with pytest.raises(ConfigError, match="flash_attn=fa2 .FlashAttention 2. needs a CUDA GPU"):
        ModelArguments(flash_attn="fa2")
    with pytest.raises(ConfigError, match="enable_liger_kernel=true needs a CUDA GPU"):
        ModelArguments(enable_liger_kernel=True)
    with pytest.raises(ConfigError, match="use_unsloth=true is not supported.*needs a CUDA GPU"):
        ModelArguments(use_unsloth=True)


def test_shift_attn_and_conflicts_are_refused():
    with pytest.raises(ConfigError, match="shift_attn=true .LongLoRA's shifted sparse attention. is not supported"):
        ModelArguments(shift_attn=True)
    with pytest.raises(ConfigError, match="flash_attn=disabled .attn_implementation=eager. and attn_implementation=sdpa"):
        ModelArguments(flash_attn="disabled", attn_implementation="sdpa")
    with pytest.raises(ConfigError, match="gradient_checkpointing=true and disable_gradient_checkpointing=true"):
        parse_config({"stage": "sft", "do_train": True, "dataset": "x", "gradient_checkpointing": True,
                      "disable_gradient_checkpointing": True})
    config = parse_config({"stage": "sft", "do_train": True, "dataset": "x", "disable_gradient_checkpointing": True})
    assert config.training.gradient_checkpointing is False


@pytest.mark.parametrize("flash_attn, expected", [("disabled", "eager"), ("sdpa", "sdpa")])
def test_flash_attn_sets_the_attention_kernel(flash_attn, expected, tiny_model_dir):
    from alignkit.model.loader import load_model

    model = load_model(ModelArguments(model_name_or_path=tiny_model_dir, flash_attn=flash_attn), FinetuningArguments(),
                       is_trainable=False)
    assert model.config._attn_implementation == expected


def test_upcast_layernorm_keeps_norm_weights_in_float32(tiny_model_dir):
    from alignkit.model.loader import load_model

    model = load_model(ModelArguments(model_name_or_path=tiny_model_dir, infer_dtype="bfloat16", upcast_layernorm=True),
                       FinetuningArguments(lora_rank=4), is_trainable=True)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    norms = [name for name in dtypes if "norm" in name]
    assert norms and all(dtypes[name] == torch.float32 for name in norms)
    assert dtypes["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "llama3"])
def test_rope_scaling_scales_to_the_training_length(kind, tiny_model_dir):
    """The tiny model has 1024 positions; cutoff_len 3000 needs factor ceil(3000 / 1024) = 3."""
    from alignkit.model.loader import load_model

    config = parse_config({"stage": "sft", "do_train": True, "dataset": "x", "model_name_or_path": tiny_model_dir,
                           "rope_scaling": kind, "cutoff_len": 3000})
    assert config.model.model_max_length == 3000
    model = load_model(config.model, FinetuningArguments(), is_trainable=False)
    rope = model.config.rope_parameters
    assert (rope["rope_type"], rope["factor"], model.config.max_position_embeddings) == (kind, 3.0, 3072)
    assert rope.get("original_max_position_embeddings") == (None if kind == "linear" else 1024)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[5, 6, 7]])).logits).all()


def test_rope_scaling_within_the_context_changes_nothing(tiny_model_dir):
    from alignkit.model.loader import load_model

    config = parse_config({"stage": "sft", "do_train": True, "dataset": "x", "model_name_or_path": tiny_model_dir,
                           "rope_scaling": "linear", "cutoff_len": 512})
    model = load_model(config.model, FinetuningArguments(), is_trainable=False)
    assert model.config.rope_parameters["rope_type"] == "default" and model.config.max_position_embeddings == 1024
