"""When things happen: the training log file, throughput, loss plots, and the stop on divergence.

`LogCallback` appends one JSON object per logging step to `output_dir/trainer_log.jsonl` with the
progress (step, total steps, percentage, epoch), time (elapsed and remaining seconds), throughput
(real, non-padding tokens per second: the Trainer's `num_input_tokens_seen`, which we switch to
`non_padding` counting by default, so collators must return an `attention_mask`) and every metric the
stage logged. A resumed run first cuts the file back to the resumed step, so each step appears once.
`plot_loss` turns that file into one PNG per series. `DivergenceGuard` stops training at the first
non-finite gradient, weight or loss, before that step can be saved. `StopOnRequest` ends a run cleanly
when `output_dir/alignkit.stop` appears (`alignkit board`'s Stop button writes it; so can `touch`): at
the end of the current step, with a checkpoint, so that the run can be resumed. `ReferenceSync` moves a separate
reference model towards the policy every `ref_model_sync_steps` steps (TR-DPO; TRL's `sync_ref_model`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from .errors import TrainingDiverged
from .jsonl import append_jsonl, keep_jsonl_rows

logger = logging.getLogger(__name__)

LOG_FILE = "trainer_log.jsonl"
STOP_FILE = "alignkit.stop"  # its presence in output_dir asks the run there to stop (`StopOnRequest`)
_RUNNING_SPEED_KEYS = {"train_runtime", "train_tokens_per_second", "train_samples_per_second", "train_steps_per_second"}


class LogCallback(TrainerCallback):
    """Writes `trainer_log.jsonl` with progress, ETA and tokens/s since the previous record."""

    def __init__(self) -> None:
        self.start_time = 0.0
        self.start_step = 0
        self.tokens_at_last_log = 0
        self.time_at_last_log = 0.0

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.start_time = time.time()
        self.time_at_last_log = self.start_time
        self.start_step = state.global_step
        self.tokens_at_last_log = state.num_input_tokens_seen
        if state.is_world_process_zero:
            os.makedirs(args.output_dir, exist_ok=True)
            truncate_log(args.output_dir, self.start_step)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        now = time.time()
        elapsed = now - self.start_time
        done = max(state.global_step - self.start_step, 0)
        total = state.max_steps or 0
        remaining = (elapsed / done) * (total - state.global_step) if done and total else None
        record: dict[str, Any] = {
            "current_steps": state.global_step,
            "total_steps": total,
            "percentage": round(100.0 * state.global_step / total, 2) if total else None,
            "epoch": round(state.epoch, 4) if state.epoch is not None else None,
            "elapsed_time": round(elapsed, 2),
            "remaining_time": round(remaining, 2) if remaining is not None else None,
        }
        tokens = state.num_input_tokens_seen
        is_step_log = "loss" in logs
        if tokens > self.tokens_at_last_log and is_step_log:
            window = now - self.time_at_last_log
            record["tokens_per_second"] = round((tokens - self.tokens_at_last_log) / window, 2) if window > 0 else None
            self.tokens_at_last_log, self.time_at_last_log = tokens, now
        if tokens:
            record["total_tokens"] = tokens
        for key, value in logs.items():
            # The Trainer repeats its running speed metrics in every step's logs; the record already
            # has elapsed time and tokens/s, and the final summary keeps them.
            if key in ("epoch", "num_input_tokens_seen") or (is_step_log and key in _RUNNING_SPEED_KEYS):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            record[key] = value
        append_jsonl(Path(args.output_dir) / LOG_FILE, [record])


def format_log_line(logs: dict[str, Any], step: int, total: int) -> str:
    """A logging step as one line of rounded numbers: `step 5/30  loss 1.069  grad_norm 0.5123  learning_rate 0.0003`.

    What transformers prints instead is the logs dict with every float turned into a string
    (`{'loss': '1.069', ...}`) under a progress bar, or with no bar, the raw floats to 17 digits.
    """
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    is_step_log = "loss" in logs
    for key, value in logs.items():
        # As in trainer_log.jsonl: the running speed the Trainer repeats in every step's logs is left to the bar
        # and the final summary.
        if key == "total_flos" or (is_step_log and (key in _RUNNING_SPEED_KEYS or key == "num_input_tokens_seen")):
            continue
        parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return "  ".join(parts)


class _ProgressLines(ProgressCallback):
    """transformers' progress bar, with each logging step written by `format_log_line`."""

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.training_bar.write(format_log_line(logs, state.global_step, state.max_steps))


class _PrinterLines(PrinterCallback):
    """transformers' printer for `disable_tqdm: true`, each logging step written by `format_log_line`."""

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if state.is_local_process_zero and logs:
            print(format_log_line(logs, state.global_step, state.max_steps))


