"""Reading the small structured files a user writes (configs, `dataset_info.json`, JSONL rows) and finding the
files a config names, with errors that say where.

Both were written out at each place that needed them; a second floor above `errors` so that the config
parser, the data layer, `alignkit score`, the reward loaders and the board use one wording.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from .errors import ConfigError

TOP_LEVEL_MAPPING = "the top level must be a mapping of key: value"


def parse_mapping(text: str, where: str, *, syntax: Literal["yaml", "json"] = "yaml",
                  error: type[Exception] = ConfigError, expected: str = TOP_LEVEL_MAPPING,
                  hint: str = "") -> dict[str, Any]:
    """Parse YAML or JSON text whose top level must be a mapping, raising `error` with `where` in the message.

    An empty YAML text is an empty mapping (an empty config file sets nothing).

    Args:
        text: the file's (or one JSONL line's) decoded text.
        where: what the text is, for messages: a path, `path line N`, `the config`.
        syntax: `yaml` or `json`.
        error: the exception raised (`ConfigError` for configs, `DataError` for data files).
        expected: the message's statement of what the top level must be.
        hint: appended to a syntax error's message (how to fix it).

    Raises:
        error: `{where}: not valid YAML: ...` / `{where}: invalid JSON at line L column C (...)` (at column C
            for a one-line text), or `{where}: {expected}, got {type}.`

    Example: `parse_mapping("[1]", "x.yaml")` raises `ConfigError("x.yaml: the top level must be a mapping
    of key: value, got list.")`.
    """
    suffix = f" {hint}" if hint else ""
    if syntax == "yaml":
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise error(f"{where}: not valid YAML: {err}{suffix}") from None
        data = {} if data is None else data
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            at = f"column {err.colno}" if "\n" not in text.strip() else f"line {err.lineno} column {err.colno}"
            raise error(f"{where}: invalid JSON at {at} ({err.msg}).{suffix}") from None
    if not isinstance(data, dict):
        raise error(f"{where}: {expected}, got {type(data).__name__}.")
    return data


def resolve_config_path(text: str, config_dir: Optional[str], *, directory: bool = False) -> Path:
    """The file (or folder) a config names: absolute as given; relative, beside the config file first, then in
    the current directory.

    Args:
        text: the path as written in the config (`~` expanded).
        config_dir: the config file's folder (None: the config came from no file).
        directory: look for a folder instead of a file.

    Returns:
        The first candidate that exists, resolved.

    Raises:
        FileNotFoundError: none exists; the message is `looked at A and B` for the caller to put in its own.
    """
    path = Path(text).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = ([Path(config_dir) / path] if config_dir else []) + [Path.cwd() / path]
    for candidate in candidates:
        if candidate.is_dir() if directory else candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError("looked at " + " and ".join(dict.fromkeys(str(c) for c in candidates)))  # a folder once


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML config into a flat mapping, with errors that name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist.")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p}: byte {err.start} (0x{err.object[err.start]:02x}) is not UTF-8; save the file "
                          "as UTF-8.") from None
    return parse_mapping(text, str(p))


__all__ = ["TOP_LEVEL_MAPPING", "load_yaml", "parse_mapping", "resolve_config_path"]
