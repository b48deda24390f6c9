"""PPO against a reward model, the classic RLHF third stage, with LoRA on one shared base model.

The design is the original PPO-with-PEFT one (Ziegler et al. 2019's loop, as TRL 0.x and LLaMA-Factory's
old PPO ran it): the policy is a LoRA adapter; its reference is the same base with that adapter disabled
(an SFT adapter given as `adapter_name_or_path` is merged into the base when the model loads, so it belongs
to the reference); the reward model is the rm stage's LoRA output loaded as a second, frozen, named adapter
with its score head and switched in only to score (when it was trained over the same merged adapters as the
policy, as `examples/ppo_lora.yaml`'s RM from the SFT adapter is; otherwise it is loaded on its own with its own
base, see `alignkit.rewards.model`); the critic is a value head on the policy's hidden states
(or, `ppo_critic: adapter`, a third adapter with its own head). One copy of the base weights in memory serves
every role.

One PPO step, top to bottom (`PPOTrainer.train`):

1. Rollout: take the next `per_device_train_batch_size x gradient_accumulation_steps x ppo_buffer_size`
   prompts; sample one response each from the policy (temperature 1, no top-k/top-p: the log-probs and the
   KL below are those of the distribution actually sampled), each cut to a length drawn from
   `response_length_range` or stopping at the template's end of turn within `max_new_tokens`.
2. Score: the reward model reads each prompt + response at its last token (and/or `reward_funcs`).
3. Old log-probs and values of the policy, reference log-probs with the adapter disabled; per-token reward
   `-kl_coef * (logp - ref_logp)` with the score added at the response's last token (`kl_penalty_rewards`).
4. GAE over the response tokens (`alignkit.rl.advantages.gae_advantages`), advantages whitened.
5. `ppo_epochs` passes over the rollout in shuffled batches of `per_device_train_batch_size x
   gradient_accumulation_steps` rows (run `mini_batch_size` rows at a time): clipped policy loss + `vf_coef` x
   clipped value loss, gradient clipping at `max_grad_norm`, one optimizer step per batch.
6. The KL coefficient adapts to the rollout's KL (`AdaptiveKLController`), the scheduler steps once.

The stage is split by job: `config` (refusals; its arguments are in `stages/arguments.py`), `layout` (response
lengths, `pack_right`, `policy_forward`, `Rollout`), `trainer` (the loop, `PPOTrainer`, and the private `Trainer`
members it relies on, `TRAINER_INTERNALS`), `build` (the entry point). The pure maths (whitening, GAE, KL penalty and controllers,
clipped losses) is in `alignkit.rl`. Design notes: `trainer`'s docstring and docs/stages/ppo.md.
"""

from __future__ import annotations

from ...model.distributed import full_weights
from .build import build_critic, build_ppo_trainer, reward_arguments, run_ppo
from .config import (CRITIC_ADAPTER, DATA_KIND, FSDP_REFUSAL, PPO_STATE_FILE, PPOArguments, check_config,
                     deepspeed_refusal)
from .layout import Rollout, pack_right, policy_forward, sample_response_lengths, truncate_to_lengths
from .trainer import TRAINER_INTERNALS, PPOTrainer

__all__ = [
    "CRITIC_ADAPTER",
    "DATA_KIND",
    "FSDP_REFUSAL",
    "PPO_STATE_FILE",
    "PPOArguments",
    "check_config",
    "deepspeed_refusal",
    "truncate_to_lengths",
    "sample_response_lengths",
    "pack_right",
    "policy_forward",
    "Rollout",
    "PPOTrainer",
    "TRAINER_INTERNALS",
    "build_critic",
    "reward_arguments",
    "build_ppo_trainer",
    "run_ppo",
    "full_weights",
]
