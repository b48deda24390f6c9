"""GRPO's pure functions against hand-computed numbers: advantages, clipping, k3 KL, the four aggregations (their
home is `alignkit.rl`), and GRPO's generation batches and rollout pieces."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.rl.advantages import ADVANTAGE_ESTIMATORS, group_advantages
from alignkit.rl.kl import k3_kl
from alignkit.rl.losses import aggregate_loss, clipped_surrogate
from alignkit.rl.stats import nan_std
from alignkit.stages.grpo import GenerationBatchSampler, resolve_generation_batch
from alignkit.rl.rollout import (
    generation_from_token_lists,
    rollout_seed,
    row_seeds,
    sample_completions,
    token_entropy,
    trl_completions,
    trl_prompts,
    vllm_weight_items,
)


def test_nan_std_is_bessel_corrected_and_skips_nan():
    """[1, 3, NaN]: mean 2, deviations 1 and 1, variance 2 / (2 - 1) = 2, std sqrt(2)."""
    assert nan_std(torch.tensor([1.0, 3.0, math.nan])).item() == pytest.approx(math.sqrt(2))
    assert math.isnan(nan_std(torch.tensor([5.0, math.nan])).item())  # one value: no spread to measure
    rows = nan_std(torch.tensor([[1.0, 3.0], [2.0, 2.0]]), dim=1)
    assert rows.tolist() == pytest.approx([math.sqrt(2), 0.0])


def test_group_advantages_per_group():
    """Groups (1, 3) and (2, 2): means 2 and 2, stds sqrt(2) and 0.
    A = [-1 / (1.41421 + 1e-4), +1 / (1.41421 + 1e-4), 0, 0] = [-0.707071, 0.707071, 0, 0]."""
    advantages, zero = group_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2, "group")
    expected = 1 / (math.sqrt(2) + 1e-4)
    assert advantages.tolist() == pytest.approx([-expected, expected, 0.0, 0.0], abs=1e-6)
    assert zero.tolist() == [False, False, True, True]


def test_grpo_takes_its_advantages_from_the_estimator_registry():
    """GRPO names its estimator; the registry entry is the group-normalised one."""
    from alignkit.stages.grpo import GRPOTrainer

    assert ADVANTAGE_ESTIMATORS[GRPOTrainer.advantage_estimator] is group_advantages


def test_group_advantages_batch_and_none():
    """rewards [0, 2, 4, 6], G = 2: group means 1, 1, 5, 5 → centred [-1, 1, -1, 1].
    batch: std of [0, 2, 4, 6] = sqrt(((9 + 1 + 1 + 9) / 3)) = sqrt(20 / 3) = 2.581989; A = centred / 2.582089.
    none: A = centred."""
    rewards = torch.tensor([0.0, 2.0, 4.0, 6.0])
    batch, zero = group_advantages(rewards, 2, "batch")
    assert batch.tolist() == pytest.approx([c / (math.sqrt(20 / 3) + 1e-4) for c in (-1, 1, -1, 1)], abs=1e-6)
    assert not zero.any()
    plain, zero = group_advantages(rewards, 2, "none")
    assert plain.tolist() == [-1.0, 1.0, -1.0, 1.0]
    assert not zero.any()  # group stds are sqrt(2), still measured for the metric


def test_group_advantages_leave_unscored_completions_out():
    """Group (1, NaN, 3): mean 2 and std sqrt(2) over the two scored ones; the NaN one gets advantage 0."""
    advantages, _ = group_advantages(torch.tensor([1.0, math.nan, 3.0]), 3, "group")
    expected = 1 / (math.sqrt(2) + 1e-4)
    assert advantages.tolist() == pytest.approx([-expected, 0.0, expected], abs=1e-6)


def test_clipped_surrogate_by_hand():
    """eps_low 0.2, eps_high 0.3.
    ratio 1.5, A = +1: -min(1.5, 1.3) = -1.3 (clipped high);  ratio 0.5, A = -1: -min(-0.5, -0.8) = 0.8 (clipped low);
    ratio 1.0, A = +2: -2;  ratio 0.5, A = +1: -min(0.5, 0.8) = -0.5 (the pessimistic side is unclipped)."""
    logps = torch.log(torch.tensor([[1.5, 1.0], [0.5, 0.5]]))
    old = torch.zeros(2, 2)
    advantages = torch.tensor([[1.0, 2.0], [-1.0, 1.0]])
    loss, ratio = clipped_surrogate(logps, old, advantages, 0.2, 0.3)
    torch.testing.assert_close(ratio, torch.tensor([[1.5, 1.0], [0.5, 0.5]]))
    torch.testing.assert_close(loss, torch.tensor([[-1.3, -2.0], [0.8, -0.5]]))
    # One advantage per row broadcasts over its tokens.
    row_loss, _ = clipped_surrogate(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -2.0]), 0.2, 0.2)
    assert row_loss.tolist() == [[-1.0] * 3, [2.0] * 3]


def test_k3_kl_by_hand():
    """ref - logp = ln 2: 2 - 0.693147 - 1 = 0.306853;  ref - logp = -ln 2: 0.5 + 0.693147 - 1 = 0.193147; equal: 0."""
    logps = torch.tensor([[0.0, 0.0, -1.0]])
    ref = torch.tensor([[math.log(2), -math.log(2), -1.0]])
    torch.testing.assert_close(k3_kl(logps, ref), torch.tensor([[0.306853, 0.193147, 0.0]]))


LOSSES = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
MASK = torch.tensor([[1, 1], [1, 0]])


@pytest.mark.parametrize("loss_type, kwargs, expected", [
    ("grpo", {}, ((1.5 + 3.0) / 2) / 2),             # row means 1.5 and 3, their mean, / k
    ("bnpo", {}, (6 / 3) / 2),                       # 6 over the 3 counted tokens, / k
    # bnpo with 2 processes, this one 3 tokens and the other 5: each divides by (3 + 5) / 2 = 4.
    ("bnpo", {"micro_batch_tokens": 4}, (6 / 4) / 2),
    ("dr_grpo", {"max_completion_length": 4}, (6 / (2 * 4)) / 2),
    ("dapo", {"generation_tokens": 6, "steps_per_generation": 2}, 6 / (6 * 2 / 2)),
])
def test_aggregate_loss_by_hand(loss_type, kwargs, expected):
    assert aggregate_loss(LOSSES, MASK, loss_type, accumulation_steps=2, **kwargs).item() == pytest.approx(expected)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_aggregation_does_not_depend_on_accumulation(loss_type):
    """4 rows as one micro-batch, or as two micro-batches of 2 accumulated: the same step loss."""
    generator = torch.Generator().manual_seed(0)
    losses = torch.randn(4, 5, generator=generator)
    mask = (torch.rand(4, 5, generator=generator) > 0.3).long()
    mask[:, 0] = 1
    tokens = mask.sum().float()
    kwargs = {"max_completion_length": 5, "generation_tokens": tokens}
    whole = aggregate_loss(losses, mask, loss_type, accumulation_steps=1, steps_per_generation=1, **kwargs)
    halves = sum(aggregate_loss(losses[i:i + 2], mask[i:i + 2], loss_type, accumulation_steps=2,
                                steps_per_generation=2, **kwargs) for i in (0, 2))
    assert halves.item() == pytest.approx(whole.item(), abs=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_two_processes_average_to_one(loss_type):
    """Data parallelism averages the processes' gradients: the mean of two halves' losses, each given the
    counts over both divided by 2, equals one process's loss of all four rows (what equal runs need)."""
    generator = torch.Generator().manual_seed(1)
    losses = torch.randn(4, 5, generator=generator)
    mask = (torch.rand(4, 5, generator=generator) > 0.3).long()
    mask[:, 0] = 1
    tokens = mask.sum().float()
    whole = aggregate_loss(losses, mask, loss_type, max_completion_length=5, generation_tokens=tokens)
    halves = [aggregate_loss(losses[i:i + 2], mask[i:i + 2], loss_type, max_completion_length=5,
                             generation_tokens=tokens / 2, micro_batch_tokens=tokens / 2) for i in (0, 2)]
    assert (sum(halves) / 2).item() == pytest.approx(whole.item(), abs=1e-6)


