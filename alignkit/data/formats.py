"""Dataset rows in their many shapes → one canonical example per row.

Shapes understood (the column names can be remapped through `dataset_info.json`, as in LLaMA-Factory):

- alpaca: `instruction` (+ optional `input`, joined by a newline) → `output`, with optional `system` and
  `history` (a list of `[question, answer]` pairs before this turn); preference rows have `chosen` and
  `rejected` strings instead of `output`.
- sharegpt: `conversations`, a list of `{"from": ..., "value": ...}` alternating user and assistant turns
  after an optional leading system turn; preference rows end with a user turn and have `chosen` and
  `rejected` message objects.
- openai: `messages` with `role`/`content` keys (the same rules as sharegpt, other tag names).
- TRL-style: `prompt` + `chosen` + `rejected` (each a string or a list of messages), `prompt` +
  `completion` (+ a boolean `label` for KTO's unpaired rows), or `prompt` alone (RL prompts; the other
  columns, e.g. `answer`, are kept).
- unpaired (KTO): any of the shapes above that gives a prompt and one reply, plus a desirable/undesirable
  flag: the column mapped as `kto_tag` in dataset_info.json (LLaMA-Factory), else `label` (TRL).
- text: a `text` column, for pretraining.

Canonical examples are plain dicts that never reach Arrow:
``{"messages": [...]}`` (supervised), ``{"prompt": [...], "chosen": str, "rejected": str, "margin": float|None}``
(preference), ``{"prompt": [...], "completion": str, "desirable": bool}`` (unpaired),
``{"prompt": [...], "extra": {...}}`` (prompt-only) and ``{"text": str}`` (pretraining).
Messages are ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``; a function call (sharegpt
`function_call` turn) is an assistant message with content "" and ``tool_calls`` (Hugging Face's form, see
`template`), an `observation` a ``tool`` message. Every example may carry ``tools`` (JSON text of the tool
signatures) for the template to render.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import DataError, RowError, describe_value
from .multimodal import IMAGE_PLACEHOLDER
from .template import parse_tools

FORMATTINGS = ("alpaca", "sharegpt", "openai")
# The kinds of example the data layer builds; each stage names the one it trains on (`alignkit.stages`).
DATA_KINDS = ("text", "supervised", "preference", "unpaired", "prompt")

ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                  "history": "history", "chosen": "chosen", "rejected": "rejected", "tools": "tools"}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": "system", "tools": "tools", "chosen": "chosen",
                    "rejected": "rejected"}
OPENAI_COLUMNS = dict(SHAREGPT_COLUMNS, messages="messages")
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
               "observation_tag": "tool", "function_tag": "function_call", "system_tag": "system"}


@dataclass
class DatasetAttr:
    """One dataset to load: where it is and how its columns map onto the canonical shape.

    Attributes:
        name: what the user wrote in `dataset` (registry name, path or hub id); used in messages.
        load_from: `file` (a local file or folder) or `hub`.
        path: the resolved file/folder path, or the hub id.
        formatting: `alpaca`, `sharegpt`, `openai`, or `auto` (guess from the first row's columns).
        ranking: the rows are preference pairs (registry `ranking: true`).
        columns: registry `columns`, role → column name.
        tags: registry `tags` for sharegpt-style messages.
        split, subset, revision: hub dataset selection.
    """

    name: str
    load_from: str
    path: str
    formatting: str = "auto"
    ranking: bool = False
    columns: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    split: str = "train"
    subset: Optional[str] = None
    revision: Optional[str] = None

    def column(self, role: str) -> Optional[str]:
        """The column holding `role` (registry mapping first, then the formatting's default)."""
        if role in self.columns:
            return self.columns[role]
        defaults = {"alpaca": ALPACA_COLUMNS, "sharegpt": SHAREGPT_COLUMNS, "openai": OPENAI_COLUMNS}
        return defaults.get(self.formatting, {}).get(role)

    def tag(self, name: str) -> str:
        base = OPENAI_TAGS if self.formatting == "openai" else SHAREGPT_TAGS
        return self.tags.get(name, base[name])


# TRL-style rows write messages with OpenAI's role/content keys.
_OPENAI = DatasetAttr(name="", load_from="file", path="", formatting="openai")


def guess_formatting(columns: list[str], source: str) -> str:
    """Pick a formatting for a file not in the registry from its column names.

    Returns:
        `alpaca`, `sharegpt`, `openai`, `trl` or `text`.
    """
    cols = set(columns)
    if "conversations" in cols:
        return "sharegpt"
    if "messages" in cols:
        return "openai"
    if "instruction" in cols:
        return "alpaca"
    if "prompt" in cols or {"chosen", "rejected"} <= cols:
        return "trl"
    if "text" in cols:
        return "text"
    raise DataError(
        f"{source}: cannot tell the format from its columns ({', '.join(sorted(cols)) or 'none'}). Expected "
        "`instruction`/`output` (alpaca), `conversations` (sharegpt), `messages` (openai), `prompt` with "
        "`completion` or `chosen`/`rejected` (TRL style), or `text` (pretraining); or register the file in "
        "dataset_info.json with a `columns` mapping."
    )


def kto_tag_column(attr: DatasetAttr) -> str:
    """The column flagging a KTO row desirable: registry `columns: {kto_tag: ...}`, else TRL's `label`."""
    return attr.column("kto_tag") or "label"


def check_columns(attr: DatasetAttr, formatting: str, columns: list[str], kind: str, stage: str, source: str) -> None:
    """Stop at once when a dataset lacks the columns the stage needs (e.g. SFT data given to `stage: rm`).

    Raises:
        DataError: naming the missing columns and what to do.
    """
    cols = set(columns)

    def need(required: list[Optional[str]], what: str, fix: str) -> None:
        missing = [c for c in required if c and c not in cols]
        if missing:
            raise DataError(
                f"{source}: stage {stage} needs {what}, but the column(s) {', '.join(f'`{c}`' for c in missing)} "
                f"are missing (columns present: {', '.join(sorted(cols)) or 'none'}). {fix}"
            )

    if kind == "text":
        text_col = attr.columns.get("prompt", "text") if formatting != "text" else "text"
        need([text_col], "raw text", "Give a file with a `text` column, or map one with `columns: {prompt: ...}`.")
    elif kind == "preference":
        fix = "Use preference data (prompt + chosen/rejected) or a supervised stage (sft)."
        if formatting == "trl":
            need(["chosen", "rejected"], "preference pairs", fix)
        else:
            need([attr.column("chosen"), attr.column("rejected")], "preference pairs", fix)
            need([attr.column("prompt") if formatting == "alpaca" else attr.column("messages")], "a prompt", fix)
    elif kind in ("supervised", "unpaired"):
        fix = ("This looks like preference data: use stage rm or dpo." if {"chosen", "rejected"} & cols
               else "Map the response column in dataset_info.json `columns`.")
        if kind == "unpaired":
            fix = ("KTO trains on single replies marked desirable or not: map that column with `columns: {kto_tag: "
                   "...}` in dataset_info.json, or name it `label` (TRL's unpaired format). Pairs go to stage dpo.")
            need([kto_tag_column(attr)], "a desirable/undesirable flag per row", fix)
        if formatting == "alpaca":
            need([attr.column("prompt"), attr.column("response")], "prompt and response columns", fix)
        elif formatting == "trl":
            need(["prompt", "completion"], "prompt and completion columns", fix)
        else:
            need([attr.column("messages")], "conversations", fix)
    elif kind == "prompt":
        fix = "Give a `prompt` column, alpaca `instruction`, or `messages`."
        if formatting == "alpaca":
            need([attr.column("prompt")], "prompts", fix)
        elif formatting == "trl":
            need(["prompt"], "prompts", fix)
        else:
            need([attr.column("messages")], "prompts", fix)


# ---------------------------------------------------------------------------------------------- values
def _text(value: Any, field_name: str, *, allow_empty: bool = False) -> str:
    """Text content of a field; openai-style content parts (`[{"type": "text", "text": ...}]`) are joined, and
    TRL's image parts (`{"type": "image"}`) become the `<image>` placeholder the row's `images` fill."""
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        parts = []
        for i, part in enumerate(value):
            if part.get("type") == "image":
                parts.append(IMAGE_PLACEHOLDER)
                continue
            if part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                raise RowError(f"{field_name}[{i}]", f"only text content parts are supported, got {describe_value(part)}")
            parts.append(part["text"])
        value = "".join(parts)
    if not isinstance(value, str):
        raise RowError(field_name, f"expected text, got {describe_value(value)}.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # a JSON escape such as "\ud800" gives a lone surrogate no tokenizer takes
        raise RowError(field_name, f"holds an unpaired surrogate {value[err.start]!r} at character {err.start}; "
                                   "fix the text (a `\\uD8xx` escape needs its `\\uDCxx` partner).") from None
    if not allow_empty and not value.strip():
        raise RowError(field_name, "is empty; expected non-empty text.")
    return value


def _optional_text(row: dict, column: Optional[str]) -> Optional[str]:
    if not column or row.get(column) is None:
        return None
    value = _text(row[column], column, allow_empty=True)
    return value if value.strip() else None


def _tools(row: dict, column: Optional[str]) -> Optional[str]:
    """A row's tool signatures as JSON text, checked to be one JSON object or a list of them."""
    if not column or row.get(column) in (None, "", []):
        return None
    value = row[column]
    try:
        text = _text(value, column, allow_empty=True) if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        parse_tools(text)
    except (TypeError, ValueError, RecursionError):  # not JSON, a JSON scalar, or a parquet cell of bytes, a date, a NaN ...
        raise RowError(column, "expected tool signatures as JSON (an object or a list of objects with `name`, "
                               f"`description`, `parameters`), got {describe_value(value)}.") from None
    return text


def _function_call(value: Any, field_name: str) -> dict[str, Any]:
    """A `function_call` turn → an assistant message with `tool_calls` (content "").

    The turn's content is JSON: `{"name": ..., "arguments": {...}}` or a list of them (parallel calls);
    `arguments` may also be JSON text of an object, as OpenAI writes it.
    """
    try:
        calls = json.loads(_text(value, field_name))
    except (ValueError, RecursionError):
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls:
        raise RowError(field_name, 'a function call must be JSON {"name": ..., "arguments": {...}} (or a list of '
                                   f"them), got {describe_value(value)}.")
    tool_calls = []
    for call in calls:
        arguments = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            raise RowError(field_name, "each function call needs a `name` (text) and `arguments` (an object), got "
                                       f"{describe_value(call)}.")
        tool_calls.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
    return {"role": "assistant", "content": "", "tool_calls": tool_calls}


def _required(row: dict, column: str) -> Any:
    if column not in row:
        raise RowError(column, "is missing from this row.")
    return row[column]


# ---------------------------------------------------------------------------------------------- alpaca
def _alpaca_prompt(row: dict, attr: DatasetAttr) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    system = _optional_text(row, attr.column("system"))
    if system:
        messages.append({"role": "system", "content": system})
    history_col = attr.column("history")
    history = row.get(history_col) if history_col else None
    if history:
        if not isinstance(history, list):
            raise RowError(history_col, f"expected a list of [question, answer] pairs, got {describe_value(history)}.")
        for i, pair in enumerate(history):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise RowError(f"{history_col}[{i}]", f"expected a [question, answer] pair, got {describe_value(pair)}.")
            messages.append({"role": "user", "content": _text(pair[0], f"{history_col}[{i}][0]")})
            messages.append({"role": "assistant", "content": _text(pair[1], f"{history_col}[{i}][1]")})
    prompt_col = attr.column("prompt")
    instruction = _text(_required(row, prompt_col), prompt_col, allow_empty=True)
    query = _optional_text(row, attr.column("query"))
    content = "\n".join(part for part in (instruction, query) if part and part.strip())
    if not content.strip():
        raise RowError(prompt_col, "the prompt (instruction + input) is empty.")
    messages.append({"role": "user", "content": content})
    return messages


def _alpaca_used_columns(attr: DatasetAttr) -> set[str]:
    return {attr.column(k) for k in ("prompt", "query", "system", "history", "tools")} - {None}


# ---------------------------------------------------------------------------------------------- messages
def _messages(value: Any, field_name: str, attr: DatasetAttr, *, system: Optional[str]) -> list[dict[str, str]]:
    """Validate sharegpt/openai messages: optional leading system, then user-side and assistant-side turns
    alternating (user/observation at even positions, assistant/function_call at odd ones)."""
    if not isinstance(value, list) or not value:
        raise RowError(field_name, f"expected a non-empty list of messages, got {describe_value(value)}.")
    role_tag, content_tag = attr.tag("role_tag"), attr.tag("content_tag")
    user_side = {attr.tag("user_tag"): "user", attr.tag("observation_tag"): "tool"}
    assistant_side = {attr.tag("assistant_tag"): "assistant", attr.tag("function_tag"): "assistant"}
    system_tag = attr.tag("system_tag")
    out: list[dict[str, str]] = []
    if system:
        out.append({"role": "system", "content": system})
    turn = 0
    for i, message in enumerate(value):
        where = f"{field_name}[{i}]"
        if not isinstance(message, dict):
            raise RowError(where, f"expected a message object, got {describe_value(message)}.")
        if role_tag not in message or content_tag not in message:
            raise RowError(where, f"expected keys `{role_tag}` and `{content_tag}`, got {sorted(message)}. "
                                  "Set `tags` in dataset_info.json if your messages use other key names.")
        role = message[role_tag]
        if not isinstance(role, str):
            raise RowError(f"{where}.{role_tag}", f"expected a role name, got {describe_value(role)}.")
        if i == 0 and role == system_tag:
            if not out:
                out.append({"role": "system", "content": _text(message[content_tag], f"{where}.{content_tag}")})
            continue
        expected = user_side if turn % 2 == 0 else assistant_side
        if role not in expected:
            known = set(user_side) | set(assistant_side) | {system_tag}
            if role not in known:
                raise RowError(f"{where}.{role_tag}", f"unknown role {role!r}; expected one of "
                                                      f"{', '.join(sorted(map(str, known)))}.")
            raise RowError(f"{where}.{role_tag}", f"role {role!r} is out of order: expected "
                                                  f"{' or '.join(map(repr, expected))} (turns must alternate "
                                                  "user/assistant after an optional leading system message).")
        if role == attr.tag("function_tag"):
            out.append(_function_call(message[content_tag], f"{where}.{content_tag}"))
        else:
            out.append({"role": expected[role], "content": _text(message[content_tag], f"{where}.{content_tag}")})
        turn += 1
    return out


def _response_message(value: Any, field_name: str, attr: DatasetAttr) -> str:
    """A chosen/rejected reply: a string, one message object, or a one-message list."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        content_key = attr.tag("content_tag") if attr.tag("content_tag") in value else "content"
        if content_key not in value:
            raise RowError(field_name, f"expected a message with `{attr.tag('content_tag')}`, got {sorted(value)}.")
        return _text(value[content_key], f"{field_name}.{content_key}")
    return _text(value, field_name)


def _trl_messages(value: Any, field_name: str) -> list[dict[str, str]]:
    """TRL-style prompt: a string (one user turn) or a list of role/content messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": _text(value, field_name)}]
    if not isinstance(value, list) or not value:
        raise RowError(field_name, f"expected text or a list of messages, got {describe_value(value)}.")
    attr = DatasetAttr(name="", load_from="file", path="", formatting="openai")
    return _messages(value, field_name, attr, system=None)


# ---------------------------------------------------------------------------------------------- convert
def convert_row(row: dict, attr: DatasetAttr, formatting: str, kind: str) -> dict[str, Any]:
    """Turn one source row into the canonical example of `kind`.

    Args:
        row: the raw row (column → value).
        attr: where the row comes from and its column/tag mapping.
        formatting: `alpaca`, `sharegpt`, `openai`, `trl` or `text` (resolved, never `auto`).
        kind: `text`, `supervised`, `preference`, `unpaired` or `prompt` (see DATA_KINDS).

    Raises:
        RowError: the row is malformed; the loader adds the file and row number.
    """
    if not isinstance(row, dict):
        raise RowError(None, f"expected an object (one example), got {describe_value(row)}.")
    if kind == "text":
        column = "text" if formatting == "text" else attr.columns.get("prompt", "text")
        return {"text": _text(_required(row, column), column)}
    if kind == "unpaired":
        return _convert_unpaired(row, attr, formatting)
    if formatting == "alpaca":
        return _convert_alpaca(row, attr, kind)
    if formatting in ("sharegpt", "openai"):
        return _convert_messages(row, attr, kind)
    if formatting == "trl":
        return _convert_trl(row, kind)
    raise RowError(None, f"formatting {formatting!r} cannot give {kind} examples.")


def _margin(row: dict, column: str = "margin") -> Optional[float]:
    value = row.get(column)
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        margin = float(value)  # csv cells arrive as text
    except (TypeError, ValueError, OverflowError):
        raise RowError(column, f"expected a number, got {describe_value(value)}.") from None
    if not math.isfinite(margin):
        raise RowError(column, f"expected a finite number, got {describe_value(value)}.")
    return margin


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _kto_tag(row: dict, column: str) -> bool:
    """A row's desirable flag: a JSON boolean, 0/1, or true/false text (CSV cells arrive as text)."""
    value = _required(row, column)
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise RowError(column, f"expected true (desirable) or false (undesirable), got {describe_value(value)}.")


def _convert_unpaired(row: dict, attr: DatasetAttr, formatting: str) -> dict[str, Any]:
    """One KTO example: the prompt turns, the reply, and whether the reply is desirable."""
    desirable = _kto_tag(row, kto_tag_column(attr))
    if formatting == "trl":
        return {"prompt": _trl_messages(_required(row, "prompt"), "prompt"), "tools": None, "desirable": desirable,
                "completion": _response_message(_required(row, "completion"), "completion", _OPENAI)}
    # alpaca and sharegpt/openai rows: the supervised conversation, whose last turn is the reply.
    example = _convert_alpaca(row, attr, "supervised") if formatting == "alpaca" else \
        _convert_messages(row, attr, "supervised")
    messages = example["messages"]
    return {"prompt": messages[:-1], "tools": example["tools"], "desirable": desirable,
            "completion": messages[-1]["content"]}


def _convert_alpaca(row: dict, attr: DatasetAttr, kind: str) -> dict[str, Any]:
    prompt = _alpaca_prompt(row, attr)
    tools = _tools(row, attr.column("tools"))
    if kind == "supervised":
        column = attr.column("response")
        reply = _text(_required(row, column), column)
        return {"messages": prompt + [{"role": "assistant", "content": reply}], "tools": tools}
    if kind == "preference":
        chosen_col, rejected_col = attr.column("chosen"), attr.column("rejected")
        return {"prompt": prompt, "tools": tools, "margin": _margin(row),
                "chosen": _response_message(_required(row, chosen_col), chosen_col, attr),
                "rejected": _response_message(_required(row, rejected_col), rejected_col, attr)}
    used = _alpaca_used_columns(attr)
    return {"prompt": prompt, "tools": tools, "conversational": False,
            "extra": {k: v for k, v in row.items() if k not in used}}


def _convert_messages(row: dict, attr: DatasetAttr, kind: str) -> dict[str, Any]:
    column = attr.column("messages")
    system = _optional_text(row, attr.column("system"))
    messages = _messages(_required(row, column), column, attr, system=system)
    tools = _tools(row, attr.column("tools"))
    ends_with_assistant = messages[-1]["role"] == "assistant"
    if kind == "supervised":
        if not ends_with_assistant:
            raise RowError(column, "the conversation ends with a user turn; the last message must be the "
                                   "assistant's reply (or use it as preference/RL prompt data).")
        return {"messages": messages, "tools": tools}
    if kind == "preference":
        if ends_with_assistant:
            raise RowError(column, "for preference data the conversation must end with a user turn; the "
                                   "replies go in `chosen` and `rejected`.")
        chosen_col, rejected_col = attr.column("chosen"), attr.column("rejected")
        return {"prompt": messages, "tools": tools, "margin": _margin(row),
                "chosen": _response_message(_required(row, chosen_col), chosen_col, attr),
                "rejected": _response_message(_required(row, rejected_col), rejected_col, attr)}
    prompt = messages[:-1] if ends_with_assistant else messages
    if not any(m["role"] == "user" for m in prompt):
        raise RowError(column, "no user turn is left to use as the prompt.")
    used = {column, attr.column("system"), attr.column("tools")}
    return {"prompt": prompt, "tools": tools, "extra": {k: v for k, v in row.items() if k not in used}}


def _convert_trl(row: dict, kind: str) -> dict[str, Any]:
    if kind == "preference" and "prompt" not in row:
        return _implicit_prompt_pair(row)
    prompt = _trl_messages(_required(row, "prompt"), "prompt")
    if kind == "supervised":
        return {"messages": prompt + [{"role": "assistant", "content": _response_message(
            _required(row, "completion"), "completion", _OPENAI)}], "tools": None}
    if kind == "preference":
        return {"prompt": prompt, "tools": None, "margin": _margin(row),
                "chosen": _response_message(_required(row, "chosen"), "chosen", _OPENAI),
                "rejected": _response_message(_required(row, "rejected"), "rejected", _OPENAI)}
    return {"prompt": prompt, "tools": None, "conversational": not isinstance(row["prompt"], str),
            "extra": {k: v for k, v in row.items() if k != "prompt"}}


def _implicit_prompt_pair(row: dict) -> dict[str, Any]:
    """TRL's implicit-prompt pairs: `chosen`/`rejected` are whole conversations sharing the prompt turns."""
    chosen = _trl_messages(_required(row, "chosen"), "chosen")
    rejected = _trl_messages(_required(row, "rejected"), "rejected")
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        raise RowError("chosen", "without a `prompt` column, chosen and rejected must be conversations "
                                 "ending with an assistant reply.")
    if chosen[:-1] != rejected[:-1]:
        raise RowError("rejected", "without a `prompt` column, chosen and rejected must share every turn "
                                   "but the last.")
    return {"prompt": chosen[:-1], "tools": None, "margin": _margin(row),
            "chosen": chosen[-1]["content"], "rejected": rejected[-1]["content"]}
