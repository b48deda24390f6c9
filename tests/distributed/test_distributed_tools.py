"""GRPO with a tool under torchrun on the CPU (gloo): 2 processes x batch 2 must equal 1 process x batch 4, losses,
every logged metric (the `tools/*` counts reduced over the processes among them), the completions turn by turn and
the final adapter, within 1e-5.

A random tiny model never writes a tool call, so the runs' processes get a policy that does (`POLICY_SOURCE`, a
`sitecustomize` put first on their PYTHONPATH): at turn 0 a row whose sampling seed is odd calls the deterministic
`add` tool with arguments taken from that seed; every other turn, and turn 0 of the other rows, is sampled from the
model for real under the row's seed. So the second turns are real samples drawn under the per-row, per-turn seeds
(`rl.tools.turn_seeds`), and they come out the same only if each row's seeds do not depend on how the batch is
spread over processes. The loss trains on the scripted and the sampled turns alike, the tool turns masked out.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tests" / "tool_functions.py"

POLICY_SOURCE = '''"""Test-only (tests/distributed/test_distributed_tools.py): turn 0 of a row with an odd seed calls `add`."""
import json

from alignkit.rl.rollout import generation_from_token_lists
from alignkit.stages import online

_sample = online.sample_completions


def _turn0_calls(model, tokenizer, prompt_ids, *, generation_kwargs, seeds=None, **kwargs):
    if seeds is None:  # not a tool rollout
        return _sample(model, tokenizer, prompt_ids, generation_kwargs=generation_kwargs, **kwargs)
    turns = [tokenizer.decode(ids).count("<|im_start|>assistant") - 1 for ids in prompt_ids]
    scripted = [i for i, (turn, seed) in enumerate(zip(turns, seeds)) if turn == 0 and seed % 2]
    sampled = [i for i in range(len(prompt_ids)) if i not in scripted]
    out = {}
    if sampled:
        real = _sample(model, tokenizer, [prompt_ids[i] for i in sampled], generation_kwargs=generation_kwargs,
                       seeds=[seeds[i] for i in sampled], **kwargs)
        for i, ids, n in zip(sampled, real.completion_ids, real.completion_mask.sum(1)):
            out[i] = ids[:n].tolist()
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i in scripted:
        call = {"name": "add", "arguments": {"a": seeds[i] % 5, "b": seeds[i] % 7}}
        out[i] = tokenizer("<tool_call>\\n" + json.dumps(call) + "\\n</tool_call>", add_special_tokens=False)[
            "input_ids"] + [stop]
    completions = [out[i][:generation_kwargs["max_new_tokens"]] for i in range(len(prompt_ids))]
    return generation_from_token_lists(tokenizer, prompt_ids, completions, [stop])


online.sample_completions = _turn0_calls
'''


# Messages in the completion (1 without a call, 3 with one) plus a function of the token ids, so the rewards of a
# group differ and the advantages drive the update. (With equal rewards the step trains on the KL alone, a gradient
# near 1e-6 that Adam scales up to the learning rate, float noise included: the runs then sample apart.)
REWARD_SOURCE = "def reward(completions, completion_ids, **kwargs):\n" \
                "    return [len(c) + float(sum(ids) % 5) for c, ids in zip(completions, completion_ids)]\n"


@pytest.fixture(scope="module")
def policy_env(dist) -> dict[str, str]:
    folder = dist.tmp / "tool_policy"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(POLICY_SOURCE, encoding="utf-8")
    (dist.tmp / "tool_reward.py").write_text(REWARD_SOURCE, encoding="utf-8")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def _grpo_tools(dist, name, batch):
    # G = 4 with 2 rows per process: every group straddles the two processes. The call (about 60 tokens of the tiny
    # tokenizer), its tool turn with the next generation prompt (about 35) and a sampled second turn fit in 160.
    # Plain SGD (as the PPO test in test_distributed_rl.py): an update is lr x the summed gradient, so the float noise
    # of differently split batches stays noise; Adam divides each element by its own gradient's scale and turned it
    # into a 2.4e-5 gap in a `lora_A` element after 3 steps at lr 2e-2.
    return dist.config("grpo", name, per_device_train_batch_size=batch, num_generations=4,
                       max_completion_length=160, max_steps=3, learning_rate=0.5, optim="sgd", beta=0.05,
                       reward_funcs=[f"{dist.tmp / 'tool_reward.py'}:reward"], tools=[f"{TOOLS}:add"],
                       max_tool_calling_iterations=2,
                       tool_timeout=5.0, log_completions=True)


def test_grpo_with_tools_two_processes_equal_one(dist, policy_env):
    single = dist.train(_grpo_tools(dist, "grpo_tools_1p", 4), env=policy_env)
    double = dist.train(_grpo_tools(dist, "grpo_tools_2p", 2), nproc=2, env=policy_env)
    harness = sys.modules[type(dist).__module__]  # the conftest's comparisons (tests/distributed/conftest.py)
    print(harness.loss_table({"1 proc x 4": single, "2 procs x 2": double}))
    harness.assert_same_losses(single, double)
    # `kl` and `entropy` are each process's token mean averaged over the processes (TRL's reduction too): with
    # completions of different lengths on the two processes that weighs tokens otherwise than one process's mean.
    harness.assert_same_logs(single, double, atol=1e-5, ignore=("kl", "entropy"))
    dist.assert_same_weights(single, double)
    records = [[json.loads(line) for line in (run.out / "completions.jsonl").read_text().splitlines()]
               for run in (single, double)]
    assert len(records[0]) == len(records[1]) == 3 * 4
    assert [(r["prompt"], r["completion"], r["reward"]) for r in records[0]] == \
        [(r["prompt"], r["completion"], r["reward"]) for r in records[1]]
    # Both kinds of row ran: some called the tool and answered after its result, some answered at once.
    roles = [[m["role"] for m in r["completion"]] for r in records[0]]
    assert ["assistant"] in roles and ["assistant", "tool", "assistant"] in roles
    calls = [r["tools/call_frequency"] for r in single.log() if "tools/call_frequency" in r]
    assert len(calls) == 3 and all(0 < c < 1 for c in calls)
