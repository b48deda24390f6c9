"""`OnlineTrainer`: what every online stage (GRPO, PPO, ...) does the same way, written once.

An online stage's round is generate -> score -> advantages -> update:
- generate: `sample` draws one completion per prompt row from the policy (`rollout.sample_completions`, each
  row under the seed of its place in the round's global batch), with sharded weights (ZeRO-3, FSDP2) gathered
  once for the whole batch (`model.distributed.full_weights`, given the DeepSpeed engine);
- score: `score` puts prompts and completions in TRL's shapes and runs the reward functions and/or reward
  models (`rollout.score_completions`, float32 `[N, F]` and their weighted `[N]` sum);
- advantages: `advantages` calls the stage's estimator from the one registry
  (`rl.advantages.ADVANTAGE_ESTIMATORS[self.advantage_estimator]`);
- update: the stage's own (GRPO: the Trainer's loop over its buffered slices; PPO: its epochs over the rollout),
  with the reference of `StageTrainer.reference()` and the losses of `rl.losses` / `rl.kl`.
Around the round: `completion_records` / `write_completions` keep `completions.jsonl` (`rl.record`), whose
`CompletionLog` callback every online trainer carries, so the file follows resumes and fresh starts.

What a subclass provides: `advantage_estimator` (a registry key), its arguments dataclass, and its step.
This class sits beside `StageTrainer` rather than in `alignkit.rl`, so `rl` (the maths, the rollout pieces, the
record) never imports the stages above it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..data.multimodal import multimodal_messages, open_image
from ..model.distributed import full_weights
from ..model.generation import Generation
from ..rl.advantages import ADVANTAGE_ESTIMATORS
from ..rl.record import CompletionLog, completion_records
from ..rl.rollout import sample_completions, score_completions, trl_completions, trl_prompts
from .base import StageTrainer

# Columns the data layer adds to prompt rows for the stage itself; reward functions get every other column.
PROMPT_COLUMNS = ("input_ids", "attention_mask", "prompt_messages", "prompt_conversational")


def data_order_seed(args: Any) -> int:
    """The seed of the prompts' order: `data_seed`, else `seed`, as transformers' own samplers take it (TRL's GRPO
    takes `seed` alone; the two agree unless `data_seed` is set)."""
    return args.data_seed if args.data_seed is not None else args.seed


def has_active_dropout(*modules: torch.nn.Module) -> bool:
    """Whether any dropout layer inside `modules` drops anything (p > 0): a training forward then differs from a
    no-grad one, so it cannot stand in for it (PPO's and GRPO's rollout forwards that training reuses)."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for module in modules for m in module.modules())


