"""The core every online stage stands on: pure maths, rollout pieces and the rollout record.

- `stats`: masked mean / variance / whitening, NaN-aware std, running moments.
- `advantages`: the advantage estimators behind one registry (`ADVANTAGE_ESTIMATORS`).
- `kl`: KL estimators, PPO's KL-penalised rewards, the KL coefficient controllers.
- `losses`: clipped policy and value losses, the token-loss aggregations.
- `rollout`: sampling completions, their per-token log-probs, scoring them.
- `record`: `completions.jsonl`, one schema for every online stage.
The trainer base class that uses them, `stages.online.OnlineTrainer`, sits with the stages: nothing here imports
a stage.
"""
