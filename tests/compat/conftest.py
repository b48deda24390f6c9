"""The LLaMA-Factory compatibility tier: configs written the way LLaMA-Factory's examples write them, run
through `alignkit train` on the tiny model.

Fixtures for every file of this tier (other cases add their own datasets and keys):

- `lf_data`: an `LFDataDir`, a `dataset_dir` holding a `dataset_info.json` in LLaMA-Factory's format and
  its data files. It starts with `alpaca_demo` (alpaca instructions), `text_demo` (a jsonl `text` column
  for pt) and `pairs_demo` (sharegpt conversations with `chosen` / `rejected` turns, `ranking: true`);
  `lf_data.add(...)` writes another one.
- `lf_config(stage, dataset, **keys)`: writes a YAML with the keys and values of LLaMA-Factory's
  `examples/train_lora/*_lora_<stage>.yaml` (model, method, dataset, output, train and eval sections),
  changed only where a run here needs it: the tiny model, `lf_data`'s folder, an output folder under
  the test's tmp dir, `template: chatml` (the tiny tokenizer's format; also a LLaMA-Factory template
  name), `max_steps: 2`, and the eval block (commented out in the examples) switched on. `keys`
  override or add keys; `drop=(...)` leaves keys out.
- `run_alignkit(config, *overrides)`: runs `python -m alignkit train CONFIG key=value ...` in its own
  process, as a user would, and returns the finished process (stdout and stderr captured apart).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

# Per stage, the method keys of LLaMA-Factory's example (`stage: dpo` adds the preference keys).
_METHOD_KEYS: dict[str, dict[str, Any]] = {
    "pt": {},
    "sft": {},
    "rm": {},
    "dpo": {"pref_beta": 0.1, "pref_loss": "sigmoid"},
    "kto": {"pref_beta": 0.1},
}
# LLaMA-Factory's learning rates per stage and finetuning type, as in its examples.
_LEARNING_RATES = {"dpo": 5.0e-6, "kto": 5.0e-6}


class LFDataDir:
    """A LLaMA-Factory `dataset_dir`: data files plus the `dataset_info.json` that names them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.info: dict[str, dict[str, Any]] = {}
        path.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, file_name: str, content: list[dict] | str, **entry: Any) -> Path:
        """Write `content` to `file_name` and register it as dataset `name`.

        Args:
            name: the dataset's name in `dataset_info.json` (what `dataset:` refers to).
            file_name: `.json` (rows as one JSON list), `.jsonl` (one row a line) or any other suffix (a
                string written as is, e.g. a `.txt` file).
            content: the rows, or the file's text.
            **entry: the rest of the `dataset_info.json` entry (`formatting`, `ranking`, `columns`, `tags`).
        """
        target = self.path / file_name
        if isinstance(content, str):
            target.write_text(content, encoding="utf-8")
        elif file_name.endswith(".jsonl"):
            target.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in content), encoding="utf-8")
        else:
            target.write_text(json.dumps(content, ensure_ascii=False, indent=2), encoding="utf-8")
        self.info[name] = {"file_name": file_name, **entry}
        (self.path / "dataset_info.json").write_text(json.dumps(self.info, indent=2), encoding="utf-8")
        return target


_QUESTIONS = [("What is 12 plus 7?", "12 plus 7 is 19.", "12 plus 7 is 27."),
              ("What is the capital of France?", "The capital of France is Paris.", "It is Tokyo."),
              ("Name a colour.", "Green.", "An apple."),
              ("List three fruits.", "Apple, banana, cherry.", "Green, blue, red."),
              ("Translate to French: good morning.", "Bonjour.", "Good morning."),
              ("Why is the sky blue?", "Sunlight scatters off air molecules.", "Because it is."),
              ("What is 9 times 3?", "It is 27.", "It is 19."),
              ("Tom has 5 apples and buys 3 more. How many?", "He has 8.", "He has 5."),
              ("Write a short poem about the sea.", "The waves roll in and out again.", "The sky is blue."),
              ("Introduce yourself in one sentence.", "I am a helpful assistant.", "No.")]


@pytest.fixture
def lf_data(tmp_path) -> LFDataDir:
    data = LFDataDir(tmp_path / "data")
    # Alpaca, registered by file name alone as LLaMA-Factory's alpaca_en_demo is.
    data.add("alpaca_demo", "alpaca_demo.json",
             [{"instruction": q, "input": "", "output": good} for q, good, _ in _QUESTIONS])
    data.add("text_demo", "text_demo.jsonl", [{"text": f"{q} {good}"} for q, good, _ in _QUESTIONS],
             columns={"prompt": "text"})
    data.add("pairs_demo", "pairs_demo.json",
             [{"conversations": [{"from": "human", "value": q}], "chosen": {"from": "gpt", "value": good},
               "rejected": {"from": "gpt", "value": bad}} for q, good, bad in _QUESTIONS],
             ranking=True, formatting="sharegpt",
             columns={"messages": "conversations", "chosen": "chosen", "rejected": "rejected"})
    return data


@pytest.fixture
def lf_config(tmp_path, tiny_model_dir, lf_data):
    """`lf_config(stage, dataset, name=None, drop=(), **keys) -> Path` of the YAML written (module docstring)."""

    def write(stage: str, dataset: str, name: str | None = None, drop: tuple[str, ...] = (), **keys: Any) -> Path:
        name = name or f"{stage}_{keys.get('finetuning_type', 'lora')}"
        full = keys.get("finetuning_type") == "full"
        sections: dict[str, dict[str, Any]] = {
            "model": {"model_name_or_path": tiny_model_dir, "trust_remote_code": True},
            "method": {"stage": stage, "do_train": True,
                       **({"finetuning_type": "full"} if full else
                          {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all"}),
                       **_METHOD_KEYS.get(stage, {})},
            "dataset": {"dataset": dataset, "dataset_dir": str(lf_data.path),
                        **({} if stage == "pt" else {"template": "chatml"}),
                        "cutoff_len": 2048, "max_samples": 1000, "overwrite_cache": True,
                        "preprocessing_num_workers": 16, "dataloader_num_workers": 4},
            "output": {"output_dir": str(tmp_path / "saves" / name), "logging_steps": 10, "save_steps": 500,
                       "plot_loss": True, "overwrite_output_dir": True, "save_only_model": False,
                       "report_to": "none"},
            "train": {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2 if full else 8,
                      "learning_rate": 1.0e-5 if full else _LEARNING_RATES.get(stage, 1.0e-4),
                      "num_train_epochs": 3.0, "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "bf16": True,
                      "ddp_timeout": 180000000, "resume_from_checkpoint": None, "max_steps": 2},
            "eval": {"val_size": 0.1, "per_device_eval_batch_size": 1, "eval_strategy": "steps", "eval_steps": 500},
        }
        for key, value in keys.items():
            next((s for s in sections.values() if key in s), sections["train"])[key] = value
        for key in drop:
            for values in sections.values():
                values.pop(key, None)
        text = "".join(f"### {title}\n" + yaml.safe_dump(values, sort_keys=False) + "\n"
                       for title, values in sections.items() if values)
        path = tmp_path / f"{name}.yaml"
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def run_alignkit(tmp_path):
    """`run_alignkit(config, *overrides, timeout=600) -> subprocess.CompletedProcess` of `alignkit train`."""

    def run(config: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        return subprocess.run([sys.executable, "-m", "alignkit", "train", str(config), *overrides], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=timeout)

    return run
