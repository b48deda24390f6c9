"""The ppo stage on the tiny model: one base for policy, reference, reward and critic; the swap; what trains;
resume equality; end to end with both critic modes; the DeepSpeed path with a stand-in engine, and what is refused."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers.trainer
from accelerate import Accelerator
from accelerate.utils import DistributedType
from accelerate.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

from alignkit.callbacks import read_log
from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.model.adapters import POLICY_ADAPTER
from alignkit.model.heads import VALUE_HEAD_FILE
from alignkit.model.loader import load_model
from alignkit.model.logprobs import forward_token_logps
from alignkit.rewards.scoring import RewardScorer
from alignkit.stages import ppo
from alignkit.rl.record import COMPLETIONS_FILE
from alignkit.stages.ppo import FSDP_REFUSAL, PPOTrainer, build_ppo_trainer, check_config, deepspeed_refusal
from alignkit.train import run_train
from tests.helpers import tiny_config

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
    """An rm run's LoRA output trained from the SFT adapter (as the RLHF pipeline of docs/stages/ppo.md trains
    it): the adapter over base + SFT, with `base_adapters.json` naming the SFT adapter."""
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
    return tiny_config(**values)


def test_the_trainer_internals_ppo_relies_on_exist():
    """Every private `Trainer` member PPO's loop uses is listed once (`TRAINER_INTERNALS`) and exists in the installed
    transformers; the PPO modules use no other private member of the Trainer."""
    import inspect
    import re

    from transformers import Trainer

    from alignkit.stages.ppo import TRAINER_INTERNALS, trainer

    trainer_source = inspect.getsource(Trainer)
    for name in TRAINER_INTERNALS:
        assert hasattr(Trainer, name) or f"self.{name} =" in trainer_source, name
    used = set()
    for module in ppo.__path__:
        for path in sorted(Path(module).glob("*.py")):
            used |= set(re.findall(r"(?:self|super\(\))\.(_[a-z][a-z0-9_]*)", path.read_text()))
    private_trainer_members = {name for name in used if name in trainer_source and name not in vars(trainer.PPOTrainer)}
    assert private_trainer_members <= set(TRAINER_INTERNALS), private_trainer_members - set(TRAINER_INTERNALS)


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
    with pytest.raises(ConfigError, match="neftune_noise_alpha: stage ppo does not apply NEFTune"):
        parse_config({"stage": "ppo", "do_train": True, "dataset": "x", "reward_funcs": "format", "neftune_noise_alpha": 5})
    with pytest.raises(ConfigError, match="torch_compile: stage ppo's loop calls the model uncompiled"):
        parse_config({"stage": "ppo", "do_train": True, "dataset": "x", "reward_funcs": "format",
                      "torch_compile": True})
    with pytest.raises(ConfigError, match="auto_find_batch_size: stage ppo sizes its rollouts"):
        parse_config({"stage": "ppo", "do_train": True, "dataset": "x", "reward_funcs": "format",
                      "auto_find_batch_size": True})
    with pytest.raises(ConfigError, match="train_sampling_strategy=sequential: stage ppo draws each step's prompts"):
        parse_config({"stage": "ppo", "do_train": True, "dataset": "x", "reward_funcs": "format",
                      "train_sampling_strategy": "sequential"})
    config = parse_config({"stage": "ppo", "do_train": True, "dataset": "x", "reward_funcs": "format", "response_length_range": "2,5"})
    assert config.method.response_length_range == [2, 5]
    assert (config.method.init_kl_coef, config.method.ppo_target, config.method.horizon, config.method.gamma,
            config.method.lam, config.method.cliprange, config.method.cliprange_value, config.method.vf_coef,
            config.method.ppo_epochs) == (0.2, 6.0, 10000, 1.0, 0.95, 0.2, 0.2, 0.1, 4)


def test_shared_reward_keys_reach_the_running_stage():
    """`log_completions` and `reward_funcs` belong to GRPO and PPO alike (config.parse._owners): each run's class
    gets them."""
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
        from alignkit.rewards.model import AdapterRewardModel
        from alignkit.rewards.reward_model import load_reward_adapter

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
    # Records hold completions in TRL's shapes: the assistant message of a conversational prompt.
    expected = scorer.score([r["prompt"] for r in records], [r["completion"][-1]["content"] for r in records])
    # `alignkit score` merges the adapters into the weights (rounded in fp32), the switched-in adapter adds its
    # delta to the activations: with these deliberately large random adapters that alone reaches ~1e-5 at a
    # reward of 1, so the bound is 1e-5 absolute plus 1e-5 relative, as in test_named_adapters.
    torch.testing.assert_close(torch.tensor([r["reward"] for r in records]), torch.tensor(expected),
                               rtol=1e-5, atol=1e-5)
    assert metrics["reward"] == pytest.approx(sum(expected) / len(expected), abs=2e-5)
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


COMPARED = ("loss", "reward", "objective/kl", "objective/kl_coef", "ppo/loss/value", "val/mean",
            "learning_rate", "grad_norm")


def _logged(out):
    return {r["current_steps"]: {k: r.get(k) for k in COMPARED} for r in read_log(out) if "loss" in r}


def _assert_same_run(a: Path, b: Path, tolerance: float = 1e-6) -> None:
    """Two runs logged the same `COMPARED` values at every step and saved the same adapter and value head (within
    `tolerance`)."""
    log_a, log_b = _logged(a), _logged(b)
    assert sorted(log_a) == sorted(log_b) and log_a
    for step in log_a:
        for key in COMPARED:
            assert log_b[step][key] == pytest.approx(log_a[step][key], rel=0, abs=tolerance), (step, key)
    for name in ("adapter_model.safetensors", VALUE_HEAD_FILE):
        _assert_same_files(a, b, name, tolerance)


def _assert_same_files(a: Path, b: Path, name: str, tolerance: float = 1e-6) -> None:
    wa, wb = load_file(a / name), load_file(b / name)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=0, atol=tolerance, msg=key)


class CheckpointingSeen(TrainerCallback):
    """Whether the decoder layers were checkpointing when each step ended."""

    def __init__(self) -> None:
        self.seen = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seen.append({bool(m.gradient_checkpointing) for m in model.modules()
                          if hasattr(m, "gradient_checkpointing")})


def test_gradient_checkpointing_is_applied_and_changes_nothing(tiny_model_dir, prompts_file, reward_dir, tmp_path):
    """`gradient_checkpointing: true` reaches PPO's loop (`Trainer.train` sets it up, then runs the loop): the layers
    checkpoint, and the run logs and saves what the plain run does. Memory metrics (`skip_memory_metrics: false`),
    which `Trainer.train` starts, are reported at the end."""
    seen = {}
    for checkpointing in (False, True):
        spy = CheckpointingSeen()
        run_train(_config(tiny_model_dir, prompts_file, tmp_path / f"gc_{checkpointing}", reward_model=reward_dir,
                          gradient_checkpointing=checkpointing, skip_memory_metrics=False), callbacks=[spy])
        seen[checkpointing] = spy.seen
    assert seen == {False: [{False}, {False}], True: [{True}, {True}]}
    _assert_same_run(tmp_path / "gc_False", tmp_path / "gc_True")
    results = json.loads((tmp_path / "gc_True" / "train_results.json").read_text())
    assert results["train_mem_cpu_peaked_delta"] >= 0 and "train_mem_cpu_alloc_delta" in results


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

    _assert_same_run(straight, resumed)
    straight_log = _logged(straight)
    assert sorted(straight_log) == [1, 2, 3, 4]
    assert len({round(straight_log[s]["objective/kl_coef"], 9) for s in straight_log}) == 4  # it adapts

    def completions(out):
        return [json.loads(line) for line in (out / COMPLETIONS_FILE).read_text().splitlines()]

    assert completions(straight) == completions(resumed)
    assert len(completions(straight)) == 4 * ROLLOUT


@pytest.mark.parametrize("critic", ["head", "adapter"])
def test_end_to_end(critic, tiny_model_dir, prompts_file, reward_from_sft_dir, sft_dir, tmp_path):
    """`alignkit train` of stage ppo, as the RLHF pipeline of docs/stages/ppo.md runs it (policy and RM from the
    SFT adapter): the files every stage writes, the SFT adapter recorded under the policy, the metrics, and an
    adapter plain peft loads."""
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
                "objective/entropy", "reward", "reward_std", "kl", "clip_ratio/region_mean", "policy/approxkl",
                "val/clipfrac", "val/mean", "completions/mean_length", "completions/min_length",
                "completions/max_length", "time/generation", "time/training",
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
        from alignkit.config import ModelArguments

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


@pytest.mark.parametrize("critic", ["head", "adapter"])
def test_the_first_pass_trains_on_the_rollouts_own_forward(critic, tiny_model_dir, prompts_file, reward_dir, tmp_path,
                                                          monkeypatch):
    """A rollout of 4 in one micro-batch (the defaults): the rollout's policy and critic forward runs with its graph
    and the first PPO pass backpropagates it, so a step runs ppo_epochs forwards of the rollout, not one more. The
    run equals one where the rollout's pass runs apart without gradients (the first pass then runs the model
    again), within the float noise of Adam's first steps (see the test above). With LoRA dropout active, or
    mini-batches of 2, the rollout's pass runs apart, without gradients."""
    calls: list[bool] = []
    real = PPOTrainer.policy_outputs

    def counted(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PPOTrainer, "policy_outputs", counted)
    keys = dict(reward_model=reward_dir, mini_batch_size=None, ppo_critic=critic)
    shared, apart = tmp_path / "shared", tmp_path / "apart"
    run_train(_config(tiny_model_dir, prompts_file, shared, **keys))
    assert calls == [True, True] * 2  # 2 steps: the rollout's forward (trained on by pass 1), pass 2
    calls.clear()
    with monkeypatch.context() as patch:
        patch.setattr(PPOTrainer, "first_pass_in_rollout", lambda self: False)
        run_train(_config(tiny_model_dir, prompts_file, apart, **keys))
    assert calls == [False, True, True] * 2
    _assert_same_run(apart, shared, tolerance=1e-5)
    if critic == "adapter":
        _assert_same_files(apart / "critic", shared / "critic", "adapter_model.safetensors", 1e-5)
    for changed in ({"lora_dropout": 0.1}, {"mini_batch_size": 2}):
        calls.clear()
        run_train(_config(tiny_model_dir, prompts_file, tmp_path / "other", **{**keys, **changed}))
        assert calls == [False, True, True] * 2 if "lora_dropout" in changed else [False, True, True] * 4, changed


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


