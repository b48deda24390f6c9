"""The ppo stage on the tiny model: one base for policy, reference, reward and critic; the swap; what trains;
resume equality; end to end with both critic modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from alignkit.callbacks import read_log
from alignkit.hparams import ConfigError, parse_config
from alignkit.model.adapters import POLICY_ADAPTER
from alignkit.model.heads import VALUE_HEAD_FILE
from alignkit.model.loader import load_model
from alignkit.model.logprobs import forward_token_logps
from alignkit.score import RewardScorer
from alignkit.stages.ppo import COMPLETIONS_FILE, build_ppo_trainer
from alignkit.train import run_train

PROMPTS = ["What is the capital of France?", "What is 12 plus 7?", "Name a colour.", "List three fruits.",
           "Translate to French: good morning.", "Why is the sky blue?", "What is 9 times 3?", "Say hello."]
ROLLOUT = 4


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS))
    return str(path)


@pytest.fixture
def reward_dir(tiny_model_dir, tmp_path, save_perturbed_adapter):
    """An rm run's LoRA output on the raw base (SEQ_CLS, `score` saved in full) with a non-trivial head."""
    out = tmp_path / "rm"
    trained = save_perturbed_adapter(tiny_model_dir, out, head="reward", seed=5)
    with torch.no_grad():
        trained.base_model.model.score.modules_to_save["default"].weight.add_(0.5)
    trained.save_pretrained(out)
    return str(out)


@pytest.fixture
def sft_dir(tiny_model_dir, tmp_path, save_perturbed_adapter):
    out = tmp_path / "sft"
    save_perturbed_adapter(tiny_model_dir, out, seed=7)
    return str(out)


@pytest.fixture
def reward_from_sft_dir(tiny_model_dir, tmp_path, save_perturbed_adapter, sft_dir):
    """An rm run's LoRA output trained from the SFT adapter (as the README pipeline trains it): the adapter over
    base + SFT, with `base_adapters.json` naming the SFT adapter."""
    out = tmp_path / "rm_sft"
    trained = save_perturbed_adapter(tiny_model_dir, out, head="reward", seed=5, over=sft_dir)
    with torch.no_grad():
        trained.base_model.model.score.modules_to_save["default"].weight.add_(0.5)
    trained.save_pretrained(out)
    return str(out)


def _config(tiny_model_dir, prompts_file, out, **overrides):
    values = {
        "stage": "ppo", "do_train": True, "model_name_or_path": tiny_model_dir, "dataset": prompts_file,
        "output_dir": str(out), "per_device_train_batch_size": ROLLOUT, "max_steps": 2, "save_steps": 100,
        "logging_steps": 1, "learning_rate": 5e-3, "lora_rank": 4, "cutoff_len": 64, "max_new_tokens": 6,
        "ppo_epochs": 2, "mini_batch_size": 2, "seed": 0, "disable_tqdm": True,
    }
    values.update(overrides)
    return parse_config(values)


def test_config_checks():
    with pytest.raises(ConfigError, match="needs a reward"):
        parse_config({"stage": "ppo", "do_train": True, "dataset": "x"})
    with pytest.raises(ConfigError, match="ppo_critic=adapter"):
        parse_config({"stage": "ppo", "do_train": True, "dataset": "x", "reward_funcs": "format", "ppo_critic": "adapter"})
    with pytest.raises(ConfigError, match="mini_batch_size=3 must divide"):
        parse_config({"stage": "ppo", "do_train": True, "dataset": "x", "reward_funcs": "format", "mini_batch_size": 3,
                      "per_device_train_batch_size": 4})
    with pytest.raises(ConfigError, match="response_length_range"):
        parse_config({"stage": "ppo", "do_train": True, "dataset": "x", "reward_funcs": "format", "response_length_range": "9,3"})
    config = parse_config({"stage": "ppo", "do_train": True, "dataset": "x", "reward_funcs": "format", "response_length_range": "2,5"})
    assert config.method.response_length_range == [2, 5]
    assert (config.method.init_kl_coef, config.method.ppo_target, config.method.horizon, config.method.gamma,
            config.method.lam, config.method.cliprange, config.method.cliprange_value, config.method.vf_coef,
            config.method.ppo_epochs) == (0.2, 6.0, 10000, 1.0, 0.95, 0.2, 0.2, 0.1, 4)


