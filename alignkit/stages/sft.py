"""Supervised fine-tuning (`stage: sft`) and causal-LM pre-training on raw text (`stage: pt`).

Both stages minimise the next-token cross-entropy on the tokens whose label is not -100: for SFT the
data layer masks everything but the assistant replies, for PT every token is a target. What this
module adds to `transformers.Trainer`:

- `compute_loss` sums the token losses and divides by the number of target tokens of the whole
  optimisation step (`num_items_in_batch`, counted by the Trainer over all gradient-accumulation
  micro-batches), so a step of 8 rows x 1 micro-batch and one of 1 row x 8 micro-batches give the same
  loss and gradients. A per-micro-batch mean would weight short replies more.
- packed rows (`packing: true`) carry `position_ids`; the loss is then the unpacked loss (see
  `alignkit.data.packing`).
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

import json
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from transformers import InfNanRemoveLogitsProcessor, LogitsProcessorList, Trainer

from ..hparams import Config, ConfigError, GeneratingArguments
from ..metrics import IGNORE_INDEX, argmax_logits, compute_token_accuracy, decode_token_ids, similarity_metrics
from ..model.logprobs import forward_sequence_logps
from ..model.padding_free import first_token_unlabelled, flatten_padded, row_token_bound, unflatten_to_padded

logger = logging.getLogger(__name__)

PREDICTIONS_FILE = "generated_predictions.jsonl"


def sft_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
) -> torch.Tensor:
    """Next-token cross-entropy summed over target tokens, divided by the step's target-token count.

    Position t predicts label t + 1; labels equal to -100 (prompt, padding, the first token of a
    packed example) are not targets.

    Args:
        logits: (batch, seq, vocab) model outputs.
        labels: (batch, seq) target ids aligned with the inputs (not yet shifted), -100 where ignored.
        num_items_in_batch: target tokens in the whole optimisation step (all accumulated micro-batches,
            counted over `labels[:, 1:]`). None: this batch's own count, i.e. the per-batch mean.

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
    )
    if num_items_in_batch is None:
        num_items_in_batch = (shifted_labels != IGNORE_INDEX).sum()
    count = torch.as_tensor(num_items_in_batch, device=total.device)
    # A step without targets (every reply cut off by cutoff_len) contributes 0, not NaN.
    return total / count.clamp(min=1)


def to_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int):
    """Move every row's real tokens to the right end, whatever side the batch was padded on.

    Generation appends new tokens after the last column, so prompts must end there. Rows are found by
    the attention mask, never by the pad id (pad == eos in SmolLM2).

    Args:
        input_ids: (batch, seq) prompt ids, padded on either side.
        attention_mask: (batch, seq) 1 on real tokens.
        pad_token_id: id written into the freed columns.

    Returns:
        (input_ids, attention_mask), both (batch, seq), left-padded.
    """
    lengths = attention_mask.sum(dim=1)
    seq_len = input_ids.shape[1]
    left_ids = torch.full_like(input_ids, pad_token_id)
    left_mask = torch.zeros_like(attention_mask)
    for row in range(input_ids.shape[0]):
        real = input_ids[row][attention_mask[row].bool()]
        left_ids[row, seq_len - int(lengths[row]) :] = real
        left_mask[row, seq_len - int(lengths[row]) :] = 1
    return left_ids, left_mask


