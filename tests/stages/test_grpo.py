"""GRPO end to end on the tiny model: a run trains and logs, generation happens once per generation batch,
accumulation alone does not change the update, and a resumed run equals the uninterrupted one."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignkit.callbacks import read_log
from alignkit.errors import ConfigError
from alignkit.stages import grpo as grpo_module
from alignkit.stages import online as online_module
from alignkit.train import run_train
from tests.helpers import tiny_config

# A reward that varies between completions of a random model and depends on nothing but the token ids.
REWARD_SOURCE = "def token_sum_reward(completions, completion_ids, **kwargs):\n" \
                "    return [float(sum(ids) % 5) for ids in completion_ids]\n"


def _data(tmp_path: Path, num_prompts: int) -> str:
    path = tmp_path / "prompts.json"
    rows = [{"prompt": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)} for i in range(num_prompts)]
    path.write_text(json.dumps(rows))
    return str(path)


def _reward(tmp_path: Path) -> str:
    path = tmp_path / "token_reward.py"
    path.write_text(REWARD_SOURCE)
    return f"{path}:token_sum_reward"


def _config(tiny_model_dir, tmp_path, out, num_prompts=4, **overrides):
    return tiny_config(**{
        "stage": "grpo", "do_train": True, "model_name_or_path": tiny_model_dir,
        "dataset": _data(tmp_path, num_prompts), "reward_funcs": [_reward(tmp_path), "accuracy"],
        "output_dir": str(out), "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 6, "max_steps": 4, "learning_rate": 2e-2, "lr_scheduler_type": "constant",
        "save_strategy": "no", "logging_steps": 1, "lora_rank": 4, "seed": 0, "disable_tqdm": True,
        "use_cpu": True, **overrides,
    })


@pytest.fixture
def count_generations(monkeypatch):
    """Counts calls of the rollout sampler (one per generation batch), and checks that each runs inside one
    `full_weights` block of its own (under ZeRO-3/FSDP: the shards gathered once per generation batch)."""
    calls, blocks = [], []
    # The online base class samples for GRPO (`OnlineTrainer.sample`).
    original, original_full_weights = online_module.sample_completions, online_module.full_weights

    @contextlib.contextmanager
    def recording_full_weights(model, engine=None):
        assert engine is None  # no DeepSpeed here: no engine is handed over
        blocks.append("open")
        with original_full_weights(model, engine) as whole:
            yield whole
        blocks[-1] = "closed"

    def counting(model, tokenizer, prompt_ids, **kwargs):
        assert blocks and blocks[-1] == "open", "generation ran outside full_weights"
        calls.append(len(prompt_ids))
        return original(model, tokenizer, prompt_ids, **kwargs)

    monkeypatch.setattr(online_module, "sample_completions", counting)
    monkeypatch.setattr(online_module, "full_weights", recording_full_weights)
    yield calls
    assert blocks == ["closed"] * len(calls)


def _losses(out: Path) -> dict[int, float]:
    return {r["current_steps"]: r["loss"] for r in read_log(out) if "loss" in r}


def test_grpo_trains_logs_and_generates_once_per_generation_batch(tiny_model_dir, tmp_path, count_generations):
    """spg 2 x num_iterations 2 = 4 micro-batches per generation batch; 8 steps (GA 1) = 2 generations."""
    out = tmp_path / "out"
    run_train(_config(tiny_model_dir, tmp_path, out, steps_per_generation=2, num_iterations=2, max_steps=8,
                      beta=0.05, log_completions=True, plot_loss=True))
    assert count_generations == [8, 8]  # two generation batches of 2 prompts x 4 completions

    records = [r for r in read_log(out) if "loss" in r]
    assert [r["current_steps"] for r in records] == list(range(1, 9))
    for record in records:
        assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])
        assert record["kl"] >= 0 and record["entropy"] > 0
        assert record["time/generation"] >= 0 and record["time/training"] > 0
        # Rollout metrics are logged by the steps that generated (1 and 5), as TRL logs them.
        assert ("reward" in record) == (record["current_steps"] in (1, 5))
    for record in (records[0], records[4]):
        assert 0 <= record["completions/clipped_ratio"] <= 1
        assert 1 <= record["completions/min_length"] <= record["completions/mean_length"] <= 6
        assert record["time/generation"] > 0
    first = records[0]
    assert first["reward"] == pytest.approx(first["rewards/token_sum_reward/mean"]
                                            + first["rewards/accuracy/mean"], abs=1e-5)
    # The second iteration over a batch is off-policy: some ratio moved away from 1 by then.
    assert any(r["kl"] > 0 for r in records[1:])

    lines = [json.loads(line) for line in (out / grpo_module.COMPLETIONS_FILE).read_text().splitlines()]
    # One record per completion, under the (1-based) step that first trained on it: rounds at steps 1 and 5.
    assert len(lines) == 16 and {line["step"] for line in lines} == {1, 5}
    assert set(lines[0]["rewards"]) == {"token_sum_reward", "accuracy"}
    assert lines[0]["prompt"].startswith("What is ")  # a TRL `prompt` string stays a string
    assert isinstance(lines[0]["completion"], str)

    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert any(name.endswith("lora_B.weight") and value.abs().max() > 0 for name, value in adapter.items())
    assert (out / "training_loss.png").is_file()


def test_reward_functions_get_prompts_in_trl_shapes_and_the_dataset_columns(tiny_model_dir, tmp_path):
    """A messages prompt reaches the reward function as messages, with the row's `answer` column."""
    seen = tmp_path / "seen.json"
    reward = tmp_path / "echo_reward.py"
    reward.write_text(
        "import json\n"
        f"def echo(prompts, completions, answer, **kwargs):\n"
        f"    json.dump({{'prompt': prompts[0], 'completion': completions[0], 'answer': answer}}, open({str(seen)!r}, 'w'))\n"
        "    return [0.0] * len(prompts)\n")
    data = tmp_path / "messages.json"
    data.write_text(json.dumps([{"prompt": [{"role": "user", "content": f"Say {i}"}], "answer": str(i)}
                                for i in range(2)]))
    config = _config(tiny_model_dir, tmp_path, tmp_path / "out", max_steps=1, reward_funcs=f"{reward}:echo")
    config.data.dataset = str(data)
    run_train(config)
    got = json.loads(seen.read_text())
    assert got["prompt"][0]["role"] == "user" and got["prompt"][0]["content"].startswith("Say ")
    assert got["completion"][0]["role"] == "assistant"
    # One generation batch = 1 prompt x 4 completions: its answer repeated for each completion.
    assert len(got["answer"]) == 4 and len(set(got["answer"])) == 1 and got["answer"][0] in ("0", "1")
    assert got["prompt"][0]["content"] == f"Say {got['answer'][0]}"


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_accumulation_alone_does_not_change_the_update(loss_type, tiny_model_dir, tmp_path, caplog):
    """per_device 8 x GA 1 and 4 x GA 2 generate the same 8 completions (same seed, one round) and must
    log the same loss and save the same adapter (SGD, so the update is the gradient itself); so on a CPU the 4 x 2
    run is told of the 8 x 1 one with its generation batch (`StageTrainer._suggest_one_batch`)."""
    outs, hints = [], []
    for batch, accumulation in ((8, 1), (4, 2)):
        out = tmp_path / f"b{batch}"
        caplog.clear()
        with caplog.at_level("INFO", logger="alignkit.stages.base"):
            run_train(_config(tiny_model_dir, tmp_path, out, per_device_train_batch_size=batch,
                              gradient_accumulation_steps=accumulation, max_steps=2, optim="sgd", loss_type=loss_type,
                              beta=0.02))
        hints.append([r.getMessage() for r in caplog.records if "gradient_accumulation_steps=1" in r.getMessage()])
        outs.append(out)
    assert hints[0] == [] and len(hints[1]) == 1
    assert "per_device_train_batch_size=8 with gradient_accumulation_steps=1 and generation_batch_size=8" in hints[1][0]
    first, second = (_losses(o) for o in outs)
    assert first.keys() == second.keys() == {1, 2}
    for step in first:
        assert first[step] == pytest.approx(second[step], abs=1e-5)
    a, b = (load_file(str(o / "adapter_model.safetensors")) for o in outs)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("keys", [{"loss_type": "bnpo"}, {"top_entropy_quantile": 0.5}, {"entropy_coef": 0.01}])