def test_shared_reward_keys_reach_the_running_stage():
    """`log_completions` and `reward_funcs` belong to GRPO and PPO alike (hparams._owners): each run's class gets them."""
    from alignkit.stages.grpo import GRPOArguments
    from alignkit.stages.ppo import PPOArguments

    keys = {"do_train": True, "dataset": "x", "reward_funcs": "format", "log_completions": True}
    ppo, grpo = parse_config({"stage": "ppo", **keys}), parse_config({"stage": "grpo", **keys})
    assert type(ppo.method) is PPOArguments and ppo.method.log_completions and ppo.method.reward_funcs == ["format"]
    assert type(grpo.method) is GRPOArguments and grpo.method.log_completions
    with pytest.raises(ConfigError, match="applies to stage ppo"):
        parse_config({"stage": "grpo", **keys, "vf_coef": 0.5})


@pytest.mark.parametrize("reward_model_type", ["lora", "full"])
def test_reward_read_in_ppo_equals_alignkit_score(reward_model_type, tiny_model_dir, prompts_file, reward_dir,
                                                  tmp_path):
    """The reward model (an adapter switched in on the policy's base, or loaded on its own) scores what
    `alignkit score` scores; the policy's log-probs after a scoring pass are bit-identical (the adapter really
    was switched back)."""
    trainer = build_ppo_trainer(_config(tiny_model_dir, prompts_file, tmp_path / "out", reward_model=reward_dir,
                                        reward_model_type=reward_model_type), [])
    assert ("reward" in trainer.model.peft_config) == (reward_model_type == "lora")
    _assert_rewards_are_alignkit_scores(trainer, reward_dir)


@pytest.mark.parametrize("rm_from_sft", [True, False])
def test_reward_with_an_sft_policy_equals_alignkit_score(rm_from_sft, tiny_model_dir, prompts_file, sft_dir,
                                                          reward_dir, reward_from_sft_dir, tmp_path, caplog):
    """Policy started from the SFT adapter. An RM trained from that SFT adapter shares the policy's base (the
    adapter is switched in); an RM of the bare base is loaded on its own with its own base, with a warning (as
    an adapter on base + SFT it would score something else). Either way the PPO reward is `alignkit score`'s."""
    rm = reward_from_sft_dir if rm_from_sft else reward_dir
    with caplog.at_level("WARNING", logger="alignkit.rewards.model"):
        trainer = build_ppo_trainer(_config(tiny_model_dir, prompts_file, tmp_path / "out", reward_model=rm,
                                            adapter_name_or_path=sft_dir), [])
    assert ("reward" in trainer.model.peft_config) == rm_from_sft
    assert ("loaded on its own, not as an adapter on the policy's base" in caplog.text) == (not rm_from_sft)
    records = _assert_rewards_are_alignkit_scores(trainer, rm)
    if not rm_from_sft:  # what sharing the base would have scored (the old behaviour): not the RM's scores
        from alignkit.model.adapters import load_reward_adapter
        from alignkit.rewards.model import AdapterRewardModel

        wrong = AdapterRewardModel(trainer.model, load_reward_adapter(trainer.model, rm, name="shared",
                                                                      check_base=False), trainer.formatter, "shared")
        off = torch.tensor(wrong([r["prompt"] for r in records], [r["completion"] for r in records]))
        assert (off - torch.tensor([r["reward"] for r in records])).abs().max() > 1e-2


