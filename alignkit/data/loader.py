"""`get_dataset`: find the data, validate every row, convert, tokenise (cached), split.

Order of work: (1) a `tokenized_path` that exists is loaded as is; (2) each name in `dataset` /
`eval_dataset` is resolved (registry entry in `dataset_dir/dataset_info.json`, local file or folder, or hub
id); (3) a cache key is computed from everything that changes the result; a cached copy is loaded unless
`overwrite_cache`; (4) otherwise rows are read (first `max_samples` of each dataset), checked for the
stage's columns, converted row by row (a bad row stops the run with a `DataError` naming file, row and
field, or is skipped and reported with `skip_invalid_rows`), split for `val_size`, tokenised, and written
to the cache atomically (and to `tokenized_path` when given).

`datasets` (with pyarrow, seconds to import) is imported by the functions that build or load a dataset, not
here: `alignkit train` resolves the dataset names (`resolve_datasets`) before it imports torch
(`alignkit.config.keytable`).
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from . import processors
from ..env import alignkit_home, launched_processes
from ..errors import DataError, RowError, describe_value
from ..files import parse_mapping
from .processors import REPORT_ROWS
from .multimodal import IMAGE_COLUMN, ImageProcessing, check_row_images, count_placeholders, row_image_paths
from .formats import DATA_KINDS, FORMATTINGS, DatasetAttr, check_columns, convert_row, guess_formatting
from .template import ChatFormatter

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

logger = logging.getLogger(__name__)

FILE_TYPES = (".json", ".jsonl", ".csv", ".parquet", ".txt")
CACHE_VERSION = 3  # bump when tokenisation changes so old caches are not reused
_REGISTRY = "dataset_info.json"
# LLaMA-Factory's multimodal columns (dataset_info.json `columns` roles and the rows' default names).
MEDIA_COLUMNS = ("images", "videos", "audios")


# ---------------------------------------------------------------------------------------------- resolve
def _read_registry(dataset_dir: str) -> Optional[dict[str, Any]]:
    path = Path(dataset_dir) / _REGISTRY
    if not path.is_file():
        return None
    return parse_mapping(decode_text(path.read_bytes(), str(path)), str(path), syntax="json", error=DataError,
                         expected="expected an object mapping dataset names to entries")


def _is_offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _attr_from_registry(name: str, entry: Any, dataset_dir: str) -> DatasetAttr:
    where = f"{Path(dataset_dir) / _REGISTRY}, entry {name!r}"
    if not isinstance(entry, dict):
        raise DataError(f"{where}: expected an object with `file_name` or `hf_hub_url`.")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise DataError(f"{where}: formatting {formatting!r} is unknown; use one of {', '.join(FORMATTINGS)}.")
    for key in ("columns", "tags"):
        if not isinstance(entry.get(key, {}), dict):
            raise DataError(f"{where}: `{key}` must be an object mapping names to column/tag names.")
    common = dict(formatting=formatting, ranking=bool(entry.get("ranking", False)),
                  columns=dict(entry.get("columns", {})), tags=dict(entry.get("tags", {})),
                  split=entry.get("split", "train"), subset=entry.get("subset"), revision=entry.get("revision"))
    if entry.get("file_name"):
        path = Path(entry["file_name"])
        if not path.is_absolute():
            path = Path(dataset_dir) / path
        if not path.exists():
            raise DataError(f"{where}: file_name {str(path)!r} does not exist. Fix the path in {_REGISTRY} "
                            "or run scripts/make_demo_data.py for the demo datasets.")
        return DatasetAttr(name=name, load_from="file", path=str(path), **common)
    if entry.get("hf_hub_url"):
        return DatasetAttr(name=name, load_from="hub", path=entry["hf_hub_url"], **common)
    raise DataError(f"{where}: needs `file_name` (a local file) or `hf_hub_url`; other sources "
                    "(ms_hub_url, script_url, ...) are not supported.")


def resolve_datasets(names: str, dataset_dir: str) -> list[DatasetAttr]:
    """Turn a comma-separated `dataset` value into the datasets to load, in order.

    Each name is looked up in `dataset_dir/dataset_info.json`, then as a path (absolute, relative to the
    working directory, or relative to `dataset_dir`), then as a hub id `org/name`.

    Raises:
        DataError: unknown name, missing file, or a hub id while offline.
    """
    registry = _read_registry(dataset_dir)
    attrs = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if registry is not None and name in registry:
            attrs.append(_attr_from_registry(name, registry[name], dataset_dir))
            continue
        for candidate in (Path(name), Path(dataset_dir) / name):
            if candidate.exists():
                attrs.append(DatasetAttr(name=name, load_from="file", path=str(candidate)))
                break
        else:
            if name.lower().endswith(FILE_TYPES) or name.startswith((".", "/", "~")):
                raise DataError(f"dataset {name!r}: no such file (looked in the working directory and in "
                                f"dataset_dir={dataset_dir!r}).")
            if name.count("/") != 1:
                known = ", ".join(sorted(registry)) if registry else f"none ({Path(dataset_dir) / _REGISTRY} not found)"
                raise DataError(f"dataset {name!r} is not a file, not a name in {Path(dataset_dir) / _REGISTRY} "
                                f"(known: {known}) and not a hub id of the form org/name.")
            attrs.append(DatasetAttr(name=name, load_from="hub", path=name))
    return attrs


# ---------------------------------------------------------------------------------------------- read
class _Rows:
    """Rows of one dataset with their 1-based row (or .jsonl line) numbers; unparseable rows hold a RowError."""

    def __init__(self, source: str, line_based: bool) -> None:
        self.source = source
        self.line_based = line_based
        self.items: list[tuple[int, Any]] = []

    def ref(self, number: int) -> str:
        return f"{self.source}, {'line' if self.line_based else 'row'} {number}"


def _data_files(attr: DatasetAttr) -> list[Path]:
    path = Path(attr.path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FILE_TYPES)
        if any(p.suffix.lower() != ".txt" for p in files):  # a notes.txt beside the data is not data
            files = [p for p in files if p.suffix.lower() != ".txt"]
        if not files:
            raise DataError(f"dataset {attr.name!r}: folder {path} holds no {'/'.join(FILE_TYPES)} files.")
        return files
    if path.suffix.lower() not in FILE_TYPES:
        raise DataError(f"dataset {attr.name!r}: {path} has an unsupported type; use {', '.join(FILE_TYPES)}.")
    return [path]


# ---------------------------------------------------------------------------------------------- text
# Text files are UTF-8. A byte-order mark selects UTF-8, UTF-16 or UTF-32 instead (Windows tools write
# them); UTF-32 is tried before UTF-16 because its little-endian mark starts with UTF-16's.
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
_UNDECODABLE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" turns undecodable bytes into
_TO_UTF8 = "Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT` for Latin-1 text)."


def _encoding(data: bytes) -> str:
    return next((name for bom, name in _BOMS if data.startswith(bom)), "utf-8")


def _not_utf8(data: bytes, start: int, *, line: bool = True) -> str:
    """Where undecodable byte `start` of `data` is: `line L, column C (byte offset B, 0xNN)`."""
    column = start - (data.rfind(b"\n", 0, start) + 1) + 1
    where = f"column {column} (byte offset {start}, 0x{data[start]:02x})"
    number = data.count(b"\n", 0, start) + 1
    return f"line {number}, {where}" if line else where


def decode_text(data: bytes, source: str) -> str:
    """The text of a whole data file: UTF-8, or what its byte-order mark says.

    Raises:
        DataError: bytes that do not decode, naming the line, column and byte offset and the fix.
    """
    encoding = _encoding(data)
    if encoding not in ("utf-8", "utf-8-sig"):
        try:
            return data.decode(encoding)
        except UnicodeDecodeError as err:
            raise DataError(f"{source}: not valid {encoding} text ({err.reason}). {_TO_UTF8}") from None
    skip = len(codecs.BOM_UTF8) if encoding == "utf-8-sig" else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as err:
        hint = " The file holds NUL bytes, so it may be UTF-16 without a byte-order mark." if b"\x00" in data else ""
        raise DataError(f"{source}: {_not_utf8(data, skip + err.start)} is not UTF-8.{hint} {_TO_UTF8}") from None


def _decoded_lines(data: bytes, source: str) -> list[tuple[int, str | RowError]]:
    """The 1-based lines of a line-based file; with UTF-8, a line holding bytes that do not decode becomes
    a RowError (so `skip_invalid_rows` can skip it) instead of failing the whole file.

    Lines end at `\\n` only: JSON text may hold U+2028 and other characters `str.splitlines` breaks at.
    """
    encoding = _encoding(data)
    if encoding not in ("utf-8", "utf-8-sig"):
        return list(enumerate(decode_text(data, source).split("\n"), start=1))
    out: list[tuple[int, str | RowError]] = []
    offset = len(codecs.BOM_UTF8) if encoding == "utf-8-sig" else 0
    for number, raw in enumerate(data[offset:].split(b"\n"), start=1):
        try:
            out.append((number, raw.decode("utf-8")))
        except UnicodeDecodeError as err:
            where = _not_utf8(data, offset + err.start, line=False)  # the caller names the line
            out.append((number, RowError(None, f"{where} is not UTF-8. {_TO_UTF8}")))
        offset += len(raw) + 1
    return out


def _read_json_lines(data: bytes, rows: _Rows) -> None:
    for number, line in _decoded_lines(data, rows.source):
        if isinstance(line, RowError):
            rows.items.append((number, line))
            continue
        if not line.strip():
            continue
        try:
            rows.items.append((number, json.loads(line)))
        except json.JSONDecodeError as err:
            rows.items.append((number, RowError(None, f"invalid JSON ({err.msg}, column {err.colno}).")))
        except (ValueError, RecursionError) as err:  # an integer of over 4300 digits, nesting past the stack
            rows.items.append((number, RowError(None, f"cannot read this JSON ({err or 'nested too deeply'}).")))


def _read_text_lines(data: bytes, rows: _Rows) -> None:
    """A .txt file for pretraining: one document per line, as `{"text": line}` rows.

    LLaMA-Factory reads .txt with the `datasets` text builder, one row per line, where a blank line is an
    empty document that adds only an eos token to the stream; blank lines hold no text, so they are skipped
    here. A trailing `\r` (Windows line ends) is not part of the document.
    """
    for number, line in _decoded_lines(data, rows.source):
        if isinstance(line, RowError):
            rows.items.append((number, line))
        elif line.strip():
            rows.items.append((number, {"text": line.removesuffix("\r")}))


def _decode_keeping_bad_bytes(data: bytes, source: str) -> str:
    """Text of a whole file in which undecodable UTF-8 bytes survive as lone surrogates (`_UNDECODABLE`),
    so the row holding them can be named; files with a UTF-16/32 byte-order mark decode strictly."""
    encoding = _encoding(data)
    if encoding.startswith("utf-8"):
        return data.decode(encoding, errors="surrogateescape")
    return decode_text(data, source)


def _read_csv(data: bytes, rows: _Rows) -> None:
    """CSV rows as dicts of their non-empty cells; a row with undecodable bytes becomes a RowError."""
    # Undecodable bytes are found per row after parsing: a quoted cell may span lines, so the file cannot
    # be split into rows before.
    text = _decode_keeping_bad_bytes(data, rows.source)
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        header = reader.fieldnames or []
        bad = next((name for name in header if _UNDECODABLE.search(name)), None)
        if bad is not None:
            raise DataError(f"{rows.source}: the header line is not UTF-8 (column {bad!r}). {_TO_UTF8}")
        for number, record in enumerate(reader, start=1):
            # Empty cells mean "absent" (an alpaca `input` left blank), not empty text.
            row = {k: v for k, v in record.items() if k is not None and v != ""}
            bad = next((k for k, v in row.items() if isinstance(v, str) and _UNDECODABLE.search(v)), None)
            if bad is not None:
                rows.items.append((number, RowError(bad, f"holds bytes that are not UTF-8 (file line "
                                                         f"{reader.line_num}). {_TO_UTF8}")))
            else:
                rows.items.append((number, row))
    except csv.Error as err:
        raise DataError(f"{rows.source}: not readable as CSV at line {reader.line_num} ({err}).") from None


def _check_json_document_decodes(data: bytes, source: str) -> None:
    """Raise the DataError of `decode_text`, adding why `skip_invalid_rows` cannot help with a .json file."""
    try:
        decode_text(data, source)
    except DataError as err:
        raise DataError(f"{err} A .json file is one JSON document, so skip_invalid_rows cannot skip the bad "
                        "part; fix the bytes, or write the rows as .jsonl (one per line) to skip bad lines.") from None


def _read_file(path: Path, max_rows: Optional[int]) -> _Rows:
    suffix = path.suffix.lower()
    source = str(path)
    if suffix == ".jsonl":
        rows = _Rows(source, line_based=True)
        _read_json_lines(path.read_bytes(), rows)
    elif suffix == ".txt":
        rows = _Rows(source, line_based=True)
        _read_text_lines(path.read_bytes(), rows)
    elif suffix == ".json":
        data_bytes = path.read_bytes()
        text = _decode_keeping_bad_bytes(data_bytes, source)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            # A .json file holding JSON lines is common (LLaMA-Factory accepts it): read it line by line,
            # where skip_invalid_rows can skip a line that does not decode or parse.
            if err.msg == "Extra data" and text.lstrip().startswith("{"):
                rows = _Rows(source, line_based=True)
                _read_json_lines(data_bytes, rows)
                return rows
            _check_json_document_decodes(data_bytes, source)  # undecodable bytes are the first thing to fix
            raise DataError(f"{source}: invalid JSON at line {err.lineno} column {err.colno} ({err.msg}). "
                            "Fix the file (a .json file must hold one list of objects).") from None
        except (ValueError, RecursionError) as err:
            raise DataError(f"{source}: cannot read this JSON ({err or 'nested too deeply'}).") from None
        if _UNDECODABLE.search(text):
            _check_json_document_decodes(data_bytes, source)
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))  # {"data": [...]} / {"train": [...]}
        if not isinstance(data, list):
            raise DataError(f"{source}: expected a list of objects at the top level, got {describe_value(data)}.")
        rows = _Rows(source, line_based=False)
        rows.items = list(enumerate(data, start=1))
    elif suffix == ".csv":
        rows = _Rows(source, line_based=False)
        _read_csv(path.read_bytes(), rows)
    else:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises several types for a damaged file
            raise DataError(f"{source}: cannot read parquet ({err}).") from None
        rows = _Rows(source, line_based=False)
        rows.items = list(enumerate(table.to_pylist(), start=1))
    if max_rows is not None:
        rows.items = rows.items[:max_rows]
    return rows


def _read_hub(attr: DatasetAttr, max_rows: Optional[int]) -> _Rows:
    if _is_offline():
        raise DataError(f"dataset {attr.name!r} is a hub dataset ({attr.path}) but the hub is offline "
                        "(HF_HUB_OFFLINE=1 or no network). Download it where there is network and give the local "
                        "file, or unset HF_HUB_OFFLINE.")
    from datasets import load_dataset

    try:
        data = load_dataset(attr.path, name=attr.subset, split=attr.split, revision=attr.revision)
    except Exception as err:  # network and hub errors come in many types; all mean the same to the user
        raise DataError(f"dataset {attr.name!r}: cannot load {attr.path} from the hub ({err}).") from None
    if max_rows is not None:
        data = data.select(range(min(max_rows, len(data))))
    rows = _Rows(f"{attr.path} ({attr.split})", line_based=False)
    rows.items = list(enumerate(data, start=1))
    return rows


def read_rows(attr: DatasetAttr, max_samples: Optional[int]) -> list[_Rows]:
    """The raw rows of one dataset (per file), at most `max_samples` in all."""
    if attr.load_from == "hub":
        return [_read_hub(attr, max_samples)]
    out = []
    left = max_samples
    for path in _data_files(attr):
        if left is not None and left <= 0:
            break
        rows = _read_file(path, left)
        out.append(rows)
        if left is not None:
            left -= len(rows.items)
    return out


# ---------------------------------------------------------------------------------------------- convert
def _resolve_formatting(attr: DatasetAttr, rows: _Rows, kind: str) -> str:
    if attr.formatting != "auto":
        return attr.formatting
    first = next((row for _, row in rows.items if isinstance(row, dict)), None)
    if first is None:
        raise DataError(f"{rows.source}: holds no rows (or none that is a JSON object).")
    formatting = guess_formatting(list(first), rows.source)
    if formatting == "text" and kind != "text":
        raise DataError(f"{rows.source}: has only a `text` column (pretraining data); stage needs "
                        f"{kind} examples. Use stage pt, or give prompt/response columns.")
    return formatting


def _refuse_text_file(attr: DatasetAttr, kind: str, stage: str) -> None:
    """A .txt file is plain documents; only pretraining (kind `text`) can use it."""
    if kind == "text" or attr.load_from != "file":
        return
    txt = next((p for p in _data_files(attr) if p.suffix.lower() == ".txt"), None)
    if txt is not None:
        raise DataError(f"dataset {attr.name!r}: {txt} is a .txt file (plain text, one document per line), which "
                        f"only stage pt trains on; stage {stage} needs {kind} examples. Use stage: pt, or give a "
                        ".json/.jsonl/.csv/.parquet file with the stage's columns.")


def _refuse_media(attr: DatasetAttr, rows: _Rows, images_allowed: bool) -> None:
    """Media a run cannot train on: videos and audio always, images unless the model is a vision-language model
    (then `multimodal` reads them). Training on the text alone would keep the rows' `<image>` placeholders as
    literal text."""
    why = ("training on the text alone would keep the rows' <image>/<video>/<audio> placeholders as literal text. "
           "{fix}, or remove the media column and the placeholders to train on the text.")
    image_fix = ("The model is text-only, or the stage does not take images yet: stages sft, dpo, kto, grpo and rloo "
                 "train on images with a vision-language model (docs/multimodal.md)")
    other_fix = "alignkit trains on images only (not videos or audio): use a trainer for that media"
    refused = [c for c in MEDIA_COLUMNS if not (images_allowed and c == IMAGE_COLUMN)]

    def fix(role: str) -> str:
        return why.format(fix=image_fix if role == IMAGE_COLUMN else other_fix)

    for role in refused:
        if role in attr.columns:
            raise DataError(f"dataset {attr.name!r}: dataset_info.json maps `{role}` to column "
                            f"`{attr.columns[role]}`; {fix(role)}")
    for number, row in rows.items:
        if isinstance(row, dict):
            column = next((c for c in refused if row.get(c) not in (None, "", [])), None)
            if column is not None:
                raise DataError(f"dataset {attr.name!r}: {rows.ref(number)} has a `{column}` column; {fix(column)}")
            if not images_allowed and _has_image_part(row):
                raise DataError(f"dataset {attr.name!r}: {rows.ref(number)} has an image content part "
                                f"({{\"type\": \"image\"}}); {fix(IMAGE_COLUMN)}")


def _has_image_part(value: Any, depth: int = 0) -> bool:
    """Whether a row holds a TRL/OpenAI image content part (`{"type": "image"}`) in its messages."""
    if isinstance(value, dict):
        return value.get("type") in ("image", "image_url") or (depth < 4 and any(
            _has_image_part(v, depth + 1) for v in value.values() if isinstance(v, (list, dict))))
    if isinstance(value, list) and depth < 4:
        return any(_has_image_part(v, depth + 1) for v in value if isinstance(v, (list, dict)))
    return False


def _attach_images(example: dict, row: dict, attr: DatasetAttr, kind: str, media_dir: str) -> dict:
    """`example` with its row's image paths (`images`), checked (`multimodal.check_row_images`)."""
    column = attr.columns.get(IMAGE_COLUMN, IMAGE_COLUMN)
    paths = row_image_paths(row, column, media_dir)
    if paths or count_placeholders(example):
        check_row_images(example, paths, column, kind)
    if isinstance(example.get("extra"), dict):
        example["extra"].pop(column, None)  # prompt rows keep their other columns; the images travel apart
    return dict(example, images=paths)


