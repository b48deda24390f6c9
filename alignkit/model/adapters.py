"""Named adapters on one base model: a frozen reward adapter beside the trainable one, switched in to score.

LoRA PPO (and GRPO with a reward model) keeps one base model in memory for every role:

- policy: the trainable adapter "default" that `load_model(..., is_trainable=True)` adds;
- reference: the same model with every adapter disabled (`adapters_disabled`). An SFT adapter given as
  `adapter_name_or_path` was merged into the base weights by `load_model` (`loader.merged_adapters`
  lists it), so the reference is base + SFT adapter and the policy is that + "default";
- reward: an rm run's LoRA output loaded *unmerged* and frozen under its own name (`load_reward_adapter`),
  with its trained score head kept as a separate frozen `nn.Linear`, and switched in only while scoring
  (`use_adapter`, `reward_adapter_rewards`).

Switching is what PEFT's `set_adapter` does, plus what it should not: it marks the newly active adapter
trainable and every other adapter frozen (peft 0.21.2, `BaseTunerLayer.set_adapter`), and leaving
`disable_adapter()` re-marks the active adapter trainable. So both context managers here record every
parameter's `requires_grad` on entry and restore it on exit (also when the body raises): the policy's
trainable set is the same before and after a scoring pass, and the reward adapter stays frozen.

A reward adapter applies its LoRA deltas to whatever base is in memory. Its rewards equal the rm run's own
(`alignkit score`) only when that base is the one the RM was trained on: the raw model for an RM trained
without `adapter_name_or_path`; base + SFT for one trained from the SFT adapter. An rm output dir records
which (`base_adapters.json`, `loader.read_base_adapters`), and `load_reward_adapter` refuses an adapter
whose recorded chain differs from the adapters merged into the policy's base (`reward_base_mismatch`);
such a reward model is loaded on its own instead (`loader.load_reward_model`, `alignkit.rewards.model`).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ..errors import ConfigError
from .heads import head_rewards
from .loader import (check_adapter_base, is_reward_adapter, merged_adapters, read_adapter_config, read_base_adapters,
                     same_adapters)

logger = logging.getLogger(__name__)

# The adapter `load_model(..., is_trainable=True)` trains; PEFT's default name.
POLICY_ADAPTER = "default"
REWARD_ADAPTER = "reward"
# Heads PEFT saves in full for a SEQ_CLS adapter (it adds both names; an architecture has one of them).
_REWARD_HEADS = ("score", "classifier")


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


def _peft_model(model: nn.Module):
    from peft import PeftModel

    inner = getattr(model, "module", model)  # DDP / DataParallel
    if not isinstance(inner, PeftModel):
        raise TypeError(
            f"{type(inner).__name__} is not a PEFT model: named adapters need the policy loaded with "
            "finetuning_type=lora (a reward model on a full or frozen policy is loaded on its own instead)."
        )
    return inner


@contextmanager
def _grad_flags_kept(model: nn.Module) -> Iterator[None]:
    """Restore every parameter's `requires_grad` on exit, whatever PEFT changed inside."""
    flags = [(param, param.requires_grad) for param in model.parameters()]
    try:
        yield
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)


