"""Clipped policy and value losses and the token-loss aggregations of the online stages (pure tensor functions).

- `clipped_surrogate`: PPO's clipped surrogate per token (GRPO, TRL 1.16's asymmetric clip range).
- `aggregate_loss`: GRPO's four ways (`LOSS_TYPES`) to sum a micro-batch's token losses into its share of a step.
- `clipped_policy_loss`, `clipped_value_loss`: PPO's (TRL 0.x's) losses, token means with their clip fractions.
N = completions (rows), C or T = completion tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from .stats import masked_mean

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


def clipped_surrogate(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                      epsilon_low: float, epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7), as a loss.

    `ratio = exp(logps - old_logps)`, `loss = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`.

    Example (eps 0.2): ratio 1.5, A = 1 → -min(1.5, 1.2) = -1.2; ratio 0.5, A = -1 → -min(-0.5, -0.8) = 0.8.

    Args:
        logps: `[N, C]` policy log-probs of the completion tokens.
        old_logps: `[N, C]` log-probs under the policy that sampled them (no gradient).
        advantages: `[N]` one advantage per completion, or `[N, C]` per token.
        epsilon_low, epsilon_high: the clipping range.

    Returns:
        `(per_token_loss [N, C], ratio [N, C])`.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    return -torch.min(ratio * advantages, clipped * advantages), ratio


def aggregate_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, *,
                   accumulation_steps: int = 1, steps_per_generation: int = 1,
                   generation_tokens: Optional[float] = None,
                   max_completion_length: Optional[int] = None,
                   micro_batch_tokens: Optional[float] = None) -> torch.Tensor:
    """One micro-batch's share of the step's loss, already divided for gradient accumulation (TRL 1.16).

    With `S = sum(per_token_loss * mask)` over the micro-batch of B rows and `k = accumulation_steps`:
    - `grpo`: mean over rows of (row sum / row tokens), divided by k;
    - `bnpo`: S / tokens of the micro-batch (`micro_batch_tokens` when given), divided by k;
    - `dr_grpo`: S / (B x max_completion_length), divided by k;
    - `dapo`: S / (generation_tokens x k / steps_per_generation), the tokens of one accumulation window's
      share of the generation batch.
    Summed over the k micro-batches of a step, grpo, dr_grpo and dapo give the same number as one micro-batch
    holding all the rows, so changing k alone leaves the update as it was.

    With N processes, each computes its own rows' share and data parallelism averages the N gradients, so
    the token counts passed are the counts over all processes divided by N (`generation_tokens`,
    `micro_batch_tokens`): the average of the N shares is then the one-process loss of all the rows.

    Example: losses [[1, 2], [3, 0]], mask [[1, 1], [1, 0]], k = 2: grpo ((1.5 + 3) / 2) / 2 = 1.125;
    bnpo (6 / 3) / 2 = 1.0, or with micro_batch_tokens 4 (another process holds 5 tokens: (3 + 5) / 2)
    (6 / 4) / 2 = 0.75; dr_grpo with length 4: (6 / 8) / 2 = 0.375; dapo with 6 generation tokens and
    steps_per_generation 2: 6 / (6 x 2 / 2) = 1.0.

    Args:
        per_token_loss: `[B, C]`.
        mask: `[B, C]` 1 on tokens that count.
        loss_type: grpo, bnpo, dr_grpo or dapo.
        accumulation_steps: micro-batches accumulated into this optimizer step.
        steps_per_generation: micro-batches the generation batch was cut into (dapo).
        generation_tokens: tokens that count in the whole generation batch (dapo).
        max_completion_length: dr_grpo's constant.
        micro_batch_tokens: tokens that count in the micro-batch (bnpo; default: those of `mask`).
    """
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation_steps
    if loss_type == "bnpo":
        tokens = mask.sum() if micro_batch_tokens is None else torch.as_tensor(float(micro_batch_tokens))
        return masked.sum() / tokens.clamp(min=1.0) / accumulation_steps
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type=dr_grpo needs max_completion_length.")
        return masked.sum() / (per_token_loss.size(0) * max_completion_length) / accumulation_steps
    if loss_type == "dapo":
        if generation_tokens is None:
            raise ValueError("loss_type=dapo needs generation_tokens.")
        return masked.sum() / (max(float(generation_tokens), 1.0) * accumulation_steps / steps_per_generation)
    raise ValueError(f"loss_type={loss_type!r}: choose one of {', '.join(LOSS_TYPES)}.")


def clipped_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7), as a loss averaged over response tokens.

    `ratio = exp(logp - old_logp)`, `loss = mean_t max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))`.

    Args:
        logps: [N, T] the policy's log-probs now (differentiable).
        old_logps: [N, T] at rollout time.
        advantages: [N, T].
        mask: [N, T] 1 on response tokens.
        cliprange: eps.

    Returns:
        `(loss, clipfrac, approxkl)`: the loss; the share of tokens where the clipped term was taken;
        `0.5 * mean (logp - old_logp)^2`, the usual estimate of KL(old || new).

    Example (eps 0.2): A [1, -1, 2], ratio [1.5, 0.5, 1]:
        -A * ratio = [-1.5, 0.5, -2], -A * clip = [-1.2, 0.8, -2], max = [-1.2, 0.8, -2],
        loss = (-1.2 + 0.8 - 2) / 3 = -0.8; clipped where the second is larger: 2 of 3;
        approxkl = 0.5 * (ln(1.5)^2 + ln(0.5)^2 + 0) / 3 = 0.5 * (0.164402 + 0.480453) / 3 = 0.107476.
    """
    log_ratio = (logps - old_logps) * mask.to(logps.dtype)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    clipfrac = masked_mean((clipped > unclipped).to(logps.dtype), mask)
    approxkl = 0.5 * masked_mean(log_ratio ** 2, mask)
    return loss, clipfrac.detach(), approxkl.detach()


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped value loss of OpenAI's PPO baselines (as in TRL 0.x), averaged over response tokens.

    `v_clip = old_v + clip(v - old_v, -c, c)`, `loss = 0.5 * mean_t max((v - R)^2, (v_clip - R)^2)`.

    Args:
        values: [N, T] the critic now (differentiable).
        old_values: [N, T] at rollout time.
        returns: [N, T] targets (`gae_advantages`).
        mask: [N, T] 1 on response tokens.
        cliprange_value: c.

    Returns:
        `(loss, clipfrac)`: clipfrac is the share of tokens where the clipped error was the larger.

    Example (c 0.2): v [1, 0], old [0.5, 0], R [2, 1]: v_clip = [0.7, 0], errors (v - R)^2 = [1, 1] and
    (v_clip - R)^2 = [1.69, 1], max = [1.69, 1], loss = 0.5 * 2.69 / 2 = 0.6725, clipfrac 1 / 2 = 0.5.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), mask)
    clipfrac = masked_mean((clipped_error > unclipped_error).to(values.dtype), mask)
    return loss, clipfrac.detach()


__all__ = ["LOSS_TYPES", "clipped_surrogate", "aggregate_loss", "clipped_policy_loss", "clipped_value_loss"]
