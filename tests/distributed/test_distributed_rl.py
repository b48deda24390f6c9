"""GRPO (with REINFORCE++), RLOO and PPO under torchrun on the CPU (gloo): 2 processes x batch b must equal 1 process
x batch 2b.

Generation samples (temperature 1), but each completion is drawn under a seed of its own, from the round and
its place in the global batch (`alignkit.rl.rollout.row_seeds`), so the same completions come out
however the batch is spread over processes; the comparison is exact up to float summation order. The
reward is a function of the token ids, so it differs between the completions of a random tiny model (an
accuracy reward would be 0 everywhere and every advantage 0).
"""

from __future__ import annotations

import json
import sys

import pytest

REWARD_SOURCE = "def token_sum_reward(completions, completion_ids, **kwargs):\n" \
                "    return [float(sum(ids) % 5) for ids in completion_ids]\n"


@pytest.fixture(scope="module")
def reward(dist) -> str:
    path = dist.tmp / "token_reward.py"
    path.write_text(REWARD_SOURCE, encoding="utf-8")
    return f"{path}:token_sum_reward"


def _harness(dist, name):
    """A comparison helper of the harness (`tests/distributed/conftest.py`): a method of `dist` or a function
    of its module."""
    return getattr(dist, name, None) or getattr(sys.modules[type(dist).__module__], name)


def _compare(dist, single, double, keys=("loss",)):
    print(_harness(dist, "loss_table")({"1 proc x 4": single, "2 procs x 2": double}))
    for key in keys:
        _harness(dist, "assert_same_losses")(single, double, key=key)
    _harness(dist, "assert_same_weights")(single, double)


def _completions(run) -> list[dict]:
    lines = (run.out / "completions.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _grpo(dist, reward, name, batch, **keys):
    # G = 4 with 2 rows per process: every group straddles the two processes, so its rewards must be gathered.
    return dist.config("grpo", name, per_device_train_batch_size=batch, num_generations=4,
                       max_completion_length=6, max_steps=3, learning_rate=2e-2, beta=0.05,
                       reward_funcs=[reward], log_completions=True, **keys)


@pytest.fixture(scope="module")
def grpo_runs(dist, reward):
    single = dist.train(_grpo(dist, reward, "grpo_1p", 4))
    double = dist.train(_grpo(dist, reward, "grpo_2p", 2, save_steps=2), nproc=2)
    return single, double


def test_grpo_two_processes_equal_one(dist, grpo_runs):
    single, double = grpo_runs
    _compare(dist, single, double, keys=("loss", "reward"))
    # The main process writes every process's completions, once, in the global order of the one-process run.
    one, two = _completions(single), _completions(double)
    assert len(one) == len(two) == 3 * 4
    for a, b in zip(one, two):
        assert (a["prompt"], a["completion"], a["reward"]) == (b["prompt"], b["completion"], b["reward"])
        assert a["advantage"] == pytest.approx(b["advantage"], abs=1e-5)
    assert len({json.dumps(r["completion"]) for r in one}) > 1  # sampled, not one greedy answer per prompt


def test_grpo_two_process_resume_equals_the_straight_run(dist, reward, grpo_runs):
    _, straight = grpo_runs
    checkpoint = straight.out / "checkpoint-2"
    assert {p.name for p in checkpoint.glob("grpo_rollout_buffer*.pt")} == \
        {"grpo_rollout_buffer_0.pt", "grpo_rollout_buffer_1.pt"}
    resumed = dist.train(_grpo(dist, reward, "grpo_2p_resumed", 2), f"resume_from_checkpoint={checkpoint}",
                         nproc=2)
    losses = resumed.losses()
    assert sorted(losses) == [3]  # only the step after the checkpoint ran
    assert losses[3] == pytest.approx(straight.losses()[3], abs=1e-5)
    _harness(dist, "assert_same_weights")(straight, resumed)


def _ppo(dist, reward, name, batch, **keys):
    # Two update batches per rollout (ppo_buffer_size 2), so an update batch is a slice of the global
    # permutation and the processes' shares of it differ; score normalisation and reward whitening on.
    # Plain SGD: an update is then lr x the summed gradient, so equal weights mean equal gradients. Adam
    # divides each coordinate by its own gradient scale, which turns the float noise of differently shaped
    # batches (about 1e-8) on near-zero coordinates into weight differences of its step size (1e-5 at lr 5e-3).
    values = dict(per_device_train_batch_size=batch, ppo_buffer_size=2, ppo_epochs=2, max_new_tokens=6, max_steps=3,
                  learning_rate=0.5, optim="sgd", reward_funcs=[reward], ppo_score_norm=True, ppo_whiten_rewards=True,
                  init_kl_coef=0.2, ppo_target=0.01, horizon=100, save_steps=2, log_completions=True)
    return dist.config("ppo", name, **{**values, **keys})  # `keys` override these


@pytest.fixture(scope="module")
def ppo_single(dist, reward):
    return dist.train(_ppo(dist, reward, "ppo_1p", 4))


def test_ppo_two_processes_equal_one(dist, reward, ppo_single):
    single = ppo_single
    double = dist.train(_ppo(dist, reward, "ppo_2p", 2), nproc=2)
    _compare(dist, single, double, keys=("loss", "objective/kl"))
    # The value head trains on every process's rows: its gradients are summed across processes too.
    from safetensors.torch import load_file

    heads = [load_file(str(run.out / "value_head.safetensors")) for run in (single, double)]
    for name in heads[0]:
        assert (heads[0][name] - heads[1][name]).abs().max().item() < 1e-5, name
    # The adaptive KL coefficient moved, and the same way (one ppo_state.json, written by the main process).
    states = [json.loads((run.out / "checkpoint-2" / "ppo_state.json").read_text()) for run in (single, double)]
    assert states[0]["kl_ctl"]["value"] != 0.2
    assert states[0]["kl_ctl"]["value"] == pytest.approx(states[1]["kl_ctl"]["value"], rel=1e-5)
    assert states[0]["score_moments"]["count"] == states[1]["score_moments"]["count"] == 2 * 8
    assert states[0]["score_moments"]["mean"] == pytest.approx(states[1]["score_moments"]["mean"], abs=1e-6)
    one, two = _completions(single), _completions(double)
    assert len(one) == len(two) == 3 * 8
    assert [(r["prompt"], r["completion"]) for r in one] == [(r["prompt"], r["completion"]) for r in two]


# FSDP2 through accelerate (its device gate lifted for the test: `cpu_gates`, see tests/distributed/conftest.py).
FSDP2 = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2}}


