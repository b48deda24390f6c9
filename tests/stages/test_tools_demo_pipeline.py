"""The calculator demo's commands in order, on the tiny model (one step each): examples/sft_tools_lora.yaml, then
examples/grpo_tools_lora.yaml from its adapter, then `alignkit eval --tools` of the result. The examples' own keys are
kept except the model, the output folders and the sizes; docs/stages/tools.md lists the same commands."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from alignkit.callbacks import read_log
from alignkit.cli import main
from alignkit.config.parse import read_config
from alignkit.train import run_train

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["max_steps=1", "use_cpu=true", "max_samples=8", "save_steps=1"]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_log(out) if "loss" in r]


def test_sft_then_grpo_with_tools_then_eval_with_tools(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the examples' relative paths (data/, tools/ beside the YAML) as a user runs them
    sft_out, grpo_out = tmp_path / "sft_tools", tmp_path / "grpo_tools"
    sft = read_config(ROOT / "examples" / "sft_tools_lora.yaml", [
        f"model_name_or_path={tiny_model_dir}", f"output_dir={sft_out}", "per_device_train_batch_size=2", *QUICK])
    assert sft.data.dataset == "demo_tools_sft" and sft.data.template == "smollm2"
    run_train(sft)
    assert len(_losses(sft_out)) == 1 and torch.isfinite(torch.tensor(_losses(sft_out))).all()
    assert (sft_out / "adapter_config.json").is_file()

    grpo_path = ROOT / "examples" / "grpo_tools_lora.yaml"
    assert read_config(grpo_path).model.adapter_name_or_path == "saves/smollm2/lora/sft_tools"  # sft's output_dir
    assert sft.training.output_dir.endswith("sft_tools") and "saves/smollm2/lora/sft_tools" == \
        read_config(ROOT / "examples" / "sft_tools_lora.yaml").training.output_dir
    grpo = read_config(grpo_path, [
        f"model_name_or_path={tiny_model_dir}", f"adapter_name_or_path={sft_out}", f"output_dir={grpo_out}",
        "per_device_train_batch_size=4", "num_generations=4", "max_completion_length=24", *QUICK])
    run_train(grpo)
    records = [r for r in read_log(grpo_out) if "loss" in r]
    assert len(records) == 1 and "tools/call_frequency" in records[0]

    rows = tmp_path / "rows.jsonl"
    code = main(["eval", "--model", tiny_model_dir, "--adapter", str(grpo_out), "--dataset", "demo_math_eval",
                 "--reward", "accuracy", "--template", "smollm2", "--max-new-tokens", "24", "--max-samples", "2",
                 "--tools", "examples/tools/calculator.py:calculate", "max_tool_calling_iterations=2",
                 "max_tool_output_chars=200", "--output", str(rows)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "accuracy: " in printed and "tool calls: " in printed
    assert len(rows.read_text(encoding="utf-8").splitlines()) == 2
    assert all("messages" in json.loads(line) for line in rows.read_text(encoding="utf-8").splitlines())