def test_aggregate_loss_rejects_unknown_type():
    with pytest.raises(ValueError, match="choose one of"):
        aggregate_loss(LOSSES, MASK, "ppo")


def test_generation_batch_sampler_layout():
    """4 prompts, 2 per generation batch, G = 2, each batch delivered twice, no shuffle."""
    sampler = GenerationBatchSampler(4, num_generations=2, prompts_per_batch=2, repeat_count=2, shuffle=False)
    assert list(sampler) == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]
    assert len(sampler) == 16
    # An incomplete last generation batch is dropped; shuffling is seeded per epoch.
    odd = GenerationBatchSampler(5, 2, 2, 1, shuffle=True, seed=3)
    first = list(odd)
    assert len(first) == len(odd) == 8
    assert list(odd) == first
    odd.set_epoch(1)
    assert len(list(odd)) == 8


def test_resolve_generation_batch():
    assert resolve_generation_batch(4, 1, 4, None, None, 2) == (2, 8)  # TRL: steps_per_generation = GA
    assert resolve_generation_batch(4, 1, 2, None, 16, 1) == (4, 16)
    assert resolve_generation_batch(4, 1, 2, 3, None, 1) == (3, 12)
    with pytest.raises(ConfigError, match="multiple of per_device_train_batch_size"):
        resolve_generation_batch(4, 1, 2, None, 10, 1)
    with pytest.raises(ConfigError, match="whole groups of num_generations=8"):
        resolve_generation_batch(4, 1, 8, None, None, 1)


