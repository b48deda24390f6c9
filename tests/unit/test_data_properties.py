"""Property tests of the data layer: whatever a data file holds, loading it gives examples or a DataError.

Hypothesis writes files of every supported type (.json, .jsonl, .csv, .parquet) holding rows of every
supported shape (alpaca, sharegpt, openai, TRL prompt/completion and preference pairs, prompt-only,
pretraining text), each field either well-formed or an arbitrary JSON value, encoded as UTF-8, UTF-8
with a byte-order mark, UTF-16, UTF-32 or Latin-1, sometimes with random bytes spliced in, and
registered either by path (format guessed) or in a `dataset_info.json` with an explicit formatting.
The property: `convert_dataset` / `get_dataset` return well-formed examples or raise `DataError`; any
other exception (KeyError, TypeError, UnicodeDecodeError, a pyarrow error, ...) is a bug.

The runs are bounded and reproducible (`derandomize=True`), so CI sees the same cases every time.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from alignkit.config.parse import parse_config
from alignkit.data import get_dataset
from alignkit.data.loader import convert_dataset, resolve_datasets
from alignkit.errors import DataError

BOUNDED = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---------------------------------------------------------------------------------------------- values
def mostly(good, bad, one_in: int = 6):
    """`good`, except about once in `one_in` draws `bad`: mostly valid data reaches the deeper checks
    (conversion, tokenisation), the rest exercises the error paths."""
    return st.integers(1, one_in).flatmap(lambda i: bad if i == 1 else good)


# 10**400 overflows a float; "\ud800" is an unpaired surrogate, which only an escaped JSON string can carry.
json_scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
                | st.sampled_from([10**400, "\ud800", "a\udfffb"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
words = st.text(st.characters(codec="utf-8"), min_size=1, max_size=20).filter(str.strip)  # no surrogates
texts = mostly(words, st.sampled_from(["", " ", "\n", "Où est 北京?", "a\u2028b", "\x00", "\ud800"]), one_in=8)


def field(good):
    return mostly(good, json_values, one_in=8)


def conversation(role_tag: str, content_tag: str, user: str, assistant: str, system: str, *, ends_with_user: bool):
    """Alternating user/assistant turns (optionally after a system turn); now and then any list of messages."""
    def build(n_pairs, with_system, contents):
        roles = ([system] if with_system else []) + [user, assistant] * n_pairs + ([user] if ends_with_user else [])
        return [{role_tag: role, content_tag: content} for role, content in zip(roles, contents)]

    valid = st.builds(build, st.integers(0 if ends_with_user else 1, 2), st.booleans(),
                      st.lists(field(texts), min_size=6, max_size=6))
    any_roles = st.lists(st.fixed_dictionaries({role_tag: field(st.sampled_from([user, assistant, system, "tool"])),
                                                content_tag: field(texts)}), max_size=4)
    return mostly(valid, any_roles, one_in=4)


def row(required: dict, optional: dict):
    """A row with the `required` fields and some `optional` ones; now and then fields go missing and
    stray keys appear."""
    def build(dropped, extra, values, keep_optional):
        out = {k: v for k, v in values.items() if (k in required or k in keep_optional) and k not in dropped}
        out.update(extra)
        return out

    return st.builds(build,
                     mostly(st.just(set()), st.sets(st.sampled_from(list(required)), max_size=1)),
                     mostly(st.just({}), st.dictionaries(st.text(max_size=6), json_values, max_size=2)),
                     st.fixed_dictionaries({**required, **optional}),
                     st.sets(st.sampled_from(list(optional) or [""])))


def pair_messages(role_tag, content_tag, assistant):
    return mostly(st.builds(lambda text: {role_tag: assistant, content_tag: text}, texts), json_values)


SHAREGPT = ("from", "value", "human", "gpt", "system")
OPENAI = ("role", "content", "user", "assistant", "system")
# Shape -> (row strategy, stages that take it, registry formatting).
ROW_SHAPES = {
    "alpaca": (row({"instruction": field(texts), "output": field(texts)},
                   {"input": field(texts), "system": field(texts), "tools": json_values,
                    "history": field(st.lists(st.lists(texts, min_size=2, max_size=2), max_size=2))}),
               ["sft", "grpo"], "alpaca"),
    "alpaca_pairs": (row({"instruction": field(texts), "chosen": field(texts), "rejected": field(texts)},
                         {"input": field(texts), "margin": mostly(st.floats(-5, 5), json_values)}),
                     ["rm", "dpo"], "alpaca"),
    "sharegpt": (row({"conversations": conversation(*SHAREGPT, ends_with_user=False)},
                     {"system": field(texts), "tools": json_values}), ["sft", "grpo"], "sharegpt"),
    "sharegpt_pairs": (row({"conversations": conversation(*SHAREGPT, ends_with_user=True),
                            "chosen": pair_messages("from", "value", "gpt"),
                            "rejected": pair_messages("from", "value", "gpt")}, {}), ["rm", "dpo"], "sharegpt"),
    "openai": (row({"messages": conversation(*OPENAI, ends_with_user=False)}, {"tools": json_values}),
               ["sft", "grpo"], "openai"),
    "trl_completion": (row({"prompt": field(texts), "completion": field(texts)}, {}), ["sft", "grpo"], None),
    "trl_unpaired": (row({"prompt": mostly(texts, conversation(*OPENAI, ends_with_user=True), one_in=3),
                          "completion": field(texts), "label": mostly(st.booleans(), json_values)}, {}), ["kto"], None),
    "sharegpt_kto": (row({"conversations": conversation(*SHAREGPT, ends_with_user=False),
                          "label": mostly(st.booleans(), json_values)}, {"system": field(texts)}), ["kto"], "sharegpt"),
    "trl_pairs": (row({"prompt": mostly(texts, conversation(*OPENAI, ends_with_user=True), one_in=3),
                       "chosen": field(texts), "rejected": field(texts)}, {"margin": json_values}),
                  ["rm", "dpo"], None),
    "trl_implicit_pairs": (row({"chosen": conversation(*OPENAI, ends_with_user=False),
                                "rejected": conversation(*OPENAI, ends_with_user=False)}, {}), ["rm", "dpo"], None),
    "prompt_only": (row({"prompt": field(texts)}, {"answer": json_values}), ["grpo", "ppo"], None),
    "text": (row({"text": field(texts)}, {}), ["pt"], None),
}
STAGES = ["pt", "sft", "rm", "dpo", "kto", "grpo"]
# The data kind each consumer trains on (grpo/ppo are not registered stages yet; their data kind is).
STAGE_KINDS = {"pt": "text", "sft": "supervised", "rm": "preference", "dpo": "preference", "kto": "unpaired",
               "grpo": "prompt",
               "ppo": "prompt"}

# ---------------------------------------------------------------------------------------------- files
ENCODINGS = ["utf-8-sig", "utf-16", "utf-32", "latin-1"]  # and, mostly, plain utf-8


def _text_of(rows, suffix: str, top_level, ascii_only: bool) -> str:
    if suffix == ".jsonl":
        return "\n".join(json.dumps(r, ensure_ascii=ascii_only) for r in rows)
    if suffix == ".json":
        return json.dumps(top_level(rows), ensure_ascii=ascii_only)
    columns = sorted({k for r in rows if isinstance(r, dict) for k in r})
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns)
    writer.writeheader()
    for r in rows:
        if isinstance(r, dict):
            writer.writerow({k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in r.items()})
    return out.getvalue()


@st.composite
def data_files(draw, suffixes=(".json", ".jsonl", ".csv"), shape=None):
    """(file name, bytes, stage, shape): a data file of rows of one shape (`shape`, else any) for a stage
    that (mostly) takes them, in some encoding, now and then corrupted."""
    shape = shape or draw(st.sampled_from(sorted(ROW_SHAPES)))
    strategy, stages, _ = ROW_SHAPES[shape]
    stage = draw(mostly(st.sampled_from(stages), st.sampled_from(STAGES)))
    suffix = draw(st.sampled_from(suffixes))
    rows = draw(mostly(st.lists(strategy, min_size=1, max_size=4), st.lists(json_values, max_size=3), one_in=10))
    top_level = draw(mostly(st.just(lambda r: r), st.sampled_from([lambda r: {"data": r},
                                                                    lambda r: r[0] if r else None])))
    text = _text_of(rows, suffix, top_level, ascii_only=draw(st.booleans()))
    data = text.encode(draw(mostly(st.just("utf-8"), st.sampled_from(ENCODINGS), one_in=3)), errors="replace")
    if draw(st.integers(1, 5)) == 1:  # splice in random bytes (invalid UTF-8, stray NULs, a broken BOM, ...)
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
    return f"data{suffix}", data, stage, shape


def _check_examples(examples, kind: str) -> None:
    """What `convert_dataset` promises downstream: canonical examples whose texts are str."""
    assert examples
    for ref, example in examples:
        assert isinstance(ref, str)
        if kind == "supervised":
            assert example["messages"] and example["messages"][-1]["role"] == "assistant"
            assert all(isinstance(m["content"], str) for m in example["messages"])
        elif kind == "preference":
            assert isinstance(example["chosen"], str) and isinstance(example["rejected"], str)
            assert example["prompt"]
            assert example["margin"] is None or isinstance(example["margin"], float)
        elif kind == "unpaired":
            assert example["prompt"] and isinstance(example["completion"], str)
            assert isinstance(example["desirable"], bool)
        elif kind == "prompt":
            assert example["prompt"] and isinstance(example["extra"], dict)
        else:
            assert isinstance(example["text"], str)


def _convert(folder: Path, name: str, data: bytes, stage: str, registry: dict | None, skip: bool):
    (folder / name).write_bytes(data)
    if registry is not None:
        (folder / "dataset_info.json").write_text(json.dumps({"d": dict(registry, file_name=name)}))
    attrs = resolve_datasets("d" if registry is not None else str(folder / name), str(folder))
    return convert_dataset(attrs[0], STAGE_KINDS[stage], stage, max_samples=None, skip_invalid_rows=skip)


# ---------------------------------------------------------------------------------------------- properties
def _convert_or_data_error(folder: Path, file, registry: dict | None, skip: bool) -> None:
    name, data, stage, _ = file
    try:
        examples = _convert(folder, name, data, stage, registry, skip)
    except DataError:
        event("DataError")
        return
    event("examples")
    _check_examples(examples, STAGE_KINDS[stage])


@pytest.mark.parametrize("shape", sorted(ROW_SHAPES))
def test_any_file_of_each_shape_converts_to_examples_or_a_data_error(shape):
    """Each shape gets its own examples, so a bug in one converter is not left to chance among all."""

    @settings(BOUNDED, max_examples=30)
    @given(file=data_files(shape=shape), skip=st.booleans())
    def check(file, skip):
        with tempfile.TemporaryDirectory() as folder:
            _convert_or_data_error(Path(folder), file, None, skip)

    check()


@BOUNDED
@given(file=data_files(suffixes=(".json", ".jsonl")), data=st.data())
def test_registered_formatting_converts_to_examples_or_a_data_error(file, data):
    formatting = ROW_SHAPES[file[3]][2]
    registry = {"formatting": data.draw(mostly(st.just(formatting or "alpaca"),
                                               st.sampled_from(["alpaca", "sharegpt", "openai"]))),
                "ranking": data.draw(st.booleans())}
    if data.draw(st.integers(1, 4)) == 1:  # a column mapping, possibly naming columns the file lacks
        registry["columns"] = data.draw(st.dictionaries(
            st.sampled_from(["prompt", "query", "response", "messages", "chosen", "rejected", "system"]),
            st.sampled_from(["instruction", "output", "conversations", "messages", "text", "prompt"]), max_size=2))
    with tempfile.TemporaryDirectory() as folder:
        _convert_or_data_error(Path(folder), file, registry, skip=True)


@settings(BOUNDED, max_examples=40)
@given(shape=st.sampled_from(sorted(ROW_SHAPES)), data=st.data())
def test_any_parquet_file_converts_to_examples_or_a_data_error(shape, data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    strategy, stages, _ = ROW_SHAPES[shape]
    rows, stage = data.draw(st.lists(strategy, min_size=1, max_size=4)), data.draw(st.sampled_from(stages))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "data.parquet"
        try:
            pq.write_table(pa.Table.from_pylist(rows), path)
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            assume(False)  # pyarrow cannot store these rows at all, so no parquet file can hold them
        _convert_or_data_error(Path(folder), ("data.parquet", path.read_bytes(), stage, shape), None, skip=True)


@settings(BOUNDED, max_examples=60)
@given(file=data_files(), skip=mostly(st.just(True), st.just(False), one_in=3),
       val_size=st.sampled_from([0.0, 0.0, 0.5, 2]))
def test_get_dataset_gives_token_columns_or_a_data_error(tiny_tokenizer, file, skip, val_size):
    """The whole pipeline, tokenisation and the Arrow cache included."""
    name, data, stage, _ = file
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / name).write_bytes(data)
        # A fresh cache per example (conftest's monkeypatch restores the variable after the test).
        os.environ["ALIGNKIT_DATA_CACHE"] = str(Path(folder) / "cache")
        config = parse_config({"dataset": str(Path(folder) / name), "dataset_dir": folder,
                               "stage": stage if stage in ("pt", "sft", "rm", "dpo", "kto") else "sft",
                               "cutoff_len": 96, "skip_invalid_rows": skip, "val_size": val_size})
        try:
            out = get_dataset(config, tiny_tokenizer, STAGE_KINDS[stage])
        except DataError:
            event("DataError")
            return
    event("examples")
    assert out["train_dataset"] is not None and len(out["train_dataset"]) > 0
    ids_column = "chosen_input_ids" if stage in ("rm", "dpo") else "input_ids"
    for split in (out["train_dataset"], out["eval_dataset"]):
        for ids in split[ids_column] if split is not None else []:
            assert ids and all(isinstance(i, int) for i in ids)
