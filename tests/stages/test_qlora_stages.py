"""LoRA on a 4-bit base (QLoRA) in the online stages and across a resume, on the tiny model (bitsandbytes quantizes
its linear layers on the CPU).

GRPO and PPO train two steps (RLOO, distillation and online DPO too): rollouts decode on the quantized base with the adapter unmerged (`merged_lora` and
`packed_linears` decline it), the reference is the quantized base with the adapter disabled, and PPO's reward
adapter and critic adapter sit on the same quantized base. An SFT run killed after its checkpoint and resumed
equals the straight run bit for bit (the base is quantized again from the same weights on each load).
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from alignkit.callbacks import read_log
from alignkit.model import generation
from alignkit.train import run_train

from .test_distill import _config as distill_config, teacher_adapter  # noqa: F401 (fixture)
from .test_grpo import _config as grpo_config
from .test_online_dpo import _config as online_dpo_config
from .test_ppo import _config as ppo_config, prompts_file, reward_dir  # noqa: F401 (fixtures)
from .test_resume_losses import CHECKPOINT_STEP, STEPS, _config as resume_config, _data, _logged

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")


@pytest.fixture
def merges(monkeypatch):
    """Records what each decode's `merged_lora` / `packed_linears` said (False: the adapter stayed unmerged)."""
    said = []

    def recording(context):
        def wrapped(*args, **kwargs):
            manager = context(*args, **kwargs)
            class Recorded:
                def __enter__(self):
                    said.append(manager.__enter__())
                    return said[-1]
                def __exit__(self, *exc):
                    return manager.__exit__(*exc)
            return Recorded()
        return wrapped

    monkeypatch.setattr(generation, "merged_lora", recording(generation.merged_lora))
    monkeypatch.setattr(generation, "packed_linears", recording(generation.packed_linears))
    return said


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_log(out) if "loss" in r]


def test_grpo_two_steps_on_a_4bit_base(tiny_model_dir, tmp_path, merges):
    out = tmp_path / "grpo"
    run_train(grpo_config(tiny_model_dir, tmp_path, out, max_steps=2, quantization_bit=4))
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    assert all(math.isfinite(x) for x in _losses(out)) and len(_losses(out)) == 2
    assert merges and not any(merges)  # every rollout decoded with the adapter unmerged
    assert json.loads((out / "base_quantization.json").read_text())["quantization_bit"] == 4


@pytest.mark.parametrize("stage", ["rloo", "distill", "online_dpo"])
def test_the_other_online_stages_train_two_steps_on_a_4bit_base(stage, tiny_model_dir, tmp_path, teacher_adapter,
                                                                 merges):
    out = tmp_path / stage
    keys = {"max_steps": 2, "quantization_bit": 4}
    config = {"rloo": lambda: grpo_config(tiny_model_dir, tmp_path, out, stage="rloo", **keys),
              "distill": lambda: distill_config(tiny_model_dir, tmp_path, out, teacher_adapter, **keys),
              "online_dpo": lambda: online_dpo_config(tiny_model_dir, tmp_path, out, **keys)}[stage]()
    run_train(config)
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    assert all(math.isfinite(x) for x in _losses(out)) and len(_losses(out)) == 2
    assert merges and not any(merges)  # every rollout decoded with the adapter unmerged
    assert json.loads((out / "base_quantization.json").read_text())["quantization_bit"] == 4


def test_ppo_two_steps_on_a_4bit_base_with_reward_and_critic_adapters(tiny_model_dir, prompts_file, reward_dir,
                                                                       tmp_path, merges):
    out = tmp_path / "ppo"
    run_train(ppo_config(tiny_model_dir, prompts_file, out, reward_model=reward_dir, ppo_critic="adapter",
                         quantization_bit=4))
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    record = [r for r in read_log(out) if "loss" in r][-1]
    assert all(math.isfinite(record[k]) for k in ("ppo/loss/policy", "ppo/loss/value", "objective/kl"))
    assert merges and not any(merges)
    assert (out / "critic").is_dir() and (out / "adapter_model.safetensors").is_file()


def test_resumed_4bit_run_equals_the_straight_run_bit_for_bit(tiny_model_dir, tmp_path, crash_before_step):
    data = _data(tmp_path, "sft")
    straight_out, resumed_out = tmp_path / "straight", tmp_path / "resumed"
    run_train(resume_config("sft", tiny_model_dir, data, straight_out, quantization_bit=4))
    with pytest.raises(Exception, match="killed before step"):
        run_train(resume_config("sft", tiny_model_dir, data, resumed_out, quantization_bit=4),
                  callbacks=[crash_before_step(CHECKPOINT_STEP + 1)])
    assert (resumed_out / f"checkpoint-{CHECKPOINT_STEP}" / "base_quantization.json").is_file()
    run_train(resume_config("sft", tiny_model_dir, data, resumed_out, quantization_bit=4))

    straight, resumed = _logged(straight_out), _logged(resumed_out)
    assert sorted(straight) == sorted(resumed) == list(range(1, STEPS + 1))
    assert straight == resumed  # loss, grad_norm, learning_rate: equal, not close
    assert len({straight[step]["loss"] for step in straight}) == STEPS
    straight_weights = load_file(straight_out / "adapter_model.safetensors")
    resumed_weights = load_file(resumed_out / "adapter_model.safetensors")
    assert straight_weights.keys() == resumed_weights.keys()
    assert all(torch.equal(resumed_weights[name], weight) for name, weight in straight_weights.items())
