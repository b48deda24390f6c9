"""`sync_ref_model` (TR-DPO, TRL's keys): the mixing rule by hand, the callback's schedule and checkpoint, and the
configs refused before anything loads."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from alignkit.callbacks import ReferenceSync, mix_into_reference
from alignkit.errors import ConfigError
from tests.helpers import tiny_config


def test_mix_into_reference_by_hand():
    """alpha 0.6: [0.6 * 1 + 0.4 * 3, 0.6 * 2 + 0.4 * 5] = [1.8, 3.2]; alpha 1 copies, alpha 0 keeps."""
    reference = torch.tensor([3.0, 5.0])
    out = mix_into_reference(torch.tensor([1.0, 2.0]), reference, 0.6)
    assert out is reference and torch.allclose(reference, torch.tensor([1.8, 3.2]))
    assert torch.equal(mix_into_reference(torch.tensor([7.0]), torch.tensor([9.0]), 1.0), torch.tensor([7.0]))
    assert torch.equal(mix_into_reference(torch.tensor([7.0]), torch.tensor([9.0]), 0.0), torch.tensor([9.0]))


def _linear(value: float) -> torch.nn.Linear:
    layer = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(value)
    return layer


def test_callback_mixes_every_sync_steps_steps(tmp_path):
    """Policy weight 1 then 2 at steps 1..4, reference 10, alpha 0.5, every 2 steps: step 2 mixes in 1 -> 5.5;
    step 4 mixes in 2 -> 0.5 * 2 + 0.5 * 5.5 = 3.75; steps 1 and 3 leave it."""
    policy, reference = _linear(1.0), _linear(10.0)
    sync = ReferenceSync(reference, alpha=0.5, sync_steps=2)
    args, state, control = TrainingArguments(output_dir=str(tmp_path), report_to=[]), TrainerState(), TrainerControl()
    seen = []
    for step, weight in zip(range(1, 5), (1.0, 1.0, 2.0, 2.0)):
        with torch.no_grad():
            policy.weight.fill_(weight)
        state.global_step = step
        sync.on_step_end(args, state, control, model=policy)
        seen.append(reference.weight.item())
    assert seen == [10.0, 5.5, 5.5, 3.75]


def test_the_reference_is_saved_with_a_checkpoint_and_restored_on_resume(tmp_path):
    args, control = TrainingArguments(output_dir=str(tmp_path), report_to=[]), TrainerControl()
    state = TrainerState(global_step=2)
    (tmp_path / "checkpoint-2").mkdir()
    ReferenceSync(_linear(4.25), 0.6, 2).on_save(args, state, control)
    restored = _linear(0.0)
    ReferenceSync(restored, 0.6, 2).on_train_begin(args, state, control)
    assert restored.weight.item() == 4.25
    with pytest.raises(FileNotFoundError, match="checkpoint-4"):
        ReferenceSync(restored, 0.6, 2).on_train_begin(args, TrainerState(global_step=4), control)


@pytest.mark.parametrize("keys, message", [
    ({"stage": "dpo"}, "finetuning_type=lora: the reference of a LoRA policy is the same weights with the adapter "
                       "disabled"),
    ({"stage": "grpo", "finetuning_type": "full"}, "uses no reference model with beta=0"),
    ({"stage": "rloo", "finetuning_type": "lora"}, "no separate reference model"),
    ({"stage": "dpo", "finetuning_type": "full", "pref_loss": "orpo"}, "pref_loss=orpo"),
    ({"stage": "dpo", "finetuning_type": "full", "precompute_ref_log_probs": True}, "would be stale"),
    ({"stage": "dpo", "finetuning_type": "full", "ref_model_mixup_alpha": 1.5}, r"must be in \[0, 1\]"),
    ({"stage": "grpo", "finetuning_type": "full", "beta": 0.04, "ref_model_sync_steps": 0}, "at least 1"),
])
def test_configs_without_a_reference_to_sync_are_refused_when_parsed(keys, message):
    rewards = {} if keys["stage"] == "dpo" else {"reward_funcs": ["length"]}
    with pytest.raises(ConfigError, match=message):
        tiny_config(sync_ref_model=True, **rewards, **keys)


def test_trl_names_and_defaults():
    for stage, extra in (("dpo", {}), ("grpo", {"reward_funcs": ["length"]}), ("rloo", {"reward_funcs": ["length"]})):
        method = tiny_config(stage=stage, **extra).method
        assert (method.sync_ref_model, method.ref_model_mixup_alpha, method.ref_model_sync_steps) == (False, 0.6, 512)
