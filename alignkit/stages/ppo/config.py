"""PPO's arguments and what it refuses (checked before anything loads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional

from ...rewards import RewardFunctionArguments

if TYPE_CHECKING:
    from ...config import Config

# The examples `data.get_dataset` builds for this stage (`formats.DATA_KINDS`); the registry records it too.
DATA_KIND = "prompt"

PPO_STATE_FILE = "ppo_state.json"
CRITIC_ADAPTER = "critic"


@dataclass
class PPOArguments(RewardFunctionArguments):
    """The keys of `stage: ppo` (plus the reward keys it shares with GRPO: `reward_funcs`, `reward_weights`,
    `reward_model_type`, `log_completions`, ...).

    Defaults are those of TRL 0.x's `PPOConfig` (the last TRL with this PPO) and LLaMA-Factory's PPO keys,
    except where a help text says otherwise.
    """

    reward_model: Optional[str] = field(
        default=None,
        metadata={"help": "Reward model: an rm run's output_dir (LLaMA-Factory's key). Its score is added to any "
                  "`reward_funcs` (weight 1). `reward_model_type` says how it is held: `lora` a second adapter "
                  "on the policy's base, `full` on its own, `auto` (default) lora when it fits."},
    )
    ppo_critic: Literal["head", "adapter"] = field(
        default="head",
        metadata={"help": "`head` (default): a value head on the policy's hidden states (the original PPO-with-PEFT "
                  "design); `adapter`: the critic gets its own LoRA adapter and head, both initialised from the "
                  "LoRA reward model (InstructGPT style; one more decoder pass per update)."},
    )
    ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout (TRL 0.x and LLaMA-Factory: 4)."})
    ppo_buffer_size: int = field(
        default=1,
        metadata={"help": "Rollout size in optimizer steps: a rollout holds per_device_train_batch_size x "
                  "gradient_accumulation_steps x ppo_buffer_size prompts (LLaMA-Factory's key, default 1)."},
    )
    ppo_score_norm: bool = field(
        default=False,
        metadata={"help": "Normalise scores by the running mean and std of all scores so far (LLaMA-Factory's key)."},
    )
    ppo_whiten_rewards: bool = field(
        default=False, metadata={"help": "Whiten the per-token rewards (scale only) before GAE (LLaMA-Factory's key)."}
    )
    ppo_target: float = field(
        default=6.0, metadata={"help": "Target KL (nats per response) of the adaptive KL controller (TRL: 6)."}
    )
    init_kl_coef: float = field(
        default=0.2, metadata={"help": "Initial (or, with adap_kl_ctrl false, fixed) KL coefficient (TRL: 0.2)."}
    )
    adap_kl_ctrl: bool = field(
        default=True, metadata={"help": "Adapt the KL coefficient towards ppo_target (Ziegler et al.; TRL: true)."}
    )
    horizon: int = field(default=10000, metadata={"help": "Horizon of the adaptive KL controller (TRL: 10000)."})
    gamma: float = field(default=1.0, metadata={"help": "Discount over response tokens (TRL: 1)."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda (TRL: 0.95)."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip range (TRL: 0.2)."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range (TRL: 0.2)."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss (TRL: 0.1)."})
    mini_batch_size: Optional[int] = field(
        default=None,
        metadata={"help": "Rows per forward/backward pass in the PPO update (default per_device_train_batch_size). "
                  "One optimizer step covers per_device_train_batch_size x gradient_accumulation_steps rows; TRL "
                  "0.x's default of 128 (with batch 128) is a GPU size, so it follows the batch here instead."},
    )
    whiten_advantages: bool = field(
        default=True, metadata={"help": "Whiten the advantages over the rollout's response tokens (TRL: always)."}
    )
    response_length_range: Optional[list[int]] = field(
        default=None,
        metadata={"help": "`min,max` (both included): each response is cut to a length drawn uniformly from this "
                  "range (the length sampler), or ends at its end of turn before. Unset (default): responses end at "
                  "their end of turn or at max_new_tokens."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        from ...errors import ConfigError

        if self.response_length_range is not None:
            try:
                self.response_length_range = [int(v) for v in self.response_length_range]
            except (TypeError, ValueError):
                raise ConfigError(f"response_length_range={self.response_length_range!r}: give two integers "
                                  "`min,max`.") from None
            if len(self.response_length_range) != 2 or not 1 <= self.response_length_range[0] \
                    <= self.response_length_range[1]:
                raise ConfigError(f"response_length_range={self.response_length_range}: give `min,max` with "
                                  "1 <= min <= max (e.g. 16,64).")
        for key in ("ppo_epochs", "ppo_buffer_size", "horizon"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be at least 1.")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ConfigError(f"mini_batch_size={self.mini_batch_size} must be at least 1.")
        for key in ("ppo_target", "cliprange", "cliprange_value"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be > 0.")
        for key in ("init_kl_coef", "vf_coef"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 0.")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"gamma={self.gamma} and lam={self.lam} must lie in [0, 1].")


# Why PPO refuses FSDP1 (see the module docstring).
FSDP_REFUSAL = (
    "stage ppo does not run under FSDP1 (fsdp_config version 1, or fsdp_version: 1 in an accelerate config): its "
    "loop is written for FSDP2 (torch's fully_shard), where the value head, read on the hidden states after the "
    "model's call, is a whole tensor from the root unit's forward to its backward; FSDP1 flattens the root unit's "
    "parameters (embeddings, final norm, output layer, value head) into one buffer that it gathers only inside the "
    "wrapper's own forward, and no FSDP1 path is written or tested. Use FSDP2 (fsdp_config: {version: 2}, "
    "transformers' default, or fsdp_version: 2 in the accelerate config), DeepSpeed, or plain data parallelism.")


def deepspeed_refusal(ds_config: dict[str, Any]) -> Optional[str]:
    """Why PPO's loop cannot run under this DeepSpeed config, or None when it can.

    A `scheduler` block is refused: DeepSpeed steps its scheduler at each optimizer step, while PPO's learning-rate
    schedule advances once per PPO step (several optimizer steps). ZeRO-3 runs with every finetuning_type and with
    `adapter_name_or_path` (module docstring).

    Args:
        ds_config: the DeepSpeed JSON as a dict (`TrainingArguments.hf_deepspeed_config.config`).
    """
    if "scheduler" in ds_config:
        return ("stage ppo: remove the `scheduler` block of the DeepSpeed config. DeepSpeed would step it at every "
                "optimizer step; PPO advances its learning-rate schedule (lr_scheduler_type, warmup_steps) once "
                "per PPO step, with the Trainer's scheduler.")
    return None


def check_config(config: "Config") -> None:
    """What only PPO forbids, before the model loads."""
    from ...errors import ConfigError

    m, t = config.method, config.training
    if t.do_train and not m.reward_model and not m.reward_funcs:
        raise ConfigError("stage ppo needs a reward: set `reward_model` (an rm run's output_dir) and/or "
                          "`reward_funcs`.")
    if m.ppo_critic == "adapter":
        if config.finetuning.finetuning_type != "lora" or not m.reward_model or m.reward_model_type == "full":
            raise ConfigError("ppo_critic=adapter initialises the critic from a LoRA reward model: it needs "
                              "finetuning_type lora, `reward_model` set to an rm run's LoRA output and "
                              "reward_model_type lora or auto. Use ppo_critic: head otherwise.")
    if t.fsdp and int((t.fsdp_config or {}).get("version", 2)) != 2:  # transformers' default version is 2
        raise ConfigError(FSDP_REFUSAL)
    if t.deepspeed:
        # Before the model loads: under ZeRO-3, transformers would load it partitioned.
        reason = deepspeed_refusal(t.hf_deepspeed_config.config)
        if reason:
            raise ConfigError(reason)
    if t.do_eval or t.do_predict:
        raise ConfigError("stage ppo trains only: set do_eval and do_predict to false (score the trained policy "
                          "with `alignkit score`).")
    if t.train_sampling_strategy != "random":
        raise ConfigError(f"train_sampling_strategy={t.train_sampling_strategy}: stage ppo draws each step's prompts "
                          "from a seeded shuffle of the dataset (data_seed, else seed); remove it.")
    if t.torch_compile:
        raise ConfigError("torch_compile: stage ppo's loop calls the model uncompiled (transformers compiles it in "
                          "its own loop, which PPO's replaces); remove the key.")
    if t.auto_find_batch_size:
        raise ConfigError("auto_find_batch_size: stage ppo sizes its rollouts from per_device_train_batch_size x "
                          "gradient_accumulation_steps x ppo_buffer_size and cannot shrink them on an out-of-memory "
                          "error; remove the key and lower per_device_train_batch_size if memory runs out.")
    if t.neftune_noise_alpha is not None:
        # Its hook would noise whichever of PPO's passes run in train mode (the rollout's first pass among them),
        # not a defined algorithm.
        raise ConfigError("neftune_noise_alpha: stage ppo does not apply NEFTune's embedding noise; remove the key "
                          "(NEFTune applies to sft, pt, rm, dpo, kto and the GRPO-family stages).")
    batch = t.per_device_train_batch_size * t.gradient_accumulation_steps
    if m.mini_batch_size is not None and batch % m.mini_batch_size:
        raise ConfigError(f"mini_batch_size={m.mini_batch_size} must divide per_device_train_batch_size x "
                          f"gradient_accumulation_steps = {batch}.")