# ---------------------------------------------------------------------------------------------------
# PPO's DeepSpeed path on the CPU, with a stand-in for the engine (DeepSpeed is not installed and needs a GPU).
# `StandInEngine` keeps the contract that accelerate's `DeepSpeedEngineWrapper` and the Trainer's DeepSpeed save and
# resume paths rely on (one process, so DeepSpeed's averaging over processes is the identity):
# - `set_gradient_accumulation_boundary(b)`, then `backward(loss, scale_wrt_gas=True)`: the loss divided by the
#   gradient accumulation steps unless `scale_wrt_gas=False`, then backpropagated;
# - `step()`: at a boundary only, clip the gradients to `gradient_clipping`, step the optimizer, zero the gradients;
#   `get_global_grad_norm()` is the norm measured there;
# - `save_checkpoint(dir, exclude_frozen_parameters)` writes `global_step*/` with the module's (trainable) weights
#   and the optimizer state; `load_checkpoint` reads them back.
# The run goes through the real `accelerator.backward` and `accelerator.clip_grad_norm_` (the accelerator is told
# it runs DeepSpeed), accelerate's `DeepSpeedEngineWrapper` and `DeepSpeedOptimizerWrapper`, the Trainer's
# DeepSpeed branches of `_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler`, and transformers'
# `deepspeed_load_checkpoint`. Only `PPOTrainer._prepare_deepspeed` (`deepspeed_init` + `accelerator.prepare`, which
# need DeepSpeed) is replaced. What this cannot show: DeepSpeed's own numerics (ZeRO-2 bucketing, bf16 master
# weights, offload), NCCL, several GPUs.
# ---------------------------------------------------------------------------------------------------

