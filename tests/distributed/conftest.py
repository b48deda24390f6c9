"""The distributed tier: real `alignkit train` runs under torchrun on the CPU (gloo), tiny model, compared with
one process.

Every test in `tests/distributed/` is marked `distributed` here (no decorator needed); the tier runs by default
(deselect it with `-m "not distributed"`).

Harness API (fixture `dist`, a `DistHarness`):

- `dist.config(stage, name=None, **keys) -> Path`: writes a YAML for `stage` on the tiny model (the session's
  `tiny_model_dir`) and the repository's demo data (`dataset_dir: data/`), with small settings that make a run
  take seconds: LoRA rank 4, `cutoff_len` 64, `max_steps` 4, `logging_steps` 1, `seed` 0, `learning_rate` 1e-3,
  `report_to: none`, no tqdm, `overwrite_output_dir`, and `output_dir` = `<tmp>/<name>`. `keys` override or add
  keys (e.g. `per_device_train_batch_size=2`, `dataset="demo_pref"`); a value of None drops the key.
  Default datasets: `demo_pt` (pt), `demo_sft` (sft), `demo_pref` (rm, dpo), `demo_kto` (kto), `demo_math`
  (grpo, ppo).
- `dist.train(config, *overrides, nproc=1, launcher=None, home=None, env=None, timeout=..., check=True,
  cpu_gates=False) -> DistRun`: runs `alignkit train CONFIG key=value ...` in fresh processes, except the plain
  one-process run (`nproc=1`, no `launcher`, `env` or `cpu_gates`, `check=True`, no `deepspeed` or `fsdp` key):
  that one goes through `alignkit.cli.main` in the test process (`dist.train_in_process`, which restores the
  environment, working folder, thread count and logging afterwards; `ALIGNKIT_TEST_IN_PROCESS=0` starts a
  process for it too). `launcher`:
  - None: `"torchrun"` when `nproc > 1`, else `"python"` (or in the test process, above);
  - `"python"`: `python -m alignkit train ...`, one process (the single-process equivalent);
  - `"torchrun"`: `python -m torch.distributed.run --standalone --nproc_per_node N -m alignkit train ...`
    (torchrun's own module, so the venv's python runs it);
  - `"nproc"`: `python -m alignkit train --nproc N ...` (alignkit re-launches itself through torchrun);
  - `"force_torchrun"`: `python -m alignkit train ...` with `FORCE_TORCHRUN=1 NPROC_PER_NODE=N`;
  - `"accelerate"`: `python -m accelerate.commands.launch --multi_gpu --num_processes N -m alignkit train ...`
    (accelerate's multi-process launcher; on a CPU-only machine the processes train on the CPU with gloo);
  - a list: torchrun with these arguments before `-m alignkit` (one node of a multi-node run, say).
  Each run gets its own `ALIGNKIT_HOME` and data cache (`<tmp>/home-<n>`, so a run never reads another's
  cache) unless `home` names one to share. The environment (`dist.environment(home=None, env=None) -> (env,
  home)`) is offline (`HF_HUB_OFFLINE=1`, `HF_DATASETS_OFFLINE=1`), with `OMP_NUM_THREADS=1` (one thread per
  rank: two ranks on two cores), `HF_HOME` inside the run's home (no user accelerate config is read),
  `PYTHONPATH` = this checkout and no launcher variables inherited, plus `env`. `cpu_gates=True` puts
  `cpu_gates/` first on `PYTHONPATH`: its `sitecustomize.py` lets accelerate run FSDP and DeepSpeed in a
  multi-process CPU run (accelerate 1.15 does so on GPU-like devices only; see that file). With `check=True` a non-zero
  exit fails the test showing the command and the end of its output; a run past `timeout` seconds is killed
  with its whole process group (torchrun's workers too) and fails.
- `dist.launch(...)`: the same, but returns the `subprocess.Popen` at once (stdout and stderr merged, text)
  for runs that must go concurrently (the nodes of a two-node run); `dist.wait(proc, out)` turns it into a
  `DistRun` and applies the same checks.
- `DistRun`: `.out` (the output_dir), `.returncode`, `.output` (stdout+stderr), `.command`, `.home` (its
  ALIGNKIT_HOME; the tokenised-data cache is `.home / "data_cache"`), `.log()` (the records of
  `trainer_log.jsonl`), `.losses(key="loss")` -> {step: value} of the training records, `.weights()` ->
  the final saved weights as a {name: tensor} (`adapter_model.safetensors` under LoRA, else
  `model.safetensors`), `.predictions()` -> the rows of `generated_predictions.jsonl`.
- `dist.assert_same_losses(a, b, atol=1e-5, key="loss")` and `dist.assert_same_weights(a, b, atol=1e-5)`: per
  step and per tensor, within `atol` plus a part of each figure's size (`LOG_RTOL`) or of each weight's update
  (`UPDATE_RTOL`; both derived where they are defined), with a table of what differs in the failure message (the weights: a tied copy that one
  run alone saved, as FSDP saves `lm_head.weight`, must equal its source; returns the largest difference). `dist.assert_same_logs(a, b,
  atol=1e-5, ignore=())`: every value of every per-step training record but the wall-clock ones and `ignore` (stage metrics, token
  counts, learning rate, epoch...). `dist.loss_table(runs, key)` formats the per-step values of several runs
  ({label: DistRun}) side by side (for reports).
- `dist.resume_folder(run, step, name) -> Path`: a fresh output_dir `<tmp>/<name>` holding `run`'s
  `checkpoint-<step>` and training log, where a run resumes as after a kill.
- `dist.free_port()`: a free localhost TCP port (for a rendezvous endpoint).
(Test modules reach these through the fixture: pytest's importlib import mode cannot import a conftest.)
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = ROOT / "data"
# Generous: a run on the tiny model takes seconds alone, but the two CPU cores are shared with other jobs.
DEFAULT_TIMEOUT = 600
DEFAULT_DATASETS = {"pt": "demo_pt", "sft": "demo_sft", "rm": "demo_pref", "dpo": "demo_pref", "kto": "demo_kto",
                    "grpo": "demo_math", "ppo": "demo_math"}
# Its sitecustomize.py lifts accelerate's FSDP and DeepSpeed device gates in the processes of a run (`cpu_gates=True`).
CPU_GATES = Path(__file__).parent / "cpu_gates"
# Variables a launcher sets for its workers: a test run from inside a torchrun job must not inherit them.
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "FORCE_TORCHRUN", "NPROC_PER_NODE",
                       "NNODES", "NODE_RANK")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.distributed)


def free_port() -> int:
    """A TCP port free on localhost now (bound and released; the rendezvous binds it again at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class DistRun:
    """One finished `alignkit train` launch (all of its processes)."""

    out: Path
    returncode: int
    output: str
    command: list[str]
    home: Optional[Path] = None  # its ALIGNKIT_HOME (the data cache is `home / "data_cache"`)

    def log(self) -> list[dict[str, Any]]:
        path = self.out / "trainer_log.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def losses(self, key: str = "loss") -> dict[int, float]:
        """{step: value} of `key` in the per-step training records (each step must be logged once)."""
        records = [r for r in self.log() if key in r and "train_runtime" not in r]
        steps = [r["current_steps"] for r in records]
        assert len(steps) == len(set(steps)), f"{self.out}: steps logged more than once: {steps}"
        return {r["current_steps"]: r[key] for r in records}

    def weights(self) -> dict[str, Any]:
        from safetensors.torch import load_file

        for name in ("adapter_model.safetensors", "model.safetensors"):
            if (self.out / name).exists():
                return load_file(str(self.out / name))
        raise AssertionError(f"{self.out} holds no adapter_model.safetensors or model.safetensors: "
                             f"{sorted(p.name for p in self.out.iterdir())}")

    def predictions(self) -> list[dict[str, Any]]:
        path = self.out / "generated_predictions.jsonl"
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _tail(text: str, limit: int = 8000) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


class DistHarness:
    """Writes configs and launches `alignkit train` runs (see the module docstring)."""

    # The module-level helpers, reachable from tests (test modules cannot import a conftest under
    # pytest's importlib mode).
    free_port = staticmethod(lambda: free_port())
    loss_table = staticmethod(lambda runs, key="loss": loss_table(runs, key))
    assert_same_losses = staticmethod(lambda a, b, atol=1e-5, key="loss": assert_same_losses(a, b, atol, key))
    assert_same_logs = staticmethod(lambda a, b, atol=1e-5, ignore=(): assert_same_logs(a, b, atol, ignore))

    def __init__(self, tmp: Path, model_dir: str) -> None:
        self.tmp = tmp
        self.model_dir = model_dir
        self._homes = 0

    def assert_same_weights(self, a: "DistRun", b: "DistRun", atol: float = 1e-5) -> float:
        """`assert_same_weights` with the weights' starting points known to the harness: the tiny model's
        tensors (full fine-tuning) and zero (LoRA's `lora_B`)."""
        from safetensors.torch import load_file

        return assert_same_weights(a, b, atol, start=load_file(str(Path(self.model_dir) / "model.safetensors")))

    # ---- configs ----

    def config(self, stage: str, name: Optional[str] = None, **keys: Any) -> Path:
        name = name or stage
        values: dict[str, Any] = {
            "stage": stage, "do_train": True, "model_name_or_path": self.model_dir,
            "finetuning_type": "lora", "lora_rank": 4, "lora_target": "all",
            "dataset": DEFAULT_DATASETS.get(stage, "demo_sft"), "dataset_dir": str(DATA_DIR),
            **({} if stage == "pt" else {"template": "chatml"}),
            "cutoff_len": 64, "output_dir": str(self.tmp / name), "overwrite_output_dir": True,
            "per_device_train_batch_size": 2, "max_steps": 4, "logging_steps": 1, "learning_rate": 1e-3,
            "seed": 0, "report_to": "none", "disable_tqdm": True,
        }
        for key, value in keys.items():
            if value is None:
                values.pop(key, None)
            else:
                values[key] = value
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(values, sort_keys=False), encoding="utf-8")
        return path

    def resume_folder(self, run: "DistRun", step: int, name: str) -> Path:
        """A fresh output_dir `<tmp>/<name>` holding `run`'s `checkpoint-<step>` and its `trainer_log.jsonl`, as a
        run killed after that checkpoint leaves it; a run pointed there (without `overwrite_output_dir`)
        resumes from it."""
        out = self.tmp / name
        out.mkdir()
        shutil.copytree(run.out / f"checkpoint-{step}", out / f"checkpoint-{step}")
        shutil.copy(run.out / "trainer_log.jsonl", out / "trainer_log.jsonl")
        return out

    # ---- launching ----

    def environment(self, home: Optional[Path] = None, env: Optional[dict[str, str]] = None,
                    cpu_gates: bool = False) -> tuple[dict, Path]:
        """The environment of a run, and its ALIGNKIT_HOME (a fresh one unless `home` is given); with
        `cpu_gates`, accelerate's FSDP and DeepSpeed device gates lifted (`CPU_GATES`)."""
        if home is None:
            self._homes += 1
            home = self.tmp / f"home-{self._homes}"
        home = Path(home)
        home.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
        paths = (str(CPU_GATES) if cpu_gates else "", str(ROOT), os.environ.get("PYTHONPATH", ""))
        base.update(PYTHONPATH=os.pathsep.join(p for p in paths if p),
                    ALIGNKIT_HOME=str(home), ALIGNKIT_DATA_CACHE=str(home / "data_cache"),
                    HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                    OMP_NUM_THREADS="1", WANDB_DISABLED="true",
                    # accelerate reads a default config from here: none, so a developer's own cannot leak in
                    HF_HOME=str(home / "hf_home"))
        base.update(env or {})
        return base, home

    def command(self, config: Path, overrides: Sequence[str], nproc: int = 1,
                launcher: Union[None, str, Sequence[str]] = None) -> list[str]:
        if launcher is None:
            launcher = "torchrun" if nproc > 1 else "python"
        if launcher == "python":
            if nproc != 1:
                raise ValueError("launcher='python' runs one process; use launcher='torchrun' for nproc > 1")
            prefix = [sys.executable]
        elif launcher == "nproc":  # alignkit's own re-launch through torchrun
            return [sys.executable, "-m", "alignkit", "train", "--nproc", str(nproc), str(config), *overrides]
        elif launcher == "force_torchrun":  # the same, asked for LLaMA-Factory's way (see `launch`)
            return [sys.executable, "-m", "alignkit", "train", str(config), *overrides]
        elif launcher == "accelerate":  # `accelerate launch --multi_gpu`: its torchrun-style launcher, CPU here
            prefix = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc)]
        elif launcher == "torchrun":
            prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        else:
            prefix = [sys.executable, "-m", "torch.distributed.run", *launcher]
        return [*prefix, "-m", "alignkit", "train", str(config), *overrides]

    def launch(self, config: Path, *overrides: str, nproc: int = 1, launcher=None, home: Optional[Path] = None,
               env: Optional[dict[str, str]] = None, cpu_gates: bool = False) -> subprocess.Popen:
        if launcher == "force_torchrun":
            env = {**(env or {}), "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(nproc)}
        run_env, run_home = self.environment(home, env, cpu_gates)
        command = self.command(config, overrides, nproc, launcher)
        proc = subprocess.Popen(command, env=run_env, cwd=self.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        proc.args = command
        proc.alignkit_home = run_home
        return proc

    def wait(self, proc: subprocess.Popen, out: Path, *, timeout: float = DEFAULT_TIMEOUT, check: bool = True) -> DistRun:
        try:
            output = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's session: torchrun and its workers
            output = proc.communicate()[0]
            pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, proc.args))}\n{_tail(output)}")
        run = DistRun(out=Path(out), returncode=proc.returncode, output=output, command=list(map(str, proc.args)),
                      home=getattr(proc, "alignkit_home", None))
        if check and proc.returncode != 0:
            pytest.fail(f"exit code {proc.returncode}: {' '.join(run.command)}\n{_tail(output)}")
        return run

    def train(self, config: Path, *overrides: str, nproc: int = 1, launcher=None, home: Optional[Path] = None,
              env: Optional[dict[str, str]] = None, timeout: float = DEFAULT_TIMEOUT, check: bool = True,
              cpu_gates: bool = False) -> DistRun:
        if nproc == 1 and launcher is None and env is None and not cpu_gates and check \
                and _plain_single_process(config, overrides):
            return self.train_in_process(config, *overrides, home=home)
        proc = self.launch(config, *overrides, nproc=nproc, launcher=launcher, home=home, env=env,
                           cpu_gates=cpu_gates)
        return self.wait(proc, output_dir_of(config, overrides), timeout=timeout, check=check)

    def train_in_process(self, config: Path, *overrides: str, home: Optional[Path] = None) -> DistRun:
        """`alignkit train CONFIG key=value ...` through its entry point (`alignkit.cli.main`) in this test process,
        in the run's environment (`environment`), from `self.tmp`, on one torch thread, its printed and logged
        output collected (alignkit's loggers; transformers' own handler writes elsewhere).

        The single-process side of a comparison needs no process of its own: starting one costs about 6 CPU
        seconds of imports (torch, transformers, peft, which imports bitsandbytes), a fifth of the distributed
        tier's CPU time (docs/testing.md). Everything is put back afterwards: the environment, the working
        folder, the thread count, the root logger's level and handlers.
        """
        import torch

        from alignkit.cli import LOG_FORMAT, main

        run_env, run_home = self.environment(home)
        saved_env, saved_cwd, saved_threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
        root = logging.getLogger()
        saved_level, saved_handlers = root.level, list(root.handlers)
        buffer = io.StringIO()
        handler = logging.StreamHandler(buffer)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        command = ["alignkit", "train", str(config), *overrides]
        try:
            os.environ.clear()
            os.environ.update(run_env)
            os.chdir(self.tmp)
            torch.set_num_threads(1)
            root.addHandler(handler)
            root.setLevel(logging.INFO)
            with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
                returncode = main(command[1:])
        finally:
            root.handlers[:] = saved_handlers
            root.setLevel(saved_level)
            torch.set_num_threads(saved_threads)
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
        run = DistRun(out=output_dir_of(config, overrides), returncode=returncode, output=buffer.getvalue(),
                      command=[*command, "(in the test process)"], home=run_home)
        if returncode != 0:
            pytest.fail(f"exit code {returncode}: {' '.join(run.command)}\n{_tail(run.output)}")
        return run