@contextmanager
def use_adapter(model: nn.Module, name: str) -> Iterator[None]:
    """Make adapter `name` the only active one inside the block; switch back on exit, even on error.

    `requires_grad` of every parameter (the trainable adapter's included) is as before on exit, and
    the train/eval mode is not touched. Run scoring inside `torch.no_grad()`: the switched-in adapter is
    frozen, but the decoder's activations would still be kept for a backward pass otherwise.

    Args:
        model: a PEFT model (DDP-wrapped allowed) holding adapter `name`.
        name: the adapter to switch in.

    Raises:
        KeyError: no adapter of that name (the message lists the loaded ones).
        RuntimeError: called inside `adapters_disabled` (the switch would have no effect).
    """
    peft_model = _peft_model(model)
    if name not in peft_model.peft_config:
        raise KeyError(f"no adapter named {name!r}; loaded adapters: {sorted(peft_model.peft_config)}.")
    if getattr(peft_model, "_adapters_disabled", False):
        raise RuntimeError(f"use_adapter({name!r}) inside a block with every adapter disabled would score the base.")
    previous_attr, previous = peft_model.active_adapter, list(peft_model.active_adapters)
    with _grad_flags_kept(peft_model):
        try:
            peft_model.set_adapter(name, inference_mode=True)
            yield
        finally:
            peft_model.base_model.set_adapter(previous if len(previous) > 1 else previous[0], inference_mode=True)
            peft_model.active_adapter = previous_attr


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The reference model: every adapter off (base + merged SFT adapter), `requires_grad` kept.

    PEFT's `disable_adapter()` freezes every adapter on entry and re-marks the active one trainable on
    exit; this wrapper restores each parameter's own flag instead.
    """
    peft_model = _peft_model(model)
    with _grad_flags_kept(peft_model), peft_model.disable_adapter():
        yield


def _split_head_weights(adapter_dir: str, weights: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Split the adapter's saved tensors into (LoRA tensors, score-head tensors keyed `weight`/`bias`).

    PEFT saves a `modules_to_save` head under its module path without the adapter name, e.g.
    `base_model.model.score.weight` (checked on peft 0.21.2).
    """
    lora, head = {}, {}
    for key, tensor in weights.items():
        parts = key.split(".")
        if len(parts) >= 2 and parts[-2] in _REWARD_HEADS and parts[-1] in ("weight", "bias"):
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
        The `RewardAdapter` (name, head, dir) to score with `reward_adapter_rewards`.

    Raises:
        ConfigError: not a reward adapter, trained on another base (another model, or other merged adapters
            with `check_base`), extra full modules besides the head, or weights that do not fit the model.
    """
    from peft import PeftConfig
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    peft_model = _peft_model(model)
    adapter_dir = str(adapter_dir)
    adapter_cfg = read_adapter_config(adapter_dir)
    if not is_reward_adapter(adapter_dir):
        raise ConfigError(f"reward_model: {adapter_dir} is not a reward-model adapter (task_type SEQ_CLS with a "
                          "`score` head); give the output_dir of an rm run.")
    if name in peft_model.peft_config:
        raise ConfigError(f"reward_model: an adapter named {name!r} is already loaded; choose another name.")
    check_adapter_base(peft_model, adapter_dir, adapter_cfg, head="reward")
    extra = sorted(set(adapter_cfg.get("modules_to_save") or []) - set(_REWARD_HEADS))
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
    with _grad_flags_kept(peft_model):  # add_adapter leaves the new adapter frozen; make sure nothing else moves
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


def reward_adapter_rewards(
    model: nn.Module,
    reward: RewardAdapter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    padding_free: bool = False,
) -> torch.Tensor:
    """Score sequences with the named reward adapter and its head; the policy is switched back after.

    Runs under `torch.no_grad()`: rewards are targets for the policy, never differentiated.

    Args:
        model: the PEFT model holding `reward.name`.
        reward: what `load_reward_adapter` returned.
        input_ids: [N, L], left- or right-padded.
        attention_mask: [N, L], 1 on real tokens.
        padding_free: run the real tokens as one row.

    Returns:
        [N] float32 rewards, read at each sequence's last real token (as `heads.sequence_rewards`).
    """
    with torch.no_grad(), use_adapter(model, reward.name):
        return head_rewards(model, reward.head, input_ids, attention_mask, padding_free=padding_free)


__all__ = [
    "POLICY_ADAPTER",
    "REWARD_ADAPTER",
    "RewardAdapter",
    "use_adapter",
    "adapters_disabled",
    "load_reward_adapter",
    "reward_base_mismatch",
    "reward_adapter_rewards",
]
