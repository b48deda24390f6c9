"""Fault injection: real `alignkit train` processes killed, raced and diverged, then run again.

Every run is a subprocess of `python -m alignkit` (the CLI's own entry point) on the tiny model, six
steps of batch 2 with a checkpoint every two. Kills are aimed from outside, by watching the output
folder the way an operator's `kill -9` would land: right after a checkpoint is complete, in the middle
of training, after the last step. A kill in the middle of writing a checkpoint leaves a folder with some
files missing or cut short; the test makes that state directly by cutting files of the newest one.
Each interrupted chain must end with adapter weights bit-equal to an uninterrupted run's and a
`trainer_log.jsonl` that has each step once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.fault

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
STAGES = {
    "sft": ["stage=sft", "dataset=demo_sft", "eval_dataset=demo_sft_eval", "do_eval=true", "eval_strategy=steps",
            "eval_steps=2", "per_device_eval_batch_size=4"],
    "rm": ["stage=rm", "dataset=demo_pref"],
    "dpo": ["stage=dpo", "dataset=demo_pref"],
}
# The online stages, each logging its completions; the reward file is written by `online_reward`.
ONLINE_STAGES = {
    "grpo": ["stage=grpo", "dataset=demo_math", "num_generations=2", "max_completion_length=8"],
    "ppo": ["stage=ppo", "dataset=demo_math", "max_new_tokens=8", "ppo_epochs=1"],
}
# A reward that varies between completions of a random model and depends on nothing but the token ids.
REWARD_SOURCE = ("def token_sum_reward(completions, completion_ids, **kwargs):\n"
                 "    return [float(sum(ids) % 5) for ids in completion_ids]\n")


@pytest.fixture(scope="module")
def cli(tiny_model_dir, tmp_path_factory):
    """`cli(out, stage, *overrides, wait=True)` runs `alignkit train` into `out` (a Popen if wait=False)."""
    home = tmp_path_factory.mktemp("fault_home")
    config = home / "empty.yaml"
    config.write_text("{}\n")
    reward_file = home / "token_reward.py"
    reward_file.write_text(REWARD_SOURCE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               ALIGNKIT_HOME=str(home), ALIGNKIT_DATA_CACHE=str(home / "data_cache"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")

    def run(out, stage, *overrides, wait=True):
        stage_keys = STAGES[stage] if stage in STAGES else [*ONLINE_STAGES[stage], "log_completions=true",
                                                             f"reward_funcs={reward_file}:token_sum_reward"]
        args = [sys.executable, "-m", "alignkit", "train", str(config), f"model_name_or_path={tiny_model_dir}",
                f"dataset_dir={ROOT / 'data'}", f"output_dir={out}", "do_train=true", "finetuning_type=lora",
                "cutoff_len=128", "max_samples=24", "per_device_train_batch_size=2", "save_steps=2",
                f"max_steps={STEPS}", "learning_rate=1e-3", "seed=0", "disable_tqdm=true", *stage_keys, *overrides]
        # SIGINT as a terminal delivers it, even where this test process was started with SIGINT ignored (a
        # background job of a non-interactive shell): Python turns it into KeyboardInterrupt only if not ignored.
        proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        if not wait:
            return proc
        output = proc.communicate(timeout=300)[0]
        return proc.returncode, output

    return run


def kill_when(proc: subprocess.Popen, condition, what: str) -> str:
    """SIGKILL `proc` as soon as `condition()` holds; fail if it exits first (the kill point was missed)."""
    deadline = time.monotonic() + 300
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc={proc.returncode}) before {what}:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == -signal.SIGKILL
    return output


def checkpoint_saved(out: Path, step: int):
    """True once checkpoint-`step` is complete: its trainer_state.json, written last, parses (the file
    exists, empty, a moment before its contents are written)."""
    def saved() -> bool:
        try:
            return json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())["global_step"] == step
        except (OSError, ValueError, KeyError):
            return False

    return saved


def step_logged(out: Path, step: int):
    """True once this run has logged `step`: a resumed run first rewrites the log (a new file), so lines
    the killed run left do not count."""
    path = out / "trainer_log.jsonl"
    old_inode = path.stat().st_ino if path.exists() else None

    def logged() -> bool:
        try:
            if path.stat().st_ino == old_inode:
                return False
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            return False
        return any(f'"current_steps": {step},' in line and '"loss"' in line for line in lines)

    return logged


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter_model.safetensors"))


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    differing = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differing, f"tensors differ from the uninterrupted run: {differing[:5]}"


def log_steps(out: Path) -> tuple[list[int], list[int]]:
    """(steps with a training loss, steps with an eval loss) of trainer_log.jsonl, in file order."""
    records = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    return ([r["current_steps"] for r in records if "loss" in r],
            [r["current_steps"] for r in records if "eval_loss" in r])


def tree_digest(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def assert_clean_outputs(out: Path) -> None:
    """Every JSON file is strict JSON (no NaN literals) and every tensor on disk is finite (broken
    checkpoints the test made and the run set aside as `invalid-checkpoint-N` excepted)."""
    def refuse(constant):
        raise ValueError(f"non-JSON constant {constant}")

    def files(pattern):
        return [p for p in out.rglob(pattern) if not p.relative_to(out).parts[0].startswith("invalid-")]

    for path in files("*.json"):
        json.loads(path.read_text(), parse_constant=refuse)
    for path in files("*.safetensors"):
        for name, tensor in load_file(str(path)).items():
            assert torch.isfinite(tensor).all(), f"{path}: {name} is not finite"
    for path in files("*.pt") + files("*.bin"):
        if path.name == "training_args.bin":
            continue
        state = torch.load(path, map_location="cpu", weights_only=True)
        stack = [state]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, torch.Tensor) and item.is_floating_point():
                assert torch.isfinite(item).all(), f"{path} holds a non-finite tensor"


def test_killed_runs_resume_to_the_uninterrupted_result(cli, tmp_path):
    """The whole chain of kills, on sft (the lock, the checkpoint checks and the final save are the same code for
    every stage; each stage's own resume is checked in-process in tests/stages, and rm and dpo below)."""
    stage = "sft"
    reference = tmp_path / "reference"
    rc, output = cli(reference, stage)
    assert rc == 0, output
    want = adapter(reference)
    want_log = log_steps(reference)
    # sft also evaluates every 2 steps; the evaluation at the last step is the end-of-run one
    assert want_log == (list(range(1, STEPS + 1)), [2, 4, 6] if stage == "sft" else [])

    # A finished run submitted again: recognised, nothing trained, not a byte changed.
    before = tree_digest(reference)
    rc, output = cli(reference, stage)
    assert rc == 0 and f"already complete: {STEPS} of {STEPS} steps" in output, output
    assert tree_digest(reference) == before

    # Killed after its last checkpoint, before any of the final save: the checkpoint is the final model.
    final_lost = tmp_path / "final_lost"
    shutil.copytree(reference, final_lost)
    for path in final_lost.iterdir():
        if path.is_file() and path.name != "trainer_log.jsonl":
            path.unlink()
    rc, output = cli(final_lost, stage)
    assert rc == 0 and f"holds the last step ({STEPS} of {STEPS})" in output, output
    assert_bit_equal(adapter(final_lost), want)
    assert log_steps(final_lost)[0] == want_log[0]

    out = tmp_path / "killed"
    # 1. Killed right after checkpoint-2 is complete.
    kill_when(cli(out, stage, wait=False), checkpoint_saved(out, 2), "checkpoint-2")
    # 2. Killed in the middle of training: resumed from checkpoint-2, stopped once step 3 is logged.
    output = kill_when(cli(out, stage, wait=False), step_logged(out, 3), "step 3")
    assert "Taking over the lock" in output and "Resuming from" in output
    assert not (out / "checkpoint-4").exists(), "the kill meant for step 4 came too late"
    # 3. Killed while writing checkpoint-4: the run is killed once it is complete, then its files are cut
    #    the way an interrupted save leaves them (state not yet written, optimizer cut short).
    kill_when(cli(out, stage, wait=False), checkpoint_saved(out, 4), "checkpoint-4")
    partial = out / "checkpoint-4"
    (partial / "trainer_state.json").unlink()
    (partial / "optimizer.pt").write_bytes((partial / "optimizer.pt").read_bytes()[:1000])
    assert not (out / f"checkpoint-{STEPS}").exists(), "the kill meant for checkpoint-4 came too late"
    # 4. Killed after the last step: checkpoint-6 complete, the final save in progress or not begun.
    output = kill_when(cli(out, stage, wait=False), checkpoint_saved(out, STEPS), f"checkpoint-{STEPS}")
    # 5. Runs to the end.
    rc, output = cli(out, stage)
    assert rc == 0, output

    assert (out / "invalid-checkpoint-4").is_dir()  # the half-written one was set aside, not resumed
    assert_bit_equal(adapter(out), want)
    assert log_steps(out)[0] == want_log[0]
    assert log_steps(out)[1] == want_log[1]  # the killed run 4 evaluated at the last step before its save
    assert_clean_outputs(out)
    assert not (out / ".alignkit.lock").exists()


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_a_run_killed_mid_training_resumes_to_the_uninterrupted_result(cli, tmp_path, stage):
    """rm and dpo, killed in the middle of training (after step 3, past checkpoint-2) as a real process, then run
    again: bit-equal adapter and each step logged once."""
    reference = tmp_path / "reference"
    rc, output = cli(reference, stage)
    assert rc == 0, output
    out = tmp_path / "killed"
    kill_when(cli(out, stage, wait=False), step_logged(out, 3), "step 3")
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists(), "the kill came too late"
    rc, output = cli(out, stage)
    assert rc == 0 and "Resuming from" in output, output
    assert_bit_equal(adapter(out), adapter(reference))
    assert log_steps(out)[0] == log_steps(reference)[0] == list(range(1, STEPS + 1))
    assert_clean_outputs(out)


def test_a_second_run_into_the_same_output_dir_is_refused(cli, tmp_path):
    out = tmp_path / "run"
    first = cli(out, "sft", "do_eval=false", wait=False)
    lock = out / ".alignkit.lock"
    deadline = time.monotonic() + 300
    while not (lock.is_file() and lock.read_text().strip()):
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    # Hold the first run still while it owns the lock, so that the second certainly meets it.
    first.send_signal(signal.SIGSTOP)
    try:
        rc, output = cli(out, "sft", "do_eval=false")
    finally:
        first.send_signal(signal.SIGCONT)
    assert rc == 2
    assert f"is in use by another run (pid {first.pid} on host" in output and "Traceback" not in output
    assert first.wait(timeout=300) == 0
    assert log_steps(out)[0] == list(range(1, STEPS + 1))  # one run's steps, once each


def test_ctrl_c_says_which_checkpoint_is_kept_and_the_same_command_resumes(cli, tmp_path):
    out, steps = tmp_path / "interrupted", 40  # long enough that the interrupt lands before the end
    proc = cli(out, "sft", "do_eval=false", f"max_steps={steps}", wait=False)
    saved = checkpoint_saved(out, 2)
    deadline = time.monotonic() + 300
    while not saved():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    kept = re.search(r"alignkit: interrupted\. (\S+) is kept; re-running the same command resumes from it\.", output)
    assert kept and (Path(kept.group(1)) / "trainer_state.json").is_file(), output[-3000:]
    rc, output = cli(out, "sft", "do_eval=false", f"max_steps={steps}")
    assert rc == 0, output[-3000:]
    assert f"Resuming from {kept.group(1)}" in output, output[-3000:]
    assert log_steps(out)[0] == list(range(1, steps + 1))


def test_a_finished_run_whose_final_model_is_gone_gets_it_back_from_its_last_checkpoint(cli, tmp_path):
    out = tmp_path / "done"
    rc, output = cli(out, "sft", "do_eval=false")
    assert rc == 0, output[-3000:]
    want = adapter(out)
    (out / "adapter_model.safetensors").unlink()
    rc, output = cli(out, "sft", "do_eval=false")
    assert rc == 0 and "final model was gone" in output and f"checkpoint-{STEPS}" in output, output[-3000:]
    assert_bit_equal(adapter(out), want)
    # With no checkpoint at the last step the model cannot come back: say so, and how to train it again.
    (out / "adapter_model.safetensors").unlink()
    shutil.rmtree(out / f"checkpoint-{STEPS}")
    rc, output = cli(out, "sft", "do_eval=false")
    assert rc == 2 and "final model is gone" in output and "overwrite_output_dir=true" in output, output[-3000:]
    assert "Traceback" not in output


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_divergence_stops_with_an_error_and_leaves_nothing_non_finite(cli, tmp_path, stage):
    out = tmp_path / "diverged"
    rc, output = cli(out, stage, "learning_rate=1e30", "logging_nan_inf_filter=false", "do_eval=false")
    assert rc != 0
    assert "alignkit: error: training diverged at step" in output and "Traceback" not in output, output
    assert not (out / "adapter_model.safetensors").exists()  # no final model
    assert_clean_outputs(out)


def completions(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stage", list(ONLINE_STAGES))
def test_online_completions_appear_once_after_kill_and_resume(cli, tmp_path, stage):
    """An online stage killed after a generation round that lies past its last checkpoint (checkpoint-2; step 3
    generated, scored, logged its completions and trained) regenerates that round on resume: `completions.jsonl`
    must then hold it once, as the uninterrupted run does, row for row. A run with overwrite_output_dir over a
    finished one starts the file afresh."""
    reference = tmp_path / "reference"
    rc, output = cli(reference, stage)
    assert rc == 0, output
    want = completions(reference)

    out = tmp_path / "killed"
    kill_when(cli(out, stage, wait=False), step_logged(out, 3), "step 3")
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists(), "the kill came too late"
    rc, output = cli(out, stage)
    assert rc == 0 and "Resuming from" in output, output
    assert completions(out) == want
    assert_bit_equal(adapter(out), adapter(reference))

    rc, output = cli(out, stage, "overwrite_output_dir=true")
    assert rc == 0, output
    assert completions(out) == want
    # One schema for every online stage: 1-based steps, each completion's rewards by name.
    assert sorted({row["step"] for row in want}) == list(range(1, STEPS + 1))
    assert len(want) == STEPS * 2 and all(set(row["rewards"]) == {"token_sum_reward"} for row in want)


def test_a_reward_beyond_float32_stops_the_run_naming_function_and_row(cli, tmp_path):
    """1e39 is a finite Python float but inf in the float32 rewards are kept in: the run must stop with the
    function and row named, before anything non-finite is logged or written (issue 31, item 5)."""
    huge = tmp_path / "huge_reward.py"
    huge.write_text("def huge(completions, **kwargs):\n    return [1e39] + [0.0] * (len(completions) - 1)\n")
    out = tmp_path / "huge"
    rc, output = cli(out, "grpo", f"reward_funcs={huge}:huge")
    assert rc != 0
    assert "reward function huge: row 0" in output and "float32" in output, output[-3000:]
    assert "Traceback" not in output
    path = out / "completions.jsonl"
    assert not path.exists() or "Infinity" not in path.read_text()
