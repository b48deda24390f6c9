"""`completions.jsonl`: the one rollout record of every online stage (GRPO, PPO, and any that follows).

With `log_completions: true` each generation round appends one line per completion to `output_dir/completions.jsonl`:

```
{"step": 3, "prompt": ..., "completion": ..., "reward": 1.5, "rewards": {"accuracy": 1.0, "format": 0.5},
 "advantage": 0.707}
```
- `step` (1-based): the optimizer step (GRPO) or PPO step whose update first trains on the completion, i.e.
  `global_step + 1` when it was generated. A generation batch that GRPO trains over several steps carries the
  step of its first one.
- `prompt`, `completion`: in TRL's shapes, as the reward functions received them (a string, or a list of
  messages for a conversational row).
- `reward`: the weighted sum of the reward functions (`alignkit.rewards.combine_rewards`); null when every
  function returned None for the row.
- `rewards`: each reward function's value by its name (`RewardFunctions.names`), null where it returned None.
- `advantage`: the completion's advantage when the stage's estimator gives one per completion (GRPO's group
  normalisation); null for a per-token estimator (PPO's GAE).
Non-finite numbers are written as null (`alignkit.jsonl`), so the file is strict JSON.

The file is written by the main process with every process's rows, in the order of the global batch
(`CompletionLog.append` gathers them), and it follows the run's checkpoints: when training begins,
`CompletionLog.on_train_begin` drops the rows of steps past the step the run resumes from (a killed run logged
them, and the resumed run generates them again) and, starting afresh (`overwrite_output_dir`, or no checkpoint),
the whole file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from transformers import TrainerCallback

from ..callbacks import truncate_log
from ..jsonl import append_jsonl

COMPLETIONS_FILE = "completions.jsonl"


def _number(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


def completion_records(
    step: int,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    reward_names: Sequence[str],
    per_function: torch.Tensor,
    rewards: torch.Tensor,
    advantages: Optional[torch.Tensor] = None,
) -> list[dict[str, Any]]:
    """The `completions.jsonl` records of N completions (see the module docstring for the schema).

    Args:
        step: the 1-based step the completions are trained in first.
        prompts, completions: N each, in TRL's shapes.
        reward_names: F names, one per column of `per_function`.
        per_function: `[N, F]` each function's reward, NaN where it returned None.
        rewards: `[N]` the weighted sum, NaN where every function returned None.
        advantages: `[N]` one advantage per completion, or None (a per-token estimator).

    Example: step 1, one prompt "p" with completion "c", names ["a", "b"], per_function [[1, NaN]],
    rewards [1], advantages [0.5] -> `[{"step": 1, "prompt": "p", "completion": "c", "reward": 1.0,
    "rewards": {"a": 1.0, "b": None}, "advantage": 0.5}]`.
    """
    per_function, rewards = per_function.detach().cpu().tolist(), rewards.detach().cpu().tolist()
    advantage_list = advantages.detach().cpu().tolist() if advantages is not None else [None] * len(rewards)
    return [{"step": step, "prompt": prompt, "completion": completion, "reward": _number(reward),
             "rewards": {name: _number(value) for name, value in zip(reward_names, row)},
             "advantage": advantage}
            for prompt, completion, row, reward, advantage in zip(prompts, completions, per_function, rewards,
                                                                  advantage_list)]


class CompletionLog(TrainerCallback):
    """`output_dir/completions.jsonl`: cut back to the resumed step when training begins, appended each round.

    Add it to the trainer's callbacks (the online base trainer does); `append` is called by every process with
    its own records.
    """

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            # Rows of steps past the checkpoint are generated again; a fresh run (global_step 0) starts a fresh file.
            truncate_log(args.output_dir, state.global_step, COMPLETIONS_FILE, "step")

    @staticmethod
    def append(output_dir: str, records: list[dict[str, Any]], accelerator) -> None:
        """Write every process's `records` (gathered in process order, i.e. the global batch's order) from the
        main process. Every process must call it (the gather is a collective)."""
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            records = gather_object(records)
        if accelerator.is_main_process:
            append_jsonl(Path(output_dir) / COMPLETIONS_FILE, records)


__all__ = ["COMPLETIONS_FILE", "completion_records", "CompletionLog"]
