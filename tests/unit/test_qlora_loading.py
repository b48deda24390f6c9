"""Quantized bases (`quantization_bit`, QLoRA) as `load_model` builds them on the tiny model (bitsandbytes runs on
the CPU): the keys' checks, the reference as "adapter disabled", the fast paths falling back to PEFT's forward
instead of dequantizing, an earlier adapter merged in full precision before the base is quantized, and export's
report."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest
import torch

from alignkit.config import FinetuningArguments, ModelArguments
from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError

needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")


def test_quantization_keys_are_checked_where_they_enter(monkeypatch):
    with pytest.raises(ConfigError, match="quantization_bit=3: bitsandbytes quantizes to 4 or 8 bits"):
        ModelArguments(quantization_bit=3)
    with pytest.raises(ConfigError, match="quantization_method='hqq' is not supported"):
        ModelArguments(quantization_bit=4, quantization_method="hqq")
    with pytest.raises(ConfigError, match="quantization_device_map=auto applies to quantization_bit=4"):
        ModelArguments(quantization_bit=8, quantization_device_map="auto")
    with pytest.raises(ConfigError, match="with finetuning_type=full: a quantized base cannot be trained"):
        parse_config({"stage": "sft", "do_train": True, "dataset": "x", "quantization_bit": 4,
                      "finetuning_type": "full"})
    # Without bitsandbytes: the install command, before anything loads.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes"
                        else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"needs bitsandbytes, which is not installed: pip install 'alignkit\[qlora\]'"):
        parse_config({"stage": "sft", "do_train": True, "dataset": "x", "quantization_bit": 4})


def _quantized(tiny_model_dir, bits=4, **keys) -> ModelArguments:
    return ModelArguments(model_name_or_path=tiny_model_dir, quantization_bit=bits, **keys)


@needs_bnb
def test_full_or_freeze_on_a_quantized_base_is_refused(tiny_model_dir):
    from alignkit.model.loader import load_model

    for kind in ("full", "freeze"):
        with pytest.raises(ConfigError, match=f"finetuning_type={kind}: a quantized base cannot be trained"):
            load_model(_quantized(tiny_model_dir), FinetuningArguments(finetuning_type=kind), is_trainable=True)


@needs_bnb
def test_lora_on_a_4bit_base_decodes_unmerged_and_its_reference_is_the_quantized_base(tiny_model_dir,
                                                                                       tiny_tokenizer):
    """Neither the fused layer nor the packed/merged decode touches the quantized layers (they would dequantize
    into a full copy, or round base + delta to the 4-bit grid again): PEFT's forward runs, and the decoded tokens
    are those of the unmerged adapter."""
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer

    from alignkit.model.adapters import adapters_disabled
    from alignkit.model.generation import generate_with_decode, merged_lora, packed_linears
    from alignkit.model.loader import load_model

    model = load_model(_quantized(tiny_model_dir), FinetuningArguments(lora_rank=4), is_trainable=True)
    assert model.get_base_model().is_quantized
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert layers and all(isinstance(m.get_base_layer(), bnb.nn.Linear4bit) for m in layers)
    assert not any("forward" in vars(m) for m in layers)  # no fused path installed
    with torch.no_grad():
        for layer in layers:  # a trained adapter, so that merged and unmerged would differ
            layer.lora_B["default"].weight.normal_(0, 0.5)
    # A merge would replace each quantized weight with a re-quantized one (bitsandbytes may re-pack a weight's bytes
    # for its CPU kernel on the first forward, so the tensors themselves are not compared).
    stored = {name: p for name, p in model.named_parameters() if not p.is_floating_point()}
    with merged_lora(model) as merged, packed_linears(model, 2) as packed:
        assert not merged and not packed

    ids = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    kwargs = dict(stop_token_ids=[tiny_tokenizer.eos_token_id], generation_kwargs={"max_new_tokens": 5})
    fast = generate_with_decode(model, tiny_tokenizer, ids, mask, merge_lora=True, **kwargs)
    unmerged = generate_with_decode(model, tiny_tokenizer, ids, mask, merge_lora=False, **kwargs)
    assert torch.equal(fast.completion_ids, unmerged.completion_ids)
    assert stored and all(stored[name] is param for name, param in model.named_parameters() if name in stored)
    # Decoding left the base on its training kernel (`loader._one_cpu_kernel`): gradients still reach the first
    # layer's adapter, through the quantized layers above it.
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    first = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert first.grad is not None and first.grad.abs().sum() > 0
    model.zero_grad()

    base = load_model(_quantized(tiny_model_dir), FinetuningArguments(), is_trainable=False)
    with torch.no_grad(), adapters_disabled(model):
        reference = model(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(reference, base(input_ids=ids, attention_mask=mask).logits)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids, attention_mask=mask).logits, reference)


@needs_bnb
def test_an_earlier_adapter_is_merged_in_full_precision_then_quantized(tiny_model_dir, tmp_path, caplog,
                                                                       save_perturbed_adapter):
    from alignkit.model.loader import load_model, merged_adapters, merged_base_dir

    sft = tmp_path / "sft"
    save_perturbed_adapter(tiny_model_dir, sft, seed=3)
    args = _quantized(tiny_model_dir, adapter_name_or_path=str(sft))
    with caplog.at_level(logging.WARNING, logger="alignkit.model.loader"):
        model = load_model(args, FinetuningArguments(lora_rank=4), is_trainable=True)
    assert "quantization_bit=4: merging" in caplog.text and "loads it quantized" in caplog.text
    folder = merged_base_dir(args, [str(sft.resolve())])
    assert (folder / "alignkit_merged_base.json").is_file()
    assert model.get_base_model().is_quantized and merged_adapters(model) == (str(sft.resolve()),)
    assert model.get_base_model().config.name_or_path == tiny_model_dir  # the real base is recorded, not the cache
    # The reference is the merged folder quantized: what the same load of that folder gives.
    plain = load_model(_quantized(str(folder)), FinetuningArguments(), is_trainable=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    from alignkit.model.adapters import adapters_disabled

    with torch.no_grad(), adapters_disabled(model):
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)


@needs_bnb
def test_export_of_an_adapter_trained_on_a_quantized_base_says_it_merges_into_full_precision(
        tiny_model_dir, tmp_path, caplog, save_perturbed_adapter):
    from alignkit.export import export_model
    from alignkit.model.loader import save_base_quantization

    adapter = tmp_path / "qlora"
    trained = save_perturbed_adapter(tiny_model_dir, adapter, seed=4)
    trained.get_base_model().alignkit_model_source = (_quantized(tiny_model_dir, double_quantization=False),
                                                      "causal_lm")
    record = save_base_quantization(trained, adapter)
    assert json.loads(record.read_text()) == {"quantization_bit": 4, "quantization_method": "bnb",
                                              "quantization_type": "nf4", "double_quantization": False}
    with caplog.at_level(logging.WARNING, logger="alignkit.export"):
        out = export_model(ModelArguments(model_name_or_path=tiny_model_dir, adapter_name_or_path=str(adapter)),
                           str(tmp_path / "merged"))
    assert "was trained on a 4-bit quantized base" in caplog.text and "merged into the full-precision base" in caplog.text
    from safetensors.torch import load_file

    assert all(t.is_floating_point() and t.dtype == torch.float32 for t in load_file(out / "model.safetensors").values())


def _maps_of(folder) -> list[str]:
    """The lines of /proc/self/maps that map a file inside `folder` (a checkpoint held open by a memory map)."""
    from pathlib import Path

    root = str(Path(folder).resolve())
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if root in line]


@needs_bnb
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_a_4bit_base_lets_go_of_the_checkpoints_memory_map(tiny_model_dir, tmp_path, monkeypatch):
    """The weights that stay full precision (the tied embedding and head, the norms) are copied out of the
    safetensors map, so the whole checkpoint, which quantizing read, does not stay resident beside the 4-bit model
    (docs/qlora.md, "Memory"). Without the copy the map stays open: the check can fail."""
    import gc

    from safetensors.torch import load_file

    import shutil

    from alignkit.model import loader

    # A copy of its own: a model another test of this process still holds keeps the shared folder's file mapped.
    tiny_model_dir = str(shutil.copytree(tiny_model_dir, tmp_path / "tiny_model"))

    def load():
        model = loader.load_model(_quantized(tiny_model_dir), FinetuningArguments(finetuning_type="lora"),
                                  is_trainable=True)
        gc.collect()
        return model, _maps_of(tiny_model_dir)

    model, maps = load()
    assert maps == []
    base = model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight  # still tied: one parameter, copied once
    saved = load_file(f"{tiny_model_dir}/model.safetensors")
    assert torch.equal(base.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    assert torch.equal(base.model.norm.weight, saved["model.norm.weight"])
    del model, base
    gc.collect()

    monkeypatch.setattr(loader, "own_mapped_weights", lambda model: 0)
    kept, maps = load()
    assert maps, "without the copies the checkpoint's map should stay open (this test would not notice it)"
    del kept


def test_the_mmap_threshold_is_fixed_for_a_quantized_cpu_base_unless_the_user_set_it(monkeypatch):
    import os

    from alignkit.model.loader import fixed_mmap_threshold

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fixed_mmap_threshold() is False  # glibc read the user's own value at start-up; left alone
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    try:
        glibc = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        glibc = False
    assert fixed_mmap_threshold() is (glibc and not torch.cuda.is_available())
