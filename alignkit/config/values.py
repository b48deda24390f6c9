"""YAML and command-line values converted to a config field's type (`int`, `float`, `bool`, `Literal`, lists,
mappings, `Optional`), with a `ConfigError` naming the key when a value does not fit.

Used by the config parser for every key, and by `alignkit eval` for its reward keys given on the command line.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Literal

import yaml

from ..errors import ConfigError


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation, for the fields a dataclass takes in `__init__`."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _allowed(tp: Any) -> list[Any]:
    """Flatten Optional/Union annotations into their member types."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        out: list[Any] = []
        for arg in typing.get_args(tp):
            out.extend(_allowed(arg))
        return out
    return [tp]


def convert_value(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML or command-line value to the field's type `tp`, or raise a ConfigError naming `key`.

    Example: `convert_value("lora_rank", "8", int)` is 8; `convert_value("lora_rank", "x", int)` raises
    `ConfigError("lora_rank='x' is not a valid int (invalid literal for int() with base 10: 'x').")`.
    """
    allowed = _allowed(tp)
    if value is None:
        if type(None) in allowed or Any in allowed:
            return None
        raise ConfigError(f"{key}: null is not allowed; give a value of type {_type_name(tp)}.")
    if isinstance(value, str) and type(None) in allowed:
        # `null`/`~` always mean None; `none` only where a string is not itself a valid value
        # (`report_to: none` is transformers' word for "no integrations", not a missing value).
        if value.lower() in ("null", "~") or (value.lower() == "none" and str not in allowed):
            return None
    last_error = None
    for candidate in allowed:
        if candidate is type(None):
            continue
        try:
            return _convert_one(value, candidate)
        except (TypeError, ValueError) as err:
            last_error = err
    detail = f" ({last_error})" if last_error and str(last_error) else ""
    raise ConfigError(f"{key}={value!r} is not a valid {_type_name(tp)}{detail}.")


def _convert_one(value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        raise ValueError(f"choose one of {', '.join(map(str, choices))}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value).value if not isinstance(value, tp) else value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        raise ValueError("expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            return int(value)
        raise ValueError("expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError("expected a number")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError("expected a string")
        return str(value)
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            return list(value)
        raise ValueError("expected a list")
    if origin is dict or tp is dict:
        if isinstance(value, dict):
            return value
        if isinstance(value, str):
            parsed = yaml.safe_load(value)
            if isinstance(parsed, dict):
                return parsed
        raise ValueError("expected a mapping")
    return value


def _type_name(tp: Any) -> str:
    names = []
    for t in _allowed(tp):
        if t is type(None):
            continue
        if typing.get_origin(t) is Literal:
            names.append("one of " + ", ".join(map(str, typing.get_args(t))))
        else:
            names.append(getattr(t, "__name__", str(t)))
    return " or ".join(names)


def parse_override(text: str) -> tuple[str, Any]:
    """Split one `key=value` command-line override; the value stays a string unless it is YAML-structured."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. learning_rate=1e-4).")
    key, value = text.split("=", 1)
    key = key.strip().lstrip("-").replace("-", "_")
    if not key:
        raise ConfigError(f"override {text!r} has no key before '='.")
    stripped = value.strip()
    if stripped.startswith(("{", "[")):
        try:
            return key, yaml.safe_load(stripped)
        except yaml.YAMLError as err:
            raise ConfigError(f"{key}: cannot parse {value!r}: {err}") from None
    return key, value


__all__ = ["convert_value", "field_types", "parse_override"]
