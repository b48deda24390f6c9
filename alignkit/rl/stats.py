"""Masked and NaN-aware statistics of the online stages: pure tensor functions, no trainer, no config.

- `masked_mean`, `masked_var`, `masked_whiten`: over the positions a mask marks (response tokens), optionally
  over the rows of every process (`reduce_sum`), as PPO whitens its rewards and advantages.
- `nan_std`: a sample standard deviation that skips NaN (a completion no reward function scored), as GRPO's
  group statistics need.
- `response_last_index`: each row's last masked position (where a sequence-level score lands).
- `RunningMoments`: the running mean and std of every score seen (PPO's `ppo_score_norm`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is 1 (0 when there are none)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def nan_std(values: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sample standard deviation (Bessel-corrected) ignoring NaN; NaN where fewer than 2 values remain.

    Example: [1, 3, NaN] → mean 2, squared deviations 1 and 1, variance 2 / (2 - 1) = 2, std 1.4142.
    """
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim)
    squares = torch.nansum((values - mean) ** 2, dim=dim)
    variance = squares / (count - 1).clamp(min=1)
    return torch.where(count > 1, variance.sqrt(), torch.full_like(variance, float("nan")))


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


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """Standardise `values` over the masked positions: `(x - mean) / sqrt(var + 1e-8)`, 0 where masked out.

    Args:
        values: [N, T] float.
        mask: [N, T], 1 on response tokens.
        shift_mean: False adds the mean back (scale only), as TRL 0.x whitened rewards.
        reduce_sum: sums a tensor over all processes (each holding some rows of the batch), so mean and
            variance are those of the whole batch; None: this batch alone.

    Returns:
        [N, T]. Example: values [2, 4, 6 | 99 masked]: mean 4, unbiased var 4 (std 2) -> [-1, 0, 1, 0];
        with shift_mean=False -> [3, 4, 5, 0]. Split over two processes as [2, 4] and [6]: sums 6 + 6 = 12
        over 2 + 1 = 3 tokens, mean 4; squared deviations 4 + 0 and 4, var 8 / 2 = 4: the same result.
    """
    if reduce_sum is None:
        mean, variance = masked_mean(values, mask), masked_var(values, mask)
    else:
        mask_f = mask.to(values.dtype)
        total, count = reduce_sum(torch.stack([(values * mask_f).sum(), mask_f.sum()])).unbind()
        mean = total / count.clamp(min=1.0)
        variance = reduce_sum(((values - mean) ** 2 * mask_f).sum()) / count.clamp(min=1.0)
        if count < 2:
            raise ValueError("whitening needs at least two response tokens in the rollout; raise the batch or "
                             "the response lengths.")
        variance = variance * count / (count - 1)
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


__all__ = ["masked_mean", "masked_var", "masked_whiten", "nan_std", "response_last_index", "RunningMoments"]
