"""RLOO's rollout inside GRPO's trainer, on the tiny model with the parity harness's injected completions (the loss
and metrics against TRL are in tests/parity/test_rloo_parity.py): which no-grad scoring passes a round runs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import alignkit.stages.grpo as grpo
import alignkit.stages.rloo as rloo
from alignkit.stages.rloo import RLOOTrainer
from tests.helpers import Injector
from tests.parity.test_grpo_parity import _completions, _no_collect_per_train, _run_ours

_no_collect_per_train = _no_collect_per_train  # skip Trainer's per-train gc.collect, as the harness does


@pytest.mark.parametrize("beta, scoring_passes", [(0.0, 0), (0.05, 2)])
def test_scoring_passes_follow_the_kl(beta, scoring_passes, tiny_model_dir, tmp_path, monkeypatch):
    """With the KL folded into the reward (beta 0.05, TRL's default) a round scores the batch twice without
    gradients (the policy's old log-probs and the reference's); with beta 0 and one iteration neither runs, and
    the slice's own forward stands in for the old log-probs (ratio 1, so no completion is clipped)."""
    passes = []
    original = grpo.completion_logps

    def counted(*args, **kwargs):
        passes.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo, "completion_logps", counted)
    monkeypatch.setattr(rloo, "completion_logps", counted)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    logs, trainer = _run_ours(tiny_model_dir, tokenizer, Injector(_completions(tokenizer)), tmp_path, monkeypatch,
                              stage="rloo", trainer_class=RLOOTrainer, return_trainer=True, beta=beta,
                              num_iterations=1)
    rounds = len(logs)
    assert passes.count(False) == scoring_passes * rounds and passes.count(True) == rounds
    (batch,) = trainer._buffer
    assert ("old_logps" in batch) == (beta != 0)
    if beta == 0:
        assert all(logs[step]["clip_ratio/region_mean"] == 0 for step in logs)