def _warn_unused_kto_tags(attr: DatasetAttr, rows: _Rows, stage: str) -> None:
    """Warn when rows carry KTO desirability tags (LLaMA-Factory's `kto_tag` column, TRL's boolean `label`)
    that this stage ignores: the rows tagged false are trained on as targets like the others."""
    column = attr.columns.get("kto_tag")
    dicts = [(number, row) for number, row in rows.items if isinstance(row, dict)]
    if column is None:
        column = "kto_tag" if any("kto_tag" in row for _, row in dicts) else None
    if column is None and any(isinstance(row.get("label"), bool) for _, row in dicts):
        column = "label"
    if column is None:
        return
    undesirable = [number for number, row in dicts if row.get(column) is False
                   or (isinstance(row.get(column), str) and row[column].strip().lower() == "false")]
    if undesirable:
        what = "line" if rows.line_based else "row"
        logger.warning(
            "Dataset %r (%s): %d of %d %ss are marked undesirable (`%s` is false): %s %s%s. Stage %s does not "
            "read that column, so it trains on their replies as targets like the others. Use stage: kto to learn "
            "from the tag, or remove those rows to train only on the desirable replies.",
            attr.name, rows.source, len(undesirable), len(dicts), what, column, what,
            ", ".join(map(str, undesirable[:REPORT_ROWS])),
            f" and {len(undesirable) - REPORT_ROWS} more" if len(undesirable) > REPORT_ROWS else "",
            stage)


