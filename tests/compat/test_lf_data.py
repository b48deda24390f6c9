"""LLaMA-Factory data as its users have it, end to end: a `dataset_info.json` in its format and configs with
its key names, two training steps on the tiny model (issue 17, items 3, 6-10).

The writer here is minimal (the keys of LLaMA-Factory's `examples/train_lora/*.yaml` that do not depend on
the machine); the rows are written for these tests in the demo files' layouts, not copied from them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from alignkit.data import ChatFormatter, DataError
from alignkit.hparams import ModelArguments, read_config
from alignkit.model.loader import load_tokenizer
from alignkit.train import run_train

ROLE_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
DATASET_INFO = {
    "wiki_demo": {"file_name": "wiki_demo.txt", "columns": {"prompt": "text"}},
    "glaive_toolcall_demo": {"file_name": "glaive_toolcall_demo.json", "formatting": "sharegpt",
                             "columns": {"messages": "conversations", "tools": "tools"}},
    "kto_demo": {"file_name": "kto_demo.json", "formatting": "sharegpt", "tags": ROLE_TAGS,
                 "columns": {"messages": "messages", "kto_tag": "label"}},
    "mllm_demo": {"file_name": "mllm_demo.json", "formatting": "sharegpt", "tags": ROLE_TAGS,
                  "columns": {"messages": "messages", "images": "images"}},
    "alpaca_demo": {"file_name": "alpaca_demo.json"},
}
TOOLS = [{"name": "convert_currency", "description": "Convert an amount between currencies",
          "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                                                          "to": {"type": "string"}}, "required": ["amount"]}}]


def tool_row(i: int) -> dict:
    call = {"name": "convert_currency", "arguments": {"amount": 10 * i, "from": "USD", "to": "EUR"}}
    return {"conversations": [
        {"from": "human", "value": f"How much is {10 * i} dollars in euros?"},
        {"from": "function_call", "value": json.dumps(call)},
        {"from": "observation", "value": json.dumps({"converted": 9 * i})},
        {"from": "gpt", "value": f"{10 * i} dollars are {9 * i} euros."}], "tools": json.dumps(TOOLS)}


def write_lf_data(folder: Path) -> Path:
    """A LLaMA-Factory `data/` folder: dataset_info.json and one small file per demo kind."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset_info.json").write_text(json.dumps(DATASET_INFO, indent=2), encoding="utf-8")
    (folder / "wiki_demo.txt").write_text(
        "The capital of France is Paris.\nThe capital of Japan is Tokyo.\n\nThe waves roll in and out again.\n",
        encoding="utf-8")
    (folder / "glaive_toolcall_demo.json").write_text(json.dumps([tool_row(i) for i in range(1, 5)]), encoding="utf-8")
    kto = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                         {"role": "assistant", "content": str(2 * i if i % 3 else 2 * i + 1)}], "label": i % 3 != 0}
           for i in range(1, 9)]
    (folder / "kto_demo.json").write_text(json.dumps(kto), encoding="utf-8")
    (folder / "mllm_demo.json").write_text(json.dumps([{"messages": [
        {"role": "user", "content": "<image>Who are they?"}, {"role": "assistant", "content": "Two players."}],
        "images": ["mllm_demo_data/1.jpg"]}]), encoding="utf-8")
    (folder / "alpaca_demo.json").write_text(json.dumps([{"instruction": "Name a colour.", "input": "",
                                                          "output": "green"}] * 4), encoding="utf-8")
    return folder


