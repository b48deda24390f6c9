"""KL to the reference: per-token estimators, PPO's KL-penalised rewards and the KL coefficient controllers.

- `k3_kl`: Schulman's k3 estimator, GRPO's penalty term in the loss.
- `sequence_log_ratio`: the sampled log-ratio per token and its sum per sequence (RLOO's KL in the reward).
- `kl_penalty_rewards`: PPO's per-token rewards, the sampled log-ratio (k1) as a penalty, the score at the end.
- `FixedKLController`, `AdaptiveKLController`: PPO's KL coefficient, fixed or steered to a target (Ziegler et al.).
"""

from __future__ import annotations

import torch

from .stats import response_last_index


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(pi || pi_ref) per token (Schulman 2020; DeepSeekMath eq. 4).

    `exp(ref - logp) - (ref - logp) - 1`, >= 0, and 0 where the two agree. Example: ref - logp = ln 2 →
    2 - 0.693147 - 1 = 0.306853.

    Args:
        logps, ref_logps: `[N, C]` policy and reference log-probs of the same tokens.
    """
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def sequence_log_ratio(logps: torch.Tensor, ref_logps: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled log-ratio (k1) per token and summed per sequence: RLOO's KL estimate (Ahmadian et al. 2024).

    `kl_t = logp_t - ref_logp_t` on counted tokens (0 elsewhere; it may be negative), `kl = sum_t kl_t`.

    Example: logps [[-1, -2, -3]], ref [[-1.5, -1, 0]], mask [[1, 1, 0]] → per token [[0.5, -1, 0]], sum [-0.5].

    Args:
        logps, ref_logps: `[N, C]` the policy's (at rollout) and the reference's log-probs of the same tokens.
        mask: `[N, C]` 1 on tokens that count.

    Returns:
        `(per_token [N, C], per_sequence [N])`.
    """
    per_token = (logps - ref_logps) * mask.to(logps.dtype)
    return per_token, per_token.sum(-1)


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


__all__ = ["k3_kl", "sequence_log_ratio", "kl_penalty_rewards", "FixedKLController", "AdaptiveKLController"]
