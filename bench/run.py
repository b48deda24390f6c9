"""alignkit against TRL 1.16 (and, with `--peer llamafactory`, LLaMA-Factory 0.9.5 in its own environment, see
`bench.llamafactory`), side by side: `python -m bench [--stage sft rm dpo grpo rloo distill online_dpo ppo]
[--model tiny] [--reps 2]`.

For each stage both tools train the same LoRA adapter (r=8, alpha=16, dropout 0, every linear layer but the
head) on the same model, the same generated data (see `bench.workloads`), the same batch, learning rate,
cutoff and number of steps, in fp32 on the CPU (bf16 autocast over fp32 weights with `--device cuda`), with
the same thread count. Every run is a fresh process (`python -m bench.worker`), and the runs alternate
alignkit, TRL default, TRL best, alignkit, ... over `--reps` repetitions, so a slow spell of the machine
touches all of them rather than one. On the CPU, "TRL default" is TRL's own config defaults except `bf16=False`,
and "TRL default bf16" (`trl_default_bf16`) is its real default, `bf16=True` (autocast on the CPU); "TRL best"
adds its faster settings (`bench.worker.TRL_BEST`). `alignkit_qlora` (sft only, `--variants`) is alignkit on a
4-bit base (`bench.worker.QLORA`).

The online stages (grpo, rloo, distill, online_dpo) are measured in completions/s, `--batch` completions per step,
with each step split into sampling and training (`bench.worker.ONLINE_STAGES`).

The machine's limit is measured in the same run: a timed square `torch.mm` loop at the same thread count,
before and after the training runs, in fp32 and (on a CPU) bf16. Model-FLOPs utilisation (MFU) divides each
trainer's model FLOPs per second by the faster of the two measurements in the precision the run computed in.
The report names the CPU and its bf16 features (AVX512-BF16, AMX).

Outputs: `<output-dir>/<name>.json` (everything, including per-step times) and `<name>.md` (the tables,
also printed), by default `bench/results/latest.json` and `latest.md`. Time figures are never asserted by
tests; the report prints each target as met or not met with its figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/run.py`: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llamafactory, workloads  # noqa: E402
from bench.sweep import add_sweep_arguments, finish_sweep_arguments  # noqa: E402
from bench.worker import ONLINE_STAGES, QLORA, TRL_BEST, completions_per_prompt  # noqa: E402

STAGES = ("sft", "rm", "dpo", "grpo", "rloo", "distill", "online_dpo", "ppo", "grpo_tools")
# What a plain `python -m bench` runs (with the TRL peer): the newer online stages are named with --stage.
DEFAULT_STAGES = ("sft", "rm", "dpo", "grpo", "ppo")
# alignkit_qlora: alignkit on a 4-bit base (bench.worker.QLORA); trl_default_bf16: TRL's real default, bf16=True
# (on a CPU, where trl_default is its defaults with bf16=False).
VARIANTS = ("alignkit", "alignkit_qlora", "trl_default", "trl_default_bf16", "trl_best", "llamafactory")
# The peers `--peer` chooses from, and the variants each one adds beside alignkit. On a CPU the TRL peer also runs
# its real default (`trl_default_bf16`); on CUDA trl_default is already bf16.
PEERS = {"trl": ("trl_default", "trl_best"), "llamafactory": ("llamafactory",)}
# Stages each tool's runner in bench/worker.py has. TRL 1.x has no PPO trainer; LLaMA-Factory has no GRPO, and its
# PPO is attempted and fails (see bench.llamafactory.SETTINGS_THAT_DIFFER).
TOOL_STAGES = {"alignkit": ("sft", "rm", "dpo", "grpo", "rloo", "distill", "online_dpo", "ppo", "grpo_tools"),
               "trl": ("sft", "rm", "dpo", "grpo", "rloo", "distill", "online_dpo", "grpo_tools"),
               "llamafactory": llamafactory.LF_STAGES}
# Variants that run only some of their tool's stages.
VARIANT_STAGES = {"alignkit_qlora": ("sft",)}
# Without AVX512-BF16 or AMX, torch multiplies bf16 matrices in a generic loop: 0.3 GFLOP/s against 124 in fp32
# for the 2048^2 probe on a 2-core AVX2 AMD EPYC (2026-12-03), so one step of TRL's bf16 default outlasts the
# run timeout. `--variants trl_default_bf16` still runs it.
NO_BF16_HARDWARE = ("left out: this CPU has no bf16 hardware (AVX512-BF16 or AMX), where torch's bf16 matmul runs "
                    "hundreds of times slower than fp32 (the bf16 probe below), so TRL's real default, bf16=True, "
                    "would not finish a step within the run timeout; `--variants ...,trl_default_bf16` runs it")
# The worker's --variant for each variant key.
WORKER_VARIANT = {"trl_best": "best", "trl_default_bf16": "bf16", "alignkit_qlora": "qlora"}
# (numerator, denominator) of the ratio rows: alignkit against each peer run, QLoRA against fp32 LoRA.
RATIO_PAIRS = [("alignkit", other) for other in VARIANTS if not other.startswith("alignkit")] + [
    ("alignkit_qlora", "alignkit")]
BUNDLED = "smollm2-135m-instruct"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
FIGURES = ("step_time_s", "tokens_per_s", "peak_rss_mb", "peak_gpu_mb", "final_loss", "mfu", "completions_per_s",
           "generation_s", "training_s", "generated_tokens_per_s", "scoring_s", "responses_per_s",
           "response_length_mean", "tool_calls_per_completion", "tool_failure_frequency")
# Benchmark workloads that are an alignkit stage under other keys: `grpo_tools` is `stage: grpo` with `tools`.
ALIGNKIT_STAGE = {"grpo_tools": "grpo"}
RATIO_FIGURES = ("step_time_s", "tokens_per_s", "peak_rss_mb", "peak_gpu_mb", "mfu", "completions_per_s",
                 "generation_s", "training_s")

# (stage, figure, compared variant, bound, sense) — sense "min": alignkit / other >= bound is met; "max": <=.
# Targets on the figure "mfu" compare alignkit's MFU itself (no other variant) with the bound. With --device cuda
# the memory targets compare peak GPU memory (torch.cuda.max_memory_allocated) instead of host RSS.
TARGETS = [
    ("sft", "tokens_per_s", "trl_default", 1.4, "min"),
    ("sft", "tokens_per_s", "trl_best", 1.0, "min"),
    ("sft", "mfu", None, 0.8, "min"),
    ("rm", "step_time_s", "trl_default", 1.0, "max"),
    ("dpo", "step_time_s", "trl_default", 0.7, "max"),
    ("dpo", "step_time_s", "trl_best", 1.0, "max"),
    ("dpo", "peak_rss_mb", "trl_default", 1.0, "max"),
    ("dpo", "peak_rss_mb", "trl_best", 1.0, "max"),
    *[(stage, figure, other, bound, sense) for stage in ("grpo", "rloo", "distill")
      for figure, other, bound, sense in (("completions_per_s", "trl_default", 2.0, "min"),
                                          ("completions_per_s", "trl_best", 1.0, "min"),
                                          ("peak_rss_mb", "trl_default", 1.0, "max"))],
    *[(stage, figure, "llamafactory", bound, sense) for stage in llamafactory.LF_STAGES
      for figure, bound, sense in (("tokens_per_s", 1.5, "min"), ("peak_rss_mb", 1.0, "max"))],
]
# Every ratio held against TRL's defaults in fp32 also holds against its real default, bf16=True (issue 30).
TARGETS += [(stage, figure, "trl_default_bf16", bound, sense) for stage, figure, other, bound, sense in TARGETS
            if other == "trl_default"]


# New tokens per completion (per response for PPO) unless `--max-completion-length` says: 32, and for GRPO with the
# calculator room for a call (~30 tokens), its result (~20) and the answer, so the loop runs whole turns in both
# tools (at 32 every call was cut off before `</tool_call>`, and the turn after it never ran).
COMPLETION_LENGTH = {"grpo_tools": 128}
DEFAULT_COMPLETION_LENGTH = 32


def completion_length(settings: dict[str, Any], stage: str) -> int:
    """The run's completion budget for `stage`: `settings["max_completion_length"]` (an int, or per stage)."""
    value = settings["max_completion_length"]
    return value if isinstance(value, int) else value[stage]


