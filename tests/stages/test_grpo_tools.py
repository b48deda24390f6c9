"""GRPO and RLOO with tools on the tiny model, end to end through `alignkit train`'s path: a scripted policy (the
sampler answers each context with a fixed turn) calls a tool that works, one that raises, one that sleeps past
`tool_timeout`, one that returns 10 MB, writes malformed JSON and an unknown name; rows finish at different turns.
The run trains, the loss mask leaves the tool turns out, the metrics and `completions.jsonl` show the turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alignkit.callbacks import read_log
from alignkit.errors import ConfigError
from alignkit.rl.rollout import generation_from_token_lists
from alignkit.stages import grpo as grpo_module
from alignkit.stages import online as online_module
from alignkit.train import run_train
from tests.helpers import tiny_config

TOOLS_FILE = Path(__file__).resolve().parent.parent / "tool_functions.py"


def _call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# Prompt i's turns (the scripted policy): prompt 0 answers at once, 1 after one tool turn, 2 after two (a failing
# call, a timeout, malformed JSON, an unknown tool), 3 calls until the iteration cap (2) stops it.
TURNS = [
    ["The answer is 1."],
    [_call("add", a=1, b=2) + "\n" + _call("huge"), "It is 3."],
    [_call("boom", x=1) + "\n" + _call("sleepy", seconds=3), '<tool_call>\n{"name": "add", "arguments": {\n</tool_call>'
     + "\n" + _call("nope"), "Done."],
    [_call("add", a=2, b=2)] * 4,
]


@pytest.fixture(scope="module")
def long_tiny_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a 4096-token context: four tool schemas in the prompt (~700 tokens in its 512-token
    vocabulary) and several tool turns pass its 1024."""
    import shutil

    path = tmp_path_factory.mktemp("long_tiny") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return str(path)


def scripted_sampler(tokenizer, record):
    """`sample_completions` replaced: each context's next turn is TURNS[prompt][turn], the turn counted by the
    generation prompts in the context."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def sample(model, tok, prompt_ids, *, generation_kwargs, seeds=None, **kwargs):
        out = []
        for ids in prompt_ids:
            text = tokenizer.decode(ids)
            prompt = int(text.split("Question ")[1].split(".")[0])
            turn = text.count("<|im_start|>assistant") - 1
            turn_ids = tokenizer(TURNS[prompt][turn], add_special_tokens=False)["input_ids"] + [eos]
            out.append(turn_ids[:generation_kwargs["max_new_tokens"]])
        record.append(seeds)
        return generation_from_token_lists(tokenizer, prompt_ids, out, [eos])

    return sample


def _config(tiny_model_dir, tmp_path, stage="grpo", questions=range(4), tools=("add", "boom", "sleepy", "huge"),
            **overrides):
    tools_file = TOOLS_FILE
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps([{"prompt": f"Question {i}."} for i in questions]))
    return tiny_config(**{
        "stage": stage, "do_train": True, "model_name_or_path": tiny_model_dir, "dataset": str(data),
        "template": "chatml", "reward_funcs": [f"{tools_file}:calls_reward"], "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8, "num_generations": 2, "max_completion_length": 1000, "max_steps": 1,
        "learning_rate": 1e-2, "save_strategy": "no", "logging_steps": 1, "lora_rank": 4, "seed": 0,
        "shuffle_dataset": False, "log_completions": True, "tools": [f"{tools_file}:{n}" for n in tools],
        "max_tool_calling_iterations": 2, "tool_timeout": 0.3, "max_tool_output_chars": 20, **overrides})


def _keep_batches(monkeypatch) -> list[dict[str, torch.Tensor]]:
    batches = []
    original = grpo_module.GRPOTrainer._generate_and_score

    def keep(self, rows, round_index):
        slices = original(self, rows, round_index)
        batches.extend(slices)
        return slices

    monkeypatch.setattr(grpo_module.GRPOTrainer, "_generate_and_score", keep)
    return batches


def test_tool_rollout_trains_with_tool_turns_out_of_the_loss(long_tiny_model_dir, tiny_tokenizer, tmp_path,
                                                             monkeypatch):
    seeds = []
    monkeypatch.setattr(online_module, "sample_completions", scripted_sampler(tiny_tokenizer, seeds))
    batches = _keep_batches(monkeypatch)
    config = _config(long_tiny_model_dir, tmp_path)
    run_train(config)

    out = Path(config.training.output_dir)
    (batch,) = batches
    attention, loss_mask = batch["completion_attention_mask"], batch["completion_mask"]
    # Tool turns attended, not trained: the loss mask is the attention minus the tool-response tokens.
    assert torch.equal(loss_mask, attention * loss_mask) and (attention.sum(1) > loss_mask.sum(1)).sum() == 6
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    by_prompt = {r["prompt"]: r["completion"] for r in records}
    roles = {k: [m["role"] for m in v] for k, v in by_prompt.items()}
    assert roles["Question 0."] == ["assistant"]
    assert roles["Question 1."] == ["assistant", "tool", "tool", "assistant"]
    assert roles["Question 2."] == ["assistant", "tool", "tool", "assistant", "tool", "tool", "assistant"]
    assert roles["Question 3."] == ["assistant", "tool", "assistant", "tool", "assistant"]  # the cap: 2 tool turns
    q1, q2 = by_prompt["Question 1."], by_prompt["Question 2."]
    assert q1[1]["content"] == "3" and q1[2]["content"].startswith("x" * 20 + "\n[output cut")
    assert q2[1]["content"] == "{'error': 'kaboom'}" and "did not return within 0.3 s" in q2[2]["content"]
    assert "not valid JSON" in q2[4]["content"] and q2[5]["content"] == "{'error': 'Tool nope not found.'}"
    assert all(r["reward"] == len(r["completion"]) for r in records)  # rewards saw the message lists
    (log,) = [r for r in read_log(out) if "loss" in r]
    assert math_finite(log["loss"])
    # Per pair of rows: calls 0, 2, 4, 2 -> 8 / 4 per completion; failures boom, sleepy, malformed, nope: 4 of 8.
    assert log["tools/call_frequency"] == pytest.approx(2.0) and log["tools/failure_frequency"] == pytest.approx(0.5)
    assert log["tools/add/call_frequency"] == pytest.approx(0.75) and log["tools/unknown/call_frequency"] == 0.5
    assert log["tools/boom/failure_frequency"] == 1.0 and log["tools/huge/failure_frequency"] == 0.0
    # Turn 0 under the round's row seeds, later turns under per-row, per-turn seeds.
    assert seeds[0] == grpo_module.turn_seeds(grpo_module.rollout_seed(0, 0), 0, range(8))


def test_rloo_with_tools(long_tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """RLOO shares the loop; its own loss and KL-in-the-reward take the loss mask, its forward the attention."""
    monkeypatch.setattr(online_module, "sample_completions", scripted_sampler(tiny_tokenizer, []))
    batches = _keep_batches(monkeypatch)
    config = _config(long_tiny_model_dir, tmp_path, "rloo", questions=[1], tools=("add", "huge"),
                     per_device_train_batch_size=2)
    run_train(config)
    (batch,) = batches
    assert (batch["completion_attention_mask"].sum(1) > batch["completion_mask"].sum(1)).all()
    (log,) = [r for r in read_log(config.training.output_dir) if "loss" in r]
    assert math_finite(log["loss"]) and log["tools/call_frequency"] == 2.0 and "kl" in log


def math_finite(value):
    return value == value and abs(value) != float("inf")


def test_bad_tool_keys_fail_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    from alignkit.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match="tools .*tool_functions.py:ad.*has no `ad`. Did you mean `add`"):
        run_train(_config(tiny_model_dir, tmp_path, tools=["ad"]))
    with pytest.raises(ConfigError, match="max_tool_calling_iterations=-1"):
        _config(tiny_model_dir, tmp_path, max_tool_calling_iterations=-1)
    from alignkit.errors import DataError

    with pytest.raises(DataError, match="does not write them"):
        run_train(_config(tiny_model_dir, tmp_path, template=None))


def seeded_sampler(tokenizer):
    """A scripted policy whose choice depends on the sampling seeds: at turn 0 a row whose seed is odd calls `add`
    ("Plan 1."), then answers; an even one answers at once. Later turns read the plan from the context."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def sample(model, tok, prompt_ids, *, generation_kwargs, seeds=None, **kwargs):
        out = []
        for ids, seed in zip(prompt_ids, seeds):
            text = tokenizer.decode(ids)
            turn = text.count("<|im_start|>assistant") - 1
            plan = seed % 2 if turn == 0 else int(text.split("Plan ")[1][0])
            turns = ["Plan 0. It is 2."] if plan == 0 else ["Plan 1.\n" + _call("add", a=1, b=seed % 7), "Done."]
            out.append(tokenizer(turns[turn], add_special_tokens=False)["input_ids"] + [eos])
        return generation_from_token_lists(tokenizer, prompt_ids, out, [eos])

    return sample


