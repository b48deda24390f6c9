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

import json
import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import EvalPrediction, Trainer, set_seed

from ..model.padding_free import flatten_padded, last_token_per_sequence, row_token_bound

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from ..hparams import Config

logger = logging.getLogger(__name__)

PREDICTIONS_FILE = "generated_predictions.jsonl"


# ---------------------------------------------------------------------------------------------------
# Pure tensor functions
# ---------------------------------------------------------------------------------------------------


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each row's last real token, for left or right padding.

    Args:
        attention_mask: [N, L], 1 on real tokens and 0 on padding (at either end).

    Returns:
        [N] long tensor: the largest position whose mask is 1 (0 for an all-padding row).
    """
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * attention_mask.ne(0).long()).argmax(dim=-1)


def gather_last_token_scores(per_token_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's score at its last real token.

    Args:
        per_token_scores: [N, L] (or [N, L, 1]) score head output at every position.
        attention_mask: [N, L], 1 on real tokens, 0 on padding.

    Returns:
        [N] the score of each sequence.
    """
    if per_token_scores.dim() == 3:
        per_token_scores = per_token_scores.squeeze(-1)
    index = last_token_index(attention_mask).to(per_token_scores.device)
    return per_token_scores.gather(1, index.unsqueeze(1)).squeeze(1)


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
# Scoring with a sequence-classification model (shared with alignkit.score)
# ---------------------------------------------------------------------------------------------------


def find_score_head(model: nn.Module) -> nn.Module:
    """The `score` head of a (possibly PEFT- or DDP-wrapped) sequence-classification model.

    Under LoRA the head is PEFT's `ModulesToSaveWrapper`, which runs the active adapter's trained copy,
    so hooking it captures exactly what the forward computed.
    """
    inner = getattr(model, "module", model)  # DDP / DataParallel
    if hasattr(inner, "get_base_model"):  # PeftModel
        inner = inner.get_base_model()
    head = getattr(inner, "score", None)
    if not isinstance(head, nn.Module):
        raise TypeError(
            f"{type(inner).__name__} has no `score` head: the rm stage needs a sequence-classification model "
            "over a causal LM (load it with `load_model(..., head=\"reward\")` or "
            "`AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)`)."
        )
    return head


def sequence_rewards(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, padding_free: bool = False
) -> torch.Tensor:
    """One forward pass; each row's reward is the score at its last real token.

    Args:
        model: a sequence-classification model with `num_labels=1` (may be wrapped by PEFT or DDP).
        input_ids: [N, L] token ids, left- or right-padded.
        attention_mask: [N, L], 1 on real tokens.
        padding_free: run the batch's real tokens packed into rows (`alignkit.model.padding_free`) and read
            each score at its sequence's last token; the same rewards without computing padding.

    Returns:
        [N] float32 rewards (differentiable when grad is enabled).
    """
    flat = None
    if padding_free:
        flat = flatten_padded(input_ids, attention_mask, max_row_tokens=row_token_bound(model))
    captured: list[torch.Tensor] = []
    handle = find_score_head(model).register_forward_hook(lambda _module, _args, output: captured.append(output))
    try:
        if flat is None:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        else:
            # The model's own pad-id pooling result is ignored; the hook reads every position's score.
            model(input_ids=flat.input_ids, position_ids=flat.position_ids, use_cache=False)
    finally:
        handle.remove()
    expected = input_ids.shape if flat is None else flat.input_ids.shape
    if len(captured) != 1 or captured[0].shape[:2] != expected:
        raise RuntimeError("the score head did not run once on per-token hidden states; unsupported model layout.")
    if flat is None:
        return gather_last_token_scores(captured[0], attention_mask).float()
    scores = flat.from_rows(captured[0][..., 0])  # flat order
    return scores[last_token_per_sequence(flat.lengths)].float()


# ---------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------


