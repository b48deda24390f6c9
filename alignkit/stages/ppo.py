"""PPO against a reward model, the classic RLHF third stage, with LoRA on one shared base model.

The design is the original PPO-with-PEFT one (Ziegler et al. 2019's loop, as TRL 0.x and LLaMA-Factory's
old PPO ran it): the policy is a LoRA adapter; its reference is the same base with that adapter disabled
(an SFT adapter given as `adapter_name_or_path` is merged into the base when the model loads, so it belongs
to the reference); the reward model is the rm stage's LoRA output loaded as a second, frozen, named adapter
with its score head and switched in only to score; the critic is a value head on the policy's hidden states.
One copy of the base weights in memory serves all four roles.

One PPO step, top to bottom (`PPOTrainer.train`):

1. Rollout: take the next `per_device_train_batch_size x gradient_accumulation_steps x ppo_buffer_size`
   prompts; sample one response each from the policy (temperature 1, no top-k/top-p: the log-probs and the
   KL below are those of the distribution actually sampled), each cut to a length drawn from
   `response_length_range` or stopping at the template's end of turn within `max_new_tokens`.
2. Score: the reward model reads each prompt + response at its last token (and/or `reward_funcs`).
3. Old log-probs and values of the policy, reference log-probs with the adapter disabled; per-token reward
   `-kl_coef * (logp - ref_logp)` with the score added at the response's last token (`kl_penalty_rewards`).
4. GAE over the response tokens (`gae_advantages`), advantages whitened.
5. `ppo_epochs` passes over the rollout in shuffled mini-batches: clipped policy loss + `vf_coef` x clipped
   value loss, gradient clipping at `max_grad_norm`, one optimizer step per mini-batch.
6. The KL coefficient adapts to the rollout's KL (`AdaptiveKLController`), the scheduler steps once.

What this simplifies, and why:
- A Trainer "step" (`global_step`, `max_steps`, `save_steps`, `logging_steps`, the scheduler) is one PPO step
  (one rollout and its `ppo_epochs` passes), as in LLaMA-Factory's PPO; the optimizer steps several times in
  it. The loop is our own, but built from the Trainer's parts (optimizer, scheduler, `TrainerState`,
  callbacks, `_save_checkpoint`, `log`), so the files every stage writes are written here too.
- Prompts are drawn by a permutation seeded from `seed` and the epoch, so the prompts of step k depend on k
  alone: a resumed run needs no data skipping. Sampling draws from the global RNG, which checkpoints save.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from ..hparams import Config

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# Pure tensor functions
# ---------------------------------------------------------------------------------------------------


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is 1.

    Args:
        values: [...] float tensor.
        mask: [...] same shape, 1 (or True) on the positions that count.

    Returns:
        Scalar. Example: values [1, 2, 9], mask [1, 1, 0] -> (1 + 2) / 2 = 1.5.
    """
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the masked positions, Bessel-corrected by default (as TRL 0.x's).

    Example: values [2, 4, 6, 99], mask [1, 1, 1, 0]: mean 4, squared deviations 4, 0, 4;
    biased 8 / 3, unbiased 8 / 2 = 4.

    Raises:
        ValueError: `unbiased` with fewer than two masked positions (the correction divides by n - 1).
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError("whitening needs at least two response tokens in the rollout; raise the batch or "
                             "the response lengths.")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise `values` over the masked positions: `(x - mean) / sqrt(var + 1e-8)`, 0 where masked out.

    Args:
        values: [N, T] float.
        mask: [N, T], 1 on response tokens.
        shift_mean: False adds the mean back (scale only), as TRL 0.x whitened rewards.

    Returns:
        [N, T]. Example: values [2, 4, 6 | 99 masked]: mean 4, unbiased var 4 (std 2) -> [-1, 0, 1, 0];
        with shift_mean=False -> [3, 4, 5, 0].
    """
    mean, variance = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


def response_last_index(mask: torch.Tensor) -> torch.Tensor:
    """[N] position of each row's last response token (mask [N, T]).

    Raises:
        ValueError: a row has no response token.
    """
    if not bool(mask.ne(0).any(dim=1).all()):
        raise ValueError("every response needs at least one token (a row's response mask is all zero).")
    positions = torch.arange(mask.shape[1], device=mask.device)
    return (positions * mask.ne(0).long()).argmax(dim=1)


def kl_penalty_rewards(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: the KL penalty at every response token, the score added at the last one.

    `kl_t = logp_t - ref_logp_t` (the sampled token's log-ratio, an unbiased estimate of KL(policy || ref)),
    `r_t = -kl_coef * kl_t`, and `r_last += score` (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022, eq. 2).

    Args:
        logps: [N, T] the policy's log-probs of the response tokens at rollout time.
        ref_logps: [N, T] the reference's.
        scores: [N] one score per response (reward model and/or reward functions).
        mask: [N, T] 1 on response tokens; each row needs at least one.
        kl_coef: the KL coefficient beta.

    Returns:
        `(rewards, kl)`, both [N, T] and 0 outside the mask.

    Example: logps [-1, -2], ref_logps [-1.5, -1], score 3, beta 0.1: kl = [0.5, -1],
    rewards = [-0.05, 0.1 + 3] = [-0.05, 3.1].
    """
    mask_f = mask.to(logps.dtype)
    kl = (logps - ref_logps) * mask_f
    rewards = -kl_coef * kl
    last = response_last_index(mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards = rewards.index_put((rows, last), rewards[rows, last] + scores.to(rewards.dtype))
    return rewards, kl


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens (Schulman et al. 2016, eqs. 11-16).

    `delta_t = r_t + gamma * V_{t+1} - V_t` and `A_t = delta_t + gamma * lam * A_{t+1}`, where `V_{t+1}` and
    `A_{t+1}` count as 0 when position t + 1 is not a response token (after the last one: the episode ends).
    Returns are `A_t + V_t`, the value targets.

    Args:
        rewards: [N, T] per-token rewards (`kl_penalty_rewards`).
        values: [N, T] the critic's values at rollout time.
        mask: [N, T] 1 on response tokens.
        gamma: discount.
        lam: GAE's lambda.

    Returns:
        `(advantages, returns)`, [N, T], 0 outside the mask.

    Example (gamma 1, lam 0.5):
        row 1: rewards [0, 0, 1], values [0.5, 0.5, 0.5], mask [1, 1, 1]:
            t=2: delta = 1 + 0 - 0.5 = 0.5, A = 0.5
            t=1: delta = 0 + 0.5 - 0.5 = 0, A = 0 + 0.5 * 0.5 = 0.25
            t=0: delta = 0, A = 0.5 * 0.25 = 0.125; returns [0.625, 0.75, 1.0]
        row 2: rewards [0, 2, 0], values [1, 0.5, 9], mask [1, 1, 0]:
            t=2 masked: A = 0
            t=1: delta = 2 + 0 - 0.5 = 1.5 (t=2 is past the end), A = 1.5
            t=0: delta = 0 + 0.5 - 1 = -0.5, A = -0.5 + 0.5 * 1.5 = 0.25; returns [1.25, 2.0, 0]
    """
    mask_f = mask.to(values.dtype)
    values = values * mask_f
    length = rewards.shape[1]
    advantages = torch.zeros_like(values)
    next_advantage = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = (delta + gamma * lam * next_advantage) * mask_f[:, t]
        advantages[:, t] = advantage
        # What position t - 1 sees as "next": this position's value and advantage, or 0 past the end.
        next_value, next_advantage = values[:, t], advantage
    returns = (advantages + values) * mask_f
    return advantages, returns


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


def truncate_to_lengths(mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Cut each row's response mask to its first `lengths[i]` tokens.

    Args:
        mask: [N, T] response mask (1 up to and including the stop token).
        lengths: [N] most tokens each response keeps.

    Returns:
        [N, T] same dtype. Example: mask [[1, 1, 1, 0], [1, 1, 1, 1]], lengths [2, 3] ->
        [[1, 1, 0, 0], [1, 1, 1, 0]].
    """
    positions = torch.arange(mask.shape[1], device=mask.device)
    return mask * (positions.unsqueeze(0) < lengths.to(mask.device).unsqueeze(1)).to(mask.dtype)


def sample_response_lengths(low: int, high: int, count: int, seed: int, step: int) -> torch.Tensor:
    """The length sampler: `count` response lengths drawn uniformly from `[low, high]` (both included).

    Seeded by `(seed, step)` alone (numpy's `SeedSequence`), so step k draws the same lengths in a resumed
    run as in an uninterrupted one, without any state to save, and the global RNG is not touched.

    Returns:
        [count] long tensor.
    """
    if not 1 <= low <= high:
        raise ValueError(f"response lengths [{low}, {high}]: need 1 <= low <= high.")
    rng = np.random.default_rng([seed, step])
    return torch.as_tensor(rng.integers(low, high + 1, size=count), dtype=torch.long)


class FixedKLController:
    """A constant KL coefficient (`adap_kl_ctrl: false`)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing changes."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019's adaptive KL coefficient (section 2.2): steer the measured KL towards `target`.

    After each rollout of `n_steps` samples with mean (per-response, summed over tokens) KL `kl`:
    `err = clip(kl / target - 1, -0.2, 0.2)`, `kl_coef *= 1 + err * n_steps / horizon`.

    Example (init 0.2, target 6, horizon 10000): kl 9, n_steps 256: err = clip(0.5) = 0.2,
    coef = 0.2 * (1 + 0.2 * 256 / 10000) = 0.2 * 1.00512 = 0.201024; then kl 5.4: err = -0.1,
    coef = 0.201024 * (1 - 0.1 * 256 / 10000) = 0.201024 * 0.99744 = 0.2005094.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        super().__init__(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


class RunningMoments:
    """Running mean and (Bessel-corrected) standard deviation of every score seen (`ppo_score_norm`).

    Batches are merged with Chan et al.'s parallel formula, so the result equals the moments of all values
    at once. Example: [1, 2, 3] -> mean 2, std 1; then [5] -> over 1, 2, 3, 5: mean 2.75, squared deviations
    3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75, std sqrt(8.75 / 3) = 1.707825.
    """

    def __init__(self) -> None:
        self.mean, self.m2, self.count = 0.0, 0.0, 0

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0

    def update(self, values: torch.Tensor) -> None:
        values = values.detach().double().flatten()
        n = values.numel()
        if n == 0:
            return
        batch_mean = values.mean().item()
        batch_m2 = ((values - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta ** 2 * self.count * n / total
        self.count = total

    def normalize(self, values: torch.Tensor) -> torch.Tensor:
        """`(values - mean) / (std + 1e-8)` with the moments as they stand."""
        return (values - self.mean) / (self.std + 1e-8)

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "m2": self.m2, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.m2, self.count = float(state["mean"]), float(state["m2"]), int(state["count"])
