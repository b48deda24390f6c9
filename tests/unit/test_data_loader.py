"""Loading: sources, registry, bad input, skipping, cutoff drops, caching, tokenized_path, val_size."""

from __future__ import annotations

import copy
import csv
import json
import logging
import os
import time

import pytest

from alignkit.config.parse import parse_config
from alignkit.data import get_dataset, processors
from alignkit.data.formats import DATA_KINDS
from alignkit.data.loader import split_examples
from alignkit.errors import DataError
from alignkit.stages import STAGES
from tests.helpers import tiny_config

SFT_ROWS = [{"instruction": f"What is {i} plus 2?", "output": f"{i} plus 2 is {i + 2}."} for i in range(10)]


def config(tmp_path, dataset, stage="sft", **keys):
    return tiny_config(**{"dataset": dataset, "dataset_dir": str(tmp_path), "stage": stage, "cutoff_len": 256, **keys})


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content, ensure_ascii=False), encoding="utf-8")
    return path


def load(tmp_path, tokenizer, rows, stage="sft", name="d.json", **keys):
    path = write(tmp_path, name, rows)
    return get_dataset(config(tmp_path, str(path), stage, **keys), tokenizer, STAGES[stage].data_kind)


# ---------------------------------------------------------------------------------------------- sources
def test_jsonl_csv_and_parquet_files_give_the_same_examples(tmp_path, tiny_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write(tmp_path, "a.jsonl", "\n".join(json.dumps(r) for r in SFT_ROWS[:3]) + "\n\n")
    with (tmp_path / "a.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["instruction", "input", "output"])
        writer.writeheader()
        writer.writerows([dict(r, input="") for r in SFT_ROWS[:3]])
    pq.write_table(pa.Table.from_pylist(SFT_ROWS[:3]), tmp_path / "a.parquet")
    results = [get_dataset(config(tmp_path, str(tmp_path / n)), tiny_tokenizer,
                           "supervised")["train_dataset"]["input_ids"] for n in ("a.jsonl", "a.csv", "a.parquet")]
    assert results[0] == results[1] == results[2] and len(results[0]) == 3


def test_several_datasets_are_concatenated_and_max_samples_applies_to_each(tmp_path, tiny_tokenizer):
    a, b = write(tmp_path, "a.json", SFT_ROWS[:5]), write(tmp_path, "b.json", SFT_ROWS[5:])
    out = get_dataset(config(tmp_path, f"{a},{b}", max_samples=2), tiny_tokenizer, "supervised")["train_dataset"]
    decoded = [tiny_tokenizer.decode(ids) for ids in out["input_ids"]]
    assert len(decoded) == 4
    assert ["What is 0 " in decoded[0], "What is 1 " in decoded[1], "What is 5 " in decoded[2]] == [True] * 3


def test_registry_columns_and_tags(tmp_path, tiny_tokenizer):
    write(tmp_path, "qa.json", [{"question": "Hi", "answer": "Hello!", "persona": "Be brief."}])
    write(tmp_path, "chat.json", [{"dialog": [{"speaker": "U", "text": "Hi"}, {"speaker": "A", "text": "Hello!"}]}])
    write(tmp_path, "dataset_info.json", {
        "qa": {"file_name": "qa.json", "columns": {"prompt": "question", "response": "answer", "system": "persona"}},
        "chat": {"file_name": "chat.json", "formatting": "sharegpt", "columns": {"messages": "dialog"},
                 "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "U", "assistant_tag": "A"}}})
    out = get_dataset(config(tmp_path, "qa,chat"), tiny_tokenizer, "supervised")["train_dataset"]
    first, second = (tiny_tokenizer.decode(ids) for ids in out["input_ids"])
    assert first == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                     "<|im_start|>assistant\nHello!<|im_end|>\n")
    assert second == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"


def test_registry_file_relative_to_dataset_dir_and_missing_file(tmp_path, tiny_tokenizer):
    write(tmp_path, "dataset_info.json", {"gone": {"file_name": "nowhere.json"}})
    with pytest.raises(DataError, match="nowhere.json.*does not exist"):
        get_dataset(config(tmp_path, "gone"), tiny_tokenizer, "supervised")


def test_the_data_layer_takes_a_data_kind_not_a_stage_name(tmp_path, tiny_tokenizer):
    """It sits below the stage registry: a stage hands it `STAGES[stage].data_kind` (its module's DATA_KIND)."""
    path = write(tmp_path, "d.json", SFT_ROWS)
    with pytest.raises(DataError, match=r"'sft' is not a data kind \(text, supervised, .*STAGES\[stage\]\.data_kind"):
        get_dataset(config(tmp_path, str(path)), tiny_tokenizer, "sft")
    assert {stage.data_kind for stage in STAGES.values()} <= set(DATA_KINDS)


def test_hub_id_fails_at_once_when_offline(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(DataError, match="someorg/somedata.*offline"):
        get_dataset(config(tmp_path, "someorg/somedata"), tiny_tokenizer, "supervised")
    assert time.monotonic() - start < 5


def test_unknown_name_lists_the_registry(tmp_path, tiny_tokenizer):
    write(tmp_path, "dataset_info.json", {"known": {"file_name": "k.json"}})
    write(tmp_path, "k.json", SFT_ROWS)
    with pytest.raises(DataError, match=r"'unknwon'.*known: known"):
        get_dataset(config(tmp_path, "unknwon"), tiny_tokenizer, "supervised")


def test_bundled_demo_registry_loads_for_every_kind(tiny_tokenizer):
    """data/dataset_info.json as committed: each demo dataset gives examples of the kind it serves, the
    first 20 rows each (none of them dropped), the first example built from the file's first row."""
    def first_row(name):
        with open(f"data/{name}.json", encoding="utf-8") as f:
            return json.load(f)[0]

    def targets(labels):
        return tiny_tokenizer.decode([t for t in labels if t != -100])

    def load_demo(name, kind):
        values = {"dataset": name, "dataset_dir": "data", "stage": "pt" if kind == "text" else "sft",
                  "max_samples": 20, "cutoff_len": 64}
        return get_dataset(parse_config(values), tiny_tokenizer, kind)["train_dataset"]

    for name in ("demo_sft", "demo_sft_sharegpt"):
        out = load_demo(name, "supervised")
        row = first_row(name)
        reply = row["output"] if "output" in row else row["conversations"][1]["value"]
        assert len(out) == 20, name
        assert targets(out[0]["labels"]).startswith(reply + "<|im_end|>\n"), name

    out, row = load_demo("demo_pref", "preference"), first_row("demo_pref")
    assert len(out) == 20
    for side in ("chosen", "rejected"):
        assert targets(out[0][f"{side}_labels"]) == row[side] + "<|im_end|>\n", side

    out, row = load_demo("demo_math", "prompt"), first_row("demo_math")
    assert len(out) == 20 and out[0]["answer"] == row["answer"]
    # The prompt keeps its end (the question's last words and the assistant header) when cut to 64 tokens.
    prompt_end = row["prompt"][-20:] + "<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.decode(out[0]["input_ids"]).endswith(prompt_end)

    # pt: the 20 texts, each closed by eos, cut into blocks of 64 tokens.
    out = load_demo("demo_pt", "text")
    with open("data/demo_pt.json", encoding="utf-8") as f:
        texts = [row["text"] for row in json.load(f)[:20]]
    stream = [t for text in texts for t in tiny_tokenizer(text)["input_ids"] + [tiny_tokenizer.eos_token_id]]
    assert sum(out["input_ids"], []) == stream and [len(ids) for ids in out["input_ids"][:-1]] == [64] * (len(out) - 1)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("content, name, match", [
    ('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": "d"}\n{"instruction": "e" "output": "f"}\n',
     "x.jsonl", r"x\.jsonl, line 3: invalid JSON \(Expecting ',' delimiter.*Fix the line or set skip_invalid_rows=true"),
    ('[{"instruction": "a", "output": "b"},\n {"instruction": "c" "output": "d"}]', "x.json",
     r"x\.json: invalid JSON at line 2 column"),
    ([{"instruction": "a", "output": "b"}, {"instruction": "c"}], "x.json", r"x\.json, row 2: field `output`: is missing"),
    ([{"instruction": "a", "output": 42}], "x.json", r"x\.json, row 1: field `output`: expected text, got number 42"),
    ([{"instruction": "a", "output": "  "}], "x.json", r"row 1: field `output`: is empty"),
    ([{"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}], "x.json",
     r"row 1: field `conversations\[1\]\.from`: role 'human' is out of order"),
    ([{"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}], "x.json",
     r"row 1: field `conversations\[1\]\.from`: unknown role 'bot'"),
    ([{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}, {"from": "human", "value": "c"}]}],
     "x.json", r"row 1: field `conversations`: the conversation ends with a user turn"),
    ([{"instruction": "a", "output": "b", "history": "not a list"}], "x.json", r"row 1: field `history`: expected a list"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, tiny_tokenizer, content, name, match):
    with pytest.raises(DataError, match=match):
        load(tmp_path, tiny_tokenizer, content, name=name)


def test_preference_data_given_to_sft_names_the_fix(tmp_path, tiny_tokenizer):
    rows = [{"instruction": "a", "chosen": "b", "rejected": "c"}]
    with pytest.raises(DataError, match=r"stage sft needs.*`output`.*use stage rm or dpo"):
        load(tmp_path, tiny_tokenizer, rows, stage="sft")


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_sft_data_given_to_preference_stage_names_missing_columns(tmp_path, tiny_tokenizer, stage):
    with pytest.raises(DataError, match=rf"stage {stage} needs preference pairs.*`chosen`, `rejected`"):
        load(tmp_path, tiny_tokenizer, SFT_ROWS, stage=stage)


def test_skip_invalid_rows_skips_and_reports(tmp_path, tiny_tokenizer, caplog):
    lines = [json.dumps(SFT_ROWS[0]), "{broken", json.dumps(SFT_ROWS[1]), json.dumps({"instruction": "a", "output": 3})]
    with caplog.at_level(logging.WARNING):
        out = load(tmp_path, tiny_tokenizer, "\n".join(lines), name="x.jsonl", skip_invalid_rows=True)
    assert len(out["train_dataset"]) == 2
    assert "Skipped 2 invalid row(s)" in caplog.text
    assert "x.jsonl, line 2" in caplog.text and "x.jsonl, line 4" in caplog.text


# ---------------------------------------------------------------------------------------------- cutoff
def test_response_that_cannot_fit_is_dropped_with_one_warning(tmp_path, tiny_tokenizer, caplog):
    """cutoff_len=8. Row 2: the reply `Hello!<|im_end|>` has r tokens with 4 <= r < 8 (not under half the
    budget) and the prompt p > 200 tokens (not under half either), so the reply gets
    int(8 * r / (p + r)) <= int(8 * 7 / 204) = 0 tokens and the row is dropped.
    Row 3: the prompt is cut from the left and the reply keeps its first tokens."""
    r = len(tiny_tokenizer("Hello!<|im_end|>", add_special_tokens=False)["input_ids"])
    assert 4 <= r < 8
    rows = [{"instruction": "Hi", "output": "Hello!"},
            {"instruction": "word " * 200, "output": "Hello!"},
            {"instruction": "Hi", "output": "Hello there, how are you today?"}]
    with caplog.at_level(logging.WARNING):
        out = load(tmp_path, tiny_tokenizer, rows, cutoff_len=8)["train_dataset"]
    assert len(out) == 2
    assert all(len(ids) <= 8 for ids in out["input_ids"])
    assert all(any(label != -100 for label in labels) for labels in out["labels"])
    assert "Dropped 1 of 3 train example(s)" in caplog.text and "row 2" in caplog.text
    # The long reply keeps its beginning; the prompt keeps its end (the generation prompt).
    kept_reply = tiny_tokenizer.decode([t for t in out["labels"][1] if t != -100])
    assert kept_reply and "Hello there, how are you today?".startswith(kept_reply)
    assert tiny_tokenizer.decode(out["input_ids"][1]).endswith("\n" + kept_reply)


def test_identical_pairs_are_dropped_with_a_warning(tmp_path, tiny_tokenizer, caplog):
    rows = [{"instruction": "a", "chosen": "same", "rejected": "same"},
            {"instruction": "b", "chosen": "good answer", "rejected": "bad"}]
    with caplog.at_level(logging.WARNING):
        out = load(tmp_path, tiny_tokenizer, rows, stage="dpo")["train_dataset"]
    assert len(out) == 1
    assert "Dropped 1 of 2" in caplog.text and "identical" in caplog.text and "row 1" in caplog.text


# ---------------------------------------------------------------------------------------------- cache
def test_second_run_hits_the_cache_and_key_changes_retokenise(tmp_path, tiny_tokenizer, monkeypatch):
    tiny_tokenizer = copy.deepcopy(tiny_tokenizer)  # `template: plain` below is installed into the tokenizer
    path = write(tmp_path, "d.json", SFT_ROWS)
    first = get_dataset(config(tmp_path, str(path)), tiny_tokenizer, "supervised")["train_dataset"]

    def fail(*args, **kwargs):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(processors, "tokenize_examples", fail)
    again = get_dataset(config(tmp_path, str(path)), tiny_tokenizer, "supervised")["train_dataset"]
    assert again["input_ids"] == first["input_ids"]
    for changed in ({"cutoff_len": 128}, {"overwrite_cache": True}, {"train_on_prompt": True}, {"max_samples": 3},
                    {"template": "plain"}):
        with pytest.raises(AssertionError, match="tokenised again"):
            get_dataset(config(tmp_path, str(path), **changed), tiny_tokenizer, "supervised")
    write(tmp_path, "d.json", SFT_ROWS[:9])  # new contents
    with pytest.raises(AssertionError, match="tokenised again"):
        get_dataset(config(tmp_path, str(path)), tiny_tokenizer, "supervised")


def test_tokenized_path_saves_then_loads_without_the_source(tmp_path, tiny_tokenizer):
    path = write(tmp_path, "d.json", SFT_ROWS)
    saved = tmp_path / "tok"
    first = get_dataset(config(tmp_path, str(path), tokenized_path=str(saved), val_size=2), tiny_tokenizer,
                        "supervised")
    assert (saved / "train").is_dir() and (saved / "eval").is_dir()
    path.unlink()
    again = get_dataset(config(tmp_path, str(path), tokenized_path=str(saved)), tiny_tokenizer, "supervised")
    assert again["train_dataset"]["input_ids"] == first["train_dataset"]["input_ids"]
    assert again["eval_dataset"]["input_ids"] == first["eval_dataset"]["input_ids"]


# ---------------------------------------------------------------------------------------------- val_size
@pytest.mark.parametrize("val_size, sizes", [(0.2, (8, 2)), (3, (7, 3)), (0.01, (9, 1))])
def test_val_size_split_sizes(tmp_path, tiny_tokenizer, val_size, sizes):
    out = load(tmp_path, tiny_tokenizer, SFT_ROWS, val_size=val_size)
    assert (len(out["train_dataset"]), len(out["eval_dataset"])) == sizes


def test_val_split_is_deterministic_per_seed_and_disjoint():
    items = list(range(100))
    train, held = split_examples(items, 0.1, seed=42)
    assert (train, held) == split_examples(items, 0.1, seed=42)
    assert held != split_examples(items, 0.1, seed=7)[1]
    assert sorted(train + held) == items and len(held) == 10


def test_val_size_too_large_is_an_error():
    with pytest.raises(DataError, match="val_size=5.*leaving none"):
        split_examples(list(range(5)), 5, seed=0)


def test_eval_dataset_key_loads_a_separate_set(tmp_path, tiny_tokenizer):
    train, held = write(tmp_path, "t.json", SFT_ROWS[:6]), write(tmp_path, "e.json", SFT_ROWS[6:])
    out = get_dataset(config(tmp_path, str(train), eval_dataset=str(held), val_size=0.5), tiny_tokenizer, "supervised")
    assert (len(out["train_dataset"]), len(out["eval_dataset"])) == (6, 4)


def test_bare_file_name_is_found_in_dataset_dir(tmp_path, tiny_tokenizer, monkeypatch):
    write(tmp_path, "only_here.jsonl", "\n".join(json.dumps(r) for r in SFT_ROWS[:2]))
    monkeypatch.chdir(tmp_path.parent)  # not found relative to the working directory
    out = get_dataset(config(tmp_path, "only_here.jsonl"), tiny_tokenizer, "supervised")["train_dataset"]
    assert len(out) == 2


def test_prompt_completion_rows_are_supervised(tmp_path, tiny_tokenizer):
    out = load(tmp_path, tiny_tokenizer, [{"prompt": "Hi", "completion": "Hello!"}])["train_dataset"][0]
    assert tiny_tokenizer.decode([t for t in out["labels"] if t != -100]) == "Hello!<|im_end|>\n"


# ---------------------------------------------------------------------------------------------- encodings (issue 10)
def _encoded(rows, suffix: str, encoding: str) -> bytes:
    if suffix == ".jsonl":
        text = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n"
    elif suffix == ".json":
        text = json.dumps(rows, ensure_ascii=False)
    else:
        text = "instruction,output\r\n" + "".join(f"{r['instruction']},{r['output']}\r\n" for r in rows)
    return text.encode(encoding)  # "utf-8-sig", "utf-16" and "utf-32" write a byte-order mark


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-be", "utf-32"])
def test_byte_order_mark_selects_the_encoding(tmp_path, tiny_tokenizer, suffix, encoding):
    rows = [{"instruction": f"Où est {i}?", "output": f"Ici {i} — 北京"} for i in range(3)]
    data = _encoded(rows, suffix, encoding)
    if encoding == "utf-16-be":  # Python writes no mark for an explicit byte order: add the big-endian one
        data = b"\xfe\xff" + data
    path = tmp_path / f"d{suffix}"
    path.write_bytes(data)
    plain = write(tmp_path, f"plain{suffix}", _encoded(rows, suffix, "utf-8").decode())
    got = get_dataset(config(tmp_path, str(path)), tiny_tokenizer, "supervised")["train_dataset"]
    expected = get_dataset(config(tmp_path, str(plain)), tiny_tokenizer, "supervised")["train_dataset"]
    assert got["input_ids"] == expected["input_ids"]


def test_bad_bytes_in_a_csv_row_name_the_row_and_column_and_can_be_skipped(tmp_path, tiny_tokenizer, caplog):
    path = tmp_path / "d.csv"
    path.write_bytes(b"instruction,output\nWhat is 1?,one\nWhat is 2?,caf\xe9\nWhat is 3?,three\n")
    with pytest.raises(DataError, match=r"d\.csv, row 2: field `output`: holds bytes that are not UTF-8 \(file line 3"):
        get_dataset(config(tmp_path, str(path)), tiny_tokenizer, "supervised")
    with caplog.at_level(logging.WARNING):
        out = get_dataset(config(tmp_path, str(path), skip_invalid_rows=True), tiny_tokenizer, "supervised")
    assert len(out["train_dataset"]) == 2 and "Skipped 1 invalid row(s)" in caplog.text


def test_bad_bytes_in_a_jsonl_line_are_skipped_and_the_other_lines_kept(tmp_path, tiny_tokenizer, caplog):
    lines = [json.dumps(r).encode() for r in SFT_ROWS[:4]]
    lines[2] = b'{"instruction": "\xff\xfe", "output": "x"}'
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines))
    with caplog.at_level(logging.WARNING):
        out = get_dataset(config(tmp_path, str(tmp_path / "d.jsonl"), skip_invalid_rows=True), tiny_tokenizer,
                          "supervised")
    assert len(out["train_dataset"]) == 3
    assert "d.jsonl, line 3: column 18" in caplog.text and "is not UTF-8" in caplog.text


def test_utf16_without_a_byte_order_mark_is_hinted(tmp_path, tiny_tokenizer):
    path = tmp_path / "d.json"
    path.write_bytes(json.dumps([{"instruction": "Où?", "output": "Ici"}], ensure_ascii=False).encode("utf-16-le"))
    with pytest.raises(DataError, match="is not UTF-8. The file holds NUL bytes, so it may be UTF-16"):
        get_dataset(config(tmp_path, str(path)), tiny_tokenizer, "supervised")


def test_line_separator_characters_inside_a_jsonl_string_do_not_split_the_line(tmp_path, tiny_tokenizer):
    rows = [{"instruction": "first\u2028second\x0cthird", "output": "ok\u2029done"}]
    path = write(tmp_path, "d.jsonl", "\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
    out = get_dataset(config(tmp_path, str(path)), tiny_tokenizer, "supervised")["train_dataset"]
    assert len(out) == 1
    assert "first\u2028second" in tiny_tokenizer.decode(out[0]["input_ids"])


def test_unpaired_surrogate_escape_is_a_row_error(tmp_path, tiny_tokenizer):
    path = write(tmp_path, "d.jsonl", '{"instruction": "a \\ud800 b", "output": "x"}')
    with pytest.raises(DataError, match=r"line 1: field `instruction`: holds an unpaired surrogate"):
        get_dataset(config(tmp_path, str(path)), tiny_tokenizer, "supervised")


# ---------------------------------------------------------------------------------------------- predict on dataset
def test_evaluating_without_training_uses_dataset_as_the_eval_set(tmp_path, tiny_tokenizer):
    path = write(tmp_path, "d.json", SFT_ROWS)
    out = get_dataset(config(tmp_path, str(path), do_predict=True), tiny_tokenizer, "supervised")
    assert out["train_dataset"] is None and len(out["eval_dataset"]) == 10
    # val_size or eval_dataset still decide the evaluation set, and training keeps `dataset` to train on.
    out = get_dataset(config(tmp_path, str(path), do_eval=True, val_size=3), tiny_tokenizer, "supervised")
    assert len(out["eval_dataset"]) == 3
    out = get_dataset(config(tmp_path, str(path), do_train=True, do_predict=True), tiny_tokenizer, "supervised")
    assert len(out["train_dataset"]) == 10 and out["eval_dataset"] is None


# ---------------------------------------------------------------------------------------------- temp folders
def test_stale_temporary_folders_are_removed_and_live_ones_kept(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from alignkit.data.loader import STALE_TEMP_SECONDS, remove_stale_temp_dirs

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, host, key = int(finished.stdout), socket.gethostname(), "0123456789abcdef" * 2
    names = {
        "dead": f".{key}.tmp-{host}-{dead_pid}-abcd1234",
        "dead_old_copy": f".{key}.old-{host}-{dead_pid}-abcd1234",
        "alive": f".{key}.tmp-{host}-{os.getpid()}-abcd1234",
        "other_host_recent": f".{key}.tmp-elsewhere-1-abcd1234",
        "other_host_old": f".{key}.tmp-elsewhere-2-abcd1234",
        "legacy_old": f".{key}.k2j4_9zq",
        "legacy_recent": f".{key}.a1b2c3d4",
        "user_folder": ".my.tmp-notes",
        "cache_entry": key,
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    day_ago = time.time() - STALE_TEMP_SECONDS - 60
    for which in ("other_host_old", "legacy_old", "user_folder"):
        os.utime(tmp_path / names[which], (day_ago, day_ago))
    removed = {p.name for p in remove_stale_temp_dirs(tmp_path)}
    assert removed == {names[k] for k in ("dead", "dead_old_copy", "other_host_old", "legacy_old")}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("alive", "other_host_recent", "legacy_recent", "user_folder", "cache_entry"))


def test_a_cache_write_cleans_up_after_a_killed_run(tmp_path, tiny_tokenizer, monkeypatch):
    import socket

    from alignkit.data.loader import cache_root

    path = write(tmp_path, "d.json", SFT_ROWS)
    get_dataset(config(tmp_path, str(path)), tiny_tokenizer, "supervised")
    (key,) = [p.name for p in cache_root().iterdir()]
    left = cache_root() / f".{key}.tmp-{socket.gethostname()}-999999999-abcd1234"  # no such pid
    (left / "train").mkdir(parents=True)
    get_dataset(config(tmp_path, str(path), overwrite_cache=True), tiny_tokenizer, "supervised")
    assert [p.name for p in cache_root().iterdir()] == [key]


def test_rl_prompts_cut_to_cutoff_len_are_counted_and_named(tmp_path, tiny_tokenizer, caplog):
    """A GRPO/PPO prompt longer than cutoff_len loses its start (the generation prompt is at its end); the reward
    functions still get it whole, so the cut is warned about, with a count and the rows."""
    rows = [{"prompt": [{"role": "user", "content": "word " * 200 + "What is 2 + 2?"}], "answer": "4"},
            {"prompt": [{"role": "user", "content": "What is 3 + 3?"}], "answer": "6"}]
    caplog.set_level(logging.WARNING, logger="alignkit.data.processors")
    out = load(tmp_path, tiny_tokenizer, rows, stage="grpo", cutoff_len=64, reward_funcs="accuracy")["train_dataset"]
    assert len(out[0]["input_ids"]) == 64 and len(out[1]["input_ids"]) < 64
    assert "Cut the start off 1 of 2 prompts longer than cutoff_len=64 tokens" in caplog.text
    assert "d.json, row 1." in caplog.text and "row 2" not in caplog.text


# ---------------------------------------------------------------------------------------------- workers
@pytest.mark.parametrize("stage", ["sft", "dpo", "kto", "grpo"])
def test_preprocessing_num_workers_tokenises_in_forked_processes_with_the_same_result(
        tmp_path, tiny_tokenizer, monkeypatch, caplog, stage):
    """LLaMA-Factory's `preprocessing_num_workers`: the examples are tokenised in slices by forked processes and
    joined in order; columns, dropped rows and the cut prompts' warning equal one process's."""
    from alignkit.data.template import ChatFormatter

    long = "word " * 200
    if stage == "sft":
        # cutoff_len 8: a 200-word prompt leaves the reply no token (as in the cutoff test above)
        rows = [{"instruction": long if i % 7 == 3 else f"{i}?", "output": "Hello!"} for i in range(23)]
    elif stage == "dpo":
        rows = [{"instruction": f"Say {i}.", "chosen": f"{i}", "rejected": f"{i} or {i + 1}" if i % 5 else f"{i}"}
                for i in range(23)]
    elif stage == "kto":
        rows = [{"instruction": f"Say {i}.", "output": f"{i}", "label": bool(i % 2)} for i in range(23)]
    else:
        rows = [{"prompt": [{"role": "user", "content": (long if i % 6 == 1 else "") + f"What is {i} + 2?"}],
                 "answer": str(i + 2)} for i in range(23)]
    path = write(tmp_path, "d.json", rows)
    cfg = config(tmp_path, str(path), stage, cutoff_len=8 if stage == "sft" else 24,
                 **({"reward_funcs": "accuracy"} if stage == "grpo" else {}))
    kind = STAGES[stage].data_kind
    from alignkit.data.loader import convert_dataset, resolve_datasets

    examples = convert_dataset(resolve_datasets(str(path), str(tmp_path))[0], kind, stage, None, False, None)
    formatter = ChatFormatter(tiny_tokenizer, None)
    pids = tmp_path / "pids"
    encoder = {"supervised": "encode_supervised", "preference": "encode_pairwise", "unpaired": "encode_unpaired",
               "prompt": "encode_prompt"}[kind]
    real = getattr(processors, encoder)

    def recording(*args, **kwargs):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(processors, encoder, recording)
    caplog.set_level(logging.WARNING, logger="alignkit.data.processors")
    one = processors.tokenize_examples(examples, kind, formatter, cfg.data.cutoff_len)
    one_log, pids_one = caplog.text, set(pids.read_text().split())
    caplog.clear()
    pids.unlink()
    monkeypatch.setattr(processors, "MIN_EXAMPLES_PER_WORKER", 4)
    monkeypatch.setattr(processors, "WORKER_CHUNK", 5)
    pools = []
    real_pool = processors.concurrent.futures.ProcessPoolExecutor

    def pool(workers, **kwargs):
        pools.append(workers)
        return real_pool(workers, **kwargs)

    monkeypatch.setattr(processors.concurrent.futures, "ProcessPoolExecutor", pool)
    several = processors.tokenize_examples(examples, kind, formatter, cfg.data.cutoff_len, num_workers=3)
    pids_several = set(pids.read_text().split())
    assert several == one
    assert caplog.text.replace("alignkit.data.processors", "") == one_log.replace("alignkit.data.processors", "")
    assert pids_one == {str(os.getpid())}
    # Three workers for 23 examples (at least 4 each); which of them takes each slice is the pool's business.
    assert pools == [3] and pids_several and str(os.getpid()) not in pids_several
    assert len(next(iter(one[0].values()))) > 0
    if stage in ("sft", "dpo"):
        assert one[1], "some rows are dropped"
    if stage == "grpo":
        assert "Cut the start off 4 of 23 prompts" in one_log


def test_preprocessing_num_workers_reaches_the_tokeniser_and_few_examples_stay_in_one_process(
        tmp_path, tiny_tokenizer, monkeypatch):
    seen = []
    real = processors.tokenize_examples

    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_workers"))
        return real(*args, **kwargs)

    monkeypatch.setattr(processors, "tokenize_examples", spy)
    monkeypatch.setattr(processors, "_encode_in_workers", lambda *a: pytest.fail("forked for 10 examples"))
    out = load(tmp_path, tiny_tokenizer, SFT_ROWS, preprocessing_num_workers=4)["train_dataset"]
    assert seen == [4] and len(out) == len(SFT_ROWS)


def test_preprocessing_num_workers_off_linux_tokenises_in_one_process(tmp_path, tiny_tokenizer, monkeypatch, caplog):
    from alignkit.data.template import ChatFormatter

    examples = [(f"row {i}", {"messages": [{"role": "user", "content": f"{i}?"},
                                           {"role": "assistant", "content": f"{i}."}]}) for i in range(8)]
    formatter = ChatFormatter(tiny_tokenizer, None)
    one = processors.tokenize_examples(examples, "supervised", formatter, 64)
    assert len(one[0]["input_ids"]) == 8
    monkeypatch.setattr(processors, "MIN_EXAMPLES_PER_WORKER", 2)
    monkeypatch.setattr(processors.sys, "platform", "darwin")
    monkeypatch.setattr(processors, "_encode_in_workers", lambda *a: pytest.fail("forked off Linux"))
    with caplog.at_level(logging.WARNING, logger="alignkit.data.processors"):
        assert processors.tokenize_examples(examples, "supervised", formatter, 64, num_workers=4) == one
    assert "tokenising in one process (workers are forked on Linux only)" in caplog.text