@pytest.mark.fault
def test_resume_mid_generation_batch_with_tools_equals_the_straight_run(tiny_model_dir, tiny_tokenizer, tmp_path,
                                                                        monkeypatch, crash_before_step):
    """steps_per_generation 2: checkpoint-3 falls inside round 1, whose buffered slices (with the tool turns'
    attention and loss masks) the resumed run reloads; round 2 is generated again under the same per-row, per-turn
    seeds. The completions (every turn), rewards, losses and the final adapter after the checkpoint equal the straight
    run's bit for bit. (They once differed by ~1e-7: the prompts, long with the tool schemas, take the shared-prompt
    pass of `completion_logps`, whose copied KV cache summed its gradient with multi-threaded atomics; two straight
    runs differed as much. See `rl.rollout._repeat_cache_rows`.)"""
    from safetensors.torch import load_file

    monkeypatch.setattr(online_module, "sample_completions", seeded_sampler(tiny_tokenizer))
    keys = dict(tools=("add",), per_device_train_batch_size=4, num_generations=4, steps_per_generation=2,
                max_steps=5, save_strategy="steps", save_steps=3, beta=0.05, max_completion_length=120)

    def config(out):
        return _config(tiny_model_dir, tmp_path, output_dir=str(tmp_path / out), **keys)

    run_train(config("straight"))
    with pytest.raises(Exception, match="killed before step"):
        run_train(config("resumed"), callbacks=[crash_before_step(4)])
    assert (tmp_path / "resumed" / "checkpoint-3" / grpo_module.ROLLOUT_BUFFER_FILE).is_file()
    run_train(config("resumed"))

    def losses(out):
        return {r["current_steps"]: (r["loss"], r["tools/call_frequency"] if "tools/call_frequency" in r else None)
                for r in read_log(tmp_path / out) if "loss" in r}

    want, got = losses("straight"), losses("resumed")
    assert set(got) == set(want) == set(range(1, 6))
    for step in range(4, 6):
        assert got[step] == want[step], step
    assert 0 < want[5][1] < 1  # some rows called, some did not

    def records(out):
        return [(r["step"], r["completion"], r["reward"]) for r in
                map(json.loads, (tmp_path / out / "completions.jsonl").read_text().splitlines())]

    assert records("resumed") == records("straight")
    a, b = (load_file(str(tmp_path / o / "adapter_model.safetensors")) for o in ("straight", "resumed"))
    assert set(a) == set(b) and [name for name in a if not torch.equal(a[name], b[name])] == []
