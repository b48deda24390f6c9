"""Experiment trackers (`report_to`): which are installed, checked before any model loads.

transformers does the reporting: `report_to` names its integration callbacks (`TensorBoardCallback`,
`WandbCallback`, `MLflowCallback`), which receive every `Trainer.log` call. Every stage logs through
`Trainer.log`, PPO's own loop included (`PPOTrainer.train` calls `self.log` at each logging step), so a tracker
receives the same scalars as `trainer_log.jsonl` (docs/trackers.md lists the names each one shows).

What transformers leaves late is the missing package: it fails when the Trainer is built, after the data and the
model have loaded, and a comma-separated `report_to=tensorboard,wandb` from the command line is read there as
one integration's name. `check_report_to` splits the list and names the install command first.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

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


__all__ = ["TRACKERS", "check_report_to", "check_mlflow_store"]
