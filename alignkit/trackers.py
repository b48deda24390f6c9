"""Experiment trackers (`report_to`): which are installed, checked before any model loads.

transformers does the reporting: `report_to` names its integration callbacks (`TensorBoardCallback`,
`WandbCallback`, `MLflowCallback`), which receive every `Trainer.log` call. Every stage logs through
`Trainer.log`, PPO's own loop included (`PPOTrainer.train` calls `self.log` at each logging step), so a tracker
receives the same scalars as `trainer_log.jsonl` (docs/trackers.md lists the names each one shows).

What transformers leaves late is the missing package: it fails when the Trainer is built, after the data and the
model have loaded, and a comma-separated `report_to=tensorboard,wandb` from the command line is read there as
one integration's name. `check_report_to` splits the list and names the install command first.
`WandbCompletionsTable` adds what transformers does not send: GRPO's and PPO's completions as a wandb Table, and
`report_evaluation` sends `alignkit eval`'s results (rewards or lm-eval tasks) through the same integrations.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from transformers import TrainerCallback

from .errors import ConfigError

# report_to name -> (modules any one of which makes it work, the alignkit extra that installs it)
TRACKERS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow",), "mlflow"),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_report_to(value: Any) -> Any:
    """`report_to` as transformers takes it, with each tracker alignkit documents checked as installed.

    A string becomes a list, split at commas (`report_to=tensorboard,wandb` on the command line); `none` and
    `all` stay as they are. Integrations other than `TRACKERS` are transformers' own business (it names the
    supported ones).

    Example: `check_report_to("tensorboard, mlflow")` is `["tensorboard", "mlflow"]` when both are installed;
    `check_report_to("none")` is `"none"`.

    Raises:
        ConfigError: a tracker of `TRACKERS` whose package is not installed, with the command that installs it;
            an MLflow store that would refuse the run (`check_mlflow_store`).
    """
    if isinstance(value, str):
        names = [name.strip() for name in value.split(",") if name.strip()]
        if names in ([], ["none"], ["all"]):
            return names[0] if names else "none"
        value = names
    if not isinstance(value, (list, tuple)):
        return value
    missing = [name for name in value if name in TRACKERS and not any(_installed(m) for m in TRACKERS[name][0])]
    if missing:
        extras = ",".join(TRACKERS[name][1] for name in missing)
        packages = " ".join(TRACKERS[name][0][0] for name in missing)
        raise ConfigError(f"report_to names {', '.join(missing)}, which is not installed here; install it with "
                          f"pip install 'alignkit[{extras}]' (or pip install {packages}), or remove it from "
                          "report_to.")
    if "mlflow" in value:
        check_mlflow_store(os.environ)
    return list(value)


def check_mlflow_store(environ) -> None:
    """Refuse an MLflow tracking store that would fail when the Trainer starts its run.

    MLflow 3 stores runs in `sqlite:///mlflow.db` when `MLFLOW_TRACKING_URI` is unset, which needs SQLAlchemy
    (not in `mlflow-skinny`), and refuses a file store (`file:./mlruns`, or a plain path) unless
    `MLFLOW_ALLOW_FILE_STORE=true`: both would surface only after the model has loaded.

    Raises:
        ConfigError: saying which variable to set.
    """
    uri = environ.get("MLFLOW_TRACKING_URI", "")
    offline = ("MLFLOW_TRACKING_URI=file:./mlruns MLFLOW_ALLOW_FILE_STORE=true (a folder of plain files, "
               "docs/trackers.md)")
    if not uri:
        if not _installed("sqlalchemy"):
            raise ConfigError("report_to=mlflow without MLFLOW_TRACKING_URI: MLflow's default store, "
                              "sqlite:///mlflow.db, needs SQLAlchemy, which is not installed. Set "
                              f"{offline}, point MLFLOW_TRACKING_URI at a tracking server, or pip install mlflow.")
        return
    scheme = uri.split(":", 1)[0] if "://" in uri or uri.startswith("file:") else ""
    if scheme in ("", "file") and environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
        try:
            from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE  # noqa: F401  (MLflow >= 3.7 asks)
        except ImportError:
            return
        raise ConfigError(f"report_to=mlflow with the file store MLFLOW_TRACKING_URI={uri}: MLflow refuses file "
                          "stores unless MLFLOW_ALLOW_FILE_STORE=true; set it (or use a database or server URI).")


class WandbCompletionsTable(TrainerCallback):
    """GRPO's and PPO's `completions.jsonl` rows (`log_completions: true`) as a wandb Table at each logging step.

    Reads the rows appended since its last logging step from the file the online stages write
    (`alignkit.rl.record`), so it needs nothing from the stages; logged as `completions` with the step in
    `train/global_step`, the step axis `WandbCallback` sets up. Added by `train.run_train` when `report_to` names
    wandb.
    """

    def __init__(self) -> None:
        self._offset = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._offset = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        import json
        from pathlib import Path

        path = Path(args.output_dir) / "completions.jsonl"
        if not state.is_world_process_zero or not path.is_file():
            return
        with open(path, "rb") as stream:
            stream.seek(self._offset)
            text = stream.read()
        complete = text[:text.rfind(b"\n") + 1]  # a row being written is read next time
        self._offset += len(complete)
        rows = [json.loads(line) for line in complete.decode("utf-8").splitlines() if line.strip()]
        import wandb

        if not rows or wandb.run is None:
            return
        names = sorted({name for row in rows for name in row.get("rewards") or {}})
        columns = ["step", "prompt", "completion", "reward", "advantage"] + names
        data = [[row.get("step"), json.dumps(row.get("prompt"), ensure_ascii=False)
                 if not isinstance(row.get("prompt"), str) else row.get("prompt"),
                 json.dumps(row.get("completion"), ensure_ascii=False)
                 if not isinstance(row.get("completion"), str) else row.get("completion"),
                 row.get("reward"), row.get("advantage")] + [(row.get("rewards") or {}).get(n) for n in names]
                for row in rows]
        wandb.run.log({"completions": wandb.Table(columns=columns, data=data),
                       "train/global_step": state.global_step})


def report_evaluation(args, metrics: dict[str, float], model: Any = None) -> list[str]:
    """Send an `alignkit eval` result to the trackers `args.report_to` names, as evaluation metrics at step 0.

    The same integration callbacks as training (`get_reporting_integration_callbacks`) receive one `on_log` of
    `eval_<name>` values between `on_train_begin` and `on_train_end`, so each tracker files them where it files a
    training run's evaluation: TensorBoard event files under `args.output_dir/runs/` (or `TENSORBOARD_LOGGING_DIR`)
    as `eval/<name>`, a wandb run (`WANDB_MODE=offline` keeps it local) with `eval/<name>`, an MLflow run with
    `eval_<name>`. Values that are None or not finite are left out.

    Args:
        args: the run's `TrainingArguments` (`report_to`, `output_dir`, `run_name`).
        metrics: name -> value, e.g. {"reward": 0.4, "rewards/accuracy/mean": 0.4} (`RewardEvaluation.metrics`).
        model: the evaluated model, for the trackers that record its config (None: none is recorded).

    Returns:
        The `eval_` names sent (empty when `report_to` names no tracker).
    """
    import math

    from transformers import TrainerControl, TrainerState
    from transformers.integrations import get_reporting_integration_callbacks

    callbacks = [callback() for callback in get_reporting_integration_callbacks(args.report_to)]
    logs = {f"eval_{name}": float(value) for name, value in metrics.items()
            if value is not None and math.isfinite(float(value))}
    if not callbacks or not logs:
        return []
    state, control = TrainerState(), TrainerControl()
    wandb_run_before = _wandb_run() if "wandb" in args.report_to else None
    for callback in callbacks:
        callback.on_train_begin(args, state, control, model=model)
        callback.on_log(args, state, control, model=model, logs=dict(logs))
        callback.on_train_end(args, state, control, model=None)  # None: wandb's model upload stays off
    if "wandb" in args.report_to and wandb_run_before is None and _wandb_run() is not None:
        import wandb

        wandb.finish()  # the run this evaluation started is complete (and an offline run is written out)
    return list(logs)


def _wandb_run():
    import sys

    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None)


def tracker_callbacks(report_to: Any) -> list[TrainerCallback]:
    """alignkit's own additions to transformers' reporting for the trackers `report_to` names."""
    names = report_to if isinstance(report_to, (list, tuple)) else [report_to]
    return [WandbCompletionsTable()] if "wandb" in names else []


__all__ = ["TRACKERS", "check_report_to", "check_mlflow_store", "WandbCompletionsTable", "report_evaluation",
           "tracker_callbacks"]