@contextlib.contextmanager
def readable_trainer_logs():
    """Trainers built inside print their logging steps as `format_log_line` does.

    The Trainer picks its printer from two names in `transformers.trainer` when it is built (transformers sets
    the first itself to a notebook bar in Jupyter, which is left alone); a callback of ours passed beside
    it would print every line twice. The names are restored on exit.
    """
    import transformers.trainer as hf_trainer

    saved = hf_trainer.DEFAULT_PROGRESS_CALLBACK, hf_trainer.PrinterCallback
    if saved[0] is ProgressCallback:
        hf_trainer.DEFAULT_PROGRESS_CALLBACK = _ProgressLines
    hf_trainer.PrinterCallback = _PrinterLines
    try:
        yield
    finally:
        hf_trainer.DEFAULT_PROGRESS_CALLBACK, hf_trainer.PrinterCallback = saved


class DivergenceGuard(TrainerCallback):
    """Stops training at the first non-finite gradient norm, weight or logged loss, before it is saved.

    Where it looks, in the order `Trainer._run_epoch` runs an optimizer step:

    - `on_pre_optimizer_step` (after backward and clipping, before `optimizer.step()`): the norm of the
      trainable parameters' gradients. A non-finite loss makes its gradients non-finite, so this sees
      every step's loss, whatever `logging_steps` and `logging_nan_inf_filter` (which hides non-finite
      losses from the log) say, and before the step changes the weights. Not under `fp16`, whose
      GradScaler skips overflowing steps by design.
    - `on_optimizer_step`: the trainable weights, which an enormous learning rate can overflow from
      finite gradients.
    - `on_log`: the logged training loss. It also turns non-finite values of the log history (an eval
      loss of NaN, say) into None, so that every `trainer_state.json` written is valid JSON.

    Raising from a callback ends `trainer.train()` at once: the Trainer saves a step's checkpoint after
    these events, so nothing of the diverged step, and no final model, reaches the disk; the checkpoints
    saved before stay. The checks cost one pass over the trainable gradients and weights per step.

    A run can also diverge while every number stays finite (PPO at learning_rate=1e6 ended with weights of 3e6
    and a loss of 2.5e10). That is warned about, once, when the trainable weights' norm has grown
    `WEIGHT_GROWTH_WARNING` times since the run started: fine-tuning moves weights by a small part of their
    size (AdamW steps each weight by about the learning rate, 1e-6 to 1e-3; a LoRA B that starts at zero grows to
    a few times its A), so a thousandfold growth means steps far larger than the weights themselves.
    """

    WEIGHT_GROWTH_WARNING = 1000.0

    def __init__(self) -> None:
        self._start_norm: float | None = None
        self._warned = False

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if args.fp16:
            # fp16 loss scaling overflows on purpose: the GradScaler skips such a step and lowers the scale,
            # so non-finite gradients are expected there; the weight and loss checks still apply.
            return
        if self._start_norm is None:  # the weights this run starts from (resumed ones after a resume)
            self._start_norm = _norm(_trainable(kwargs.get("model")))
        grads = [p.grad for p in _trainable(kwargs.get("model")) if p.grad is not None]
        norm = _norm(grads)
        if not math.isfinite(norm):
            self._stop(args, state.global_step + 1, f"the gradient norm is {norm}")

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        import torch

        named = _named_trainable(kwargs.get("model"))
        for name, param in named:
            if not bool(torch.isfinite(param.detach()).all()):
                self._stop(args, state.global_step + 1, f"weight {name} is not finite after the optimizer step")
        if self._start_norm and not self._warned:
            norm = _norm([param for _, param in named])
            if norm > self.WEIGHT_GROWTH_WARNING * self._start_norm:
                self._warned = True
                logger.warning(
                    "Training is diverging at step %d: the trainable weights' norm grew from %.3g to %.3g (more than "
                    "%gx) since the run started, though every number is still finite. Lower learning_rate (now %g).",
                    state.global_step + 1, self._start_norm, norm, self.WEIGHT_GROWTH_WARNING, args.learning_rate)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if isinstance(loss, float) and not math.isfinite(loss):
            self._stop(args, state.global_step, f"the training loss is {loss}")
        if state.log_history:
            record = state.log_history[-1]
            for key, value in record.items():
                if isinstance(value, float) and not math.isfinite(value):
                    record[key] = None

    @staticmethod
    def _stop(args: TrainingArguments, step: int, what: str) -> None:
        from .lifecycle import list_checkpoints

        checkpoints = list_checkpoints(args.output_dir)
        kept = f"the last checkpoint, {checkpoints[0]}, is kept" if checkpoints else "no checkpoint had been saved"
        raise TrainingDiverged(
            f"training diverged at step {step}: {what}. Nothing of this step was saved and {kept}. "
            f"Lower learning_rate (now {args.learning_rate}), keep max_grad_norm > 0 (now {args.max_grad_norm}), "
            "or look for a broken example in this step's batch."
        )


