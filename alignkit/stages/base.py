"""What every stage trainer shares, written once: metrics, the reference model, and the run's tail.

- `StageTrainer.record_metrics` buffers the stage's metrics (slash names such as `rewards/chosen`) with
  the number of examples each value averages over; `log()` adds their means to the Trainer's record.
  Training: the mean over the examples of the logging window. Evaluation: the mean over every example of
  the evaluation set (a weighted mean of the batch means, so a short last batch counts for what it holds,
  and summed across processes), not a mean of per-batch means.
- `StageTrainer.reference()` is the frozen reference model of DPO, GRPO and PPO: the policy with its
  trainable adapter disabled under LoRA (no second copy of the weights; an SFT adapter given as
  `adapter_name_or_path` was merged into the base when the model was loaded, so it is part of the
  reference), or a frozen in-memory copy made when the trainer is built (full / freeze fine-tuning), or an
  explicit `ref_model`. Under DeepSpeed ZeRO-3 a full/freeze policy's weights are partitioned, and a copy would
  copy partitions that nothing gathers: the reference is loaded again from the policy's own source instead
  (`loader.load_frozen_copy`, partitioned by `from_pretrained` like the policy), and each reference pass runs with
  its weights gathered once for the pass (`full_weights`; no engine runs over the reference, so nothing else
  gathers them). That holds the whole reference on every process during the pass, see docs/ARCHITECTURE.md.
- `ReferenceSyncArguments` are TRL's `sync_ref_model` keys (TR-DPO) for the stages TRL has them in (dpo, grpo,
  rloo); `check_reference_sync` refuses what cannot be synced before anything loads, and `StageTrainer` adds the
  `callbacks.ReferenceSync` callback that does it (when things happen belongs in callbacks).
- `StageTrainer.kept_reference` keeps each example's reference outputs (DPO, KTO) for the rest of the run when the
  reference cannot change during it (a frozen copy, or the base under LoRA with nothing of it trained, and no
  `sync_ref_model`): later epochs and evaluations after the first run the policy alone, and checkpoints carry
  the kept outputs so a resumed run computes what the uninterrupted one does.
- `run_stage_trainer` is the train / evaluate / predict / save sequence every `run_<stage>` ends with.
- Evaluation and prediction share one pass: a stage whose predictions are a few numbers per example (rm, dpo,
  kto: `predictions_from_evaluation`) gathers them while it evaluates, and `predict` on the data just evaluated,
  with the same weights, takes them from there (`StageTrainer.evaluation_predictions`) instead of running
  every example through the model (and the reference) again.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch
from accelerate.utils import gather_object
from torch import nn
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput, PredictionOutput

from ..constants import IGNORE_INDEX
from ..jsonl import write_jsonl
from ..lifecycle import json_safe
from ..model.adapters import adapters_disabled
from ..model.distributed import full_weights, sharding_of, unwrap_without_importing_deepspeed, zero3_enabled
from .arguments import ReferenceSyncArguments

if TYPE_CHECKING:
    from ..config import Config

unwrap_without_importing_deepspeed()  # every stage trainer unwraps its model through accelerate

logger = logging.getLogger(__name__)

PREDICTIONS_FILE = "generated_predictions.jsonl"


# At most this many examples' reference outputs are kept (a few floats each, about 250 bytes with the key and the
# dictionary's entry: 125 MB at the cap); examples past it run the reference whenever they come.
MAX_KEPT_REFERENCE_EXAMPLES = 500_000
REFERENCE_OUTPUTS_FILE = "reference_outputs.pt"


def example_digests(inputs: dict[str, Any], examples: Sequence[Sequence[tuple[str, int]]]) -> list[bytes]:
    """One digest per example of a batch, over the real tokens and labels of the sequences that make it up.

    Args:
        inputs: the collated batch (`{prefix}input_ids`, `{prefix}attention_mask`, `{prefix}labels`).
        examples: for each example, its sequences as `(prefix, row)`: a DPO pair `[("", i), ("", B + i)]` (chosen
            and rejected stacked), a KTO row `[("", i), ("kl_", i)]` (its reply and its mismatched KL row).

    Equal digests mean the same token ids and labels in every sequence, whatever the padding or the batch.
    """
    import hashlib

    columns = {}
    for prefix in {prefix for example in examples for prefix, _ in example}:
        columns[prefix] = tuple(inputs[f"{prefix}{name}"].detach().cpu()
                                for name in ("input_ids", "attention_mask", "labels"))
    digests = []
    for example in examples:
        digest = hashlib.blake2b(digest_size=20)
        for prefix, row in example:
            ids, mask, labels = (column[row] for column in columns[prefix])
            real = mask.bool()
            for part in (ids[real], labels[real]):
                digest.update(f"{part.numel()};".encode())
                digest.update(memoryview(part.to(torch.int64).contiguous().view(torch.uint8).numpy()))
        digests.append(digest.digest())
    return digests


def zero_dropout(model: nn.Module) -> None:
    """Set every `nn.Dropout` in `model` to p = 0 (TRL's `disable_dropout`), saying so when one was on (a
    `lora_dropout`, a model's attention dropout)."""
    active = sorted({m.p for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0})
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    if active:
        logger.info("disable_dropout: dropout p=%s set to 0 (set disable_dropout: false to keep it).",
                    ", ".join(f"{p:g}" for p in active))


def is_peft_model(model: nn.Module) -> bool:
    """True for a PEFT-wrapped model (one whose adapters can be disabled to get the base back)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def weighted_means(sums: dict[str, float], counts: dict[str, float]) -> dict[str, float]:
    """`sums[key] / counts[key]` for every key with a positive count.

    Example: a metric seen as batch means 1.0 over 4 examples and 4.0 over 2 gives sums {m: 1*4 + 4*2 = 12},
    counts {m: 6}, so its mean is 12 / 6 = 2.0 (a mean of the batch means would say 2.5).
    """
    return {key: sums[key] / counts[key] for key in sums if counts.get(key, 0) > 0}


class _Evaluation(NamedTuple):
    """One evaluation pass kept for prediction: the data, the step whose weights it ran, its output and metrics."""

    dataset: Any
    step: int
    output: EvalLoopOutput
    metrics: dict[str, Any]


def check_reference_sync(config: "Config", uses_reference: bool, no_reference_reason: str = "") -> None:
    """Refuse `sync_ref_model` where there is no separate reference model to sync, before anything loads.

    Args:
        config: the parsed config; `config.method` holds `ReferenceSyncArguments`.
        uses_reference: whether the stage's settings use a reference at all.
        no_reference_reason: the settings that make it use none (for the message).

    Raises:
        ConfigError: under LoRA (the reference is the base with the adapter disabled, as in TRL, which refuses
            `sync_ref_model` with PEFT for the same reason), without a reference, or with the weights sharded
            (DeepSpeed ZeRO-3, FSDP), which the sync does not gather.
    """
    from ..errors import ConfigError

    if not getattr(config.method, "sync_ref_model", False):
        return
    stage, finetuning_type = config.finetuning.stage, config.finetuning.finetuning_type
    if not uses_reference:
        raise ConfigError(f"sync_ref_model: stage {stage} uses no reference model with {no_reference_reason}, so "
                          "there is nothing to sync; set sync_ref_model: false.")
    if finetuning_type not in ("full", "freeze"):
        raise ConfigError(
            f"sync_ref_model with finetuning_type={finetuning_type}: the reference of a LoRA policy is the same "
            "weights with the adapter disabled (no second copy in memory), so there is no separate reference model "
            "to move towards the policy (TRL refuses sync_ref_model with PEFT for the same reason). Use "
            "finetuning_type: full or freeze, which keep a frozen reference copy, or set sync_ref_model: false.")
    training = config.training
    deepspeed = getattr(training, "hf_deepspeed_config", None)
    if (deepspeed is not None and deepspeed.is_zero3()) or training.fsdp:
        raise ConfigError("sync_ref_model with DeepSpeed ZeRO-3 or FSDP: the reference sync mixes whole weights and "
                          "does not gather sharded ones yet; use ZeRO-2 or data parallel, or set sync_ref_model: "
                          "false.")


class StageTrainer(Trainer):
    """`transformers.Trainer` with a metric buffer and a reference-model context for the stage trainers.

    Args:
        ref_model: an explicit frozen reference model (moved to the training device, eval mode).
        reference_sync: the stage's `sync_ref_model` keys; when it is on, `callbacks.ReferenceSync` mixes the
            policy into the reference as they say.
        disable_dropout: set every dropout of the model to 0 first (`zero_dropout`; TRL's key of that name).
        keep_reference_copy: with no `ref_model` and a policy that is not a PEFT model, keep a frozen
            in-memory copy of the policy as it is now to serve as the reference (under ZeRO-3: the policy loaded
            again from its source, partitioned). False when the stage needs no reference, or needs it only
            before training starts (precomputed reference log-probs).
        *args, **kwargs: as for `transformers.Trainer`.
    """

    # Why `reference()` is refused after training when no copy was kept; stages say what to do instead.
    no_reference_copy_message = (
        "this trainer keeps no reference copy of a full/freeze fine-tuned policy (reference outputs were meant to "
        "be computed before training), and the policy has been trained since."
    )
    # Whether an evaluation gathers the predictions and keeps them for `predict` on the same data and weights
    # (`evaluation_predictions`). The stages whose predictions are a few numbers per example set it (rm, dpo,
    # kto); SFT's are tokens or logits, too large to keep through training.
    predictions_from_evaluation = False
    # Whether a step of `gradient_accumulation_steps` micro-batches of b rows equals one batch of b x g rows for
    # this stage's loss (a token sum over the step, or a mean over equal micro-batches): then a CPU run with
    # accumulation is told that the one batch is faster (`_suggest_one_batch`).
    accumulation_is_one_batch = False

    def __init__(self, *args, ref_model: Optional[nn.Module] = None, keep_reference_copy: bool = False,
                 reference_sync: Optional[ReferenceSyncArguments] = None, disable_dropout: bool = False,
                 **kwargs) -> None:
        training_args = kwargs.get("args")
        if getattr(training_args, "bf16_auto", False):
            # Before `Trainer.__init__`, which builds the accelerator (and its autocast) from `args.bf16`.
            from ..model.precision import resolve_auto_bf16

            resolve_auto_bf16(kwargs["model"], training_args)
        super().__init__(*args, **kwargs)
        # NEFTune runs through alignkit's hook (`padding_free.neftune_noise`: the padded length's noise scale also for a
        # padding-free forward, whose embeddings hold the whole batch in one row); the Trainer's own stays off.
        self._neftune_alpha, self.neftune_noise_alpha = self.neftune_noise_alpha, None
        # Per mode: per-batch means, and how many examples each mean covers.
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._metric_counts: dict[str, dict[str, list[float]]] = {"train": defaultdict(list),
                                                                   "eval": defaultdict(list)}
        if disable_dropout:  # before the reference copy below is taken, so both are the same network
            zero_dropout(self.model)
        self.ref_model: Optional[nn.Module] = None
        if ref_model is not None:
            if sharding_of(ref_model) != "zero3":  # `zero.Init` already put the partitions on this process's device
                ref_model = ref_model.to(self.args.device)
            self.ref_model = ref_model.eval().requires_grad_(False)
        elif keep_reference_copy and not is_peft_model(self.model) and zero3_enabled():
            # A deep copy would copy the policy's partitions (module docstring): load it again, partitioned.
            from ..model.loader import load_frozen_copy

            self.ref_model = load_frozen_copy(self.model)
        elif keep_reference_copy and not is_peft_model(self.model):
            # The policy as it is now, in memory (never re-read from disk, so a policy changed in memory
            # before training gets the matching reference).
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        if reference_sync is not None and reference_sync.sync_ref_model:
            if self.ref_model is None:  # `check_reference_sync` refuses such configs; this guards direct use
                raise ValueError("sync_ref_model needs a separate reference model (full or freeze fine-tuning, or an "
                                 "explicit ref_model); this trainer's reference is the policy with its adapter "
                                 "disabled.")
            from ..callbacks import ReferenceSync

            self.add_callback(ReferenceSync(self.ref_model, reference_sync.ref_model_mixup_alpha,
                                            reference_sync.ref_model_sync_steps))
        # Each example's reference outputs, by its tokens (`kept_reference`), kept only where the reference is fixed
        # for the run: {digest: its k outputs}, as floats (a tensor apiece would cost more than its numbers).
        self._reference_memo: Optional[dict[bytes, tuple[float, ...]]] = (
            {} if self._reference_is_fixed(reference_sync) else None)
        self._add_pair_lengths_for_grouping()
        self._suggest_one_batch()
        self._last_evaluation: Optional[_Evaluation] = None
        self._gather_predictions = False  # inside an evaluation that keeps its predictions
        self._evaluation_output: Optional[EvalLoopOutput] = None

    # ---- metrics ----

    def real_rows(self, num_rows: int) -> int:
        """How many of this batch's `num_rows` examples are real rather than repeats that fill the last batches.

        Under several processes accelerate gives every process a full batch in the last round of an evaluation
        (`even_batches`), repeating examples from the start of the data set after the real ones: the real ones
        come first in process order, so process k keeps `remainder - k * num_rows` of its rows (clamped to
        [0, num_rows]), where `remainder` is the number of real examples in that round. Example: 37 pairs,
        2 processes x batch 4: the last round holds 37 % 8 = 5 real pairs, 4 on process 0, 1 on process 1.
        Training batches and a single process: all `num_rows`.
        """
        if self.model.training or self.accelerator.num_processes == 1:
            return num_rows
        state = self.accelerator.gradient_state
        if not state.end_of_dataloader or state.remainder is None or state.remainder <= 0:
            return num_rows
        return max(0, min(num_rows, state.remainder - self.accelerator.process_index * num_rows))

    def gather_real_rows(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every process's real rows of per-example tensors ([B] each, one batch), in process order.

        For a statistic of the whole batch that every process must see alike (KTO's reference point and reward
        margin): under several processes the batch is the union of their batches, without the repeated rows
        that fill the last evaluation round (`real_rows`). One process: the tensors as they are. Every process
        must call this at the same point (it is a collective), also one that holds no real row.

        Example: 2 processes, last evaluation round of 5 examples by 4: process 0 holds x0..x3, process 1 holds
        x4 and three repeats; both get [x0, x1, x2, x3, x4].
        """
        if self.accelerator.num_processes == 1:
            return tensors
        num_rows = tensors[0].shape[0]
        real = self.real_rows(num_rows)
        device = tensors[0].device
        # gloo gathers neither bools nor tensors of different lengths: float columns, padded to the longest batch.
        columns = torch.stack([t.detach().to(device=device, dtype=torch.float64) for t in tensors], dim=-1)
        columns = self.accelerator.pad_across_processes(columns, dim=0)
        width = columns.shape[0]
        real_counts = self.accelerator.gather(torch.tensor([real], device=device)).tolist()
        gathered = self.accelerator.gather(columns).reshape(len(real_counts), width, len(tensors))
        rows = torch.cat([gathered[k, :count] for k, count in enumerate(real_counts)])
        return tuple(rows[:, i].to(t.dtype) for i, t in enumerate(tensors))

    def record_metrics(self, metrics: dict[str, float | torch.Tensor], num_examples: int,
                       rows: Optional[torch.Tensor] = None) -> None:
        """Buffer this batch's metric means (each over `num_examples` examples) for the next `log()`.

        A tensor with one value per example is averaged over the real examples only (`real_rows`: evaluation
        under several processes repeats a few to fill the last batches); other values are kept as given and
        count for the real examples.

        Args:
            metrics: {name: a number, or a tensor of per-example values (averaged)}.
            num_examples: how many examples each value is a mean over.
            rows: [B] bool, when the metrics cover some rows of a batch of B (KTO's desirable replies): the
                per-example tensors hold one value per True row, `num_examples` is their count, and which of
                them are real is decided by their place among the batch's B rows.
        """
        mode = "train" if self.model.training else "eval"
        selected = torch.ones(num_examples, dtype=torch.bool) if rows is None else rows.detach().bool().cpu()
        real_selected = (torch.arange(selected.numel()) < self.real_rows(selected.numel()))[selected]
        real = int(real_selected.sum())
        if real == 0:
            return
        for key, value in metrics.items():
            if real < num_examples and isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and value.shape[0] == num_examples:
                value = value[real_selected.to(value.device)]
            value = value.detach().float().mean().item() if isinstance(value, torch.Tensor) else float(value)
            self._metrics[mode][key].append(value)
            self._metric_counts[mode][key].append(float(real))

    def _buffered_means(self, mode: str) -> dict[str, float]:
        keys = sorted(self._metrics[mode])
        if self.accelerator.num_processes > 1:
            # A process may lack a metric another holds (its batches had no real desirable reply, say): reduce
            # the same keys everywhere, its share counting zero.
            keys = sorted(set().union(*gather_object([keys])))  # one list of keys per process
        if not keys:
            return {}
        sums = torch.tensor([sum(v * n for v, n in zip(self._metrics[mode][k], self._metric_counts[mode][k]))
                             for k in keys], dtype=torch.float64)
        counts = torch.tensor([sum(self._metric_counts[mode][k]) for k in keys], dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            # Every process holds its own share of the examples: sum them all before dividing.
            sums = self.accelerator.reduce(sums.to(self.args.device), reduction="sum").cpu()
            counts = self.accelerator.reduce(counts.to(self.args.device), reduction="sum").cpu()
        self._metrics[mode].clear()
        self._metric_counts[mode].clear()
        return weighted_means(dict(zip(keys, sums.tolist())), dict(zip(keys, counts.tolist())))

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        """Add the buffered metric means to `logs` (`eval_` prefixed in evaluation), then log as usual.

        `logs` is updated in place: `evaluate()` returns the same dict, so its result holds them too.
        """
        mode = "train" if self.model.training else "eval"
        means = self._buffered_means(mode)
        logs.update(means if mode == "train" else {f"eval_{k}": v for k, v in means.items()})
        super().log(logs, start_time)

    def create_optimizer(self):
        """Trainer's optimizer, or peft's LoRA+ optimizer (lora_B at `learning_rate * loraplus_lr_ratio`) for an
        adapter set up with `loraplus_lr_ratio` (`loader.loraplus_settings`); same optimizer class and settings."""
        from ..model.loader import loraplus_settings

        loraplus = loraplus_settings(self.model)
        if self.optimizer is not None or loraplus is None:
            return super().create_optimizer()
        from peft.optimizers import create_loraplus_optimizer

        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        lr = optimizer_kwargs.pop("lr", self.args.learning_rate)
        self.optimizer = create_loraplus_optimizer(
            self.model, optimizer_cls, lr=lr, loraplus_lr_ratio=loraplus[0], loraplus_lr_embedding=loraplus[1],
            loraplus_weight_decay=self.args.weight_decay, **optimizer_kwargs)
        return self.optimizer

    # ---- saving ----

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Save as the Trainer does (final model and every checkpoint), plus `base_adapters.json` beside a LoRA
        adapter trained over merged adapters (`loader.save_base_adapters`), so that loading it puts them back, and
        `base_quantization.json` beside one trained on a quantized base (`loader.save_base_quantization`)."""
        from ..model.loader import save_base_adapters, save_base_quantization

        super().save_model(output_dir, _internal_call=_internal_call)
        if self.args.should_save:
            save_base_adapters(self.model, output_dir or self.args.output_dir)
            save_base_quantization(self.model, output_dir or self.args.output_dir)

    # ---- evaluation and prediction: one pass ----

    def train(self, *args, **kwargs):
        with self._neftune():
            result = super().train(*args, **kwargs)
        if self.args.load_best_model_at_end and self.state.best_global_step not in (None, self.state.global_step):
            self._last_evaluation = None  # an earlier checkpoint's weights are back: not those last evaluated
        return result

    @contextlib.contextmanager
    def _neftune(self) -> Iterator[None]:
        """`neftune_noise_alpha`'s hook on the input embeddings while `train` runs, where the Trainer attaches its own."""
        if self._neftune_alpha is None:
            yield
            return
        from ..model.padding_free import neftune_noise

        model = self.accelerator.unwrap_model(self.model)
        embeddings = (model.base_model.model if is_peft_model(model) else model).get_input_embeddings()
        embeddings.neftune_noise_alpha = self._neftune_alpha
        handle = embeddings.register_forward_hook(neftune_noise)
        try:
            yield
        finally:
            handle.remove()
            del embeddings.neftune_noise_alpha

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`Trainer.evaluate`; with `predictions_from_evaluation`, the pass's predictions are kept for `predict`."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        # Several named evaluation sets: Trainer calls this again for each set, by name. Under
        # `batch_eval_metrics` an evaluation keeps no predictions (transformers' point of it): `predict` runs its own.
        keep = (self.predictions_from_evaluation and not isinstance(dataset, (dict, str))
                and not self.args.batch_eval_metrics)
        self._gather_predictions, self._evaluation_output = keep, None
        try:
            metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._gather_predictions = False
        if keep and self._evaluation_output is not None:
            self._last_evaluation = _Evaluation(dataset, self.state.global_step, self._evaluation_output, metrics)
        self._evaluation_output = None
        return metrics

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        if self._gather_predictions:
            # Trainer gathers no predictions for a trainer without `compute_metrics`; these are a few numbers per
            # example, computed by the pass anyway, and spare `predict` a second pass.
            prediction_loss_only = False
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                         metric_key_prefix)
        if self._gather_predictions:
            self._evaluation_output = output
        return output

    def evaluation_predictions(self, dataset: Any) -> Optional[PredictionOutput]:
        """What `predict(dataset)` would return, taken from the last evaluation, or None if it cannot be.

        It can when that evaluation ran on `dataset` (the same object) at the current step (no optimizer step
        since, and no earlier checkpoint's weights loaded) and kept its predictions. The metrics are the
        evaluation's under `predict_` names (`eval_loss` -> `predict_loss`).
        """
        last = self._last_evaluation
        if last is None or last.dataset is not dataset or last.step != self.state.global_step:
            return None
        metrics = {"predict_" + key[len("eval_"):]: value for key, value in last.metrics.items()
                   if key.startswith("eval_")}
        return PredictionOutput(last.output.predictions, last.output.label_ids, metrics)

    # ---- prediction ----

    def loss_and_outputs(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, Any, dict[str, Any]]:
        """For `prediction_step`: `compute_loss(..., return_outputs=True)` without gradients.

        Returns:
            (the detached loss, the outputs `compute_loss` returned, the inputs as prepared for the device).
        """
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        return loss.detach(), outputs, inputs

    # ---- the reference ----

    @contextlib.contextmanager
    def reference(self) -> Iterator[nn.Module]:
        """The module to run for reference outputs: eval mode (no dropout), no gradients, adapter disabled.

        A separate reference partitioned by ZeRO-3 has its weights gathered for the block (`full_weights`): use one
        block per reference pass (a batch's forward), not one per row.
        """
        with torch.no_grad():
            if self.ref_model is not None:
                with full_weights(self.ref_model) as reference:
                    yield reference
                return
            model = self.model
            if not is_peft_model(model) and self.state.global_step > 0:
                raise ValueError(self.no_reference_copy_message)
            was_training = model.training
            model.eval()
            try:
                with adapters_disabled(model) if is_peft_model(model) else contextlib.nullcontext():
                    yield model
            finally:
                model.train(was_training)

    def _reference_is_fixed(self, reference_sync: Optional[ReferenceSyncArguments]) -> bool:
        """Whether the reference computes the same outputs for the same batch all run: a frozen `ref_model` or a
        PEFT policy whose weights outside its adapters are all frozen (the reference is then the untouched base),
        and no `sync_ref_model` moving it. A full/freeze policy without a copy is its own reference: never fixed."""
        if reference_sync is not None and reference_sync.sync_ref_model:
            return False
        if self.ref_model is not None:
            return not any(p.requires_grad for p in self.ref_model.parameters())
        if not is_peft_model(self.model):
            return False
        adapters = tuple(f".{name}." for name in self.model.peft_config)
        return not any(p.requires_grad and not any(a in n for a in adapters) for n, p in self.model.named_parameters())

    def kept_reference(self, inputs: dict[str, Any], compute: Callable[[dict[str, Any]], tuple[torch.Tensor, ...]],
                       examples: Sequence[Sequence[tuple[str, int]]]) -> tuple[torch.Tensor, ...]:
        """`compute(inputs)`, the batch's reference outputs (`[B]` tensors, one value per example); where the reference
        is fixed (`_reference_is_fixed`) and every example of the batch has been through it before in this run
        (training or evaluation, any batch), the outputs kept then.

        A fixed reference gives an example the same outputs whenever it comes (up to float rounding, the batch
        around it aside), so a run's second and later epochs, and its evaluations after the first, run the policy
        alone: what `precompute_ref_log_probs` does, without a pass before training (TRL reruns the reference
        unless it is set). A batch with any example not seen before runs the reference whole and keeps each
        example's outputs. Under several processes the kept outputs are used only when every process has all of
        its batch's (the reference's forward may hold collectives, FSDP or ZeRO-3 gathers, that a process skipping
        it would leave the others waiting in). Kept outputs are saved with each checkpoint, so a resumed run
        computes what the uninterrupted one does. A batch with images runs the reference always (its tokens do not
        tell its pixels apart).

        Args:
            examples: each example's sequences as `example_digests` takes them.
        """
        from ..data.multimodal import image_inputs

        if self._reference_memo is None or image_inputs(inputs):
            return compute(inputs)
        keys = example_digests(inputs, examples)
        kept = [self._reference_memo.get(key) for key in keys]
        every = all(value is not None for value in kept)
        if self.accelerator.num_processes > 1:
            everywhere = self.accelerator.reduce(torch.tensor([float(every)], device=self.args.device),
                                                 reduction="sum")
            every = int(everywhere.item()) == self.accelerator.num_processes
        if every:
            # float32 outputs (`forward_sequence_logps` sums in float32), exact through the Python floats.
            stacked = torch.tensor(kept, dtype=torch.float32, device=self.args.device)
            return tuple(stacked[:, j] for j in range(stacked.shape[1]))
        outputs = tuple(t.detach() for t in compute(inputs))
        if all(t.dtype == torch.float32 for t in outputs):
            for key, row in zip(keys, torch.stack(outputs, dim=1).tolist()):
                if key in self._reference_memo or len(self._reference_memo) < MAX_KEPT_REFERENCE_EXAMPLES:
                    self._reference_memo[key] = tuple(row)
        return outputs

    def process_file(self, name: str) -> str:
        """A checkpoint file's name for this process's own state: `name` in one process, `name` with `_<rank>` before
        its suffix with several (`reference_outputs_1.pt`, like the Trainer's `rng_state_<rank>.pth`)."""
        if self.accelerator.num_processes == 1:
            return name
        path = Path(name)
        return f"{path.stem}_{self.accelerator.process_index}{path.suffix}"

    def save_process_file(self, value: Any, output_dir: str, name: str) -> None:
        """`torch.save` this process's `value` as `process_file(name)` in `output_dir`, through a temporary file
        renamed into place (a crash mid-write leaves no half file for a resume to read)."""
        path = Path(output_dir) / self.process_file(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(value, tmp)
        os.replace(tmp, path)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Beside the optimizer: the reference outputs kept so far (`kept_reference`)."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self._reference_memo:
            keys = torch.tensor([list(key) for key in self._reference_memo], dtype=torch.uint8)
            values = torch.tensor(list(self._reference_memo.values()), dtype=torch.float32)
            self.save_process_file({"keys": keys, "values": values}, output_dir, REFERENCE_OUTPUTS_FILE)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self._reference_memo is None:
            return
        path = Path(checkpoint) / self.process_file(REFERENCE_OUTPUTS_FILE)
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            self._reference_memo.update((bytes(key), tuple(value))
                                        for key, value in zip(saved["keys"].tolist(), saved["values"].tolist()))

    def reference_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The weights the reference computes with (for cache keys): the base's alone under LoRA."""
        if self.ref_model is not None:
            return self.ref_model.named_parameters()
        if is_peft_model(self.model):
            return ((n, p) for n, p in self.model.named_parameters() if not p.requires_grad)
        return self.model.named_parameters()

    # ---- data ----

    def _suggest_one_batch(self, applies: Optional[bool] = None, keep: str = "") -> None:
        """Say once, on a CPU, when gradient accumulation could be one larger batch of the same examples.

        Every micro-batch is a forward and backward of its own, and a few rows run the matrix products far below
        the CPU's speed: on the bundled model 1 row x 8 micro-batches took 2.1x the time of 8 rows x 1 for the same
        examples (docs/performance.md, "The twenty-sixth session"). Only said, never changed: the larger
        batch holds all its rows' activations at once, which is what accumulation is there to avoid.

        Args:
            applies: whether the stage's loss is the same either way (default: `accumulation_is_one_batch`); the
                online stages decide it from their settings once they hold them.
            keep: what else the larger batch must keep as it is, said after it (GRPO's generation batch).
        """
        a = self.args
        applies = self.accumulation_is_one_batch if applies is None else applies
        if (not applies or a.gradient_accumulation_steps <= 1 or a.device.type != "cpu"
                or not self.is_world_process_zero()):
            return
        rows = a.per_device_train_batch_size * a.gradient_accumulation_steps
        logger.info("gradient_accumulation_steps=%d at per_device_train_batch_size=%d: on a CPU each micro-batch's "
                    "few rows run the matrix products far below the CPU's speed. per_device_train_batch_size=%d "
                    "with gradient_accumulation_steps=1%s trains on the same examples in each step, faster (sft "
                    "at 1 x 8 took 2.1x the time of 8 x 1 on the bundled model), if the memory of %d rows' "
                    "activations at once is there.", a.gradient_accumulation_steps, a.per_device_train_batch_size,
                    rows, keep, rows)

    def _add_pair_lengths_for_grouping(self) -> None:
        """`group_by_length` and `batch_rebalance` for pairwise data: the Trainer's samplers read `input_ids`,
        which pairs lack.

        A `length` column (the longer of chosen and rejected, what a pair costs once padded) lets the
        sampler group pairs as it groups single sequences.
        """
        dataset = self.train_dataset
        if (self.args.train_sampling_strategy not in ("group_by_length", "batch_rebalance") or dataset is None
                or not hasattr(dataset, "column_names") or "chosen_input_ids" not in dataset.column_names
                or self.args.length_column_name in dataset.column_names):
            return
        lengths = [max(len(c), len(r)) for c, r in zip(dataset["chosen_input_ids"], dataset["rejected_input_ids"])]
        self.train_dataset = dataset.add_column(self.args.length_column_name, lengths)


def save_pair_predictions(output_dir: str | os.PathLike, predictions: np.ndarray, dataset: Any = None,
                          tokenizer: Any = None) -> Path:
    """Write `generated_predictions.jsonl`: one line per pair, in dataset order.

    Each line holds the two scores under `chosen` and `rejected` (the keys of LLaMA-Factory's reward-model
    predictions, so tools reading those keep working) and, given the dataset and tokenizer, the text they
    score: `prompt` (the rendered prompt, as in LLaMA-Factory's SFT predictions), `chosen_response` and
    `rejected_response`, decoded from the tokens the model saw (special tokens dropped; cut as cutoff_len
    cut them).

    Args:
        output_dir: the run's output folder.
        predictions: `[num_pairs, 2]` rewards (the reward model's, or DPO's implicit ones), chosen first.
        dataset: the predicted pairs (`chosen_input_ids`, `chosen_labels`, `rejected_input_ids`,
            `rejected_labels`, prompt tokens labelled -100), in the order predicted.
        tokenizer: decodes the tokens.
    """
    scores = np.asarray(predictions).reshape(-1, 2).tolist()
    texts: list[dict[str, str]] = [{} for _ in scores]
    if dataset is not None and tokenizer is not None:
        texts = [_pair_texts(tokenizer, dataset[i]) for i in range(len(scores))]
    return write_jsonl(Path(output_dir) / PREDICTIONS_FILE,
                       ({**text, "chosen": round(chosen, 6), "rejected": round(rejected, 6)}
                        for (chosen, rejected), text in zip(scores, texts)))


def split_prompt_reply(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """A tokenised example's prompt and reply ids: the prompt is the leading run of labels equal to -100.

    Example: ids [5, 6, 7, 8], labels [-100, -100, 7, 8] → ([5, 6], [7, 8]).
    """
    prompt_len = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    return list(ids[:prompt_len]), list(ids[prompt_len:])


def _pair_texts(tokenizer: Any, example: dict[str, list[int]]) -> dict[str, str]:
    """`prompt`, `chosen_response`, `rejected_response` of one tokenised pair (the prompt is where labels are -100)."""
    def split(name: str) -> tuple[list[int], list[int]]:
        return split_prompt_reply(example[f"{name}_input_ids"], example[f"{name}_labels"])

    prompt_ids, chosen_ids = split("chosen")
    _, rejected_ids = split("rejected")
    prompt, chosen, rejected = tokenizer.batch_decode([prompt_ids, chosen_ids, rejected_ids], skip_special_tokens=True)
    return {"prompt": prompt, "chosen_response": chosen, "rejected_response": rejected}


def check_splits(config: "Config", datasets: dict[str, Any]) -> None:
    """Stop before the model loads when a split the run needs came out empty.

    Raises:
        ConfigError: saying which keys decide the split's size.
    """
    from ..errors import ConfigError

    t = config.training
    eval_dataset = datasets.get("eval_dataset")
    if (t.do_eval or t.do_predict) and (eval_dataset is None or len(eval_dataset) == 0):
        raise ConfigError(
            "do_eval/do_predict=true but the evaluation set is empty: set `eval_dataset`, or `val_size` "
            "large enough to hold at least one row (check max_samples), or turn do_eval/do_predict off."
        )
    if t.do_train and (datasets.get("train_dataset") is None or len(datasets["train_dataset"]) == 0):
        raise ConfigError("do_train=true but the training set is empty: check `dataset`, `max_samples` and `val_size`.")


def final_step_eval_metrics(trainer: Trainer) -> Optional[dict[str, Any]]:
    """The metrics of the evaluation the training loop ran at its last step, if it ran one on the final weights.

    Returns:
        The logged evaluation metrics at `state.global_step` (several evaluation sets merged), as
        `trainer.evaluate()` would return them; None when the loop did not evaluate at its last step, or
        when `load_best_model_at_end` replaced the final weights with an earlier checkpoint's.
    """
    state = trainer.state
    if trainer.args.load_best_model_at_end and state.best_global_step not in (None, state.global_step):
        return None
    metrics: dict[str, Any] = {}
    for record in state.log_history:
        if record.get("step") == state.global_step and any(key.startswith("eval_") for key in record):
            metrics.update({key: value for key, value in record.items() if key != "step"})
    return metrics or None


def run_stage_trainer(
    trainer: Trainer,
    config: "Config",
    *,
    predict_dataset: Any = None,
    save_predictions: Optional[Callable[["PredictionOutput"], Any]] = None,
) -> None:
    """Train, evaluate and predict as `config.training` says, writing what each step writes.

    - do_train: `trainer.train` (resuming from `resume_from_checkpoint`), then the model, `train_results.json`,
      `trainer_state.json` and, with `plot_loss`, the curves.
    - do_eval: `eval_results.json`, from one evaluation of the final weights. transformers evaluates in the
      training loop every `eval_steps` and, with `eval_strategy` steps or epoch, at the last step too; that
      last evaluation is the end-of-run one (same weights, same data), so its metrics are written and it is
      not run a second time. An evaluation runs after training only when the loop did not evaluate at its
      last step (`eval_strategy: no`), or when `load_best_model_at_end` brought back other weights.
    - do_predict: `predict_results.json`, then `save_predictions(output)` on the main process. When the
      end-of-run evaluation ran on the same data and kept its predictions (`StageTrainer.evaluation_predictions`),
      those are the predictions and its metrics `predict_results.json` (printed once, as eval's).

    Args:
        trainer: a built stage trainer.
        config: the run's configuration.
        predict_dataset: what `do_predict` predicts on (default: the trainer's eval dataset).
        save_predictions: writes the stage's predictions file from the `PredictionOutput`.
    """
    t = config.training
    if t.do_train:
        result = trainer.train(resume_from_checkpoint=t.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", json_safe(result.metrics))
        trainer.save_state()
        if t.plot_loss and trainer.is_world_process_zero():
            from ..callbacks import plot_loss

            plot_loss(t.output_dir)
        from ..callbacks import stop_requested

        if stop_requested(t.output_dir) and trainer.state.global_step < trainer.state.max_steps:
            # Stopped on request (`StopOnRequest`): the user wants the process gone; evaluating or predicting
            # a half-trained model is for the resumed run's end.
            logger.warning("Stopped at step %d of %d on request; evaluation and prediction skipped. Run the "
                           "same command again to resume.", trainer.state.global_step, trainer.state.max_steps)
            return
    if t.do_eval:
        metrics = final_step_eval_metrics(trainer) if t.do_train else None
        if metrics is None:
            metrics = trainer.evaluate(metric_key_prefix="eval")
        else:
            logger.info("The evaluation at the last step (%d) is the end-of-run evaluation; not run again.",
                        trainer.state.global_step)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", json_safe(metrics))
    if t.do_predict:
        dataset = predict_dataset if predict_dataset is not None else trainer.eval_dataset
        output = trainer.evaluation_predictions(dataset) if isinstance(trainer, StageTrainer) else None
        if output is None:
            output = trainer.predict(dataset, metric_key_prefix="predict")
            trainer.log_metrics("predict", output.metrics)
        else:
            logger.info("Predictions from the evaluation of these weights on the same data: not computed again "
                        "(predict_results.json holds its metrics).")
        trainer.save_metrics("predict", json_safe(output.metrics))
        if save_predictions is not None and trainer.is_world_process_zero():
            path = save_predictions(output)
            logger.info("Wrote predictions to %s", path)


__all__ = ["StageTrainer", "split_prompt_reply", "is_peft_model", "weighted_means", "save_pair_predictions", "check_splits",
           "final_step_eval_metrics", "run_stage_trainer",
           "PREDICTIONS_FILE"]