@pytest.fixture(scope="module")
def ppo_fsdp2(dist, reward):
    return dist.train(_ppo(dist, reward, "ppo_fsdp2", 2, **FSDP2), nproc=2, cpu_gates=True)


def test_ppo_fsdp2_two_processes_equal_one(dist, ppo_single, ppo_fsdp2):
    """The policy adapter and the value head sharded by FSDP2 over 2 processes (gradients reduced in its backward,
    rollouts under `full_weights`) update as 1 process with the double batch."""
    single, fsdp = ppo_single, ppo_fsdp2
    assert (fsdp.out / "checkpoint-2" / "pytorch_model_fsdp.bin").is_file()  # accelerate's FSDP checkpoint
    _compare(dist, single, fsdp, keys=("loss", "objective/kl", "grad_norm"))
    from safetensors.torch import load_file

    heads = [load_file(str(run.out / "value_head.safetensors")) for run in (single, fsdp)]
    for name in heads[0]:
        assert (heads[0][name] - heads[1][name]).abs().max().item() < 1e-5, name
    assert [(r["prompt"], r["completion"]) for r in _completions(single)] == \
        [(r["prompt"], r["completion"]) for r in _completions(fsdp)]


def test_ppo_fsdp2_resume_equals_the_straight_run(dist, reward, ppo_fsdp2):
    out = dist.resume_folder(ppo_fsdp2, 2, "ppo_fsdp2_resumed")
    resumed = dist.train(_ppo(dist, reward, "ppo_fsdp2_resumed", 2, overwrite_output_dir=None, **FSDP2), nproc=2,
                         cpu_gates=True)
    assert resumed.out == out and "Resuming from" in resumed.output
    assert sorted(resumed.losses()) == [1, 2, 3]  # 1-2 from the copied log, 3 run again
    print(_harness(dist, "loss_table")({"straight": ppo_fsdp2, "resumed": resumed}))
    _harness(dist, "assert_same_losses")(ppo_fsdp2, resumed)
    _harness(dist, "assert_same_weights")(ppo_fsdp2, resumed)
    from safetensors.torch import load_file

    heads = [load_file(str(run.out / "value_head.safetensors")) for run in (ppo_fsdp2, resumed)]
    for name in heads[0]:
        assert (heads[0][name] - heads[1][name]).abs().max().item() < 1e-5, name


def test_ppo_fsdp2_full_policy_equals_one(dist, reward):
    """A full fine-tuned policy under FSDP2: every weight sharded and updated on the shards, the reference a whole
    copy taken before sharding, the policy saved from the gathered full state dict without its value head."""
    keys = {"finetuning_type": "full", "learning_rate": 0.05, "max_steps": 2, "save_steps": None}
    single = dist.train(_ppo(dist, reward, "ppo_full_1p", 4, **keys))
    fsdp = dist.train(_ppo(dist, reward, "ppo_full_fsdp2", 2, **keys, **FSDP2), nproc=2, cpu_gates=True)
    _compare(dist, single, fsdp, keys=("loss", "objective/kl", "grad_norm"))
    assert not any(name.startswith("v_head.") for name in fsdp.weights())


@pytest.mark.parametrize("stage, keys", [("rloo", {}), ("grpo", {"advantage_estimator": "reinforce_pp"})],
                         ids=["rloo", "grpo-reinforce_pp"])
def test_rloo_and_reinforce_pp_two_processes_equal_one(dist, reward, stage, keys):
    """RLOO's KL-folded leave-one-out advantages and REINFORCE++'s batch-wide whitening are taken over every
    process's rows: 2 processes x batch 2 train as 1 process x batch 4 (groups straddle the processes)."""
    name = f"{stage}_{keys.get('advantage_estimator', 'loo')}"

    def config(suffix, batch):
        return dist.config(stage, f"{name}_{suffix}", dataset="demo_math", per_device_train_batch_size=batch,
                           num_generations=4, max_completion_length=6, max_steps=3, learning_rate=2e-2, beta=0.05,
                           reward_funcs=[reward], **keys)

    single, double = dist.train(config("1p", 4)), dist.train(config("2p", 2), nproc=2)
    _compare(dist, single, double, keys=("loss", "reward", "kl"))