class StopOnRequest(TrainerCallback):
    """Ends training at the end of the current step, saving a checkpoint, once `output_dir/alignkit.stop` exists.

    Why a file and not a signal: whoever asks (the board, a user's `touch`) needs no process id, the run may
    have been started anywhere (command line, board, torchrun), and the request outlives the process, so a
    stopped run can be told from a crashed one. `train.run_train` deletes a stale file before the run
    starts; the file of an honoured request stays, as the record that the run was stopped. The Trainer
    saves after `on_step_end`, so the checkpoint holds the step just finished and a rerun resumes there.
    Under torchrun every process must stop at the same step: the ranks agree (a max over the group).
    """

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        requested = stop_requested(args.output_dir)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            import torch

            flag = torch.tensor([int(requested)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            requested = bool(flag.item())
        if requested:
            if state.is_world_process_zero:
                logger.warning("Stop requested (%s): stopping after step %d with a checkpoint; run the same "
                               "command again to resume.", Path(args.output_dir) / STOP_FILE, state.global_step)
            control.should_training_stop = True
            control.should_save = True
        return control


def mix_into_reference(policy: torch.Tensor, reference: torch.Tensor, alpha: float) -> torch.Tensor:
    """TR-DPO's soft reference update (Gorbatovski et al. 2024, eq. 5), in place: `reference <- alpha * policy +
    (1 - alpha) * reference`, as TRL's `SyncRefModelCallback` computes it (`mul_(1 - alpha).add_(policy, alpha)`).

    Args:
        policy: a weight of the trained policy, any shape.
        reference: the same weight of the reference, same shape; overwritten.
        alpha: `ref_model_mixup_alpha` in [0, 1]; 1 copies the policy.

    Returns:
        `reference`, updated.

    Example: policy [1, 2], reference [3, 5], alpha 0.6 -> [0.6 + 1.2, 1.2 + 2.0] = [1.8, 3.2].
    """
    return reference.mul_(1.0 - alpha).add_(policy.to(reference.dtype), alpha=alpha)


class ReferenceSync(TrainerCallback):
    """Every `sync_steps` optimizer steps, mix the policy's weights into the separate reference model
    (`mix_into_reference`), as TRL's `SyncRefModelCallback` does at the end of each step whose number is a multiple
    of `ref_model_sync_steps`.

    The reference changes during training, so it is saved with each checkpoint (`reference_model.safetensors`) and
    read back when a run resumes from one, so that a resumed run continues with the reference it had. Weights are
    matched by name; a policy and reference that differ in names or shapes are an error (the reference is a copy
    of the policy made before training, so they never should).

    Args:
        ref_model: the frozen reference (a full copy; a LoRA policy has none, its reference being the base).
        alpha: `ref_model_mixup_alpha`.
        sync_steps: `ref_model_sync_steps`.
    """

    FILE = "reference_model.safetensors"

    def __init__(self, ref_model: torch.nn.Module, alpha: float, sync_steps: int) -> None:
        self.ref_model, self.alpha, self.sync_steps = ref_model, alpha, sync_steps

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            return
        from safetensors.torch import load_file

        path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / self.FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"sync_ref_model: resuming at step {state.global_step} needs the reference as it was then, {path}, "
                "which is not there (resume from a checkpoint in this run's output_dir, or start again).")
        saved = load_file(str(path))
        with torch.no_grad():
            for name, param in self.ref_model.named_parameters():
                param.copy_(saved[name].to(param.device, param.dtype))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.sync_steps != 0:
            return
        policy = dict(model.named_parameters())
        with torch.no_grad():
            for name, param in self.ref_model.named_parameters():
                if name not in policy or policy[name].shape != param.shape:
                    raise ValueError(f"sync_ref_model: the reference weight {name} has no policy weight of its "
                                     "name and shape to mix in.")
                mix_into_reference(policy[name].detach().to(param.device), param.data, self.alpha)

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from safetensors.torch import save_file

        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            save_file({name: param.detach().cpu().contiguous() for name, param in self.ref_model.named_parameters()},
                      str(folder / self.FILE))


def request_stop(output_dir: str | os.PathLike) -> Path:
    """Ask the run in `output_dir` to stop at the end of its current step (see `StopOnRequest`)."""
    path = Path(output_dir) / STOP_FILE
    path.write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z") + "\n", encoding="utf-8")
    return path


def stop_requested(output_dir: str | os.PathLike) -> bool:
    """Whether `output_dir` holds a stop request."""
    return (Path(output_dir) / STOP_FILE).exists()


def _named_trainable(model) -> list:
    if model is None:
        return []
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _trainable(model) -> list:
    return [p for _, p in _named_trainable(model)]


def _norm(params: list) -> float:
    """The L2 norm of `params` taken together."""
    import torch

    if not params:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach().float()) for p in params])))