def convert_dataset(attr: DatasetAttr, kind: str, stage: str, max_samples: Optional[int],
                    skip_invalid_rows: bool, media_dir: Optional[str] = None) -> list[tuple[str, dict]]:
    """Read, check and convert one dataset into (reference, canonical example) pairs.

    Args:
        media_dir: for a vision-language model, where relative image paths are read from (`dataset_dir`); each
            example then carries `images` (its paths, every one opened and checked). None: rows with images are
            refused (a text-only model).

    Raises:
        DataError: on the first bad row (unless `skip_invalid_rows`), or when the stage's columns are missing.
    """
    examples: list[tuple[str, dict]] = []
    skipped: list[tuple[str, str]] = []
    _refuse_text_file(attr, kind, stage)
    for rows in read_rows(attr, max_samples):
        _refuse_media(attr, rows, images_allowed=media_dir is not None)
        if stage != "kto":
            _warn_unused_kto_tags(attr, rows, stage)
        formatting = _resolve_formatting(attr, rows, kind)
        if formatting in FORMATTINGS:
            attr = dataclasses.replace(attr, formatting=formatting)  # its default column names apply
        columns: list[str] = []
        for _, row in rows.items:
            if isinstance(row, dict):
                columns += [k for k in row if k not in columns]
        if columns:
            check_columns(attr, formatting, columns, kind, stage, rows.source)
        for number, row in rows.items:
            try:
                if isinstance(row, RowError):
                    raise row
                example = convert_row(row, attr, formatting, kind)
                if media_dir is not None and kind != "text":
                    example = _attach_images(example, row, attr, kind, media_dir)
                examples.append((rows.ref(number), example))
            except RowError as err:
                if not skip_invalid_rows:
                    what = "line" if rows.line_based else "row"
                    raise DataError(f"{rows.ref(number)}: {err} Fix the {what} or set skip_invalid_rows=true "
                                    "to skip it.") from None
                skipped.append((rows.ref(number), str(err)))
    if skipped:
        shown = "; ".join(f"{ref}: {msg}" for ref, msg in skipped[:REPORT_ROWS])
        logger.warning("Skipped %d invalid row(s) of dataset %r (skip_invalid_rows=true): %s%s", len(skipped),
                       attr.name, shown, " ..." if len(skipped) > REPORT_ROWS else "")
    if not examples:
        raise DataError(f"dataset {attr.name!r}: no usable rows" + (" (all were invalid)." if skipped else "."))
    return examples


