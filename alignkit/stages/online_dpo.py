"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"), at the numbers of TRL
1.16's `trl.experimental.online_dpo.OnlineDPOTrainer`.

Each micro-batch, the policy samples two completions per prompt; the reward functions (and/or reward models) score
both; the better one is `chosen`, the other `rejected` (a tie goes to the first); the policy takes a DPO step on
those pairs against the reference (the step-0 policy). The preference data is made by the policy as it trains, so
the pairs stay on-policy, which offline DPO's fixed pairs are not.

How the work is laid out, and why:
- One round per micro-batch, as TRL does it: the `per_device_train_batch_size` prompts of a micro-batch are sampled
  twice, scored, paired and trained at once; nothing is buffered. The round's sampling is seeded by its place in
  the run (the micro-batch index, `rollout.rollout_seed`) and each row by its place in the round's global batch
  (`rollout.row_seeds`), so a run resumed from a checkpoint samples what the uninterrupted run sampled, and N
  processes sample what one does. A pair's two rows are neighbours (`[p_1, p_1, p_2, p_2, ...]`, where TRL lays
  out `[p_1 .. p_B, p_1 .. p_B]` in one process), which keeps that true under several processes.
- The pieces are the online stages' and DPO's: `OnlineTrainer.sample` (the decode loop), `OnlineTrainer.score`
  (reward functions and reward models, `alignkit.rewards`), `rollout.completion_logps` (policy and reference
  log-probs), `StageTrainer.reference()` (the adapter disabled, or a frozen copy under full fine-tuning), and
  `dpo.preference_loss` (`sigmoid`; `ipo` on summed log-probs, as TRL's online trainer computes it, where offline
  DPO averages per token). `completions.jsonl` gets both completions of every pair.
- Log-probs are of the raw logits (no temperature), as TRL's online DPO reads them.
- A completion every reward function skipped (None) counts as reward 0, as TRL's `nansum` makes it.

