"""`sync_ref_model` in DPO and GRPO runs on the tiny model (full fine-tuning keeps the separate reference): the
reference after training is the hand-mixed sequence of the policy's weights, and a resumed run continues with the
reference saved in its checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import TrainerCallback

from alignkit import callbacks as alignkit_callbacks
from alignkit.callbacks import read_log
from alignkit.train import run_train
from tests.helpers import tiny_config

ALPHA = 0.6


@pytest.fixture
def syncs(monkeypatch):
    """Every `ReferenceSync` the trainers build, in order."""
    made = []

    class Recorded(alignkit_callbacks.ReferenceSync):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(alignkit_callbacks, "ReferenceSync", Recorded)
    return made


class PolicyWeights(TrainerCallback):
    """The policy's weights at the start and after each step."""

    def __init__(self):
        self.steps = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.steps[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}


def _config(stage, tiny_model_dir, tmp_path, out, **keys):
    if stage == "dpo":
        rows = [{"prompt": f"Say {i}.", "chosen": f"{i}", "rejected": f"not {i}"} for i in range(4)]
        data = {"dataset": str(tmp_path / "pairs.jsonl"), "learning_rate": 5e-3}
    else:
        rows = [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
        data = {"dataset": str(tmp_path / "prompts.jsonl"), "reward_funcs": ["length"], "num_generations": 2,
                "max_completion_length": 4, "beta": 0.04, "learning_rate": 2e-2}
    (tmp_path / data["dataset"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tiny_config(tiny_model_dir, out, **{
        "stage": stage, "do_train": True, "finetuning_type": "full", "per_device_train_batch_size": 2,
        "lr_scheduler_type": "constant", "save_strategy": "no", "logging_steps": 1, "cutoff_len": 64, "seed": 0,
        "sync_ref_model": True, "ref_model_mixup_alpha": ALPHA, **data, **keys})


@pytest.mark.parametrize("stage", ["dpo", "grpo"])
def test_reference_is_the_policy_mixed_in_every_sync_steps(stage, tiny_model_dir, tmp_path, syncs):
    """3 steps, a sync every 2: the reference ends as 0.6 x policy after step 2 + 0.4 x policy at step 0, whatever
    step 3 did."""
    weights = PolicyWeights()
    run_train(_config(stage, tiny_model_dir, tmp_path, tmp_path / "out", max_steps=3, ref_model_sync_steps=2),
              callbacks=[weights])
    [sync] = syncs
    for name, ref in sync.ref_model.named_parameters():
        expected = ALPHA * weights.steps[2][name] + (1 - ALPHA) * weights.steps[0][name]
        assert torch.allclose(ref, expected, atol=1e-6, rtol=0), name
    moved = [n for n, ref in sync.ref_model.named_parameters() if not torch.equal(ref, weights.steps[0][n])]
    assert moved and not torch.equal(weights.steps[3][moved[0]], weights.steps[2][moved[0]])


def test_resumed_run_continues_with_the_synced_reference(tiny_model_dir, tmp_path, syncs, crash_before_step):
    """DPO, a sync every step, a checkpoint at step 2: the run killed before step 3 and resumed logs the same
    losses and ends with the same reference as the straight run."""
    keys = dict(max_steps=4, ref_model_sync_steps=1, save_strategy="steps", save_steps=2)
    run_train(_config("dpo", tiny_model_dir, tmp_path, tmp_path / "straight", **keys))
    with pytest.raises(Exception, match="killed before step"):
        run_train(_config("dpo", tiny_model_dir, tmp_path, tmp_path / "resumed", **keys),
                  callbacks=[crash_before_step(3)])
    assert (tmp_path / "resumed" / "checkpoint-2" / "reference_model.safetensors").is_file()
    run_train(_config("dpo", tiny_model_dir, tmp_path, tmp_path / "resumed", **keys))
    straight, _, resumed = syncs

    def losses(out):
        return {r["current_steps"]: r["loss"] for r in read_log(out) if "loss" in r}

    assert losses(tmp_path / "resumed") == pytest.approx(losses(tmp_path / "straight"), abs=1e-6)
    for (name, a), (_, b) in zip(straight.ref_model.named_parameters(), resumed.ref_model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name
