"""Kahneman-Tversky optimisation (Ethayarajh et al. 2024): alignment from replies marked good or bad, unpaired.

Each example is one prompt with one reply and a flag: desirable or undesirable. The policy's implicit
reward of a reply is `r = beta * (log pi(y|x) - log pi_ref(y|x))`, and it is judged against a reference
point `z0`, the policy's KL divergence from the reference. Desirable replies are pushed above it,
undesirable ones below, through a sigmoid value function (the paper's KTO loss; TRL cites it as eq. 7).

What this file simplifies, and why:
- `z0` is estimated as TRL 1.16 estimates it: from mismatched (prompt, reply) pairs of the same batch, the
  mean of `log pi(y'|x) - log pi_ref(y'|x)` over them, clamped at 0 and detached (no gradient flows
  through the reference point). The mismatched rows are added to the dataset when the trainer is built:
  each row's prompt with the reply of the row before it within its group of `per_device_train_batch_size` x
  processes consecutive rows (the first takes the group's last), TRL's rotation (TRL groups by the
  per-device batch; here the group is a step's rows over all processes, so N processes x batch b build the
  mismatched rows one process x batch N*b builds, and train as it does). Under sequential sampling
  (`train_sampling_strategy: sequential`, TRL's default for KTO) a batch is such a group, so its
  mismatched replies are its own replies paired with other prompts, as the paper recommends. Under the
  default random sampling each prompt still meets a reply written for another prompt, which is how
  LLaMA-Factory builds its KL pairs (fixed neighbours, shuffled batches). With one example per device
  there is no batch to rotate in, so the group is the whole dataset (each row paired with the reply of
  the row before it, LLaMA-Factory's pairing); TRL refuses that batch size, LLaMA-Factory's example
  configs use it. Evaluation sets get their mismatched rows the same way (grouped by the training batch size
  x processes, as TRL groups them by the training batch size), and each evaluation batch estimates its own z0. Under several processes a
  batch is the union of the processes' batches (z0 from all their mismatched rows, without the rows accelerate
  repeats to fill the last evaluation round), so N processes x batch b estimate what one process x N*b does.
- Rows with images (a vision-language model, `alignkit.data.multimodal`) run padded with their pixel inputs; a
  mismatched row keeps its own row's prompt and images whole (only the borrowed reply is cut to fit).
- The reference is the policy at step 0, as in DPO (`StageTrainer.reference()`): the adapter disabled
  under LoRA, a frozen in-memory copy under full / freeze fine-tuning. Its log-probs are computed on the fly,
  or with `precompute_ref_log_probs` (TRL's key) once per dataset when the trainer is built, for the replies
  and the KL rows alike, and cached on disk as DPO's are (`reference_cache`): a step then runs the policy alone,
  and so does every evaluation. The KL rows are fixed when the trainer is built, so their reference
  log-probs are too.
- The loss is the mean over the batch's examples of the weighted per-example losses (TRL's `nanmean`
  over the concatenated desirable and undesirable losses); `kto_chosen_weight` / `kto_rejected_weight`
  (TRL: `desirable_weight` / `undesirable_weight`) rebalance data with unequal shares of the two.
- `pref_ftx` adds the mean over desirable replies of each reply's NLL per token (the same term as DPO's
  `pref_ftx` on chosen replies). LLaMA-Factory scales its version by `batch size / desirable count`; this one
  is not rescaled.
- Metrics under TRL 1.16's names: `kl`, `rewards/chosen` and `logps/chosen` (means over the desirable
  examples), `rewards/rejected` and `logps/rejected` (over the undesirable ones), `rewards/margins` (the
  difference of the two means over the batch, all processes' rows, as TRL forms it). TRL
  averages a logging window's batch values with equal weight; here each value counts for the examples it
  covers (the same number when the window is one batch). TRL's `logits/*` and `entropy` need the full
  vocabulary logits, which alignkit never builds, and are not logged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..constants import IGNORE_INDEX
from ..data.multimodal import IMAGE_COLUMN
from ..errors import ConfigError
from ..jsonl import write_jsonl
from ..model.logprobs import forward_sequence_logps
from .arguments import KTOArguments
from .base import PREDICTIONS_FILE, StageTrainer, run_stage_trainer
from .reference_cache import CollateWithReference, precompute_reference_logps
from .dpo import chosen_nll_loss

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import TrainerCallback

    from ..config import Config

logger = logging.getLogger(__name__)

# The examples `data.get_dataset` builds for this stage (`formats.DATA_KINDS`); the registry records it too.
DATA_KIND = "unpaired"

KL_LOSSES = ("kto",)  # the loss types whose reference point is the KL estimate
# The precomputed reference columns (`precompute_ref_log_probs`): the replies', then the KL rows' (KL losses only),
# and what they depend on besides the reference's weights (`reference_cache`).
REF_COLUMNS = ("ref_logps", "ref_kl_logps")
TOKEN_COLUMNS = ("input_ids", "labels", "kl_input_ids", "kl_labels", IMAGE_COLUMN)


def check_config(config: "Config") -> None:
    """What `stage: kto` refuses beyond its own keys."""
    if config.training.predict_with_generate:
        raise ConfigError("predict_with_generate applies to stage sft, not kto; remove it.")


# ---------------------------------------------------------------------------------------------------
# Pure tensor functions. B = examples in the batch; log-probs are per-sequence sums.
# ---------------------------------------------------------------------------------------------------


def kl_estimate(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0 estimated from mismatched pairs, as TRL 1.16 forms it.

    `z0 = max(0, mean(kl_logps - ref_kl_logps))`, detached: the reference point moves no weights.

    Args:
        kl_logps: [B] policy log-probs of replies under prompts they were not written for.
        ref_kl_logps: [B] reference log-probs of the same.

    Returns:
        Scalar z0 (0-dim tensor).
    """
    return (kl_logps - ref_kl_logps).mean().clamp(min=0).detach()


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example KTO losses (Ethayarajh et al. 2024; eq. 7 as TRL 1.16 cites it) and the implicit rewards.

    With `h = log pi(y|x) - log pi_ref(y|x)`:
    - kto: desirable `w_d * (1 - sigmoid(beta * (h - z0)))`, undesirable `w_u * (1 - sigmoid(beta * (z0 - h)))`.
    - apo_zero_unpaired (D'Oosterlinck et al. 2024, eq. 7 unpaired, as TRL 1.16): desirable
      `w_d * (1 - sigmoid(beta * h))`, undesirable `w_u * sigmoid(beta * h)`; z0 is not used.

    Args:
        policy_logps: [B] summed policy log-probs of the replies.
        ref_logps: [B] summed reference log-probs of the same.
        desirable: [B] bool, True for a desirable reply.
        kl: z0, the reference point (see `kl_estimate`).
        beta: scales the log-ratio.
        desirable_weight, undesirable_weight: w_d and w_u.
        loss_type: kto or apo_zero_unpaired.

    Returns:
        `(losses [B], rewards [B])` in the input order; rewards `beta * h` are detached.
    """
    logratios = policy_logps - ref_logps
    if loss_type == "kto":
        desirable_losses = 1 - torch.sigmoid(beta * (logratios - kl))
        undesirable_losses = 1 - torch.sigmoid(beta * (kl - logratios))
    elif loss_type == "apo_zero_unpaired":
        desirable_losses = 1 - torch.sigmoid(beta * logratios)
        undesirable_losses = torch.sigmoid(beta * logratios)
    else:
        raise ValueError(f"loss_type={loss_type!r}: choose kto or apo_zero_unpaired.")
    losses = torch.where(desirable, desirable_weight * desirable_losses, undesirable_weight * undesirable_losses)
    return losses, beta * logratios.detach()


# ---------------------------------------------------------------------------------------------------
# Mismatched (prompt, reply) rows for the KL estimate
# ---------------------------------------------------------------------------------------------------


def rotated_partners(num_rows: int, group_size: int) -> list[int]:
    """For each row, the row whose reply it borrows: the one before it within its group of `group_size`
    consecutive rows, the group's last for its first (TRL's rotation: `(x1, yn), (x2, y1), ..., (xn, yn-1)`).

    Example: 5 rows in groups of 2 -> groups (0, 1), (2, 3), (4) -> partners [1, 0, 3, 2, 4].
    """
    partners = []
    for start in range(0, num_rows, group_size):
        group = list(range(start, min(start + group_size, num_rows)))
        partners += group[-1:] + group[:-1]
    return partners


def _prompt_length(labels: list[int]) -> int:
    """Tokens before the first labelled one (KTO rows never train on their prompt)."""
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def with_mismatched_rows(dataset: "Dataset", group_size: int, max_length: Optional[int] = None) -> "Dataset":
    """`dataset` plus `kl_input_ids` / `kl_labels`: each row's prompt followed by its partner's reply
    (`rotated_partners`), labels -100 on the prompt.

    Args:
        dataset: tokenised unpaired rows (`input_ids`, `labels`).
        group_size: rows per rotation group (`per_device_train_batch_size` x processes; the whole dataset at 1).
        max_length: when a prompt and a borrowed reply exceed it, both are cut as `cutoff_len` cuts a row
            (the prompt keeps its end, the reply its start).
    """
    from ..data.processors import infer_seqlen

    from ..data.multimodal import has_images

    if "kl_input_ids" in dataset.column_names:
        return dataset
    # A prompt with images keeps all its tokens (a cut image would no longer match its pixels): only the reply is cut.
    whole_prompts = has_images(dataset)
    input_ids, labels = dataset["input_ids"], dataset["labels"]
    prompt_lengths = [_prompt_length(row) for row in labels]
    kl_input_ids, kl_labels = [], []
    for i, j in enumerate(rotated_partners(len(dataset), group_size if group_size > 1 else len(dataset))):
        prompt, reply = input_ids[i][:prompt_lengths[i]], input_ids[j][prompt_lengths[j]:]
        if max_length is not None and len(prompt) + len(reply) > max_length and whole_prompts:
            reply = reply[:max(max_length - len(prompt), 0)]
        elif max_length is not None and len(prompt) + len(reply) > max_length:
            source_len, target_len = infer_seqlen(len(prompt), len(reply), max_length)
            prompt, reply = prompt[len(prompt) - source_len:], reply[:target_len]
        kl_input_ids.append(prompt + reply)
        kl_labels.append([IGNORE_INDEX] * len(prompt) + reply)
    return dataset.add_column("kl_input_ids", kl_input_ids).add_column("kl_labels", kl_labels)


# ---------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------


class KTOTrainer(StageTrainer):
    """`Trainer` whose loss is KTO's over a batch of unpaired rows (`UnpairedCollator`).

    Args:
        kto_args: `pref_beta`, `kto_chosen_weight`, `kto_rejected_weight`, `pref_ftx`, `loss_type`,
            `precompute_ref_log_probs`.
        ref_model: an explicit frozen reference model. Default: the policy with its LoRA adapter disabled,
            or a frozen in-memory deep copy of the policy as it is now (full / freeze fine-tuning; under ZeRO-3
            the policy's source loaded again, partitioned: `StageTrainer`).
        kl_max_length: the most tokens of a mismatched row (`cutoff_len`); None: no cut.
        *args, **kwargs: as for `transformers.Trainer`; `args.padding_free` runs the batch's real tokens only.
    """

    # The loss is a per-micro-batch mean over examples: let Trainer divide it by the accumulation steps.
    loss_is_scaled_for_ga = False
    predictions_from_evaluation = True  # predict reuses the evaluation's pass (StageTrainer)
    no_reference_copy_message = (
        "precompute_ref_log_probs=true with full/freeze fine-tuning keeps no reference copy, and the policy has "
        "been trained since: reference log-probs exist only for the datasets given when the trainer was built. "
        "Pass this dataset as eval_dataset then, or set precompute_ref_log_probs=false."
    )

    def __init__(self, *args, kto_args: KTOArguments, ref_model: Optional[nn.Module] = None,
                 kl_max_length: Optional[int] = None, **kwargs) -> None:
        self.beta = kto_args.pref_beta
        self.desirable_weight = kto_args.kto_chosen_weight
        self.undesirable_weight = kto_args.kto_rejected_weight
        self.pref_ftx = kto_args.pref_ftx
        self.loss_type = kto_args.loss_type
        self.uses_kl = self.loss_type in KL_LOSSES
        self.precompute_ref_logps = kto_args.precompute_ref_log_probs
        self.reference_columns = REF_COLUMNS if self.uses_kl else REF_COLUMNS[:1]
        if self.precompute_ref_logps and kwargs.get("data_collator") is not None:
            kwargs["data_collator"] = CollateWithReference(kwargs["data_collator"], self.reference_columns)
        kwargs.setdefault("disable_dropout", kto_args.disable_dropout)
        super().__init__(*args, ref_model=ref_model, keep_reference_copy=not self.precompute_ref_logps, **kwargs)
        if self.uses_kl:
            # A step's rows over all processes (what one process with the whole batch would group).
            group = self.args.per_device_train_batch_size * self.args.world_size
            if group == 1:
                logger.info("per_device_train_batch_size=1: each example's KL row borrows the reply of the example "
                            "before it in the dataset (a batch of one has no other reply to borrow).")
            if self.train_dataset is not None:
                self.train_dataset = with_mismatched_rows(self.train_dataset, group, kl_max_length)
            if isinstance(self.eval_dataset, dict):
                self.eval_dataset = {k: with_mismatched_rows(v, group, kl_max_length)
                                     for k, v in self.eval_dataset.items()}
            elif self.eval_dataset is not None:
                self.eval_dataset = with_mismatched_rows(self.eval_dataset, group, kl_max_length)
        if self.precompute_ref_logps:  # before any update (the KL rows are fixed above, so theirs can be too)
            precompute_reference_logps(self, self.reference_columns, TOKEN_COLUMNS, self.reference_logps)
        if self.train_dataset is not None and hasattr(self.train_dataset, "column_names"):
            _warn_if_unbalanced(self.train_dataset["desirable"], self.desirable_weight, self.undesirable_weight)

    def _sequence_logps(self, model: nn.Module, inputs: dict[str, torch.Tensor], prefix: str = ""
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed log-probs [B] and reply lengths [B] of the batch's rows (`prefix="kl_"`: its mismatched rows).

        With images, a mismatched row has its own row's prompt, so it takes the same pixel inputs."""
        from ..data.multimodal import image_inputs

        pixels = image_inputs(inputs)  # a vision-language batch runs padded, with its images
        return forward_sequence_logps(model, inputs[f"{prefix}input_ids"], inputs[f"{prefix}attention_mask"],
                                      inputs[f"{prefix}labels"], padding_free=self.args.padding_free and not pixels,
                                      model_inputs=pixels)

    def _row_and_kl_logps(self, model: nn.Module, inputs: dict[str, torch.Tensor]
                          ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """`_sequence_logps` of the rows and of their mismatched rows; one padding-free forward for both when it can.

        A mismatched row starts with its own row's prompt, so in one forward the prompt runs once for both
        (`alignkit.model.padding_free.flatten_for_model` shares prefixes): for passes without gradients (the
        reference, evaluation), where no backward pays for the mismatched rows' tokens.
        """
        from ..data.multimodal import image_inputs

        if not self.args.padding_free or image_inputs(inputs):
            return self._sequence_logps(model, inputs), self._sequence_logps(model, inputs, "kl_")
        width = max(inputs["input_ids"].size(1), inputs["kl_input_ids"].size(1))
        both = {}
        for name, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", IGNORE_INDEX)):
            # Widened on the right: each row's real tokens stay contiguous, which is all the padding-free layout needs.
            both[name] = torch.cat([F.pad(inputs[f"{prefix}{name}"], (0, width - inputs[f"{prefix}{name}"].size(1)),
                                          value=fill) for prefix in ("", "kl_")])
        logps, lengths = forward_sequence_logps(model, both["input_ids"], both["attention_mask"], both["labels"],
                                                padding_free=True)
        rows = inputs["input_ids"].size(0)
        return (logps[:rows], lengths[:rows]), (logps[rows:], lengths[rows:])

    def reference_logps(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Summed reference log-probs of the batch's rows [B] and, with the KL term, of its mismatched rows [B]."""
        with self.reference() as reference:
            if not self.uses_kl:
                return (self._sequence_logps(reference, inputs)[0],)
            (ref_logps, _), (ref_kl_logps, _) = self._row_and_kl_logps(reference, inputs)
        return ref_logps, ref_kl_logps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        kl_logps = None
        if self.uses_kl and not torch.is_grad_enabled() and "kl_input_ids" in inputs:  # evaluation: one forward
            (logps, lengths), (kl_logps, _) = self._row_and_kl_logps(model, inputs)
        else:
            logps, lengths = self._sequence_logps(model, inputs)
        desirable = inputs["desirable"].bool()
        kl: torch.Tensor | float = 0.0
        if self.reference_columns[0] in inputs:  # precomputed (`precompute_ref_log_probs`)
            ref_logps, *ref_kl = (inputs[column] for column in self.reference_columns)
        else:
            parts = ("", "kl_") if self.uses_kl else ("",)  # a row's reply and, with the KL term, its KL row
            ref_logps, *ref_kl = self.kept_reference(inputs, self.reference_logps,
                                                     [[(p, i) for p in parts] for i in range(logps.shape[0])])
        if self.uses_kl:
            (ref_kl_logps,) = ref_kl
            if kl_logps is None:
                with torch.no_grad():  # z0 is a detached reference point: no graph for the policy's KL pass
                    kl_logps, _ = self._sequence_logps(model, inputs, "kl_")
            # z0 of the whole batch (every process's real rows, as one process with the whole batch would form
            # it; TRL averages the processes' estimates, the same when their batches are equal).
            kl = kl_estimate(*self.gather_real_rows(kl_logps, ref_kl_logps))

        losses, rewards = kto_loss(logps, ref_logps, desirable, kl, beta=self.beta,
                                   desirable_weight=self.desirable_weight,
                                   undesirable_weight=self.undesirable_weight, loss_type=self.loss_type)
        real = self.real_rows(losses.shape[0])  # evaluation: without repeated rows (several processes)
        loss = losses[:real].mean()
        real_desirable = desirable.clone()
        real_desirable[real:] = False
        if self.pref_ftx and real_desirable.any():
            loss = loss + self.pref_ftx * chosen_nll_loss(logps[real_desirable], lengths[real_desirable]).mean()

        self._record_kto_metrics(logps.detach(), rewards, desirable, kl)
        if return_outputs:
            return loss, {"rewards": rewards}
        return loss

    def _record_kto_metrics(self, logps: torch.Tensor, rewards: torch.Tensor, desirable: torch.Tensor,
                            kl: torch.Tensor | float) -> None:
        """Each metric counts for the real examples it is a mean over (the desirable ones for `*/chosen`).

        The margin is the difference of the whole batch's means (every process's real rows, as TRL forms it), so
        N processes report what one process with their joint batch reports.
        """
        num_rows = desirable.numel()
        self.record_metrics({"kl": kl}, num_rows)
        self.record_metrics({"rewards/chosen": rewards[desirable], "logps/chosen": logps[desirable]},
                            int(desirable.sum()), rows=desirable)
        self.record_metrics({"rewards/rejected": rewards[~desirable], "logps/rejected": logps[~desirable]},
                            int((~desirable).sum()), rows=~desirable)
        batch_rewards, batch_desirable = self.gather_real_rows(rewards, desirable)
        if batch_desirable.any() and not batch_desirable.all():
            margin = batch_rewards[batch_desirable].mean() - batch_rewards[~batch_desirable].mean()
            self.record_metrics({"rewards/margins": margin}, num_rows)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss; unless `prediction_loss_only`, each example's implicit reward [B] and its flag [B]."""
        loss, outputs, inputs = self.loss_and_outputs(model, inputs)
        if prediction_loss_only:
            return loss, None, None
        return loss, outputs["rewards"], inputs["desirable"].long()


def _warn_if_unbalanced(desirable: list[bool], desirable_weight: float, undesirable_weight: float) -> None:
    """Warn when the weights leave one kind of reply dominating the loss.

    The KTO paper advises `w_d * n_d / (w_u * n_u)` in [1, 4/3]; this warns outside that range and names the
    `kto_chosen_weight` range that reaches it (TRL warns likewise, naming either weight).
    """
    num_desirable = sum(bool(d) for d in desirable)
    num_undesirable = len(desirable) - num_desirable
    if not num_desirable or not num_undesirable:
        logger.warning("The training set holds only %s replies: KTO then has nothing to contrast them with.",
                       "desirable" if num_desirable else "undesirable")
        return
    ratio = desirable_weight * num_desirable / (undesirable_weight * num_undesirable)
    if not 1.0 <= ratio <= 4 / 3:
        suggested = undesirable_weight * num_undesirable / num_desirable
        logger.warning("%d desirable and %d undesirable replies with kto_chosen_weight=%g and kto_rejected_weight=%g "
                       "give a desirable:undesirable loss weight of %.2f; the KTO paper advises 1 to 4/3. Set "
                       "kto_chosen_weight to about %.2f-%.2f.", num_desirable, num_undesirable, desirable_weight,
                       undesirable_weight, ratio, suggested, suggested * 4 / 3)


# ---------------------------------------------------------------------------------------------------
# Stage entry point
# ---------------------------------------------------------------------------------------------------


def save_unpaired_predictions(output_dir: str, rewards: Any, desirable: Any, dataset: Any = None,
                              tokenizer: Any = None) -> Path:
    """Write `generated_predictions.jsonl`: one line per example, in dataset order.

    Each line holds the implicit `reward` and the `desirable` flag and, given the dataset and tokenizer,
    the text scored: `prompt` and `completion`, decoded from the tokens the model saw (special tokens
    dropped), as the rm and dpo predictions carry theirs.
    """
    from .base import split_prompt_reply

    rewards = np.asarray(rewards).reshape(-1).tolist()
    flags = np.asarray(desirable).reshape(-1).tolist()
    rows = []
    for i, (reward, flag) in enumerate(zip(rewards, flags)):
        row: dict[str, Any] = {}
        if dataset is not None and tokenizer is not None:
            prompt_ids, reply_ids = split_prompt_reply(dataset[i]["input_ids"], dataset[i]["labels"])
            prompt, completion = tokenizer.batch_decode([prompt_ids, reply_ids], skip_special_tokens=True)
            row = {"prompt": prompt, "completion": completion}
        row.update(reward=round(reward, 6), desirable=bool(flag))
        rows.append(row)
    return write_jsonl(Path(output_dir) / PREDICTIONS_FILE, rows)


def run_kto(config: "Config", callbacks: list["TrainerCallback"]) -> None:
    """Train, evaluate and predict with the KTO loss as `config` says; outputs go to `output_dir`.

    Prediction writes each example's implicit reward (`beta * (policy - reference)` log-probs) and its
    desirable flag to `generated_predictions.jsonl`.
    """
    from ..data import UnpairedCollator, get_dataset
    from ..data.multimodal import image_collator
    from ..model.loader import load_image_processing, load_model, load_tokenizer
    from .base import check_splits

    tokenizer = load_tokenizer(config.model)
    images = load_image_processing(config.model, tokenizer)
    datasets = get_dataset(config, tokenizer, DATA_KIND, images=images)
    check_splits(config, datasets)
    model = load_model(config.model, config.finetuning, is_trainable=config.training.do_train, vision=True)
    data_collator = UnpairedCollator(tokenizer)
    if images is not None:
        data_collator = image_collator(data_collator, images,
                                       stepping_aside=["padding_free"] if config.training.padding_free else [])
    trainer = KTOTrainer(
        model=model,
        args=config.training,
        kto_args=config.method,
        kl_max_length=config.data.cutoff_len,
        data_collator=data_collator,
        processing_class=tokenizer,
        callbacks=callbacks,
        **datasets,
    )
    run_stage_trainer(trainer, config, save_predictions=lambda output: save_unpaired_predictions(
        config.training.output_dir, output.predictions, output.label_ids, trainer.eval_dataset, tokenizer))
    if images is not None and config.training.do_train and trainer.is_world_process_zero():
        images.save(config.training.output_dir)


__all__ = [
    "kl_estimate",
    "kto_loss",
    "rotated_partners",
    "with_mismatched_rows",
    "KTOArguments",
    "check_config",
    "KTOTrainer",
    "save_unpaired_predictions",
    "run_kto",
]