def _assert_rewards_are_alignkit_scores(trainer, reward_dir):
    model = trainer.model
    assert model.active_adapter == POLICY_ADAPTER
    rollout, metrics, records = trainer.make_rollout(0)
    before = trainer.policy_outputs(rollout.input_ids, rollout.attention_mask, rollout.labels, grad=False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    scorer = RewardScorer(reward_dir)
    expected = scorer.score([r["prompt"] for r in records], [r["completion"] for r in records])
    # `alignkit score` merges the adapters into the weights (rounded in fp32), the switched-in adapter adds its
    # delta to the activations: with these deliberately large random adapters that alone reaches ~1e-5 at a
    # reward of 1, so the bound is 1e-5 absolute plus 1e-5 relative, as in test_named_adapters.
    torch.testing.assert_close(torch.tensor([r["reward"] for r in records]), torch.tensor(expected),
                               rtol=1e-5, atol=1e-5)
    assert metrics["reward/mean"] == pytest.approx(sum(expected) / len(expected), abs=2e-5)
    trainer.reward_functions(["Hi"], [[{"role": "assistant", "content": "Hello"}]], {})  # another scoring pass
    after = trainer.policy_outputs(rollout.input_ids, rollout.attention_mask, rollout.labels, grad=False)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert model.active_adapter == POLICY_ADAPTER
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}
    return records


