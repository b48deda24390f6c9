"""Named adapters on one base: an rm run's adapter + score head loaded beside the policy's adapter,
switched in to score and back, the reference with every adapter off, and the SFT-adapter rule."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import tiny_config
from alignkit.data.collator import pad_sequences
from alignkit.errors import ConfigError
from alignkit.model.adapters import adapters_disabled, use_adapter
from alignkit.model.loader import load_model, merged_adapters
from alignkit.model.logprobs import forward_token_logps
from alignkit.rewards.reward_model import load_reward_adapter
from alignkit.rewards.scoring import reward_adapter_rewards, sequence_rewards

PAD = 2
# Rows ending in a non-pad token, as ChatML turns do; one of them contains the pad id as a real token.
ROWS = [[5, 17, 40, 2, 9], [7, 8, 11], [30, 31, 32, 33, 34, 35, 36]]


def _pad(rows, side):
    """[N, L] ids and attention mask, padded on `side` with the pad id (which is also a real token here)."""
    return pad_sequences(rows, PAD, side), pad_sequences([[1] * len(row) for row in rows], 0, side)


def _perturb(model, adapter="default", seed=3):
    """Give an adapter non-zero lora_B (a fresh one is a no-op), so whether it is active shows in the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name and f".{adapter}." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


@pytest.fixture
def reward_dir(reward_adapter_dir):
    """An rm run's LoRA output (task_type SEQ_CLS, `score` in modules_to_save) with a trained-looking head."""
    return reward_adapter_dir


@pytest.fixture
def policy(tiny_model_dir):
    config = tiny_config(tiny_model_dir)
    model = load_model(config.model, config.finetuning, is_trainable=True)
    _perturb(model)
    return model


def _reward_model_rewards(model_dir, adapters, ids, mask, padding_free=False):
    """The rm run's rewards loaded the normal way (what `alignkit score` does)."""
    config = tiny_config(model_dir, adapter_name_or_path=adapters)
    model = load_model(config.model, config.finetuning, is_trainable=False, head="reward")
    with torch.no_grad():
        return sequence_rewards(model, ids, mask, padding_free=padding_free)


def test_saved_reward_adapter_keys_are_what_the_loader_expects(reward_dir):
    """PEFT 0.21.2 saves the score head under its module path, without the adapter name."""
    from safetensors import safe_open

    with safe_open(str(reward_dir / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert "base_model.model.score.weight" in keys
    assert all("lora_" in k for k in keys if k != "base_model.model.score.weight")


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("padding_free", [False, True])
def test_reward_adapter_scores_equal_the_reward_model(tiny_model_dir, reward_dir, float64_models, policy, side,
                                                     padding_free):
    ids, mask = _pad(ROWS, side)
    expected = _reward_model_rewards(tiny_model_dir, str(reward_dir), ids, mask, padding_free=padding_free)
    reward = load_reward_adapter(policy, reward_dir)
    policy.train()  # scoring does not depend on the mode: the reward adapter has no dropout
    got = reward_adapter_rewards(policy, reward, ids, mask, padding_free=padding_free)
    # The normal load merges the adapter into the weights (W + BA rounded once); unmerged, the delta is added to
    # the activations. Both in float64 (`float64_models`): equal up to one float32 ulp of the returned rewards.
    torch.testing.assert_close(got, expected, **float64_models)
    assert expected.std() > 1e-3  # rows score differently, so a misread position would show
    assert got.dtype == torch.float32 and not got.requires_grad
    # The head was read from the file (the fixture shifted it by +1) and is frozen.
    assert reward.head.weight.abs().min() > 0.5 and not reward.head.weight.requires_grad


def test_reward_adapter_scores_equal_the_unmerged_rm_it_was_saved_from(tiny_model_dir, tmp_path,
                                                                     save_perturbed_adapter, policy):
    """Against the RM in memory as the rm run held it (adapter unmerged): the same arithmetic, so 1e-5 flat."""
    out = tmp_path / "rm"
    trained = save_perturbed_adapter(tiny_model_dir, out, head="reward")
    reward = load_reward_adapter(policy, out)
    for side in ("right", "left"):
        ids, mask = _pad(ROWS, side)
        with torch.no_grad():
            expected = sequence_rewards(trained, ids, mask)
        torch.testing.assert_close(reward_adapter_rewards(policy, reward, ids, mask), expected, atol=1e-5, rtol=0)


def test_scoring_leaves_the_policy_bit_identical_and_grads_reach_only_the_policy(reward_dir, policy):
    ids, mask = _pad(ROWS, "right")
    labels = ids.masked_fill(mask == 0, -100)
    trainable = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    with torch.no_grad():
        before, _ = forward_token_logps(policy, ids, mask, labels)

    reward = load_reward_adapter(policy, reward_dir)
    flags = {n: p.requires_grad for n, p in policy.named_parameters()}
    reward_adapter_rewards(policy, reward, ids, mask)
    with torch.no_grad():
        after, _ = forward_token_logps(policy, ids, mask, labels)
        with use_adapter(policy, reward.name):
            with_reward, _ = forward_token_logps(policy, ids, mask, labels)

    assert torch.equal(before, after)
    # The switch really changes the model, so the equality above means it switched back.
    assert (with_reward - before).abs().max() > 1e-2
    assert {n: p.requires_grad for n, p in policy.named_parameters()} == flags
    assert sorted(n for n, f in flags.items() if f) == sorted(trainable)  # loading the adapter froze nothing new
    for name, value in trainable.items():
        assert torch.equal(dict(policy.named_parameters())[name], value), name
    assert policy.active_adapters == ["default"]

    logps, token_mask = forward_token_logps(policy, ids, mask, labels)
    (logps * token_mask).sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters()}
    assert all(g is not None for n, g in grads.items() if ".default." in n and "lora_" in n)
    assert all(g is None for n, g in grads.items() if ".default." not in n), \
        [n for n, g in grads.items() if g is not None and ".default." not in n][:3]
    assert reward.head.weight.grad is None


def test_use_adapter_switches_back_after_an_exception(reward_dir, policy):
    reward = load_reward_adapter(policy, reward_dir)
    flags = {n: p.requires_grad for n, p in policy.named_parameters()}
    with pytest.raises(ValueError, match="inside"):
        with use_adapter(policy, reward.name):
            assert policy.active_adapters == ["reward"]
            raise ValueError("inside")
    assert policy.active_adapters == ["default"] and policy.active_adapter == "default"
    assert {n: p.requires_grad for n, p in policy.named_parameters()} == flags
    with pytest.raises(KeyError, match="no adapter named 'critic'.*'default', 'reward'"):
        with use_adapter(policy, "critic"):
            pass
    with adapters_disabled(policy), pytest.raises(RuntimeError, match="every adapter disabled"):
        with use_adapter(policy, reward.name):
            pass
    assert policy.active_adapters == ["default"]
    assert {n: p.requires_grad for n, p in policy.named_parameters()} == flags


def test_peft_set_adapter_would_flip_requires_grad(reward_dir, policy):
    """Why `use_adapter` restores the flags: plain PEFT makes the switched-in adapter trainable and freezes
    the policy's (peft 0.21.2). If this stops failing, the guard is still harmless."""
    load_reward_adapter(policy, reward_dir)
    policy.set_adapter("reward")
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".reward." in n for n in trainable)