def test_config_errors_name_the_fix(monkeypatch):
    base = {"stage": "grpo", "dataset": "demo_math", "reward_funcs": "accuracy"}
    with pytest.raises(ConfigError, match="at least 2"):
        parse_config({**base, "num_generations": 1})
    with pytest.raises(ConfigError, match="multiple of 8"):
        parse_config({**base, "per_device_train_batch_size": 4})
    with pytest.raises(ConfigError, match="both set"):
        parse_config({**base, "steps_per_generation": 2, "generation_batch_size": 16})
    with pytest.raises(ConfigError, match="alignkit eval"):
        parse_config({**base, "per_device_train_batch_size": 8, "do_eval": True, "val_size": 2})
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm" else object())
    with pytest.raises(ConfigError, match=r"alignkit\[vllm\]"):
        parse_config({**base, "per_device_train_batch_size": 8, "use_vllm": True})


def test_config_check_counts_the_launched_processes(monkeypatch):
    """The generation batch holds whole groups over all processes: batch 4 x 2 processes = one group of 8."""
    base = {"stage": "grpo", "dataset": "demo_math", "reward_funcs": "accuracy", "per_device_train_batch_size": 4}
    for module in ("alignkit.stages.grpo", "alignkit.stages.arguments"):  # check_generation_loop, check_run
        monkeypatch.setattr(f"{module}.launched_processes", lambda: 2)
    assert parse_config(base).method.steps_per_generation is None  # checked, left as given
    for module in ("alignkit.stages.grpo", "alignkit.stages.arguments"):
        monkeypatch.setattr(f"{module}.launched_processes", lambda: 1)
    with pytest.raises(ConfigError, match="multiple of 8"):
        parse_config(base)


