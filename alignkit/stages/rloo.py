"""REINFORCE leave-one-out (RLOO, Ahmadian et al. 2024, "Back to Basics"), at TRL 1.16's `RLOOTrainer` numbers.

RLOO is GRPO with two things changed, so it is GRPO's trainer with those two things overridden:
- the advantage: each completion's reward against the mean reward of the *other* completions of its prompt
  (`rl.advantages.leave_one_out_advantages`, the `leave_one_out` estimator), optionally whitened over the batch
  (`normalize_advantages`); before that the rewards are clipped (`reward_clip_range`) and the KL to the reference
  is folded into them as a sequence-level penalty, `r - beta x sum_t (log pi_old - log pi_ref)` (k1, as the RLOO
  paper; GRPO instead adds a k3 term to the loss), so `beta` defaults to 0.05 here;
- the loss: one importance ratio per completion, from the *summed* token log-probs (`exp(sum logp - sum
  logp_old)`), the clipped surrogate of it, averaged over completions (`rl.losses.clipped_surrogate` on `[N, 1]`).
  The old log-probs are computed after generation where needed: for the KL penalty (`beta` > 0) or when a slice
  trains after an update since its generation (GRPO's rule); TRL computes them always, the loss is the same.
Everything else (generation batches, buffering and `num_iterations`, scoring, several processes, exact resume,
`completions.jsonl`, vLLM) is GRPO's, unchanged: see `stages/grpo.py`.

Defaults: every key has TRL 1.16 `RLOOConfig`'s default (`num_generations: 2`, `beta: 0.05`, `epsilon: 0.2`,
`normalize_advantages: false`, `reward_clip_range: null`, `max_completion_length: 512`, ...); as for GRPO,
`learning_rate` is the Trainer's unless set (TRL: 1e-6).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..rl.kl import sequence_log_ratio
from ..rl.losses import clipped_surrogate
from .arguments import RLOOArguments
from .base import run_stage_trainer
from .grpo import DATA_KIND, GRPOTrainer, build_online_trainer, save_processor

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from ..config import Config

__all__ = ["DATA_KIND", "RLOOArguments", "RLOOTrainer", "run_rloo"]


class RLOOTrainer(GRPOTrainer):
    """GRPO's trainer with RLOO's advantage (leave-one-out, KL folded into the reward) and sequence-level loss.

    Args: as `GRPOTrainer`, with `grpo_args` an `RLOOArguments`.
    """

    advantage_estimator = "leave_one_out"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The KL folded into the reward is taken at rollout time, so with beta it needs the log-probs computed right
        # after generation (TRL's RLOO computes them always). Without it GRPO's rule holds: a slice trained before any
        # update since its generation takes its own forward's log-probs, detached, as the old ones (the ratio is 1),
        # and no no-grad pass of the batch runs for them.
        if self.grpo_args.beta != 0:
            self.needs_old_logps = self.rollout_reads_old_logps = True

    def _init_loss_state(self) -> None:
        """RLOO has one estimator (the class's) and no entropy bonus."""

    def _accumulation_is_one_batch(self) -> bool:
        """The loss is a mean over the micro-batch's completions divided by the accumulation steps: over equal
        micro-batches, the mean over the step's completions."""
        return True

    def compute_advantages(self, all_per_function: torch.Tensor, all_rewards: torch.Tensor,
                           batch: dict[str, torch.Tensor], local: slice) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.grpo_args
        rewards = all_rewards
        if g.reward_clip_range is not None:
            rewards = rewards.clamp(min=g.reward_clip_range[0], max=g.reward_clip_range[1])
        if g.beta != 0:
            mask = batch["completion_mask"]
            per_token_kl, kl = sequence_log_ratio(batch["old_logps"], batch["ref_logps"], mask)
            rewards = rewards - g.beta * self.accelerator.gather(kl)
            totals = self.accelerator.reduce(torch.stack([per_token_kl.sum(), mask.sum().float()]), reduction="sum")
            self.record_metrics({"kl": (totals[0] / totals[1].clamp(min=1.0)).item()}, 1)
        advantages, std_is_zero = self.advantages(rewards, self.num_generations, g.normalize_advantages)
        return advantages[local], std_is_zero

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("RLOOTrainer.compute_loss returns the loss only.")
        g = self.grpo_args
        mask = inputs["completion_mask"]
        logps, entropy = self.slice_forward(model, inputs)
        mask_f = mask.to(logps.dtype)
        sequence_logps = (logps * mask_f).sum(1, keepdim=True)
        old_sequence_logps = (self.old_logps_of(inputs, logps) * mask_f).sum(1, keepdim=True)
        advantages = inputs["advantages"]
        per_sequence_loss, ratio = clipped_surrogate(sequence_logps, old_sequence_logps, advantages, g.epsilon,
                                                     g.epsilon_high)
        # A mean over completions, divided for gradient accumulation here (`loss_is_scaled_for_ga`, as GRPO's).
        loss = per_sequence_loss.mean() / self.current_gradient_accumulation_steps

        ratio, adv = ratio.detach().squeeze(1), advantages
        low = ((ratio < 1 - g.epsilon) & (adv < 0)).float()
        high = ((ratio > 1 + g.epsilon_high) & (adv > 0)).float()
        gather = self.accelerator.gather
        low_all, high_all, region_all = gather(low), gather(high), gather(torch.maximum(low, high))
        entropy_totals = self.accelerator.reduce(torch.stack([(entropy.detach() * mask_f).sum(), mask_f.sum()]),
                                                 reduction="sum")
        metrics = {
            "entropy": (entropy_totals[0] / entropy_totals[1].clamp(min=1.0)).item(),
            "clip_ratio/low_mean": low_all.mean().item(), "clip_ratio/low_min": low_all.min().item(),
            "clip_ratio/high_mean": high_all.mean().item(), "clip_ratio/high_max": high_all.max().item(),
            "clip_ratio/region_mean": region_all.mean().item(),
        }
        self.record_metrics({k: v for k, v in metrics.items() if not math.isnan(v)}, 1)
        return loss


def run_rloo(config: "Config", callbacks: list["TrainerCallback"]) -> None:
    """Train the policy with RLOO as `config` says; outputs (adapter, logs, completions.jsonl) go to `output_dir`."""
    trainer = build_online_trainer(RLOOTrainer, config, callbacks)
    run_stage_trainer(trainer, config)
    save_processor(trainer, config)
