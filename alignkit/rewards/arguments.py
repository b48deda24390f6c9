"""The reward keys the online stages share (`RewardFunctionArguments`), checked without importing torch.

A stage's keys subclass it (GRPO, RLOO, PPO, online DPO); its checks are syntax only (a malformed `module:function`,
a misspelt built-in, weights that do not match), so `alignkit train` runs them before torch loads
(`alignkit.config.keytable.check_config_early`). Building the functions is `alignkit.rewards.functions`'s.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from ..errors import ConfigError
from .builtin import BUILTIN_NAMES, DEFAULT_FORMAT_PATTERN


@dataclass
class RewardFunctionArguments:
    """Reward keys shared by the online stages (GRPO, PPO subclass this)."""

    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Reward functions, a list or comma-separated: built-in `accuracy`, `format`, `length`; "
            "`package.module:function`; `path/to/file.py:function` (relative to the config file's folder, then "
            "the current directory); or a reward model directory written by `stage: rm`."
        },
    )
    reward_weights: Optional[list[float]] = field(
        default=None,
        metadata={"help": "One weight per reward function (default: all 1.0); the reward is their weighted sum."},
    )
    log_completions: bool = field(
        default=False,
        metadata={"help": "Append each prompt, completion and its rewards to `completions.jsonl` in output_dir."},
    )
    format_reward_pattern: str = field(
        default=DEFAULT_FORMAT_PATTERN,
        metadata={
            "help": "`format` reward: regex the whole completion (stripped of surrounding whitespace) must match, "
            "with `.` matching newlines. Default: one `<think>...</think>` block followed by an answer."
        },
    )
    length_reward_max_tokens: Optional[int] = field(
        default=None,
        metadata={"help": "`length` reward: L_max in tokens (default: the stage's `max_completion_length`)."},
    )
    length_reward_window: Optional[int] = field(
        default=None,
        metadata={
            "help": "`length` reward: completions longer than L_max - window are penalised linearly, down to -1 "
            "at L_max (DAPO's soft overlong penalty). Default: a fifth of L_max (DAPO used 4096 of 20480)."
        },
    )
    length_reward_truncated: float = field(
        default=-1.0,
        metadata={"help": "`length` reward: the reward of a completion cut off at L_max before it stopped."},
    )
    reward_model_type: Literal["auto", "lora", "full"] = field(
        default="auto",
        metadata={
            "help": "How a reward model in reward_funcs is loaded. `lora`: an rm run's LoRA adapter as a second "
            "adapter on the policy's base (no second copy of the base; needs finetuning_type lora and the RM's "
            "base); `full`: on its own; `auto`: `lora` when possible, else `full`."
        },
    )
    reward_timeout: Optional[float] = field(
        default=300.0,
        metadata={
            "help": "Seconds one call of a user reward function (`module:function`, `file.py:function`) may take; "
            "a call that takes longer stops the run with an error naming the function and the rows it was scoring, "
            "and the last checkpoint resumes. The call runs in a worker thread, which Python cannot stop: it is "
            "left behind and the process exits. Generous by default, so that a slow judge or code runner over a "
            "whole batch never trips it. 0 or null: no limit, the call runs in the training thread (for a "
            "function that installs signal handlers, which only the main thread may do). Built-ins and reward "
            "models are not timed."
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.reward_funcs, str):
            self.reward_funcs = [s.strip() for s in self.reward_funcs.split(",") if s.strip()]
        self.reward_funcs = [str(s).strip() for s in self.reward_funcs]
        for spec in self.reward_funcs:
            _check_spec_syntax(spec)
        if self.reward_weights is not None:
            weights = self.reward_weights
            if isinstance(weights, str):
                weights = [w for w in weights.split(",") if w.strip()]
            try:
                self.reward_weights = [float(w) for w in weights]
            except (TypeError, ValueError):
                raise ConfigError(f"reward_weights={weights!r}: give one number per reward function.") from None
            if len(self.reward_weights) != len(self.reward_funcs):
                raise ConfigError(f"reward_weights has {len(self.reward_weights)} values but reward_funcs has "
                                  f"{len(self.reward_funcs)} ({', '.join(self.reward_funcs) or 'none'}); give one "
                                  "weight per function.")
            bad = [w for w in self.reward_weights if not math.isfinite(w)]
            if bad:
                raise ConfigError(f"reward_weights holds {bad[0]}; weights must be finite numbers.")
        if self.length_reward_max_tokens is not None and self.length_reward_max_tokens < 1:
            raise ConfigError(f"length_reward_max_tokens={self.length_reward_max_tokens} must be >= 1.")
        if self.length_reward_window is not None and self.length_reward_window < 1:
            raise ConfigError(f"length_reward_window={self.length_reward_window} must be >= 1.")
        if self.reward_timeout is not None and not (math.isfinite(self.reward_timeout) and self.reward_timeout >= 0):
            raise ConfigError(f"reward_timeout={self.reward_timeout} must be a number of seconds >= 0 (0 or null: no "
                              "limit).")
        if not math.isfinite(self.length_reward_truncated):
            raise ConfigError(f"length_reward_truncated={self.length_reward_truncated} must be a finite number.")
        try:
            import re

            re.compile(self.format_reward_pattern)
        except re.error as err:
            raise ConfigError(f"format_reward_pattern={self.format_reward_pattern!r} is not a valid regular "
                              f"expression: {err}.") from None


def _check_spec_syntax(spec: str) -> None:
    """Catch a malformed `module:function` and a misspelt built-in (`acuracy`) before anything loads."""
    if not spec:
        raise ConfigError("reward_funcs holds an empty entry; remove it.")
    if ":" in spec:
        target, _, function = spec.rpartition(":")
        if not target or not function.isidentifier():
            raise ConfigError(f"reward_funcs: {spec!r} is not `package.module:function` or `path/to/file.py:function`"
                              " (the part after the last ':' must be a function name).")
        return
    if spec in BUILTIN_NAMES or "/" in spec or os.sep in spec or Path(spec).exists():
        return
    # Any other bare word may be a reward model folder beside the config file (checked when the functions
    # are built); one that is close to a built-in's name is almost surely a typo.
    close = difflib.get_close_matches(spec, BUILTIN_NAMES, n=1, cutoff=0.6)
    if close:
        raise ConfigError(f"reward_funcs: {spec!r} is not a built-in ({', '.join(BUILTIN_NAMES)}). Did you mean "
                          f"`{close[0]}`?")


def require_reward_funcs(args: RewardFunctionArguments, stage: Optional[str] = None) -> None:
    """Raise a ConfigError when `reward_funcs` is empty (a stage's `check_config` calls it, before the model loads).

    Args:
        args: the stage's arguments (a `RewardFunctionArguments` subclass).
        stage: the stage that needs the rewards, named in the message when given.
    """
    if not args.reward_funcs:
        needs = f"stage {stage} needs reward_funcs" if stage else "reward_funcs is empty"
        raise ConfigError(f"{needs}: give at least one reward function or reward model folder, e.g. "
                          "`reward_funcs: accuracy,format` (built-ins: " + ", ".join(BUILTIN_NAMES) + ").")


__all__ = ["RewardFunctionArguments", "require_reward_funcs"]
