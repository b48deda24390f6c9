"""Every config key and its type as a table read without importing torch, for the checks `alignkit train` makes first.

The config's dataclasses cannot all be imported cheaply: the training section subclasses transformers'
`Seq2SeqTrainingArguments` (which imports torch), and the full parse imports every stage module. That takes
seconds, so a misspelt key or a bad value would keep a user waiting that long for a one-line error. The model,
data, fine-tuning and generation sections (`alignkit.config.sections`) and every stage's own keys
(`alignkit.stages.arguments`) import neither, so the early check builds them, runs alignkit's checks of the
training keys over transformers' defaults (recorded here) and the checks of those sections with the stage, for the
same errors as the parse's. `keys.json`, next to this module, records what the parser needs to find those errors: each
section's keys with their types, the stage names, and the `--help-keys` text. It is generated from the live
dataclasses (`python -m alignkit.config.keytable`), and `tests/unit/test_key_table.py` fails when it no longer
matches them.

The table names the transformers releases whose keys it holds (every release it was generated with whose keys
came out the same); with another release installed it is not used and every check waits for the full parse,
which finds the same errors. The early check is a subset of the full
parse: it raises only what the parse would raise (through the same functions, `alignkit.config.values`), and a
type it cannot write down (an enum, a class) accepts any value here and is checked by the parse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import types
import typing
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Literal, Optional

from ..errors import ConfigError
from ..files import load_yaml
from .values import assign_keys, check_stage_name, key_owners, merge_overrides, other_stage_keys_error

TABLE_FILE = Path(__file__).with_name("keys.json")
# The modules whose config classes the early check builds: they import neither torch nor transformers (a test checks).
TORCH_FREE_MODULES = ("alignkit.config.sections", "alignkit.stages.arguments")
_SCALARS = {"bool": bool, "int": int, "float": float, "str": str, "list": list, "dict": dict,
            "none": type(None), "any": Any}


def type_spec(tp: Any) -> Any:
    """A field's type as JSON: a scalar's name, `list`, `dict`, `{"literal": [...]}`, `{"list": {"literal": [...]}}`
    (a list of choices) or `{"union": [...]}`.

    Anything else (an enum, a class) is `any`: the early check lets every value through and the parse checks it.
    """
    if tp is type(None):
        return "none"
    if tp in (bool, int, float, str):
        return tp.__name__
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return {"union": [type_spec(arg) for arg in typing.get_args(tp)]}
    if origin is Literal:
        choices = typing.get_args(tp)
        if all(choice is None or isinstance(choice, (bool, int, float, str)) for choice in choices):
            return {"literal": list(choices)}
        return "any"
    if origin in (list, tuple) or tp in (list, tuple):
        element = type_spec(typing.get_args(tp)[0]) if typing.get_args(tp) else "any"
        return {"list": element} if isinstance(element, dict) and "literal" in element else "list"
    if origin is dict or tp is dict:
        return "dict"
    return "any"


def type_from_spec(spec: Any) -> Any:
    """The type `convert_value` checks a value against, from `type_spec`'s JSON."""
    if isinstance(spec, str):
        return _SCALARS[spec]
    if "literal" in spec:
        return Literal[tuple(spec["literal"])]
    if "list" in spec:
        return list[type_from_spec(spec["list"])]
    members = tuple(type_from_spec(member) for member in spec["union"])
    return typing.Union[members] if len(members) > 1 else members[0]


def build_key_table() -> dict[str, Any]:
    """The table from the live dataclasses (imports torch, transformers and every stage module)."""
    from ..stages import STAGES
    from .parse import TRANSFORMERS_TRAINING_GROUP, _stage_argument_classes, all_keys
    from .schema import ARG_CLASSES, DataArguments, FinetuningArguments, TrainingArguments
    from .values import field_types

    stage_classes = _stage_argument_classes()
    classes = []
    for cls in (*ARG_CLASSES, *dict.fromkeys(stage_classes.values())):
        classes.append({"name": f"{cls.__module__}.{cls.__qualname__}",
                        "stages": [name for name, stage_cls in stage_classes.items() if stage_cls is cls],
                        "fields": {key: type_spec(tp) for key, tp in field_types(cls).items()}})
    help_groups = all_keys()
    # `--help-keys` prints transformers' own keys by name only (their help is transformers' documentation).
    help_groups[TRANSFORMERS_TRAINING_GROUP] = dict.fromkeys(help_groups[TRANSFORMERS_TRAINING_GROUP], "")
    return {"transformers": [importlib.metadata.version("transformers")], "stages": list(STAGES),
            "default_stage": FinetuningArguments.stage, "default_dataset_dir": DataArguments.dataset_dir,
            "data_class": f"{DataArguments.__module__}.{DataArguments.__qualname__}",
            "data_kinds": {name: stage.data_kind for name, stage in STAGES.items()},
            "training_class": f"{TrainingArguments.__module__}.{TrainingArguments.__qualname__}",
            "training_defaults": _scalar_defaults(TrainingArguments),
            "classes": classes, "help": help_groups}


