"""`alignkit eval --tasks`: lm-evaluation-harness tasks on the tiny model, base and base + adapter, offline."""

from __future__ import annotations

import json

import pytest

from alignkit.cli import main
from alignkit.errors import ConfigError

pytest.importorskip("lm_eval")


def test_shipped_task_runs_with_and_without_an_adapter(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                       save_perturbed_adapter):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    adapter = tmp_path / "sft"
    save_perturbed_adapter(tiny_model_dir, adapter)
    scores = {}
    for name, extra in (("base", []), ("sft", ["--adapter", str(adapter)])):
        out = tmp_path / name
        assert main(["eval", "--tasks", "demo_reply_choice", "--model", tiny_model_dir, "--max-samples", "8",
                     "--output-dir", str(out), *extra]) == 0
        printed = capsys.readouterr().out
        assert "demo_reply_choice: " in printed and "acc " in printed
        record = json.loads((out / "eval_results.json").read_text())
        assert record["limit"] == 8 and record["adapter"] == (str(adapter) if extra else None)
        scores[name] = record["results"]["demo_reply_choice"]
        assert 0.0 <= scores[name]["acc"] <= 1.0 and scores[name]["sample_len"] == 8
    # The adapter changes the model, so the log-likelihoods the scores come from differ; equal accuracies on 8
    # questions are possible, but not equal normalised and unnormalised accuracies and stderrs all at once.
    assert scores["base"] != scores["sft"]


def test_a_task_yaml_reads_its_data_beside_it(tmp_path):
    from alignkit.benchmark import task_config

    (tmp_path / "mine.yaml").write_text("task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                        "    test: rows.jsonl\noutput_type: multiple_choice\n")
    config = task_config(str(tmp_path / "mine.yaml"))
    assert config["dataset_kwargs"]["data_files"] == {"test": str(tmp_path / "rows.jsonl")}
    assert task_config("hellaswag") == "hellaswag"  # lm-eval's own registry
    with pytest.raises(ConfigError, match="no such task file"):
        task_config(str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.yaml").write_text("dataset_path: json\n")
    with pytest.raises(ConfigError, match="needs a `task:` name"):
        task_config(str(tmp_path / "bad.yaml"))


def test_eval_without_tasks_or_rewards_is_a_clear_error(capsys):
    assert main(["eval"]) == 2
    assert "needs --dataset and --reward" in capsys.readouterr().err