# A rollout of 4 prompts as 2 per device x 2 accumulation steps, trained as mini-batches of 2 (2 backward passes
# per optimizer step), 2 PPO epochs; clipping on, so the engine's clipping is what the plain loop's is. SGD: a
# gradient off by a factor moves the weights by that factor (Adam's first steps would hide it).
DEEPSPEED_KEYS = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "mini_batch_size": 2,
                  "reward_funcs": "format,length", "reward_weights": "1,1", "max_grad_norm": 0.5, "optim": "sgd",
                  "learning_rate": 0.05}


class StandInEngine:
    """DeepSpeed's engine contract on one CPU process (the section comment above)."""

    def __init__(self, module, optimizer, gradient_clipping: float, gradient_accumulation_steps: int) -> None:
        self.module, self.optimizer = module, optimizer
        self.gradient_clipping, self.gradient_accumulation_steps = gradient_clipping, gradient_accumulation_steps
        self.config = {"zero_optimization": {"stage": 2}}
        self.boundary, self.norm, self.steps = True, None, 0
        self.backward_calls: list[tuple[bool, bool]] = []  # (boundary, scale_wrt_gas) of each backward

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.boundary = is_boundary

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        self.backward_calls.append((self.boundary, scale_wrt_gas))
        (loss / self.gradient_accumulation_steps if scale_wrt_gas else loss).backward()

    def step(self) -> None:
        if not self.boundary:
            return
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.gradient_clipping > 0:
            self.norm = torch.nn.utils.clip_grad_norm_(params, self.gradient_clipping)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    def get_global_grad_norm(self):
        return self.norm

    def __call__(self, *args, **kwargs):  # DeepSpeedEngine.forward runs its module's
        return self.module(*args, **kwargs)

    def state_dict(self):
        return self.module.state_dict()

    def save_checkpoint(self, save_dir: str, exclude_frozen_parameters: bool = False) -> None:
        weights = {name: p.detach().clone() for name, p in self.module.named_parameters()
                   if p.requires_grad or not exclude_frozen_parameters}
        folder = Path(save_dir) / f"global_step{self.steps}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"module": weights, "optimizer": self.optimizer.state_dict()}, folder / "engine_state.pt")

    def load_checkpoint(self, load_dir: str, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True):
        folder = sorted(Path(load_dir).glob("global_step*"))[-1]
        state = torch.load(folder / "engine_state.pt", weights_only=True)
        self.module.load_state_dict(state["module"], strict=load_module_strict)
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
        return str(folder), {}