def split_examples(examples: list, val_size: float, seed: int) -> tuple[list, list]:
    """Hold out `val_size` (a share < 1 or a count >= 1) of the examples, chosen by a seeded shuffle.

    Returns:
        (train, eval), each in the original order.
    """
    n = len(examples)
    count = int(val_size) if val_size >= 1 else max(1, round(n * val_size))
    if count >= n:
        raise DataError(f"val_size={val_size} holds out {count} of {n} examples, leaving none to train on; "
                        "lower val_size.")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


# ---------------------------------------------------------------------------------------------- cache
def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _attr_fingerprint(attr: DatasetAttr) -> dict[str, Any]:
    fp: dict[str, Any] = {k: getattr(attr, k) for k in ("load_from", "formatting", "ranking", "columns", "tags",
                                                          "split", "subset", "revision")}
    if attr.load_from == "hub":
        fp["hub"] = attr.path
    else:
        fp["files"] = [[p.name, _file_digest(p)] for p in _data_files(attr)]
    return fp


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides token ids: the vocabulary and merges, special tokens and chat template."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    for part in (tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token):
        digest.update(repr(part).encode())
    return digest.hexdigest()


def cache_root() -> Path:
    """`$ALIGNKIT_DATA_CACHE`, else `$ALIGNKIT_HOME/tokenized`, else `~/.cache/alignkit/tokenized`."""
    if os.environ.get("ALIGNKIT_DATA_CACHE"):
        return Path(os.environ["ALIGNKIT_DATA_CACHE"])
    return alignkit_home() / "tokenized"


