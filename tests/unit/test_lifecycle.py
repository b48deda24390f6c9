"""Run lifecycle pieces without training: the output_dir lock, checkpoint checks, finished runs, log cut."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from alignkit.callbacks import DivergenceGuard, read_log, truncate_log
from alignkit.errors import TrainingDiverged
from alignkit.errors import ConfigError
from alignkit.lifecycle import (
    LOCK_FILE,
    OutputDirLock,
    checkpoint_problem,
    complete_from_checkpoint,
    json_safe,
    reached_end,
    set_aside,
    usable_checkpoint,
)


def make_checkpoint(out: Path, step: int, value: float = 1.0) -> Path:
    """A checkpoint folder with every file a LoRA run's checkpoint holds, small and sound."""
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": 8, "epoch": 0.4}))
    (folder / "adapter_config.json").write_text("{}")
    save_file({"lora_A": torch.full((2, 3), value), "lora_B": torch.zeros(3, 2)}, str(folder / "adapter_model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.ones(3), "step": torch.tensor(2.0)}}, "param_groups": [{"lr": 1e-3}]},
               folder / "optimizer.pt")
    torch.save({"last_epoch": step}, folder / "scheduler.pt")
    torch.save({"cpu": torch.random.get_rng_state()}, folder / "rng_state.pth")
    return folder


def _truncate(path: Path, keep: int = 40) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _nan_adapter(folder: Path) -> None:
    save_file({"lora_A": torch.full((2, 3), float("nan")), "lora_B": torch.zeros(3, 2)},
              str(folder / "adapter_model.safetensors"))


def _nan_optimizer(folder: Path) -> None:
    torch.save({"state": {0: {"exp_avg": torch.tensor([1.0, float("inf")])}}, "param_groups": []}, folder / "optimizer.pt")


CORRUPTIONS = {
    "empty state": (lambda f: (f / "trainer_state.json").write_text(""), "trainer_state.json empty"),
    "truncated state": (lambda f: _truncate(f / "trainer_state.json", 10), "trainer_state.json empty or does not parse"),
    "state of another step": (lambda f: (f / "trainer_state.json").write_text('{"global_step": 3}'), "global_step=3"),
    "missing state": (lambda f: (f / "trainer_state.json").unlink(), "trainer_state.json missing"),
    "truncated adapter": (lambda f: _truncate(f / "adapter_model.safetensors"), "adapter_model.safetensors does not load"),
    "missing adapter": (lambda f: (f / "adapter_model.safetensors").unlink(), "adapter_config.json without"),
    "NaN adapter": (_nan_adapter, "tensor lora_A is not finite"),
    "truncated optimizer": (lambda f: _truncate(f / "optimizer.pt"), "optimizer.pt does not load"),
    "missing scheduler": (lambda f: (f / "scheduler.pt").unlink(), "scheduler.pt missing"),
    "inf in optimizer": (_nan_optimizer, "exp_avg"),
    "truncated rng state": (lambda f: _truncate(f / "rng_state.pth"), "rng_state.pth does not load"),
}


def test_sound_checkpoint_passes(tmp_path):
    assert checkpoint_problem(make_checkpoint(tmp_path, 2)) is None


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_each_corruption_is_named_and_the_previous_checkpoint_is_used(tmp_path, name, caplog):
    corrupt, expected = CORRUPTIONS[name]
    make_checkpoint(tmp_path, 2)
    newest = make_checkpoint(tmp_path, 4)
    corrupt(newest)
    assert expected in checkpoint_problem(newest)
    assert Path(usable_checkpoint(tmp_path)).name == "checkpoint-2"
    # The broken one is kept for inspection under a name the Trainer's checkpoint glob does not match.
    assert not newest.exists() and (tmp_path / "invalid-checkpoint-4").is_dir()
    assert "checkpoint-4 is unusable" in caplog.text


def test_processes_setting_the_same_broken_checkpoint_aside_do_not_collide(tmp_path):
    """Each process of a torchrun job checks the checkpoints; the one that comes second finds the broken one
    already moved (before this, its rename raised FileNotFoundError and stopped the run)."""
    make_checkpoint(tmp_path, 2)
    broken = make_checkpoint(tmp_path, 4)
    _truncate(broken / "optimizer.pt")
    (tmp_path / "invalid-checkpoint-4").mkdir()  # left by an earlier run: replaced
    assert Path(usable_checkpoint(tmp_path)).name == "checkpoint-2"
    assert set_aside(broken, "optimizer.pt does not load") == tmp_path / "invalid-checkpoint-4"  # the second process
    assert (tmp_path / "invalid-checkpoint-4" / "optimizer.pt").is_file()


def test_no_usable_checkpoint_means_a_fresh_start(tmp_path):
    _truncate(make_checkpoint(tmp_path, 2) / "optimizer.pt")
    assert usable_checkpoint(tmp_path) is None
    assert usable_checkpoint(tmp_path / "missing") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["invalid-checkpoint-2"]


def test_save_only_model_checkpoints_need_no_optimizer(tmp_path):
    folder = make_checkpoint(tmp_path, 2)
    (folder / "optimizer.pt").unlink()
    (folder / "scheduler.pt").unlink()
    assert checkpoint_problem(folder, need_optimizer=False) is None
    assert checkpoint_problem(folder) == "optimizer.pt missing"


def _as_fsdp_full_state(folder: Path) -> None:
    """What accelerate's FSDP checkpointing (FULL_STATE_DICT) writes instead of the Trainer's optimizer.pt."""
    (folder / "optimizer.pt").rename(folder / "optimizer.bin")
    torch.save({"lora_A": torch.ones(2, 3)}, folder / "pytorch_model_fsdp.bin")


def _as_fsdp_sharded_state(folder: Path, complete: bool = True) -> None:
    """SHARDED_STATE_DICT: a torch.distributed.checkpoint folder, whose `.metadata` is written last."""
    (folder / "optimizer.pt").unlink()
    (folder / "optimizer_0").mkdir()
    (folder / "optimizer_0" / "__0_0.distcp").write_bytes(b"shard")
    if complete:
        (folder / "optimizer_0" / ".metadata").write_bytes(b"meta")


def test_fsdp_checkpoints_are_resumable_and_checked(tmp_path):
    full = make_checkpoint(tmp_path / "full", 2)
    _as_fsdp_full_state(full)
    assert checkpoint_problem(full) is None
    _nan_optimizer(full)
    (full / "optimizer.pt").rename(full / "optimizer.bin")
    assert "optimizer.bin" in checkpoint_problem(full) and "exp_avg" in checkpoint_problem(full)
    sharded = make_checkpoint(tmp_path / "sharded", 2)
    _as_fsdp_sharded_state(sharded)
    assert checkpoint_problem(sharded) is None
    cut = make_checkpoint(tmp_path / "cut", 2)
    _as_fsdp_sharded_state(cut, complete=False)
    assert checkpoint_problem(cut) == "optimizer_0/.metadata missing (the sharded save was interrupted)"


def test_complete_from_an_fsdp_checkpoint_copies_no_training_state(tmp_path):
    folder = make_checkpoint(tmp_path, 8)
    _as_fsdp_full_state(folder)
    complete_from_checkpoint(folder, tmp_path)
    assert (tmp_path / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "optimizer.bin").exists() and not (tmp_path / "pytorch_model_fsdp.bin").exists()


def test_reached_end_by_steps_and_by_epochs():
    state = {"global_step": 8, "max_steps": 8, "epoch": 1.0}
    assert reached_end(state, max_steps=8, num_train_epochs=3.0)
    assert not reached_end(state, max_steps=9, num_train_epochs=3.0)  # raised max_steps: continue
    assert reached_end(state, max_steps=-1, num_train_epochs=1.0)
    assert not reached_end(state, max_steps=-1, num_train_epochs=2.0)  # more epochs asked for
    assert not reached_end({"global_step": 6, "max_steps": 8, "epoch": 0.75}, max_steps=-1, num_train_epochs=1.0)


def test_complete_from_checkpoint_copies_the_model_not_the_training_state(tmp_path):
    folder = make_checkpoint(tmp_path, 8)
    complete_from_checkpoint(folder, tmp_path)
    assert (tmp_path / "adapter_model.safetensors").read_bytes() == (folder / "adapter_model.safetensors").read_bytes()
    assert json.loads((tmp_path / "trainer_state.json").read_text())["global_step"] == 8
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert not (tmp_path / name).exists()


def test_truncate_log_keeps_each_step_up_to_the_resumed_one(tmp_path):
    lines = [{"current_steps": s, "loss": 1.0} for s in (1, 2, 3, 4)] + [{"current_steps": 4, "eval_loss": 2.0}]
    lines += [{"current_steps": 5, "loss": 1.0}, {"current_steps": 6, "eval_loss": 1.0}]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"current_steps": 7, "lo'  # cut short by a kill
    (tmp_path / "trainer_log.jsonl").write_text(text)
    truncate_log(tmp_path, 4)
    assert [(r["current_steps"], "loss" in r) for r in read_log(tmp_path)] == [
        (1, True), (2, True), (3, True), (4, True), (4, False)]
    truncate_log(tmp_path, 0)
    assert not (tmp_path / "trainer_log.jsonl").exists()


def test_json_safe_replaces_non_finite_floats():
    assert json_safe({"eval_loss": math.nan, "x": math.inf, "epoch": 1.0, "n": 3}) == {
        "eval_loss": None, "x": None, "epoch": 1.0, "n": 3}


def test_second_lock_is_refused_naming_the_holder_and_released_on_exit(tmp_path):
    with OutputDirLock(tmp_path):
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()} on host "):
            with OutputDirLock(tmp_path):
                pass
    assert not (tmp_path / LOCK_FILE).exists()  # a finished run leaves no trace
    with OutputDirLock(tmp_path):  # and the next run gets it
        pass