def _prepare_with_stand_in(self: PPOTrainer, max_steps: int) -> None:
    """`_prepare_deepspeed` with the stand-in engine in DeepSpeed's place (accelerate's wrappers around it)."""
    self.create_optimizer()
    engine = StandInEngine(self.model, self.optimizer, self.args.max_grad_norm, self.args.gradient_accumulation_steps)
    self.accelerator.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)
    self.model_wrapped = self.deepspeed = engine
    self.optimizer = DeepSpeedOptimizerWrapper(self.optimizer)  # step and zero_grad: no-ops, as under DeepSpeed
    self.lr_scheduler = None


@pytest.fixture
def stand_in_deepspeed(monkeypatch):
    """`install()` puts the stand-in in place (until the test ends) and returns the list of PPO trainers built
    from then on (each one's `.deepspeed` is its engine)."""
    def install() -> list[PPOTrainer]:
        built: list[PPOTrainer] = []
        original_init = PPOTrainer.__init__

        def init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self.is_deepspeed_enabled = True  # as the Trainer sets it when accelerate holds a DeepSpeed plugin
            built.append(self)

        monkeypatch.setattr(PPOTrainer, "__init__", init)
        monkeypatch.setattr(PPOTrainer, "_prepare_deepspeed", _prepare_with_stand_in)
        monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType.DEEPSPEED))
        monkeypatch.setattr(Accelerator, "get_state_dict", lambda self, model, unwrap=True: model.state_dict())
        # transformers imports this name only when DeepSpeed is installed; its DeepSpeed branches read it.
        monkeypatch.setattr(transformers.trainer, "DeepSpeedSchedulerWrapper", DeepSpeedSchedulerWrapper, raising=False)
        return built

    return install


