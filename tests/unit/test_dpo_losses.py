"""DPO-family losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.stages.dpo import (
    _log1mexp,
    f_divergence_scores,
    hinge_loss,
    ipo_loss,
    orpo_loss,
    preference_loss,
    chosen_nll_loss,
    sigmoid_loss,
    simpo_loss,
)

T = torch.tensor


def test_sigmoid_loss():
    """Pair 1: h = (-1 - -2) - (-3 - -2) = 1 - (-1) = 2; beta*h = 0.5*2 = 1; -log sigmoid(1) = log(1 + e^-1) = 0.3132617.
    Pair 2: policy == reference, h = 0: -log sigmoid(0) = log 2 = 0.6931472.
    Label smoothing 0.1 on pair 1: 0.9 * 0.3132617 + 0.1 * -log sigmoid(-1) = 0.9 * 0.3132617 + 0.1 * 1.3132617 = 0.4132617.
    """
    args = (T([-1.0, -2.0]), T([-3.0, -2.0]), T([-2.0, -2.0]), T([-2.0, -2.0]))
    assert sigmoid_loss(*args, beta=0.5).tolist() == pytest.approx([0.3132617, 0.6931472], abs=1e-6)
    assert sigmoid_loss(*args, beta=0.5, label_smoothing=0.1)[0].item() == pytest.approx(0.4132617, abs=1e-6)


def test_beta_scales_the_difference_not_only_the_chosen_term():
    """h = (0 - -1) - (0 - 0) = 1 with beta = 0.5: -log sigmoid(0.5) = log(1 + e^-0.5) = 0.4740770.
    (`beta * chosen_ratio - rejected_ratio` would give -log sigmoid(0.5 - 0) here too, so the rejected
    ratio is made non-zero in the second pair: h = (0 - 0) - (-2 - 0) = 2, loss = -log sigmoid(1) = 0.3132617,
    whereas beta * 0 - (-2) = 2 would give -log sigmoid(2) = 0.1269280.)
    """
    loss = sigmoid_loss(T([0.0, 0.0]), T([0.0, -2.0]), T([-1.0, 0.0]), T([0.0, 0.0]), beta=0.5)
    assert loss.tolist() == pytest.approx([0.4740770, 0.3132617], abs=1e-6)


def test_hinge_loss():
    """h = 2 (as above): beta 0.5 -> relu(1 - 1) = 0; beta 0.25 -> relu(1 - 0.5) = 0.5. h = 0 -> relu(1) = 1."""
    args = (T([-1.0, -2.0]), T([-3.0, -2.0]), T([-2.0, -2.0]), T([-2.0, -2.0]))
    assert hinge_loss(*args, beta=0.5).tolist() == pytest.approx([0.0, 1.0])
    assert hinge_loss(*args, beta=0.25).tolist() == pytest.approx([0.5, 1.0])


def test_ipo_loss_uses_per_token_average_log_ratios():
    """Chosen: (-4 - -6) / 2 tokens = 1; rejected: (-9 - -6) / 3 tokens = -1; h = 2.
    beta 0.5: (2 - 1/(2*0.5))^2 = (2 - 1)^2 = 1.  beta 0.25: (2 - 2)^2 = 0.  beta 1: (2 - 0.5)^2 = 2.25.
    """
    args = (T([-4.0]), T([-9.0]), T([-6.0]), T([-6.0]), T([2]), T([3]))
    assert ipo_loss(*args, beta=0.5).item() == pytest.approx(1.0)
    assert ipo_loss(*args, beta=0.25).item() == pytest.approx(0.0)
    assert ipo_loss(*args, beta=1.0).item() == pytest.approx(2.25)


def test_orpo_loss():
    """avg_c = ln 0.5: p = 0.5, odds = 1, log odds = 0.  avg_r = ln 0.25: p = 0.25, odds = 1/3.
    log odds ratio = 0 - ln(1/3) = ln 3; -log sigmoid(ln 3) = -ln(3/4) = 0.2876821.
    NLL = -ln 0.5 = 0.6931472; beta = 0.1: 0.6931472 + 0.1 * 0.2876821 = 0.7219154.
    """
    loss = orpo_loss(T([math.log(0.5)]), T([math.log(0.25)]), beta=0.1)
    assert loss.item() == pytest.approx(0.7219154, abs=1e-6)


def test_simpo_loss():
    """avg_c = -1, avg_r = -2, beta = 2, gamma = 0.5: 2 * (-1 - -2) - 0.5 = 1.5; -log sigmoid(1.5) = 0.2014133."""
    assert simpo_loss(T([-1.0]), T([-2.0]), beta=2.0, gamma=0.5).item() == pytest.approx(0.2014133, abs=1e-6)


def test_sft_loss_is_each_chosen_replys_mean_nll_per_token():
    """Summed log-probs -3 (2 tokens) and -5 (3 tokens): 3 / 2 = 1.5 and 5 / 3 = 1.667, one per pair (as
    LLaMA-Factory's pref_ftx; the batch mean of these is then taken with the preference losses)."""
    assert chosen_nll_loss(T([-3.0, -5.0]), T([2, 3])).tolist() == pytest.approx([1.5, 5 / 3])  # per pair: 3/2, 5/3


def test_log1mexp_is_accurate_at_both_ends():
    """log(1 - e^x): x = -1e-10 -> log(1e-10) = -23.0258509; x = -50 -> -e^-50 = -1.9287498e-22; x = ln 0.5 -> ln 0.5."""
    out = _log1mexp(T([-1e-10, -50.0, math.log(0.5)], dtype=torch.float64))
    assert out[0].item() == pytest.approx(-23.0258509, rel=1e-6)
    assert out[1].item() == pytest.approx(-1.9287498e-22, rel=1e-6)
    assert out[2].item() == pytest.approx(math.log(0.5))


def test_preference_loss_rewards():
    """Sigmoid, beta 0.5: rewards 0.5 * (-1 - -2) = 0.5 and 0.5 * (-3 - -2) = -0.5.
    SimPO, beta 2, summed -2 over 2 tokens and -6 over 3 tokens: averages -1 and -2, rewards -2 and -4,
    loss -log sigmoid(2 * 1 - 0.5) = 0.2014133.
    """
    lengths = (T([2]), T([3]))
    losses, chosen, rejected = preference_loss("sigmoid", T([-1.0]), T([-3.0]), *lengths, T([-2.0]), T([-2.0]),
                                               beta=0.5)
    assert (chosen.item(), rejected.item()) == pytest.approx((0.5, -0.5))
    assert losses.item() == pytest.approx(0.3132617, abs=1e-6)
    losses, chosen, rejected = preference_loss("simpo", T([-2.0]), T([-6.0]), *lengths, None, None,
                                               beta=2.0, simpo_gamma=0.5)
    assert (chosen.item(), rejected.item()) == pytest.approx((-2.0, -4.0))
    assert losses.item() == pytest.approx(0.2014133, abs=1e-6)
    with pytest.raises(ValueError, match="reference"):
        preference_loss("ipo", T([-1.0]), T([-3.0]), *lengths, None, None, beta=0.5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "orpo", "simpo"])
