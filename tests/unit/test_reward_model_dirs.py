"""`check_reward_model_dir`: which folders hold a trained score head, read from tensor names alone.

The entry points' refusals are in tests/fault/test_reward_model_heads.py; here each weights layout the loader
accepts (one safetensors file, a shard index, a torch pickle; a LoRA adapter, alone or over a full RM) is shown
with and without its head.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from alignkit.errors import ConfigError
from alignkit.rewards.reward_model import check_reward_model_dir


@pytest.fixture
def full_rm_dir(tiny_model_dir, tmp_path):
    """A full reward model as an rm run with finetuning_type full (or `alignkit export`) saves it."""
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "rm_full"
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id = 2
    model.save_pretrained(out)
    return out


def _copy(folder, tmp_path, name):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def _shard(folder):
    """Replace model.safetensors by two shards and their index (as save_pretrained does for a large model)."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), start=1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, folder / shard, metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _refused(folder, match="no trained score head"):
    with pytest.raises(ConfigError, match=match) as info:
        check_reward_model_dir(folder)
    assert str(folder) in str(info.value) and "stage: rm" in str(info.value)
    return str(info.value)


def test_full_reward_model_and_plain_causal_lm(full_rm_dir, tiny_model_dir):
    check_reward_model_dir(full_rm_dir)
    message = _refused(tiny_model_dir)
    assert "its weights (model.safetensors) hold no `score.weight`; it is a LlamaForCausalLM" in message


def test_sharded_and_pickled_weights(full_rm_dir, tiny_model_dir, tmp_path):
    sharded_rm, sharded_lm = _copy(full_rm_dir, tmp_path, "rm_sharded"), _copy(tiny_model_dir, tmp_path, "lm_sharded")
    _shard(sharded_rm)
    _shard(sharded_lm)
    check_reward_model_dir(sharded_rm)
    assert "model.safetensors.index.json" in _refused(sharded_lm)

    pickled = _copy(tiny_model_dir, tmp_path, "lm_pickled")
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    assert "pytorch_model.bin" in _refused(pickled)


def test_reward_adapter_needs_its_saved_head(reward_adapter_dir, tiny_model_dir, full_rm_dir, tmp_path,
                                             save_perturbed_adapter):
    check_reward_model_dir(reward_adapter_dir)
    weights = reward_adapter_dir / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if ".score." not in k}, weights, metadata={"format": "pt"})
    message = _refused(reward_adapter_dir)
    assert "hold no `score.weight` (modules_to_save: [" in message
    assert f"its base {tiny_model_dir} has none either" in message

    # A SEQ_CLS adapter over a full reward model need not save the head: the base's is trained.
    over_rm = tmp_path / "lora_over_rm"
    shutil.copytree(reward_adapter_dir, over_rm)
    config = json.loads((over_rm / "adapter_config.json").read_text())
    config.update(base_model_name_or_path=str(full_rm_dir), modules_to_save=None)
    (over_rm / "adapter_config.json").write_text(json.dumps(config))
    check_reward_model_dir(over_rm)

    save_perturbed_adapter(tiny_model_dir, tmp_path / "sft")
    _refused(tmp_path / "sft", match="holds an adapter without a score head")
    with pytest.raises(ConfigError, match="reward_model: reward model .* is not a directory"):
        check_reward_model_dir(tmp_path / "nowhere", key="reward_model")


def test_unreadable_weights_are_left_to_the_loader(tiny_model_dir, tmp_path):
    """A cut-off weights file is not judged here: the loader's own check names what is wrong with it."""
    damaged = _copy(tiny_model_dir, tmp_path, "damaged")
    data = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(data[:100])
    check_reward_model_dir(damaged)