class OnlineTrainer(StageTrainer):
    """A `StageTrainer` with the online round's shared parts (see the module docstring).

    Args:
        reward_functions: `alignkit.rewards.RewardFunctions` (`.names`, `.weights`, callable -> `[N, F]`), or
            None for a run that does not train.
        stop_token_ids: ids that end a completion (the template's end of turn, `ChatFormatter.stop_token_ids()`).
        log_completions: write `completions.jsonl` (`RewardFunctionArguments.log_completions`).
        *args, **kwargs: as for `StageTrainer` (`keep_reference_copy`, ...) and `transformers.Trainer`.
    """

    # The key of the stage's estimator in `ADVANTAGE_ESTIMATORS`.
    advantage_estimator: str = ""

    def __init__(self, *args, reward_functions, stop_token_ids: Sequence[int], log_completions: bool = False,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reward_functions = reward_functions
        self.stop_token_ids = list(stop_token_ids)
        self.log_completions = log_completions
        self.add_callback(CompletionLog())

    # ---- generate ----

    def sample(self, prompt_ids: Sequence[Sequence[int]], *, generation_kwargs: dict[str, Any], seed: int,
               first_row: int, seeds: Optional[Sequence[int]] = None,
               image_inputs: Optional[dict[str, Any]] = None) -> Generation:
        """One completion per prompt row of this process (`first_row`: the index of its first row in the round's
        global batch; `seeds`: each row's own seed instead, as a tool rollout's later turns give them; `image_inputs`:
        a vision-language model's pixel inputs laid out by row), the policy's sharded weights gathered once for the
        batch (a no-op without sharding, and inside a caller's own `full_weights` block)."""
        # Given the DeepSpeed engine, whose per-module hooks would otherwise release each layer after its forward.
        engine = self.model_wrapped if self.is_deepspeed_enabled else None
        # The run's autocast (a no-op without mixed precision) is entered around the whole decode, not only inside
        # the prepared model's forward, so that `packed_linears` packs bf16 copies of the weights for a bf16 run.
        with self.accelerator.autocast(), full_weights(self.model, engine) as model:
            return sample_completions(model, self.processing_class, prompt_ids, stop_token_ids=self.stop_token_ids,
                                      generation_kwargs=generation_kwargs, seed=seed, first_row=first_row,
                                      seeds=seeds, image_inputs=image_inputs)

    # ---- score ----

    def score(self, prompt_messages: Sequence[list[dict[str, str]]], conversational: Sequence[bool],
              texts: Sequence[str], columns: dict[str, list], completion_ids: list[list[int]],
              truncated: Sequence[bool], completions: Optional[list[Any]] = None,
              image_paths: Optional[list[list[str]]] = None
              ) -> tuple[list[Any], list[Any], torch.Tensor, torch.Tensor]:
        """Every reward on every completion of this process.

        Args:
            prompt_messages, conversational: each row's prompt messages and whether the dataset gave it as
                messages (then prompts and completions go to the reward functions as messages, else as text).
            texts: the decoded completions.
            columns: the dataset's other columns (`PROMPT_COLUMNS` left out), one list of N values each.
            completion_ids: each completion's token ids (up to and including its stop token).
            truncated: N flags, True where a completion hit the length limit without stopping.
            completions: the completions as given (a tool rollout's message lists) instead of from `texts`.
            image_paths: each row's image files, for a batch with images. As TRL 1.16's GRPOTrainer gives them, the
                images (PIL, RGB, as the files hold them) reach the functions as the `images` keyword, and every
                conversational prompt of the batch comes in the structured shape, each image in a
                `{"type": "image", "image": ...}` part where its placeholder stood
                (`data.multimodal.multimodal_messages`).

        Returns:
            `(prompts, completions, per_function [N, F], rewards [N])`: prompts and completions in TRL's shapes, as
            the functions got them but with each image given by its path (for `completions.jsonl`); NaN where a
            function (or every function) returned None.
        """
        prompts = given = trl_prompts(prompt_messages, conversational)
        if image_paths is not None and any(image_paths):
            images = [[open_image(path) for path in paths] for paths in image_paths]
            given, prompts = ([multimodal_messages(prompt, row) if is_conversational else prompt
                               for prompt, row, is_conversational in zip(prompts, rows, conversational)]
                              for rows in (images, image_paths))
            columns = dict(columns, images=images)
        if completions is None:
            completions = trl_completions(texts, conversational)
        per_function, rewards = score_completions(self.reward_functions, given, completions, columns,
                                                  completion_ids, list(truncated))
        return prompts, completions, per_function, rewards

    # ---- advantages ----

    def advantages(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage's estimator (`ADVANTAGE_ESTIMATORS[self.advantage_estimator]`) on the given tensors."""
        return ADVANTAGE_ESTIMATORS[self.advantage_estimator](*args, **kwargs)

    # ---- the record ----

    def completion_records(self, step: int, prompts: Sequence[Any], completions: Sequence[Any],
                           per_function: torch.Tensor, rewards: torch.Tensor,
                           advantages: Optional[torch.Tensor] = None) -> list[dict[str, Any]]:
        """This process's `completions.jsonl` records (`rl.record.completion_records`); written by
        `write_completions` only with `log_completions`."""
        return completion_records(step, prompts, completions, self.reward_functions.names, per_function, rewards,
                                  advantages)

    def write_completions(self, records: list[dict[str, Any]]) -> None:
        """Append every process's records to `completions.jsonl` (from the main process). Every process calls it."""
        if self.log_completions:
            CompletionLog.append(self.args.output_dir, records, self.accelerator)


__all__ = ["PROMPT_COLUMNS", "OnlineTrainer", "has_active_dropout"]