def test_gradient_raises_chosen_and_lowers_rejected(loss_type):
    """Descending each loss must push the chosen log-prob up and the rejected one down."""
    chosen = T([-6.0], requires_grad=True)
    rejected = T([-5.0], requires_grad=True)
    losses, _, _ = preference_loss(loss_type, chosen, rejected, T([3]), T([3]), T([-5.0]), T([-5.0]), beta=0.1)
    losses.sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()


# TRL 1.16's other DPO loss types. One pair unless stated: chosen -1 against reference -2 (c = 1), rejected -3
# against -2 (r = -1), so h = c - r = 2; replies of 2 and 4 tokens. log s(1) = -0.3132617, log s(-1) = -1.3132617.
ONE_PAIR = (T([-1.0]), T([-3.0]), T([2]), T([4]), T([-2.0]), T([-2.0]))


def _loss(loss_type, beta, **options):
    return preference_loss(loss_type, *ONE_PAIR, beta=beta, **options)[0]


@pytest.mark.parametrize(("loss_type", "beta", "options", "expected"), [
    # robust, eps 0.1, beta 0.5 (beta h = 1): (0.9 * 0.3132617 - 0.1 * 1.3132617) / (1 - 0.2) = 0.1882617
    ("robust", 0.5, {"label_smoothing": 0.1}, 0.1882617),
    # exo_pair, eps 0.1, beta 0.5: q = s(1) = 0.7310586; q (log q - log 0.9) + (1 - q) (log(1 - q) - log 0.1)
    # = 0.7310586 (-0.3132617 + 0.1053605) + 0.2689414 (-1.3132617 + 2.3025851) = 0.1140821
    ("exo_pair", 0.5, {"label_smoothing": 0.1}, 0.1140821),
    # nca_pair, beta 1: -log s(1) - log s(-1) / 2 - log s(1) / 2 = 0.3132617 + 0.6566309 + 0.1566309 = 1.1265234
    ("nca_pair", 1.0, {}, 1.1265234),
    # bco_pair, beta 1: -log s(1) - log s(-(-1)) = 2 * 0.3132617 = 0.6265234
    ("bco_pair", 1.0, {}, 0.6265234),
    # sppo_hard, beta 1: (1 - 0.5)^2 + (-1 + 0.5)^2 = 0.5
    ("sppo_hard", 1.0, {}, 0.5),
    # apo_zero, beta 1: 1 - s(1) + s(-1) = 1 - 0.7310586 + 0.2689414 = 0.5378828
    ("apo_zero", 1.0, {}, 0.5378828),
    # apo_down, beta 1: s(1) + 1 - s(1 - -1) = 0.7310586 + 1 - 0.8807971 = 0.8502615
    ("apo_down", 1.0, {}, 0.8502615),
    # discopop, beta 0.5 (z = 1), tau 1: m = s(1); (1 - m) * 0.3132617 + m * e^-1 = 0.0842491 + 0.2689414 = 0.3531905
    ("discopop", 0.5, {"discopop_tau": 1.0}, 0.3531905),
    # sigmoid_norm, beta 1: per-token scores 1/2 - (-1/4) = 0.75; -log s(0.75) = log(1 + e^-0.75) = 0.3868710
    ("sigmoid_norm", 1.0, {}, 0.3868710),
    # sigmoid and bco_pair weighted 0.8 / 0.2, beta 1: 0.8 * -log s(2) + 0.2 * 0.6265234 = 0.1015424 + 0.1253047
    (["sigmoid", "bco_pair"], 1.0, {"loss_weights": [0.8, 0.2]}, 0.2268471),
])
def test_trl_pair_losses_by_hand(loss_type, beta, options, expected):
    assert _loss(loss_type, beta, **options).item() == pytest.approx(expected, abs=1e-6)


