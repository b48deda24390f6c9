"""Reward models as reward functions: an rm run's output scoring (prompt, completion) pairs.

Two ways to hold one (`reward_model_type`):

- `lora`: the rm run's LoRA adapter and score head loaded as a named, frozen second adapter on the
  policy's PeftModel (`reward_model.load_reward_adapter`) and switched in only while scoring
  (`scoring.reward_adapter_rewards`, which switches back and restores every `requires_grad`). No second copy
  of the base is made. It needs the policy under LoRA and the RM trained on the same base: the same model,
  and the same adapters merged into it (the RM's `base_adapters.json` against the policy's
  `adapter_name_or_path`, `reward_model.reward_base_mismatch`).
- `full`: the reward model loaded on its own (`scoring.RewardScorer`, the scorer of `alignkit score`,
  with the adapters the RM was trained over merged first): a full or exported RM, an RM on another base,
  or a policy that is not a PeftModel. It costs a second copy of the base in memory.
- `auto` (default): `lora` when the directory holds a reward adapter and the policy is a PeftModel on a
  base the adapter fits, else `full`, with a log line saying why and what it costs.

Either way the text is rendered as `alignkit score` renders it (`scoring.encode_scored`: the
prompt, a user message when it is a string, then the completion as the assistant reply closed by the
template's end of turn), so a reward equals `alignkit score` on the same text.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from ..data.collator import padding_token_id
from ..data.template import ChatFormatter
from ..errors import ConfigError
from ..files import resolve_config_path
from ..model.loader import is_reward_adapter, resolve_dtype
from .builtin import completion_text
from .reward_model import REWARD_ADAPTER, check_reward_model_dir, load_reward_adapter, reward_base_mismatch
from .scoring import RewardScorer, encode_scored, reward_adapter_rewards, score_sequences

logger = logging.getLogger(__name__)

# Sequences per scoring forward pass.
SCORING_BATCH_SIZE = 8


def resolve_reward_model_dir(spec: str, config_dir: Optional[str] = None, key: str = "reward_funcs") -> Path:
    """The reward model directory a spec names: absolute, or relative to the config file's folder, then cwd.

    Args:
        spec: the folder as given.
        config_dir: the config file's folder.
        key: the key that gave it, for the message: `reward_model` (PPO's, only ever a folder), or
            `reward_funcs` (`--reward` for `alignkit eval`), where a spec may also be a function.

    Raises:
        ConfigError: no such folder; the message names the key and each place looked at.
    """
    try:
        return resolve_config_path(spec, config_dir, directory=True)
    except FileNotFoundError as err:
        if key == "reward_model":
            raise ConfigError(f"reward_model: no folder {spec!r} ({err}). Give the output_dir of a `stage: rm` "
                              "run.") from None
        raise ConfigError(f"{key}: {spec!r} is not a built-in, a `module:function`, a `file.py:function`, nor a "
                          f"reward model directory ({err}). Give the output_dir of a `stage: rm` run.") from None


def _as_prompt(prompt: Any) -> Any:
    """TRL's prompt shapes to what `encode_scored` takes: a string (one user turn) or a list of messages."""
    if isinstance(prompt, (str, list)):
        return prompt
    raise TypeError(f"a prompt must be a string or a list of messages, got {type(prompt).__name__}.")


class AdapterRewardModel:
    """A reward adapter on the policy's base, scored with the run's template.

    Args:
        policy: the PeftModel holding the adapter.
        reward: what `load_reward_adapter` returned.
        formatter: the run's `ChatFormatter`.
        name: metric name.
    """

    def __init__(self, policy, reward, formatter: ChatFormatter, name: str) -> None:
        self.policy = policy
        self.reward = reward
        self.formatter = formatter
        self.name = name
        self.__name__ = name

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        sequences = [encode_scored(self.formatter, _as_prompt(p), completion_text(c))
                     for p, c in zip(prompts, completions, strict=True)]
        return score_sequences(lambda ids, mask: reward_adapter_rewards(self.policy, self.reward, ids, mask),
                               sequences, padding_token_id(self.formatter.tokenizer),
                               next(self.policy.parameters()).device,
                               batch_size=SCORING_BATCH_SIZE)


class FullRewardModel:
    """A reward model loaded on its own: `alignkit score`'s scorer, called with TRL's signature."""

    def __init__(self, scorer, name: str) -> None:
        self.scorer = scorer
        self.name = name
        self.__name__ = name

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return self.scorer.score([_as_prompt(p) for p in prompts], [completion_text(c) for c in completions])


def _is_peft_model(model) -> bool:
    from peft import PeftModel

    return isinstance(getattr(model, "module", model), PeftModel)


def _free_adapter_name(model) -> str:
    taken = set(getattr(model, "module", model).peft_config)
    name, n = REWARD_ADAPTER, 1
    while name in taken:
        n += 1
        name = f"{REWARD_ADAPTER}_{n}"
    return name


def load_reward_function(spec: str, args, *, model=None, formatter: Optional[ChatFormatter] = None,
                         model_args=None, config_dir: Optional[str] = None):
    """A reward function (TRL's signature, with `.name`) scoring with the reward model at `spec`.

    Args:
        spec: the reward model directory (an rm run's output_dir or an exported reward model).
        args: `RewardFunctionArguments` (`reward_model_type`).
        model: the policy; a PeftModel lets a LoRA reward adapter share its base.
        formatter: the run's `ChatFormatter`; its template renders the scored text.
        model_args: the run's `ModelArguments` (dtype, attention kernel) for a model loaded on its own.
        config_dir: folder of the config file, for relative directories.

    Raises:
        ConfigError: not a directory, not a reward model with a trained score head (`check_reward_model_dir`),
            `reward_model_type: lora` where it cannot apply, or an adapter that does not fit the policy.
    """
    model_dir = resolve_reward_model_dir(spec, config_dir)
    check_reward_model_dir(model_dir)  # a folder without a trained score head would score with a random one
    name = model_dir.name
    kind = getattr(args, "reward_model_type", "auto")
    is_adapter = (model_dir / "adapter_config.json").is_file() and is_reward_adapter(model_dir)
    if kind == "lora":
        if not is_adapter:
            raise ConfigError(f"reward_model_type=lora but {model_dir} is not an rm run's LoRA adapter; use "
                              "reward_model_type: full (or auto).")
        if model is None or not _is_peft_model(model):
            raise ConfigError(f"reward_model_type=lora needs the policy under LoRA (finetuning_type: lora) to share "
                              f"its base with {model_dir}; use reward_model_type: full (or auto).")
    if formatter is None:
        raise ValueError("a reward model needs the run's ChatFormatter (formatter=...) to render the scored text.")
    why_alone = None
    if kind != "full" and is_adapter and model is not None and _is_peft_model(model):
        # A reward adapter on another base than the one it was trained on scores something else: load it with
        # its own base then (explicit `lora` gets load_reward_adapter's error instead).
        why_alone = reward_base_mismatch(model, model_dir) if kind == "auto" else None
        if why_alone is None:
            try:
                reward = load_reward_adapter(model, model_dir, name=_free_adapter_name(model))
            except ConfigError as err:
                if kind == "lora":
                    raise
                why_alone = f"it does not fit the policy's base as an adapter ({err})"
            else:
                logger.info("Reward model %s: LoRA adapter %r on the policy's base.", model_dir, reward.name)
                return AdapterRewardModel(model, reward, formatter, name)

    device = next(model.parameters()).device if model is not None else None
    template = None if formatter.name == "tokenizer" else formatter.name
    scorer = RewardScorer(model_dir, template=template, batch_size=SCORING_BATCH_SIZE,
                          device=str(device) if device is not None else None)
    if model_args is not None and model_args.infer_dtype != "auto":
        scorer.model.to(resolve_dtype(model_args.infer_dtype))
    if why_alone is None:
        logger.info("Reward model %s loaded on its own.", model_dir)
    else:
        size = sum(p.numel() * p.element_size() for p in scorer.model.parameters())
        logger.warning("Reward model %s loaded on its own, not as an adapter on the policy's base: %s. That costs "
                       "a second copy of the base model in memory (%.1f MB); an RM trained with the policy's "
                       "adapter_name_or_path would share the policy's base instead.", model_dir, why_alone,
                       size / 2**20)
    return FullRewardModel(scorer, name)


__all__ = ["AdapterRewardModel", "FullRewardModel", "load_reward_function", "resolve_reward_model_dir"]