def test_lock_of_a_killed_process_is_taken_over(tmp_path, caplog):
    # A child takes the lock and is killed with it held, leaving its lock file behind.
    code = ("import sys, os, signal; from alignkit.lifecycle import OutputDirLock; "
            "lock = OutputDirLock(sys.argv[1]).__enter__(); os.kill(os.getpid(), signal.SIGKILL)")
    child = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    assert child.returncode == -9
    left = json.loads((tmp_path / LOCK_FILE).read_text())
    with OutputDirLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"left by a run that is gone (pid {left['pid']}" in caplog.text


class _Param(torch.nn.Module):
    def __init__(self, weight, grad):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(weight))
        self.weight.grad = torch.tensor(grad)


class _State:
    global_step = 2
    log_history: list = []


class _Args:
    output_dir = "/nonexistent"
    learning_rate = 1e30
    max_grad_norm = 1.0
    fp16 = False


class _Fp16Args(_Args):
    fp16 = True


def test_guard_stops_on_a_non_finite_gradient_norm_naming_the_step():
    guard = DivergenceGuard()
    guard.on_pre_optimizer_step(_Args, _State, None, model=_Param([1.0, 2.0], [3.0, 4.0]))  # norm 5: fine
    with pytest.raises(TrainingDiverged, match=r"diverged at step 3: the gradient norm is nan.*learning_rate \(now 1e\+30\)"):
        guard.on_pre_optimizer_step(_Args, _State, None, model=_Param([1.0, 2.0], [float("nan"), 4.0]))
    # fp16 loss scaling: an overflowing step is skipped by the GradScaler, not a divergence
    guard.on_pre_optimizer_step(_Fp16Args, _State, None, model=_Param([1.0, 2.0], [float("inf"), 4.0]))
    with pytest.raises(TrainingDiverged, match="step 3: weight weight is not finite"):
        guard.on_optimizer_step(_Args, _State, None, model=_Param([float("inf"), 2.0], [0.0, 0.0]))