class RewardTrainer(Trainer):
    """`Trainer` whose loss is the pairwise reward loss over a batch of 2B rows (chosen first).

    Training logs `rewards/chosen`, `rewards/rejected`, `rewards/margins`, `rewards/accuracies`,
    averaged over the micro-batches of each logging step. Evaluation returns each pair's two rewards
    as predictions, so `compute_reward_eval_metrics` gives exact eval metrics over the whole set.

    Args:
        center_rewards_coefficient: weight of the penalty pulling rewards towards zero (None: off).
        padding_free: score the batch's real tokens packed into rows (see `sequence_rewards`).
        *args, **kwargs: as for `transformers.Trainer` (`data_collator` must be a pairwise collator).
    """

    # The loss is a per-micro-batch mean over pairs: let Trainer divide it by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(self, *args, center_rewards_coefficient: Optional[float] = None, padding_free: bool = True,
                 **kwargs) -> None:
        kwargs.setdefault("compute_metrics", compute_reward_eval_metrics)
        super().__init__(*args, **kwargs)
        self.center_rewards_coefficient = center_rewards_coefficient
        self.padding_free = padding_free
        self._train_metrics: dict[str, list[float]] = defaultdict(list)

    def _pair_rewards(self, model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        rewards = sequence_rewards(model, inputs["input_ids"], inputs["attention_mask"], padding_free=self.padding_free)
        chosen_rewards, rejected_rewards = rewards.chunk(2)
        return chosen_rewards, rejected_rewards

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chosen_rewards, rejected_rewards = self._pair_rewards(model, inputs)
        loss = pairwise_reward_loss(
            chosen_rewards, rejected_rewards, inputs.get("margin"), self.center_rewards_coefficient
        )
        if model.training:
            for key, value in reward_metrics(chosen_rewards, rejected_rewards).items():
                self._train_metrics[key].append(value)
        if return_outputs:
            return loss, {"rewards_chosen": chosen_rewards, "rewards_rejected": rejected_rewards}
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        # [B, 2]: column 0 chosen, column 1 rejected. Labels are a dummy so that Trainer calls compute_metrics.
        logits = torch.stack([outputs["rewards_chosen"], outputs["rewards_rejected"]], dim=-1).detach()
        labels = torch.zeros(logits.shape[0], device=logits.device)
        return loss, logits, labels

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        if "loss" in logs and self._train_metrics:
            logs.update({key: sum(values) / len(values) for key, values in self._train_metrics.items()})
            self._train_metrics.clear()
        super().log(logs, start_time)


def compute_reward_eval_metrics(eval_pred: EvalPrediction) -> dict[str, float]:
    """Eval metrics over all pairs from `RewardTrainer` predictions ([num_pairs, 2]: chosen, rejected).

    Trainer prefixes them with `eval_`: `eval_accuracy`, `eval_rewards/chosen`, `eval_rewards/rejected`,
    `eval_rewards/margins`.
    """
    rewards = torch.as_tensor(np.asarray(eval_pred.predictions), dtype=torch.float32)
    metrics = reward_metrics(rewards[:, 0], rewards[:, 1])
    return {"accuracy": metrics.pop("rewards/accuracies"), **metrics}


def save_reward_predictions(output_dir: str | os.PathLike, predictions: np.ndarray) -> Path:
    """Write `generated_predictions.jsonl`: one `{"chosen": r_c, "rejected": r_r}` per pair, in dataset order."""
    path = Path(output_dir) / PREDICTIONS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for chosen, rejected in np.asarray(predictions).reshape(-1, 2).tolist():
            f.write(json.dumps({"chosen": round(chosen, 6), "rejected": round(rejected, 6)}) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------
# Stage entry point
# ---------------------------------------------------------------------------------------------------


def run_rm(config: "Config", callbacks: list["TrainerCallback"]) -> None:
    """Train and/or evaluate a reward model as `config` says; outputs go to `output_dir`."""
    from ..data import PairwiseCollator, get_dataset
    from ..model.loader import load_model, load_tokenizer
    from ..train import finish_training, save_eval_metrics

    tokenizer = load_tokenizer(config.model)
    datasets = get_dataset(config, tokenizer, "rm")
    # A fresh score head is initialised randomly while loading: seed first so that runs repeat.
    set_seed(config.training.seed)
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
        center_rewards_coefficient=config.finetuning.center_rewards_coefficient,
        padding_free=config.finetuning.padding_free,
        **datasets,
    )
    if config.training.do_train:
        result = trainer.train(resume_from_checkpoint=config.training.resume_from_checkpoint)
        finish_training(trainer, result, config)
    if config.training.do_eval:
        save_eval_metrics(trainer, trainer.evaluate(metric_key_prefix="eval"), "eval")
    if config.training.do_predict:
        output = trainer.predict(datasets["eval_dataset"], metric_key_prefix="predict")
        save_eval_metrics(trainer, output.metrics, "predict")
        path = save_reward_predictions(config.training.output_dir, output.predictions)
        logger.info("Wrote each pair's chosen and rejected rewards to %s", path)


__all__ = [
    "last_token_index",
    "gather_last_token_scores",
    "pairwise_reward_loss",
    "reward_metrics",
    "find_score_head",
    "sequence_rewards",
    "RewardTrainer",
    "compute_reward_eval_metrics",
    "save_reward_predictions",
    "run_rm",
]
