"""`adapter_name_or_path` under DeepSpeed ZeRO-3: the merged base is built once into a cache folder (with ZeRO-3
switched off) and loaded from there, partitioned; never merged into partitioned weights. ZeRO-3 is the stand-in of
tests/conftest.py (`zero3_loading`): transformers' own switch is on, and `zero.Init` is stood in for at load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from alignkit.config import FinetuningArguments
from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.model import loader
from alignkit.model.distributed import full_weights, sharding_of, zero3_enabled, zero3_switched_off
from alignkit.model.loader import (MERGED_BASE_FILE, count_parameters, ensure_merged_base, load_model, merged_adapters,
                                   merged_base_dir, resolve_adapter_chain, split_adapters)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh ALIGNKIT_HOME (the merged bases go under it)."""
    monkeypatch.setenv("ALIGNKIT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def sft_chain(tiny_model_dir, tmp_path, save_perturbed_adapter):
    """Two LoRA adapters, the second trained over the first (recorded in its base_adapters.json)."""
    first, second = tmp_path / "sft", tmp_path / "dpo"
    save_perturbed_adapter(tiny_model_dir, first, seed=3)
    save_perturbed_adapter(tiny_model_dir, second, seed=4, over=first)
    return first, second


@pytest.fixture
def merges(monkeypatch):
    """Every `merge_adapters` call from then on: (adapters, whether the model's weights were partitioned)."""
    calls: list[tuple[list[str], str]] = []
    real = loader.merge_adapters

    def recording(model, adapter_dirs, **kwargs):
        calls.append((list(adapter_dirs), sharding_of(model)))
        return real(model, adapter_dirs, **kwargs)

    monkeypatch.setattr(loader, "merge_adapters", recording)
    return calls


def _model_args(tiny_model_dir, adapters):
    return parse_config({"model_name_or_path": str(tiny_model_dir), "adapter_name_or_path": str(adapters)}).model


def _assert_same_weights(expected: dict, model, atol: float = 1e-6) -> None:
    got = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=atol, msg=name)


def test_the_cached_merged_base_equals_the_in_memory_merge(tiny_model_dir, sft_chain, home, merges):
    model_args = _model_args(tiny_model_dir, sft_chain[1])  # the chain comes from the record
    in_memory = load_model(model_args, FinetuningArguments(), is_trainable=False)
    expected = {name: p.detach().clone() for name, p in in_memory.named_parameters()}
    chain = resolve_adapter_chain(split_adapters(model_args.adapter_name_or_path))
    assert len(chain) == 2

    folder = ensure_merged_base(model_args, chain)
    assert folder == merged_base_dir(model_args, chain) and folder.parent == home / "merged"
    cached = AutoModelForCausalLM.from_pretrained(folder)
    _assert_same_weights(expected, cached)
    record = json.loads((folder / MERGED_BASE_FILE).read_text())
    assert record["adapters"] == chain and record["base"] == tiny_model_dir and record["head"] == "causal_lm"
    assert (folder / "tokenizer_config.json").is_file()
    assert [partitioned for _, partitioned in merges] == ["none", "none"]

    # A second load reuses it; a retrained adapter (other weights, same folder) gets a new one, never the stale one.
    merges.clear()
    assert ensure_merged_base(model_args, chain) == folder and merges == []
    weights_file = sft_chain[1] / "adapter_model.safetensors"
    weights = load_file(weights_file)
    save_file({k: v + 0.25 if "lora_B" in k else v for k, v in weights.items()}, weights_file)
    rebuilt = ensure_merged_base(model_args, chain)
    assert rebuilt != folder and merges and merges[0][0] == chain
    changed = AutoModelForCausalLM.from_pretrained(rebuilt)
    assert any(not torch.allclose(p, expected[n]) for n, p in changed.named_parameters())


def test_without_zero3_nothing_is_cached(tiny_model_dir, sft_chain, home, merges):
    model = load_model(_model_args(tiny_model_dir, sft_chain[0]), FinetuningArguments(), is_trainable=False)
    assert not (home / "merged").exists()
    assert merges == [([str(Path(sft_chain[0]).resolve())], "none")] and merged_adapters(model)