@pytest.fixture
def counted_gathers(monkeypatch):
    """Counts the `full_weights` blocks PPO enters (the real context runs inside)."""
    entered: list[int] = []
    real = ppo.full_weights

    @contextlib.contextmanager
    def counting(model, engine=None):
        entered.append(1)
        with real(model, engine) as inner:
            yield inner

    monkeypatch.setattr(ppo.trainer, "full_weights", counting)
    return entered


def test_deepspeed_path_updates_as_the_plain_loop(tiny_model_dir, prompts_file, tmp_path, stand_in_deepspeed,
                                                  counted_gathers, monkeypatch):
    """The same run through the plain loop and through the engine: the same logs, adapter and value head.

    The DeepSpeed run also pads every update batch with one weightless pass, as a process holding fewer rows of
    the batch than another does (`_most_micro_batches` reports one more than this process has).
    """
    plain, engine_run = tmp_path / "plain", tmp_path / "deepspeed"
    run_train(_config(tiny_model_dir, prompts_file, plain, **DEEPSPEED_KEYS))
    assert len(counted_gathers) == 2  # one gather block per rollout (2 PPO steps)

    built = stand_in_deepspeed()
    monkeypatch.setattr(PPOTrainer, "_most_micro_batches", lambda self, count: count + 1)
    run_train(_config(tiny_model_dir, prompts_file, engine_run, **DEEPSPEED_KEYS))
    assert len(counted_gathers) == 4
    _assert_same_run(plain, engine_run)

    engine = built[0].deepspeed
    # 2 PPO steps x 2 epochs x 1 update batch = 4 optimizer steps, each of 2 real passes + 1 weightless one, all
    # through accelerate.backward with DeepSpeed's accumulation scaling off; the boundary is each batch's last pass.
    assert engine.steps == 4
    assert engine.backward_calls == [(False, False), (False, False), (True, False)] * 4


@pytest.mark.parametrize("zero3", [False, True])
def test_deepspeed_resume_equals_uninterrupted_run(tiny_model_dir, prompts_file, tmp_path, stand_in_deepspeed,
                                                   stand_in_zero3, crash_before_step, zero3):
    """Killed before step 4 and resumed from checkpoint-2 (the engine's checkpoint, written and read through the
    Trainer's DeepSpeed paths) ends as the uninterrupted run does. Under the ZeRO-3 stand-in (defined below) the
    adapter and value head are saved from the state dict the Trainer consolidates, not from the partitions."""
    (stand_in_zero3 if zero3 else stand_in_deepspeed)()

    def config(out):
        return _config(tiny_model_dir, prompts_file, out, **DEEPSPEED_KEYS, max_steps=4, save_steps=2, warmup_steps=1,
                       lr_scheduler_type="linear")

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(config(straight))
    with pytest.raises(Exception, match="killed before step"):
        run_train(config(resumed), callbacks=[crash_before_step(4)])
    checkpoint = resumed / "checkpoint-2"
    assert [p.name for p in checkpoint.glob("global_step*")] == ["global_step4"]  # the engine's own checkpoint
    assert (checkpoint / "scheduler.pt").is_file() and not (checkpoint / "optimizer.pt").exists()
    saved = load_file(checkpoint / VALUE_HEAD_FILE)
    assert saved["weight"].numel() == 64 and saved["weight"].abs().sum() > 0  # whole and trained, not a partition
    run_train(config(resumed))
    _assert_same_run(straight, resumed)


# ---------------------------------------------------------------------------------------------------
# ZeRO-3 with the stand-in for DeepSpeed's parameter partitioning of tests/conftest.py (`StandInPartitions`: every
# partitioned parameter empty outside a module call of the engine or a gather). Here the engine's partitions take the
# policy over when the engine is built (from the stand-in `zero.Init` when the run loads under `zero3_loading`), and
# the engine steps, checkpoints and consolidates whole parameters; the Trainer saves a PEFT model from
# `_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)`, a full one from accelerate's
# `get_state_dict`, which under ZeRO-3 is the same consolidation.
# ---------------------------------------------------------------------------------------------------


