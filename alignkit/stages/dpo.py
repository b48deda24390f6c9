"""Direct preference optimisation and its reference-free relatives (ORPO, SimPO).

The policy learns to raise the log-probability of the chosen response of a pair relative to the
rejected one, measured against a frozen reference (DPO, IPO, hinge) or against nothing (ORPO, SimPO).

What this file simplifies, and why:
- One forward pass over 2B rows: the `PairwiseCollator` stacks chosen rows first, then rejected. The
  sequence log-probability is the sum of the response tokens' log-probs (labels are -100 on the prompt
  and padding), gathered by `alignkit.model.logprobs` without a second full-vocabulary tensor.
- Padding-free by default (`padding_free`): policy and reference run on the batch's real tokens packed
  into rows no wider than its longest sequence (`alignkit.model.padding_free`), and only response
  positions reach the output layer. A preference batch pads 2B rows to the longest of chosen and
  rejected, so this is where most of a padded step's time and activation memory would go; the
  log-probs are the same. A vision-language batch (images: `alignkit.data.multimodal`) runs padded
  instead, chosen and rejected rows each with the pair's prompt images, for policy and reference alike.
- The reference is the policy as it was at step 0, and never a second model read from disk (except under
  DeepSpeed ZeRO-3, see `StageTrainer`): under LoRA the same weights with the adapter disabled
  (`with model.disable_adapter()`), under full or freeze fine-tuning a frozen deep copy made in memory when
  the trainer is built. With
  `precompute_ref_log_probs` it is evaluated once for the whole dataset before training and cached on
  disk, keyed by the token ids and the reference weights, so a second run (or a resumed one) reads it.
- Loss definitions follow TRL 1.16 for its 15 loss types (`pair_loss`, `preference_loss`: sigmoid, ipo on
  per-token average log-ratios, hinge, robust, exo_pair, ..., several weighted together as its `loss_type` list
  with `loss_weights`, and its f-divergences),
  and the papers for ORPO (Hong et al. 2024, eq. 6-7: per-sequence mean NLL of chosen plus beta times
  the odds-ratio loss on average log-probs) and SimPO (Meng et al. 2024, eq. 6:
  `-log sigmoid(beta * (avg_c - avg_r) - gamma)`; LLaMA-Factory writes `beta * (delta - gamma / beta)`,
  the same number). `dpo_label_smoothing` is the conservative-DPO smoothing of the sigmoid loss
  (Mitchell 2023), what LLaMA-Factory's key meant with TRL's sigmoid loss; at 0 it is plain DPO.
- Metrics as TRL logs them: rewards = beta * (policy - reference) summed log-probs; for the
  reference-free losses, whose implicit reward is the length-normalised log-prob, beta * average
  log-prob. `logps/*` are the policy's summed log-probs.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..data.multimodal import IMAGE_COLUMN
from ..errors import ConfigError
from ..model.logprobs import forward_sequence_logps
from .arguments import F_DIVERGENCES, PREFERENCE_LOSSES, REFERENCE_FREE_LOSSES, TRL_LOSSES, DPOArguments
from .base import StageTrainer, check_reference_sync, run_stage_trainer, save_pair_predictions
from .reference_cache import CollateWithReference, precompute_reference_logps

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from ..config import Config

logger = logging.getLogger(__name__)

# The examples `data.get_dataset` builds for this stage (`formats.DATA_KINDS`); the registry records it too.
DATA_KIND = "preference"

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
# What the cached reference log-probs depend on besides the reference's weights (`reference_cache`).
TOKEN_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", IMAGE_COLUMN)


def check_config(config: "Config") -> None:
    """What `stage: dpo` refuses beyond its own keys."""
    if config.training.predict_with_generate:
        raise ConfigError("predict_with_generate applies to stage sft, not dpo; remove it.")
    d = config.method
    if d.sync_ref_model and d.precompute_ref_log_probs:
        raise ConfigError("sync_ref_model moves the reference during training, so reference log-probs computed "
                          "before it (precompute_ref_log_probs) would be stale; set one of them to false.")
    check_reference_sync(config, d.needs_reference, f"pref_loss={','.join(d.loss_types)}")


# ---------------------------------------------------------------------------------------------------
# Pure tensor functions. B = number of pairs; log-probs are per-sequence sums unless named avg_.
# ---------------------------------------------------------------------------------------------------


def sigmoid_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """DPO loss (Rafailov et al. 2023, eq. 7), with conservative-DPO label smoothing.

    With `h = (chosen - ref_chosen) - (rejected - ref_rejected)`:
    `loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)`.

    Args:
        chosen_logps, rejected_logps: [B] policy log-probs of the chosen / rejected responses.
        ref_chosen_logps, ref_rejected_logps: [B] reference log-probs of the same.
        beta: scales the log-ratio difference (how far the policy may move from the reference).
        label_smoothing: eps in [0, 0.5), the assumed share of flipped preference labels.

    Returns:
        [B] per-pair losses.
    """
    return _reverse_kl_pair_loss("sigmoid", chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                                 beta=beta, label_smoothing=label_smoothing)


def hinge_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """SLiC hinge loss on the DPO log-ratio (Zhao et al. 2023, eq. 3; TRL's `hinge`).

    `loss = relu(1 - beta * h)` with `h = (chosen - ref_chosen) - (rejected - ref_rejected)`.

    Args:
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps: [B] summed log-probs.
        beta: the margin is 1 / beta in log-ratio units.

    Returns:
        [B] per-pair losses.
    """
    return _reverse_kl_pair_loss("hinge", chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                                 beta=beta)


def ipo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """IPO loss (Azar et al. 2023, eq. 17) on per-token average log-ratios, as TRL 1.16 computes it.

    `h = (chosen - ref_chosen) / n_chosen - (rejected - ref_rejected) / n_rejected`,
    `loss = (h - 1 / (2 * beta))^2`; beta is the paper's tau.

    Args:
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps: [B] summed log-probs.
        chosen_lengths, rejected_lengths: [B] response token counts (clamped to at least 1).
        beta: regularisation tau; the target gap is 1 / (2 tau).

    Returns:
        [B] per-pair losses.
    """
    return _reverse_kl_pair_loss("ipo", chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                                 chosen_lengths, rejected_lengths, beta=beta)


def _reverse_kl_pair_loss(loss_type: str, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                          ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
                          chosen_lengths: Optional[torch.Tensor] = None, rejected_lengths: Optional[torch.Tensor] = None,
                          **parameters) -> torch.Tensor:
    """`pair_loss` of summed log-probs under plain DPO's divergence (the scores are the log-ratios themselves)."""
    chosen, rejected = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    ones = torch.ones_like(chosen)
    return pair_loss(loss_type, chosen, rejected, chosen, rejected,
                     ones if chosen_lengths is None else chosen_lengths,
                     ones if rejected_lengths is None else rejected_lengths, **parameters)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 and for very negative x (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(avg_chosen_logps: torch.Tensor, avg_rejected_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """ORPO loss (Hong et al. 2024, eq. 6-7): chosen NLL plus beta times the odds-ratio loss.

    With `p = exp(avg log-prob)` and `odds = p / (1 - p)`:
    `log_odds = (avg_c - avg_r) - (log(1 - exp(avg_c)) - log(1 - exp(avg_r)))`,
    `loss = -avg_c + beta * -log sigmoid(log_odds)`.

    Args:
        avg_chosen_logps, avg_rejected_logps: [B] per-token average log-probs (< 0) of the responses.
        beta: weight of the odds-ratio term (the paper's lambda).

    Returns:
        [B] per-pair losses.
    """
    log_odds = (avg_chosen_logps - avg_rejected_logps) - (
        _log1mexp(avg_chosen_logps) - _log1mexp(avg_rejected_logps)
    )
    return -avg_chosen_logps - beta * F.logsigmoid(log_odds)


def simpo_loss(
    avg_chosen_logps: torch.Tensor, avg_rejected_logps: torch.Tensor, beta: float, gamma: float
) -> torch.Tensor:
    """SimPO loss (Meng et al. 2024, eq. 6): `-log sigmoid(beta * (avg_c - avg_r) - gamma)`.

    Args:
        avg_chosen_logps, avg_rejected_logps: [B] per-token average log-probs of the responses.
        beta: reward scale.
        gamma: target reward margin, in reward units (outside beta, as in the paper).

    Returns:
        [B] per-pair losses.
    """
    return -F.logsigmoid(beta * (avg_chosen_logps - avg_rejected_logps) - gamma)


def chosen_nll_loss(chosen_logps: torch.Tensor, chosen_lengths: torch.Tensor) -> torch.Tensor:
    """Each chosen reply's mean negative log-likelihood per token (the `pref_ftx` term, one value per pair).

    LLaMA-Factory's `pref_ftx` adds this per pair to the preference loss before the batch mean, so the term is
    a mean over pairs of per-reply token means. A per-pair term also keeps N processes x batch b equal to one
    process x batch N*b (a batch-wide token ratio would be a different ratio on each process).

    Example: summed log-probs [-3, -5] over [2, 3] tokens: [3 / 2, 5 / 3] = [1.5, 1.6667].

    Args:
        chosen_logps: [B] summed log-probs of the chosen responses.
        chosen_lengths: [B] their token counts.

    Returns:
        [B] `-chosen_logps / chosen_lengths` (a length of 0 counts as 1).
    """
    return -chosen_logps / chosen_lengths.clamp(min=1)


def f_divergence_scores(log_ratios: torch.Tensor, divergence: str = "reverse_kl", alpha: float = 0.5
                        ) -> torch.Tensor:
    """f-DPO's scores of policy/reference log-ratios (Wang et al. 2023): `f'(t)` at `t = exp(log_ratio)`.

    reverse_kl (plain DPO): `log t`; forward_kl: `1 - 1/t`; js_divergence: `log 2 + log sigmoid(log t)`
    (`log(2t / (1 + t))`); alpha_divergence: `(t^(alpha - 1) - 1) / (alpha - 1)`, which tends to `log t` as
    alpha -> 1 (taken as reverse_kl within 1e-6 of it); its exponent is capped at 80 so that exp stays finite in
    fp32, as TRL caps it.

    Example: log-ratio 0 (policy equals reference) scores 0 under every divergence; log-ratio log 2 scores
    log 2 = 0.6931, 1 - 1/2 = 0.5, log(4/3) = 0.2877 and, alpha 0.5, (2^-0.5 - 1) / -0.5 = 0.5858.

    Args:
        log_ratios: [N] summed policy minus reference log-probs.
        divergence: one of `F_DIVERGENCES`.
        alpha: alpha_divergence's coefficient.

    Returns:
        [N] scores, in the dtype of `log_ratios`.
    """
    if divergence == "reverse_kl" or (divergence == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return log_ratios
    if divergence == "forward_kl":
        return 1 - torch.exp(-log_ratios)
    if divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratios)
    if divergence == "alpha_divergence":
        exponent = ((alpha - 1.0) * log_ratios).float().clamp(max=80.0)
        return (torch.expm1(exponent) / (alpha - 1.0)).to(log_ratios.dtype)
    raise ValueError(f"f_divergence_type={divergence!r}: choose one of {', '.join(F_DIVERGENCES)}.")


def _smoothed_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """`-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)`: the logistic loss with a share eps of flipped labels."""
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def pair_loss(
    loss_type: str,
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
) -> torch.Tensor:
    """Per-pair losses of one reference-based loss type of TRL 1.16's `DPOTrainer` (its formulas and names).

    With `c`, `r` the summed log-ratios (policy minus reference) of chosen and rejected, `sc`, `sr` their
    f-divergence scores (`f_divergence_scores`; equal to `c`, `r` under reverse KL), `h = sc - sr`, `eps` the
    label smoothing and `n_c`, `n_r` the reply token counts:

    - sigmoid (DPO, Rafailov et al. 2023): `-(1 - eps) log s(beta h) - eps log s(-beta h)` (conservative DPO's
      smoothing, what LLaMA-Factory's `dpo_label_smoothing` means; TRL's sigmoid has none, i.e. eps 0);
    - hinge (SLiC): `relu(1 - beta h)`;
    - ipo (Azar et al. 2023, on per-token averages as TRL): `(sc / n_c - sr / n_r - 1 / (2 beta))^2`;
    - sigmoid_norm: `-log s(beta (sc / n_c - sr / n_r))`;
    - robust (Chowdhury et al. 2024): `(-(1 - eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps)`;
    - exo_pair (Ji et al. 2024, K = 2): `q log(q / (1 - eps)) + (1 - q) log((1 - q) / eps)`, `q = s(beta h)`;
    - discopop (Lu et al. 2024): `(1 - m) (-log s(z)) + m exp(-z)` with `z = beta h`, `m = s(z / tau)`;
    - nca_pair (Chen et al. 2024): `-log s(beta c) - log s(-beta c) / 2 - log s(-beta r) / 2`;
    - bco_pair: `-log s(beta c) - log s(-beta r)`;
    - sppo_hard (Wu et al. 2024, hard labels): `(c - 1 / (2 beta))^2 + (r + 1 / (2 beta))^2`;
    - apo_zero (D'Oosterlinck et al. 2024, eq. 7): `1 - s(beta c) + s(beta r)`;
    - apo_down (eq. 8): `s(beta c) + 1 - s(beta (c - r))`;
    - aot_unpaired (Melnyk et al. 2024): `sort(c) - sort(r)` over the batch, then the smoothed sigmoid of beta
      times it; aot takes the sorted policy margins minus the sorted reference margins instead, which needs the
      log-probs themselves: `preference_loss` computes it.

    `s` is the sigmoid. Examples (hand-computed in tests/unit/test_dpo_losses.py): bco_pair at c = 1, r = -1,
    beta 1: `2 log(1 + e^-1) = 0.6265`; apo_zero there: `1 - s(1) + s(-1) = 0.5379`.

    Args:
        loss_type: one of `TRL_LOSSES` except sft and aot (`preference_loss` computes those).
        chosen_logratios, rejected_logratios: [B] `c`, `r`.
        chosen_scores, rejected_scores: [B] `sc`, `sr`.
        chosen_lengths, rejected_lengths: [B] reply token counts (clamped to at least 1).
        beta: the loss's beta (IPO's tau).
        label_smoothing: eps (sigmoid, robust, exo_pair, aot_unpaired).
        discopop_tau: DiscoPOP's temperature.

    Returns:
        [B] per-pair losses (aot_unpaired: per sorted position).
    """
    h = chosen_scores - rejected_scores
    if loss_type == "sigmoid":
        return _smoothed_sigmoid(beta * h, label_smoothing)
    if loss_type == "hinge":
        return torch.relu(1 - beta * h)
    if loss_type in ("ipo", "sigmoid_norm"):
        avg = chosen_scores / chosen_lengths.clamp(min=1) - rejected_scores / rejected_lengths.clamp(min=1)
        return (avg - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * avg)
    if loss_type == "robust":
        eps = label_smoothing
        return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    if loss_type == "exo_pair":
        eps = label_smoothing
        return (torch.sigmoid(beta * h) * (F.logsigmoid(beta * h) - math.log1p(-eps))
                + torch.sigmoid(-beta * h) * (F.logsigmoid(-beta * h) - math.log(eps)))
    if loss_type == "discopop":
        z = beta * h
        modulation = torch.sigmoid(z / discopop_tau)
        return (1 - modulation) * -F.logsigmoid(z) + modulation * torch.exp(-z)
    c, r = beta * chosen_logratios, beta * rejected_logratios
    if loss_type == "nca_pair":
        return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)
    if loss_type == "bco_pair":
        return -F.logsigmoid(c) - F.logsigmoid(-r)
    if loss_type == "sppo_hard":
        return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(c) + torch.sigmoid(r)
    if loss_type == "apo_down":
        return torch.sigmoid(c) + 1 - torch.sigmoid(c - r)
    if loss_type == "aot_unpaired":
        margin = torch.sort(chosen_logratios, dim=0).values - torch.sort(rejected_logratios, dim=0).values
        return _smoothed_sigmoid(beta * margin, label_smoothing)
    raise ValueError(f"pref_loss={loss_type!r} is not a reference-based pair loss; choose one of "
                     f"{', '.join(t for t in TRL_LOSSES if t not in ('sft', 'aot'))}.")


def preference_loss(
    loss_type: Union[str, Sequence[str]],
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    ref_chosen_logps: Optional[torch.Tensor],
    ref_rejected_logps: Optional[torch.Tensor],
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    loss_weights: Optional[Sequence[float]] = None,
    discopop_tau: float = 0.05,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses of `loss_type` (one loss or a weighted sum of several) and the rewards logged as `rewards/*`.

    Several losses add up as TRL adds them: `sum_i w_i * loss_i` per pair, whose batch mean is TRL's
    `sum_i w_i * mean(loss_i)` (MPO: sigmoid, bco_pair and sft weighted 0.8, 0.2, 1). The reference-based
    losses are `pair_loss`'s; besides them:

    - aot (Melnyk et al. 2024): `sort(chosen - rejected) - sort(ref_chosen - ref_rejected)` over the batch, its
      smoothed sigmoid of beta times that;
    - sft: the chosen replies' negative log-likelihood per token over the whole batch (`-sum chosen_logps /
      sum chosen_lengths`), the same value for every pair, as TRL's;
    - orpo, simpo (LLaMA-Factory's reference-free losses): `orpo_loss`, `simpo_loss` on average log-probs.

    Args:
        loss_type: a name in `PREFERENCE_LOSSES`, or several.
        chosen_logps, rejected_logps: [B] summed policy log-probs.
        chosen_lengths, rejected_lengths: [B] response token counts.
        ref_chosen_logps, ref_rejected_logps: [B] summed reference log-probs (None when every loss is
            reference-free: orpo, simpo, sft).
        beta, label_smoothing, simpo_gamma, discopop_tau: the losses' parameters.
        loss_weights: one weight per loss (None: all 1).
        f_divergence_type, f_alpha_divergence_coef: f-DPO's divergence (`f_divergence_scores`).

    Returns:
        `(losses [B], chosen_rewards [B], rejected_rewards [B])`, rewards detached: `beta * (policy - reference)`
        summed log-probs where the losses read a reference (TRL's), else `beta * average log-prob`.
    """
    loss_types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(loss_types):
        raise ValueError(f"{len(weights)} loss weights for {len(loss_types)} losses ({', '.join(loss_types)}).")
    unknown = [t for t in loss_types if t not in PREFERENCE_LOSSES]
    if unknown:
        raise ValueError(f"pref_loss={unknown[0]!r}: choose from {', '.join(PREFERENCE_LOSSES)}.")
    with_reference = any(t not in REFERENCE_FREE_LOSSES for t in loss_types)
    if with_reference and (ref_chosen_logps is None or ref_rejected_logps is None):
        raise ValueError(f"pref_loss={','.join(loss_types)} needs reference log-probs.")

    avg_chosen = chosen_logps / chosen_lengths.clamp(min=1)
    avg_rejected = rejected_logps / rejected_lengths.clamp(min=1)
    if with_reference:
        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        chosen_scores = f_divergence_scores(chosen_logratios, f_divergence_type, f_alpha_divergence_coef)
        rejected_scores = f_divergence_scores(rejected_logratios, f_divergence_type, f_alpha_divergence_coef)
    losses = torch.zeros_like(chosen_logps)
    for name, weight in zip(loss_types, weights):
        if name == "orpo":
            term = orpo_loss(avg_chosen, avg_rejected, beta)
        elif name == "simpo":
            term = simpo_loss(avg_chosen, avg_rejected, beta, simpo_gamma)
        elif name == "sft":
            term = (-chosen_logps.sum() / chosen_lengths.sum().clamp(min=1)).expand_as(chosen_logps)
        elif name == "aot":
            policy = torch.sort(chosen_logps - rejected_logps, dim=0).values
            reference = torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0).values
            term = _smoothed_sigmoid(beta * (policy - reference), label_smoothing)
        else:
            term = pair_loss(name, chosen_logratios, rejected_logratios, chosen_scores, rejected_scores,
                             chosen_lengths, rejected_lengths, beta=beta, label_smoothing=label_smoothing,
                             discopop_tau=discopop_tau)
        losses = losses + weight * term
    if with_reference:
        return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    return losses, beta * avg_chosen.detach(), beta * avg_rejected.detach()


# ---------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------


class DPOTrainer(StageTrainer):
    """`Trainer` whose loss is a preference loss over a batch of 2B rows (chosen first, then rejected).

    Args:
        dpo_args: `pref_loss` (with `loss_weights`), `pref_beta`, `pref_ftx`, `dpo_label_smoothing`,
            `simpo_gamma`, `discopop_tau`, `f_divergence_type`, `f_alpha_divergence_coef`, `precompute_ref_log_probs`.
        ref_model: an explicit frozen reference model. Default: the policy with its LoRA adapter disabled,
            or a frozen in-memory deep copy of the policy as it is now (full / freeze fine-tuning; under ZeRO-3
            the policy's source loaded again, partitioned: `StageTrainer`).
        *args, **kwargs: as for `transformers.Trainer` (`data_collator` must be a pairwise collator);
            `args.padding_free` runs policy and reference on the batch's real tokens only.
    """

    # The loss is a per-micro-batch mean over pairs: let Trainer divide it by the accumulation steps.
    loss_is_scaled_for_ga = False
    predictions_from_evaluation = True  # predict reuses the evaluation's pass (StageTrainer)
    accumulation_is_one_batch = True  # a mean over equal micro-batches (StageTrainer)
    no_reference_copy_message = (
        "precompute_ref_log_probs=true with full/freeze fine-tuning keeps no reference copy, and the policy has "
        "been trained since: reference log-probs exist only for the datasets given when the trainer was built. "
        "Pass this dataset as eval_dataset then, or set precompute_ref_log_probs=false."
    )

    def __init__(self, *args, dpo_args: DPOArguments, ref_model: Optional[nn.Module] = None, **kwargs) -> None:
        self.loss_type = dpo_args.loss_types
        self.beta = dpo_args.pref_beta
        self.pref_ftx = dpo_args.pref_ftx
        self.loss_parameters = {
            "label_smoothing": dpo_args.dpo_label_smoothing, "simpo_gamma": dpo_args.simpo_gamma,
            "loss_weights": dpo_args.loss_weights, "discopop_tau": dpo_args.discopop_tau,
            "f_divergence_type": dpo_args.f_divergence_type,
            "f_alpha_divergence_coef": dpo_args.f_alpha_divergence_coef}
        self.needs_reference = dpo_args.needs_reference
        self.precompute_ref_logps = dpo_args.precompute_ref_log_probs and self.needs_reference
        if self.precompute_ref_logps and kwargs.get("data_collator") is not None:
            kwargs["data_collator"] = CollateWithReference(kwargs["data_collator"], REF_COLUMNS)
        kwargs.setdefault("disable_dropout", dpo_args.disable_dropout)
        super().__init__(*args, ref_model=ref_model if self.needs_reference else None,
                         keep_reference_copy=self.needs_reference and not self.precompute_ref_logps,
                         reference_sync=dpo_args, **kwargs)

        if self.precompute_ref_logps:  # before any update: the policy may serve as its own reference here
            precompute_reference_logps(self, REF_COLUMNS, TOKEN_COLUMNS, self.reference_logps, unit="pairs")

    # ---- the reference ----

    def reference_logps(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed reference log-probs of the chosen and rejected rows of a pairwise batch: ([B], [B])."""
        with self.reference() as reference:
            logps, _ = self._sequence_logps(reference, inputs)
        return logps.chunk(2)

    def _sequence_logps(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed log-probs [2B] and response lengths [2B] of every row of a pairwise batch under `model`."""
        from ..data.multimodal import image_inputs

        pixels = image_inputs(inputs)  # a vision-language batch runs padded, with its images
        return forward_sequence_logps(model, inputs["input_ids"], inputs["attention_mask"], inputs["labels"],
                                      padding_free=self.args.padding_free and not pixels, model_inputs=pixels)

    # ---- the loss ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logps, lengths = self._sequence_logps(model, inputs)
        chosen_logps, rejected_logps = logps.chunk(2)
        chosen_lengths, rejected_lengths = lengths.chunk(2)

        ref_chosen_logps = ref_rejected_logps = None
        if self.needs_reference:
            if "ref_chosen_logps" in inputs:
                ref_chosen_logps, ref_rejected_logps = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
            else:
                pairs = chosen_logps.shape[0]  # chosen rows 0..B-1, their rejected rows B..2B-1
                ref_chosen_logps, ref_rejected_logps = self.kept_reference(
                    inputs, self.reference_logps, [[("", i), ("", pairs + i)] for i in range(pairs)])

        losses, chosen_rewards, rejected_rewards = preference_loss(
            self.loss_type, chosen_logps, rejected_logps, chosen_lengths, rejected_lengths,
            ref_chosen_logps, ref_rejected_logps,
            beta=self.beta, **self.loss_parameters)
        if self.pref_ftx:
            losses = losses + self.pref_ftx * chosen_nll_loss(chosen_logps, chosen_lengths)
        loss = losses[:self.real_rows(losses.shape[0])].mean()  # evaluation: without repeated pairs (several processes)

        self.record_metrics({
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "rewards/margins": chosen_rewards - rejected_rewards,
            "logps/chosen": chosen_logps,
            "logps/rejected": rejected_logps,
        }, chosen_logps.numel())
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss; unless `prediction_loss_only`, each pair's implicit rewards as predictions ([B, 2])."""
        loss, outputs, inputs = self.loss_and_outputs(model, inputs)
        if prediction_loss_only:
            return loss, None, None
        rewards = torch.stack([outputs["chosen_rewards"], outputs["rejected_rewards"]], dim=-1).detach()
        return loss, rewards, None


# ---------------------------------------------------------------------------------------------------
# Stage entry point
# ---------------------------------------------------------------------------------------------------


def run_dpo(config: "Config", callbacks: list["TrainerCallback"]) -> None:
    """Train, evaluate and predict with a preference loss as `config` says; outputs go to `output_dir`.

    Prediction writes each pair's implicit rewards (`beta * (policy - reference)` log-probs) to
    `generated_predictions.jsonl`, as the rm stage writes its rewards.
    """
    from ..data import PairwiseCollator, get_dataset
    from ..data.multimodal import image_collator
    from ..model.loader import load_image_processing, load_model, load_tokenizer
    from .base import check_splits

    tokenizer = load_tokenizer(config.model)
    images = load_image_processing(config.model, tokenizer)
    datasets = get_dataset(config, tokenizer, DATA_KIND, images=images)
    check_splits(config, datasets)
    model = load_model(config.model, config.finetuning, is_trainable=config.training.do_train, vision=True)
    data_collator = PairwiseCollator(tokenizer)
    if images is not None:  # both replies of a pair see the prompt's images
        data_collator = image_collator(data_collator, images, pairwise=True,
                                       stepping_aside=["padding_free"] if config.training.padding_free else [])
    trainer = DPOTrainer(
        model=model,
        args=config.training,
        dpo_args=config.method,
        data_collator=data_collator,
        processing_class=tokenizer,
        callbacks=callbacks,
        **datasets,
    )
    run_stage_trainer(trainer, config, save_predictions=lambda output: save_pair_predictions(
        config.training.output_dir, output.predictions, trainer.eval_dataset, tokenizer))
    if images is not None and config.training.do_train and trainer.is_world_process_zero():
        images.save(config.training.output_dir)


__all__ = [
    "sigmoid_loss",
    "hinge_loss",
    "ipo_loss",
    "orpo_loss",
    "simpo_loss",
    "chosen_nll_loss",
    "f_divergence_scores",
    "pair_loss",
    "preference_loss",
    "PREFERENCE_LOSSES",
    "TRL_LOSSES",
    "DPOArguments",
    "check_config",
    "DPOTrainer",
    "run_dpo",
]