def test_a_load_under_zero3_goes_through_the_cache(tiny_model_dir, sft_chain, home, merges, zero3_loading):
    """Under (stand-in) ZeRO-3 the merge runs once on whole weights with ZeRO-3 switched off, and the run's model is
    that folder, partitioned as it loads, recording the same chain and base as an in-memory merge."""
    model_args = _model_args(tiny_model_dir, sft_chain[1])
    in_memory = load_model(model_args, FinetuningArguments(), is_trainable=False)
    expected = {name: p.detach().clone() for name, p in in_memory.named_parameters()}

    loaded = zero3_loading()
    assert zero3_enabled()
    model = load_model(model_args, FinetuningArguments(), is_trainable=False)
    assert zero3_enabled()  # switched back on after the merge
    # The in-memory load above and the cache build: each one merge of the same chain, on whole weights.
    assert len(merges) == 2 and merges[1] == merges[0] and merges[0][1] == "none"
    assert loaded == [model] and sharding_of(model) == "zero3"
    assert all(p.numel() == 0 for p in model.parameters())  # partitioned: nothing to read outside a gather
    assert count_parameters(model) == count_parameters(in_memory)  # counted whole (`ds_numel`)
    assert merged_adapters(model) == merged_adapters(in_memory)
    assert model.name_or_path == model.config.name_or_path == tiny_model_dir  # the real base, not the cache folder
    with full_weights(model):
        _assert_same_weights(expected, model)

    # Every later load (the reference's, another stage's) reuses the folder.
    load_model(model_args, FinetuningArguments(), is_trainable=False)
    assert len(merges) == 2 and len(list((home / "merged").iterdir())) == 2  # the folder and its lock file

    # A LoRA adapter trained on it records the real base (its base_adapters.json the chain), as without ZeRO-3.
    config = parse_config({"model_name_or_path": tiny_model_dir, "adapter_name_or_path": str(sft_chain[1]),
                           "lora_rank": 4})
    policy = load_model(config.model, config.finetuning, is_trainable=True)
    assert policy.peft_config["default"].base_model_name_or_path == tiny_model_dir


def test_a_reward_chain_is_cached_with_its_score_head(tiny_model_dir, reward_adapter_dir, home, zero3_loading):
    model_args = _model_args(tiny_model_dir, reward_adapter_dir)
    in_memory = load_model(model_args, FinetuningArguments(), is_trainable=False, head="reward")
    expected = {name: p.detach().clone() for name, p in in_memory.named_parameters()}
    zero3_loading()
    model = load_model(model_args, FinetuningArguments(), is_trainable=False, head="reward")
    folder = next(p for p in (home / "merged").iterdir() if p.is_dir())
    assert json.loads((folder / MERGED_BASE_FILE).read_text())["head"] == "reward"
    with full_weights(model):
        _assert_same_weights(expected, model)


def test_zero3_switched_off_restores_the_switch(zero3_loading):
    assert not zero3_enabled()
    with zero3_switched_off():  # nothing to switch off: stays off
        assert not zero3_enabled()
    assert not zero3_enabled()
    zero3_loading()
    with pytest.raises(KeyError), zero3_switched_off():
        assert not zero3_enabled()
        raise KeyError("fails inside")
    assert zero3_enabled()


_RACE = """
import sys, time
from pathlib import Path
from alignkit.config import FinetuningArguments
from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.model import loader

start, log = Path(sys.argv[1]), Path(sys.argv[2])
real = loader.merge_adapters

def merging(model, adapter_dirs, **kwargs):
    with open(log, "a") as f:
        f.write("merged\\n")
    time.sleep(1.0)  # a slow merge: the other process must wait, not merge too
    return real(model, adapter_dirs, **kwargs)

loader.merge_adapters = merging
model_args = parse_config({"model_name_or_path": sys.argv[3], "adapter_name_or_path": sys.argv[4]}).model
chain = loader.resolve_adapter_chain(loader.split_adapters(model_args.adapter_name_or_path))
while not start.exists():
    time.sleep(0.01)
print(loader.ensure_merged_base(model_args, chain))
"""


