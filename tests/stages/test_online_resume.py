"""Resumes of what this lane added to the online stages, on the parity harness's tiny model and injected completions:
- GRPO with `use_adaptive_entropy`: the coefficient and the entropy it last measured travel in
  `grpo_entropy_controller.json` (without them the resumed step would apply no bonus, the controller having
  measured nothing yet);
- RLOO resumed in the middle of a generation batch (`num_iterations: 2`) trains on the buffered batch, with its
  old log-probs and KL-folded advantages, as the uninterrupted run."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from alignkit.stages.grpo import ENTROPY_CONTROLLER_FILE
from alignkit.stages.rloo import RLOOTrainer
from tests.helpers import Injector
from tests.parity.test_grpo_parity import _completions, _no_collect_per_train, _run_ours

_no_collect_per_train = _no_collect_per_train  # skip Trainer's per-train gc.collect, as the harness does

ADAPTIVE = {"use_adaptive_entropy": True, "entropy_coef": 0.1, "entropy_target": 100.0, "entropy_coef_delta": 0.05,
            "num_iterations": 1, "save_strategy": "steps", "save_steps": 1}


def test_adaptive_entropy_state_resumes(tiny_model_dir, tmp_path, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    whole = _run_ours(tiny_model_dir, tokenizer, Injector(_completions(tokenizer)), tmp_path / "whole", monkeypatch,
                      **ADAPTIVE)
    checkpoint = tmp_path / "whole" / "ours" / "checkpoint-1"
    saved = json.loads((checkpoint / ENTROPY_CONTROLLER_FILE).read_text())
    assert saved["entropy_coef"] == pytest.approx(whole[1]["entropy_coef"]) == pytest.approx(0.15)
    resumed = _run_ours(tiny_model_dir, tokenizer, Injector(_completions(tokenizer)), tmp_path / "whole",
                        monkeypatch, resume_from_checkpoint=str(checkpoint), **ADAPTIVE)
    for key in ("loss", "entropy_coef", "policy_loss", "entropy"):
        assert resumed[2][key] == pytest.approx(whole[2][key], abs=1e-6), key


def test_rloo_resumes_mid_generation_batch(tiny_model_dir, tmp_path, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    method = {"beta": 0.05, "num_iterations": 2, "save_strategy": "steps", "save_steps": 1}
    rloo = {"stage": "rloo", "trainer_class": RLOOTrainer}
    whole = _run_ours(tiny_model_dir, tokenizer, Injector(_completions(tokenizer)), tmp_path / "whole", monkeypatch,
                      **rloo, **method)
    injector = Injector(_completions(tokenizer))
    resumed = _run_ours(tiny_model_dir, tokenizer, injector, tmp_path / "whole", monkeypatch,
                        resume_from_checkpoint=str(tmp_path / "whole" / "ours" / "checkpoint-1"), **rloo, **method)
    assert injector.calls == 0  # step 2 trains on the buffered batch: nothing is generated again
    for key in ("loss", "entropy", "clip_ratio/region_mean"):
        assert resumed[2][key] == pytest.approx(whole[2][key], abs=1e-6), key


def test_grpo_keeps_the_first_iterations_log_probs_and_resumes_with_them(tiny_model_dir, tmp_path, monkeypatch):
    """`num_iterations: 2` at beta 0, one micro-batch a step (so each generation batch's first iteration trains
    within the step that sampled it): no no-grad pass runs for the old log-probs; the first iteration's own, detached,
    are kept in the buffer, which a checkpoint taken after it carries, so step 2 resumed from checkpoint-1 trains
    with the ratios of the uninterrupted run (TRL's, within 1e-5: tests/parity/test_grpo_parity.py)."""
    import torch

    import alignkit.stages.grpo as grpo

    passes = []
    original = grpo.completion_logps
    monkeypatch.setattr(grpo, "completion_logps",
                        lambda *a, **k: passes.append(torch.is_grad_enabled()) or original(*a, **k))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    method = {"beta": 0.0, "num_iterations": 2, "save_strategy": "steps", "save_steps": 1}
    whole, trainer = _run_ours(tiny_model_dir, tokenizer, Injector(_completions(tokenizer)), tmp_path / "whole",
                               monkeypatch, return_trainer=True, **method)
    assert passes == [True, True]  # the two training forwards, no scoring pass
    (batch,) = trainer._buffer
    assert batch["old_logps"].shape == batch["completion_mask"].shape
    assert whole[2]["clip_ratio/region_mean"] > 0  # step 2's ratios are off 1: it read step 1's log-probs
    saved = torch.load(tmp_path / "whole" / "ours" / "checkpoint-1" / grpo.ROLLOUT_BUFFER_FILE, weights_only=True)
    torch.testing.assert_close(saved["slices"][0]["old_logps"], batch["old_logps"], rtol=0, atol=0)
    injector = Injector(_completions(tokenizer))
    resumed = _run_ours(tiny_model_dir, tokenizer, injector, tmp_path / "whole", monkeypatch,
                        resume_from_checkpoint=str(tmp_path / "whole" / "ours" / "checkpoint-1"), **method)
    assert injector.calls == 0
    for key in ("loss", "clip_ratio/region_mean"):
        assert resumed[2][key] == pytest.approx(whole[2][key], abs=1e-6), key
