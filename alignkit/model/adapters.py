"""Named adapters on one base model: switch one in, or switch them all off, without touching what trains.

LoRA PPO (and GRPO with a reward model) keeps one base model in memory for every role:

- policy: the trainable adapter "default" (`POLICY_ADAPTER`) that `load_model(..., is_trainable=True)` adds;
- reference: the same model with every adapter disabled (`adapters_disabled`). An SFT adapter given as
  `adapter_name_or_path` was merged into the base weights by `load_model` (`loader.merged_adapters`
  lists it), so the reference is base + SFT adapter and the policy is that + "default";
- further named adapters switched in for a block (`use_adapter`): a reward model's adapter, loaded by
  `alignkit.rewards.reward_model.load_reward_adapter` and scored by `alignkit.rewards.scoring`, or PPO's
  critic adapter.

Switching is what PEFT's `set_adapter` does, plus what it should not: it marks the newly active adapter
trainable and every other adapter frozen (peft 0.21.2, `BaseTunerLayer.set_adapter`), and leaving
`disable_adapter()` re-marks the active adapter trainable. So both context managers here record every
parameter's `requires_grad` on entry and restore it on exit (`requires_grad_kept`, also when the body
raises): the policy's trainable set is the same before and after a scoring pass, and a frozen adapter stays
frozen.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

# The adapter `load_model(..., is_trainable=True)` trains; PEFT's default name.
POLICY_ADAPTER = "default"


def as_peft_model(model: nn.Module):
    """The `PeftModel` inside a DDP / DataParallel wrapper (or `model` itself).

    Raises:
        TypeError: it is not a PEFT model (the policy was not loaded under LoRA).
    """
    from peft import PeftModel

    inner = getattr(model, "module", model)  # DDP / DataParallel
    if not isinstance(inner, PeftModel):
        raise TypeError(
            f"{type(inner).__name__} is not a PEFT model: named adapters need the policy loaded with "
            "finetuning_type=lora (a reward model on a full or frozen policy is loaded on its own instead)."
        )
    return inner


@contextmanager
def requires_grad_kept(model: nn.Module) -> Iterator[None]:
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
    peft_model = as_peft_model(model)
    if name not in peft_model.peft_config:
        raise KeyError(f"no adapter named {name!r}; loaded adapters: {sorted(peft_model.peft_config)}.")
    if getattr(peft_model, "_adapters_disabled", False):
        raise RuntimeError(f"use_adapter({name!r}) inside a block with every adapter disabled would score the base.")
    previous_attr, previous = peft_model.active_adapter, list(peft_model.active_adapters)
    with requires_grad_kept(peft_model):
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
    peft_model = as_peft_model(model)
    with requires_grad_kept(peft_model), peft_model.disable_adapter():
        yield


__all__ = [
    "POLICY_ADAPTER",
    "as_peft_model",
    "requires_grad_kept",
    "use_adapter",
    "adapters_disabled",
]
