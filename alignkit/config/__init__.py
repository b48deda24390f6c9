"""The run's configuration: the schema here, the parser in `alignkit.config.parse`.

- `schema`: the argument dataclasses (`ModelArguments`, `DataArguments`, `FinetuningArguments`,
  `GeneratingArguments`, `TrainingArguments`) and `Config`, each checking its own fields. A low floor: model,
  data, reward and stage modules import it.
- `values`: a YAML or command-line value converted to a field's type (`convert_value`, `field_types`).
- `parse`: YAML + `key=value` overrides to a checked `Config` (`parse_config`, `read_config`, `all_keys`,
  `check_combinations`). It reads the stage registry (`alignkit.stages.STAGES`: which stages and keys exist,
  what each refuses), so it sits above the stages and is not imported here: importing this package from
  a stage must not import the stages. Import it as `from alignkit.config.parse import parse_config`.

Errors are `alignkit.errors.ConfigError`.
"""

from .schema import (
    ARG_CLASSES,
    BUNDLED_MODEL_NAME,
    TRAINING_DEFAULTS,
    Config,
    DataArguments,
    FinetuningArguments,
    GeneratingArguments,
    ModelArguments,
    TrainingArguments,
    check_sampling_knobs,
)
from .values import convert_value, field_types

__all__ = ["ARG_CLASSES", "BUNDLED_MODEL_NAME", "TRAINING_DEFAULTS", "Config", "DataArguments", "FinetuningArguments",
           "GeneratingArguments", "ModelArguments", "TrainingArguments", "check_sampling_knobs", "convert_value",
           "field_types"]
