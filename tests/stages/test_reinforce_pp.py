"""`advantage_estimator: reinforce_pp` (REINFORCE++, OpenRLHF's semantics) inside GRPO's trainer, on the tiny model
with the parity harness's injected completions (there is no TRL oracle for it; the estimator's arithmetic is
checked by hand in tests/unit/test_rl_policy_terms.py)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from alignkit.rl.advantages import reinforce_pp_advantages
from tests.helpers import Injector
from tests.parity.test_grpo_parity import _completions, _no_collect_per_train, _run_ours

_no_collect_per_train = _no_collect_per_train  # skip Trainer's per-train gc.collect, as the harness does


def test_reinforce_pp_trains_on_whitened_token_advantages(tiny_model_dir, tmp_path, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    logs, trainer = _run_ours(tiny_model_dir, tokenizer, Injector(_completions(tokenizer)), tmp_path, monkeypatch,
                              return_trainer=True, advantage_estimator="reinforce_pp", beta=0.04, num_iterations=1)
    assert sorted(logs) == [1, 2] and all(math.isfinite(logs[s]["loss"]) for s in logs)
    assert all(math.isfinite(logs[s]["kl"]) for s in logs)  # the rollout's k1 KL is logged
    assert logs[2]["kl"] != 0  # after one update the policy has left the reference
    (batch,) = trainer._buffer  # steps_per_generation 1: the last generation batch is one slice
    advantages, mask = batch["advantages"], batch["completion_mask"].float()
    assert advantages.shape == mask.shape  # one advantage per token
    # Whitened over every response token of the batch (one process: the batch), 0 elsewhere.
    count = mask.sum()
    mean = (advantages * mask).sum() / count
    variance = ((advantages - mean) ** 2 * mask).sum() / count
    assert mean.item() == pytest.approx(0.0, abs=1e-5) and variance.item() == pytest.approx(1.0, abs=1e-4)
    assert (advantages * (1 - mask)).abs().max().item() == 0.0
    # The KL rode in the reward: the same rollout with kl_coef 0 gives other advantages.
    scores = torch.zeros(mask.shape[0])
    with_kl, _ = reinforce_pp_advantages(scores, batch["old_logps"], batch["ref_logps"], mask, 0.04)
    without_kl, _ = reinforce_pp_advantages(scores, batch["old_logps"], batch["ref_logps"], mask, 0.0)
    assert not torch.allclose(with_kl, without_kl)


def test_reinforce_pp_without_kl_runs_no_scoring_pass(tiny_model_dir, tmp_path, monkeypatch):
    """beta 0 (GRPO's default): the KL reward is 0 whatever the log-probs, so the round runs no no-grad scoring pass
    (`old_logps` is not computed) and the advantages are the whitened returns of the scores alone."""
    import alignkit.stages.grpo as grpo

    passes = []
    original = grpo.completion_logps
    monkeypatch.setattr(grpo, "completion_logps",
                        lambda *a, **k: passes.append(torch.is_grad_enabled()) or original(*a, **k))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    logs, trainer = _run_ours(tiny_model_dir, tokenizer, Injector(_completions(tokenizer)), tmp_path, monkeypatch,
                              return_trainer=True, advantage_estimator="reinforce_pp", beta=0.0, num_iterations=1)
    assert sorted(logs) == [1, 2] and all(math.isfinite(logs[s]["loss"]) for s in logs)
    assert passes and all(passes)  # the training forwards only
    (batch,) = trainer._buffer
    assert "old_logps" not in batch and "ref_logps" not in batch
    advantages, mask = batch["advantages"], batch["completion_mask"].float()
    count = mask.sum()
    mean = (advantages * mask).sum() / count
    assert mean.item() == pytest.approx(0.0, abs=1e-5)
    assert (((advantages - mean) ** 2 * mask).sum() / count).item() == pytest.approx(1.0, abs=1e-4)
    # What the scoring pass would have fed in changes nothing at beta 0.
    scores = torch.linspace(-1.0, 2.0, mask.shape[0])
    logps = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(reinforce_pp_advantages(scores, logps, logps, mask, 0.0)[0],
                       reinforce_pp_advantages(scores, torch.zeros_like(logps), torch.zeros_like(logps), mask, 0.0)[0])
