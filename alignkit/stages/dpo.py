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
- Loss definitions follow TRL 1.16 for sigmoid, ipo and hinge (IPO on per-token average log-ratios),
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..data.multimodal import IMAGE_COLUMN
from ..errors import ConfigError
from ..model.logprobs import forward_sequence_logps
from .base import ReferenceSyncArguments, StageTrainer, check_reference_sync, run_stage_trainer, save_pair_predictions
from .reference_cache import CollateWithReference, precompute_reference_logps

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from ..config import Config

logger = logging.getLogger(__name__)

# The examples `data.get_dataset` builds for this stage (`formats.DATA_KINDS`); the registry records it too.
DATA_KIND = "preference"

REFERENCE_FREE_LOSSES = ("orpo", "simpo")
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
# What the cached reference log-probs depend on besides the reference's weights (`reference_cache`).
TOKEN_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", IMAGE_COLUMN)


@dataclass
class DPOArguments(ReferenceSyncArguments):
    """The keys of `stage: dpo` (LLaMA-Factory's names; TRL's for the reference sync)."""

    pref_beta: float = field(default=0.1, metadata={"help": "DPO-family beta: how far the policy may move."})
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Set every dropout of the model (LoRA's included) to 0 while training, so that a step "
                          "sees the network its reference sees. TRL default true."})
    pref_loss: Literal["sigmoid", "ipo", "hinge", "orpo", "simpo"] = field(
        default="sigmoid", metadata={"help": "Preference loss: sigmoid (DPO), ipo, hinge, orpo or simpo."}
    )
    pref_ftx: float = field(default=0.0, metadata={"help": "Weight of the SFT loss on chosen added to DPO (each "
                                                   "chosen reply's mean NLL per token, per pair, as LLaMA-Factory)."})
    dpo_label_smoothing: float = field(
        default=0.0,
        metadata={
            "help": "Conservative-DPO label smoothing in [0, 0.5) for the sigmoid loss: the assumed share of "
            "flipped preference labels (0 = plain DPO)."
        },
    )
    simpo_gamma: float = field(default=0.5, metadata={"help": "SimPO target reward margin."})
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute reference log-probs once for the whole dataset before training (cached)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.pref_beta > 0:  # also refuses NaN
            raise ConfigError(f"pref_beta={self.pref_beta} must be > 0: at 0 the preference loss has no gradient.")
        if not 0 <= self.dpo_label_smoothing < 0.5:
            raise ConfigError(f"dpo_label_smoothing={self.dpo_label_smoothing} must be in [0, 0.5).")
        if self.dpo_label_smoothing and self.pref_loss != "sigmoid":
            raise ConfigError("dpo_label_smoothing only applies to pref_loss=sigmoid; set one or the other.")
        if self.pref_ftx < 0:
            raise ConfigError(f"pref_ftx={self.pref_ftx} must be >= 0 (the weight of an added SFT loss).")
        if self.precompute_ref_log_probs and self.pref_loss in REFERENCE_FREE_LOSSES:
            raise ConfigError(f"pref_loss={self.pref_loss} uses no reference model; drop precompute_ref_log_probs.")


def check_config(config: "Config") -> None:
    """What `stage: dpo` refuses beyond its own keys."""
    if config.training.predict_with_generate:
        raise ConfigError("predict_with_generate applies to stage sft, not dpo; remove it.")
    d = config.method
    if d.sync_ref_model and d.precompute_ref_log_probs:
        raise ConfigError("sync_ref_model moves the reference during training, so reference log-probs computed "
                          "before it (precompute_ref_log_probs) would be stale; set one of them to false.")
    check_reference_sync(config, d.pref_loss not in REFERENCE_FREE_LOSSES, f"pref_loss={d.pref_loss}")


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
    logits = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    loss = -F.logsigmoid(beta * logits)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-beta * logits)
    return loss


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
    logits = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    return torch.relu(1 - beta * logits)


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
    chosen_avg = (chosen_logps - ref_chosen_logps) / chosen_lengths.clamp(min=1)
    rejected_avg = (rejected_logps - ref_rejected_logps) / rejected_lengths.clamp(min=1)
    return (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2


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


def preference_loss(
    loss_type: str,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses of `loss_type` and the implicit rewards logged as `rewards/*`.

    Args:
        loss_type: sigmoid, ipo, hinge, orpo or simpo.
        chosen_logps, rejected_logps: [B] summed policy log-probs.
        chosen_lengths, rejected_lengths: [B] response token counts.
        ref_chosen_logps, ref_rejected_logps: [B] summed reference log-probs (None for orpo / simpo).
        beta, label_smoothing, simpo_gamma: the loss's parameters.

    Returns:
        `(losses [B], chosen_rewards [B], rejected_rewards [B])`; rewards are detached.
    """
    if loss_type in REFERENCE_FREE_LOSSES:
        avg_chosen = chosen_logps / chosen_lengths.clamp(min=1)
        avg_rejected = rejected_logps / rejected_lengths.clamp(min=1)
        if loss_type == "orpo":
            losses = orpo_loss(avg_chosen, avg_rejected, beta)
        else:
            losses = simpo_loss(avg_chosen, avg_rejected, beta, simpo_gamma)
        return losses, beta * avg_chosen.detach(), beta * avg_rejected.detach()

    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"pref_loss={loss_type} needs reference log-probs.")
    pair = (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = sigmoid_loss(*pair, beta, label_smoothing)
    elif loss_type == "hinge":
        losses = hinge_loss(*pair, beta)
    elif loss_type == "ipo":
        losses = ipo_loss(*pair, chosen_lengths, rejected_lengths, beta)
    else:
        raise ValueError(f"pref_loss={loss_type!r}: choose sigmoid, ipo, hinge, orpo or simpo.")
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


# ---------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------


class DPOTrainer(StageTrainer):
    """`Trainer` whose loss is a preference loss over a batch of 2B rows (chosen first, then rejected).

    Args:
        dpo_args: `pref_loss`, `pref_beta`, `pref_ftx`, `dpo_label_smoothing`, `simpo_gamma`,
            `precompute_ref_log_probs`.
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
        self.loss_type = dpo_args.pref_loss
        self.beta = dpo_args.pref_beta
        self.pref_ftx = dpo_args.pref_ftx
        self.label_smoothing = dpo_args.dpo_label_smoothing
        self.simpo_gamma = dpo_args.simpo_gamma
        self.needs_reference = self.loss_type not in REFERENCE_FREE_LOSSES
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
            beta=self.beta, label_smoothing=self.label_smoothing, simpo_gamma=self.simpo_gamma,
        )
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
    "preference_loss",
    "DPOArguments",
    "check_config",
    "DPOTrainer",
    "run_dpo",
]
