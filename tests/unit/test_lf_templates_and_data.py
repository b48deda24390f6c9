"""LLaMA-Factory data compatibility in the data layer: template names, refused special tokens, the Jinja
template saved with a model, tool-calling rows, .txt pretraining files, media columns, unused KTO tags."""

from __future__ import annotations

import copy
import json
import logging
import re

import pytest

from alignkit.config import ModelArguments
from alignkit.config.parse import parse_config
from alignkit.data import IGNORE_INDEX, ChatFormatter, get_dataset
from alignkit.data.formats import DatasetAttr, convert_row
from alignkit.data.loader import convert_dataset, resolve_datasets
from alignkit.data.template import BUILTIN_TEMPLATES, TEMPLATE_ALIASES, missing_special_tokens
from alignkit.errors import DataError
from alignkit.model.loader import load_tokenizer
from alignkit.stages import STAGES

LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# A sharegpt row with tools in LLaMA-Factory's layout (written here, not LLaMA-Factory's file).
TOOL_ROW = {"conversations": [
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": json.dumps(CALL)},
    {"from": "observation", "value": '{"temp": 20}'},
    {"from": "gpt", "value": "It is 20 C."}], "system": "Be brief.", "tools": json.dumps(TOOLS)}
CONVERSATION = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
    {"role": "tool", "content": '{"temp": 20}'}, {"role": "assistant", "content": "It is 20 C."},
    {"role": "user", "content": "And <think> tomorrow?"}, {"role": "assistant", "content": "<think>hm</think>Same."}]


@pytest.fixture
def full_tokenizer(tiny_tokenizer):
    """The tiny ChatML tokenizer plus Llama 3's and Qwen3's special tokens, so every built-in can render."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_tokens(LLAMA3_TOKENS + ["<think>", "</think>"], special_tokens=True)
    return tokenizer


def trained_spans(tokenizer, row):
    spans, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label == IGNORE_INDEX:
            spans, current = (spans + [current], []) if current else (spans, [])
        else:
            current.append(token)
    return [tokenizer.decode(s) for s in spans + ([current] if current else [])]


def write_registry(tmp_path, entries: dict, files: dict):
    for name, content in files.items():
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    (tmp_path / "dataset_info.json").write_text(json.dumps(entries), encoding="utf-8")


def load(tmp_path, tokenizer, dataset, stage="sft", **keys):
    values = {"dataset": dataset, "dataset_dir": str(tmp_path), "stage": stage, "cutoff_len": 2048, **keys}
    return get_dataset(parse_config(values), tokenizer, STAGES[stage].data_kind)


# ---------------------------------------------------------------------------------------------- templates
def test_llama_factory_names_render_as_their_builtin(tiny_tokenizer):
    """qwen3_nothink and smollm are plain ChatML; qwen and smollm2 add their family's default system prompt
    only when the conversation has none."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    chatml = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    for alias in TEMPLATE_ALIASES:
        assert ChatFormatter(tiny_tokenizer, alias).render(messages) == chatml
    assert ChatFormatter(tiny_tokenizer, "qwen").render(messages) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n" + chatml)
    assert ChatFormatter(tiny_tokenizer, "smollm2").render(messages).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n")
    with_system = [{"role": "system", "content": "S"}] + messages
    assert ChatFormatter(tiny_tokenizer, "qwen").render(with_system) == "<|im_start|>system\nS<|im_end|>\n" + chatml


def test_default_template_is_llama_factorys_transcript(tiny_tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}]
    assert ChatFormatter(tiny_tokenizer, "default").render(messages) == (
        "System: S<|im_end|>\nHuman: Hi<|im_end|>\nAssistant:Hello<|im_end|>\n")


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_template_whose_special_tokens_the_tokenizer_lacks_is_refused(tiny_tokenizer, name):
    """`<|start_header_id|>` on a ChatML tokenizer would be trained as plain-text pieces: refused, naming
    the tokens and the templates this tokenizer can use."""
    missing = {"llama3": LLAMA3_TOKENS, "qwen3": ["<think>", "</think>"]}[name]
    assert missing_special_tokens(tiny_tokenizer, BUILTIN_TEMPLATES[name].special_tokens) == missing
    with pytest.raises(DataError) as err:
        ChatFormatter(tiny_tokenizer, name)
    message = str(err.value)
    assert f"template={name!r}" in message and ", ".join(missing) in message
    assert "use template: chatml or qwen or smollm2 or leave `template` unset" in message