def test_no_one_batch_hint_where_the_split_changes_the_loss(keys, tiny_model_dir, tmp_path, caplog):
    """bnpo normalises each micro-batch, the entropy quantile and bonus take statistics of it: 8 x 1 would train
    otherwise than 4 x 2, so nothing is said."""
    from alignkit.stages.grpo import GRPOTrainer

    config = _config(tiny_model_dir, tmp_path, tmp_path / "out", gradient_accumulation_steps=2, **keys)
    trainer = object.__new__(GRPOTrainer)
    trainer.grpo_args = config.method
    trainer._entropy_bonus_enabled = config.method.entropy_coef != 0.0 or config.method.use_adaptive_entropy
    assert not trainer._accumulation_is_one_batch()
    trainer.grpo_args = _config(tiny_model_dir, tmp_path, tmp_path / "out").method
    trainer._entropy_bonus_enabled = False
    assert trainer._accumulation_is_one_batch()


def _rounds(out: Path) -> dict[int, list]:
    """Completion records by round (a round's records carry the step that first trained on it)."""
    by_round: dict[int, list] = {}
    for line in (out / grpo_module.COMPLETIONS_FILE).read_text().splitlines():
        record = json.loads(line)
        by_round.setdefault(record["step"], []).append((record["completion"], record["rewards"],
                                                         record["advantage"]))
    return by_round


