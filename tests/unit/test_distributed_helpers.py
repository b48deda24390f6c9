"""The single-process logic of the distributed helpers: the torchrun re-launch command, the FSDP refusal on a CPU,
and `full_weights` under ZeRO-3 with DeepSpeed stubbed (DeepSpeed needs an accelerator; the FSDP2 path runs for
real in tests/distributed)."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from alignkit.config.parse import parse_config
from alignkit.env import launched_processes
from alignkit.errors import ConfigError
from alignkit.launch import asks_for_deepspeed, single_process_rendezvous, torchrun_command
from alignkit.model import distributed
from alignkit.model.distributed import full_weights, sharding_of

_ORIGINAL_GATHER = distributed._zero3_gathered

PY = "python"
RUN = [PY, "-m", "torch.distributed.run"]
TRAIN = ["-m", "alignkit", "train", "c.yaml", "max_steps=3"]


@pytest.mark.parametrize("nproc, env, expected", [
    (2, {}, RUN + ["--standalone", "--nproc_per_node", "2"] + TRAIN),
    (None, {}, None),  # no --nproc, no FORCE_TORCHRUN: this process trains
    (1, {}, None),
    (2, {"WORLD_SIZE": "2"}, None),  # already a launched worker: never launch again
    (None, {"LOCAL_RANK": "0", "FORCE_TORCHRUN": "1"}, None),
    (None, {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "3"}, RUN + ["--standalone", "--nproc_per_node", "3"] + TRAIN),
    (None, {"FORCE_TORCHRUN": "true"}, RUN + ["--standalone", "--nproc_per_node", "1"] + TRAIN),  # no GPU: 1
    (None, {"FORCE_TORCHRUN": "0", "NPROC_PER_NODE": "3"}, None),
    (None, {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29555"},
     RUN + ["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port", "29555",
            "--nproc_per_node", "2"] + TRAIN),
    (2, {"NNODES": "2"},  # LLaMA-Factory's defaults for the rest
     RUN + ["--nnodes", "2", "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", "29500",
            "--nproc_per_node", "2"] + TRAIN),
])
def test_torchrun_command(nproc, env, expected, monkeypatch):
    monkeypatch.setattr("alignkit.launch._device_count", lambda: 1)
    assert torchrun_command(["c.yaml", "max_steps=3"], nproc, env, python=PY) == expected


@pytest.mark.parametrize("nproc, env, message", [
    (0, {}, "--nproc 0"),
    (None, {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "two"}, "NPROC_PER_NODE='two' must be a whole number"),
    (2, {"NNODES": "0"}, "NNODES='0' must be at least 1"),
    (2, {"NNODES": "2", "NODE_RANK": "-1"}, "NODE_RANK='-1' must be >= 0"),
])
def test_torchrun_command_refuses_bad_numbers(nproc, env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        torchrun_command(["c.yaml"], nproc, env)


def test_a_deepspeed_run_alone_gets_the_variables_of_a_one_process_torchrun():
    variables = single_process_rendezvous({})
    assert {k: variables[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == \
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert 0 < int(variables["MASTER_PORT"]) < 65536
    assert single_process_rendezvous({"MASTER_PORT": "29511"})["MASTER_PORT"] == "29511"
    # Inside a launched worker the launcher's variables stand.
    assert single_process_rendezvous({"WORLD_SIZE": "2"}) == {} == single_process_rendezvous({"LOCAL_RANK": "0"})


def test_asks_for_deepspeed_reads_the_config_and_its_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stage: sft\ndeepspeed: ds.json\n")
    assert asks_for_deepspeed(str(path), [])
    assert not asks_for_deepspeed(str(path), ["deepspeed="])  # an override wins, also an empty one
    path.write_text("stage: sft\n")
    assert not asks_for_deepspeed(str(path), [])
    assert asks_for_deepspeed(str(path), ["max_steps=3", "deepspeed=examples/deepspeed/ds_z3_config.json"])


def test_launched_processes_reads_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launched_processes() == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launched_processes() == 4


@pytest.mark.parametrize("keys, env", [({"fsdp": "full_shard auto_wrap"}, {}), ({"fsdp": True}, {}),
                                       ({}, {"ACCELERATE_USE_FSDP": "true"})])
def test_fsdp_on_a_cpu_is_refused_instead_of_silently_running_ddp(keys, env, monkeypatch, tmp_path):
    monkeypatch.setattr("alignkit.config.parse._has_accelerator", lambda: False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="FSDP .* needs GPUs.*plain data parallel"):
        parse_config({"output_dir": str(tmp_path), **keys})



def test_fsdp_on_a_cpu_passes_where_accelerate_was_made_to_run_it(monkeypatch, tmp_path):
    """The distributed tests lift accelerate's device gate (tests/distributed/cpu_gates/sitecustomize.py) and
    mark it on AcceleratorState: then FSDP really runs on the CPU, and the config is not refused."""
    from accelerate.state import AcceleratorState

    monkeypatch.setattr("alignkit.config.parse._has_accelerator", lambda: False)
    monkeypatch.setattr(AcceleratorState, "fsdp_on_cpu", True, raising=False)
    config = parse_config({"output_dir": str(tmp_path), "fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2}})
    assert config.training.fsdp

@pytest.mark.parametrize("keys, env", [
    ({"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2, "activation_checkpointing": True}}, {}),
    ({"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_activation_checkpointing": True}}, {}),
    ({}, {"ACCELERATE_USE_FSDP": "true", "FSDP_ACTIVATION_CHECKPOINTING": "true"})])
def test_fsdp_activation_checkpointing_with_lora_is_refused(keys, env, monkeypatch, tmp_path):
    """torch's checkpoint wrapper renames the decoder layers, and peft's save then finds no adapter weights (an
    empty adapter file, seen in tests/distributed/test_distributed_fsdp.py before this check): refused before any
    model loads, pointing at gradient_checkpointing; full fine-tuning keeps it."""
    from accelerate.state import AcceleratorState

    monkeypatch.setattr("alignkit.config.parse._has_accelerator", lambda: False)
    monkeypatch.setattr(AcceleratorState, "fsdp_on_cpu", True, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    base = {"output_dir": str(tmp_path), "do_train": True, "dataset": "demo_sft", **keys}
    with pytest.raises(ConfigError,
                       match="activation checkpointing.*finetuning_type=lora.*gradient_checkpointing: true"):
        parse_config(base)
    assert parse_config({**base, "finetuning_type": "full"}).finetuning.finetuning_type == "full"
    assert parse_config({**base, "do_train": False, "do_eval": True, "val_size": 0.1})


# ---- full_weights under ZeRO-3, DeepSpeed stubbed ----

class _FakeZero:
    """`deepspeed.zero.GatheredParameters` as documented: a context manager over a parameter list; records its use."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, object]] = []
        self.active = False

    @contextlib.contextmanager
    def GatheredParameters(self, params, modifier_rank=None):  # noqa: N802 (DeepSpeed's name)
        self.calls.append((len(list(params)), modifier_rank))
        self.active = True
        try:
            yield
        finally:
            self.active = False


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """A stand-in `deepspeed` module (only `zero.GatheredParameters`), seen by alignkit's ZeRO-3 gather alone: in
    `sys.modules` accelerate would take it for an installed DeepSpeed."""
    zero = _FakeZero()
    module = types.SimpleNamespace(zero=zero)
    real_import = __import__

    def gathered(params):
        def importing(name, *args, **kwargs):
            return module if name == "deepspeed" else real_import(name, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("builtins.__import__", importing)
            return _ORIGINAL_GATHER(params)  # alignkit's own call, `import deepspeed` answered by the stand-in

    monkeypatch.setattr(distributed, "_zero3_gathered", gathered)
    return zero


def _mark_partitioned(model: torch.nn.Module) -> int:
    """Give every parameter the `ds_id` that `deepspeed.zero.Init` sets on a partitioned one; returns their count."""
    params = list(model.parameters())
    for i, param in enumerate(params):
        param.ds_id = i
    return len(params)


def test_full_weights_is_a_no_op_without_sharding(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # importing it would fail: it must not be imported
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert sharding_of(model) == "none"
    with full_weights(model) as inside:
        assert inside is model


def test_full_weights_gathers_zero3_parameters_once_around_a_whole_generation(tiny_model_dir, fake_deepspeed):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    count = _mark_partitioned(model)
    assert sharding_of(model) == "zero3"
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(fake_deepspeed.active))
    ids = torch.tensor([[5, 6, 7, 8]])
    with full_weights(model) as inside:
        out = inside.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 9
    assert len(forwards) == 5 and all(forwards)  # every forward of the generation ran inside the one gather
    assert fake_deepspeed.calls == [(count, None)]  # one gather of every partitioned weight, read-only
    assert not fake_deepspeed.active


@pytest.mark.parametrize("has_block", [True, False])
def test_full_weights_with_an_engine_uses_deepspeeds_generation_block(tiny_model_dir, monkeypatch, has_block):
    """Given the engine, the ZeRO-3 block is DeepSpeed's `unwrap_model_for_generation(engine)` (which also takes the
    engine's per-module hooks off); a DeepSpeed without it falls back to the plain gather."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    count = _mark_partitioned(model)
    engine, used = object(), []

    @contextlib.contextmanager
    def unwrap_model_for_generation(given):
        used.append(("generation block", given))
        yield given

    @contextlib.contextmanager
    def gathered_parameters(params, modifier_rank=None):
        used.append(("gather", len(list(params)), modifier_rank))
        yield

    zero = types.SimpleNamespace(GatheredParameters=gathered_parameters)
    real_import = __import__

    def importing(name, *args, **kwargs):
        if name == "deepspeed.runtime.zero":
            if not has_block:
                raise ImportError("cannot import name 'unwrap_model_for_generation'")
            return types.SimpleNamespace(unwrap_model_for_generation=unwrap_model_for_generation)
        return types.SimpleNamespace(zero=zero) if name == "deepspeed" else real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", importing)
    with full_weights(model, engine) as inside:
        assert inside is model
    monkeypatch.undo()
    assert used == ([("generation block", engine)] if has_block else [("gather", count, None)])


def test_partitioned_weights_are_read_only_through_their_modules(tiny_model_dir):
    """Under ZeRO-3 (weights marked partitioned) the fused log-probs and the fused LoRA layers step aside: both read
    a weight outside its module's forward, where DeepSpeed's hooks have not gathered it."""
    from alignkit.model.loader import load_model
    from alignkit.model.logprobs import _fusable_head
    from alignkit.model.lora_fused import _plain_adapter

    config = parse_config({"stage": "sft", "model_name_or_path": tiny_model_dir, "output_dir": "unused",
                           "lora_rank": 4, "lora_dropout": 0.0})
    model = load_model(config.model, config.finetuning, is_trainable=True)
    layer = next(m for m in model.modules() if hasattr(m, "lora_A") and len(m.lora_A))
    x = torch.zeros(1, layer.get_base_layer().in_features)
    assert _fusable_head(model) is not None and _plain_adapter(layer, x) is not None
    _mark_partitioned(model)
    assert _fusable_head(model) is None and _plain_adapter(layer, x) is None


def test_dpo_reference_precomputation_gathers_once_for_the_whole_pass(tiny_model_dir, tiny_tokenizer, fake_deepspeed,
                                                                      tmp_path):
    from datasets import Dataset

    from alignkit.data.collator import PairwiseCollator
    from alignkit.model.loader import load_model
    from alignkit.stages.dpo import DPOTrainer

    config = parse_config({"stage": "dpo", "model_name_or_path": tiny_model_dir, "output_dir": str(tmp_path / "out"),
                           "precompute_ref_log_probs": True, "per_device_eval_batch_size": 2, "lora_rank": 4,
                           "use_cpu": True})
    model = load_model(config.model, config.finetuning, is_trainable=True)
    _mark_partitioned(model)
    rows = []
    for i in range(5):  # 3 batches of the reference pass
        prompt = tiny_tokenizer(f"question {i}", add_special_tokens=False)["input_ids"]
        for side, reply in (("chosen", f" good {i}"), ("rejected", f" bad {i}")):
            ids = prompt + tiny_tokenizer(reply, add_special_tokens=False)["input_ids"]
            rows.append((side, ids, [-100] * len(prompt) + ids[len(prompt):]))
    columns: dict[str, list] = {}
    for side, ids, labels in rows:
        columns.setdefault(f"{side}_input_ids", []).append(ids)
        columns.setdefault(f"{side}_attention_mask", []).append([1] * len(ids))
        columns.setdefault(f"{side}_labels", []).append(labels)
    dataset = Dataset.from_dict(columns)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(fake_deepspeed.active))
    trainer = DPOTrainer(model=model, args=config.training, dpo_args=config.method,
                         data_collator=PairwiseCollator(tiny_tokenizer), train_dataset=dataset,
                         eval_dataset=dataset.select(range(3)))
    assert len(fake_deepspeed.calls) == 1  # train and eval sets: one gather for the whole precomputation
    assert len(forwards) == 3 + 2 and all(forwards)  # train: 5 pairs, eval: 3, by 2; all inside it
    assert "ref_chosen_logps" in trainer.train_dataset.column_names


def test_accelerate_unwraps_without_importing_deepspeed_until_a_run_has(monkeypatch):
    """With deepspeed installed, accelerate's `extract_model_from_parallel` imported it to test for a DeepSpeed
    engine; after `unwrap_without_importing_deepspeed` it asks only once deepspeed is imported (no object can be an
    engine before), and then answers as before."""
    from accelerate.utils import other

    distributed.unwrap_without_importing_deepspeed()
    distributed.unwrap_without_importing_deepspeed()  # idempotent: still one wrapper over the original check
    installed = other.is_deepspeed_available.__wrapped__
    assert not hasattr(installed, "__wrapped__")
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    assert other.is_deepspeed_available() is False
    model = torch.nn.Linear(2, 2)
    assert other.extract_model_from_parallel(model) is model
    assert "deepspeed" not in sys.modules
    calls = []
    monkeypatch.setattr(other.is_deepspeed_available, "__wrapped__", lambda: calls.append(1) or True)
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    assert other.is_deepspeed_available() is True and calls == [1]  # imported: accelerate's own check decides
