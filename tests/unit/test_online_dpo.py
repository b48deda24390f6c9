"""Online DPO's pure pieces against hand-computed numbers: pairing by reward, beta per epoch, its keys."""

from __future__ import annotations

import pytest
import torch

from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.stages.online_dpo import OnlineDPOArguments, choose_pairs


def test_pairs_take_the_higher_reward_and_a_tie_goes_to_the_first():
    """B = 3, rows in pairs (2i, 2i + 1): rewards [1, 0.5 | 0, 2 | 2, 2].
    Prompt 0: 1 >= 0.5, chosen row 0, rejected 1; prompt 1: 0 < 2, chosen 3, rejected 2; prompt 2: tie 2 = 2,
    chosen 4 (the first), rejected 5."""
    chosen, rejected = choose_pairs(torch.tensor([1.0, 0.5, 0.0, 2.0, 2.0, 2.0]))
    assert chosen.tolist() == [0, 3, 4] and rejected.tolist() == [1, 2, 5]


def test_beta_is_one_value_or_one_per_epoch():
    """TRL's `beta` list: epoch e takes beta[e], the last one after the list ends."""
    assert OnlineDPOArguments().beta == 0.1  # TRL's default [0.1] is kept as 0.1, as TRL keeps it
    args = OnlineDPOArguments(beta=[0.3, 0.2])
    assert [args.beta_at(e) for e in (0.0, 0.99, 1.0, 5.5)] == [0.3, 0.3, 0.2, 0.2]
    assert parse_config({"stage": "online_dpo", "reward_funcs": "accuracy", "beta": "0.3,0.2"}).method.beta == \
        [0.3, 0.2]
    with pytest.raises(ConfigError, match="must be > 0"):
        OnlineDPOArguments(beta=[0.1, 0.0])
    with pytest.raises(ConfigError, match="missing_eos_penalty=-1.0 must be > 0"):
        OnlineDPOArguments(missing_eos_penalty=-1.0)


def test_a_run_needs_reward_functions_and_trains_only():
    with pytest.raises(ConfigError, match="stage online_dpo needs reward_funcs"):
        parse_config({"stage": "online_dpo"})
    with pytest.raises(ConfigError, match="stage online_dpo trains only"):
        parse_config({"stage": "online_dpo", "reward_funcs": "accuracy", "do_eval": True, "eval_dataset": "x"})