def _scalar_defaults(cls: type) -> dict[str, Any]:
    """A dataclass's fields whose default is a JSON scalar (a string, number, bool or None), name -> default: what
    the early check overlays the given training keys on (`check_training_values` reads some of them)."""
    import enum

    defaults = {}
    for f in dataclasses.fields(cls):
        value = f.default
        if isinstance(value, enum.Enum):
            value = value.value
        if f.init and (value is None or isinstance(value, (bool, int, float, str))):
            defaults[f.name] = value
    return defaults


def load_key_table() -> Optional[dict[str, Any]]:
    """The committed table, or None when it is missing or none of its transformers releases is the installed one."""
    try:
        table = json.loads(TABLE_FILE.read_text(encoding="utf-8"))
        installed = importlib.metadata.version("transformers")
    except (OSError, ValueError, importlib.metadata.PackageNotFoundError):
        return None
    return table if installed in table.get("transformers", ()) else None


def same_keys(table: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two tables hold the same keys, types, stages and help (the transformers releases aside)."""
    return {**table, "transformers": None} == {**other, "transformers": None}


def check_config_early(path: str, overrides: list[str], table: dict[str, Any]) -> None:
    """Raise what `read_config(path, overrides)` would raise for an unknown key, a value of the wrong type, an
    unknown stage, another stage's key, a bad value of the model, data, fine-tuning, generation, training or stage
    keys or a key the stage has no use for (`_check_values_early`), or a dataset that does not exist, without
    importing torch.

    Raises:
        ConfigError: an unknown key, a value that does not fit, an unknown stage, another stage's key, a value a
            section or the stage refuses, or a key the stage has no use for (the parse's messages).
        DataError: a `dataset` / `eval_dataset` that is not a file, a registry name or a hub id (the loader's).
    """
    merged, from_command_line = merge_overrides(load_yaml(path), overrides)
    stage = str(merged.get("stage", table["default_stage"]))
    classes = [(entry["name"], {key: type_from_spec(spec) for key, spec in entry["fields"].items()})
               for entry in table["classes"]]
    preferred = next((entry["name"] for entry in table["classes"] if stage in entry["stages"]), None)
    owners = key_owners(classes, preferred)
    per_class = assign_keys(merged, owners, dict(classes), from_command_line, f" in {path}", stage)
    try:
        check_stage_name(stage, table["stages"])
    except ConfigError as err:
        raise ConfigError(f"{err} ({path})") from None
    for entry in table["classes"]:  # another stage's keys (`num_generations` with stage sft), in the parse's order
        if entry["stages"] and stage not in entry["stages"] and per_class.get(entry["name"]):
            raise other_stage_keys_error(sorted(per_class[entry["name"]]), entry["stages"][0], stage, f" in {path}")
    _check_values_early(per_class, table, stage, path, merged)
    data = per_class.get(table["data_class"], {})
    tokenized = data.get("tokenized_path")
    if tokenized and Path(tokenized).is_dir():
        return  # the saved tokens are loaded and the dataset keys ignored (`alignkit.data.loader.get_dataset`)
    from ..data.loader import resolve_datasets

    for key in ("dataset", "eval_dataset"):
        if data.get(key):
            resolve_datasets(data[key], data.get("dataset_dir", table["default_dataset_dir"]))


def _check_values_early(per_class: dict[str, dict[str, Any]], table: dict[str, Any], stage: str, path: str,
                        given: dict[str, Any]) -> None:
    """Raise what the parse's dataclasses raise for a bad value where they can run without torch: the sections of
    `alignkit.config.sections` and the run's stage keys (`alignkit.stages.arguments`) built from their keys, and
    `check_training_values` on the training keys given over transformers' defaults (as `TrainingArguments` runs it,
    after the parse's own defaults and its `do_eval` rule); then the checks of `check_combinations` that read only
    those sections and the stage (`check_section_combinations`, `check_generation_keys`), and the stage keys' own
    part of the stage's `check_config` (the online stages: training only, with a reward and whole generation groups:
    `check_run`). The rest of
    `check_combinations` and of a stage's `check_config`, and transformers' own checks, stay with the parse."""
    import importlib

    from . import sections

    built: dict[str, Any] = {}
    own_keys: set[str] = set()
    method_name = None
    for entry in table["classes"]:
        module, _, name = entry["name"].rpartition(".")
        keys = per_class.get(entry["name"], {})
        if stage in entry["stages"]:
            own_keys, method_name = set(entry["fields"]), name
        if module in TORCH_FREE_MODULES and (not entry["stages"] or stage in entry["stages"]):
            try:
                with _quiet():  # the parse logs what the classes log; here only their errors count
                    built[name] = getattr(importlib.import_module(module), name)(**keys)
            except ConfigError as err:
                raise ConfigError(f"{err} ({path})") from None
            except (ValueError, TypeError) as err:
                raise ConfigError(f"invalid {name} settings in {path}: {err}") from None
        elif entry["name"] == table.get("training_class") and "training_defaults" in table:
            sections.check_warmup_keys(keys, f" in {path}")
            try:
                sections.check_training_values(_training_view(keys, table, given))
            except ConfigError as err:
                raise ConfigError(f"{err} ({path})") from None
            except (AttributeError, TypeError):  # a default the table lacks, or an odd value: the parse decides
                pass
    data_kind = table.get("data_kinds", {}).get(stage)
    parts = ("ModelArguments", "DataArguments", "FinetuningArguments", "GeneratingArguments")
    if data_kind is None or not all(part in built for part in parts):
        return
    # As `check_combinations` raises them: without the file's name.
    sections.check_section_combinations(built["ModelArguments"], built["DataArguments"], built["FinetuningArguments"],
                                        data_kind)
    sections.check_generation_keys(stage, data_kind, own_keys, given, built["GeneratingArguments"])
    method = built.get(method_name) if method_name else None
    if method is not None and hasattr(method, "check_run"):  # what its check_config refuses from it and the mode
        try:
            method.check_run(stage, _training_view(per_class.get(table.get("training_class", ""), {}), table, given))
        except (AttributeError, TypeError):  # a default the table lacks, or an odd value: the parse decides
            pass


def _training_view(keys: dict[str, Any], table: dict[str, Any], given: dict[str, Any]) -> SimpleNamespace:
    """The training keys as the parse hands them to `TrainingArguments`, and the mode it then runs in: the keys given
    over transformers' defaults (the table's) and the parse's own (`TRAINING_DEFAULTS`); `do_train` on for a config
    silent on `do_train`, `do_eval` and `do_predict` (`read_config`); `eval_strategy` off for `do_eval: false` (the
    parse) and `do_eval` on for any other eval strategy (transformers)."""
    from .sections import TRAINING_DEFAULTS

    values = {**table.get("training_defaults", {}), **TRAINING_DEFAULTS, **keys}
    if not {"do_train", "do_eval", "do_predict"} & set(given):
        values["do_train"] = True
    if keys.get("do_eval") is False:
        values["eval_strategy"] = "no"
    values["do_eval"] = bool(values.get("do_eval")) or str(values.get("eval_strategy", "no")) != "no"
    return SimpleNamespace(**values)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Logging and warnings off for the duration (the early check builds classes the parse builds again)."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _release_order(release: str) -> list[tuple[int, int, str]]:
    """Sort key of a release string: numeric parts as numbers ("5.9.0" before "5.24.0"), others ("0rc1") after."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in release.split(".")]


def write_key_table() -> Path:
    """Regenerate `keys.json` from the live dataclasses; run after changing a config key or upgrading transformers.

    Where the committed table holds the same keys, the installed release joins its list, so one table serves
    every release it was checked with; otherwise the new table names the installed release alone.
    """
    table = build_key_table()
    try:
        committed = json.loads(TABLE_FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        committed = None
    if committed is not None and isinstance(committed.get("transformers"), list) and same_keys(committed, table):
        table["transformers"] = sorted(set(committed["transformers"]) | set(table["transformers"]),
                                       key=_release_order)
    TABLE_FILE.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return TABLE_FILE


if __name__ == "__main__":  # pragma: no cover
    print(f"wrote {write_key_table()}")


__all__ = ["TABLE_FILE", "build_key_table", "check_config_early", "load_key_table", "same_keys", "type_from_spec",
           "type_spec", "write_key_table"]
