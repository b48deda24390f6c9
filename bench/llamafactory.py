"""LLaMA-Factory 0.9.5 as a benchmark peer: its own cached virtual environment, and the settings translation.

LLaMA-Factory pins `transformers<=5.6`, `peft<=0.18.1`, `trl<=0.24`, `datasets<=4.0` and `accelerate<=1.11`,
so it cannot share alignkit's environment. `ensure_venv()` creates one once (by default
`~/.cache/alignkit/bench/llamafactory-0.9.5`, or `$ALIGNKIT_LF_VENV`) and writes a stamp; a second call with
the same recipe returns at once. The recipe (`install_commands`) works around three traps found on the
development machine (2026-11-30):

- `torch==2.13.0` goes in first and stays pinned in every later install: an unpinned torch makes pip take a
  multi-GB CUDA build.
- torchvision is left out: pip's choice (0.28.0) is a CUDA build, and with it installed every
  `import transformers` model fails (`operator torchvision::nms does not exist`). LLaMA-Factory never imports
  it. So llamafactory itself goes in with `--no-deps`, and its declared requirements follow, minus torchvision
  and torchaudio.
- torchaudio must import (`llamafactory/data/mm_plugin.py` imports it) but its wheel is CUDA-linked: it goes
  in with `--no-deps` and its `torchaudio/lib/*.so` files are moved aside (to `lib.moved-aside/`), which
  leaves a package whose Python modules import and whose audio ops are never called here.

`lf_config()` is the translation of one benchmark run into LLaMA-Factory's training arguments (what its YAML
files hold); `SETTINGS_THAT_DIFFER` lists what cannot be made equal and why. This module imports only the
standard library at the top, because the worker imports it inside the LLaMA-Factory environment too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

LF_VERSION = "0.9.5"
TORCH_PIN = "torch==2.13.0"
TORCHAUDIO_PIN = "torchaudio==2.11.1"
# Requirements of llamafactory that are not installed (see the module docstring).
LEFT_OUT = ("torchvision", "torchaudio")
TEMPLATE = "smollm2"  # LLaMA-Factory's name for the bundled model's ChatML template
STAMP = ".alignkit-lf-installed"
PACKAGES = ("llamafactory", "transformers", "peft", "trl", "torch", "accelerate", "datasets", "torchaudio")

# LLaMA-Factory has the stage names alignkit uses (its `stage` key): pt, sft, rm, ppo, dpo, kto.
LF_STAGES = ("sft", "rm", "dpo", "ppo")

# What the LLaMA-Factory runs do differently from alignkit's, and why (reported with the results).
SETTINGS_THAT_DIFFER = {
    "rm": "reward head: LLaMA-Factory wraps the causal LM in trl's AutoModelForCausalLMWithValueHead (a hidden -> 1 "
          "value head, trained in full beside the adapter) and reads the value at each sequence's last real token; "
          "that wrapper also computes the LM head's vocabulary logits for every token, which the loss never uses. "
          "alignkit (and TRL) use a sequence-classification score head and no LM head. MFU is computed with the "
          "same N (the reward model's) for both, so LLaMA-Factory's unused LM-head work is not counted.",
    "dpo": "reference model: both run the reference forward inside the step with the adapter disabled "
           "(LLaMA-Factory's default for LoRA without ref_model); beta 0.1, sigmoid loss in both.",
    "ppo": "cannot run: LLaMA-Factory 0.9.5's CustomPPOTrainer calls require_version('trl>=0.8.6,<=0.9.6') "
           "unconditionally (DISABLE_VERSION_CHECK=1, which its message suggests, does not reach it) and then builds "
           "trl 0.9's PPOConfig (model_name=, ppo_epochs=, ...), which trl 0.24 rejects (TypeError: unexpected "
           "keyword argument 'model_name'); its other stages need trl>=0.18, so one environment cannot hold both "
           "(upstream issue hiyouga/LLaMA-Factory#10757). The attempt is run and its error recorded.",
    "all": "gradient checkpointing is on by default in LLaMA-Factory; it is turned off "
           "(disable_gradient_checkpointing: true) because alignkit does not use it. LLaMA-Factory tokenises "
           "with its own `smollm2` template (the same ChatML text as the model's chat template).",
}


def default_venv_dir() -> Path:
    """`$ALIGNKIT_LF_VENV`, else `~/.cache/alignkit/bench/llamafactory-<version>` (under `$XDG_CACHE_HOME`)."""
    if os.environ.get("ALIGNKIT_LF_VENV"):
        return Path(os.environ["ALIGNKIT_LF_VENV"]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "alignkit" / "bench" / f"llamafactory-{LF_VERSION}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def requirement_name(requirement: str) -> str:
    """The normalised project name of a requirement string: "Trl>=0.18,<=0.24.0; python_version>'3'" -> "trl"."""
    name = requirement.split(";")[0].strip()
    for sep in "<>=!~[ (":
        name = name.split(sep)[0]
    return name.strip().lower().replace("_", "-")


def core_requirements(requires: list[str]) -> list[str]:
    """llamafactory's declared requirements without extras-only ones and without `LEFT_OUT`.

    Example: ["transformers>=4.55,<=5.6.0", "torchvision", "deepspeed; extra == 'deepspeed'"]
    -> ["transformers>=4.55,<=5.6.0"].
    """
    out = []
    for req in requires:
        marker = req.partition(";")[2]
        if "extra" in marker:
            continue
        if requirement_name(req) in LEFT_OUT:
            continue
        out.append(req.partition(";")[0].strip() if not marker.strip() else req)
    return out


def install_commands(python: Path) -> list[list[str]]:
    """The pip steps before the requirements are known (the requirement step is built from the metadata)."""
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    return [
        [*pip, "--upgrade", "pip"],
        [*pip, TORCH_PIN],
        [*pip, "--no-deps", f"llamafactory=={LF_VERSION}"],
    ]


RECIPE_VERSION = 1  # bump when `ensure_venv`'s steps change, so existing environments are rebuilt


def recipe_hash() -> str:
    """Identifies the install recipe: the pins, what is left out, and `RECIPE_VERSION`."""
    text = json.dumps([RECIPE_VERSION, LF_VERSION, TORCH_PIN, TORCHAUDIO_PIN, LEFT_OUT])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_stamp(venv: Path) -> dict[str, Any] | None:
    try:
        return json.loads((venv / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def ensure_venv(venv: Path | None = None, log: Callable[[str], None] = print, force: bool = False) -> dict[str, Any]:
    """Create (once) the LLaMA-Factory environment; returns its stamp: python, versions, install time.

    Raises:
        RuntimeError: an install step failed (the message names the command; pip's output was streamed).
    """
    venv = Path(venv or default_venv_dir())
    python = venv_python(venv)
    stamp = read_stamp(venv)
    if not force and stamp and stamp.get("recipe") == recipe_hash() and python.exists():
        return stamp
    started = time.time()
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps: list[str] = []

    def run(cmd: list[str]) -> str:
        log("[bench] llamafactory venv: " + " ".join(cmd))
        steps.append(" ".join(cmd[1:] if cmd[0] == str(python) else cmd))
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            raise RuntimeError(f"installing LLaMA-Factory's environment in {venv} failed at `{' '.join(cmd)}` "
                               f"(exit {proc.returncode}):\n{proc.stdout[-3000:]}\nRemove {venv} and rerun, or "
                               "set ALIGNKIT_LF_VENV to another directory.")
        return proc.stdout

    if not python.exists():
        # The stdlib venv module of a plain interpreter: the base Python of whatever runs the benchmark.
        base = getattr(sys, "_base_executable", sys.executable)
        run([base, "-m", "venv", str(venv)])
    for cmd in install_commands(python):
        run(cmd)
    requires = json.loads(run([str(python), "-c", "import json, importlib.metadata as m; "
                                                  "print(json.dumps(m.requires('llamafactory') or []))"]
                              ).strip().splitlines()[-1])
    core = core_requirements(requires)
    # torch stays pinned: listing it with the requirements keeps pip from replacing the CPU build.
    run([str(python), "-m", "pip", "install", "--disable-pip-version-check", TORCH_PIN, *core])
    run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-deps", TORCHAUDIO_PIN])
    moved = move_torchaudio_libs(venv)
    log(f"[bench] llamafactory venv: moved aside {len(moved)} CUDA-linked torchaudio libraries")
    steps.append(f"move torchaudio/lib/*.so to torchaudio/lib.moved-aside/ ({len(moved)} files)")
    check = ("import json, importlib.metadata as m, torchaudio, llamafactory; "
             "from llamafactory.train.tuner import run_exp; "
             f"print(json.dumps({{p: m.version(p) for p in {list(PACKAGES)!r}}}))")
    found = json.loads(run([str(python), "-c", check]).strip().splitlines()[-1])
    stamp = {"recipe": recipe_hash(), "python": str(python), "versions": found, "steps": steps,
             "requirements": core, "install_s": round(time.time() - started, 1),
             "installed_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (venv / STAMP).write_text(json.dumps(stamp, indent=1), encoding="utf-8")
    log(f"[bench] llamafactory venv ready in {stamp['install_s']:.0f} s: {found}")
    return stamp


def move_torchaudio_libs(venv: Path) -> list[str]:
    """Move torchaudio's compiled libraries (CUDA-linked here) out of its `lib/` so that it never loads them."""
    moved = []
    for lib_dir in venv.glob("lib/python*/site-packages/torchaudio/lib"):
        aside = lib_dir.parent / "lib.moved-aside"
        aside.mkdir(exist_ok=True)
        for so in sorted(lib_dir.glob("*.so")):
            shutil.move(str(so), str(aside / so.name))
            moved.append(so.name)
    return moved


def lf_config(stage: str, *, model_dir: str, dataset: str, dataset_dir: str, output_dir: str, batch: int,
              steps: int, lr: float, cutoff: int, device: str = "cpu", seed: int = 42,
              reward_model: str | None = None) -> dict[str, Any]:
    """LLaMA-Factory training arguments (its YAML keys) for one benchmark run, matching alignkit's run.

    Shared with alignkit's side (bench/worker.py `run_alignkit`): LoRA r=8, alpha 16, dropout 0 on every linear
    layer (`lora_target: all`), batch, steps, learning rate with the Trainer's linear schedule and no warm-up,
    cutoff, seed 42, one micro-batch per step, no dataloader workers, no checkpoints, loss logged every step,
    fp32 on the CPU (bf16 autocast with `device="cuda"`), DPO beta 0.1 with the sigmoid loss.

    Differs on purpose: `template: smollm2` (LLaMA-Factory formats chats with its own templates;
    this one is the model's ChatML text), `disable_gradient_checkpointing: true` (LLaMA-Factory turns it
    on by default; alignkit does not use it). See `SETTINGS_THAT_DIFFER`.
    """
    if stage not in LF_STAGES:
        raise ValueError(f"stage {stage!r}: LLaMA-Factory runs in the benchmark exist for {', '.join(LF_STAGES)}.")
    config: dict[str, Any] = {
        "stage": stage,
        "do_train": True,
        "model_name_or_path": model_dir,
        "finetuning_type": "lora",
        "lora_rank": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "lora_target": "all",
        "dataset": dataset,
        "dataset_dir": dataset_dir,
        "template": TEMPLATE,
        "cutoff_len": cutoff,
        "overwrite_cache": True,
        "preprocessing_num_workers": None,
        "dataloader_num_workers": 0,
        "output_dir": output_dir,
        "overwrite_output_dir": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "plot_loss": False,
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": 1,
        "learning_rate": lr,
        "max_steps": steps,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "seed": seed,
        "disable_gradient_checkpointing": True,
        "bf16": device == "cuda",
        "fp16": False,
    }
    if device == "cpu":
        config["use_cpu"] = True
    if stage == "dpo":
        config.update(pref_beta=0.1, pref_loss="sigmoid")
    if stage == "ppo":
        config.update(reward_model=reward_model or model_dir, reward_model_type="full")
    return config