class StandInZero3Engine(StandInEngine):
    """The stand-in engine over partitioned parameters: it steps, checkpoints and consolidates whole ones."""

    def __init__(self, *args, partitions, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.partitions = partitions
        self.config = {"zero_optimization": {"stage": 3}}

    def step(self) -> None:
        if self.boundary:
            with self.partitions.whole_weights():
                super().step()

    def save_checkpoint(self, save_dir: str, exclude_frozen_parameters: bool = False) -> None:
        with self.partitions.whole_weights():
            super().save_checkpoint(save_dir, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, **kwargs):
        with self.partitions.whole_weights():
            return super().load_checkpoint(load_dir, **kwargs)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        with self.partitions.whole_weights():
            return {name: p.detach().clone() for name, p in self.module.named_parameters()
                    if p.requires_grad or not exclude_frozen_parameters}


@pytest.fixture
def stand_in_zero3(stand_in_deepspeed, zero3_partitions, monkeypatch):
    """`install()` puts the stand-in engine over partitioned parameters in place and returns the list of PPO
    trainers built from then on."""
    from alignkit.model import distributed

    def prepare(self: PPOTrainer, max_steps: int) -> None:
        self.create_optimizer()
        partitions = zero3_partitions(self.model)
        engine = StandInZero3Engine(self.model, self.optimizer, self.args.max_grad_norm,
                                    self.args.gradient_accumulation_steps, partitions=partitions)
        self.accelerator.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)
        self.model_wrapped = self.deepspeed = engine
        self.optimizer = DeepSpeedOptimizerWrapper(self.optimizer)
        self.lr_scheduler = None

    def install() -> list[PPOTrainer]:
        built = stand_in_deepspeed()
        monkeypatch.setattr(PPOTrainer, "_prepare_deepspeed", prepare)
        monkeypatch.setattr(distributed, "_zero3_generation", lambda engine: engine.partitions.generation_block())
        # accelerate's `get_state_dict(engine)` under ZeRO-3 is the engine's consolidation (a full policy's save).
        monkeypatch.setattr(Accelerator, "get_state_dict", lambda self, model, unwrap=True:
                            model._zero3_consolidated_16bit_state_dict() if hasattr(model, "partitions")
                            else model.state_dict())
        return built

    return install


def test_zero3_path_updates_as_the_plain_loop(tiny_model_dir, prompts_file, reward_dir, tmp_path, stand_in_zero3):
    """Under the partitioning stand-in (every weight empty outside a module's forward/backward or a gather), the
    run equals the plain loop's: logs, adapters and value head. Each rollout is one gather block (generation,
    the reward adapter, the policy, critic and reference passes); training reads weights only in module calls.
    The critic is its own adapter here: the real-DeepSpeed tier (tests/distributed/test_distributed_deepspeed.py)
    runs the value-head critic, a full policy with its partitioned reference and the merged-SFT-base shape of
    examples/ppo_lora.yaml, so the stand-in keeps only what that tier does not run."""
    critic = "adapter"
    keys = {**DEEPSPEED_KEYS, "reward_model": reward_dir, "ppo_critic": critic, "reward_funcs": "format",
            "reward_weights": "1"}
    plain, zero3 = tmp_path / "plain", tmp_path / "zero3"
    run_train(_config(tiny_model_dir, prompts_file, plain, **keys))
    built = stand_in_zero3()
    run_train(_config(tiny_model_dir, prompts_file, zero3, **keys))
    # The partitioned run takes PEFT's unfused LoRA forward (`lora_fused` steps aside under ZeRO-3), the plain one
    # the fused one: the same arithmetic, rounded in another order (seen: 4e-6 in a gradient norm of 5.2).
    _assert_same_run(plain, zero3, tolerance=1e-5)
    _assert_same_files(plain / "critic", zero3 / "critic", "adapter_model.safetensors", tolerance=1e-5)
    partitions = built[0].deepspeed.partitions
    assert partitions.generation_blocks == 2  # one per rollout (2 PPO steps)
    assert partitions.is_partitioned()  # nothing left gathered after the run
    assert built[0].deepspeed.steps == 4