def test_template_with_its_special_tokens_renders_them_as_single_tokens(full_tokenizer):
    formatter = ChatFormatter(full_tokenizer, "llama3")
    text = formatter.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = full_tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = full_tokenizer.convert_ids_to_tokens(ids)
    assert [p for p in pieces if p in LLAMA3_TOKENS] == LLAMA3_TOKENS + LLAMA3_TOKENS[1:3]  # one id each
    assert "<|" not in full_tokenizer.decode([i for i, p in zip(ids, pieces) if p not in LLAMA3_TOKENS])
    assert formatter.stop_token_ids() == [full_tokenizer.convert_tokens_to_ids("<|eot_id|>"), 2]


@pytest.mark.parametrize("name", list(BUILTIN_TEMPLATES) + list(TEMPLATE_ALIASES))
def test_saved_jinja_template_renders_what_the_builtin_trains(full_tokenizer, name):
    """The Jinja written into the saved tokenizer and the Python renderer agree on every prefix of a
    conversation with a system turn, tools, a function call, a tool result and a thought."""
    formatter = ChatFormatter(full_tokenizer, name)
    saved = copy.deepcopy(full_tokenizer)
    saved.chat_template = formatter.jinja_template()
    from_jinja = ChatFormatter(saved)
    for end in range(1, len(CONVERSATION) + 1):
        for messages in (CONVERSATION[:end], CONVERSATION[1:end]):
            for tools in (json.dumps(TOOLS), None):
                for generation_prompt in (False, True):
                    if not messages:
                        continue
                    assert from_jinja.render(messages, generation_prompt, tools=tools) == formatter.render(
                        messages, generation_prompt, tools=tools)


def test_qwen3_trains_an_empty_thought_on_replies_without_one(full_tokenizer):
    chunks = ChatFormatter(full_tokenizer, "qwen3").chunks(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
         {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "<think>x</think>Because."}])
    assert [text for text, trained in chunks if trained] == [
        "<think>\n\n</think>\n\nHello<|im_end|>\n", "<think>x</think>Because.<|im_end|>\n"]