Metrics (TRL's names): `objective/scores`, `objective/scores_margin`, `objective/kl`, `objective/non_score_reward`,
`objective/rlhf_reward`, `objective/entropy`, `rewards/chosen|rejected|margins|accuracies`, `logps/chosen|rejected`,
`val/contain_eos_token`, `beta`. One difference: TRL sums `objective/kl` and `objective/entropy` over every completion
position, padding after the end of turn included; here over the completion's own tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from ..rl.rollout import completion_logps, rollout_seed
from .dpo import preference_loss
from .arguments import OnlineDPOArguments
from .grpo import build_online_trainer, collate_prompt_rows
from .online import PROMPT_COLUMNS, OnlineTrainer

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from ..config import Config

# The examples `data.get_dataset` builds for this stage (`formats.DATA_KINDS`): prompts, as for GRPO.
DATA_KIND = "prompt"


def choose_pairs(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected rows of `2B` completions laid out in pairs: rows `2i` and `2i + 1` answer prompt i.

    The one with the higher reward is chosen; a tie goes to the first (row `2i`), as in TRL.

    Example: rewards [1, 0.5, 0, 2] (B = 2): pair (0, 1): 1 >= 0.5, chosen 0; pair (2, 3): 0 < 2, chosen 3 →
    chosen [0, 3], rejected [1, 2].

    Args:
        rewards: `[2B]`, no NaN.

    Returns:
        `(chosen [B], rejected [B])` row indices.
    """
    first, second = rewards.view(-1, 2).unbind(1)
    first_wins = (first >= second).long()
    rows = 2 * torch.arange(first.numel(), device=rewards.device)
    return rows + 1 - first_wins, rows + first_wins


def check_config(config: "Config") -> None:
    """What `stage: online_dpo` refuses beyond its own keys (called after the config is parsed)."""
    config.method.check_run("online_dpo", config.training)


class OnlineDPOTrainer(OnlineTrainer):
    """`Trainer` that samples two completions per prompt, judges them with the rewards and takes DPO steps.

    Args:
        online_dpo_args: the stage's keys (`OnlineDPOArguments`).
        reward_functions: `alignkit.rewards.RewardFunctions`.
        stop_token_ids: ids that end a completion (the template's end of turn).
        *args, **kwargs: as for `transformers.Trainer`; `train_dataset` holds the data layer's prompt rows.
    """

    # The per-pair mean is divided for gradient accumulation by the Trainer.
    loss_is_scaled_for_ga = False

    def __init__(self, *args, online_dpo_args: OnlineDPOArguments, reward_functions, stop_token_ids: Sequence[int],
                 **kwargs) -> None:
        kwargs.setdefault("data_collator", collate_prompt_rows)
        super().__init__(*args, reward_functions=reward_functions, stop_token_ids=stop_token_ids,
                         log_completions=online_dpo_args.log_completions, keep_reference_copy=True,
                         disable_dropout=online_dpo_args.disable_dropout, **kwargs)
        self.online_dpo_args = online_dpo_args
        self.generation_kwargs = {
            "do_sample": True, "max_new_tokens": online_dpo_args.max_new_tokens,
            "temperature": online_dpo_args.temperature, "top_p": online_dpo_args.top_p,
            "top_k": online_dpo_args.top_k, "min_p": online_dpo_args.min_p,
            "repetition_penalty": online_dpo_args.repetition_penalty,
        }
        self._micro_in_step = 0

    def _track_num_input_tokens(self, inputs) -> None:
        """Tokens are counted when they are generated (prompts + completions), not from the prompt rows."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._micro_in_step = 0 if self.accelerator.sync_gradients else self._micro_in_step + 1
        return loss

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        self._micro_in_step = 0  # a checkpoint is taken at a step boundary

    # ---- the round: generate, score, pair ----

    def _prepare_inputs(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not self.model.training:
            raise ValueError("stage online_dpo does not evaluate through the Trainer; use `alignkit eval`.")
        args = self.online_dpo_args
        round_index = self.state.global_step * self.args.gradient_accumulation_steps + self._micro_in_step
        # Each prompt twice in a row: a pair's rows are then neighbours in the global batch too, so row seeds (by
        # place in the global batch) and with them the pairs do not depend on the number of processes.
        doubled = [row for row in rows for _ in range(2)]
        first_row = self.accelerator.process_index * len(doubled)
        generation = self.sample([row["input_ids"] for row in doubled], generation_kwargs=self.generation_kwargs,
                                 seed=rollout_seed(self.args.seed, round_index), first_row=first_row)
        device = self.args.device
        prompt_ids, prompt_mask = generation.prompt_ids.to(device), generation.prompt_mask.to(device)
        completion_ids, completion_mask = generation.completion_ids.to(device), generation.completion_mask.to(device)
        truncated = generation.truncated.to(device)
        lengths = completion_mask.sum(1)

        columns = {key: [row[key] for row in doubled] for key in doubled[0] if key not in PROMPT_COLUMNS}
        id_lists = [ids[:n].tolist() for ids, n in zip(generation.completion_ids, lengths.tolist())]
        prompts, completions, per_function, rewards = self.score(
            [row["prompt_messages"] for row in doubled], [bool(row["prompt_conversational"]) for row in doubled],
            generation.texts, columns, id_lists, truncated.tolist())
        rewards = torch.nan_to_num(rewards.to(device), nan=0.0)  # all skipped: 0, as TRL's nansum
        if args.missing_eos_penalty is not None:
            rewards = rewards - args.missing_eos_penalty * truncated.float()
        self.write_completions(self.completion_records(self.state.global_step + 1, prompts, completions,
                                                       per_function, rewards))
        self.state.num_input_tokens_seen += int(self.accelerator.reduce(
            (prompt_mask.sum() + lengths.sum()).long(), reduction="sum").item())
        chosen, rejected = choose_pairs(rewards)
        with torch.no_grad(), self.reference() as reference:
            ref_logps, _ = completion_logps(reference, prompt_ids, prompt_mask, completion_ids, completion_mask)
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                "completion_mask": completion_mask, "ref_logps": ref_logps, "rewards": rewards,
                "truncated": truncated, "chosen": chosen, "rejected": rejected}

    # ---- the loss ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("OnlineDPOTrainer.compute_loss returns the loss only.")
        args = self.online_dpo_args
        beta = args.beta_at(self.state.epoch or 0.0)
        mask = inputs["completion_mask"].float()
        logps, _ = completion_logps(model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"],
                                    inputs["completion_mask"])
        sums, ref_sums = (logps * mask).sum(1), (inputs["ref_logps"] * mask).sum(1)
        chosen, rejected = inputs["chosen"], inputs["rejected"]
        ones = torch.ones_like(sums[chosen])  # lengths of 1: ipo on summed log-probs, as TRL's online trainer
        losses, chosen_rewards, rejected_rewards = preference_loss(
            args.loss_type, sums[chosen], sums[rejected], ones, ones, ref_sums[chosen], ref_sums[rejected], beta=beta)

        rewards = inputs["rewards"]
        kl = ((logps.detach() - inputs["ref_logps"]) * mask).sum(1)
        non_score_reward = -beta * kl
        margins = chosen_rewards - rejected_rewards
        self.record_metrics({
            "objective/scores": rewards.mean(), "objective/scores_margin": (rewards[chosen] - rewards[rejected]).mean(),
            "objective/kl": kl.mean(), "objective/non_score_reward": non_score_reward.mean(),
            "objective/rlhf_reward": (rewards + non_score_reward).mean(),
            "objective/entropy": -(logps.detach() * mask).sum(1).mean(),
            "val/contain_eos_token": (~inputs["truncated"]).float().mean(),
            "logps/chosen": sums[chosen].detach().mean(), "logps/rejected": sums[rejected].detach().mean(),
            "rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": margins.mean(), "rewards/accuracies": (margins > 0).float().mean(), "beta": beta,
        }, 1)
        return losses.mean()


def run_online_dpo(config: "Config", callbacks: list["TrainerCallback"]) -> None:
    """Train the policy with online DPO as `config` says; outputs (adapter, logs, completions.jsonl) go to
    `output_dir`. Built as the other online stages are (`grpo.build_online_trainer`); the `length` reward's default
    L_max is `max_new_tokens`."""
    from .base import run_stage_trainer

    trainer = build_online_trainer(OnlineDPOTrainer, config, callbacks, method_keyword="online_dpo_args",
                                   max_completion_length=config.method.max_new_tokens)
    run_stage_trainer(trainer, config)


__all__ = ["OnlineDPOArguments", "choose_pairs", "check_config", "OnlineDPOTrainer", "run_online_dpo"]
