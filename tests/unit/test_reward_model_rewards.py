"""Reward models in `reward_funcs`: an rm run's LoRA adapter on the policy's base (no second copy of the
base, the policy unchanged after scoring) and a reward model on its own, both equal to `alignkit score`."""

from __future__ import annotations

import logging

import pytest
import torch

from alignkit.config.parse import parse_config
from alignkit.data.template import ChatFormatter
from alignkit.errors import ConfigError
from alignkit.model.loader import load_model, load_tokenizer
from alignkit.model.logprobs import forward_token_logps
from alignkit.rewards import RewardFunctionArguments, build_reward_functions
from alignkit.rewards.model import AdapterRewardModel, FullRewardModel
from alignkit.rewards.scoring import RewardScorer

PROMPTS = ["How many legs does a cat have?", [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "What is 2 + 2?"}], "Name a colour."]
COMPLETIONS = ["A cat has 4 legs.", [{"role": "assistant", "content": "4"}], "Blue, like the sky on a clear day."]
RESPONSES = ["A cat has 4 legs.", "4", "Blue, like the sky on a clear day."]


@pytest.fixture
def rm_dir(reward_adapter_dir):
    return reward_adapter_dir


def _policy(model_dir, finetuning_type="lora", over=None):
    config = parse_config({"model_name_or_path": str(model_dir), "finetuning_type": finetuning_type,
                           "adapter_name_or_path": over and str(over)})
    model = load_model(config.model, config.finetuning, is_trainable=True)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # a non-zero policy adapter, so a wrong switch would show in the log-probs
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model, ChatFormatter(load_tokenizer(config.model)), config.model


def _expected_scores(rm_dir):
    """What `alignkit score` gives for the same (prompt, response) pairs."""
    return torch.tensor(RewardScorer(rm_dir).score(PROMPTS, RESPONSES))


def test_lora_reward_model_equals_alignkit_score_and_shares_the_base(tiny_model_dir, rm_dir, float64_models):
    policy, formatter, model_args = _policy(tiny_model_dir)
    base_storage = {n: p.data_ptr() for n, p in policy.named_parameters() if "lora_" not in n}
    numel_before = sum(p.numel() for p in policy.parameters())

    rewards = build_reward_functions(RewardFunctionArguments(reward_funcs=[str(rm_dir)]), model=policy,
                                     formatter=formatter, model_args=model_args)
    function = rewards.functions[0].function
    assert isinstance(function, AdapterRewardModel) and function.policy is policy
    assert rewards.names == ["rm_lora"]
    # No second copy of the base: the base tensors are the same storage, and the only new parameters are
    # the reward adapter's LoRA matrices (the head is a separate small nn.Linear).
    assert {n: p.data_ptr() for n, p in policy.named_parameters() if "lora_" not in n} == base_storage
    added = sum(p.numel() for p in policy.parameters()) - numel_before
    reward_lora = sum(p.numel() for n, p in policy.named_parameters() if ".reward." in n)
    assert added == reward_lora > 0
    assert all("lora_A" in n or "lora_B" in n for n, _ in policy.named_parameters() if ".reward." in n)

    got = rewards(PROMPTS, COMPLETIONS, {})[:, 0]
    expected = _expected_scores(rm_dir)
    # The scorer merges the adapter into the weights (rounded once), the named adapter adds its delta to the
    # activations: both in float64, so equal up to one float32 ulp of the rewards (`float64_models`).
    torch.testing.assert_close(got, expected, **float64_models)
    assert expected.std() > 1e-3  # the texts score differently, so a misrendered text would show