def test_training_installs_the_builtin_template_into_the_saved_tokenizer(tmp_path, tiny_tokenizer):
    """What the stage saves with the model renders as trained: the tokenizer's own template afterwards gives
    the same ids as the built-in did."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    (tmp_path / "d.json").write_text(json.dumps([{"instruction": "Hi", "output": "Hello"}]))
    row = load(tmp_path, tokenizer, str(tmp_path / "d.json"), template="smollm2")["train_dataset"][0]
    assert tokenizer.chat_template == ChatFormatter(tokenizer, "smollm2").jinja_template()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                                         tokenize=False)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == row["input_ids"]
    assert tiny_tokenizer.chat_template != tokenizer.chat_template


def test_default_system_replaces_the_templates_own_in_training_and_in_the_saved_template(tmp_path, tiny_tokenizer):
    """LLaMA-Factory's `default_system`: conversations without a system message get it (one with its own keeps
    it), the tokenised rows and the chat template saved with the model carry it, and the cache tells the two
    apart. It needs a built-in template: the tokenizer's own writes its own default."""
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    formatter = ChatFormatter(tiny_tokenizer, "smollm2", default_system="Answer in French.")
    assert formatter.render(conversation[:1], True) == (
        "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    own = [{"role": "system", "content": "Be brief."}] + conversation[:1]
    assert "Be brief." in formatter.render(own, True) and "French" not in formatter.render(own, True)
    assert "SmolLM" in ChatFormatter(tiny_tokenizer, "smollm2").render(conversation[:1], True)

    (tmp_path / "d.json").write_text(json.dumps([{"instruction": "Hi", "output": "Hello"}]))
    rows = {}
    for default_system in (None, "Answer in French."):
        tokenizer = copy.deepcopy(tiny_tokenizer)
        keys = {"default_system": default_system} if default_system else {}
        rows[default_system] = load(tmp_path, tokenizer, str(tmp_path / "d.json"), template="smollm2",
                                    **keys)["train_dataset"][0]["input_ids"]
        saved = tokenizer.apply_chat_template(conversation, tokenize=False)
        assert tokenizer(saved, add_special_tokens=False)["input_ids"] == rows[default_system]
    assert "Answer in French." in tiny_tokenizer.decode(rows["Answer in French."])
    assert "Answer in French." not in tiny_tokenizer.decode(rows[None])
    with pytest.raises(Exception, match="default_system replaces a built-in template's default system prompt"):
        parse_config({"stage": "sft", "default_system": "Answer in French."})
    with pytest.raises(DataError, match="default_system replaces"):
        ChatFormatter(tiny_tokenizer, None, default_system="x")


def test_load_tokenizer_takes_the_chat_template_saved_with_the_adapter(tmp_path, tiny_model_dir):
    """`alignkit chat/export --adapter OUT` must use the format OUT was trained with, not the base's."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "chat_template.jinja").write_text("{{ 'trained format' }}", encoding="utf-8")
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=tiny_model_dir, adapter_name_or_path=str(adapter)))
    assert tokenizer.chat_template == "{{ 'trained format' }}"
    base = load_tokenizer(ModelArguments(model_name_or_path=tiny_model_dir))
    assert base.chat_template != tokenizer.chat_template


# ---------------------------------------------------------------------------------------------- tools
def test_tool_row_renders_qwen_layout_and_trains_the_call_not_the_observation(tmp_path, tiny_tokenizer):
    write_registry(tmp_path, {"toolcalls": {"file_name": "tools.json", "formatting": "sharegpt",
                                            "columns": {"messages": "conversations", "tools": "tools"}}},
                   {"tools.json": [TOOL_ROW]})
    tokenizer = copy.deepcopy(tiny_tokenizer)
    row = load(tmp_path, tokenizer, "toolcalls", template="qwen3_nothink")["train_dataset"][0]
    signature = json.dumps({"type": "function", "function": TOOLS[0]})
    text = tokenizer.decode(row["input_ids"])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert f"<tools>\n{signature}\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nIt is 20 C.<|im_end|>\n")
    assert trained_spans(tokenizer, row) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
        "It is 20 C.<|im_end|>\n"]


def test_llama3_writes_calls_as_json_with_parameters_and_results_as_ipython(full_tokenizer):
    text = ChatFormatter(full_tokenizer, "llama3").render(CONVERSATION[1:5], tools=json.dumps(TOOLS))
    assert '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}' \
           '<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 20}<|eot_id|>' in text
    assert json.dumps({"type": "function", "function": TOOLS[0]}) in text.split("<|eot_id|>")[0]


def test_parallel_calls_and_openai_string_arguments():
    attr = DatasetAttr(name="t", load_from="file", path="", formatting="sharegpt")
    calls = [{"name": "a", "arguments": '{"x": 1}'}, {"name": "b", "arguments": {}}]
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": json.dumps(calls)}]}
    message = convert_row(row, attr, "sharegpt", "supervised")["messages"][-1]
    assert message == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "a", "arguments": {"x": 1}}},
        {"type": "function", "function": {"name": "b", "arguments": {}}}]}


@pytest.mark.parametrize("change, field", [
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "get_weather(Paris)"}]},
     "conversations[1].value"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": '{"name": "f"}'}]},
     "conversations[1].value"),
    ({"tools": "get_weather: weather of a city"}, "tools"),
    ({"tools": "5"}, "tools")])
def test_malformed_tool_rows_name_row_and_field(tmp_path, tiny_tokenizer, change, field):
    (tmp_path / "t.json").write_text(json.dumps([dict(TOOL_ROW, **change)]))
    with pytest.raises(DataError, match=rf"t.json, row 1: field `{re.escape(field)}`"):
        load(tmp_path, copy.deepcopy(tiny_tokenizer), str(tmp_path / "t.json"), template="chatml")


def test_tokenizer_template_that_drops_tools_is_refused(tmp_path, tiny_tokenizer):
    """The tiny (and SmolLM2's) own template ignores `tools` and `tool_calls`: refused, not dropped."""
    (tmp_path / "t.json").write_text(json.dumps([TOOL_ROW]))
    with pytest.raises(DataError, match="does not write them.*template: chatml"):
        load(tmp_path, tiny_tokenizer, str(tmp_path / "t.json"))


# ---------------------------------------------------------------------------------------------- .txt
def test_txt_file_loads_for_pt_one_document_per_line(tmp_path, tiny_tokenizer):
    """Blank lines hold no document and are skipped; a Windows line end is not part of the text."""
    write_registry(tmp_path, {"wiki": {"file_name": "wiki.txt", "columns": {"prompt": "text"}}},
                   {"wiki.txt": "First doc.\r\n\n   \nSecond doc.\n"})
    eos = tiny_tokenizer.eos_token_id
    expected = (tiny_tokenizer("First doc.", add_special_tokens=False)["input_ids"] + [eos]
                + tiny_tokenizer("Second doc.", add_special_tokens=False)["input_ids"] + [eos])
    for dataset in ("wiki", str(tmp_path / "wiki.txt")):
        rows = load(tmp_path, tiny_tokenizer, dataset, stage="pt")["train_dataset"]
        assert rows["input_ids"] == [expected]


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo"])
def test_txt_file_for_another_stage_is_refused(tmp_path, tiny_tokenizer, stage):
    write_registry(tmp_path, {"wiki": {"file_name": "wiki.txt"}}, {"wiki.txt": "A document.\n"})
    with pytest.raises(DataError, match=rf"wiki.txt is a .txt file .* only stage pt trains on; stage {stage}"):
        load(tmp_path, tiny_tokenizer, "wiki", stage=stage)


def test_notes_txt_beside_data_in_a_folder_is_not_data(tmp_path, tiny_tokenizer):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps([{"instruction": "Hi", "output": "Hello"}]))
    (folder / "README.txt").write_text("not training data\n")
    assert len(load(tmp_path, tiny_tokenizer, str(folder))["train_dataset"]) == 1


# ---------------------------------------------------------------------------------------------- media
MLLM_ROW = {"messages": [{"role": "user", "content": "<image>Who are they?"},
                         {"role": "assistant", "content": "Two players."}], "images": ["1.jpg"]}
MLLM_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}