def data_kind(stage: str) -> str:
    """The generated data a stage trains on: `sft`, `pref` (rm, dpo), `prompt` (grpo, rloo: `--num-generations`
    completions per prompt), `distill_prompt` (one completion per prompt), `online_dpo_prompt` (two) or `ppo_prompt`
    (ppo, one response per prompt, for alignkit and for LLaMA-Factory's attempt)."""
    return {"sft": "sft", "grpo": "prompt", "rloo": "prompt", "distill": "distill_prompt",
            "online_dpo": "online_dpo_prompt", "ppo": "ppo_prompt", "grpo_tools": "tool_prompt"}.get(stage, "pref")


# Completions per prompt of each prompt data kind (None: `--num-generations`). `tool_prompt`: arithmetic questions
# that ask for the calculator (`workloads.tool_prompt_rows`); the others share one sequence of generated prompts.
PROMPT_KINDS = {"prompt": None, "distill_prompt": 1, "online_dpo_prompt": 2, "ppo_prompt": 1, "tool_prompt": None}


def tool_of(variant: str) -> str:
    return "trl" if variant.startswith("trl") else "alignkit" if variant.startswith("alignkit") else variant


def alignkit_has_stage(stage: str) -> bool:
    """True when alignkit's stage registry (`alignkit.stages.STAGES`) has the stage and the benchmark runs it."""
    from alignkit.stages import STAGES

    return ALIGNKIT_STAGE.get(stage, stage) in STAGES and stage in TOOL_STAGES["alignkit"]


def resolve_model(model: str, work_dir: Path) -> tuple[str, str]:
    """(name, directory) for `--model`: the bundled default's converted cache, `tiny`, or a local directory."""
    if model == BUNDLED:
        from alignkit.model.bundled import ensure_bundled_model

        return BUNDLED, str(ensure_bundled_model())
    if model == "tiny":
        from alignkit.model.tiny import save_tiny_model

        return "tiny (alignkit.model.tiny: 2 layers, hidden 64)", str(save_tiny_model(work_dir / "tiny_model"))
    if Path(model).is_dir():
        return model, str(Path(model).resolve())
    raise SystemExit(f"--model {model!r}: expected `{BUNDLED}`, `tiny`, or an existing local model directory.")


def prepare_data(model_dir: str, stages: list[str], n_rows: int, cutoff: int, work_dir: Path,
                 num_generations: int = 4) -> dict[str, Any]:
    """Generate, fit to the cutoff, and write each stage's data; returns paths and length statistics per stage.

    `n_rows` = steps x batch. A prompt kind (`PROMPT_KINDS`) gets `n_rows / completions per prompt` prompts (a
    step trains on `batch` completions), so one epoch is exactly the run; prompts are the same generated rows for
    every kind (a prefix of one sequence) and are not fitted: a prompt alone stays far below the cutoff."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out: dict[str, Any] = {}
    for kind in sorted({data_kind(s) for s in stages}):
        if kind in PROMPT_KINDS:  # prompts only: their own templated length is what is reported
            rows = workloads.canonical_rows("tool_prompt" if kind == "tool_prompt" else "prompt",
                                            max(1, n_rows // (PROMPT_KINDS[kind] or num_generations)))
            lengths = [len(tokenizer.apply_chat_template(
                [{"role": "system", "content": r["system"]}, {"role": "user", "content": r["prompt"]}],
                add_generation_prompt=True, tokenize=True)["input_ids"]) for r in rows]
        else:
            rows = workloads.fit_to_cutoff(tokenizer, workloads.canonical_rows(kind, n_rows), cutoff)
            keys = ["response"] if kind == "sft" else ["chosen", "rejected"]
            lengths = [workloads.chat_length(tokenizer, r, k) for r in rows for k in keys]
        paths = workloads.write_datasets(rows, work_dir / "data", f"bench_{kind}")
        paths["rows"] = len(rows)
        paths["chat_tokens"] = {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
                                "total": sum(lengths)}
        out[kind] = paths
    return out


def run_worker(args: list[str], threads: int, timeout: float, log_path: Path,
               python: str | None = None) -> dict[str, Any]:
    """Run `python -m bench.worker ARGS` in a fresh process; returns its JSON line (or a failure record).

    `python` is another environment's interpreter (LLaMA-Factory's); the repository root is then its only
    addition to the import path, so nothing from this environment leaks in."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
    root = Path(__file__).resolve().parents[1]
    if python:
        env["PYTHONPATH"] = str(root)
        env.pop("VIRTUAL_ENV", None)
    command = [python or sys.executable, "-m", "bench.worker", *args]
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f} s", "log": str(log_path)}
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("{")]
    if not lines:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
        return {"ok": False, "error": f"worker exited {proc.returncode} without a result", "stderr_tail": tail,
                "log": str(log_path)}
    result = json.loads(lines[-1])
    result["log"] = str(log_path)
    return result


