"""The policy terms, masks and estimators GRPO's other loss types and RLOO add to `alignkit.rl`, against numbers
worked out by hand in each docstring (TRL 1.16's GRPOTrainer / RLOOTrainer are the parity oracle in tests/parity)."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.rl.advantages import (ADVANTAGE_ESTIMATORS, decoupled_group_advantages, leave_one_out_advantages,
                                     reinforce_pp_advantages)
from alignkit.rl.kl import sequence_log_ratio
from alignkit.rl.losses import (
    LOSS_TYPES,
    AdaptiveEntropyController,
    aggregate_loss,
    cispo_loss,
    clipped_surrogate,
    entropy_bonus,
    high_entropy_mask,
    importance_log_weights,
    off_policy_sequence_mask,
    sapo_loss,
    vespo_weights,
)


def test_trl_116_has_these_eight_loss_types():
    assert LOSS_TYPES == ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


def test_importance_log_weights_token_and_sequence():
    """Row 1 counts 2 tokens: (0.2 + 0.4) / 2 = 0.3; row 2 counts 1: 0.3. Token level: unchanged."""
    log_ratio = torch.tensor([[0.2, 0.4, 9.0], [0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(importance_log_weights(log_ratio, mask, "sequence"), torch.tensor([[0.3], [0.3]]))
    assert importance_log_weights(log_ratio, mask, "token") is log_ratio
    with pytest.raises(ValueError, match="token or sequence"):
        importance_log_weights(log_ratio, mask, "word")


def test_clipped_surrogate_two_sided_delta():
    """eps 0.2, A = -1: ratio 3 → -min(-3, -1.2) = 3; with delta 2 the unclipped ratio is capped: -min(-2, -1.2) = 2.
    Ratio 0.5, A = -1: delta does not act below it: 0.8."""
    logps = torch.log(torch.tensor([[3.0, 0.5]]))
    old = torch.zeros(1, 2)
    advantages = torch.tensor([-1.0])
    loss, _ = clipped_surrogate(logps, old, advantages, 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 0.8]]))
    loss, _ = clipped_surrogate(logps, old, advantages, 0.2, 0.2, delta=2.0)
    torch.testing.assert_close(loss, torch.tensor([[2.0, 0.8]]))


def test_clipped_surrogate_sequence_level_is_gspo():
    """log-ratios [ln 1.5, ln 1.5 | ln 0.5 masked]: the sequence ratio is exp(ln 1.5) = 1.5; A = 1, eps 0.2:
    -min(1.5, 1.2) = -1.2, one value for the row."""
    logps = torch.log(torch.tensor([[1.5, 1.5, 0.5]]))
    mask = torch.tensor([[1, 1, 0]])
    loss, ratio = clipped_surrogate(logps, torch.zeros(1, 3), torch.tensor([1.0]), 0.2, 0.2, mask=mask,
                                    importance_sampling_level="sequence")
    torch.testing.assert_close(ratio, torch.tensor([[1.5]]))
    torch.testing.assert_close(loss, torch.tensor([[-1.2]]))


def test_cispo_caps_the_weight_and_keeps_the_gradient():
    """ratio [0.5, 6], A = 2, logps [-1, -2], cap 5: weights [0.5, 5], loss -w A logp = [1, 20];
    d loss / d logp = -w A = [-1, -10], through the log-probs only."""
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ratio = torch.tensor([[0.5, 6.0]], requires_grad=True)
    loss = cispo_loss(logps, ratio, torch.tensor([2.0]), 5.0)
    torch.testing.assert_close(loss, torch.tensor([[1.0, 20.0]]))
    loss.sum().backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, -10.0]]))
    assert ratio.grad is None


def test_sapo_soft_gate():
    """ratio 1, A = 1, tau_pos 1: -sigmoid(0) x 4 / 1 x 1 = -2. ratio 2, A = -1, tau_neg 2: sigmoid(2) = 0.880797,
    loss = 0.880797 x 4 / 2 = 1.761594."""
    loss = sapo_loss(torch.tensor([[1.0], [2.0]]), torch.tensor([1.0, -1.0]), 1.0, 2.0)
    torch.testing.assert_close(loss, torch.tensor([[-2.0], [1.761594]]))


def test_vespo_gamma_weights():
    """Row 1: log-ratios 0.1 + 0.1 = 0.2, w = e^0.2 = 1.221403, A = 1 (k 2, lambda 3):
    phi = exp(3 + 2 x 0.2 - 3 x 1.221403) = exp(-0.264208) = 0.767818.
    Row 2: log w = 0 (w = 1), A = -1 (k 3, lambda 2): phi = exp(2 + 0 - 2) = 1.
    Row 3: masked token ignored, log w = -0.5, w = 0.606531, A = -1:
    phi = exp(2 - 1.5 - 1.213061) = exp(-0.713061) = 0.490141."""
    log_ratio = torch.tensor([[0.1, 0.1], [0.0, 0.0], [-0.5, 7.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    phi = vespo_weights(log_ratio, mask, torch.tensor([1.0, -1.0, -1.0]), 2.0, 3.0, 3.0, 2.0)
    torch.testing.assert_close(phi, torch.tensor([[0.767818], [1.0], [0.490141]]))


def test_off_policy_sequence_mask():
    """A [1, -1, -1], mean (sampling - logps) per row [2, 0.1, 0.9] (row 3's masked token left out),
    threshold 0.5: keep a positive advantage whatever its KL, drop the negative one over 0.5 → [1, 1, 0]."""
    logps = torch.zeros(3, 2)
    sampling = torch.tensor([[2.0, 2.0], [0.1, 0.1], [0.9, -50.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    keep = off_policy_sequence_mask(torch.tensor([1.0, -1.0, -1.0]), logps, sampling, mask, 0.5)
    assert keep.tolist() == [[1], [1], [0]]


def test_high_entropy_mask():
    """Entropies [1, 2, 3, 4]; keep the top half: the 0.5 quantile is 2.5, so tokens 3 and 4. Masked tokens never
    count; 1.0 keeps every counted token; 0.0 only the highest."""
    entropies = torch.tensor([[1.0, 2.0, 3.0, 4.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert high_entropy_mask(entropies, mask, 0.5).tolist() == [[False, False, True, True, False]]
    assert high_entropy_mask(entropies, mask, 1.0).tolist() == [[True, True, True, True, False]]
    assert high_entropy_mask(entropies, mask, 0.0).tolist() == [[False, False, False, True, False]]
    # The threshold comes from every process's tokens when given: quantile 0.5 of [1, 2, 3, 4, 10, 20] = 3.5.
    everyone = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 20.0])
    assert high_entropy_mask(entropies, mask, 0.5, all_entropies=everyone).tolist() == [[False] * 3 + [True, False]]


def test_entropy_bonus_and_adaptive_controller():
    """Bonus: (1 + 3 + 2) / 3 counted tokens = 2, / k = 2 → 1.
    Controller (coef 0.1, target 0.5, delta 0.05): nothing measured → applies 0; entropy 0.4 <= 0.5 → coef 0.15,
    applied; entropy 0.9 → coef 0.1, not applied (0); bounds hold."""
    assert entropy_bonus(torch.tensor([[1.0, 3.0], [2.0, 9.0]]), torch.tensor([[1, 1], [1, 0]]), 2).item() == 1.0
    controller = AdaptiveEntropyController(0.1, 0.5, 0.05, 0.0, 0.12)
    assert controller.applied() == 0.0
    controller.update(0.4)
    assert controller.coef == pytest.approx(0.12) and controller.applied() == pytest.approx(0.12)  # capped at max
    controller.update(0.9)
    assert controller.coef == pytest.approx(0.07) and controller.applied() == 0.0
    restored = AdaptiveEntropyController(0.0, 0.5, 0.05, 0.0, 1.0)
    restored.load_state_dict(controller.state_dict())
    assert (restored.coef, restored.last_entropy) == (controller.coef, 0.9)


LOSSES = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
MASK = torch.tensor([[1, 1], [1, 0]])


@pytest.mark.parametrize("loss_type, kwargs, expected", [
    ("sapo", {}, ((1.5 + 3.0) / 2) / 2),             # as grpo
    ("luspo", {}, ((3.0 + 3.0) / 2) / 2),            # row sums 3 and 3, their mean, / k
    ("cispo", {"generation_tokens": 6, "steps_per_generation": 2}, 6 / (6 * 2 / 2)),   # as dapo
    ("vespo", {"generation_tokens": 6, "steps_per_generation": 2}, 6 / (6 * 2 / 2)),
])
def test_aggregate_loss_new_types_by_hand(loss_type, kwargs, expected):
    assert aggregate_loss(LOSSES, MASK, loss_type, accumulation_steps=2, **kwargs).item() == pytest.approx(expected)


def test_aggregate_loss_broadcasts_a_sequence_term():
    """A `[B, 1]` term (GSPO) counts once per token: [[2], [3]] over masks of 2 and 1 tokens, luspo: (4 + 3) / 2."""
    assert aggregate_loss(torch.tensor([[2.0], [3.0]]), MASK, "luspo").item() == pytest.approx(3.5)


def test_decoupled_group_advantages():
    """G = 2, one function: [1, 3 | 5, 5] → z = [-2 / 2.8285, 2 / 2.8285 ... ] per group: group 1 mean 2, std
    sqrt(2) → ±1 / 1.41431 = ±0.70706; group 2: 0, 0. Batch: mean 0, sample std sqrt(2 x 0.70706^2 / 3) = 0.57731,
    A = ±0.70706 / 0.57741 = ±1.22455. Two functions weigh their z's: weights [1, 2] with the second [0, 0, 1, 1]
    (z 0 everywhere) leave the same; a row no function scored gets 0."""
    per_function = torch.tensor([[1.0], [3.0], [5.0], [5.0]])
    advantages, std_is_zero = decoupled_group_advantages(per_function, torch.tensor([1.0]), 2)
    torch.testing.assert_close(advantages, torch.tensor([-1.22455, 1.22455, 0.0, 0.0]), atol=1e-4, rtol=0)
    assert not std_is_zero.any()
    two = torch.tensor([[1.0, 0.0], [3.0, 0.0], [5.0, 1.0], [5.0, 1.0]])
    torch.testing.assert_close(decoupled_group_advantages(two, torch.tensor([1.0, 2.0]), 2)[0], advantages)
    unscored = torch.tensor([[1.0], [3.0], [float("nan")], [5.0]])
    assert decoupled_group_advantages(unscored, torch.tensor([1.0]), 2)[0][2].item() == 0.0


def test_leave_one_out_advantages():
    """G = 3: [1, 2, 6] → baselines (8 / 2, 7 / 2, 3 / 2) = (4, 3.5, 1.5), A = [-3, -1.5, 4.5].
    With NaN: [1, NaN, 3] → baselines (3, -, 1), A = [-2, 0, 2]. Normalised: A [-3, -1.5, 4.5] has mean 0 and
    sample std sqrt((9 + 2.25 + 20.25) / 2) = 3.968627 → A / 3.968727."""
    advantages, std_is_zero = leave_one_out_advantages(torch.tensor([1.0, 2.0, 6.0]), 3)
    torch.testing.assert_close(advantages, torch.tensor([-3.0, -1.5, 4.5]))
    assert std_is_zero.tolist() == [False]
    torch.testing.assert_close(leave_one_out_advantages(torch.tensor([1.0, math.nan, 3.0]), 3)[0],
                               torch.tensor([-2.0, 0.0, 2.0]))
    normalised, _ = leave_one_out_advantages(torch.tensor([1.0, 2.0, 6.0]), 3, normalize_advantages=True)
    torch.testing.assert_close(normalised, torch.tensor([-3.0, -1.5, 4.5]) / (3.968627 + 1e-4))
    # A group of equal rewards: zero advantages, flagged.
    flat, flagged = leave_one_out_advantages(torch.tensor([2.0, 2.0]), 2)
    assert flat.tolist() == [0.0, 0.0] and flagged.tolist() == [True]
    assert ADVANTAGE_ESTIMATORS["leave_one_out"] is leave_one_out_advantages


def test_sequence_log_ratio():
    """logps [-1, -2, -3], ref [-1.5, -1, 0], mask [1, 1, 0]: per token [0.5, -1, 0], summed -0.5 (k1 may be < 0)."""
    per_token, per_sequence = sequence_log_ratio(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -1.0, 0.0]]),
                                                 torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(per_token, torch.tensor([[0.5, -1.0, 0.0]]))
    torch.testing.assert_close(per_sequence, torch.tensor([-0.5]))


def test_rloo_config_defaults_are_trl_116():
    """Every RLOO key left unset has TRL 1.16 RLOOConfig's default; a bad clip range names the fix."""
    from trl import RLOOConfig

    from alignkit.config.parse import parse_config
    from alignkit.errors import ConfigError

    base = {"stage": "rloo", "dataset": "demo_math", "reward_funcs": "accuracy", "per_device_train_batch_size": 8}
    method = parse_config(base).method
    trl = RLOOConfig(output_dir="/tmp/unused", per_device_train_batch_size=8, use_cpu=True, bf16=False)
    for key in ("num_generations", "num_iterations", "max_completion_length", "temperature", "top_p", "top_k",
                "min_p", "repetition_penalty", "beta", "epsilon", "normalize_advantages", "disable_dropout",
                "vllm_mode",
                "reward_clip_range",
                "mask_truncated_completions", "shuffle_dataset", "use_vllm", "vllm_gpu_memory_utilization",
                "log_completions"):
        assert getattr(method, key) == getattr(trl, key), key
    with pytest.raises(ConfigError, match=r"\[min, max\]"):
        parse_config({**base, "reward_clip_range": [2, 1]})
    with pytest.raises(ConfigError, match="applies to stage grpo, not rloo"):
        parse_config({**base, "scale_rewards": "group"})


def test_reinforce_pp_advantages_by_hand():
    """kl_coef 0.1, gamma 1: scores [1, 0], logps [[-1, -2], [-1, -1]], ref [[-1.5, -1], [-1, -1]],
    mask [[1, 1], [1, 0]].
    k1 = [[0.5, -1], [0, -]], token rewards -0.1 x k1 = [[-0.05, 0.1], [0, -]], scores at the last tokens:
    [[-0.05, 1.1], [0, -]]; returns (sum to the end) [[1.05, 1.1], [0, -]].
    Whitened over the 3 tokens: mean 2.15 / 3 = 0.716667; deviations 0.333333, 0.383333, -0.716667; biased var
    (0.111111 + 0.146944 + 0.513611) / 3 = 0.257222, std 0.507171 → [[0.657241, 0.755827], [-1.413068, 0]].
    gamma 0.5: returns [[-0.05 + 0.55, 1.1], [0, -]] = [[0.5, 1.1], [0, -]], mean 0.533333, var 0.606667 / 3 =
    0.202222, std 0.449691 → [[-0.074125, 1.260119], [-1.185994, 0]]."""
    args = (torch.tensor([1.0, 0.0]), torch.tensor([[-1.0, -2.0], [-1.0, -1.0]]),
            torch.tensor([[-1.5, -1.0], [-1.0, -1.0]]), torch.tensor([[1, 1], [1, 0]]), 0.1)
    advantages, returns = reinforce_pp_advantages(*args)
    torch.testing.assert_close(returns, torch.tensor([[1.05, 1.1], [0.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.657241, 0.755827], [-1.413068, 0.0]]), atol=1e-5, rtol=0)
    discounted, _ = reinforce_pp_advantages(*args, gamma=0.5)
    torch.testing.assert_close(discounted, torch.tensor([[-0.074125, 1.260119], [-1.185994, 0.0]]), atol=1e-5, rtol=0)
    assert ADVANTAGE_ESTIMATORS["reinforce_pp"] is reinforce_pp_advantages


def test_reinforce_pp_whitens_over_every_process():
    """Rows split over two processes (reduce_sum adds both halves' sums) give the one-process advantages."""
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(4, generator=generator)
    logps, ref = torch.randn(4, 5, generator=generator), torch.randn(4, 5, generator=generator)
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    whole, _ = reinforce_pp_advantages(scores, logps, ref, mask, 0.05)
    halves = [(scores[i:i + 2], logps[i:i + 2], ref[i:i + 2], mask[i:i + 2]) for i in (0, 2)]

    def reduce_sum_over(part):
        """What the other process contributes: its own totals for the same quantity."""
        def reduce_sum(tensor):
            other = halves[1 - part]
            _, other_returns = reinforce_pp_advantages(*other, 0.05)
            other_mask = other[3].float()
            if tensor.dim() == 1:  # (sum, count)
                return tensor + torch.stack([(other_returns * other_mask).sum(), other_mask.sum()])
            mean = ((returns_all * mask.float()).sum() / mask.sum())
            return tensor + ((other_returns - mean) ** 2 * other_mask).sum()
        return reduce_sum

    _, returns_all = reinforce_pp_advantages(scores, logps, ref, mask, 0.05)
    split = torch.cat([reinforce_pp_advantages(*halves[p], 0.05, reduce_sum=reduce_sum_over(p))[0] for p in (0, 1)])
    torch.testing.assert_close(split, whole)