def _plain_single_process(config: Path, overrides: Sequence[str]) -> bool:
    """Whether a one-process run of `config` can go in the test process: not under DeepSpeed or FSDP (engines
    that set up process groups and state of their own), and not asked otherwise by `ALIGNKIT_TEST_IN_PROCESS=0`."""
    if os.environ.get("ALIGNKIT_TEST_IN_PROCESS", "1") == "0":
        return False
    keys = set(yaml.safe_load(config.read_text(encoding="utf-8")) or {})
    keys |= {item.split("=", 1)[0].strip() for item in overrides}
    return not keys & {"deepspeed", "fsdp", "fsdp_config"}


def output_dir_of(config: Path, overrides: Iterable[str] = ()) -> Path:
    """The output_dir a run of `config` with `overrides` writes to."""
    out = yaml.safe_load(Path(config).read_text(encoding="utf-8")).get("output_dir")
    for item in overrides:
        if item.startswith("output_dir="):
            out = item.split("=", 1)[1]
    return Path(out)


# ---- comparisons ----

def loss_table(runs: dict[str, DistRun], key: str = "loss") -> str:
    """Per-step values of `key` of each run side by side, plus the largest absolute difference to the first."""
    series = {label: run.losses(key) for label, run in runs.items()}
    steps = sorted(set().union(*(s.keys() for s in series.values())))
    labels = list(series)
    lines = ["step | " + " | ".join(labels) + " | max |diff|"]
    for step in steps:
        values = [series[label].get(step) for label in labels]
        known = [v for v in values if v is not None]
        diff = max(abs(v - known[0]) for v in known) if known else float("nan")
        lines.append(f"{step} | " + " | ".join("-" if v is None else f"{v:.8f}" for v in values) + f" | {diff:.2e}")
    return "\n".join(lines)