def test_reference_equals_the_sft_model(tiny_model_dir, prompts_file, sft_dir, tmp_path):
    """With the SFT adapter merged into the base, the reference (policy adapter off) is the SFT model; at step 0
    the fresh policy adapter is a no-op, so the policy equals it too and the KL starts at 0."""
    trainer = build_ppo_trainer(_config(tiny_model_dir, prompts_file, tmp_path / "out", reward_funcs="format",
                                        adapter_name_or_path=sft_dir), [])
    rollout, metrics, _ = trainer.make_rollout(0)
    config = parse_config({"model_name_or_path": tiny_model_dir, "adapter_name_or_path": sft_dir})
    sft = load_model(config.model, config.finetuning, is_trainable=False)
    with torch.no_grad():
        sft_logps, mask = forward_token_logps(sft, rollout.input_ids, rollout.attention_mask, rollout.labels)
    torch.testing.assert_close(rollout.ref_logps, sft_logps * mask, rtol=0, atol=1e-5)
    torch.testing.assert_close(rollout.logps, rollout.ref_logps, rtol=0, atol=1e-6)
    assert metrics["objective/kl"] == pytest.approx(0.0, abs=1e-5)
    assert rollout.mask.sum() > 0


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("critic", ["head", "adapter"])
def test_only_policy_and_critic_change(critic, tiny_model_dir, prompts_file, reward_from_sft_dir, sft_dir, tmp_path):
    """After two PPO steps: base (with the merged SFT adapter) and reward adapter bit-identical; the policy
    adapter and the critic changed."""
    config = _config(tiny_model_dir, prompts_file, tmp_path / "out", reward_model=reward_from_sft_dir, ppo_critic=critic,
                     adapter_name_or_path=sft_dir, save_strategy="no")
    trainer = build_ppo_trainer(config, [])
    reward_function = trainer.reward_functions.functions[0].function
    reward_head = reward_function.reward.head.weight.detach().clone()
    before = _snapshot(trainer.model)
    trainer.train()
    after = _snapshot(trainer.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    trainable = {n for n in before if f".{POLICY_ADAPTER}." in n or n.startswith("base_model.model.v_head")
                 or ".critic." in n}
    assert changed <= trainable, sorted(changed - trainable)[:5]
    assert any(f".{POLICY_ADAPTER}." in n for n in changed)
    assert any("v_head" in n for n in changed)
    if critic == "adapter":
        assert any(".critic." in n for n in changed)
    assert torch.equal(reward_head, reward_function.reward.head.weight)


COMPARED = ("loss", "reward/mean", "objective/kl", "objective/kl_coef", "ppo/loss/value", "val/mean",
            "learning_rate", "grad_norm")


def _logged(out):
    return {r["current_steps"]: {k: r.get(k) for k in COMPARED} for r in read_log(out) if "loss" in r}


def test_resume_equals_uninterrupted_run(tiny_model_dir, prompts_file, reward_dir, tmp_path, crash_before_step):
    """4 steps straight vs. killed before step 4 (after step 3 logged its completions; the last checkpoint is
    checkpoint-2) and resumed: the same completions (step 3's once), rewards, losses, KL coefficient, adapter and
    value head."""
    def config(out):
        return _config(tiny_model_dir, prompts_file, out, reward_model=reward_dir, max_steps=4, save_steps=2,
                       log_completions=True, warmup_steps=1, lr_scheduler_type="linear", response_length_range="2,6")

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(config(straight))
    with pytest.raises(Exception, match="killed before step"):
        run_train(config(resumed), callbacks=[crash_before_step(4)])
    assert {json.loads(line)["step"] for line in (resumed / COMPLETIONS_FILE).read_text().splitlines()} == {1, 2, 3}
    assert sorted(p.name for p in resumed.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (resumed / "checkpoint-2" / VALUE_HEAD_FILE).is_file()
    assert (resumed / "checkpoint-2" / "ppo_state.json").is_file()
    run_train(config(resumed))

    straight_log, resumed_log = _logged(straight), _logged(resumed)
    assert sorted(straight_log) == sorted(resumed_log) == [1, 2, 3, 4]
    for step in range(1, 5):
        for key in COMPARED:
            assert resumed_log[step][key] == pytest.approx(straight_log[step][key], rel=0, abs=1e-6), (step, key)
    assert len({round(straight_log[s]["objective/kl_coef"], 9) for s in straight_log}) == 4  # it adapts

    def completions(out):
        return [json.loads(line) for line in (out / COMPLETIONS_FILE).read_text().splitlines()]

    assert completions(straight) == completions(resumed)
    assert len(completions(straight)) == 4 * ROLLOUT
    for name in ("adapter_model.safetensors", VALUE_HEAD_FILE):
        a, b = load_file(straight / name), load_file(resumed / name)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("critic", ["head", "adapter"])
def test_end_to_end(critic, tiny_model_dir, prompts_file, reward_from_sft_dir, sft_dir, tmp_path):
    """`alignkit train` of stage ppo, as the README pipeline runs it (policy and RM from the SFT adapter): the
    files every stage writes, the SFT adapter recorded under the policy, the metrics, and an adapter plain peft
    loads."""
    from peft import PeftModel

    from alignkit.model.loader import BASE_ADAPTERS_FILE

    out = tmp_path / "out"
    run_train(_config(tiny_model_dir, prompts_file, out, reward_model=reward_from_sft_dir, ppo_critic=critic,
                      adapter_name_or_path=sft_dir, reward_funcs="format", reward_weights="0.5",
                      log_completions=True, plot_loss=True))
    for name in ("adapter_model.safetensors", "adapter_config.json", VALUE_HEAD_FILE, "trainer_state.json",
                 "train_results.json", "trainer_log.jsonl", COMPLETIONS_FILE, "training_loss.png"):
        assert (out / name).is_file(), name
    assert json.loads((out / BASE_ADAPTERS_FILE).read_text())["base_adapters"] == [str(Path(sft_dir).resolve())]
    assert not (out / "reward").exists()  # the reward adapter is not part of the output
    assert (out / "critic").is_dir() == (critic == "adapter")
    record = [r for r in read_log(out) if "loss" in r][-1]
    for key in ("ppo/loss/policy", "ppo/loss/value", "ppo/loss/total", "objective/kl", "objective/kl_coef",
                "objective/entropy", "reward/mean", "reward/std", "policy/clipfrac", "policy/approxkl",
                "val/clipfrac", "val/mean", "response_length/mean", "time/generation", "time/training",
                "rewards/rm_sft/mean", "rewards/format/mean"):
        assert key in record and record[key] is not None, key
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    policy = PeftModel.from_pretrained(base, str(out))
    trained = load_file(out / "adapter_model.safetensors")
    assert any(t.abs().sum() > 0 for k, t in trained.items() if "lora_B" in k)
    assert isinstance(policy, PeftModel)
    if critic == "head":  # `alignkit export` merges it like any causal-LM adapter
        from alignkit.export import export_model
        from alignkit.hparams import ModelArguments

        exported = export_model(ModelArguments(model_name_or_path=tiny_model_dir, adapter_name_or_path=str(out)),
                                str(tmp_path / "export"))
        AutoModelForCausalLM.from_pretrained(str(exported))


def test_padded_and_padding_free_rollouts_agree(tiny_model_dir, prompts_file, reward_from_sft_dir, sft_dir,
                                                tmp_path):
    """Prompts of different lengths: both layouts give each token its true position, so the same numbers."""
    rollouts = []
    for padding_free in (False, True):
        config = _config(tiny_model_dir, prompts_file, tmp_path / f"out{padding_free}", reward_model=reward_from_sft_dir,
                         adapter_name_or_path=sft_dir, padding_free=padding_free)
        trainer = build_ppo_trainer(config, [])
        with torch.no_grad():  # a zero head would hide a layout error
            trainer.value_head.weight.copy_(torch.randn(trainer.value_head.weight.shape,
                                                        generator=torch.Generator().manual_seed(0)) * 0.1)
        rollouts.append(trainer.make_rollout(0)[0])
    padded, packed = rollouts
    assert torch.equal(padded.input_ids, packed.input_ids)
    assert len(set(padded.attention_mask.sum(dim=1).tolist())) > 1
    for name in ("logps", "ref_logps", "values", "scores", "advantages"):
        torch.testing.assert_close(getattr(padded, name), getattr(packed, name), rtol=0, atol=1e-5, msg=name)


def test_gradient_accumulation_does_not_change_the_update(tiny_model_dir, prompts_file, tmp_path):
    """Rollout of 4 as 4 x GA 1 or 2 x GA 2 (mini-batches of 2): the token-weighted loss gives the same update."""
    adapters = []
    for batch, accumulation in ((4, 1), (2, 2)):
        out = tmp_path / f"b{batch}"
        run_train(_config(tiny_model_dir, prompts_file, out, reward_funcs="format,length", reward_weights="1,1",
                          per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                          mini_batch_size=None, max_steps=1, max_grad_norm=0))
        adapters.append(load_file(out / "adapter_model.safetensors"))
    # Mini-batches of 4 and of 2 sum in different orders (gradients agree to about 5e-8: the same runs with SGD
    # at lr 1), and Adam's first steps divide each gradient by its own size, so weights move by lr x sign(g) and
    # an entry whose gradient is near 0 carries that float noise up to about 1e-6 of the weights.
    for key in adapters[0]:
        torch.testing.assert_close(adapters[1][key], adapters[0][key], rtol=0, atol=1e-5, msg=key)
    assert any(t.abs().sum() > 0 for k, t in adapters[0].items() if "lora_B" in k)


def test_full_fine_tuning_policy(tiny_model_dir, prompts_file, tmp_path):
    """finetuning_type full: a frozen copy is the reference; the saved model has no value head inside it."""
    out = tmp_path / "out"
    run_train(_config(tiny_model_dir, prompts_file, out, finetuning_type="full", reward_funcs="length",
                      learning_rate=1e-4))
    weights = load_file(out / "model.safetensors")
    assert not any(k.startswith("v_head") for k in weights)
    assert (out / VALUE_HEAD_FILE).is_file()
    AutoModelForCausalLM.from_pretrained(str(out))
    record = [r for r in read_log(out) if "objective/kl" in r][-1]
    assert record["objective/kl"] != 0.0  # the policy moved away from its frozen copy after step 1
