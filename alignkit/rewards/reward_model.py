"""A reward model from its folder: the output_dir of a `stage: rm` run (LoRA or full) or an exported one.

Two ways to hold one:

- on its own (`load_reward_model`, `reward_model_arguments`): `AutoModelForSequenceClassification` with one
  label, from a full or exported RM, or from an rm run's LoRA output, whose adapter and score head are merged
  into the base its `adapter_config.json` names, after the adapters its `base_adapters.json` records (an RM
  trained from an SFT adapter scores on base + SFT). This is what `alignkit score` and
  `reward_model_type: full` use; it costs a copy of the base;
- as a named adapter on the policy's base (`load_reward_adapter`): the rm run's LoRA weights loaded
  unmerged and frozen beside the policy's adapter, its trained score head a separate frozen `nn.Linear`,
  switched in only to score (`alignkit.model.adapters.use_adapter`, `alignkit.rewards.scoring`). No second
  copy of the base is made.

The base-chain check: a reward adapter applies its LoRA deltas to whatever base is in memory, so its rewards
equal the rm run's own (`alignkit score`) only on the base it was trained on: the raw model for an RM trained
without `adapter_name_or_path`, base + SFT for one trained from the SFT adapter. `reward_base_mismatch` compares
the chain the RM recorded (`base_adapters.json`, `loader.read_base_adapters`) with the adapters merged into the
policy's base, and `load_reward_adapter` refuses a mismatch; such a reward model is loaded on its own instead
(`alignkit.rewards.model`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import FinetuningArguments, ModelArguments
from ..errors import ConfigError
from ..model.adapters import as_peft_model, requires_grad_kept
from ..model.loader import (REWARD_HEADS, check_adapter_base, is_reward_adapter, merged_adapters, read_adapter_config,
                            read_base_adapters, same_adapters)
from ..model.weight_files import ADAPTER_WEIGHT_FILES, WEIGHT_FILES

logger = logging.getLogger(__name__)

# The name a reward model's adapter gets on the policy's PEFT model.
REWARD_ADAPTER = "reward"


def check_reward_model_dir(model_dir: str | os.PathLike, key: str | None = None) -> None:
    """Refuse a folder that is not a reward model before anything loads: the one check of every entry point.

    A causal-LM folder loads as `AutoModelForSequenceClassification` without complaint: transformers initialises
    the missing `score` head at random (its load report says `score.weight MISSING`) and every score is noise.
    So the folder's weights must hold the trained head: a full or exported RM its `score.weight` (or
    `classifier.weight`) in its weights file or shard index; an rm run's LoRA output, a reward adapter (task_type
    SEQ_CLS or `score` in modules_to_save) whose saved weights hold the head (or whose local base's weights do: a
    LoRA over a full RM). Only tensor names are read (safetensors headers, shard indexes), no weights. A folder
    whose weights cannot be read here is left to the loader, which names what is wrong with them.

    Args:
        model_dir: the reward model's folder.
        key: the config key or flag that named it, put first in the message (e.g. `reward_model`).

    Raises:
        ConfigError: not a directory, an adapter that is not a reward model's, or no trained score head; the
            message names the folder and how to train a reward model.
    """
    prefix = f"{key}: " if key else ""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise ConfigError(f"{prefix}reward model {str(model_dir)!r} is not a directory; give an rm run's output_dir "
                          "(or an exported reward model).")
    if (folder / "adapter_config.json").is_file():
        if not is_reward_adapter(folder):
            raise ConfigError(f"{prefix}reward model {str(model_dir)!r} holds an adapter without a score head "
                              "(task_type SEQ_CLS); give the output_dir of a `stage: rm` run.")
        problem = _adapter_head_problem(folder)
    else:
        problem = _head_problem(folder, WEIGHT_FILES)
    if problem:
        raise ConfigError(f"{prefix}reward model {model_dir} has no trained score head: {problem}, so it would score "
                          "with a randomly initialised head. Train a reward model with `stage: rm` (e.g. `alignkit "
                          "train examples/rm_lora.yaml`) and give its output_dir, or an `alignkit export` of it.")


def _adapter_head_problem(adapter_dir: Path) -> str | None:
    problem = _head_problem(adapter_dir, ADAPTER_WEIGHT_FILES)
    if problem is None:
        return None
    # A SEQ_CLS LoRA over a full reward model need not save the head: the base brings it.
    base = read_adapter_config(adapter_dir).get("base_model_name_or_path")
    if base and Path(base).is_dir() and _head_problem(Path(base), WEIGHT_FILES) is None:
        return None
    saved = read_adapter_config(adapter_dir).get("modules_to_save")
    return f"{problem} (modules_to_save: {saved}), and its base {base} has none either"


def _head_problem(folder: Path, weight_files: tuple[str, ...]) -> str | None:
    """What says `folder`'s weights hold no score head, or None when they hold one (or cannot be read here)."""
    names = None
    for name in weight_files:
        if (folder / name).is_file():
            names = _tensor_names(folder / name)
            break
    if names is None or any(_is_head_weight(n) for n in names):
        return None
    architectures = _read_json(folder / "config.json").get("architectures") or []
    kind = f"; it is a {', '.join(map(str, architectures))}" if architectures else ""
    return f"its weights ({name}) hold no `score.weight`{kind}"