@pytest.mark.fault  # issue 31 item 4: a resume inside a generation round, bit-exact
@pytest.mark.parametrize("checkpoint_step", [3, 4])
def test_resume_mid_generation_batch_equals_the_straight_run(checkpoint_step, tiny_model_dir, tmp_path,
                                                            crash_before_step):
    """steps_per_generation 2, GA 1: checkpoint-3 falls inside generation round 1 (its second slice is still
    to train), checkpoint-4 on a round boundary. 4 prompts = 2 rounds = 4 steps per epoch, so the resumed run
    also crosses into epoch 2. Losses, completions, rewards and the final adapter after the checkpoint equal the
    straight run's bit for bit (the resumed run once trained step 4 through another LoRA forward than the
    straight run, whose first generation round had dropped the fused one: 1.5e-8 apart)."""
    overrides = dict(steps_per_generation=2, max_steps=7, save_strategy="steps", save_steps=checkpoint_step,
                     log_completions=True, beta=0.05, num_iterations=1)
    straight = tmp_path / "straight"
    run_train(_config(tiny_model_dir, tmp_path, straight, **overrides))
    resumed = tmp_path / "resumed"
    config = _config(tiny_model_dir, tmp_path, resumed, **overrides)
    with pytest.raises(Exception, match="killed before step"):
        run_train(config, callbacks=[crash_before_step(checkpoint_step + 1)])
    run_train(_config(tiny_model_dir, tmp_path, resumed, **overrides))

    want, got = _losses(straight), _losses(resumed)
    assert set(got) == set(want) == set(range(1, 8))
    for step in range(checkpoint_step + 1, 8):
        assert got[step] == want[step], step
    straight_rounds, resumed_rounds = _rounds(straight), _rounds(resumed)
    assert sorted(resumed_rounds) == sorted(straight_rounds)  # no round generated twice, none skipped
    for round_index, rows in straight_rounds.items():
        assert len(resumed_rounds[round_index]) == len(rows)
        for (text_a, rewards_a, adv_a), (text_b, rewards_b, adv_b) in zip(rows, resumed_rounds[round_index]):
            assert (text_a, rewards_a, adv_a) == (text_b, rewards_b, adv_b)
    a, b = (load_file(str(o / "adapter_model.safetensors")) for o in (straight, resumed))
    assert [name for name in a if not torch.equal(a[name], b[name])] == []
    if checkpoint_step == 3:
        assert (resumed / "checkpoint-3" / grpo_module.ROLLOUT_BUFFER_FILE).is_file()


