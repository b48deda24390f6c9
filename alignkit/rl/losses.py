"""Clipped policy and value losses and the token-loss aggregations of the online stages (pure tensor functions).

- `importance_log_weights`: the log importance ratio per token, or one per sequence (GSPO).
- `clipped_surrogate`: PPO's clipped surrogate per token (GRPO, TRL 1.16's asymmetric clip range, optional
  two-sided `delta`); `cispo_loss`, `sapo_loss`, `vespo_weights`: the other policy terms of TRL 1.16's GRPO.
- `off_policy_sequence_mask`, `high_entropy_mask`, `entropy_bonus`, `AdaptiveEntropyController`: the masks and
  the entropy regulariser GRPO can put around its policy term.
- `aggregate_loss`: GRPO's ways (`LOSS_TYPES`) to sum a micro-batch's token losses into its share of a step.
- `clipped_policy_loss`, `clipped_value_loss`: PPO's (TRL 0.x's) losses, token means with their clip fractions.
N = completions (rows), C or T = completion tokens.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .stats import masked_mean

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
# The loss types whose policy term is the clipped surrogate (the others replace it).
CLIPPED_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def importance_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log importance weight `log(pi / pi_old)` per token, or one per sequence (GSPO, Zheng et al. 2025, eq. 7).

    `token`: `log_ratio` as it is, `[N, C]`. `sequence`: the mean of the row's log-ratios over its counted tokens,
    `[N, 1]` (so `exp` of it is the geometric mean of the token ratios, the length-normalised sequence ratio).

    Example: log_ratio [[0.2, 0.4, 9], [0.3, 0, 0]], mask [[1, 1, 0], [1, 0, 0]] → sequence [[0.3], [0.3]].

    Args:
        log_ratio: `[N, C]` `logps - old_logps`.
        mask: `[N, C]` 1 on tokens that count.
        level: `token` or `sequence`.
    """
    if level == "token":
        return log_ratio
    if level == "sequence":
        mask = mask.to(log_ratio.dtype)
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level={level!r}: choose token or sequence.")


def clipped_surrogate(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                      epsilon_low: float, epsilon_high: float, *, delta: Optional[float] = None,
                      mask: Optional[torch.Tensor] = None,
                      importance_sampling_level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7), as a loss.

    `ratio = exp(logps - old_logps)` (per token, or per sequence: `importance_log_weights`),
    `loss = -min(min(ratio, delta) * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`. `delta` (INTELLECT-2's
    two-sided clipping, None = off) caps the unclipped ratio too, so a large ratio cannot pass through the min on
    the side of a negative advantage.

    Example (eps 0.2): ratio 1.5, A = 1 → -min(1.5, 1.2) = -1.2; ratio 0.5, A = -1 → -min(-0.5, -0.8) = 0.8;
    ratio 3, A = -1 → -min(-3, -1.2) = 3, and with delta 2: -min(-2, -1.2) = 2.

    Args:
        logps: `[N, C]` policy log-probs of the completion tokens.
        old_logps: `[N, C]` log-probs under the policy that sampled them (no gradient).
        advantages: `[N]` one advantage per completion, or `[N, C]` per token.
        epsilon_low, epsilon_high: the clipping range.
        delta: upper cap of the unclipped ratio (two-sided clipping), or None.
        mask: `[N, C]` 1 on tokens that count; needed for `importance_sampling_level="sequence"`.
        importance_sampling_level: `token` or `sequence` (GSPO).

    Returns:
        `(per_token_loss [N, C] (or [N, 1] at sequence level), ratio [N, C] or [N, 1])`.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if mask is None:
        mask = torch.ones_like(logps)
    ratio = torch.exp(importance_log_weights(logps - old_logps, mask, importance_sampling_level))
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return -torch.min(unclipped * advantages, clipped * advantages), ratio


def cispo_loss(logps: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor,
               epsilon_high: float) -> torch.Tensor:
    """CISPO's policy term per token (MiniMax-M1, eq. 4): the clipped importance weight, with no gradient, times
    the advantage times the log-prob.

    `loss = -sg(min(ratio, epsilon_high)) * A * logps`. Unlike the clipped surrogate, every token keeps a
    gradient; the weight only bounds it. (TRL 1.16 uses `epsilon_high` itself as the cap, not `1 + epsilon_high`.)

    Example: ratio [0.5, 6], A = 2, logps [-1, -2], epsilon_high 5: weights [0.5, 5], loss [1, 20].

    Args:
        logps: `[N, C]` policy log-probs (differentiable).
        ratio: `[N, C]` or `[N, 1]` importance ratio.
        advantages: `[N]` or `[N, C]`.
        epsilon_high: the cap of the weight.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logps


def sapo_loss(ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float,
              temperature_neg: float) -> torch.Tensor:
    """SAPO's policy term per token (Soft Adaptive Policy Optimization, Gao et al. 2025): a smooth gate of the ratio
    in place of the hard clip.

    `loss = -sigmoid(tau * (ratio - 1)) * 4 / tau * A`, `tau = temperature_pos` where A > 0, else `temperature_neg`.
    At ratio 1 the gate is `0.5 * 4 / tau`; its slope there is 1, as the plain ratio's.

    Example: ratio 1, A = 1, tau 1: -0.5 * 4 = -2. Ratio 2, A = -1, tau_neg 2: sigmoid(2) = 0.880797,
    loss = 0.880797 * 4 / 2 = 1.761594.

    Args:
        ratio: `[N, C]` or `[N, 1]` importance ratio (differentiable).
        advantages: `[N]` or `[N, C]`.
        temperature_pos, temperature_neg: tau for positive and for non-positive advantages.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    temperatures = torch.where(advantages > 0, temperature_pos, temperature_neg)
    return -torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures * advantages


