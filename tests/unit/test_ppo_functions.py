"""PPO's pure functions against numbers worked out by hand (the arithmetic is in each docstring); the maths lives in
`alignkit.rl`, the length sampler and the forward in the stage."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.rl.advantages import ADVANTAGE_ESTIMATORS, gae_advantages
from alignkit.rl.kl import AdaptiveKLController, FixedKLController, kl_penalty_rewards
from alignkit.rl.losses import clipped_policy_loss, clipped_value_loss
from alignkit.rl.stats import RunningMoments, masked_mean, masked_var, masked_whiten
from alignkit.stages.ppo import sample_response_lengths, truncate_to_lengths


def test_masked_mean_and_var():
    """[2, 4, 6 | 99 masked]: mean 4; squared deviations 4, 0, 4: biased 8/3, unbiased 8/2 = 4."""
    values, mask = torch.tensor([2.0, 4.0, 6.0, 99.0]), torch.tensor([1, 1, 1, 0])
    assert masked_mean(values, mask).item() == pytest.approx(4.0)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(8 / 3)
    assert masked_var(values, mask).item() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="two response tokens"):
        masked_var(values, torch.tensor([0, 1, 0, 0]))


def test_masked_whiten():
    """std 2: (x - 4) / 2 = [-1, 0, 1], masked 0; shift_mean=False adds the mean 4 back: [3, 4, 5]."""
    values, mask = torch.tensor([[2.0, 4.0], [6.0, 99.0]]), torch.tensor([[1, 1], [1, 0]])
    torch.testing.assert_close(masked_whiten(values, mask), torch.tensor([[-1.0, 0.0], [1.0, 0.0]]))
    torch.testing.assert_close(masked_whiten(values, mask, shift_mean=False), torch.tensor([[3.0, 4.0], [5.0, 0.0]]))


def test_masked_whiten_over_processes():
    """Rows [2, 4] here and [6 | 99 masked] on another process: sums 6 + 6 over 2 + 1 tokens, mean 4;
    squared deviations 4 + 0 here and 4 there, unbiased var 8 / 2 = 4: this process's rows get [-1, 0]."""
    here, there = torch.tensor([[2.0, 4.0]]), torch.tensor([[6.0, 99.0]])
    here_mask, there_mask = torch.tensor([[1, 1]]), torch.tensor([[1, 0]])
    calls = []

    def reduce_sum(tensor):  # stands in for the all-reduce: adds the other process's matching sum
        other = [torch.stack([(there * there_mask).sum(), there_mask.sum().float()]),
                 ((there - 4.0) ** 2 * there_mask).sum()][len(calls)]
        calls.append(tensor)
        return tensor + other

    torch.testing.assert_close(masked_whiten(here, here_mask, reduce_sum=reduce_sum), torch.tensor([[-1.0, 0.0]]))
    assert len(calls) == 2


