"""Supervised fine-tuning (`stage: sft`) and causal-LM pre-training on raw text (`stage: pt`).

Both stages minimise the next-token cross-entropy on the tokens whose label is not -100: for SFT the
data layer masks everything but the assistant replies, for PT every token is a target. What this
module adds to `transformers.Trainer`:

- `compute_loss` sums the token losses and divides by the number of target tokens of the whole
  optimisation step (`num_items_in_batch`, counted by the Trainer over all gradient-accumulation
  micro-batches), so a step of 8 rows x 1 micro-batch and one of 1 row x 8 micro-batches give the same
  loss and gradients. A per-micro-batch mean would weight short replies more.
- packed rows (`packing: true`) carry `position_ids`; the loss is then the unpacked loss (see
  `alignkit.data.packing`). With `padding_free` (the default) a training step splits them back into their
  examples (`unpack_rows`) and runs those padding-free as below; evaluation runs the rows as they are, the
  block-diagonal mask derived from the position resets.
- unpacked batches are trained padding-free by default (`padding_free`): the real tokens of the batch
  run packed into rows no wider than its longest example, position ids restarting per example
  (`alignkit.model.padding_free`), each example's first label set to -100 so no token is predicted
  across a boundary. Same loss, none of the padding's compute or activations; the token count
  (`num_items_in_batch`) is the padded batch's.
- `prediction_step` with `predict_with_generate` generates with the KV cache from left-aligned prompts
  and returns only the new tokens; `save_predictions` writes `generated_predictions.jsonl`.
- evaluation without generation reports `accuracy` from argmax ids, never the eval set's logits.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.nn.functional as F
from transformers import InfNanRemoveLogitsProcessor, LogitsProcessorList

from ..constants import IGNORE_INDEX
from ..config import Config, GeneratingArguments
from ..data.packing import PackedCollator, pack_dataset, unpack_rows
from ..errors import ConfigError
from ..jsonl import write_jsonl
from ..metrics import argmax_logits, decode_token_ids, similarity_metrics, token_accuracy_metric
from ..model.generation import generate, stop_token_ids
from ..model.logprobs import forward_sequence_logps
from ..model.padding_free import (
    attention_slot_cost,
    first_token_unlabelled,
    flatten_padded,
    packed_attention,
    row_token_bound,
    unflatten_to_padded,
)
from .base import PREDICTIONS_FILE, StageTrainer, check_splits, run_stage_trainer

logger = logging.getLogger(__name__)

# The examples `data.get_dataset` builds for these stages (`formats.DATA_KINDS`); the registry records it too.
PT_DATA_KIND = "text"  # pretraining blocks
SFT_DATA_KIND = "supervised"  # prompt + reply with a label mask


def sft_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Next-token cross-entropy summed over target tokens, divided by the step's target-token count.

    Position t predicts label t + 1; labels equal to -100 (prompt, padding, the first token of a
    packed example) are not targets. With `label_smoothing` eps (transformers' `label_smoothing_factor`) each
    target's loss is `(1 - eps) * nll + eps * mean over the vocabulary of -log p`, as transformers'
    `LabelSmoother` computes it (the target spread as eps / V over every token).

    Args:
        logits: (batch, seq, vocab) model outputs.
        labels: (batch, seq) target ids aligned with the inputs (not yet shifted), -100 where ignored.
        num_items_in_batch: target tokens in the whole optimisation step (all accumulated micro-batches,
            counted over `labels[:, 1:]`). None: this batch's own count, i.e. the per-batch mean.
        label_smoothing: eps in [0, 1); 0 is the plain cross-entropy.

    Returns:
        Scalar loss. With `num_items_in_batch`, summing it over the step's micro-batches gives the
        step's mean token loss.
    """
    # Shift the labels rather than the logits: a view of the logits avoids copying (batch, seq, vocab).
    shifted_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    total = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        shifted_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    if num_items_in_batch is None:
        num_items_in_batch = (shifted_labels != IGNORE_INDEX).sum()
    count = torch.as_tensor(num_items_in_batch, device=total.device)
    # A step without targets (every reply cut off by cutoff_len) contributes 0, not NaN.
    return total / count.clamp(min=1)