def test_vllm_colocate_path_with_a_stand_in_engine(tiny_model_dir, tmp_path, monkeypatch):
    """No GPU here, so vLLM itself cannot run: a stand-in `vllm` module with the documented API records what
    the trainer asks of it. The engine is built once from the base model's folder, gets the merged weights
    before each round that follows an update, and samples each row with its own seed."""
    import sys
    from types import SimpleNamespace

    engines = []

    class FakeLLM:
        def __init__(self, model, **kwargs):
            self.model, self.kwargs, self.loads, self.seeds = model, kwargs, [], []
            runner = SimpleNamespace(model=SimpleNamespace(load_weights=lambda weights: self.loads.append(dict(weights))))
            self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
                model_runner=runner)))
            engines.append(self)

        def reset_prefix_cache(self):
            pass

        def generate(self, prompts, sampling_params, use_tqdm=False):
            assert len(prompts) == len(sampling_params) and "prompt_token_ids" in prompts[0]
            self.seeds.append([p.seed for p in sampling_params])
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[10 + p.seed % 40, 11 + p.seed % 7, 2, 5])])
                    for p in sampling_params]

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=FakeLLM, SamplingParams=SimpleNamespace))
    config = _config(tiny_model_dir, tmp_path, tmp_path / "out", max_steps=2)
    config.method.use_vllm = True  # set after parsing: the config check would (rightly) ask for a GPU
    run_train(config)

    (engine,) = engines
    assert engine.model == tiny_model_dir and engine.kwargs["gpu_memory_utilization"] == 0.3
    assert len(engine.loads) == 2 and len(engine.seeds) == 2  # one sync per round, each after a new step
    assert "model.layers.0.self_attn.q_proj.weight" in engine.loads[0]
    assert not any("lora_" in name for name in engine.loads[0])
    assert all(len(set(seeds)) == len(seeds) == 4 for seeds in engine.seeds)  # a seed per completion
    records = [r for r in read_log(tmp_path / "out") if "loss" in r]
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)
    assert records[0]["completions/max_length"] == 3  # cut after the stop token (id 2)


def test_zero3_full_finetuning_reference_is_a_second_load_gathered_per_pass(tiny_model_dir, tmp_path, zero3_loading):
    """GRPO with beta != 0 and a full fine-tuning policy under (stand-in) ZeRO-3: the reference is the policy's source
    loaded again, partitioned, and gathered once per generation batch's reference pass; the run equals the plain one.
    The policy is given back whole when the Trainer is built (its DeepSpeed engine is not stood in for)."""
    keys = {"finetuning_type": "full", "beta": 0.1, "learning_rate": 1e-3, "max_steps": 2}
    plain, zero3 = tmp_path / "plain", tmp_path / "zero3"
    run_train(_config(tiny_model_dir, tmp_path, plain, **keys))
    loaded = zero3_loading(policy_whole=True)
    run_train(_config(tiny_model_dir, tmp_path, zero3, **keys))
    assert len(loaded) == 2  # the policy (given to the stand-in engine whole), then its reference, partitioned
    reference = next(loaded[1].parameters()).ds_owner
    # steps_per_generation defaults to gradient_accumulation_steps (1): one generation batch, one reference pass, a step
    assert reference.gathers == 2 and reference.is_partitioned()
    logged = [{r["current_steps"]: (r["loss"], r["kl"]) for r in read_log(out) if "loss" in r} for out in (plain, zero3)]
    assert sorted(logged[0]) == sorted(logged[1]) == [1, 2]
    for step, (loss, kl) in logged[0].items():
        assert logged[1][step] == pytest.approx((loss, kl), abs=1e-5)
    assert any(kl != 0 for _, kl in logged[0].values())  # the reference pass mattered


def test_data_seed_orders_the_prompts_and_transformers_samplers_are_refused(tiny_model_dir, tmp_path):
    """`data_seed` seeds the prompts' order (else `seed`), as transformers' samplers and PPO take it; a
    `train_sampling_strategy` other than `random` is refused, naming `shuffle_dataset` (GRPO's own sampler never
    read it)."""
    from alignkit.stages.grpo import GRPOTrainer, build_online_trainer

    seeds = {}
    for data_seed in (None, 7):
        keys = {} if data_seed is None else {"data_seed": data_seed}
        config = _config(tiny_model_dir, tmp_path, tmp_path / "o", seed=3, **keys)
        trainer = build_online_trainer(GRPOTrainer, config, [])
        sampler = trainer._get_train_sampler()
        seeds[data_seed] = (sampler.seed, list(sampler))
    assert seeds[None][0] == 3 and seeds[7][0] == 7 and seeds[None][1] != seeds[7][1]
    for stage in ("grpo", "rloo"):
        with pytest.raises(ConfigError, match="train_sampling_strategy=sequential: .*shuffle_dataset: false takes"):
            _config(tiny_model_dir, tmp_path, tmp_path / "o", stage=stage, train_sampling_strategy="sequential")
        with pytest.raises(ConfigError, match="train_sampling_strategy=group_by_length: .*remove it"):
            _config(tiny_model_dir, tmp_path, tmp_path / "o", stage=stage, group_by_length=True)