def test_adapters_disabled_is_base_plus_sft_and_keeps_flags(tiny_model_dir, tmp_path, save_perturbed_adapter):
    """The SFT rule: adapter_name_or_path is merged (recorded), the reference is base + SFT, the policy
    starts equal to it and adds a fresh adapter on top."""
    ids, mask = _pad(ROWS, "right")
    sft_dir = tmp_path / "sft"
    sft = save_perturbed_adapter(tiny_model_dir, sft_dir)
    with torch.no_grad():
        sft_logits = sft(input_ids=ids, attention_mask=mask).logits
        with sft.disable_adapter():
            base_logits = sft(input_ids=ids, attention_mask=mask).logits
    assert (sft_logits - base_logits).abs().max() > 1e-2

    config = tiny_config(tiny_model_dir, adapter_name_or_path=str(sft_dir))
    policy = load_model(config.model, config.finetuning, is_trainable=True)
    assert merged_adapters(policy) == (str(sft_dir),)
    assert set(policy.peft_config) == {"default"}  # the SFT adapter is in the weights, not a second adapter
    with torch.no_grad():
        torch.testing.assert_close(policy(input_ids=ids, attention_mask=mask).logits, sft_logits, atol=1e-5, rtol=0)
    _perturb(policy)
    # A frozen policy adapter (e.g. while generating) must stay frozen; PEFT's disable_adapter would unfreeze it.
    policy.requires_grad_(False)
    with torch.no_grad(), adapters_disabled(policy):
        reference = policy(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(reference, sft_logits, atol=1e-5, rtol=0)
    assert not any(p.requires_grad for p in policy.parameters())
    with torch.no_grad():
        assert (policy(input_ids=ids, attention_mask=mask).logits - sft_logits).abs().max() > 1e-2  # re-enabled
    with policy.disable_adapter():
        pass
    assert any(p.requires_grad for p in policy.parameters())  # what the wrapper guards against


def test_reward_adapter_trained_from_the_sft_adapter(tiny_model_dir, tmp_path, save_perturbed_adapter, caplog):
    """An RM started from the SFT adapter records it; on a policy with the same SFT adapter merged its rewards
    equal the RM loaded on its own (which merges the recorded SFT adapter, then the RM adapter). Without the
    record (an RM of the bare base) the same adapter is refused on that policy: it would score on the wrong
    base. As a starting point only (PPO's critic, `check_base=False`) it loads, and the mismatch is logged."""
    from alignkit.model.loader import BASE_ADAPTERS_FILE, save_base_adapters

    ids, mask = _pad(ROWS, "left")
    sft_dir, rm_dir = tmp_path / "sft", tmp_path / "rm_from_sft"
    save_perturbed_adapter(tiny_model_dir, sft_dir)
    config = tiny_config(tiny_model_dir, adapter_name_or_path=str(sft_dir))
    rm = load_model(config.model, config.finetuning, is_trainable=True, head="reward")
    _perturb(rm, seed=5)
    rm.save_pretrained(rm_dir)
    assert save_base_adapters(rm, rm_dir) == rm_dir / BASE_ADAPTERS_FILE
    expected = _reward_model_rewards(tiny_model_dir, str(rm_dir), ids, mask)
    torch.testing.assert_close(_reward_model_rewards(tiny_model_dir, f"{sft_dir},{rm_dir}", ids, mask), expected,
                               atol=0, rtol=0)

    policy = load_model(config.model, config.finetuning, is_trainable=True)
    reward = load_reward_adapter(policy, rm_dir)
    # Merged (expected) vs unmerged (got) LoRA rounding: the same bound as above.
    torch.testing.assert_close(reward_adapter_rewards(policy, reward, ids, mask), expected, atol=1e-5, rtol=1e-5)

    (rm_dir / BASE_ADAPTERS_FILE).unlink()
    with pytest.raises(ConfigError, match=r"rm_from_sft was trained on the bare base, the policy's base is the base "
                                          r"\+ .*/sft \(adapter_name_or_path\).*Load it on its own"):
        load_reward_adapter(policy, rm_dir, name="other")
    with caplog.at_level(logging.INFO, logger="alignkit.rewards.reward_model"):
        load_reward_adapter(policy, rm_dir, name="critic", check_base=False)
    assert "'critic' starts from the reward model's weights, on another base" in caplog.text


def test_reward_adapter_refusals(tiny_model_dir, tmp_path, reward_dir, policy, save_perturbed_adapter):
    # Given as adapter_name_or_path of a causal-LM stage it is still refused, pointing at the right key.
    config = tiny_config(tiny_model_dir, adapter_name_or_path=str(reward_dir))
    with pytest.raises(ConfigError, match="reward-model adapter.*causal LM.*`reward_model`"):
        load_model(config.model, config.finetuning, is_trainable=True)

    sft_dir = tmp_path / "sft"
    save_perturbed_adapter(tiny_model_dir, sft_dir)
    with pytest.raises(ConfigError, match="not a reward-model adapter"):
        load_reward_adapter(policy, sft_dir)
    load_reward_adapter(policy, reward_dir)
    with pytest.raises(ConfigError, match="'reward' is already loaded"):
        load_reward_adapter(policy, reward_dir)

    full = load_model(tiny_config(tiny_model_dir).model, tiny_config(tiny_model_dir).finetuning, is_trainable=False)
    with pytest.raises(TypeError, match="not a PEFT model.*finetuning_type=lora"):
        load_reward_adapter(full, reward_dir)


def test_reward_adapter_for_another_base_is_rejected(tiny_model_dir, tmp_path, policy, save_perturbed_adapter):
    from alignkit.model.tiny import build_tiny_model, build_tiny_tokenizer

    other_dir = tmp_path / "wider"
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(len(tokenizer), hidden_size=32).save_pretrained(other_dir)
    tokenizer.save_pretrained(other_dir)
    save_perturbed_adapter(other_dir, tmp_path / "rm_other", head="reward")
    with pytest.raises(ConfigError, match=r"does not match.*hidden_size: 32 vs 64"):
        load_reward_adapter(policy, tmp_path / "rm_other")
    assert set(policy.peft_config) == {"default"}


def test_reward_adapter_with_other_full_modules(tmp_path, reward_dir, policy):
    """modules_to_save beyond the score head: a name that matches no module of the model (peft >= 0.22 lists
    DistilBERT's `pre_classifier` in every sequence-classification adapter) trained nothing and loads; one that
    matches a module (an `additional_target` such as the embeddings) is refused, naming it."""
    import json
    import shutil

    def with_full_modules(name, modules):
        copy = tmp_path / name
        shutil.copytree(reward_dir, copy)
        config = json.loads((copy / "adapter_config.json").read_text())
        config["modules_to_save"] = modules
        (copy / "adapter_config.json").write_text(json.dumps(config))
        return copy

    load_reward_adapter(policy, with_full_modules("peft_names", ["classifier", "score", "pre_classifier"]))
    assert "reward" in policy.peft_config
    with pytest.raises(ConfigError, match=r"also trains \['embed_tokens'\] in full"):
        load_reward_adapter(policy, with_full_modules("embeddings", ["score", "embed_tokens"]), name="reward_2")
    assert "reward_2" not in policy.peft_config