def test_config_defaults_are_trl_116():
    """Every GRPO key left unset has TRL 1.16 GRPOConfig's default."""
    from trl import GRPOConfig

    method = parse_config({"stage": "grpo", "dataset": "demo_math", "reward_funcs": "accuracy",
                           "per_device_train_batch_size": 8}).method
    trl = GRPOConfig(output_dir="/tmp/unused", per_device_train_batch_size=8, use_cpu=True, bf16=False)
    for key in ("num_generations", "num_iterations", "max_completion_length", "temperature", "top_p", "top_k",
                "min_p", "repetition_penalty", "beta", "epsilon", "loss_type", "scale_rewards", "disable_dropout",
                "vllm_mode",
                "mask_truncated_completions",
                "use_bias_correction_kl", "shuffle_dataset", "use_vllm", "vllm_gpu_memory_utilization",
                "log_completions", "delta", "importance_sampling_level", "sapo_temperature_neg",
                "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                "multi_objective_aggregation", "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy",
                "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
                "off_policy_mask_threshold", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
        assert getattr(method, key) == getattr(trl, key), key
    # Both unset: the config keeps them so (checks do not change it); the Trainer derives TRL's values.
    assert method.steps_per_generation is None and method.generation_batch_size is None
    assert resolve_generation_batch(8, 1, method.num_generations, None, None, 1) == (trl.steps_per_generation,
                                                                                     trl.generation_batch_size)
    assert method.epsilon_high == trl.epsilon  # TRL leaves None meaning "= epsilon"; we write the value


def test_token_entropy_by_hand():
    """Uniform over 2: log 2 = 0.693147; one-hot-like logits [0, -inf-ish]: ~0."""
    logits = torch.tensor([[[0.0, 0.0], [0.0, -100.0]]])
    torch.testing.assert_close(token_entropy(logits), torch.tensor([[math.log(2), 0.0]]))


def test_rollout_seed_and_trl_shapes():
    assert rollout_seed(42, 3) == 42 * 1_000_003 + 3
    messages = [[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]] * 2
    assert trl_prompts(messages, [True, False]) == [messages[0], "q"]
    assert trl_completions(["a", "b"], [True, False]) == [[{"role": "assistant", "content": "a"}], "b"]


def test_row_seeds_by_hand():
    """rollout_seed(7, r) = 7 * 1_000_003 + r: rows 2 and 3 → 7_000_023, 7_000_024."""
    assert row_seeds(7, 2, 2) == [7_000_023, 7_000_024]


def test_per_row_generators_draw_each_row_from_its_own_stream():
    """Row i with its own generator draws what that generator alone gives: probs [0.25, 0.75] pick token 0
    when the row's uniform u < 0.25, else token 1, whatever the other rows are; over 4000 rows seeded by
    `row_seeds` about a quarter pick token 0."""
    from alignkit.model.generation import sample_from_probs

    probs = torch.tensor([[0.25, 0.75]]).repeat(4000, 1)
    seeds = row_seeds(0, 0, 4000)
    picks = sample_from_probs(probs, [torch.Generator().manual_seed(s) for s in seeds])
    assert (picks == 0).float().mean().item() == pytest.approx(0.25, abs=0.03)
    expected = [int(torch.rand(1, generator=torch.Generator().manual_seed(s), dtype=torch.float64).item() >= 0.25)
                for s in seeds[:3]]
    alone = [sample_from_probs(probs[:1], [torch.Generator().manual_seed(s)]).item() for s in seeds[:3]]
    assert picks[:3].tolist() == expected == alone
    with pytest.raises(ValueError, match="2 per-row generators for 3 rows"):
        sample_from_probs(probs[:3], [torch.Generator(), torch.Generator()])


def test_row_seeded_sampling_does_not_depend_on_the_batch(tiny_model_dir, tiny_tokenizer):
    """Four prompts sampled together, or as two halves each told where its first row lies in the whole
    batch (two processes), give the same completions; a different round seed gives others."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompts = [tiny_tokenizer("What is 1 plus 2?")["input_ids"], tiny_tokenizer("Hi")["input_ids"]] * 2
    kwargs = {"stop_token_ids": [], "generation_kwargs": {"do_sample": True, "max_new_tokens": 5,
                                                           "temperature": 1.0, "top_k": 0, "top_p": 1.0}}
    whole = sample_completions(model, tiny_tokenizer, prompts, seed=5, **kwargs).completion_ids
    halves = [sample_completions(model, tiny_tokenizer, prompts[i:i + 2], seed=5, first_row=i, **kwargs).completion_ids
              for i in (0, 2)]
    assert torch.equal(torch.cat(halves), whole)
    assert not torch.equal(whole[0], whole[2])  # the same prompt, two rows: two draws
    other = sample_completions(model, tiny_tokenizer, prompts, seed=6, **kwargs).completion_ids
    assert not torch.equal(other, whole)


def test_generation_from_token_lists_cuts_at_the_stop_token(tiny_tokenizer):
    """Rows [5, 6, 2, 7] (stop 2 at index 2) and [8, 9] (no stop): lengths 3 and 2, the second truncated."""
    out = generation_from_token_lists(tiny_tokenizer, [[11, 12], [13]], [[5, 6, 2, 7], [8, 9]], [2])
    assert out.completion_ids.tolist() == [[5, 6, 2], [8, 9, tiny_tokenizer.pad_token_id]]
    assert out.completion_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert out.truncated.tolist() == [False, True]
    assert out.prompt_mask.tolist() == [[1, 1], [0, 1]]  # prompts left-padded


def test_vllm_weight_items_give_the_plain_checkpoint_names(tiny_model_dir):
    """A LoRA policy's weights, merged, under the names (and values) of the plain model's checkpoint."""
    from transformers import AutoModelForCausalLM

    from alignkit.model.generation import merged_lora
    from alignkit.model.loader import load_model

    config = parse_config({"model_name_or_path": tiny_model_dir, "lora_rank": 4})
    policy = load_model(config.model, config.finetuning, is_trainable=True)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad(), merged_lora(policy):  # the items view the merged weights only inside the block
        items = dict(vllm_weight_items(policy))
        assert set(items) == {n for n, _ in plain.named_parameters()}
        merged = items["model.layers.0.self_attn.q_proj.weight"]
        layer = policy.get_base_model().model.layers[0].self_attn.q_proj
        delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
        torch.testing.assert_close(merged, plain.model.layers[0].self_attn.q_proj.weight + delta)