def test_scoring_leaves_the_policy_log_probs_unchanged(tiny_model_dir, rm_dir):
    policy, formatter, model_args = _policy(tiny_model_dir)
    ids = torch.tensor([[5, 17, 40, 9, 11, 12], [7, 8, 11, 30, 31, 32]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        before, _ = forward_token_logps(policy, ids, mask, ids)
    flags = {n: p.requires_grad for n, p in policy.named_parameters()}
    rewards = build_reward_functions(RewardFunctionArguments(reward_funcs=[str(rm_dir)]), model=policy,
                                     formatter=formatter, model_args=model_args)
    policy.train()
    rewards(PROMPTS, COMPLETIONS, {})
    with torch.no_grad():
        after, _ = forward_token_logps(policy, ids, mask, ids)
    assert torch.equal(before, after)
    assert policy.active_adapters == ["default"] and policy.training
    after_flags = {n: p.requires_grad for n, p in policy.named_parameters()}
    assert {n: after_flags[n] for n in flags} == flags  # the policy's trainable set is as before
    assert not any(f for n, f in after_flags.items() if n not in flags)  # the reward adapter is frozen


def test_full_reward_model_is_alignkit_score(tiny_model_dir, rm_dir):
    policy, formatter, model_args = _policy(tiny_model_dir)
    args = RewardFunctionArguments(reward_funcs=[str(rm_dir)], reward_model_type="full")
    rewards = build_reward_functions(args, model=policy, formatter=formatter, model_args=model_args)
    assert isinstance(rewards.functions[0].function, FullRewardModel)
    assert not any(".reward" in n for n, _ in policy.named_parameters())  # nothing loaded onto the policy
    torch.testing.assert_close(rewards(PROMPTS, COMPLETIONS, {})[:, 0], _expected_scores(rm_dir), atol=0, rtol=0)


def test_auto_loads_on_its_own_for_a_policy_without_lora(tiny_model_dir, rm_dir):
    policy, formatter, model_args = _policy(tiny_model_dir, finetuning_type="full")
    rewards = build_reward_functions(RewardFunctionArguments(reward_funcs=[str(rm_dir)]), model=policy,
                                     formatter=formatter, model_args=model_args)
    assert isinstance(rewards.functions[0].function, FullRewardModel)
    with pytest.raises(ConfigError, match="needs the policy under LoRA"):
        build_reward_functions(RewardFunctionArguments(reward_funcs=[str(rm_dir)], reward_model_type="lora"),
                               model=policy, formatter=formatter, model_args=model_args)


def test_two_reward_adapters_get_their_own_names_and_relative_dirs_resolve(tiny_model_dir, rm_dir):
    policy, formatter, model_args = _policy(tiny_model_dir)
    args = RewardFunctionArguments(reward_funcs=["rm_lora", str(rm_dir)], reward_weights=[1.0, -1.0])
    rewards = build_reward_functions(args, model=policy, formatter=formatter, model_args=model_args,
                                     config_dir=str(rm_dir.parent))
    assert rewards.names == ["rm_lora", "rm_lora_2"]
    assert sorted(policy.peft_config) == ["default", "reward", "reward_2"]
    out = rewards(PROMPTS, COMPLETIONS, {})
    torch.testing.assert_close(out[:, 0], out[:, 1], atol=0, rtol=0)


def test_a_spec_that_is_no_directory_is_a_config_error(tiny_model_dir, tmp_path):
    policy, formatter, model_args = _policy(tiny_model_dir)
    with pytest.raises(ConfigError, match="not a built-in.*reward model directory.*stage: rm"):
        build_reward_functions(RewardFunctionArguments(reward_funcs=["runs/no_such_rm"]), model=policy,
                               formatter=formatter, config_dir=str(tmp_path))


def test_a_reward_adapter_shares_the_base_only_when_trained_over_the_policys_adapters(
        tiny_model_dir, tmp_path, rm_dir, save_perturbed_adapter, caplog, request):
    """An RM trained from the SFT adapter the policy starts from is an adapter on the policy's base; an RM
    trained on another chain (the bare base here, or from SFT for a policy without it) is loaded on its own with
    its own base chain, with a warning saying why and what it costs, and explicit `lora` refuses it. Each reward
    is `alignkit score`'s."""
    sft = tmp_path / "sft"
    save_perturbed_adapter(tiny_model_dir, sft, seed=3)
    rm_sft = tmp_path / "rm_sft"
    trained = save_perturbed_adapter(tiny_model_dir, rm_sft, head="reward", seed=4, over=sft)
    with torch.no_grad():
        trained.base_model.model.score.modules_to_save["default"].weight.add_(1.0)
    trained.save_pretrained(rm_sft)
    close = request.getfixturevalue("float64_models")  # the adapters are saved (float32); what loads now is float64
    policy, formatter, model_args = _policy(tiny_model_dir, over=sft)

    def build(spec, policy=policy, **keys):
        return build_reward_functions(RewardFunctionArguments(reward_funcs=[str(spec)], **keys), model=policy,
                                      formatter=formatter, model_args=model_args)

    shared = build(rm_sft)
    assert isinstance(shared.functions[0].function, AdapterRewardModel)
    # Unmerged against `alignkit score`'s merged load, in float64: one float32 ulp apart at most.
    torch.testing.assert_close(shared(PROMPTS, COMPLETIONS, {})[:, 0], _expected_scores(rm_sft), **close)

    caplog.set_level(logging.WARNING, logger="alignkit.rewards.model")
    alone = build(rm_dir)
    assert isinstance(alone.functions[0].function, FullRewardModel)
    assert sorted(policy.peft_config) == ["default", "reward"]  # nothing more loaded onto the policy
    assert f"trained on the bare base, the policy's base is the base + {sft.resolve()}" in caplog.text
    assert "second copy of the base model in memory" in caplog.text and " MB)" in caplog.text
    torch.testing.assert_close(alone(PROMPTS, COMPLETIONS, {})[:, 0], _expected_scores(rm_dir), atol=0, rtol=0)
    with pytest.raises(ConfigError, match="trained on the bare base.*would not score as the reward model does"):
        build(rm_dir, reward_model_type="lora")

    bare_policy, _, _ = _policy(tiny_model_dir)
    from_sft = build(rm_sft, policy=bare_policy)
    assert isinstance(from_sft.functions[0].function, FullRewardModel)
    torch.testing.assert_close(from_sft(PROMPTS, COMPLETIONS, {})[:, 0], _expected_scores(rm_sft), atol=0, rtol=0)
