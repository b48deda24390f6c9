"""The LoRA variants (`use_dora`, `use_rslora`, `pissa_init`, `loraplus_lr_ratio`) as `load_model` and the stage
trainers set them up equal peft's own: the adapter weights after one SGD step on the same batch agree within 1e-6.

rsLoRA and PiSSA change only the scaling and the starting weights, so the fused LoRA layer (`lora_fused`) computes
them; DoRA is a peft "variant" the fused layer and the packed decode hand back to peft's forward. Export merges each
(PiSSA through its converted adapter)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from alignkit.config import FinetuningArguments, ModelArguments
from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.model.loader import find_linear_modules, load_model
from alignkit.model.lora_fused import _plain_adapter

RANK, LR = 4, 0.5
VARIANTS = {"dora": dict(use_dora=True), "rslora": dict(use_rslora=True), "pissa": dict(pissa_init=True, pissa_iter=-1)}


def _batch():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    return {"input_ids": ids, "labels": ids}


def _peft_model(tiny_model_dir, **variant):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    init = "pissa" if variant.get("pissa_init") else True
    return get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=find_linear_modules(base),
                                           use_dora=variant.get("use_dora", False),
                                           use_rslora=variant.get("use_rslora", False), init_lora_weights=init))


def _trainable(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _sgd_step(model, param_groups=None):
    optimizer = torch.optim.SGD(param_groups or [p for p in model.parameters() if p.requires_grad], lr=LR)
    model(**_batch()).loss.backward()
    optimizer.step()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_sgd_step_equals_peft(variant, tiny_model_dir):
    ours = load_model(ModelArguments(model_name_or_path=tiny_model_dir),
                      FinetuningArguments(lora_rank=RANK, **VARIANTS[variant]), is_trainable=True)
    theirs = _peft_model(tiny_model_dir, **VARIANTS[variant])
    mine, peft_params = _trainable(ours), _trainable(theirs)
    assert mine.keys() == peft_params.keys()
    with torch.no_grad():
        torch.manual_seed(0)
        for name, param in mine.items():  # the same start (A is random), B non-zero so every term moves
            if "lora_B" in name:
                param.normal_(0, 0.1)
            peft_params[name].copy_(param)
    layer = ours.base_model.model.model.layers[0].self_attn.q_proj
    fused = _plain_adapter(layer, torch.zeros(1, 64)) is not None
    assert fused  # every variant takes the fused layer (DoRA while its dropout is not in effect, as here)
    _sgd_step(ours)
    _sgd_step(theirs)
    for name, param in mine.items():
        torch.testing.assert_close(param, peft_params[name], rtol=0, atol=1e-6, msg=name)


def test_loraplus_step_equals_peft_loraplus_optimizer(tiny_model_dir, tmp_path):
    from peft.optimizers import create_loraplus_optimizer

    from alignkit.stages.base import StageTrainer
    from alignkit.config import TrainingArguments

    ours = load_model(ModelArguments(model_name_or_path=tiny_model_dir),
                      FinetuningArguments(lora_rank=RANK, loraplus_lr_ratio=16.0), is_trainable=True)
    theirs = _peft_model(tiny_model_dir)
    with torch.no_grad():
        torch.manual_seed(0)
        for name, param in _trainable(ours).items():
            if "lora_B" in name:
                param.normal_(0, 0.1)
            _trainable(theirs)[name].copy_(param)
    args = TrainingArguments(output_dir=str(tmp_path), optim="sgd", learning_rate=LR, report_to="none",
                             use_cpu=True)
    optimizer = StageTrainer(model=ours, args=args).create_optimizer()
    assert sorted(g["lr"] for g in optimizer.param_groups) == sorted([LR, 1e-6, LR * 16, LR * 16])
    reference = create_loraplus_optimizer(theirs, torch.optim.SGD, lr=LR, loraplus_lr_ratio=16.0)
    for model, opt in ((ours, optimizer), (theirs, reference)):
        model(**_batch()).loss.backward()
        opt.step()
    for name, param in _trainable(ours).items():
        torch.testing.assert_close(param, _trainable(theirs)[name], rtol=0, atol=1e-6, msg=name)


def test_variant_keys_are_checked():
    with pytest.raises(ConfigError, match="use_dora apply to finetuning_type=lora, not full"):
        FinetuningArguments(finetuning_type="full", use_dora=True)
    with pytest.raises(ConfigError, match="pissa_iter=0"):
        FinetuningArguments(pissa_init=True, pissa_iter=0)
    with pytest.raises(ConfigError, match="loraplus_lr_ratio=0"):
        FinetuningArguments(loraplus_lr_ratio=0)
    with pytest.raises(ConfigError, match="pissa_init=true with stage dpo"):
        parse_config({"stage": "dpo", "do_train": True, "dataset": "x", "pissa_init": True})


@pytest.mark.parametrize("variant", ["dora", "rslora"])
def test_export_merges_the_variant(variant, tiny_model_dir, tmp_path):
    from alignkit.export import export_model

    model = load_model(ModelArguments(model_name_or_path=tiny_model_dir),
                       FinetuningArguments(lora_rank=RANK, **VARIANTS[variant]), is_trainable=True)
    with torch.no_grad():
        for name, param in _trainable(model).items():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(tmp_path / "adapter")
    model.eval()
    ids = _batch()["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    out = export_model(ModelArguments(model_name_or_path=tiny_model_dir, adapter_name_or_path=str(tmp_path / "adapter")),
                       str(tmp_path / "merged"))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-5)


def test_pissa_converted_adapter_exports_the_trained_model(tiny_model_dir, tmp_path):
    """`pissa_convert` as LLaMA-Factory lays it out: pissa_init at step 0, pissa_converted at the end. The converted
    adapter merged into the ORIGINAL base gives the trained model (residual base + adapter); the unconverted one is
    refused there."""
    import json
    from types import SimpleNamespace

    from alignkit.export import export_model
    from alignkit.model.pissa import PissaConvertCallback
    from alignkit.train import run_train

    out = tmp_path / "run"
    rows = [{"instruction": f"What is {i} plus {i}?", "output": f"It is {2 * i}."} for i in range(4)]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    run_train(parse_config({"stage": "sft", "do_train": True, "model_name_or_path": tiny_model_dir,
                            "dataset": str(tmp_path / "data.json"), "output_dir": str(out), "max_steps": 1,
                            "per_device_train_batch_size": 2, "lora_rank": RANK, "pissa_init": True,
                            "pissa_iter": -1, "pissa_convert": True, "save_strategy": "no", "disable_tqdm": True}))
    assert (out / "pissa_init" / "adapter_config.json").is_file()
    assert (out / "pissa_converted" / "adapter_config.json").is_file()
    with pytest.raises(ConfigError, match="is a PiSSA adapter, right only on the residual base"):
        export_model(ModelArguments(model_name_or_path=tiny_model_dir, adapter_name_or_path=str(out)),
                     str(tmp_path / "wrong"))

    # In process, with a moved adapter standing for training: the export of the converted one is that model.
    model = load_model(ModelArguments(model_name_or_path=tiny_model_dir),
                       FinetuningArguments(lora_rank=RANK, pissa_init=True, pissa_iter=-1), is_trainable=True)
    args = SimpleNamespace(output_dir=str(tmp_path / "manual"), should_save=True)
    PissaConvertCallback().on_train_begin(args, None, None, model=model)
    with torch.no_grad():
        for param in _trainable(model).values():
            param.add_(torch.randn_like(param) * 0.05)
    PissaConvertCallback().on_train_end(args, None, None, model=model)
    model.eval()
    ids = _batch()["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    merged_dir = export_model(ModelArguments(model_name_or_path=tiny_model_dir,
                                             adapter_name_or_path=str(tmp_path / "manual" / "pissa_converted")),
                              str(tmp_path / "merged"))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(merged_dir)(input_ids=ids).logits
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-4)