@pytest.mark.distributed  # two real processes: out of the fast tier (scripts/test.sh --fast)
def test_two_processes_build_the_merged_base_once(tiny_model_dir, sft_chain, home, tmp_path):
    start, log = tmp_path / "start", tmp_path / "merges.log"
    env = {**os.environ, "ALIGNKIT_HOME": str(home), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    runs = [subprocess.Popen([sys.executable, "-c", _RACE, str(start), str(log), tiny_model_dir, str(sft_chain[1])],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    start.touch()
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outputs]
    folders = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(folders) == 1 and log.read_text() == "merged\n"
    folder = Path(folders.pop())
    assert sorted(p.name for p in folder.parent.iterdir()) == sorted([folder.name, folder.name + ".lock"])


_RANK_RACE = """
import sys, time
from pathlib import Path
import torch.distributed as dist
from alignkit.config.parse import parse_config
from alignkit.model import loader

rank, store, log = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
real = loader.merge_adapters

def merging(model, adapter_dirs, **kwargs):
    with open(log, "a") as f:
        f.write(f"merged on rank {rank}\\n")
    return real(model, adapter_dirs, **kwargs)

loader.merge_adapters = merging
model_args = parse_config({"model_name_or_path": sys.argv[4], "adapter_name_or_path": sys.argv[5]}).model
chain = loader.resolve_adapter_chain(loader.split_adapters(model_args.adapter_name_or_path))
if rank == 0:
    time.sleep(3.0)  # rank 1 reaches the folder's lock first
print(loader.ensure_merged_base(model_args, chain))
dist.destroy_process_group()
"""


@pytest.mark.distributed  # two real processes: out of the fast tier (scripts/test.sh --fast)
def test_in_a_process_group_rank_zero_builds_the_merged_base_while_the_others_wait(tiny_model_dir, sft_chain, home,
                                                                                 tmp_path):
    """transformers' `save_pretrained` writes the model on rank 0 of a process group only: a rank 1 that reached the
    lock first used to build a folder of tokenizer files, mark it complete, and fail this run and every later one
    reading it ("holds no config.json"). Rank 1 comes first here; rank 0 must build, rank 1 read the same folder."""
    store, log = tmp_path / "store", tmp_path / "merges.log"
    env = {**os.environ, "ALIGNKIT_HOME": str(home), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    runs = [subprocess.Popen([sys.executable, "-c", _RANK_RACE, str(rank), str(store), str(log), tiny_model_dir,
                              str(sft_chain[1])], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in (0, 1)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outputs]
    assert log.read_text() == "merged on rank 0\n"
    folders = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(folders) == 1
    folder = Path(folders.pop())
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def test_a_folder_whose_build_writes_no_model_is_never_marked_complete(tmp_path):
    from alignkit.model.bundled import build_folder_once, is_complete

    target = tmp_path / "merged"
    with pytest.raises(RuntimeError, match="wrote no config.json"):
        build_folder_once(target, lambda folder: (folder / "tokenizer.json").write_text("{}") and {})
    assert not target.exists() and not is_complete(target)
    assert [p.name for p in tmp_path.iterdir()] == ["merged.lock"]


def test_a_rank_waiting_for_rank_zero_gives_up_with_the_fix(tmp_path):
    from alignkit.model.bundled import _wait_for_rank_zero

    with pytest.raises(ConfigError, match=r"rank 1 waited 0 s for rank 0.*ALIGNKIT_HOME at a folder they all share"):
        _wait_for_rank_zero(tmp_path / "never", 1, timeout=0.3)


def test_a_reference_reloads_only_what_load_model_built(tiny_model_dir):
    with pytest.raises(ValueError, match="was not loaded by alignkit.model.loader.load_model.*ref_model"):
        loader.load_frozen_copy(AutoModelForCausalLM.from_pretrained(tiny_model_dir))


def test_nested_full_weights_blocks_gather_once(tiny_model_dir, zero3_loading, zero3_partitions):
    """A reference pass inside the DPO precomputation's block over the same model: DeepSpeed's `GatheredParameters`
    partitions on every exit, so the inner block must not open a second one."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    zero3_loading()  # its stand-in `GatheredParameters`
    partitions = zero3_partitions(model, hooks=False)
    ids = torch.tensor([[5, 6, 7]])
    with full_weights(model):
        with full_weights(model):
            model(input_ids=ids)
        model(input_ids=ids)  # still whole after the inner block
    assert partitions.gathers == 1 and partitions.is_partitioned()
    with pytest.raises((RuntimeError, IndexError, AssertionError)):  # torch's check of the (empty) embedding
        model(input_ids=ids)  # outside any gather: an empty weight


def test_an_unwritable_home_names_the_folder_and_the_fix(tiny_model_dir, sft_chain, tmp_path, monkeypatch):
    home = tmp_path / "a_file"
    home.write_text("not a folder")
    monkeypatch.setenv("ALIGNKIT_HOME", str(home))
    model_args = _model_args(tiny_model_dir, sft_chain[0])
    with pytest.raises(ConfigError, match=r"cannot write the merged base into .*a_file/merged.*Set ALIGNKIT_HOME"):
        ensure_merged_base(model_args, resolve_adapter_chain([str(sft_chain[0])]))