# A temporary folder's name says which process writes it, so a later run can tell a folder still being
# written from one left behind by a killed run: `.{target}.tmp-{host}-{pid}-{random}` (and `.old-` for a
# replaced copy on its way out). One is stale when its process is gone (same host) or, for folders of
# other hosts sharing the file system (and of processes whose id was reused), when untouched for a day.
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.(?:tmp|old)-(?P<host>.*)-(?P<pid>\d+)-[A-Za-z0-9_]+$")
# Before temporary folders carried their writer, they were `.{32 hex cache key}.{random}`.
_LEGACY_TEMP_NAME = re.compile(r"^\.[0-9a-f]{32}\.[A-Za-z0-9_]{8}$")
STALE_TEMP_SECONDS = 24 * 3600


def _temp_prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # alive under another user; or not a pid at all
        return True
    return True


def remove_stale_temp_dirs(folder: Path, now: Optional[float] = None) -> list[Path]:
    """Delete the temporary folders that killed runs left in `folder` (see `_TEMP_NAME`); returns them.

    Only folders named by `_save_atomically` are touched, so `folder` may be any user folder (the parent
    of `tokenized_path`).
    """
    now = time.time() if now is None else now
    host = socket.gethostname()
    removed = []
    for child in folder.iterdir() if folder.is_dir() else []:
        match = _TEMP_NAME.match(child.name)
        try:
            if not child.is_dir() or (match is None and not _LEGACY_TEMP_NAME.match(child.name)):
                continue
            old = now - child.stat().st_mtime > STALE_TEMP_SECONDS
            dead = match is not None and match["host"] == host and not _process_alive(int(match["pid"]))
        except OSError:  # removed meanwhile by another run cleaning up
            continue
        if old or dead:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    if removed:
        logger.info("Removed %d temporary folder(s) left by interrupted runs in %s.", len(removed), folder)
    return removed


