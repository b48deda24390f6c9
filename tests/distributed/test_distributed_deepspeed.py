"""Real DeepSpeed (0.19, ZeRO-2 and ZeRO-3) on the CPU over gloo: 2 processes must train as 1 process without it.

DeepSpeed runs on the CPU here through its CPU accelerator, which falls back to gloo. accelerate (1.15) does not
hand DeepSpeed a backend on a machine without GPUs, so the 2-process runs lift that gate with a test-only
`sitecustomize` (`cpu_gates=True`: `tests/distributed/cpu_gates/`, see its docstring); without it alignkit refuses the run with a
ConfigError, which is tested too. A DeepSpeed run of one process, started without a launcher, needs no gate
(alignkit gives it the variables torchrun would: `alignkit.launch.single_process_rendezvous`).

Every run uses the DeepSpeed JSONs shipped in `examples/deepspeed/`, with their `"auto"` values filled in by
transformers. Compared: per-step losses (and the stage's own figures), and the saved weights, within 1e-5, against
1 process x the double batch without DeepSpeed:

- sft, full fine-tuning, ZeRO-3 (weights partitioned at load by `zero.Init`, saved by gathering them): 2 processes,
  2 processes with the optimizer and weights offloaded to the CPU, and 1 process started alone; a 2-process resume
  from the ZeRO-3 checkpoint equals the uninterrupted run;
- dpo, LoRA, ZeRO-3, with the reference log-probs precomputed (the reference pass gathers the partitioned weights
  once, `full_weights`) and `pref_ftx`;
- rm, LoRA, ZeRO-2;
- ppo, LoRA, ZeRO-2 and ZeRO-3 (PPO's own loop on the DeepSpeed engine: backward and step through it, ZeRO-3
  rollouts in one gather, the adapter and value head saved from the consolidated state dict);
- grpo, LoRA, ZeRO-3 (generation inside one gather, given the engine);
- ZeRO-3 with a full policy's reference (a second, partitioned load gathered per reference pass): dpo without
  precomputed reference log-probs, ppo full; and ppo in the shape of `examples/ppo_lora.yaml` (a LoRA policy
  over an SFT adapter merged into a cached base before the partitioned load, a LoRA reward model over it).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is not installed (pip install 'alignkit[deepspeed]'; the dev extra has it)")

ROOT = Path(__file__).resolve().parents[2]
Z2 = str(ROOT / "examples" / "deepspeed" / "ds_z2_config.json")
Z3 = str(ROOT / "examples" / "deepspeed" / "ds_z3_config.json")

REWARD_SOURCE = "def token_sum_reward(completions, completion_ids, **kwargs):\n" \
                "    return [float(sum(ids) % 5) for ids in completion_ids]\n"


def _harness(dist, name):
    """A helper of the harness (`tests/distributed/conftest.py`): a method of `dist` or a function of its module."""
    return getattr(dist, name, None) or getattr(sys.modules[type(dist).__module__], name)


def _compare(dist, single, double, keys=("loss",), label="2 procs x 2, DeepSpeed"):
    print("\n" + _harness(dist, "loss_table")({"1 proc x 4": single, label: double}))
    for key in keys:
        _harness(dist, "assert_same_losses")(single, double, key=key)
    _harness(dist, "assert_same_weights")(single, double)


def _pair(dist, stage, name, ds_config, single_keys=None, double_keys=None, **keys):
    """1 process x batch 4 without DeepSpeed, and 2 processes x batch 2 under `ds_config`."""
    single = dist.train(dist.config(stage, f"{name}_1p", per_device_train_batch_size=4, **keys,
                                    **(single_keys or {})))
    double = dist.train(dist.config(stage, f"{name}_ds", per_device_train_batch_size=2, deepspeed=ds_config,
                                    **keys, **(double_keys or {})), nproc=2, cpu_gates=True)
    return single, double


@pytest.fixture(scope="module")
def reward(dist) -> str:
    path = dist.tmp / "ds_token_reward.py"
    path.write_text(REWARD_SOURCE, encoding="utf-8")
    return f"{path}:token_sum_reward"


@pytest.fixture(scope="module")
def sft_runs(dist):
    return _pair(dist, "sft", "sft_full_z3", Z3, finetuning_type="full", double_keys={"save_steps": 2})


def test_sft_full_zero3_two_processes_equal_one(dist, sft_runs):
    single, double = sft_runs
    assert "DeepSpeed" in double.output or "deepspeed" in double.output
    _compare(dist, single, double)
    _harness(dist, "assert_same_logs")(single, double)
    # Saved whole (gathered from the partitions), loadable as a plain model.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(double.out)
    assert all(p.numel() > 0 for p in model.parameters())
    checkpoint = double.out / "checkpoint-2"
    assert any(p.name.startswith("global_step") for p in checkpoint.iterdir())  # the engine's own checkpoint


def test_sft_full_zero3_resume_equals_the_straight_run(dist, sft_runs):
    _, straight = sft_runs
    resumed = dist.train(dist.config("sft", "sft_full_z3_resumed", per_device_train_batch_size=2, deepspeed=Z3,
                                     finetuning_type="full"),
                         f"resume_from_checkpoint={straight.out / 'checkpoint-2'}", nproc=2, cpu_gates=True)
    losses = resumed.losses()
    assert sorted(losses) == [3, 4]  # only the steps after the checkpoint ran
    for step in (3, 4):
        assert losses[step] == pytest.approx(straight.losses()[step], abs=1e-5)
    _harness(dist, "assert_same_weights")(straight, resumed)


def test_deepspeed_alone_needs_no_launcher(dist, sft_runs):
    single, _ = sft_runs
    alone = dist.train(dist.config("sft", "sft_full_z3_alone", per_device_train_batch_size=4, deepspeed=Z3,
                                   finetuning_type="full"))
    _compare(dist, single, alone, label="1 proc x 4, DeepSpeed")


def test_sft_full_zero3_with_cpu_offload_equals_one_process(dist, sft_runs):
    """`ds_z3_offload_config.json`: optimizer state and weights offloaded to the CPU (DeepSpeed's own)."""
    single, _ = sft_runs
    offload = str(ROOT / "examples" / "deepspeed" / "ds_z3_offload_config.json")
    run = dist.train(dist.config("sft", "sft_full_z3_offload", per_device_train_batch_size=2, deepspeed=offload,
                                 finetuning_type="full"), nproc=2, cpu_gates=True)
    _compare(dist, single, run, label="2 procs x 2, ZeRO-3 offload")


def test_deepspeed_without_the_gate_is_refused_clearly(dist):
    run = dist.train(dist.config("sft", "sft_ungated", per_device_train_batch_size=2, deepspeed=Z3), nproc=2,
                     check=False)
    assert run.returncode != 0
    assert "accelerate set DeepSpeed up for 1" in run.output
    # A ConfigError, not a crash inside DeepSpeed (torchrun prints a traceback of its own for the failed workers).
    # Frames are matched by the installed packages' own folders, not by a folder name: a checkout folder named
    # `alignkit` holds torch's files too (in its .venv), and torchrun's traceback names them.
    packages = "|".join(re.escape(importlib.util.find_spec(name).submodule_search_locations[0])
                        for name in ("alignkit", "deepspeed"))
    assert not re.search(rf'File "({packages})/', run.output), run.output[-3000:]


def test_dpo_lora_zero3_two_processes_equal_one(dist):
    single, double = _pair(dist, "dpo", "dpo_lora_z3", Z3, precompute_ref_log_probs=True, pref_ftx=0.5)
    _compare(dist, single, double, keys=("loss", "rewards/margins"))


def test_rm_lora_zero2_two_processes_equal_one(dist):
    single, double = _pair(dist, "rm", "rm_lora_z2", Z2)
    _compare(dist, single, double, keys=("loss", "rewards/accuracies"))


def _ppo_keys(reward):
    # As tests/distributed/test_distributed_rl.py: two update batches per rollout, plain SGD (an update is then
    # lr x the summed gradient, so equal weights mean equal gradients), score normalisation and whitening on.
    return dict(ppo_buffer_size=2, ppo_epochs=2, max_new_tokens=6, max_steps=3, learning_rate=0.5, optim="sgd",
                reward_funcs=[reward], ppo_score_norm=True, ppo_whiten_rewards=True, init_kl_coef=0.2,
                ppo_target=0.01, horizon=100, log_completions=True)


@pytest.mark.parametrize("zero", ["z2", "z3"])
def test_ppo_lora_zero_two_processes_equal_one(dist, reward, zero):
    single, double = _pair(dist, "ppo", f"ppo_lora_{zero}", {"z2": Z2, "z3": Z3}[zero], **_ppo_keys(reward))
    _compare(dist, single, double, keys=("loss", "objective/kl"))
    from safetensors.torch import load_file

    heads = [load_file(str(run.out / "value_head.safetensors")) for run in (single, double)]
    assert heads[0].keys() == heads[1].keys()
    for name in heads[0]:
        assert (heads[0][name] - heads[1][name]).abs().max().item() < 1e-5, name


def test_grpo_lora_zero3_two_processes_equal_one(dist, reward):
    keys = dict(num_generations=4, max_completion_length=6, max_steps=3, learning_rate=2e-2, beta=0.05,
                reward_funcs=[reward])
    single, double = _pair(dist, "grpo", "grpo_lora_z3", Z3, **keys)
    _compare(dist, single, double, keys=("loss", "reward"))


# ---- ZeRO-3 with a full policy's reference and with adapter_name_or_path (the merged base) ----


def test_dpo_full_zero3_reference_is_a_partitioned_load_and_trains_as_one_process(dist):
    """No precompute: each step's reference pass runs on the policy's source loaded a second time, partitioned by
    `zero.Init` and gathered for the pass."""
    single, double = _pair(dist, "dpo", "dpo_full_z3", Z3, finetuning_type="full", max_steps=3)
    _compare(dist, single, double, keys=("loss", "rewards/margins"))


def test_ppo_zero3_in_the_shape_of_the_example_trains_as_one_process(dist, reward):
    """`examples/ppo_lora.yaml`'s shape: a LoRA policy over an SFT adapter (`adapter_name_or_path`, merged into a
    cached base before the ZeRO-3 load) and a LoRA reward model trained over that adapter, switched in as a named
    adapter on the one base; plus a reward function."""
    sft = dist.train(dist.config("sft", "ds_sft_adapter", max_steps=2))
    rm = dist.train(dist.config("rm", "ds_rm_over_sft", max_steps=2, adapter_name_or_path=str(sft.out)))
    keys = {**_ppo_keys(reward), "adapter_name_or_path": str(sft.out), "reward_model": str(rm.out),
            "reward_model_type": "lora"}
    single, double = _pair(dist, "ppo", "ppo_example_z3", Z3, **keys)
    _compare(dist, single, double, keys=("loss", "objective/kl"))
    # The ZeRO-3 run merged the SFT adapter once into a cached base (the plain run merges in memory).
    assert len(list((double.home / "merged").glob("*/alignkit_merged_base.json"))) == 1
    assert not (single.home / "merged").exists()


def test_ppo_full_zero3_trains_as_one_process(dist, reward):
    single, double = _pair(dist, "ppo", "ppo_full_z3", Z3, finetuning_type="full",
                           **{**_ppo_keys(reward), "max_steps": 2})
    _compare(dist, single, double, keys=("loss", "objective/kl"))
