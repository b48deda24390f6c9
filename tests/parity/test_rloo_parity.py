"""Parity with TRL 1.16's RLOOTrainer, on the GRPO harness (`test_grpo_parity.py`): the same tiny model, prompts,
injected completions and reward functions, SGD for two steps → the same loss and metrics within 1e-5.

Covered: the KL folded into the reward (`beta` 0 and TRL's default 0.05), `num_iterations` 1 and 2 (the second
trains on old log-probs after an update, so the clip shares move), `normalize_advantages` and
`reward_clip_range`.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from alignkit.stages.rloo import RLOOTrainer
from tests.parity.test_grpo_parity import _assert_runs_match, _no_collect_per_train

pytestmark = pytest.mark.parity
trl = pytest.importorskip("trl")
_no_collect_per_train = _no_collect_per_train  # the harness's autouse fixture, used here too

METRICS = ("loss", "reward", "reward_std", "frac_reward_zero_std", "rewards/token_sum/mean", "rewards/token_sum/std",
           "rewards/even_length/mean", "rewards/even_length/std", "completions/mean_length",
           "completions/min_length", "completions/max_length", "completions/clipped_ratio",
           "completions/mean_terminated_length", "completions/min_terminated_length",
           "completions/max_terminated_length", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
           "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")


@pytest.mark.parametrize("method", [
    {"beta": 0.0, "num_iterations": 1},
    {"beta": 0.05, "num_iterations": 1},
    {"beta": 0.0, "num_iterations": 2},
    {"beta": 0.05, "num_iterations": 2, "normalize_advantages": True, "reward_clip_range": [0.5, 2.5]},
], ids=["beta0-it1", "beta0.05-it1", "beta0-it2", "beta0.05-it2-normalized-clipped"])
def test_loss_and_metrics_match_trl(method, tiny_model_dir, tmp_path, monkeypatch):
    _assert_runs_match(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path, monkeypatch, method,
                       stage="rloo", trainer_class=RLOOTrainer, metrics=METRICS)
