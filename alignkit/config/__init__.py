"""The run's configuration: the schema here, the parser in `alignkit.config.parse`.

- `schema`: the argument dataclasses (`ModelArguments`, `DataArguments`, `FinetuningArguments`,
  `GeneratingArguments`, `TrainingArguments`) and `Config`, each checking its own fields. A low floor: model,
  data, reward and stage modules import it.
- `values`: a YAML or command-line value converted to a field's type (`convert_value`, `field_types`), and one
  `key=value` override split (`parse_override`).
- `parse`: YAML + `key=value` overrides to a checked `Config` (`parse_config`, `read_config`, `all_keys`,
  `check_combinations`). It reads the stage registry (`alignkit.stages.STAGES`: which stages and keys exist,
  what each refuses), so it sits above the stages and is not imported here: importing this package from
  a stage must not import the stages. Import it as `from alignkit.config.parse import parse_config`.

The names below are imported on first use (PEP 562 `__getattr__`): the schema subclasses transformers'
`Seq2SeqTrainingArguments`, which imports torch, so importing this package (as `alignkit.config.values` does
on the way) must not load it. The CLI reads a config file and its overrides, and prints its help, before torch
is imported.

Errors are `alignkit.errors.ConfigError`.
"""

from __future__ import annotations

from typing import Any

_SCHEMA_NAMES = ("ARG_CLASSES", "BUNDLED_MODEL_NAME", "TRAINING_DEFAULTS", "Config", "DataArguments",
                 "FinetuningArguments", "GeneratingArguments", "ModelArguments", "TrainingArguments",
                 "check_sampling_knobs")
_VALUES_NAMES = ("convert_value", "field_types")


def __getattr__(name: str) -> Any:
    if name in _SCHEMA_NAMES:
        from . import schema as module
    elif name in _VALUES_NAMES:
        from . import values as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


__all__ = sorted(_SCHEMA_NAMES + _VALUES_NAMES)