def test_guard_stops_on_a_logged_non_finite_loss_and_cleans_the_history():
    guard, state = DivergenceGuard(), _State()
    state.log_history = [{"eval_loss": float("nan"), "step": 2}]
    guard.on_log(_Args, state, None, logs={"eval_loss": float("nan")})
    assert state.log_history == [{"eval_loss": None, "step": 2}]
    with pytest.raises(TrainingDiverged, match="step 2: the training loss is inf"):
        guard.on_log(_Args, state, None, logs={"loss": float("inf")})


def _deepspeed_checkpoint(out: Path, step: int) -> Path:
    """A checkpoint as the Trainer saves it under DeepSpeed: the engine's state in `global_stepN/` (named by
    `latest`), no optimizer.pt."""
    folder = make_checkpoint(out, step)
    (folder / "optimizer.pt").unlink()
    engine = folder / f"global_step{step}"
    engine.mkdir()
    for rank in (0, 1):
        (engine / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"DeepSpeed's own pickle")
        (engine / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"DeepSpeed's own pickle")
    (folder / "latest").write_text(f"global_step{step}")
    return folder


DEEPSPEED_CORRUPTIONS = {
    "latest names no folder": (lambda f: (f / "latest").write_text("global_step9"), "names 'global_step9'"),
    "no optimizer files": (lambda f: [p.unlink() for p in f.glob("global_step*/*optim_states.pt")],
                           "holds no *optim_states.pt"),
    "empty optimizer file": (lambda f: next(f.glob("global_step*/*rank_1*optim_states.pt")).write_bytes(b""),
                             "zero_pp_rank_1_mp_rank_00_optim_states.pt is empty"),
}


def test_deepspeed_checkpoint_passes_without_optimizer_pt(tmp_path):
    assert checkpoint_problem(_deepspeed_checkpoint(tmp_path, 2)) is None


@pytest.mark.parametrize("name", list(DEEPSPEED_CORRUPTIONS))
def test_each_deepspeed_corruption_is_named(tmp_path, name):
    corrupt, expected = DEEPSPEED_CORRUPTIONS[name]
    folder = _deepspeed_checkpoint(tmp_path, 2)
    corrupt(folder)
    assert expected in checkpoint_problem(folder)
    assert checkpoint_problem(folder, need_optimizer=False) is None  # save_only_model: the engine state is not read