# Two processes reduce a batch in another order than one process does, and a float32 sum of n terms computed in
# two orders differs by about sqrt(n) * u * sum(|terms|) (u = 2^-24; n * u at worst). The figures a step logs are
# sums or means of at most a few hundred terms of one sign (token log-probs, per-row losses, squared gradients),
# so sum(|terms|) is the figure's own magnitude and sqrt(256) * 2^-24 = 1e-6 of it is their rounding gap. A flat
# 1e-5 alone is too tight for large figures: a DPO `logps/rejected` of -114 (a sum of about 60 log-probs) is only
# 1.3 float32 ulps wide at 1e-5 (ulp(114) = 7.6e-6), and an Intel Xeon's AVX-512 kernels put it 1.1e-5 apart.
LOG_RTOL = 1e-6


def _within(x: float, y: float, atol: float) -> bool:
    return abs(x - y) <= atol + LOG_RTOL * max(abs(x), abs(y))


def assert_same_losses(a: DistRun, b: DistRun, atol: float = 1e-5, key: str = "loss") -> None:
    la, lb = a.losses(key), b.losses(key)
    assert la, f"{a.out}: no `{key}` logged"
    assert sorted(la) == sorted(lb), f"different steps logged: {sorted(la)} vs {sorted(lb)}"
    bad = [s for s in la if not _within(la[s], lb[s], atol)]
    assert not bad, f"`{key}` differs by more than {atol} + {LOG_RTOL} x |value| at steps {bad}:\n" \
                    f"{loss_table({'a': a, 'b': b}, key)}"


