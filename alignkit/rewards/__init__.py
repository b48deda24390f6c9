"""Rewards for the online stages (GRPO, PPO): built-in functions, user functions, reward models.

The contract the stages code against (docs/ARCHITECTURE.md, "Rewards"):
`RewardFunctionArguments` (the shared config keys), `build_reward_functions(args, model=, formatter=,
model_args=) -> RewardFunctions`, whose call gives `[N, F]` rewards (NaN for None), `combine_rewards`
(their weighted sum, NaN-aware as TRL), and `RewardFunctionError` for a function that fails or returns
something unusable.

Reward models live here too, imported by module (they pull in the model layer): `reward_model` loads one from
its folder (on its own, or as a named adapter on the policy's base, with the base-chain check), `scoring`
reads its scores (`RewardScorer`, `sequence_rewards`, `encode_scored`), and `model` wraps either as a reward
function.
"""

from typing import Any

from .arguments import RewardFunctionArguments, require_reward_funcs
from .builtin import BUILTIN_NAMES, accuracy_reward, extract_final_answer, format_reward, length_reward

# `functions` imports torch; its names load on first use, so that the reward keys (`arguments`) are checked
# without it (`alignkit.config.keytable.check_config_early`).
_FUNCTION_NAMES = ("RewardFunction", "RewardFunctionError", "RewardFunctions", "build_reward_functions",
                   "check_reward_functions", "combine_rewards", "load_user_function")


def __getattr__(name: str) -> Any:
    if name not in _FUNCTION_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import functions

    value = getattr(functions, name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


__all__ = [
    "BUILTIN_NAMES",
    "RewardFunction",
    "RewardFunctionArguments",
    "RewardFunctionError",
    "RewardFunctions",
    "accuracy_reward",
    "build_reward_functions",
    "check_reward_functions",
    "combine_rewards",
    "extract_final_answer",
    "format_reward",
    "length_reward",
    "load_user_function",
    "require_reward_funcs",
]