class SFTTrainer(Trainer):
    """`Trainer` with step-normalised token loss, generation-based prediction and a predictions file.

    Args:
        generating_args: generation settings for `predict_with_generate`.
        padding_free: run unpacked batches as their real tokens packed into rows in `compute_loss`.
        *args, **kwargs: as for `transformers.Trainer`.
    """

    # `compute_loss` divides by the step's token count itself, so training_step must not divide again.
    loss_is_scaled_for_ga = True

    def __init__(self, *args, generating_args: GeneratingArguments | None = None, padding_free: bool = True,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.generating_args = generating_args or GeneratingArguments()
        self.padding_free = padding_free
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
        if self.padding_free and not return_outputs and "position_ids" not in inputs and "attention_mask" in inputs:
            # Training: only the sum of the targets' log-probs is needed, so the output layer runs on the
            # labelled positions alone (a prompt token's logits carry no loss) and log-probs are gathered
            # chunk by chunk, never holding a (tokens x vocab) log-softmax (`alignkit.model.logprobs`).
            summed_logps, _ = forward_sequence_logps(model, inputs["input_ids"], inputs["attention_mask"], labels,
                                                     padding_free=True)
            return self._scaled(-summed_logps.sum(), labels, num_items_in_batch)
        if "position_ids" in inputs:
            # Packed rows: transformers derives the block-diagonal mask from position resets only
            # when no 2D mask is given (the collator still returns it so the Trainer can count tokens).
            inputs.pop("attention_mask", None)
        elif self.padding_free and "attention_mask" in inputs:
            # The same mechanism for an unpacked batch: its real tokens packed into rows. sft_loss shifts labels
            # along each row, so each example's first label must not be a target of the previous example.
            flat = flatten_padded(inputs.pop("input_ids"), inputs.pop("attention_mask"), labels,
                                  max_row_tokens=row_token_bound(model))
            inputs.update(input_ids=flat.input_ids, position_ids=flat.position_ids)
            labels = first_token_unlabelled(flat.labels, flat.to_rows(flat.sequence_index, fill=-1))
        # No KV cache in a training forward: it is useless there and disables the packed-sequence mask.
        outputs = model(**inputs, use_cache=False)
        loss = sft_loss(outputs.logits, labels, num_items_in_batch)
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

        The generated ids exclude the prompt: prompts are first left-aligned, so every row's new
        tokens start at the same column whichever side the collator padded.
        """
        if not self.args.predict_with_generate or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        pad_token_id = self.processing_class.pad_token_id
        input_ids, attention_mask = to_left_padding(inputs["input_ids"], inputs["attention_mask"], pad_token_id)
        with torch.no_grad():
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=True,  # even when training turned it off (gradient checkpointing)
                pad_token_id=pad_token_id,
                eos_token_id=self.processing_class.eos_token_id,
                logits_processor=LogitsProcessorList([InfNanRemoveLogitsProcessor()]),
                **self.generating_args.to_generation_kwargs(),
            )
        new_tokens = generated[:, input_ids.shape[1] :].contiguous()
        return None, new_tokens, inputs.get("labels")

    def save_predictions(self, dataset, predict_results) -> str:
        """Write `generated_predictions.jsonl` (`prompt`, `predict`, `label` per example); returns its path."""
        path = os.path.join(self.args.output_dir, PREDICTIONS_FILE)
        if not self.is_world_process_zero():
            return path
        tokenizer = self.processing_class
        prompts = tokenizer.batch_decode(list(dataset["input_ids"]), skip_special_tokens=False)
        predictions = decode_token_ids(tokenizer, predict_results.predictions)
        labels = decode_token_ids(tokenizer, predict_results.label_ids)
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for prompt, predict, label in zip(prompts, predictions, labels):
                record = {"prompt": prompt, "predict": predict.strip(), "label": label.strip()}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        return path


def check_sft_inputs(config: Config, tokenizer: Any, datasets: dict[str, Any] | None = None) -> None:
    """Stop on settings that would fail later or silently do nothing.

    Called twice by the stage: before the data is tokenised (`datasets=None`: settings only) and
    before the model is loaded (the splits' sizes).
    """
    t = config.training
    if t.predict_with_generate and tokenizer.pad_token_id is None:
        raise ConfigError(
            "predict_with_generate=true needs a pad token to batch prompts, and the tokenizer has none: "
            "use a tokenizer with pad_token (or eos_token) set, or predict_with_generate=false."
        )
    if config.data.packing and t.predict_with_generate:
        raise ConfigError(
            "packing=true with predict_with_generate=true: generation needs one prompt per row; "
            "predict in a separate run without packing."
        )
    if datasets is None:
        return
    eval_dataset = datasets.get("eval_dataset")
    if (t.do_eval or t.do_predict) and (eval_dataset is None or len(eval_dataset) == 0):
        raise ConfigError(
            "do_eval/do_predict=true but the evaluation set is empty: set `eval_dataset`, or `val_size` "
            "large enough to hold at least one row (check max_samples), or turn do_eval/do_predict off."
        )
    if t.do_train and (datasets.get("train_dataset") is None or len(datasets["train_dataset"]) == 0):
        raise ConfigError("do_train=true but the training set is empty: check `dataset`, `max_samples` and `val_size`.")


def _run_causal_lm(config: Config, callbacks: list, stage: str) -> None:
    """What sft and pt share: load, (pack), train, evaluate, predict."""
    from ..data import get_dataset
    from ..data.collator import SupervisedCollator
    from ..data.packing import PackedCollator, pack_dataset
    from ..model.loader import load_model, load_tokenizer
    from ..train import finish_training, save_eval_metrics

    t = config.training
    if t.predict_with_generate and not (t.do_eval or t.do_predict):
        logger.warning("predict_with_generate=true has no effect without do_eval or do_predict.")
    tokenizer = load_tokenizer(config.model)
    check_sft_inputs(config, tokenizer)
    datasets = get_dataset(config, tokenizer, stage=stage)
    check_sft_inputs(config, tokenizer, datasets)
    model = load_model(config.model, config.finetuning, is_trainable=t.do_train)

    train_dataset, eval_dataset = datasets.get("train_dataset"), datasets.get("eval_dataset")
    data_collator = SupervisedCollator(tokenizer)
    if config.data.packing:
        if train_dataset is not None:
            train_dataset = pack_dataset(train_dataset, config.data.cutoff_len)
        if eval_dataset is not None:  # loss-based evaluation: generation with packing was refused above
            eval_dataset = pack_dataset(eval_dataset, config.data.cutoff_len)
        data_collator = PackedCollator(pad_token_id=tokenizer.pad_token_id)
    if config.data.group_by_length:
        t.train_sampling_strategy = "group_by_length"

    if t.predict_with_generate:
        compute_metrics, preprocess_logits = similarity_metrics(tokenizer), None
    else:
        compute_metrics, preprocess_logits = compute_token_accuracy, argmax_logits

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
        padding_free=config.finetuning.padding_free,
    )
    if t.do_train:
        result = trainer.train(resume_from_checkpoint=t.resume_from_checkpoint)
        finish_training(trainer, result, config)
    if t.do_eval:
        save_eval_metrics(trainer, trainer.evaluate(metric_key_prefix="eval"), "eval")
    if t.do_predict:
        results = trainer.predict(eval_dataset, metric_key_prefix="predict")
        save_eval_metrics(trainer, results.metrics, "predict")
        if t.predict_with_generate:
            trainer.save_predictions(eval_dataset, results)


def run_sft(config: Config, callbacks: list) -> None:
    """`stage: sft`: loss on response tokens, optional generation-based evaluation and prediction."""
    _run_causal_lm(config, callbacks, stage="sft")


def run_pt(config: Config, callbacks: list) -> None:
    """`stage: pt`: causal-LM training on raw text blocks of `cutoff_len` tokens (every token a target)."""
    _run_causal_lm(config, callbacks, stage="pt")


__all__ = ["sft_loss", "to_left_padding", "SFTTrainer", "check_sft_inputs", "run_sft", "run_pt"]