# Wall-clock figures differ from run to run; everything else a step logs must agree.
TIMING_KEYS = frozenset({"elapsed_time", "remaining_time", "tokens_per_second",
                         "step_time", "time/generation", "time/training"})  # the last three: GRPO's


def assert_same_logs(a: DistRun, b: DistRun, atol: float = 1e-5, ignore: Iterable[str] = ()) -> None:
    """Every per-step training record of `a` and `b` holds the same keys and values (`atol` + `LOG_RTOL` x |value|),
    timing aside:
    losses, gradient norms, learning rates, epochs, token counts and each stage's metrics (reward
    accuracies, margins...), which under several processes are reduced over all of them. `ignore`: keys left
    out of the comparison (say why at the call)."""
    steps_a = {r["current_steps"]: r for r in a.log() if "loss" in r}
    steps_b = {r["current_steps"]: r for r in b.log() if "loss" in r}
    assert sorted(steps_a) == sorted(steps_b), f"different steps logged: {sorted(steps_a)} vs {sorted(steps_b)}"
    problems = []
    for step, record in steps_a.items():
        other = steps_b[step]
        keys = (set(record) | set(other)) - TIMING_KEYS - set(ignore)
        for key in sorted(keys):
            x, y = record.get(key), other.get(key)
            if isinstance(x, (int, float)) and isinstance(y, (int, float)):
                if not _within(x, y, atol):
                    problems.append(f"step {step} {key}: {x} vs {y}")
            elif x != y:
                problems.append(f"step {step} {key}: {x!r} vs {y!r}")
    assert not problems, "logged values differ:\n" + "\n".join(problems[:20])


