"""Reward modelling: learn a scalar score that ranks the chosen response of a pair above the rejected one.

The model is a standard `AutoModelForSequenceClassification` with `num_labels=1` over the causal LM's
backbone (under LoRA the `score` head is trained in full beside the adapter), so what `output_dir`
holds loads with plain transformers (plus peft for an adapter).

What this file simplifies, and why:
- Chosen and rejected go through the model in one forward pass: the `PairwiseCollator` stacks them
  into one batch of 2B rows, chosen first. One pass costs less than two, and both halves see the same
  dropout/LoRA state.
- The reward of a sequence is the score at its *last real token*, found from the attention mask. The
  transformers sequence-classification forward instead pools at the rightmost token that differs from
  `pad_token_id`; with pad == eos (SmolLM2 and many chat models) a sequence ending in eos would be read
  one token early. So we take the per-token scores that the `score` head produces inside that same
  forward (a forward hook on the head, so any wrapper around the model -- PEFT, DDP -- still runs its
  own forward) and gather them ourselves, for left and right padding alike. The data layer ends every
  sequence with the template's text after the end-of-turn token (ChatML's newline), so the last real
  token is not the pad id and plain transformers, pooling at the rightmost non-pad token, reads the
  same score from the saved model, padded batches included (tested).
- Padding-free by default (`padding_free`): the real tokens of the 2B rows run packed into rows no
  wider than the longest sequence, position ids restarting per sequence (`alignkit.model.padding_free`),
  and each reward is read at its sequence's last token: the same scores without the padding's compute.
- The loss is the Bradley-Terry negative log-likelihood `-log sigmoid(r_chosen - r_rejected - margin)`
  averaged over pairs, plus TRL's optional centring penalty; the pure functions are below.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
import torch.nn.functional as F
from transformers import EvalPrediction

from ..metrics import EvalMetric
from ..rewards.scoring import sequence_rewards
from .arguments import RewardArguments
from .base import StageTrainer, run_stage_trainer, save_pair_predictions

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from ..config import Config

logger = logging.getLogger(__name__)

# The examples `data.get_dataset` builds for this stage (`formats.DATA_KINDS`); the registry records it too.
DATA_KIND = "preference"


# ---------------------------------------------------------------------------------------------------
# Pure tensor functions
# ---------------------------------------------------------------------------------------------------


def pairwise_reward_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: Optional[torch.Tensor] = None,
    center_rewards_coefficient: Optional[float] = None,
) -> torch.Tensor:
    """Bradley-Terry reward-model loss, with TRL's optional margin and centring terms.

    `loss = mean_i[-log sigmoid(r_c_i - r_r_i - m_i)] + c * mean_i[(r_c_i + r_r_i)^2]`
    (Ouyang et al. 2022, eq. 1, averaged over pairs instead of over the K-choose-2 comparisons of a prompt;
    the margin is Llama 2's (Touvron et al. 2023, eq. 2); the centring penalty is Eisenstein et al. 2023's,
    as in TRL's RewardTrainer).

    Args:
        chosen_rewards: [B] rewards of the preferred responses.
        rejected_rewards: [B] rewards of the dispreferred responses.
        margin: optional [B] per-pair margin the chosen reward must exceed the rejected one by.
        center_rewards_coefficient: optional weight c of the penalty pulling rewards towards zero.

    Returns:
        Scalar loss.
    """
    logits = chosen_rewards - rejected_rewards
    if margin is not None:
        logits = logits - margin.to(logits.dtype)
    loss = -F.logsigmoid(logits).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * torch.mean((chosen_rewards + rejected_rewards) ** 2)
    return loss


def reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, float]:
    """Means over pairs: chosen and rejected rewards, their margin, and the share ranked right.

    Args:
        chosen_rewards: [B]; rejected_rewards: [B].

    Returns:
        `rewards/chosen`, `rewards/rejected`, `rewards/margins`, `rewards/accuracies` (ties count as wrong).
    """
    chosen, rejected = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    return {
        "rewards/chosen": chosen.mean().item(),
        "rewards/rejected": rejected.mean().item(),
        "rewards/margins": (chosen - rejected).mean().item(),
        "rewards/accuracies": (chosen > rejected).float().mean().item(),
    }


# ---------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------


class RewardTrainer(StageTrainer):
    """`Trainer` whose loss is the pairwise reward loss over a batch of 2B rows (chosen first).

    Training logs `rewards/chosen`, `rewards/rejected`, `rewards/margins`, `rewards/accuracies`,
    averaged over the pairs of each logging step (`StageTrainer.record_metrics`). Evaluation and
    prediction return each pair's two rewards as predictions, so `compute_reward_eval_metrics` gives
    exact metrics over the whole set, and prediction can write them out.

    Args:
        center_rewards_coefficient: weight of the penalty pulling rewards towards zero (None: off).
        *args, **kwargs: as for `transformers.Trainer` (`data_collator` must be a pairwise collator);
            `args.padding_free` scores the batch's real tokens without padding (see `sequence_rewards`).
    """

    # The loss is a per-micro-batch mean over pairs: let Trainer divide it by the accumulation steps.
    loss_is_scaled_for_ga = False
    predictions_from_evaluation = True  # predict reuses the evaluation's pass (StageTrainer)
    accumulation_is_one_batch = True  # a mean over equal micro-batches (StageTrainer)

    def __init__(self, *args, center_rewards_coefficient: Optional[float] = None, **kwargs) -> None:
        kwargs.setdefault("compute_metrics", reward_eval_metrics())
        super().__init__(*args, **kwargs)
        self.center_rewards_coefficient = center_rewards_coefficient

    def _pair_rewards(self, model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        rewards = sequence_rewards(model, inputs["input_ids"], inputs["attention_mask"],
                                   padding_free=self.args.padding_free)
        chosen_rewards, rejected_rewards = rewards.chunk(2)
        return chosen_rewards, rejected_rewards

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chosen_rewards, rejected_rewards = self._pair_rewards(model, inputs)
        real = self.real_rows(chosen_rewards.shape[0])  # evaluation: without repeated pairs (several processes)
        margin = inputs.get("margin")
        loss = pairwise_reward_loss(chosen_rewards[:real], rejected_rewards[:real],
                                    None if margin is None else margin[:real], self.center_rewards_coefficient)
        if model.training:  # evaluation metrics come exact from the predictions (compute_reward_eval_metrics)
            self.record_metrics(reward_metrics(chosen_rewards, rejected_rewards), chosen_rewards.numel())
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, outputs, inputs = self.loss_and_outputs(model, inputs)
        if prediction_loss_only:
            return loss, None, None
        # [B, 2]: column 0 chosen, column 1 rejected. Labels are a dummy so that Trainer calls compute_metrics.
        logits = torch.stack([outputs["chosen_rewards"], outputs["rejected_rewards"]], dim=-1).detach()
        labels = torch.zeros(logits.shape[0], device=logits.device)
        return loss, logits, labels


def reward_eval_metrics() -> EvalMetric:
    """`compute_metrics` of a reward model: `compute_reward_eval_metrics` over every pair, whether the Trainer
    hands the pairs at once or batch by batch (`batch_eval_metrics`)."""

    def update(state: dict, rewards: np.ndarray, labels: np.ndarray) -> None:
        state.setdefault("rewards", []).append(np.asarray(rewards))

    def finish(state: dict) -> dict[str, float]:
        return compute_reward_eval_metrics(EvalPrediction(predictions=np.concatenate(state["rewards"]), label_ids=None))

    return EvalMetric(update, finish)


def compute_reward_eval_metrics(eval_pred: EvalPrediction) -> dict[str, float]:
    """Eval metrics over all pairs from `RewardTrainer` predictions ([num_pairs, 2]: chosen, rejected).

    Trainer prefixes them with `eval_`: `eval_accuracy`, `eval_rewards/chosen`, `eval_rewards/rejected`,
    `eval_rewards/margins`.
    """
    rewards = torch.as_tensor(np.asarray(eval_pred.predictions), dtype=torch.float32)
    metrics = reward_metrics(rewards[:, 0], rewards[:, 1])
    return {"accuracy": metrics.pop("rewards/accuracies"), **metrics}


# ---------------------------------------------------------------------------------------------------
# Stage entry point
# ---------------------------------------------------------------------------------------------------


def run_rm(config: "Config", callbacks: list["TrainerCallback"]) -> None:
    """Train and/or evaluate a reward model as `config` says; outputs go to `output_dir`."""
    from ..data import PairwiseCollator, get_dataset
    from ..model.loader import load_model, load_tokenizer
    from .base import check_splits

    tokenizer = load_tokenizer(config.model)
    datasets = get_dataset(config, tokenizer, DATA_KIND)
    check_splits(config, datasets)
    model = load_model(config.model, config.finetuning, is_trainable=config.training.do_train, head="reward")
    # Plain-transformers batched scoring of the saved model needs a pad id in its config.
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id

    trainer = RewardTrainer(
        model=model,
        args=config.training,
        data_collator=PairwiseCollator(tokenizer),
        processing_class=tokenizer,
        callbacks=callbacks,
        center_rewards_coefficient=config.method.center_rewards_coefficient,
        disable_dropout=config.method.disable_dropout,
        **datasets,
    )
    run_stage_trainer(trainer, config, save_predictions=lambda output: save_pair_predictions(
        config.training.output_dir, output.predictions, trainer.eval_dataset, tokenizer))


__all__ = [
    "RewardArguments",
    "pairwise_reward_loss",
    "reward_metrics",
    "RewardTrainer",
    "compute_reward_eval_metrics",
    "reward_eval_metrics",
    "run_rm",
]
