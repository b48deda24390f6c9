"""Advantage estimators: how an online stage turns rewards into the advantage its policy loss weighs.

`ADVANTAGE_ESTIMATORS` is the one registry (a plain dict, as `stages.STAGES` is): a stage names its estimator
(`OnlineTrainer.advantage_estimator`, e.g. GRPO's "group") and looks it up here. Two kinds plug in:
- outcome estimators, one advantage per completion from the `[N]` rewards of groups laid out contiguously
  (`num_generations` rows per prompt): `group_advantages` (GRPO: each reward against its group's mean and std),
  `leave_one_out_advantages` (RLOO: each reward against the mean of the *other* completions of its prompt);
  `decoupled_group_advantages` is GRPO's `normalize_then_sum` variant over the per-function rewards;
- token estimators: `reinforce_pp_advantages` (REINFORCE++: the KL folded into a token reward, returns whitened
  over the global batch, no critic) and `gae_advantages` over a critic's values (PPO).
Every estimator is a pure tensor function; the shapes are in each docstring.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .stats import nan_std


def group_advantages(rewards: torch.Tensor, num_generations: int,
                     scale_rewards: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages (DeepSeekMath eq. 3 with TRL 1.16's 1e-4): each reward against its group's mean.

    `A_i = (r_i - mean(group)) / (std + 1e-4)`, std of the group (`group`), of the whole batch (`batch`), or
    no division (`none`, Dr. GRPO). NaN rewards (no function scored the completion) are left out of the mean
    and std, and get advantage 0.

    Example (G = 2, group): rewards [1, 3, 2, 2] → groups (1, 3) and (2, 2); means 2, 2; stds sqrt(2), 0;
    A = [-1 / 1.4143, 1 / 1.4143, 0, 0] = [-0.70706, 0.70706, 0, 0]; the second group has std 0.

    Args:
        rewards: `[N]` combined rewards, groups contiguous (rows i*G .. i*G + G - 1 share a prompt).
        num_generations: G.
        scale_rewards: `group`, `batch` or `none`.

    Returns:
        `(advantages [N], std_is_zero [N] bool)`: the second marks rows whose std (of the group, or of the
        batch with `batch`) is 0, for the `frac_reward_zero_std` metric.
    """
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards in ("group", "none"):
        std = nan_std(grouped, dim=1).repeat_interleave(num_generations)
    elif scale_rewards == "batch":
        std = nan_std(rewards).expand_as(rewards)
    else:
        raise ValueError(f"scale_rewards={scale_rewards!r}: choose group, batch or none.")
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def decoupled_group_advantages(per_function: torch.Tensor, weights: torch.Tensor,
                               num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO's advantages (`multi_objective_aggregation: normalize_then_sum`, as TRL 1.16): normalise each reward
    function within its group first, sum the normalised rewards with their weights, then normalise the sums over
    the whole batch.

    `z_ik = (r_ik - mean_group(r_k)) / (std_group(r_k) + 1e-4)`, `s_i = sum_k w_k z_ik` (NaN z count as 0; a row
    that no function scored stays NaN), `A_i = (s_i - mean(s)) / (std(s) + 1e-4)`, NaN → 0.

    Example (G = 2, one function, weight 1): rewards [1, 3, 5, 5] → z = [-0.70706, 0.70706, 0, 0];
    mean 0, sample std sqrt(2 x 0.49994 / 3) = 0.57731 → A = [-1.22455, 1.22455, 0, 0].

    Args:
        per_function: `[N, F]` each function's reward (NaN: did not score), groups contiguous.
        weights: `[F]` the functions' weights.
        num_generations: G.

    Returns:
        `(advantages [N], std_is_zero [N] bool)` (the second from the batch std of the sums).
    """
    num_functions = per_function.shape[1]
    grouped = per_function.view(-1, num_generations, num_functions)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nan_std(grouped, dim=1).unsqueeze(1)
    normalised = ((grouped - mean) / (std + 1e-4)).view(-1, num_functions)
    sums = (normalised * weights.to(normalised).unsqueeze(0)).nansum(dim=1)
    sums[torch.isnan(per_function).all(dim=1)] = float("nan")
    batch_std = nan_std(sums).expand_as(sums)
    advantages = (sums - torch.nanmean(sums)) / (batch_std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(batch_std, torch.zeros_like(batch_std))


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int,
                             normalize_advantages: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO advantages (Ahmadian et al. 2024, eq. 5; Kool et al. 2019): each reward against the mean of the other
    completions of its prompt.

    `A_i = r_i - (sum_group - r_i) / (n - 1)`, n the group's scored completions (NaN rewards are left out and get
    advantage 0; a group with one scored completion gives 0). `normalize_advantages`: then `(A - mean) / (std +
    1e-4)` over the batch (TRL 1.16's `RLOOConfig.normalize_advantages`).

    Example (G = 3): rewards [1, 2, 6] → baselines [(2 + 6) / 2, (1 + 6) / 2, (1 + 2) / 2] = [4, 3.5, 1.5],
    A = [-3, -1.5, 4.5]. With [1, NaN, 3]: baselines [3, NaN, 1], A = [-2, 0, 2].

    Args:
        rewards: `[N]` rewards, groups contiguous.
        num_generations: G.
        normalize_advantages: whiten the advantages over the batch.

    Returns:
        `(advantages [N], std_is_zero [N // G] bool)`: the second per group, as TRL 1.16's RLOO logs
        `frac_reward_zero_std` over groups.
    """
    grouped = rewards.view(-1, num_generations)
    scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)
    advantages = rewards - baselines.view(-1)
    if normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nan_std(advantages) + 1e-4)
    std = nan_std(grouped, dim=1)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def reinforce_pp_advantages(
    scores: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, kl_coef: float,
    gamma: float = 1.0, reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantages (Hu 2025; OpenRLHF's `advantage_estimator: reinforce`): no critic, no group baseline;
    the KL penalty is folded into a token-level reward and the returns are whitened over the global batch.

    `r_t = -kl_coef x (logp_t - ref_logp_t)` (k1, at rollout time) on each response token, plus the completion's
    score at its last token; `G_t = r_t + gamma x G_{t+1}` (0 past the last token); then over every response
    token of the batch (all processes, with `reduce_sum`): `A_t = (G_t - mean) / sqrt(max(var, 1e-8))`, var the
    biased (divide by the count) variance, as OpenRLHF. 0 outside the mask. A row with no token counts nothing.

    Example (kl_coef 0.1, gamma 1): scores [1, 0], logps [[-1, -2], [-1, -1]], ref [[-1.5, -1], [-1, -1]],
    mask [[1, 1], [1, 0]]: k1 [[0.5, -1], [0, -]], rewards [[-0.05, 0.1 + 1], [0 + 0, -]];
    returns [[-0.05 + 1.1, 1.1], [0, -]] = [[1.05, 1.1], [0, -]]; mean 2.15 / 3 = 0.716667, deviations
    0.333333, 0.383333, -0.716667, var 0.771667 / 3 = 0.257222, std 0.507171 → A [[0.657241, 0.755827],
    [-1.413068, 0]].

    Args:
        scores: `[N]` one score per completion (the weighted reward).
        logps: `[N, T]` the policy's log-probs of the sampled tokens at rollout time.
        ref_logps: `[N, T]` the reference's.
        mask: `[N, T]` 1 on response tokens.
        kl_coef: the KL coefficient (the stage's `beta`).
        gamma: discount (OpenRLHF's default 1).
        reduce_sum: sums a tensor over all processes (each holding some rows); None: this batch alone.

    Returns:
        `(advantages [N, T], returns [N, T])`.
    """
    mask_f = mask.to(logps.dtype)
    rewards = -kl_coef * (logps - ref_logps) * mask_f
    has_token = mask_f.sum(-1) > 0
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = (positions * mask.ne(0).long()).argmax(dim=1)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards = rewards.index_put((rows, last), rewards[rows, last] + torch.where(has_token, scores.to(rewards.dtype),
                                                                                torch.zeros_like(rewards[:, 0])))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask_f[:, t]
        returns[:, t] = running
    totals = torch.stack([(returns * mask_f).sum(), mask_f.sum()])
    if reduce_sum is not None:
        totals = reduce_sum(totals)
    count = totals[1].clamp(min=1.0)
    mean = totals[0] / count
    squares = ((returns - mean) ** 2 * mask_f).sum()
    if reduce_sum is not None:
        squares = reduce_sum(squares)
    advantages = (returns - mean) * (squares / count).clamp(min=1e-8).rsqrt()
    return advantages * mask_f, returns


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


# name -> estimator. Outcome estimators: `(rewards [N], num_generations, scale_rewards | normalize_advantages) ->
# (advantages [N], std_is_zero)`; token estimators: `(... [N, T] ...) -> (advantages [N, T], returns [N, T])`, GAE
# from rewards and values, REINFORCE++ from scores and log-probs (see each docstring).
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "group": group_advantages,
    "leave_one_out": leave_one_out_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "gae": gae_advantages,
}


__all__ = ["ADVANTAGE_ESTIMATORS", "group_advantages", "decoupled_group_advantages", "leave_one_out_advantages",
           "reinforce_pp_advantages", "gae_advantages"]