class SFTTrainer(StageTrainer):
    """`Trainer` with step-normalised token loss, generation-based prediction and a predictions file.

    Args:
        generating_args: generation settings for `predict_with_generate`.
        template: the `template` key: generation stops at its end-of-turn token (None: the tokenizer's own).
        *args, **kwargs: as for `transformers.Trainer`; `args.padding_free` runs unpacked batches as their
            real tokens packed into rows in `compute_loss`.
    """

    # `compute_loss` divides by the step's token count itself, so training_step must not divide again.
    loss_is_scaled_for_ga = True
    accumulation_is_one_batch = True  # the loss is a token sum over the step (StageTrainer)

    def __init__(self, *args, generating_args: GeneratingArguments | None = None, template: str | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.generating_args = generating_args or GeneratingArguments()
        self.template = template
        # Make the Trainer count target tokens for every step whatever the model class declares
        # (our compute_loss consumes the count, not the model), and count them over labels[:, 1:],
        # the positions sft_loss actually scores.
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Forward without labels, then `sft_loss` over the step's target-token count."""
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        flat = None
        # Padding-free layouts hold text only: a batch with images (pixel_values) runs padded, as the model takes it.
        padding_free = self.args.padding_free and "pixel_values" not in inputs
        smoothing = float(self.args.label_smoothing_factor or 0.0)
        # Label smoothing reads every logit of a target position; the lean path below computes only the target's.
        if padding_free and not return_outputs and not smoothing and "attention_mask" in inputs:
            # Training: only the sum of the targets' log-probs is needed, so the output layer runs on the
            # labelled positions alone (a prompt token's logits carry no loss) and log-probs are gathered
            # chunk by chunk, never holding a (tokens x vocab) log-softmax (`alignkit.model.logprobs`).
            input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
            if "position_ids" in inputs:
                # Packed rows (`packing: true`): their examples, one per row, take the same padding-free forward
                # (each attending to itself alone, shared prefixes run once) instead of a block mask per row.
                input_ids, attention_mask, labels = unpack_rows(input_ids, inputs["position_ids"], attention_mask,
                                                                labels)
            summed_logps, _ = forward_sequence_logps(model, input_ids, attention_mask, labels, padding_free=True)
            return self._scaled(-summed_logps.sum(), labels, num_items_in_batch)
        if "position_ids" in inputs:
            # Packed rows: transformers derives the block-diagonal mask from position resets only
            # when no 2D mask is given (the collator still returns it so the Trainer can count tokens).
            inputs.pop("attention_mask", None)
        elif padding_free and "attention_mask" in inputs:
            # The same mechanism for an unpacked batch: its real tokens packed into rows. sft_loss shifts labels
            # along each row, so each example's first label must not be a target of the previous example.
            flat = flatten_padded(inputs.pop("input_ids"), inputs.pop("attention_mask"), labels,
                                  max_row_tokens=row_token_bound(model), slot_cost=attention_slot_cost(model))
            inputs.update(input_ids=flat.input_ids, position_ids=flat.position_ids)
            labels = first_token_unlabelled(flat.labels, flat.to_rows(flat.sequence_index, fill=-1))
        # No KV cache in a training forward: it is useless there and disables the packed-sequence mask.
        with packed_attention(model, flat) if flat is not None else contextlib.nullcontext():
            outputs = model(**inputs, use_cache=False)
        loss = sft_loss(outputs.logits, labels, num_items_in_batch, label_smoothing=smoothing)
        if flat is not None and return_outputs:
            # Evaluation compares the logits with the padded labels: give them back in that layout.
            outputs.logits = unflatten_to_padded(flat.from_rows(outputs.logits), flat.real)
        loss = self._across_devices(loss, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def _scaled(self, total_nll: torch.Tensor, labels: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        """`total_nll` divided as `sft_loss` divides: by the step's target count (this batch's if unknown)."""
        if num_items_in_batch is None:
            num_items_in_batch = (labels[:, 1:] != IGNORE_INDEX).sum()
        count = torch.as_tensor(num_items_in_batch, device=total_nll.device)
        return self._across_devices(total_nll / count.clamp(min=1), num_items_in_batch)

    def _across_devices(self, loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # The count is summed over processes while DDP averages gradients: undo the average.
            loss = loss * self.accelerator.num_processes
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Loss-based evaluation as usual; with `predict_with_generate`, (None, new tokens, labels).

        The generated ids exclude the prompt (`model.generation.generate` left-aligns prompts, so every
        row's new tokens start at the same column whichever side the collator padded). Rows stop at the
        end-of-turn token of the configured template (and at eos) and are filled with the pad id after it.
        """
        if not self.args.predict_with_generate or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        tokenizer = self.processing_class
        out = generate(
            model, tokenizer, inputs["input_ids"], inputs["attention_mask"],
            stop_token_ids=stop_token_ids(tokenizer, self.template),
            generation_kwargs={**self.generating_args.to_generation_kwargs(),
                               "logits_processor": LogitsProcessorList([InfNanRemoveLogitsProcessor()])},
        )
        return None, out.completion_ids, inputs.get("labels")

    def save_predictions(self, dataset, predict_results) -> str:
        """Write `generated_predictions.jsonl` (`prompt`, `predict`, `label` per example); returns its path."""
        path = os.path.join(self.args.output_dir, PREDICTIONS_FILE)
        if not self.is_world_process_zero():
            return path
        tokenizer = self.processing_class
        prompts = tokenizer.batch_decode(list(dataset["input_ids"]), skip_special_tokens=False)
        predictions = decode_token_ids(tokenizer, predict_results.predictions)
        labels = decode_token_ids(tokenizer, predict_results.label_ids)
        write_jsonl(path, ({"prompt": prompt, "predict": predict.strip(), "label": label.strip()}
                           for prompt, predict, label in zip(prompts, predictions, labels)))
        return path


def check_config(config: Config) -> None:
    """What `stage: sft` / `pt` refuse, before anything is loaded."""
    t = config.training
    if t.predict_with_generate and not (t.do_eval or t.do_predict):
        raise ConfigError("predict_with_generate=true does nothing without do_eval or do_predict; set one of them "
                          "or remove predict_with_generate.")
    if config.data.packing and t.predict_with_generate:
        raise ConfigError(
            "packing=true with predict_with_generate=true: generation needs one prompt per row; "
            "predict in a separate run without packing."
        )


def _run_causal_lm(config: Config, callbacks: list, data_kind: str) -> None:
    """What sft and pt share: load, (pack), train, evaluate, predict."""
    from ..data import get_dataset
    from ..data.collator import SupervisedCollator
    from ..data.multimodal import image_collator
    from ..model.loader import load_image_processing, load_model, load_tokenizer

    t = config.training
    tokenizer = load_tokenizer(config.model)
    images = load_image_processing(config.model, tokenizer) if data_kind != PT_DATA_KIND else None
    datasets = get_dataset(config, tokenizer, data_kind, images=images)
    check_splits(config, datasets)
    model = load_model(config.model, config.finetuning, is_trainable=t.do_train, vision=data_kind == SFT_DATA_KIND)

    train_dataset, eval_dataset = datasets.get("train_dataset"), datasets.get("eval_dataset")
    data_collator = SupervisedCollator(tokenizer)
    if images is not None:
        if t.predict_with_generate:
            raise ConfigError("predict_with_generate is not supported for vision-language models yet (generation "
                              "does not pass the images); evaluate by loss, or chat with `alignkit chat`.")
        data_collator = image_collator(data_collator, images, stepping_aside=[
            key for key, on in (("packing", config.data.packing), ("padding_free", t.padding_free)) if on])
    if config.data.packing and images is None:
        if train_dataset is not None:
            train_dataset = pack_dataset(train_dataset, config.data.cutoff_len)
        if eval_dataset is not None:  # loss-based evaluation: generation with packing was refused above
            eval_dataset = pack_dataset(eval_dataset, config.data.cutoff_len)
        data_collator = PackedCollator(pad_token_id=tokenizer.pad_token_id)

    if t.predict_with_generate:
        compute_metrics, preprocess_logits = similarity_metrics(tokenizer), None
    else:
        compute_metrics, preprocess_logits = token_accuracy_metric(), argmax_logits

    trainer = SFTTrainer(
        model=model,
        args=t,
        data_collator=data_collator,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits,
        generating_args=config.generating,
        template=config.data.template,
    )
    save = None
    if t.predict_with_generate:
        save = lambda output: trainer.save_predictions(eval_dataset, output)  # noqa: E731
    run_stage_trainer(trainer, config, predict_dataset=eval_dataset, save_predictions=save)
    if images is not None and t.do_train and trainer.is_world_process_zero():
        images.save(t.output_dir)


def run_sft(config: Config, callbacks: list) -> None:
    """`stage: sft`: loss on response tokens, optional generation-based evaluation and prediction."""
    _run_causal_lm(config, callbacks, data_kind=SFT_DATA_KIND)


def run_pt(config: Config, callbacks: list) -> None:
    """`stage: pt`: causal-LM training on raw text blocks of `cutoff_len` tokens (every token a target)."""
    _run_causal_lm(config, callbacks, data_kind=PT_DATA_KIND)


__all__ = ["sft_loss", "SFTTrainer", "check_config", "run_sft", "run_pt"]
