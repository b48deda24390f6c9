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

from alignkit.config import ModelArguments
from alignkit.config.parse import read_config
from alignkit.data import ChatFormatter
from alignkit.errors import DataError
from alignkit.model.loader import load_tokenizer
from alignkit.train import run_train

pytestmark = pytest.mark.compat

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


def add_lf_data(lf_data) -> None:
    """Register this file's datasets (one small file per LLaMA-Factory demo kind) in the tier's `lf_data`."""
    for name, entry in DATASET_INFO.items():
        entry = dict(entry)
        file_name = entry.pop("file_name")
        lf_data.add(name, file_name, ROWS[name], **entry)


ROWS = {
    "wiki_demo": "The capital of France is Paris.\nThe capital of Japan is Tokyo.\n\nThe waves roll in and out again.\n",
    "glaive_toolcall_demo": [tool_row(i) for i in range(1, 5)],
    "kto_demo": [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                               {"role": "assistant", "content": str(2 * i if i % 3 else 2 * i + 1)}],
                  "label": i % 3 != 0} for i in range(1, 9)],
    "mllm_demo": [{"messages": [{"role": "user", "content": "<image>Who are they?"},
                                {"role": "assistant", "content": "Two players."}],
                   "images": ["mllm_demo_data/1.jpg"]}],
    "alpaca_demo": [{"instruction": "Name a colour.", "input": "", "output": "green"}] * 4,
}


@pytest.fixture
def train(lf_config, lf_data):
    """`train(stage="sft", dataset="alpaca_demo", **keys) -> output_dir`: the tier's LLaMA-Factory config
    (`template: qwen3_nothink` unless given, no eval block: these sets are a few rows), run in-process so
    that log records and exceptions reach the test."""
    add_lf_data(lf_data)

    def run(stage: str = "sft", dataset: str = "alpaca_demo", **keys) -> Path:
        if stage != "pt":
            keys.setdefault("template", "qwen3_nothink")
        config = lf_config(stage, dataset, drop=("val_size", "per_device_eval_batch_size", "eval_strategy",
                                                 "eval_steps"),
                           logging_steps=1, gradient_accumulation_steps=1, dataloader_num_workers=0, **keys)
        run_train(read_config(config))
        return Path(read_config(config).training.output_dir)

    return run


def test_pt_on_a_txt_file(train):
    """Item 6: `wiki_demo` (a .txt registered with `columns: {prompt: text}`) trains under stage pt."""
    out = train(stage="pt", dataset="wiki_demo")
    assert (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2


def test_sft_on_tool_calls_saves_the_template_it_trained_with(train, tiny_model_dir):
    """Items 3, 7, 8: `template: qwen3_nothink` trains the tool rows in ChatML with Qwen-style tool tags, and
    the adapter's saved tokenizer renders the same text, so `alignkit chat --adapter` uses that format."""
    out = train(dataset="glaive_toolcall_demo")
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


def test_kto_tags_under_sft_warn_with_the_rows(train, caplog):
    """Item 9: rows tagged false are named (and still trained: the stage cannot use the tag)."""
    with caplog.at_level(logging.WARNING, logger="alignkit.data.loader"):
        train(dataset="kto_demo")
    assert "2 of 8 rows are marked undesirable (`label` is false): row 3, 6." in caplog.text
    assert "Use stage: kto" in caplog.text


def test_multimodal_dataset_is_refused(train, tmp_path):
    """Item 10: mllm_demo on a text-only model stops before the model loads, naming the dataset and the column
    (vision-language models train on it: docs/multimodal.md)."""
    with pytest.raises(DataError, match="dataset 'mllm_demo': dataset_info.json maps `images`.*The model is text-only"):
        train(dataset="mllm_demo")
    assert not list((tmp_path / "saves").glob("*/adapter_model.safetensors"))


def test_llama3_template_on_a_chatml_tokenizer_is_refused(train):
    """Item 7: `template: llama3` (LLaMA-Factory's llama3 examples) on a tokenizer without Llama 3's special
    tokens is refused with the fix, not trained as text."""
    with pytest.raises(DataError, match=r"template='llama3' writes the special token\(s\) <\|begin_of_text\|>.*"
                                        "use template: chatml"):
        train(template="llama3")


@pytest.mark.parametrize("template", ["smollm", "smollm2", "qwen", "default"])
def test_llama_factory_template_names_train(train, template):
    """Item 3: LLaMA-Factory's names for the families whose tokens the tiny (ChatML) tokenizer has."""
    out = train(template=template)
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
