"""The PPO stage's entry point: load the policy, critic and rewards, build the trainer, run it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from .config import CRITIC_ADAPTER, DATA_KIND, PPOArguments
from .trainer import PPOTrainer

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from ...config import Config

def build_critic(model: nn.Module, ppo_args: PPOArguments, config_dir: Optional[str] = None):
    """The critic's value head, attached to the policy; with `ppo_critic: adapter` also its own LoRA adapter.

    `adapter`: the reward model's LoRA weights are loaded a second time as the trainable adapter `critic`, and the
    value head starts from its score head (the critic starts out predicting the reward model's score).

    Returns:
        The `ValueHead` (float32, trainable).
    """
    from ...model.heads import ValueHead, attach_value_head
    from ...rewards.model import resolve_reward_model_dir
    from ...rewards.reward_model import load_reward_adapter

    if ppo_args.ppo_critic == "head":
        return attach_value_head(model)
    reward_dir = resolve_reward_model_dir(ppo_args.reward_model, config_dir)
    # The critic only starts from the RM's weights and trains from there: another base is no error here.
    critic = load_reward_adapter(model, reward_dir, name=CRITIC_ADAPTER, check_base=False)
    for name, param in model.named_parameters():
        if f".{CRITIC_ADAPTER}." in name:
            param.requires_grad_(True)
    head = ValueHead(critic.head.in_features)
    with torch.no_grad():
        head.weight.copy_(critic.head.weight.float())
        if critic.head.bias is not None:
            head.bias.copy_(critic.head.bias.float())
    return attach_value_head(model, head)


def reward_arguments(ppo_args: PPOArguments) -> PPOArguments:
    """`ppo_args` with `reward_model` put first in `reward_funcs` (weight 1), so one `RewardFunctions` scores."""
    import dataclasses

    if not ppo_args.reward_model:
        return ppo_args
    weights = None
    if ppo_args.reward_weights is not None:
        weights = [1.0] + list(ppo_args.reward_weights)
    return dataclasses.replace(ppo_args, reward_funcs=[ppo_args.reward_model] + list(ppo_args.reward_funcs),
                               reward_weights=weights)


def build_ppo_trainer(config: "Config", callbacks: list["TrainerCallback"]) -> PPOTrainer:
    """Load the tokenizer, prompts, policy, critic and rewards, and build the `PPOTrainer` (`run_ppo` trains it)."""
    from ...data import get_dataset
    from ...data.template import ChatFormatter
    from ...model.loader import load_model, load_tokenizer
    from ...rewards import build_reward_functions, check_reward_functions
    from ..base import check_splits

    config_dir = config.dir
    check_reward_functions(config.method, config_dir=config_dir,  # before anything loads
                           max_completion_length=config.generating.max_new_tokens)
    tokenizer = load_tokenizer(config.model)
    datasets = get_dataset(config, tokenizer, DATA_KIND)
    check_splits(config, datasets)
    model = load_model(config.model, config.finetuning, is_trainable=True)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    formatter = ChatFormatter(tokenizer, config.data.template, config.data.default_system)
    ppo_args = config.method
    # The critic before the reward model: its adapter is a second load of the same rm output.
    value_head = build_critic(model, ppo_args, config_dir)
    reward_functions = build_reward_functions(reward_arguments(ppo_args), model=model, formatter=formatter,
                                              model_args=config.model, config_dir=config_dir,
                                              max_completion_length=config.generating.max_new_tokens)
    return PPOTrainer(
        model=model,
        args=config.training,
        processing_class=tokenizer,
        callbacks=callbacks,
        train_dataset=datasets.get("train_dataset"),
        ppo_args=ppo_args,
        reward_functions=reward_functions,
        formatter=formatter,
        value_head=value_head,
        max_new_tokens=config.generating.max_new_tokens,
    )


def run_ppo(config: "Config", callbacks: list["TrainerCallback"]) -> None:
    """Train a policy with PPO as `config` says; the policy adapter and value head go to `output_dir`."""
    from ..base import run_stage_trainer

    run_stage_trainer(build_ppo_trainer(config, callbacks), config)