def test_kl_penalty_rewards_adds_score_at_last_token():
    """Row 1: kl = [-1 - -1.5, -2 - -1] = [0.5, -1]; rewards = -0.1 * kl + [0, 3] = [-0.05, 3.1], position 2
    masked. Row 2 ends at position 0: kl [0.25], reward -0.025 + (-1) = -1.025."""
    logps = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -9.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-0.75, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rewards, kl = kl_penalty_rewards(logps, ref, torch.tensor([3.0, -1.0]), mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [0.25, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 3.1, 0.0], [-1.025, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="at least one token"):
        kl_penalty_rewards(logps, ref, torch.zeros(2), torch.tensor([[1, 0, 0], [0, 0, 0]]), 0.1)


def test_gae_matches_hand_computation():
    """gamma 1, lam 0.5 (see `gae_advantages`' docstring for each step)."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0.125, 0.25, 0.5], [0.25, 1.5, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.625, 0.75, 1.0], [1.25, 2.0, 0.0]]))
    assert ADVANTAGE_ESTIMATORS["gae"] is gae_advantages  # what PPO looks up


def test_gae_discount():
    """gamma 0.5, lam 1, values 0, rewards [0, 4]: A_1 = 4, A_0 = 0 + 0.5 * 0 - 0 + 0.5 * 1 * 4 = 2."""
    advantages, returns = gae_advantages(torch.tensor([[0.0, 4.0]]), torch.zeros(1, 2), torch.ones(1, 2),
                                         gamma=0.5, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[2.0, 4.0]]))
    torch.testing.assert_close(returns, torch.tensor([[2.0, 4.0]]))


def test_clipped_policy_loss():
    """eps 0.2, A [1, -1, 2], ratio [1.5, 0.5, 1]: loss -0.8, clipfrac 2/3, approxkl 0.107476."""
    old = torch.zeros(1, 4)
    logps = torch.tensor([[math.log(1.5), math.log(0.5), 0.0, 5.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0, 2.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipfrac, approxkl = clipped_policy_loss(logps, old, advantages, mask, cliprange=0.2)
    assert loss.item() == pytest.approx(-0.8, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 3)
    assert approxkl.item() == pytest.approx(0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 3, abs=1e-6)
    loss.backward()
    # Clipped tokens and the masked one get no gradient; the third gets d/dlogp(-A * ratio)/3 = -2/3.
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, 0.0, -2 / 3, 0.0]]))


def test_clipped_value_loss():
    """c 0.2: v [1, 0], old [0.5, 0], R [2, 1] -> loss 0.6725, clipfrac 0.5."""
    values = torch.tensor([[1.0, 0.0, 3.0]])
    loss, clipfrac = clipped_value_loss(values, torch.tensor([[0.5, 0.0, 0.0]]), torch.tensor([[2.0, 1.0, 0.0]]),
                                        torch.tensor([[1, 1, 0]]), cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.6725)
    assert clipfrac.item() == pytest.approx(0.5)


def test_adaptive_kl_controller():
    """kl 9 (err clipped to 0.2): 0.2 * 1.00512 = 0.201024; kl 5.4 (err -0.1): * 0.99744 = 0.2005094."""
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(9.0, 256)
    assert ctl.value == pytest.approx(0.201024)
    ctl.update(5.4, 256)
    assert ctl.value == pytest.approx(0.201024 * 0.99744)
    ctl.update(-100.0, 256)  # err clipped to -0.2
    assert ctl.value == pytest.approx(0.201024 * 0.99744 * (1 - 0.2 * 256 / 10000))
    restored = AdaptiveKLController(0.2, 6.0, 10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 64)
    assert ctl.value == 0.05


def test_running_moments():
    """[1, 2, 3]: mean 2, std 1; + [5]: mean 2.75, std sqrt(8.75 / 3) = 1.707825."""
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 3.0]))
    assert (moments.mean, moments.std) == pytest.approx((2.0, 1.0))
    moments.update(torch.tensor([5.0]))
    assert moments.mean == pytest.approx(2.75)
    assert moments.std == pytest.approx(math.sqrt(8.75 / 3))
    assert moments.normalize(torch.tensor([2.75])).item() == pytest.approx(0.0)
    copy = RunningMoments()
    copy.load_state_dict(moments.state_dict())
    assert copy.state_dict() == moments.state_dict()


def test_truncate_to_lengths():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(truncate_to_lengths(mask, torch.tensor([2, 3])), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]))


def test_length_sampler_is_seeded_and_in_range():
    draws = sample_response_lengths(3, 6, 400, seed=7, step=2)
    assert draws.dtype == torch.long and draws.min().item() == 3 and draws.max().item() == 6  # both ends included
    assert set(draws.tolist()) == {3, 4, 5, 6}
    torch.testing.assert_close(draws, sample_response_lengths(3, 6, 400, seed=7, step=2))  # same (seed, step)
    assert not torch.equal(draws, sample_response_lengths(3, 6, 400, seed=7, step=3))
    assert not torch.equal(draws, sample_response_lengths(3, 6, 400, seed=8, step=2))
    assert sample_response_lengths(4, 4, 5, seed=0, step=0).tolist() == [4] * 5
    state = torch.get_rng_state()
    sample_response_lengths(1, 9, 3, seed=0, step=0)
    assert torch.equal(state, torch.get_rng_state())  # the global stream is untouched
    with pytest.raises(ValueError, match="low <= high"):
        sample_response_lengths(5, 4, 1, seed=0, step=0)


def test_pack_right():
    """prompt [pad, 5, 6], response [7, 8] with mask [1, 0] -> [5, 6, 7, pad, pad], labels only on 7."""
    from alignkit.stages.ppo import pack_right

    ids, mask, labels = pack_right(torch.tensor([[0, 5, 6], [4, 5, 6]]), torch.tensor([[0, 1, 1], [1, 1, 1]]),
                                   torch.tensor([[7, 8], [9, 3]]), torch.tensor([[1, 0], [1, 1]]), pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7, 0, 0], [4, 5, 6, 9, 3]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert labels.tolist() == [[-100, -100, 7, -100, -100], [-100, -100, -100, 9, 3]]


@pytest.mark.parametrize("padding_free", [False, True])
def test_policy_forward_equals_forward_token_logps_and_the_decoder(padding_free, tiny_model_dir):
    """One call of the whole model gives the log-probs the model's own forward gives, and hands back the decoder's
    last hidden states (what `last_hidden_states` returns) for the value head."""
    from transformers import AutoModelForCausalLM

    from alignkit.model.heads import last_hidden_states
    from alignkit.model.logprobs import forward_token_logps
    from alignkit.stages.ppo import pack_right, policy_forward

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids, mask, labels = pack_right(torch.tensor([[0, 0, 5, 6], [4, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1], [1] * 4]),
                                   torch.tensor([[7, 8, 9], [9, 3, 2]]), torch.tensor([[1, 1, 0], [1, 1, 1]]),
                                   pad_token_id=2)
    calls = []
    with torch.no_grad():
        ours, hidden, flat = policy_forward(model, ids, mask, labels, padding_free=padding_free,
                                            call=lambda **kwargs: calls.append(kwargs) or model(**kwargs))
        theirs, labelled = forward_token_logps(model, ids, mask, labels)
        decoder_hidden, decoder_flat = last_hidden_states(model, ids, mask, padding_free=padding_free)
    assert len(calls) == 1  # through `call`, once
    assert labelled.sum().item() == 5
    torch.testing.assert_close(ours, theirs * labelled, rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden, decoder_hidden, rtol=0, atol=1e-6)
    assert (flat is None) == (decoder_flat is None) == (not padding_free)