def _save_atomically(splits: DatasetDict, target: Path) -> None:
    """Write to a sibling temporary folder and rename it into place, so a reader never sees half a cache.

    A run killed mid-write leaves its temporary folder behind; the next write into the same folder
    removes it (`remove_stale_temp_dirs`).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(target.parent)
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target, "tmp"), dir=target.parent))
    replaced = None
    quiet = not are_progress_bars_disabled()
    try:
        if quiet:  # a progress bar per cache write is noise in the training log
            disable_progress_bars()
        splits.save_to_disk(str(tmp))
        if target.exists():
            # A folder cannot be renamed onto a non-empty one: move the old copy aside first.
            replaced = Path(tempfile.mkdtemp(prefix=_temp_prefix(target, "old"), dir=target.parent))
            os.replace(target, replaced)
        os.replace(tmp, target)
    except OSError:
        # Another process finished the same cache first; its copy is as good as ours.
        if not target.exists():
            raise
    finally:
        if quiet:
            enable_progress_bars()
        shutil.rmtree(tmp, ignore_errors=True)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)


def _as_result(splits: DatasetDict) -> dict[str, Optional[Dataset]]:
    return {"train_dataset": splits.get("train"), "eval_dataset": splits.get("eval")}


# ---------------------------------------------------------------------------------------------- entry point
def get_dataset(config, tokenizer, kind: str, images: Optional[ImageProcessing] = None) -> dict[str, Optional[Dataset]]:
    """Tokenised train and eval datasets of one kind (see docs/ARCHITECTURE.md for the columns).

    With a built-in `template`, `tokenizer.chat_template` is set to that template's Jinja (the tokenizer a
    stage saves with its model must render what was trained); pass a copy to keep the tokenizer as it was.

    Args:
        config: the run's `Config` (its `data` section, `finetuning.stage` for messages, and
            `training.seed` / `predict_with_generate`).
        tokenizer: the model's tokenizer.
        kind: one of `formats.DATA_KINDS` (`text`, `supervised`, `preference`, `unpaired`, `prompt`). A stage
            passes its own (`DATA_KIND` in its module, as the registry `alignkit.stages.STAGES` records it);
            the data layer knows no stages.
        images: a vision-language model's processor (`model.loader.load_image_processing`): rows may then carry
            images, which become the model's image tokens, and each example keeps its image paths in `images`
            for `multimodal.ImageCollator`. None: rows with images are refused.

    Returns:
        `{"train_dataset": Dataset | None, "eval_dataset": Dataset | None}`.

    Raises:
        DataError: a missing or malformed dataset, with file, row and field named.
    """
    if kind not in DATA_KINDS:
        raise DataError(f"{kind!r} is not a data kind ({', '.join(DATA_KINDS)}); a stage's is "
                        "`alignkit.stages.STAGES[stage].data_kind`.")
    d = config.data
    formatter = ChatFormatter(tokenizer, d.template, d.default_system)
    if formatter.jinja_template() is not None:
        # The tokenizer is saved with the trained model (the Trainer's processing_class): it must carry the
        # format trained with, so that chat and export after training use it.
        tokenizer.chat_template = formatter.jinja_template()
    from datasets import load_from_disk

    if d.tokenized_path and Path(d.tokenized_path).is_dir():
        logger.warning("Loading tokenised data from tokenized_path=%s; the dataset settings are ignored.",
                       d.tokenized_path)
        return _as_result(load_from_disk(d.tokenized_path))

    seed = config.training.seed
    for_generation = bool(getattr(config.training, "predict_with_generate", False)) and kind == "supervised"
    train_attrs = resolve_datasets(d.dataset, d.dataset_dir) if d.dataset else []
    eval_attrs = resolve_datasets(d.eval_dataset, d.dataset_dir) if d.eval_dataset else []
    t = config.training
    if not t.do_train and (t.do_eval or t.do_predict) and not eval_attrs and not d.val_size and train_attrs:
        # Without training, `dataset` is what evaluation and prediction run on (LLaMA-Efficient-Tuning's
        # `do_predict: true, dataset: X` configs rely on it).
        logger.info("do_train is false: evaluating/predicting on dataset=%s.", d.dataset)
        train_attrs, eval_attrs = [], train_attrs

    key_parts = {
        "version": CACHE_VERSION, "kind": kind, "train": [_attr_fingerprint(a) for a in train_attrs],
        "eval": [_attr_fingerprint(a) for a in eval_attrs], "tokenizer": tokenizer_fingerprint(tokenizer),
        "template": d.template, "default_system": d.default_system, "cutoff_len": d.cutoff_len,
        "train_on_prompt": d.train_on_prompt,
        "mask_history": d.mask_history, "max_samples": d.max_samples, "val_size": d.val_size, "seed": seed, "for_generation": for_generation,
        "skip_invalid_rows": d.skip_invalid_rows,
    }
    if images is not None:  # image tokens depend on the processor; the image files are read from dataset_dir
        key_parts.update(images=images.fingerprint(), media_dir=str(Path(d.dataset_dir).resolve()))
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
    cached = cache_root() / key
    # Under torchrun/accelerate the main process of each node tokenises and writes the cache while the
    # others wait, then they read what it wrote (one tokenisation per node, never two writers racing;
    # nodes sharing a file system each write the same bytes atomically). One process: no waiting.
    with _main_process_first(config, "tokenisation") as is_main:
        if cached.is_dir() and not (d.overwrite_cache and is_main):
            logger.info("Loading tokenised data from cache %s.", cached)
        else:
            _save_atomically(_build(config, formatter, kind, train_attrs, eval_attrs, for_generation, images), cached)
        # Every process, and a fresh run as a cached one, reads the cache: the same memory-mapped rows, so
        # what is derived from the files (DPO's reference log-prob cache sits beside them) agrees everywhere.
        splits = load_from_disk(str(cached))
    if d.tokenized_path and is_main:
        _save_atomically(splits, Path(d.tokenized_path))
        logger.info("Saved tokenised data to tokenized_path=%s.", d.tokenized_path)
    return _as_result(splits)


@contextlib.contextmanager
def _main_process_first(config, desc: str) -> Iterator[bool]:
    """`TrainingArguments.main_process_first` (per node) for a run launched with several processes; yields
    whether this process is the one that goes first."""
    args = config.training
    if launched_processes() <= 1 or not hasattr(args, "main_process_first"):
        yield True
        return
    with args.main_process_first(local=True, desc=desc):
        yield args.local_process_index == 0


def _build(config, formatter: ChatFormatter, kind: str, train_attrs: list[DatasetAttr],
           eval_attrs: list[DatasetAttr], for_generation: bool, images: Optional[ImageProcessing] = None
           ) -> DatasetDict:
    from datasets import Dataset, DatasetDict

    d = config.data
    stage = config.finetuning.stage
    media_dir = d.dataset_dir if images is not None else None

    def convert(attrs: list[DatasetAttr]) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        for attr in attrs:
            out += convert_dataset(attr, kind, stage, d.max_samples, d.skip_invalid_rows, media_dir)
        return out

    train, held = convert(train_attrs), convert(eval_attrs)
    if train and not eval_attrs and d.val_size > 0:
        train, held = split_examples(train, d.val_size, config.training.seed)
    splits = {}
    for split, examples in (("train", train), ("eval", held)):
        if not examples:
            continue
        columns, dropped = processors.tokenize_examples(
            examples, kind, formatter, d.cutoff_len, train_on_prompt=d.train_on_prompt, mask_history=d.mask_history,
            for_generation=for_generation and split == "eval", images=images,
            num_workers=d.preprocessing_num_workers)
        if dropped:
            reasons = sorted({reason for _, reason in dropped})
            logger.warning("Dropped %d of %d %s example(s): %s. Rows: %s%s. Raise cutoff_len or fix those rows.",
                           len(dropped), len(examples), split, "; ".join(reasons),
                           ", ".join(ref for ref, _ in dropped[:REPORT_ROWS]),
                           " ..." if len(dropped) > REPORT_ROWS else "")
        if not columns or not next(iter(columns.values())):
            raise DataError(f"no {split} example is left after tokenisation (cutoff_len={d.cutoff_len}).")
        try:
            splits[split] = Dataset.from_dict(columns)
        except Exception as err:  # pyarrow type clashes inside extra columns
            raise DataError(f"{split} data: a kept column has values of mixed types across rows ({err}); "
                            "make each column hold one type.") from None
    return DatasetDict(splits)