@pytest.mark.parametrize("column", ["images", "videos", "audios"])
def test_registered_media_column_is_refused(tmp_path, tiny_tokenizer, column):
    row = {"messages": MLLM_ROW["messages"], column: ["1.x"]}
    write_registry(tmp_path, {"mllm": {"file_name": "m.json", "formatting": "sharegpt", "tags": MLLM_TAGS,
                                       "columns": {"messages": "messages", column: column}}}, {"m.json": [row]})
    with pytest.raises(DataError, match=rf"dataset 'mllm': dataset_info.json maps `{column}`.*literal text. "
                                        r"(The model is text-only|alignkit trains on images only)"):
        load(tmp_path, tiny_tokenizer, "mllm")


def test_media_column_in_rows_is_refused_and_empty_one_is_not(tmp_path, tiny_tokenizer):
    (tmp_path / "m.json").write_text(json.dumps([dict(MLLM_ROW, images=[]), MLLM_ROW]))
    with pytest.raises(DataError, match=r"m.json, row 2 has a `images` column;.*<image>.* literal text"):
        load(tmp_path, tiny_tokenizer, str(tmp_path / "m.json"))
    (tmp_path / "m.json").write_text(json.dumps([dict(MLLM_ROW, images=[])]))
    assert len(load(tmp_path, tiny_tokenizer, str(tmp_path / "m.json"))["train_dataset"]) == 1


