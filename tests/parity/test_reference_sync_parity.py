"""`sync_ref_model`: alignkit's `ReferenceSync` leaves the reference where TRL 1.16's `SyncRefModelCallback` does,
on a tiny model (the policy perturbed, so every weight differs from the reference)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerControl, TrainerState, TrainingArguments

from alignkit.callbacks import ReferenceSync

pytest.importorskip("trl")


def test_reference_after_two_syncs_equals_trl(tiny_model_dir, tmp_path):
    from trl.trainer.callbacks import SyncRefModelCallback

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ours, theirs = copy.deepcopy(policy), copy.deepcopy(policy)
    generator = torch.Generator().manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    sync = ReferenceSync(ours, alpha=0.6, sync_steps=1)
    for step in (1, 2):
        with torch.no_grad():
            for param in policy.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
        sync.on_step_end(args, TrainerState(global_step=step), TrainerControl(), model=policy)
        SyncRefModelCallback._sync_target_model(policy, theirs, 0.6)  # its path without DeepSpeed ZeRO-3
    for (name, a), (_, b), (_, p) in zip(ours.named_parameters(), theirs.named_parameters(),
                                         policy.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name
        assert not torch.allclose(a, p), name  # a mix, not a copy