def test_sft_loss_is_the_batch_token_mean_of_the_chosen_nll():
    """Chosen summed log-probs [-3, -6] over [1, 2] tokens: (3 + 6) / 3 = 3 for every pair. [-3, -2] over [1, 4]:
    5 / 5 = 1, where the mean of per-pair means would give (3 + 0.5) / 2 = 1.75."""
    for chosen, lengths, expected in ((T([-3.0, -6.0]), T([1, 2]), 3.0), (T([-3.0, -2.0]), T([1, 4]), 1.0)):
        losses, chosen_rewards, _ = preference_loss("sft", chosen, T([-9.0, -9.0]), lengths, T([3, 3]), None, None,
                                                    beta=0.1)
        assert losses.tolist() == pytest.approx([expected, expected])
        assert chosen_rewards.tolist() == pytest.approx((0.1 * chosen / lengths).tolist())  # reference-free


def test_aot_sorts_margins_across_the_batch():
    """Policy margins (chosen - rejected) [-1 - -3, -5 - -2] = [2, -3], sorted [-3, 2]; reference margins
    [-2 - -2, -2 - -4] = [0, 2], sorted [0, 2]; beta 1: -log s(-3 - 0) = 3.0485874, -log s(2 - 2) = log 2.
    aot_unpaired sorts the log-ratios instead: chosen [1, -3] -> [-3, 1], rejected [-1, 2] -> [-1, 2]:
    -log s(-2) = 2.1269280, -log s(-1) = 1.3132617."""
    pair = (T([-1.0, -5.0]), T([-3.0, -2.0]), T([1, 1]), T([1, 1]), T([-2.0, -2.0]), T([-2.0, -4.0]))
    assert preference_loss("aot", *pair, beta=1.0)[0].tolist() == pytest.approx([3.0485874, 0.6931472], abs=1e-6)
    assert preference_loss("aot_unpaired", *pair, beta=1.0)[0].tolist() == pytest.approx([2.1269280, 1.3132617],
                                                                                         abs=1e-6)


def test_f_divergence_scores_by_hand():
    """At log-ratio log 2 (t = 2): reverse KL log 2; forward KL 1 - 1/2; JS log 2 + log s(log 2) = log(4/3);
    alpha 0.5: (2^-0.5 - 1) / -0.5 = 0.5857864; alpha 1 is reverse KL's limit. Log-ratio 0 scores 0 in all."""
    x = T([math.log(2), 0.0])
    assert f_divergence_scores(x).tolist() == pytest.approx([math.log(2), 0.0])
    assert f_divergence_scores(x, "forward_kl").tolist() == pytest.approx([0.5, 0.0])
    assert f_divergence_scores(x, "js_divergence").tolist() == pytest.approx([math.log(4 / 3), 0.0], abs=1e-6)
    assert f_divergence_scores(x, "alpha_divergence", 0.5).tolist() == pytest.approx([0.5857864, 0.0], abs=1e-6)
    assert f_divergence_scores(x, "alpha_divergence", 1.0).tolist() == pytest.approx([math.log(2), 0.0])


def test_f_divergence_changes_the_scores_the_sigmoid_loss_reads():
    """Forward KL, c = log 2 -> 1 - 1/2 = 0.5, r = -log 2 -> 1 - 2 = -1: h = 1.5, beta 1: -log s(1.5) = 0.2014133.
    The rewards stay beta times the plain log-ratios, as TRL logs them."""
    pair = (T([math.log(2)]), T([-math.log(2)]), T([1]), T([1]), T([0.0]), T([0.0]))
    losses, chosen_rewards, rejected_rewards = preference_loss("sigmoid", *pair, beta=1.0,
                                                               f_divergence_type="forward_kl")
    assert losses.item() == pytest.approx(0.2014133, abs=1e-6)
    assert (chosen_rewards.item(), rejected_rewards.item()) == pytest.approx((math.log(2), -math.log(2)))


def test_preference_loss_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="needs reference log-probs"):
        preference_loss(["sft", "bco_pair"], T([-1.0]), T([-2.0]), T([1]), T([1]), None, None, beta=0.1)
    with pytest.raises(ValueError, match="2 loss weights for 1 losses"):
        _loss("sigmoid", 0.1, loss_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="choose from"):
        _loss("kto_pair", 0.1)