@torch.no_grad()
def vespo_weights(log_ratio: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, k_pos: float,
                  lambda_pos: float, k_neg: float, lambda_neg: float) -> torch.Tensor:
    """VESPO's per-sequence weight (Variational Sequence-Level Soft Policy Optimization): a Gamma-shaped function of
    the sequence importance ratio, 1 at ratio 1, used as a gradient scale (no gradient of its own).

    `w = exp(clamp(sum_t clamp(log_ratio_t, -20, 20), log 1e-8, 20))` (the product of the token ratios, not their
    mean), `phi(w) = exp(lambda + k log w - lambda w)`, with `(k, lambda) = (k_pos, lambda_pos)` where A >= 0, else
    `(k_neg, lambda_neg)`; lambda is floored at 1e-4; a non-finite phi becomes 0. The loss is then `-phi * A * logps`.

    Example: log-ratios [0.1, 0.1] → log w = 0.2, w = 1.221403; A = 1, k 2, lambda 3:
    phi = exp(3 + 0.4 - 3.664208) = exp(-0.264208) = 0.767818.

    Args:
        log_ratio: `[N, C]` `logps - old_logps`.
        mask: `[N, C]` 1 on tokens that count.
        advantages: `[N]` or `[N, 1]`.
        k_pos, lambda_pos, k_neg, lambda_neg: the Gamma shapes for non-negative and negative advantages.

    Returns:
        `[N, 1]`.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    lower = math.log(1e-8)
    sequence_log_ratio = (torch.clamp(log_ratio, -20.0, 20.0) * mask.to(log_ratio.dtype)).sum(-1, keepdim=True)
    log_w = torch.clamp(sequence_log_ratio, lower, 20.0)
    non_negative = advantages >= 0
    k = torch.where(non_negative, k_pos, k_neg)
    lam = torch.where(non_negative, lambda_pos, lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_sequence_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (eq. 9): drop a sequence whose advantage is negative AND whose mean
    KL(sampler || policy) over its tokens exceeds `threshold`.

    `kl = mean_t (sampling_logps - logps)` per row (NaN tokens count as 0); keep where `A >= 0 or kl <= threshold`.

    Example: A [1, -1, -1], per-row mean (sampling - logps) [2, 0.1, 0.9], threshold 0.5 → keep [1, 1, 0].

    Args:
        advantages: `[N]` or `[N, 1]`.
        logps: `[N, C]` policy log-probs (used without gradient).
        sampling_logps: `[N, C]` log-probs of the policy that sampled.
        mask: `[N, C]` 1 on tokens that count.
        threshold: delta of the paper (> 0).

    Returns:
        `[N, 1]`, 1.0 keep, 0.0 drop, in `mask`'s dtype.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    mask_f = mask.to(logps.dtype)
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask_f).sum(-1, keepdim=True) / mask_f.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float,
                      all_entropies: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tokens in the top `top_entropy_quantile` share by entropy ("Beyond the 80/20 rule", Wang et al. 2025).

    The threshold is the `1 - top_entropy_quantile` quantile (linear interpolation, `torch.quantile`) of the
    entropies of every counted token (`all_entropies`: those of every process; default: this batch's); a token
    counts where its entropy is >= it. `top_entropy_quantile` 1 keeps every token, 0 only the highest.

    Example: entropies [[1, 2, 3, 4]], all counted, 0.5 → quantile 0.5 of [1, 2, 3, 4] = 2.5 → [[0, 0, 1, 1]].

    Args:
        entropies: `[N, C]` per-token entropies.
        mask: `[N, C]` 1 on tokens that count.
        top_entropy_quantile: rho in [0, 1].
        all_entropies: `[M]` the counted entropies the threshold is taken over.

    Returns:
        `[N, C]` bool, False outside `mask`.
    """
    counted = mask.bool()
    if all_entropies is None:
        all_entropies = entropies[counted]
    if all_entropies.numel() == 0:
        return torch.zeros_like(counted)
    threshold = torch.quantile(all_entropies.float(), 1 - top_entropy_quantile)
    return (entropies * mask.to(entropies.dtype) >= threshold) & counted


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, accumulation_steps: int = 1) -> torch.Tensor:
    """The mean entropy per counted token, divided for gradient accumulation: the loss subtracts `coef x` it.

    Example: entropies [[1, 3], [2, 9]], mask [[1, 1], [1, 0]], k = 2 → (6 / 3) / 2 = 1.
    """
    mask = mask.to(entropies.dtype)
    return (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation_steps


class AdaptiveEntropyController:
    """Skywork-OR1's adaptive entropy coefficient (§3.2.2), as TRL 1.16 steps it.

    The coefficient applied in a step is `coef` when the entropy measured over the previous step (all processes,
    token-weighted) was at most `target`, else 0 (no step measured yet: infinity, so 0). After each step the
    coefficient moves by `delta` towards more entropy bonus when that step's entropy was <= target, towards less
    otherwise, within `[coef_min, coef_max]`.

    Example (coef 0.1, target 0.5, delta 0.05): applies 0 first; step entropy 0.4 → coef 0.15 and applies 0.15;
    step entropy 0.9 → coef 0.1 and applies 0.
    """

    def __init__(self, coef: float, target: float, delta: float, coef_min: float, coef_max: float) -> None:
        self.coef, self.target, self.delta = float(coef), float(target), float(delta)
        self.coef_min, self.coef_max = float(coef_min), float(coef_max)
        self.last_entropy = math.inf

    def applied(self) -> float:
        """The coefficient this step uses."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, step_entropy: float) -> None:
        if step_entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = float(step_entropy)

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_world_entropy"])


def aggregate_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, *,
                   accumulation_steps: int = 1, steps_per_generation: int = 1,
                   generation_tokens: Optional[float] = None,
                   max_completion_length: Optional[int] = None,
                   micro_batch_tokens: Optional[float] = None) -> torch.Tensor:
    """One micro-batch's share of the step's loss, already divided for gradient accumulation (TRL 1.16).

    With `S = sum(per_token_loss * mask)` over the micro-batch of B rows and `k = accumulation_steps`:
    - `grpo` and `sapo`: mean over rows of (row sum / row tokens), divided by k;
    - `luspo`: mean over rows of the row sum (each sequence weighted by its length, LUSPO), divided by k;
    - `bnpo`: S / tokens of the micro-batch (`micro_batch_tokens` when given), divided by k;
    - `dr_grpo`: S / (B x max_completion_length), divided by k;
    - `dapo`, `cispo` and `vespo`: S / (generation_tokens x k / steps_per_generation), the tokens of one accumulation window's
      share of the generation batch.
    Summed over the k micro-batches of a step, grpo, dr_grpo and dapo give the same number as one micro-batch
    holding all the rows, so changing k alone leaves the update as it was.

    With N processes, each computes its own rows' share and data parallelism averages the N gradients, so
    the token counts passed are the counts over all processes divided by N (`generation_tokens`,
    `micro_batch_tokens`): the average of the N shares is then the one-process loss of all the rows.

    Example: losses [[1, 2], [3, 0]], mask [[1, 1], [1, 0]], k = 2: grpo ((1.5 + 3) / 2) / 2 = 1.125;
    bnpo (6 / 3) / 2 = 1.0, or with micro_batch_tokens 4 (another process holds 5 tokens: (3 + 5) / 2)
    (6 / 4) / 2 = 0.75; dr_grpo with length 4: (6 / 8) / 2 = 0.375; dapo with 6 generation tokens and
    steps_per_generation 2: 6 / (6 x 2 / 2) = 1.0; luspo ((3 + 3) / 2) / 2 = 1.5.

    Args:
        per_token_loss: `[B, C]` (or `[B, 1]`, a sequence-level term broadcast over the row's tokens).
        mask: `[B, C]` 1 on tokens that count.
        loss_type: one of `LOSS_TYPES`.
        accumulation_steps: micro-batches accumulated into this optimizer step.
        steps_per_generation: micro-batches the generation batch was cut into (dapo).
        generation_tokens: tokens that count in the whole generation batch (dapo).
        max_completion_length: dr_grpo's constant.
        micro_batch_tokens: tokens that count in the micro-batch (bnpo; default: those of `mask`).
    """
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation_steps
    if loss_type == "bnpo":
        tokens = mask.sum() if micro_batch_tokens is None else torch.as_tensor(float(micro_batch_tokens))
        return masked.sum() / tokens.clamp(min=1.0) / accumulation_steps
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type=dr_grpo needs max_completion_length.")
        return masked.sum() / (per_token_loss.size(0) * max_completion_length) / accumulation_steps
    if loss_type == "luspo":
        return masked.sum(-1).mean() / accumulation_steps
    if loss_type in ("dapo", "cispo", "vespo"):
        if generation_tokens is None:
            raise ValueError(f"loss_type={loss_type} needs generation_tokens.")
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


__all__ = ["LOSS_TYPES", "CLIPPED_LOSS_TYPES", "IMPORTANCE_SAMPLING_LEVELS", "importance_log_weights",
           "clipped_surrogate", "cispo_loss", "sapo_loss", "vespo_weights", "off_policy_sequence_mask",
           "high_entropy_mask", "entropy_bonus", "AdaptiveEntropyController", "aggregate_loss", "clipped_policy_loss", "clipped_value_loss"]