def write_lf_config(path: Path, model: str, data_dir: Path, output_dir: Path, **changes) -> Path:
    """A config in LLaMA-Factory's example layout (`examples/train_lora/*_lora_sft.yaml`), two steps."""
    config = {
        "model_name_or_path": model, "trust_remote_code": True,
        "stage": "sft", "do_train": True, "finetuning_type": "lora", "lora_rank": 8, "lora_target": "all",
        "dataset": "alpaca_demo", "dataset_dir": str(data_dir), "template": "qwen3_nothink", "cutoff_len": 2048,
        "max_samples": 1000, "overwrite_cache": True, "preprocessing_num_workers": 16,
        "dataloader_num_workers": 0, "output_dir": str(output_dir), "logging_steps": 1, "save_steps": 500,
        "plot_loss": True, "overwrite_output_dir": True, "save_only_model": False, "report_to": "none",
        "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "learning_rate": 1.0e-4,
        "num_train_epochs": 3.0, "lr_scheduler_type": "cosine", "max_steps": 2,
    }
    config.update(changes)
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def train(tmp_path: Path, model: str, **changes) -> Path:
    data_dir = write_lf_data(tmp_path / "data")
    out = tmp_path / "saves"
    run_train(read_config(write_lf_config(tmp_path / "config.yaml", model, data_dir, out, **changes)))
    return out


def test_pt_on_a_txt_file(tmp_path, tiny_model_dir):
    """Item 6: `wiki_demo` (a .txt registered with `columns: {prompt: text}`) trains under stage pt."""
    out = train(tmp_path, tiny_model_dir, stage="pt", dataset="wiki_demo", template=None)
    assert (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2


def test_sft_on_tool_calls_saves_the_template_it_trained_with(tmp_path, tiny_model_dir):
    """Items 3, 7, 8: `template: qwen3_nothink` trains the tool rows in ChatML with Qwen-style tool tags, and
    the adapter's saved tokenizer renders the same text, so `alignkit chat --adapter` uses that format."""
    out = train(tmp_path, tiny_model_dir, dataset="glaive_toolcall_demo")
    base = load_tokenizer(ModelArguments(model_name_or_path=tiny_model_dir))
    trained = ChatFormatter(base, "qwen3_nothink")
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == trained.jinja_template()
    after = ChatFormatter(load_tokenizer(ModelArguments(model_name_or_path=tiny_model_dir,
                                                        adapter_name_or_path=str(out))))
    messages = [{"role": "user", "content": "How much is 10 dollars in euros?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "convert_currency", "arguments": {"amount": 10}}}]},
                {"role": "tool", "content": '{"converted": 9}'}]
    assert after.prompt_text(messages, tools=json.dumps(TOOLS)) == trained.prompt_text(messages, tools=json.dumps(TOOLS))
    assert "<tool_call>\n" in trained.render(messages, tools=json.dumps(TOOLS))


def test_kto_tags_under_sft_warn_with_the_rows(tmp_path, tiny_model_dir, caplog):
    """Item 9: rows tagged false are named (and still trained: the stage cannot use the tag)."""
    with caplog.at_level(logging.WARNING, logger="alignkit.data.loader"):
        train(tmp_path, tiny_model_dir, dataset="kto_demo")
    assert "2 of 8 rows are marked undesirable (`label` is false): row 3, 6." in caplog.text
    assert "Use stage: kto" in caplog.text


def test_multimodal_dataset_is_refused(tmp_path, tiny_model_dir):
    """Item 10: mllm_demo stops before the model loads, naming the dataset and the column."""
    with pytest.raises(DataError, match="dataset 'mllm_demo': dataset_info.json maps `images`.*not supported yet"):
        train(tmp_path, tiny_model_dir, dataset="mllm_demo")
    assert not (tmp_path / "saves" / "adapter_model.safetensors").exists()


def test_llama3_template_on_a_chatml_tokenizer_is_refused(tmp_path, tiny_model_dir):
    """Item 7: `template: llama3` (LLaMA-Factory's llama3 examples) on a tokenizer without Llama 3's special
    tokens is refused with the fix, not trained as text."""
    with pytest.raises(DataError, match=r"template='llama3' writes the special token\(s\) <\|begin_of_text\|>.*"
                                        "use template: chatml"):
        train(tmp_path, tiny_model_dir, template="llama3")


@pytest.mark.parametrize("template", ["smollm", "smollm2", "qwen", "default"])
def test_llama_factory_template_names_train(tmp_path, tiny_model_dir, template):
    """Item 3: LLaMA-Factory's names for the families whose tokens the tiny (ChatML) tokenizer has."""
    out = train(tmp_path, tiny_model_dir, template=template)
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