def test_zero3_saving_needs_the_consolidated_state_dict(tiny_model_dir, tmp_path):
    """Under ZeRO-3 the module's tensors are partitions: with no consolidated dict the global main process stops
    with the fix, and another node's main process (which DeepSpeed gives None) writes nothing."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for param in model.parameters():
        param.ds_id = 0

    def trainer(main: bool):
        return SimpleNamespace(args=SimpleNamespace(should_save=True, output_dir=str(tmp_path), process_index=0 if main
                                                    else 8), model=model, is_world_process_zero=lambda: main)

    for state_dict in ({}, None):
        with pytest.raises(RuntimeError, match="stage3_gather_16bit_weights_on_model_save: true"):
            PPOTrainer._save(trainer(True), str(tmp_path / "main"), state_dict=state_dict)
    PPOTrainer._save(trainer(False), str(tmp_path / "node"), state_dict=None)
    assert not (tmp_path / "main").exists() and not (tmp_path / "node").exists()


def test_deepspeed_configs_are_refused_only_for_a_scheduler_block():
    assert deepspeed_refusal({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}) is None
    assert deepspeed_refusal({"zero_optimization": {"stage": 0}}) is None
    assert deepspeed_refusal({"train_batch_size": "auto"}) is None
    assert deepspeed_refusal({"zero_optimization": {"stage": 3}}) is None
    assert "scheduler" in deepspeed_refusal({"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR"}})
    shipped = Path(__file__).resolve().parents[2] / "examples" / "deepspeed"
    verdicts = {path.name: deepspeed_refusal(json.loads(path.read_text())) is None for path in shipped.glob("*.json")}
    assert verdicts == {"ds_z0_config.json": True, "ds_z2_config.json": True, "ds_z3_config.json": True,
                        "ds_z3_offload_config.json": True}

    def config(finetuning="lora", adapters=None, **training):  # check_config reads these keys only (parse_config
        # refuses DeepSpeed and FSDP earlier on a CPU)
        keys = {"do_train": True, "do_eval": False, "do_predict": False, "deepspeed": None, "fsdp": None,
                "neftune_noise_alpha": None, "train_sampling_strategy": "random", "torch_compile": False,
                "auto_find_batch_size": False, "per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 1,
                **training}
        from alignkit.stages.ppo import PPOArguments

        return SimpleNamespace(method=PPOArguments(reward_funcs=["format"]),
                               training=SimpleNamespace(**keys), finetuning=SimpleNamespace(finetuning_type=finetuning),
                               model=SimpleNamespace(adapter_name_or_path=adapters))

    with pytest.raises(ConfigError) as refused:
        check_config(config(fsdp="full_shard", fsdp_config={"version": 1}))
    assert str(refused.value) == FSDP_REFUSAL
    check_config(config(fsdp="full_shard", fsdp_config={"version": 2}))  # FSDP2: tests/distributed/test_distributed_rl.py
    check_config(config(fsdp="full_shard", fsdp_config={}))  # transformers' default version is 2
    zero3_keys = {"deepspeed": "ds_z3_config.json",
                  "hf_deepspeed_config": SimpleNamespace(config={"zero_optimization": {"stage": 3}})}
    # ZeRO-3 with a full/freeze policy (its reference a second, partitioned load) and with adapter_name_or_path (merged
    # into a cached base first): both run (tests below), so neither is refused any more.
    for finetuning in ("lora", "full", "freeze"):
        check_config(config(finetuning=finetuning, **zero3_keys))
    check_config(config(adapters="sft", **zero3_keys))
    with pytest.raises(ConfigError, match="remove the `scheduler` block"):
        check_config(config(deepspeed="ds.json", hf_deepspeed_config=SimpleNamespace(
            config={"zero_optimization": {"stage": 3}, "scheduler": {"type": "WarmupLR"}})))