def spread(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise_stage(runs: list[dict[str, Any]], n_params: int, peak_gflops: float | dict[str, float]) -> dict[str, Any]:
    """Per variant: median and min-max of each figure over the repetitions; MFU per run from its own formula,
    against the matmul probe of the precision the run computed in (`peak_gflops` by "fp32" / "bf16"; a single
    number serves both).

    Example: 4N = 4e8 FLOPs per token at 500 tokens/s is 200 GFLOP/s: MFU 0.5 against an fp32 probe of 400 GFLOP/s
    for an fp32 run, 0.25 against a bf16 probe of 800 GFLOP/s for a bf16 run."""
    peaks = peak_gflops if isinstance(peak_gflops, dict) else {"fp32": peak_gflops, "bf16": peak_gflops}
    summary: dict[str, Any] = {}
    for variant in VARIANTS:
        ok = [r for r in runs if r.get("variant_key") == variant and r.get("ok")]
        if not ok:
            continue
        for r in ok:
            r.setdefault("reference_forward", False)
            flops, _ = workloads.flops_per_token(n_params, lora=True, reference_forward=r["reference_forward"])
            r["flops_per_token"] = flops
            peak = peaks.get(r.get("precision") or "fp32") or float("nan")
            r["mfu_probe_gflops"] = peak
            # On the tokens the model ran: a shared prefix runs once (alignkit's rm/dpo/kto), so its repeats are
            # throughput (tokens_per_s) but not FLOPs.
            per_s = r.get("computed_tokens_per_s") or r.get("tokens_per_s")
            r["mfu"] = flops * per_s / (peak * 1e9) if per_s else None
        summary[variant] = {fig: spread([r.get(fig) for r in ok]) for fig in FIGURES}
        summary[variant]["first_loss"] = spread([r.get("first_loss") for r in ok])
        summary[variant]["setup_s"] = spread([r.get("setup_s") for r in ok])
        counted = [r["tokens_per_step"] for r in ok if None not in r["tokens_per_step"]]
        summary[variant]["tokens_per_step_mean"] = (statistics.mean(statistics.mean(t) for t in counted)
                                                    if counted else None)
        summary[variant]["formula"] = workloads.flops_per_token(
            n_params, lora=True, reference_forward=ok[0]["reference_forward"])[1]
        summary[variant]["precision"] = "/".join(sorted({r.get("precision") or "fp32" for r in ok}))
    ratios: dict[str, Any] = {}
    for mine, other in RATIO_PAIRS:
        if mine not in summary or other not in summary:
            continue
        ratios[f"{mine}/{other}"] = {
            fig: (summary[mine][fig]["median"] / summary[other][fig]["median"]
                  if summary[mine].get(fig) and summary[other].get(fig) and summary[other][fig]["median"]
                  else None)
            for fig in RATIO_FIGURES
        }
    return {"summary": summary, "ratios": ratios}


def check_targets(stages: dict[str, Any], device: str = "cpu",
                  variants: list[str] | None = None) -> list[dict[str, Any]]:
    """Each target with its figures and met / not met (None when a run it needs is missing or failed).

    With `variants` (the runs planned), targets against a peer none of whose runs was planned are left out,
    so a TRL-only report has no LLaMA-Factory rows and the other way round; without it every target is listed."""
    out = []
    planned_tools = None if variants is None else {tool_of(v) for v in variants}
    for stage, figure, other, bound, sense in TARGETS:
        if other is not None and planned_tools is not None and tool_of(other) not in planned_tools:
            continue
        if figure == "peak_rss_mb" and device == "cuda":
            figure = "peak_gpu_mb"
        if stage not in stages:
            continue
        summary = stages[stage]["summary"]
        mine = (summary.get("alignkit") or {}).get(figure)
        if other is None:
            value = mine["median"] if mine else None
            text = f"alignkit MFU {value:.2f}" if value is not None else "alignkit run missing"
            name = f"alignkit {figure} >= {bound} (share of the measured matmul throughput)"
        else:
            theirs = (summary.get(other) or {}).get(figure)
            value = mine["median"] / theirs["median"] if mine and theirs and theirs["median"] else None
            text = (f"alignkit {_fmt(mine['median'])} vs {other} {_fmt(theirs['median'])}: ratio {value:.2f}"
                    if value is not None else "a run is missing or failed")
            name = f"{figure} alignkit/{other} {'>=' if sense == 'min' else '<='} {bound}"
        met = None if value is None else (value >= bound if sense == "min" else value <= bound)
        out.append({"stage": stage, "target": name, "value": value, "figures": text, "met": met})
    return out


# CPU flags that decide how fast bf16 (and fp32) matmuls can be: AVX-512 BF16 dot products, AMX tiles.
BF16_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_features(cpuinfo: str) -> dict[str, Any]:
    """The CPU model and its `BF16_FLAGS` from /proc/cpuinfo text, and whether it has native bf16 matmuls.

    Example: "model name : Intel Xeon\nflags : fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16" gives
    {"cpu": "Intel Xeon", "flags": {"avx2": True, ..., "amx_bf16": True}, "native_bf16": "AMX"}."""
    cpu, flags = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and cpu is None:
            cpu = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    have = {flag: flag in flags for flag in BF16_FLAGS}
    native = "AMX" if have["amx_bf16"] else "AVX512-BF16" if have["avx512_bf16"] else "none"
    return {"cpu": cpu, "flags": have, "native_bf16": native}


def read_cpu_features() -> dict[str, Any]:
    """`cpu_features` of this machine's /proc/cpuinfo (native_bf16 "unknown ..." where there is none)."""
    try:
        return cpu_features(Path("/proc/cpuinfo").read_text())
    except OSError:
        return {"cpu": None, "flags": {}, "native_bf16": "unknown (no /proc/cpuinfo)"}


def native_bf16() -> str:
    """This CPU's native bf16 matmul: "AMX", "AVX512-BF16", "none" or "unknown ..." (`cpu_features`)."""
    return read_cpu_features()["native_bf16"]


def machine_info(threads: int, device: str) -> dict[str, Any]:
    features = read_cpu_features()
    info = {"cpu": features["cpu"] or platform.processor() or "unknown", "cores": os.cpu_count(), "threads": threads,
            "device": device, "cpu_flags": features["flags"], "native_bf16": features["native_bf16"],
            "platform": platform.platform(), "python": platform.python_version()}
    try:
        import torch

        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        pass
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes", "kernels",
                    "alignkit"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    try:
        root = Path(__file__).resolve().parents[1]
        out["alignkit_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                                capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "—"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def _cell(s: dict[str, float] | None, digits: int = 3) -> str:
    if not s:
        return "—"
    if s["n"] > 1 and s["min"] != s["max"]:
        return f"{_fmt(s['median'], digits)} ({_fmt(s['min'], digits)}–{_fmt(s['max'], digits)})"
    return _fmt(s["median"], digits)


def render_markdown(report: dict[str, Any]) -> str:
    """The tables for docs/performance.md."""
    s, m = report["settings"], report["machine"]
    v = report["versions"]
    mem, mem_label = ("peak_gpu_mb", "peak GPU (MB)") if s["device"] == "cuda" else ("peak_rss_mb", "peak RSS (MB)")
    lines = [
        f"Command: `{report['command']}`  ",
        f"Date: {report['date']}; machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, "
        f"device {m['device']}{' (' + m['gpu'] + ')' if m.get('gpu') else ''}; 1-minute load average "
        f"{m['load_average_1min']['before']} before, {m['load_average_1min']['after']} after "
        "(the benchmark's own process adds about 1 while it runs).  ",
        *_cpu_line(m),
        f"Versions: alignkit {v.get('alignkit')} ({v.get('alignkit_commit', '?')}), TRL {v['trl']}, "
        f"transformers {v['transformers']}, peft {v['peft']}, torch {v['torch']}.  ",
        f"Model: {report['model']['name']} (N = {report['model']['matmul_params_causal_lm']:,} matmul weights; "
        f"{report['model']['matmul_params_reward']:,} with the reward head).  ",
        f"Settings: LoRA r=8 alpha=16 dropout 0 on every linear layer but the head; batch {s['batch']}; "
        f"{s['steps']} steps (the first {s['warmup']} not timed); cutoff {s['cutoff']}; lr {s['lr']}; "
        f"{s['precision']}; {s['reps']} repetition(s), alternating; every run a fresh process"
        + (f"; alignkit's runs also set {', '.join(s['alignkit_extra'])} (`--alignkit-extra`, over the settings "
           "above)" if s.get("alignkit_extra") else "") + ".  ",
        f"Data: {report['data_note']}  ",
        *([f"TRL default = TRL {v['trl']} config defaults except {s['trl_default_overrides']}"
           + ("; trl_default_bf16 = its real default, bf16=True (autocast on the CPU)"
              if "trl_default_bf16" in s.get("variants", ()) else "")
           + "".join(f"; {variant} {why}" for variant, why in s.get("left_out", {}).items())
           + "; TRL best adds "
           + "; ".join(f"{st}: {', '.join(f'{k}={val}' for k, val in kv.items())}" for st, kv in TRL_BEST.items())
           + ".  "] if any(tool_of(x) == "trl" for x in s.get("variants", VARIANTS)) else []),
        *([f"alignkit_qlora = alignkit with a 4-bit base ({', '.join(f'{k}: {val}' for k, val in QLORA.items())}; "
           f"bitsandbytes {v.get('bitsandbytes')}, `kernels` package {v.get('kernels')}), sft only.  "]
          if "alignkit_qlora" in s.get("variants", ()) else []),
        *_llamafactory_lines(report),
        f"Machine limit: {report['matmul']['size']}x{report['matmul']['size']} {report['matmul']['dtype']} "
        f"matmul, {_fmt(report['matmul']['gflops'])} GFLOP/s (probes: "
        f"{', '.join(_fmt(g) for g in report['matmul']['probes_gflops'])})"
        + (f"; bfloat16 {_fmt(report['matmul']['bf16']['gflops'])} GFLOP/s (probes: "
           f"{', '.join(_fmt(g) for g in report['matmul']['bf16']['probes_gflops'])})"
           if report["matmul"].get("bf16") else "") + ".  ",
        f"MFU = FLOPs per real token x real tokens/s the model ran / matmul GFLOP/s of the run's precision (bf16 "
        f"when it autocasts to bf16 or its frozen weights are bf16, else fp32), with {report['formula']}. "
        "alignkit's sft, rm, dpo and kto run a prefix shared with an earlier sequence of the batch once: its repeats "
        "count in real tokens/s, not in MFU.",
        "",
        "Figures are medians over the repetitions, (min–max) when they differ. Step time excludes setup "
        "(model load, tokenisation, and TRL's reference precomputation, shown as setup).",
    ]
    if any(stage not in ONLINE_STAGES and stage != "ppo" for stage in report["stages"]):
        lines += ["", f"| stage | run | step time (s) | real tokens/s | tokens/step | {mem_label} | first loss "
                  "| final loss | MFU | setup (s) | precision |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for stage, data in report["stages"].items():
        if stage in ONLINE_STAGES or stage == "ppo":
            continue  # tables of their own below: completions, not training tokens, are what a step produces
        for variant in VARIANTS:
            row = data["summary"].get(variant)
            if row is None:
                failed = [r for r in data["runs"] if r.get("variant_key") == variant and not r.get("ok")]
                if failed:
                    lines.append(f"| {stage} | {variant} | failed: {failed[0].get('error', '?')[:80]} "
                                 "| | | | | | | | |")
                continue
            lines.append(
                f"| {stage} | {variant} | {_cell(row['step_time_s'])} | {_cell(row['tokens_per_s'])} "
                f"| {_fmt(row['tokens_per_step_mean'], 4)} | {_cell(row[mem], 4)} | {_cell(row['first_loss'], 4)} "
                f"| {_cell(row['final_loss'], 4)} | {_cell(row['mfu'], 2)} | {_cell(row['setup_s'])} "
                f"| {row.get('precision', '')} |")
        for name, ratio in data["ratios"].items():
            lines.append(
                f"| {stage} | {name} | {_fmt(ratio['step_time_s'], 2)}x | {_fmt(ratio['tokens_per_s'], 2)}x | "
                f"| {_fmt(ratio[mem], 2)}x | | | {_fmt(ratio['mfu'], 2)}x | | |")
    for stage in ONLINE_STAGES:
        if stage in report["stages"]:
            lines += _online_table(report, stage, mem, mem_label)
    if "ppo" in report["stages"]:
        lines += _ppo_table(report, mem, mem_label)
    lines += ["", "| stage | target | figures | met |", "|---|---|---|---|"]
    for t in report["targets"]:
        verdict = {True: "met", False: "not met", None: "not measured"}[t["met"]]
        lines.append(f"| {t['stage']} | {t['target']} | {t['figures']} | {verdict} |")
    return "\n".join(lines) + "\n"


def _cpu_line(machine: dict[str, Any]) -> list[str]:
    """The CPU's bf16 features, for reading bf16 figures (absent from reports written before they were recorded)."""
    flags = machine.get("cpu_flags")
    if flags is None:
        return []
    have = ", ".join(flag for flag, on in flags.items() if on) or "none of them"
    return [f"CPU features: {have} (of {', '.join(flags)}); native bf16 matmul: {machine.get('native_bf16')}; "
            f"torch CPU capability {machine.get('torch_cpu_capability', '?')}.  "]


def _llamafactory_lines(report: dict[str, Any]) -> list[str]:
    """The LLaMA-Factory peer's versions and the settings that differ from alignkit's runs (when it ran)."""
    lf = report.get("llamafactory")
    if not lf:
        return []
    v = lf["versions"]
    return [f"LLaMA-Factory = llamafactory {v.get('llamafactory')} in its own environment (transformers "
            f"{v.get('transformers')}, peft {v.get('peft')}, trl {v.get('trl')}, torch {v.get('torch')}, accelerate "
            f"{v.get('accelerate')}, datasets {v.get('datasets')}), the same model directory, dataset registry, LoRA, "
            "batch, lr, steps, cutoff, seed and precision (bench/llamafactory.py `lf_config`). Differences: "
            + " ".join(f"{stage}: {text}" for stage, text in lf["settings_that_differ"].items()) + "  "]


# What an online stage's step does, after its sampling, for the table's caption.
ONLINE_STEP = {"grpo": "GRPO (group-normalised advantages, clipped loss, TRL {trl} GRPOTrainer as the peer)",
               "rloo": "RLOO (leave-one-out baseline, KL to the adapter-disabled reference folded into the reward, "
                       "beta 0.05; TRL {trl} RLOOTrainer as the peer)",
               "distill": "On-policy distillation (the teacher, a second frozen copy of the same model, scores the "
                          "student's completions; generalized JSD with beta 1.0; TRL {trl} DistillationTrainer as the "
                          "peer)",
               "online_dpo": "Online DPO (two answers per prompt judged by the reward, DPO loss against the "
                             "adapter-disabled reference; TRL {trl} trl.experimental.online_dpo as the peer)",
               "grpo_tools": "GRPO with a tool (the calculator of examples/tools/calculator.py, at most 2 tool turns "
                             "per completion, Qwen2.5's chat template in both tools; TRL {trl} GRPOTrainer(tools=...) "
                             "as the peer; generation is every turn's sampling call)"}


def _online_table(report: dict[str, Any], stage: str, mem: str, mem_label: str) -> list[str]:
    """An online stage's rows: completions/s and how a step splits between generating and training."""
    s, data = report["settings"], report["stages"][stage]
    per_prompt = completions_per_prompt(stage, s["num_generations"])
    lines = ["", f"{ONLINE_STEP[stage].format(trl=report['versions'].get('trl'))}: {s['batch']} completions per "
             f"step ({s['batch'] // per_prompt} prompts x {per_prompt}), at most {completion_length(s, stage)} new "
             "tokens each, sampling at each tool's default (temperature 1.0; online DPO 0.9), "
             + ("one sampling call per turn of the step's rollout; generation time is those calls summed"
                if stage == "grpo_tools" else "one generation per step; generation time is the sampling call alone")
             + ", training time the rest of the step (log-probs, loss, backward, optimizer).", "",
             f"| run | step time (s) | completions/s | generation (s/step) | training (s/step) | generated tokens/s "
             f"| {mem_label} | first loss | final loss |", "|---|---|---|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        row = data["summary"].get(variant)
        if row is None:
            failed = [r for r in data["runs"] if r.get("variant_key") == variant and not r.get("ok")]
            if failed:
                lines.append(f"| {variant} | failed: {failed[0].get('error', '?')[:80]} | | | | | | | |")
            continue
        lines.append(f"| {variant} ({row.get('precision', '')}) | {_cell(row['step_time_s'])} "
                     f"| {_cell(row['completions_per_s'])} "
                     f"| {_cell(row['generation_s'])} | {_cell(row['training_s'])} "
                     f"| {_cell(row['generated_tokens_per_s'])} | {_cell(row[mem], 4)} | {_cell(row['first_loss'], 4)} "
                     f"| {_cell(row['final_loss'], 4)} |")
    for name, ratio in data["ratios"].items():
        lines.append(f"| {name} | {_fmt(ratio['step_time_s'], 2)}x | {_fmt(ratio['completions_per_s'], 2)}x "
                     f"| {_fmt(ratio['generation_s'], 2)}x | {_fmt(ratio['training_s'], 2)}x | "
                     f"| {_fmt(ratio[mem], 2)}x | | |")
    if stage == "grpo_tools":  # the same workload only if both policies called about as often
        lines += ["", "Tool calls per completion (failed share): " + "; ".join(
            f"{variant} {_cell(row.get('tool_calls_per_completion'))} ({_cell(row.get('tool_failure_frequency'))})"
            for variant, row in data["summary"].items()) + ". A model that never calls measures the schema in the "
            "prompt and the per-turn parsing only: pass `--model DIR` of a model taught the call format."]
    return lines


def _ppo_table(report: dict[str, Any], mem: str, mem_label: str) -> list[str]:
    """PPO rows: step time and its split into generation, scoring and training; which peers ran and why not."""
    s, data = report["settings"], report["stages"]["ppo"]
    lines = ["", f"PPO (LoRA, `stage: ppo` defaults: 4 passes per rollout, value head on the policy): {s['batch']} "
             f"prompts per step, one response each of at most {completion_length(s, 'ppo')} new tokens (temperature "
             "1.0), the reward model a LoRA reward adapter switched in on the same base. Generation is the sampling "
             "call, scoring the reward model plus the rollout's policy, critic and reference passes, training the 4 "
             "passes (backward and optimizer steps).", "",
             f"| run | step time (s) | responses/s | generation (s/step) | scoring (s/step) | training (s/step) "
             f"| response tokens (mean) | {mem_label} | final loss |", "|---|---|---|---|---|---|---|---|---|"]
    for variant, row in data["summary"].items():
        lines.append(f"| {variant} | {_cell(row['step_time_s'])} | {_cell(row['responses_per_s'])} "
                     f"| {_cell(row['generation_s'])} | {_cell(row['scoring_s'])} | {_cell(row['training_s'])} "
                     f"| {_cell(row['response_length_mean'])} | {_cell(row[mem], 4)} | {_cell(row['final_loss'], 4)} |")
    for run in data["runs"]:
        if not run.get("ok"):
            lines.append(f"| {run.get('variant_key')} | failed: {run.get('error', '?')[:80]} | | | | | | | |")
    if not any(k != "alignkit" for k in data["summary"]):
        lines += ["", "No peer ran: TRL 1.16 has no PPO trainer, and LLaMA-Factory 0.9.5's PPO needs trl<=0.9.6 "
                  "while its other imports need trl>=0.18 (ENVIRONMENT.md), so it cannot run in one environment."]
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description="alignkit vs TRL 1.16 and LLaMA-Factory 0.9.5, side by side.")
    p.add_argument("--stage", nargs="+", choices=STAGES, action="extend", default=None,
                   help=f"Stages to run (repeatable; default: those of {', '.join(DEFAULT_STAGES)} that the chosen "
                        "tools have).")
    p.add_argument("--model", default=BUNDLED,
                   help=f"`{BUNDLED}` (default: the bundled model's converted cache), `tiny`, or a local directory.")
    p.add_argument("--reps", type=int, default=2, help="Repetitions of each run (alternating tools).")
    p.add_argument("--steps", type=int, default=6, help="Optimisation steps per run.")
    p.add_argument("--warmup", type=int, default=2, help="Leading steps left out of the timings.")
    p.add_argument("--batch", type=int, default=8, help="Examples (pairs for rm/dpo) per step, in both tools.")
    p.add_argument("--cutoff", type=int, default=256, help="Max tokens per conversation; data is fitted to it.")
    p.add_argument("--lr", type=float, default=1e-4, help="Learning rate, in both tools.")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every process.")
    p.add_argument("--num-generations", type=int, default=4,
                   help="GRPO, RLOO: completions per prompt (--batch completions per step, so batch/this prompts; "
                        "distill: 1 per prompt; online_dpo: 2).")
    p.add_argument("--max-completion-length", type=int, default=None,
                   help=f"Online stages: most new tokens per completion; PPO: per response (default "
                        f"{DEFAULT_COMPLETION_LENGTH}; grpo_tools {COMPLETION_LENGTH['grpo_tools']}).")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: bf16 autocast (bf16=True) in both tools, bf16 matmul probe. cpu: fp32, plus TRL's real "
                        "default (bf16=True) as trl_default_bf16, and fp32 and bf16 matmul probes.")
    p.add_argument("--alignkit-bf16", choices=["false", "true", "auto"], default="auto",
                   help="cpu: alignkit's `bf16` key in its runs (auto, its default: its own per-machine choice, a "
                        "probe at the model's shapes; false: fp32, as TRL's fp32 runs; true: bf16 autocast). MFU "
                        "follows the precision each run used.")
    p.add_argument("--alignkit-extra", nargs="+", default=[], metavar="KEY=VALUE",
                   help="alignkit's runs only: training keys added to its settings (e.g. gradient_checkpointing=true), "
                        "recorded in the report's settings.")
    p.add_argument("--peer", nargs="+", choices=sorted(PEERS), action="extend", default=None,
                   help="Peers to compare alignkit with (repeatable; default: trl). `llamafactory` creates "
                        "LLaMA-Factory's own environment the first time (bench/llamafactory.py).")
    p.add_argument("--variants", default=None,
                   help=f"Comma-separated subset of {', '.join(VARIANTS)} (default: alignkit and the --peer runs).")
    p.add_argument("--matmul-size", type=int, default=None, help="Probe matrix size (default 2048; 8192 on cuda).")
    p.add_argument("--matmul-seconds", type=float, default=4.0, help="Seconds per matmul probe.")
    p.add_argument("--run-timeout", type=float, default=900.0, help="Seconds before a run is abandoned.")
    p.add_argument("--output-dir", default=str(RESULTS_DIR), help="Where <name>.json and <name>.md go.")
    p.add_argument("--name", default="latest", help="Base name of the output files.")
    p.add_argument("--work-dir", default=None, help="Data, logs, tiny model (default: a temporary directory).")
    p.add_argument("--dry-run", action="store_true", help="Print the plan (runs, settings) and exit.")
    add_sweep_arguments(p)
    opts = p.parse_args(argv)
    opts.peer = list(dict.fromkeys(opts.peer or ["trl"]))
    opts.left_out = {}
    if opts.variants is None:
        opts.variants = ["alignkit", *[v for peer in opts.peer for v in PEERS[peer]]]
        if opts.device == "cpu" and "trl_default" in opts.variants:  # TRL's real default, bf16=True, beside fp32
            if native_bf16() == "none":
                opts.left_out["trl_default_bf16"] = NO_BF16_HARDWARE
            else:
                opts.variants.insert(opts.variants.index("trl_default") + 1, "trl_default_bf16")
    else:
        opts.variants = [v.strip() for v in opts.variants.split(",") if v.strip()]
    unknown = set(opts.variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}.")
    bad = [item for item in opts.alignkit_extra if "=" not in item or not item.partition("=")[0]]
    if bad:
        p.error(f"--alignkit-extra: {', '.join(bad)} is not KEY=VALUE (e.g. gradient_checkpointing=true).")
    if opts.warmup >= opts.steps:
        p.error(f"--warmup {opts.warmup} must be smaller than --steps {opts.steps}: no step would be timed.")
    if opts.matmul_size is None:
        opts.matmul_size = 8192 if opts.device == "cuda" else 2048
    if opts.sweep:
        finish_sweep_arguments(opts, p, sys.argv[1:] if argv is None else argv)
    return opts


def plan_runs(opts: argparse.Namespace, stages: list[str], available: dict[str, bool]) -> list[tuple[str, int, str]]:
    """(stage, rep, variant) in execution order: per stage, the variants alternate within each repetition.

    A variant whose tool has no runner for the stage (`TOOL_STAGES`; alignkit: `available`) is left out."""
    plan = []
    for stage in stages:
        for rep in range(opts.reps):
            for variant in opts.variants:
                if variant == "alignkit" and not available[stage]:
                    continue
                if variant != "alignkit" and stage not in TOOL_STAGES[tool_of(variant)]:
                    continue
                if stage not in VARIANT_STAGES.get(variant, (stage,)):
                    continue
                plan.append((stage, rep, variant))
    return plan


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.sweep:
        from bench.sweep import run_sweep

        return run_sweep(opts, argv)
    command = "python -m bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    available = {s: alignkit_has_stage(s) for s in STAGES}
    # Default stages: those a chosen peer runs (TRL: sft rm dpo grpo; LLaMA-Factory: sft rm dpo and its ppo
    # attempt), or alignkit's when it runs alone.
    peer_stages = {s for v in opts.variants if tool_of(v) != "alignkit" for s in TOOL_STAGES[tool_of(v)]}
    stages = (list(dict.fromkeys(opts.stage)) if opts.stage
              else [s for s in DEFAULT_STAGES if s in peer_stages] if peer_stages
              else [s for s in DEFAULT_STAGES if available[s]])
    lf_wanted = "llamafactory" in opts.variants
    if not stages:
        raise SystemExit("no alignkit stage is available yet; name stages with --stage to benchmark TRL alone.")
    for stage in stages:
        if stage in ONLINE_STAGES and opts.batch % completions_per_prompt(stage, opts.num_generations):
            group = completions_per_prompt(stage, opts.num_generations)
            raise SystemExit(f"--batch {opts.batch} must be a multiple of {group} for stage {stage} "
                             f"({'--num-generations' if stage in ('grpo', 'rloo', 'grpo_tools') else 'its answers per prompt'}): "
                             "a step trains on whole groups of completions.")
    lengths = {stage: opts.max_completion_length or COMPLETION_LENGTH.get(stage, DEFAULT_COMPLETION_LENGTH)
               for stage in stages if stage in ONLINE_STAGES or stage == "ppo"}
    plan = plan_runs(opts, stages, available)
    if opts.dry_run:
        dry: dict[str, Any] = {"stages": stages, "alignkit_available": available, "device": opts.device,
                               "bf16": opts.device == "cuda", "alignkit_bf16": opts.alignkit_bf16, "peers": opts.peer,
                               "runs": plan, "left_out": opts.left_out}
        if lf_wanted:
            venv = llamafactory.default_venv_dir()
            dry["llamafactory"] = {
                "venv": str(venv), "installed": llamafactory.read_stamp(venv) is not None,
                "configs": {stage: llamafactory.lf_config(
                    stage, model_dir="<model dir>", dataset=f"bench_{data_kind(stage)}",
                    dataset_dir="<work dir>/data", output_dir="<run dir>/out", batch=opts.batch, steps=opts.steps,
                    lr=opts.lr, cutoff=opts.cutoff, device=opts.device)
                    for stage in stages if stage in llamafactory.LF_STAGES},
                "settings_that_differ": llamafactory.SETTINGS_THAT_DIFFER}
        print(json.dumps(dry, indent=1))
        return 0

    work_dir = Path(opts.work_dir or tempfile.mkdtemp(prefix="alignkit-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "logs").mkdir(exist_ok=True)
    started = time.time()
    lf_env = None
    if lf_wanted:  # before any measurement: the first time this installs LLaMA-Factory's environment
        lf_env = llamafactory.ensure_venv(log=lambda line: print(line, file=sys.stderr, flush=True))
    model_name, model_dir = resolve_model(opts.model, work_dir)
    n_rows = opts.steps * opts.batch  # one epoch is exactly the run, so a precomputation covers only used rows
    data = prepare_data(model_dir, stages, n_rows, opts.cutoff, work_dir, opts.num_generations)
    n_causal = workloads.matmul_params(model_dir, "causal_lm")
    n_reward = workloads.matmul_params(model_dir, "reward")

    # fp32 on a CPU (bf16 on CUDA) is the probe MFU used to be measured against; a CPU also gets a bf16 probe,
    # against which the runs that compute in bf16 (TRL's real default) are measured.
    probe_dtypes = ["bfloat16"] if opts.device == "cuda" else ["float32", "bfloat16"]

    def probe(tag: str) -> dict[str, Any]:
        results = {}
        for dtype in probe_dtypes:
            result = run_worker(["--matmul", "--threads", str(opts.threads), "--device", opts.device,
                                 "--matmul-size", str(opts.matmul_size), "--matmul-seconds", str(opts.matmul_seconds),
                                 "--matmul-dtype", dtype],
                                opts.threads, opts.run_timeout, work_dir / "logs" / f"matmul_{dtype}_{tag}.log")
            print(f"[bench] matmul {dtype} {tag}: {result.get('matmul_gflops', float('nan')):.1f} GFLOP/s",
                  file=sys.stderr)
            results[dtype] = result
        return results

    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"[bench] warning: 1-minute load average is {load_before:.1f} before the first run; other programs "
              "share the CPU and the figures will be noisy. Measure alone.", file=sys.stderr)
    probes = [probe("before")]
    runs: list[dict[str, Any]] = []
    # Each finished run's result, as it comes: a benchmark that dies before its report (a 33-minute run on
    # 2026-12-03 ended without one, no traceback) leaves the figures of every run it finished.
    record = work_dir / "runs.jsonl"
    print(f"[bench] each finished run's result goes to {record}", file=sys.stderr, flush=True)
    for i, (stage, rep, variant) in enumerate(plan, 1):
        kind = data_kind(stage)
        tool = tool_of(variant)
        args = ["--tool", tool, "--variant", WORKER_VARIANT.get(variant, "default"), "--stage", stage,
                "--model-dir", model_dir, "--steps", str(opts.steps), "--warmup", str(opts.warmup),
                "--batch", str(opts.batch), "--cutoff", str(opts.cutoff), "--lr", str(opts.lr),
                "--threads", str(opts.threads), "--device", opts.device]
        if tool == "alignkit":
            args += ["--alignkit-bf16", opts.alignkit_bf16]
            if opts.alignkit_extra:
                args += ["--extra", *opts.alignkit_extra]
        if stage == "ppo":
            args += ["--max-completion-length", str(lengths[stage])]
        if stage in ONLINE_STAGES:
            args += ["--num-generations", str(opts.num_generations),
                     "--max-completion-length", str(lengths[stage])]
        if tool in ("alignkit", "llamafactory"):  # both read the same dataset_info.json registry
            args += ["--alignkit-dataset", data[kind]["alignkit_dataset"],
                     "--alignkit-dataset-dir", data[kind]["alignkit_dataset_dir"]]
        else:
            args += ["--trl-file", data[kind]["trl_file"]]
        print(f"[bench] {i}/{len(plan)} {stage} rep {rep + 1} {variant} ...", file=sys.stderr, flush=True)
        result = run_worker(args, opts.threads, opts.run_timeout, work_dir / "logs" / f"{stage}_{variant}_{rep}.log",
                            python=lf_env["python"] if tool == "llamafactory" else None)
        result.update(variant_key=variant, rep=rep, stage=stage,
                      reference_forward=stage == "dpo" and variant != "trl_best")
        rate = (f"{result['completions_per_s']:.2f} completions/s" if stage in ONLINE_STAGES
                else f"{result['responses_per_s']:.2f} responses/s" if stage == "ppo"
                else f"{result.get('tokens_per_s') or 0:.0f} tok/s") if result.get("ok") else ""
        status = (f"{result['step_time_s']:.2f} s/step, {rate}, {result['peak_rss_mb']:.0f} MB"
                  if result.get("ok") else f"FAILED: {result.get('error')}")
        print(f"[bench]   {status}", file=sys.stderr, flush=True)
        runs.append(result)
        with record.open("a", encoding="utf-8") as out:
            out.write(json.dumps(result) + "\n")
    probes.append(probe("after"))
    load_after = os.getloadavg()[0]

    measured = {dtype: [p[dtype]["matmul_gflops"] for p in probes if p[dtype].get("ok")] for dtype in probe_dtypes}
    best = {dtype: max(g) if g else float("nan") for dtype, g in measured.items()}
    main_dtype = probe_dtypes[0]
    # CUDA runs are all bf16 autocast: one probe serves both names.
    peaks = {"fp32": best[main_dtype], "bf16": best["bfloat16"]}
    stage_reports = {}
    for stage in stages:
        stage_runs = [r for r in runs if r["stage"] == stage]
        n = n_reward if stage == "rm" else n_causal
        stage_reports[stage] = {"matmul_params": n, "runs": stage_runs, **summarise_stage(stage_runs, n, peaks)}
    precision = ("bf16 autocast over fp32 weights" if opts.device == "cuda" else
                 "fp32" + (f" (alignkit: bf16={opts.alignkit_bf16})" if opts.alignkit_bf16 != "false" else "")
                 + (" (trl_default_bf16: TRL's bf16=True autocast)" if "trl_default_bf16" in opts.variants else ""))
    report = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "wall_s": round(time.time() - started, 1),
        "machine": {**machine_info(opts.threads, opts.device),
                    "load_average_1min": {"before": round(load_before, 2), "after": round(load_after, 2)}},
        "versions": versions(),
        "model": {"name": model_name, "path": model_dir, "matmul_params_causal_lm": n_causal,
                  "matmul_params_reward": n_reward},
        "settings": {"steps": opts.steps, "warmup": opts.warmup, "batch": opts.batch, "cutoff": opts.cutoff,
                     "lr": opts.lr, "reps": opts.reps, "threads": opts.threads, "device": opts.device,
                     "num_generations": opts.num_generations, "max_completion_length": lengths,
                     "precision": precision, "alignkit_bf16": opts.alignkit_bf16,
                     "alignkit_extra": opts.alignkit_extra,
                     "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target": "all linear",
                              **({"note": "alignkit_extra overrides these for alignkit's runs where it sets them"}
                                 if opts.alignkit_extra else {})},
                     "variants": opts.variants, "left_out": opts.left_out,
                     "trl_default_overrides": "bf16=True" if opts.device == "cuda" else "bf16=False",
                     "trl_best": TRL_BEST},
        "data": data,
        "data_note": (f"generated deterministically (bench/workloads.py), {n_rows} rows per stage = steps x batch, "
                      "chat-formatted by the model's own template in both tools, fitted so nothing is truncated; "
                      + "; ".join(f"{k}: {v['chat_tokens']['min']}–{v['chat_tokens']['max']} tokens, "
                                  f"median {v['chat_tokens']['median']:.0f}" for k, v in data.items()) + "."),
        "matmul": {"size": opts.matmul_size, "dtype": main_dtype, "probes_gflops": measured[main_dtype],
                   "gflops": best[main_dtype],
                   **({"bf16": {"probes_gflops": measured["bfloat16"], "gflops": best["bfloat16"]}}
                      if main_dtype != "bfloat16" else {})},
        "formula": ("FLOPs per real token = 4N for LoRA training (2N forward + 2N backward, no weight gradients "
                    "for frozen weights; 6N would be full fine-tuning), + 2N for DPO's reference forward when it "
                    "runs inside the step (not with TRL's precompute_ref_log_probs); N = weights in matmuls "
                    "(linear layers + LM or score head, not the embedding lookup)"),
        "stages": stage_reports,
    }
    if lf_env:
        report["llamafactory"] = {"versions": lf_env["versions"], "venv": str(Path(lf_env["python"]).parents[1]),
                                  "install_steps": lf_env["steps"], "install_s": lf_env["install_s"],
                                  "settings_that_differ": llamafactory.SETTINGS_THAT_DIFFER}
    report["targets"] = check_targets(stage_reports, opts.device, opts.variants)
    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(report)
    (out_dir / f"{opts.name}.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    (out_dir / f"{opts.name}.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    print(f"[bench] wrote {out_dir / (opts.name + '.json')} and .md in {report['wall_s']:.0f} s; logs in "
          f"{work_dir / 'logs'}", file=sys.stderr)
    return 0 if all(r.get("ok") for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