# ---------------------------------------------------------------------------------------------- kto tags
def kto_rows(tags):
    return [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
             "label": tag} for i, tag in enumerate(tags)]


def test_kto_tag_under_sft_warns_with_the_undesirable_rows(tmp_path, tiny_tokenizer, caplog):
    tags = [True, False, False, True, False, False, False, False, True]  # false at rows 2, 3, 5, 6, 7, 8
    write_registry(tmp_path, {"kto": {"file_name": "kto.json", "formatting": "sharegpt", "tags": MLLM_TAGS,
                                      "columns": {"messages": "messages", "kto_tag": "label"}}},
                   {"kto.json": kto_rows(tags)})
    with caplog.at_level(logging.WARNING, logger="alignkit.data.loader"):
        rows = load(tmp_path, tiny_tokenizer, "kto")["train_dataset"]
    assert len(rows) == 9  # still trained: a warning, not a refusal
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "6 of 9 rows are marked undesirable (`label` is false): row 2, 3, 5, 6, 7 and 1 more." in message
    assert "Stage sft does not read that column" in message and "Use stage: kto" in message


def test_trl_boolean_label_warns_and_other_labels_do_not(tmp_path, tiny_tokenizer, caplog):
    rows = [{"prompt": "q", "completion": "a", "label": tag} for tag in (True, False)]
    (tmp_path / "u.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with caplog.at_level(logging.WARNING, logger="alignkit.data.loader"):
        load(tmp_path, tiny_tokenizer, str(tmp_path / "u.jsonl"))
    assert "1 of 2 lines are marked undesirable (`label` is false): line 2." in caplog.text
    caplog.clear()
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(dict(r, label="sports")) for r in rows))
    with caplog.at_level(logging.WARNING, logger="alignkit.data.loader"):
        load(tmp_path, tiny_tokenizer, str(tmp_path / "c.jsonl"))
    assert "undesirable" not in caplog.text


def test_stage_kto_reads_the_tag_so_no_warning(tmp_path, caplog):
    (tmp_path / "kto.json").write_text(json.dumps(kto_rows([True, False])))
    attr = resolve_datasets(str(tmp_path / "kto.json"), str(tmp_path))[0]
    with caplog.at_level(logging.WARNING, logger="alignkit.data.loader"):
        convert_dataset(attr, "supervised", "kto", max_samples=None, skip_invalid_rows=False)
    assert "undesirable" not in caplog.text


def test_enable_thinking_false_drops_thoughts_and_puts_the_empty_one_in_the_prompt(full_tokenizer):
    """LLaMA-Factory's `enable_thinking: false` on `qwen3`: no reply trains a thought; the empty thought closes every
    generation prompt (so the saved template, checked against the renderer above, prompts without thinking)."""
    from alignkit.config import DataArguments
    from alignkit.errors import ConfigError

    assert DataArguments(template="qwen3", enable_thinking=False).template == "qwen3_no_thinking"
    assert DataArguments(template="qwen3").template == "qwen3"
    with pytest.raises(ConfigError, match="enable_thinking=false needs a built-in reasoning template"):
        DataArguments(enable_thinking=False)
    formatter = ChatFormatter(full_tokenizer, "qwen3_no_thinking")
    chunks = formatter.chunks(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
         {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\nBecause."}])
    assert [text for text, trained in chunks if trained] == ["Hello<|im_end|>\n", "Because.<|im_end|>\n"]
    assert [text for text, trained in chunks if not trained][-1].endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert formatter.prompt_text([{"role": "user", "content": "Hi"}]).endswith("assistant\n<think>\n\n</think>\n\n")
