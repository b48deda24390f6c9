"""What PPO refuses (checked before anything loads), and its arguments, re-exported from `alignkit.stages.arguments`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..arguments import PPOArguments

if TYPE_CHECKING:
    from ...config import Config

# The examples `data.get_dataset` builds for this stage (`formats.DATA_KINDS`); the registry records it too.
DATA_KIND = "prompt"

PPO_STATE_FILE = "ppo_state.json"
CRITIC_ADAPTER = "critic"


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
    m.check_run("ppo", t)
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


__all__ = ["CRITIC_ADAPTER", "DATA_KIND", "FSDP_REFUSAL", "PPO_STATE_FILE", "PPOArguments", "check_config",
           "deepspeed_refusal"]
