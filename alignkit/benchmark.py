"""`alignkit eval --tasks`: benchmark tasks of lm-evaluation-harness on the base model or base + adapter.

lm-eval (the `lm-eval` extra) does the evaluation: its `HFLM` wraps the model alignkit loads (adapters merged, as
`alignkit chat` loads them) and `simple_evaluate` runs the tasks. A task is named as lm-eval names it, or given
as a task YAML file; a name that is a YAML file in the checkout's `data/lm_eval/` is the shipped task of that
name (`demo_reply_choice`: pick each demo_sft_eval question's own reply among four, from
`scripts/make_lm_eval_task.py`). A YAML's `dataset_kwargs.data_files` are read beside the YAML, so a task and its
local data travel together and run offline. Scores go to `OUTPUT/eval_results.json` (the board shows a run
folder's `eval_results.json`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from .config import FinetuningArguments, ModelArguments
from .errors import ConfigError

logger = logging.getLogger(__name__)

SHIPPED_TASKS = Path(__file__).resolve().parents[1] / "data" / "lm_eval"


def check_installed() -> None:
    """Raise a ConfigError naming the install command when lm-eval is missing."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("alignkit eval --tasks needs lm-evaluation-harness: pip install 'alignkit[lm-eval]'.")


def task_config(task: str) -> Any:
    """What `simple_evaluate` takes for `task`: a YAML file's config (its local data files made absolute), the
    shipped task of that name, or the name itself (lm-eval's own task registry).

    Raises:
        ConfigError: a `.yaml` path that does not exist, or one without a `task` key.
    """
    import yaml

    path = Path(task)
    if not task.endswith((".yaml", ".yml")):
        shipped = SHIPPED_TASKS / f"{task}.yaml"
        if not shipped.is_file():
            return task
        path = shipped
    if not path.is_file():
        raise ConfigError(f"--tasks {task}: no such task file.")
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict) or "task" not in config:
        raise ConfigError(f"--tasks {task}: a task YAML needs a `task:` name (lm-eval's task format).")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        config["dataset_kwargs"]["data_files"] = {
            split: str((path.parent / name).resolve()) if not Path(name).is_absolute() else name
            for split, name in files.items()}
    return config


def run_tasks(model_args: ModelArguments, tasks: list[str], *, limit: Optional[int] = None, batch_size: int = 8,
              output_dir: Optional[str] = None) -> dict[str, dict[str, float]]:
    """Run lm-eval `tasks` on the model (base + merged adapters) and return {task: {metric: value}}.

    Args:
        model_args: the base and `adapter_name_or_path`.
        tasks: names or YAML files (see `task_config`).
        limit: evaluate only the first `limit` documents of each task.
        batch_size: sequences per forward pass.
        output_dir: where to write `eval_results.json` (none when None).

    Raises:
        ConfigError: lm-eval not installed, a task file missing or malformed (before the model loads).
    """
    check_installed()
    configs = [task_config(task) for task in tasks]
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from .model.loader import load_model, load_tokenizer

    tokenizer = load_tokenizer(model_args)
    model = load_model(model_args, FinetuningArguments(), is_trainable=False)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    results = lm_eval.simple_evaluate(model=lm, tasks=configs, limit=limit, log_samples=False)
    scores = {task: {metric.split(",")[0]: value for metric, value in values.items()
                     if isinstance(value, (int, float)) and not metric.startswith("alias")}
              for task, values in results["results"].items()}
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        record = {"model": model_args.model_name_or_path or "bundled", "adapter": model_args.adapter_name_or_path,
                  "limit": limit, "results": scores}
        (out / "eval_results.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return scores


__all__ = ["run_tasks", "task_config", "check_installed", "SHIPPED_TASKS"]