def truncate_log(output_dir: str | os.PathLike, step: int, file_name: str = LOG_FILE,
                 step_key: str = "current_steps") -> None:
    """Keep the records of `trainer_log.jsonl` up to `step` (all of them at `step`, evaluations too).

    A fresh run (`step == 0`) starts a fresh log. A run resumed from `checkpoint-N` trains steps N+1...
    again, so the records a killed run wrote past N are dropped. The file is replaced atomically, and a
    line cut short by the kill is dropped too. `file_name` and `step_key` name another per-step jsonl file
    of the run and its step field (PPO's `completions.jsonl`, `step`).
    """
    path = Path(output_dir) / file_name
    if step == 0:
        path.unlink(missing_ok=True)
        return
    keep_jsonl_rows(path, lambda record: isinstance(record, dict) and isinstance(record.get(step_key), int)
                    and record[step_key] <= step)


def read_log(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of `trainer_log.jsonl` (empty if the file does not exist).

    A last line without its newline that does not parse is a record being written by a running run, and
    is left out. Any other line that does not parse raises ValueError. (The board reads the log its own
    way, `board.runs.read_records`: incrementally, skipping broken lines.)
    """
    path = Path(output_dir) / LOG_FILE
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    lines = text.split("\n")  # the last item is "" when the file ends with a newline
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                continue
            raise ValueError(f"{path}: line {number} is not JSON ({line[:80]!r})") from None
        if isinstance(record, dict):
            records.append(record)
    return records


def smooth(values: list[float], weight: float | None = None) -> list[float]:
    """Exponential moving average (TensorBoard-style); weight grows with the number of points.

    Example: smooth([1, 3], weight=0.5) -> [1, 0.5*1 + 0.5*3] = [1, 2].
    """
    if not values:
        return []
    if weight is None:
        weight = 1.8 * (1 / (1 + math.exp(-0.05 * len(values))) - 0.5)
    out, last = [], values[0]
    for v in values:
        last = last * weight + (1 - weight) * v
        out.append(last)
    return out


def is_run_summary(record: dict[str, Any]) -> bool:
    """Whether a `trainer_log.jsonl` record is the summary a run logs when `trainer.train()` ends.

    It holds `train_runtime` (which `LogCallback` keeps out of step records) and `train_loss`, the average
    loss of that run (since its resume, for a resumed run), at the step the run ended on: a run's
    summary, not a point of the loss curve.
    """
    return "train_runtime" in record


def plot_loss(output_dir: str | os.PathLike, keys: list[str] | None = None) -> list[Path]:
    """Write `training_<key>.png` (raw and smoothed curves) for each numeric series logged at >= 2 steps.

    Keys default to every logged metric; `/` in a metric name becomes `_` in the file name. Run summaries
    (`is_run_summary`) are not curve points: after a resume each run's average `train_loss` would otherwise
    draw a line between runs. A step logged twice counts once (its last value), and a series with fewer than
    two steps is skipped (one log line names them all), since one point makes empty axes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_log(output_dir) if not is_run_summary(r)]
    skip = {"current_steps", "total_steps", "percentage", "epoch", "elapsed_time", "remaining_time",
            "tokens_per_second", "total_tokens", "learning_rate", "grad_norm", "total_flos"}

    def is_metric(key: str) -> bool:
        return key not in skip and not key.endswith(("_runtime", "_per_second"))

    if keys is None:
        keys = sorted({k for r in records for k, v in r.items() if is_metric(k) and isinstance(v, (int, float))})
    written, too_short = [], []
    for key in keys:
        by_step = {r["current_steps"]: r[key] for r in records if isinstance(r.get(key), (int, float))}
        if len(by_step) < 2:
            too_short.append(key)
            continue
        steps, values = zip(*sorted(by_step.items()))
        plt.figure()
        plt.plot(steps, values, color="#1f77b4", alpha=0.4, label="original")
        plt.plot(steps, smooth(list(values)), color="#1f77b4", label="smoothed")
        plt.title(f"{key} of {Path(output_dir).name}")
        plt.xlabel("step")
        plt.ylabel(key)
        plt.legend()
        name = key.replace("/", "_")
        path = Path(output_dir) / f"training_{name}.png"
        plt.savefig(path, format="png", dpi=100)
        plt.close()
        written.append(path)
    if too_short:
        logger.info("plot_loss: no plot of %s: logged at fewer than 2 steps, and a curve needs 2.", ", ".join(too_short))
    return written
