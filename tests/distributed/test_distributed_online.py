"""Distillation and online DPO under torchrun on the CPU (gloo): 2 processes x batch 2 must equal 1 process x
batch 4, losses, logged metrics and final adapters within 1e-5. Each row is sampled under a seed of its own, from
the round and its place in the global batch, so the same completions come out however the batch is spread."""

from __future__ import annotations

import json
import sys

import pytest

REWARD_SOURCE = "def token_sum_reward(completions, completion_ids, **kwargs):\n" \
                "    return [float(sum(ids) % 5) for ids in completion_ids]\n"


def _harness(dist, name):
    """A helper of the harness (`tests/distributed/conftest.py`): a method of `dist` or a function of its module."""
    return getattr(dist, name, None) or getattr(sys.modules[type(dist).__module__], name)


def _compare(dist, single, double):
    print(_harness(dist, "loss_table")({"1 proc x 4": single, "2 procs x 2": double}))
    _harness(dist, "assert_same_losses")(single, double)
    _harness(dist, "assert_same_logs")(single, double, atol=1e-5)
    _harness(dist, "assert_same_weights")(single, double)
    completions = [[json.loads(line) for line in (run.out / "completions.jsonl").read_text().splitlines()]
                   for run in (single, double)]
    assert [(r["prompt"], r["completion"]) for r in completions[0]] == \
        [(r["prompt"], r["completion"]) for r in completions[1]]


@pytest.fixture(scope="module")
def teacher_dir(dist):
    """The tiny model with every weight moved by seeded noise, saved with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(dist.model_dir)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    out = dist.tmp / "teacher"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(dist.model_dir).save_pretrained(out)
    return str(out)


def test_distill_two_processes_equal_one(dist, teacher_dir):
    def config(name, batch):
        return dist.config("distill", name, dataset="demo_math", teacher_model_name_or_path=teacher_dir,
                           per_device_train_batch_size=batch, max_completion_length=6, max_steps=3,
                           learning_rate=2e-2, beta=0.5, log_completions=True)

    _compare(dist, dist.train(config("distill_1p", 4)), dist.train(config("distill_2p", 2), nproc=2))


def test_online_dpo_two_processes_equal_one(dist):
    reward = dist.tmp / "token_reward.py"
    reward.write_text(REWARD_SOURCE, encoding="utf-8")

    def config(name, batch):
        return dist.config("online_dpo", name, dataset="demo_math", reward_funcs=[f"{reward}:token_sum_reward"],
                           per_device_train_batch_size=batch, max_new_tokens=6, max_steps=3, learning_rate=2e-2,
                           log_completions=True)

    _compare(dist, dist.train(config("online_dpo_1p", 4)), dist.train(config("online_dpo_2p", 2), nproc=2))
