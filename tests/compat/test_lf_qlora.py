"""LLaMA-Factory's QLoRA example keys (`examples/train_qlora/*_otfq.yaml`, `*_bnb_npu.yaml`: `quantization_bit`,
`quantization_method: bnb`, `double_quantization`) on top of the tier's LoRA example config, two steps each through
`alignkit train` on the tiny model with its linear layers quantized by bitsandbytes (it runs on the CPU).

sft, rm, dpo and kto train LoRA on a 4-bit base, sft also on an 8-bit one; the adapter records the quantization it
trained over (`base_quantization.json`, what `alignkit export` reports). The sft case runs 10 steps and checks that
the loss falls on a quantized base, not only that it is finite. Gradient accumulation is 2 here (8 in the examples,
which the LoRA tier runs as written): each case is a process of its own, and the quantized matmuls are slow on a CPU.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from alignkit.config.parse import read_config

from .test_lf_configs import NO_WORKERS
from .test_lf_kto import add_lf_kto_data

pytestmark = [pytest.mark.compat, pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                                     reason="needs bitsandbytes (the qlora or dev extra)")]

# The QLoRA examples' keys beyond the LoRA ones (`_otfq` leaves double_quantization at its default, true).
QLORA_KEYS = {"quantization_bit": 4, "quantization_method": "bnb", "double_quantization": False}
# The tier's eval block is left out: it is the LoRA tier's business, and each eval pass costs seconds here.
NO_EVAL = ("val_size", "per_device_eval_batch_size", "eval_strategy", "eval_steps")


def _trained(proc, config: Path, steps: int = 2) -> Path:
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = Path(read_config(config).training.output_dir)
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == steps
    train_loss = json.loads((out / "train_results.json").read_text())["train_loss"]
    assert math.isfinite(train_loss), train_loss
    assert (out / "adapter_model.safetensors").is_file()
    return out


@pytest.mark.parametrize("stage, dataset", [("sft", "alpaca_demo"), ("rm", "pairs_demo"), ("dpo", "pairs_demo"),
                                            ("kto", "kto_demo")])
def test_lora_on_a_4bit_base(lf_config, lf_data, run_alignkit, stage, dataset):
    add_lf_kto_data(lf_data)
    # sft: 10 steps of one example, logged each step, at a learning rate that moves the tiny model within them.
    falling = dict(max_steps=10, logging_steps=1, gradient_accumulation_steps=1, learning_rate=5e-3,
                   warmup_ratio=0.0) if stage == "sft" else {"gradient_accumulation_steps": 2}
    config = lf_config(stage, dataset, drop=NO_EVAL, **{**QLORA_KEYS, **NO_WORKERS, **falling})
    out = _trained(run_alignkit(config), config, steps=falling.get("max_steps", 2))
    assert json.loads((out / "base_quantization.json").read_text()) == {
        "quantization_bit": 4, "quantization_method": "bnb", "quantization_type": "nf4", "double_quantization": False}
    if stage == "rm":
        # The score head trained in full precision beside the adapter (transformers never quantizes it).
        from safetensors import safe_open

        with safe_open(out / "adapter_model.safetensors", "pt") as weights:
            score = [weights.get_tensor(k) for k in weights.keys() if "score" in k]
        assert score and all(t.dtype.is_floating_point for t in score)
    if stage == "sft":
        losses = [r["loss"] for r in map(json.loads, (out / "trainer_log.jsonl").read_text().splitlines())
                  if "loss" in r]
        assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses


def test_lora_sft_on_an_8bit_base(lf_config, run_alignkit):
    config = lf_config("sft", "alpaca_demo", name="sft_8bit", drop=NO_EVAL, quantization_bit=8,
                       gradient_accumulation_steps=2, **NO_WORKERS)
    out = _trained(run_alignkit(config), config)
    assert json.loads((out / "base_quantization.json").read_text())["quantization_bit"] == 8


def test_every_key_of_the_qlora_and_qwen3_examples_parses(lf_config, monkeypatch):
    """The keys LLaMA-Factory's text examples (`train_lora`, `train_qlora`, `train_full`, the qwen3 ones under
    `ascend/`) add to the LoRA tier's union: the QLoRA keys, `tokenized_path`, `flash_attn`,
    `disable_gradient_checkpointing`, `packing`, `seed`. (`deepspeed` is the DeepSpeed tests'; the multimodal
    `qwen3vl`/`mossvl` keys and Ray's `ray_num_workers` belong to features alignkit does not have.) `flash_attn: fa2`,
    as written there, is a ConfigError on a CPU that names the fix, never an unknown key."""
    extra = {**QLORA_KEYS, "quantization_type": "nf4", "quantization_device_map": "auto", "tokenized_path": None,
             "flash_attn": "sdpa", "disable_gradient_checkpointing": True, "packing": False, "seed": 1234}
    config = lf_config("sft", "alpaca_demo", name="sft_union", **extra)
    parsed = read_config(config)
    assert parsed.model.quantization_bit == 4 and parsed.model.flash_attn == "sdpa"
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match=r"flash_attn=fa2 \(FlashAttention 2\) needs a CUDA GPU"):
            read_config(config, ["flash_attn=fa2"])