# A tied output layer: FSDP's full state dict saves it beside the embeddings (transformers drops a tied copy only
# when it shares storage with its source, which the gathered copies do not); loading ties the two again.
TIED_COPIES = {"lm_head.weight": "model.embed_tokens.weight"}


def _without_tied_copies(weights: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """`weights` less the tied copies `other` lacks, each checked to equal the tensor it is tied to."""
    for copy, source in TIED_COPIES.items():
        if copy in weights and copy not in other and source in weights:
            assert (weights[copy] - weights[source]).abs().max().item() == 0, f"{copy} differs from {source}"
            weights = {k: v for k, v in weights.items() if k != copy}
    return weights


# Adam moves every weight by about the learning rate per step whatever the size of its gradient (it divides by the
# gradient's own running RMS). An element whose gradient is a near-cancelled sum carries that sum's rounding gap,
# which may be any fraction of the gradient itself, into its update at the learning-rate scale: full fine-tuning at
# lr 1e-3 under ZeRO-3 left an element of `mlp.up_proj` 1.04e-5 apart after 3 steps on an Intel Xeon (AVX-512
# kernels). So where a weight's starting point is known, an element may differ by `atol` plus this fraction of how
# far it moved; two runs that trained on different data or batch splits move their weights apart by far more.
UPDATE_RTOL = 1e-2


def assert_same_weights(a: DistRun, b: DistRun, atol: float = 1e-5, start: Optional[dict[str, Any]] = None) -> float:
    """The saved weights agree within `atol` (a tied copy saved by one run alone, `TIED_COPIES`, must equal its
    source); returns the largest difference. `start`: the weights before training ({name: tensor}, the base
    model's); an element of a tensor found there with the same shape, and of a LoRA `lora_B` (which starts at
    zero), may differ by `atol` + `UPDATE_RTOL` x how far it moved."""
    import torch

    wa, wb = a.weights(), b.weights()
    wa, wb = _without_tied_copies(wa, wb), _without_tied_copies(wb, wa)
    assert sorted(wa) == sorted(wb), f"different tensors saved: {sorted(set(wa) ^ set(wb))}"
    diffs, bad = {}, {}
    for name in wa:
        x, y = wa[name].float(), wb[name].float()
        gap = (x - y).abs()
        diffs[name] = gap.max().item()
        origin = (start or {}).get(name)
        if origin is None and "lora_B" in name:
            origin = torch.zeros_like(x)
        allowed = atol if origin is None or origin.shape != x.shape else atol + UPDATE_RTOL * (x - origin.float()).abs()
        if (gap > allowed).any():
            bad[name] = diffs[name]
    assert not bad, f"{len(bad)} of {len(diffs)} tensors differ by more than {atol} (+ {UPDATE_RTOL} x the update " \
        "where the start is known): " + \
        ", ".join(f"{n}: {d:.2e}" for n, d in sorted(bad.items(), key=lambda kv: -kv[1])[:8])
    return max(diffs.values())


@pytest.fixture(scope="module")
def dist(tiny_model_dir, tmp_path_factory) -> DistHarness:
    """The harness (module docstring); one per test module, so runs can be shared between its tests."""
    return DistHarness(tmp_path_factory.mktemp("dist"), tiny_model_dir)