def _is_head_weight(tensor_name: str) -> bool:
    parts = tensor_name.split(".")
    return len(parts) >= 2 and parts[-2] in REWARD_HEADS and parts[-1] == "weight"


def _tensor_names(path: Path) -> set[str] | None:
    """The tensor names a weights file or shard index lists, or None when it cannot be read (damaged)."""
    try:
        if path.name.endswith(".index.json"):
            return set(json.loads(path.read_text(encoding="utf-8"))["weight_map"])
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return set(f.keys())
        return set(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except Exception:  # noqa: BLE001 - a damaged file is the loader's to report, with its own message
        return None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def reward_model_arguments(model_dir: str | os.PathLike, like: ModelArguments | None = None) -> ModelArguments:
    """`ModelArguments` that load the reward model an rm run wrote to `model_dir` (or an exported one).

    A LoRA output dir names its base in `adapter_config.json` and becomes `adapter_name_or_path` over it
    (`load_model` then merges the adapters its `base_adapters.json` records first, e.g. the SFT adapter an
    RM was trained from); any other dir is a full model. dtype, attention kernel, cache and remote-code settings come from
    `like` (the running stage's model arguments) when given.

    Raises:
        ConfigError: `model_dir` is not a reward model's folder (`check_reward_model_dir`).
    """
    from dataclasses import replace

    check_reward_model_dir(model_dir)
    model_dir = str(model_dir)
    base_args = like if like is not None else ModelArguments()
    if (Path(model_dir) / "adapter_config.json").is_file():
        base = read_adapter_config(model_dir).get("base_model_name_or_path")
        return replace(base_args, model_name_or_path=base, adapter_name_or_path=model_dir)
    return replace(base_args, model_name_or_path=model_dir, adapter_name_or_path=None)


def load_reward_model(model_dir: str | os.PathLike, like: ModelArguments | None = None):
    """A reward model on its own (`reward_model_type: full`, `alignkit score`): frozen, eval mode.

    `AutoModelForSequenceClassification` with one label, from a full rm output dir, an exported one, or a
    LoRA rm output dir (its adapter and score head merged into the base it names, after the adapters its
    `base_adapters.json` records, so it scores as in training). Score it with
    `alignkit.rewards.scoring.sequence_rewards`.

    Args:
        model_dir: the reward model's directory.
        like: the running stage's `ModelArguments`, for dtype, attention kernel and hub settings.
    """
    # Looked up at call time, as the stages do: tests stand in for `loader.load_model` to prove nothing loads early.
    from ..model.loader import load_model

    return load_model(reward_model_arguments(model_dir, like), FinetuningArguments(), is_trainable=False,
                      head="reward")


@dataclass
class RewardAdapter:
    """A reward model held as a named adapter on a shared base, plus its score head.

    Attributes:
        name: the adapter's name in the PEFT model.
        head: the frozen score head (`nn.Linear(hidden, 1)`, in the model's dtype and device).
        adapter_dir: where it was loaded from.
    """

    name: str
    head: nn.Linear
    adapter_dir: str


def _split_head_weights(adapter_dir: str, weights: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Split the adapter's saved tensors into (LoRA tensors, score-head tensors keyed `weight`/`bias`).

    PEFT saves a `modules_to_save` head under its module path without the adapter name, e.g.
    `base_model.model.score.weight` (checked on peft 0.21.2).
    """
    lora, head = {}, {}
    for key, tensor in weights.items():
        parts = key.split(".")
        if len(parts) >= 2 and parts[-2] in REWARD_HEADS and parts[-1] in ("weight", "bias"):
            head[parts[-1]] = tensor
        else:
            lora[key] = tensor
    if "weight" not in head:
        raise ConfigError(
            f"reward_model: {adapter_dir} holds no score head weights (expected a key ending in `score.weight`); "
            "give the output_dir of an rm run with finetuning_type=lora."
        )
    return lora, head


def reward_base_mismatch(model: nn.Module, adapter_dir: str | os.PathLike) -> str | None:
    """Why the reward adapter in `adapter_dir` would score wrongly on `model`'s base, or None when it fits.

    It fits when the adapters it was trained over (its `base_adapters.json`; none when absent) are the
    adapters merged into `model`'s base (`loader.merged_adapters`), in the same order.
    """
    trained_on, policy_has = read_base_adapters(adapter_dir), merged_adapters(model)
    if same_adapters(trained_on, policy_has):
        return None

    def describe(chain: tuple[str, ...]) -> str:
        return "the base + " + " + ".join(chain) if chain else "the bare base"

    return (f"{adapter_dir} was trained on {describe(trained_on)}, the policy's base is {describe(policy_has)} "
            "(adapter_name_or_path)")


def load_reward_adapter(
    model: nn.Module, adapter_dir: str | os.PathLike, *, name: str = REWARD_ADAPTER, check_base: bool = True
) -> RewardAdapter:
    """Load an rm run's LoRA output as a frozen, unmerged adapter `name` beside the policy's adapter.

    The adapter's LoRA weights go into the policy's PEFT model (the active adapter stays active and its
    `requires_grad` untouched); its trained score head becomes a separate frozen `nn.Linear`. Its LoRA
    dropout is set to 0 so that scoring gives the same numbers in train and eval mode.

    Args:
        model: the policy, a causal-LM `PeftModel` (from `load_model(..., is_trainable=True)` with LoRA).
        adapter_dir: what `alignkit train examples/rm_lora.yaml` wrote (adapter_config task_type SEQ_CLS,
            `score` in modules_to_save), or one of its checkpoint dirs.
        name: the adapter's name; must not be taken.
        check_base: refuse an adapter trained over other merged adapters than the policy's base holds
            (`reward_base_mismatch`): its scores would not be the reward model's. False where the weights are
            only a starting point (PPO's trainable critic); the mismatch is then logged.

    Returns:
        The `RewardAdapter` (name, head, dir) to score with `alignkit.rewards.scoring.reward_adapter_rewards`.

    Raises:
        ConfigError: not a reward adapter, trained on another base (another model, or other merged adapters
            with `check_base`), extra full modules besides the head, or weights that do not fit the model.
    """
    from peft import PeftConfig
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    peft_model = as_peft_model(model)
    adapter_dir = str(adapter_dir)
    adapter_cfg = read_adapter_config(adapter_dir)
    if not is_reward_adapter(adapter_dir):
        raise ConfigError(f"reward_model: {adapter_dir} is not a reward-model adapter (task_type SEQ_CLS with a "
                          "`score` head); give the output_dir of an rm run.")
    if name in peft_model.peft_config:
        raise ConfigError(f"reward_model: an adapter named {name!r} is already loaded; choose another name.")
    check_adapter_base(peft_model, adapter_dir, adapter_cfg, head="reward")
    # peft lists its classification heads' names in every sequence-classification adapter's modules_to_save, whether
    # the model has such a module or not (peft 0.22 added DistilBERT's `pre_classifier`): a name that matches no module
    # of the model trained nothing.
    module_names = [n for n, _ in peft_model.base_model.model.named_modules()]
    extra = sorted(m for m in set(adapter_cfg.get("modules_to_save") or []) - set(REWARD_HEADS)
                   if any(n == m or n.endswith("." + m) for n in module_names))
    if extra:
        raise ConfigError(f"reward_model: {adapter_dir} also trains {extra} in full (additional_target); only "
                          "a reward adapter whose sole full module is its score head can share the policy's base. "
                          "Load it on its own (reward_model_type: full).")
    mismatch = reward_base_mismatch(peft_model, adapter_dir)
    if mismatch and check_base:
        raise ConfigError(f"reward_model: {mismatch}; as an adapter on the policy's base it would not score as the "
                          "reward model does. Load it on its own (reward_model_type: full or auto).")
    if mismatch:
        logger.info("Adapter %r starts from the reward model's weights, on another base: %s.", name, mismatch)

    config = PeftConfig.from_pretrained(adapter_dir)
    # On a causal LM the head lives outside the PEFT model, and the adapter is frozen: no dropout.
    config.task_type = peft_model.peft_config[peft_model.active_adapters[0]].task_type
    config.modules_to_save = None
    config.lora_dropout = 0.0
    config.inference_mode = True
    lora_weights, head_weights = _split_head_weights(adapter_dir, load_peft_weights(adapter_dir, device="cpu"))
    with requires_grad_kept(peft_model):  # add_adapter leaves the new adapter frozen; make sure nothing else moves
        peft_model.add_adapter(name, config)
    try:
        result = set_peft_model_state_dict(peft_model, lora_weights, adapter_name=name)
    except (RuntimeError, ValueError) as err:
        peft_model.delete_adapter(name)
        raise ConfigError(f"reward_model: cannot load {adapter_dir} onto {peft_model.config.name_or_path}: "
                          f"{str(err).strip().splitlines()[0]} Set model_name_or_path to the RM's base.") from None
    missing = [k for k in result.missing_keys if f".{name}." in k or k.endswith(f".{name}")]
    if missing or result.unexpected_keys:
        peft_model.delete_adapter(name)
        raise ConfigError(f"reward_model: {adapter_dir} does not fit the model: {len(missing)} adapter tensors "
                          f"missing (e.g. {missing[:1]}), unexpected {result.unexpected_keys[:1]}.")
    for param_name, param in peft_model.named_parameters():
        if f".{name}." in param_name:
            param.requires_grad_(False)

    weight = head_weights["weight"]
    reference = next(peft_model.parameters())
    head = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in head_weights,
                     dtype=reference.dtype, device=reference.device)
    with torch.no_grad():
        head.weight.copy_(weight)
        if head.bias is not None:
            head.bias.copy_(head_weights["bias"])
    head.requires_grad_(False)
    head.eval()
    logger.info("Loaded the reward adapter %s as %r (unmerged, frozen) with its score head.", adapter_dir, name)
    return RewardAdapter(name=name, head=head, adapter_dir=str(Path(adapter_dir)))


__all__ = [
    "REWARD_ADAPTER",
    "RewardAdapter",
    "check_reward_model_dir",
    "load_reward_adapter",
    "load_reward_model",
    "reward_base_mismatch",
    "reward_model_arguments",
]
