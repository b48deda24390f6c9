"""Cost curves of the online stages: `python -m bench --sweep --stage grpo ppo [--quick]`.

Two axes, as `bench.sweep` has for sft and dpo:

- completion length: at most L = 32 ... 512 new tokens per completion (`--sweep-lengths`), at the first number of
  generations of the other axis;
- generations: `num_generations` G = 4, 8, 16 (`--sweep-generations`) at the first length, `--sweep-prompts`
  prompts per step (2), so a GRPO step samples and trains on 2 x G completions. PPO samples one response per
  prompt and has no `num_generations`: its point G takes 2 x G prompts, the same completions per step.

GRPO runs alignkit against TRL 1.16 (its best settings, `bench.worker.TRL_BEST`, unless `--variants` says
otherwise); PPO runs alignkit alone (TRL 1.x has no PPO trainer). Every point is one fresh process per tool
(`bench.worker`, as in `python -m bench`), `--steps` steps of which the first `--warmup` are not timed. Sampling
stops at the end-of-sequence token, so a completion may be shorter than L: each point records the tokens actually
generated per step, and the linear fits (time and peak memory against generated tokens per step, along each axis)
use those, not L.

Outputs in `--output-dir` (default `bench/results/`): `<sweep-name>.json` (default `sweep_online.json`), `.md`
(the table and the fits), `_time.png` and `_memory.png` (against L on the left, against G on the right). Points
already in the JSON with the same settings are kept, and `--sweep-budget-s` stops starting new points, as in
`bench.sweep`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import workloads
from bench.sweep import close_sweep, linear_fit, open_sweep, plot_two_axes, run_points, worker_variant_args

ONLINE_SWEEP_STAGES = ("grpo", "ppo")
LENGTHS = (32, 64, 128, 256, 512)
GENERATIONS = (4, 8, 16)
PROMPTS = 2
QUICK = {"lengths": (8, 16), "generations": (2, 4), "prompts": 2}


def online_points(lengths: tuple[int, ...], generations: tuple[int, ...], prompts: int,
                  stages: list[str]) -> list[dict[str, Any]]:
    """The grid: one entry per (stage, length, generations); the point on both axes is listed once with both.

    `completions` is what a step samples: prompts x G for GRPO; PPO takes prompts x G prompts of one response.
    Example: lengths (32, 64), generations (4, 8), 2 prompts, grpo: (32, 4) on both axes, (64, 4) on the length
    axis, (32, 8) on the generations axis, with 8, 8 and 16 completions per step.
    """
    out: dict[tuple[str, int, int], dict[str, Any]] = {}
    for stage in stages:
        for length in lengths:
            out.setdefault((stage, length, generations[0]), {"stage": stage, "length": length,
                                                             "generations": generations[0], "axes": []})["axes"].append(
                "length")
        for g in generations:
            out.setdefault((stage, lengths[0], g), {"stage": stage, "length": lengths[0], "generations": g,
                                                    "axes": []})["axes"].append("generations")
    for point in out.values():
        point["completions"] = prompts * point["generations"]
    return list(out.values())


def worker_args(point: dict[str, Any]) -> list[str]:
    """The point's `bench.worker` arguments beyond the shared ones: `--batch` counts completions for GRPO (G per
    prompt) and prompts for PPO (one response each), so both sample `completions` per step."""
    args = ["--batch", str(point["completions"]), "--max-completion-length", str(point["length"])]
    if point["stage"] == "grpo":
        args += ["--num-generations", str(point["generations"])]
    return args


def generated_per_step(run: dict[str, Any], completions: int) -> float | None:
    """Tokens generated per measured step: GRPO records them per generation call; PPO its mean response length."""
    if run.get("generated_tokens_per_step"):
        measured = run["generated_tokens_per_step"][run["steps"] - run["measured_steps"]:run["steps"]]
        return sum(measured) / len(measured) if measured else None
    if run.get("response_length_mean") is not None:
        return run["response_length_mean"] * completions
    return None


def _key(point: dict[str, Any], variant: str) -> str:
    return f"{point['stage']} L{point['length']} G{point['generations']} {variant}"


def variants_for(stage: str, variants: list[str]) -> list[str]:
    """PPO has no TRL runner: alignkit alone."""
    return ["alignkit"] if stage == "ppo" else variants


def run_online_sweep(opts, argv: list[str] | None) -> int:
    """`python -m bench --sweep --stage grpo ppo`: the missing points, then the table, fits and plots; 0 when
    complete, 3 when the budget stopped it (call again to go on), 1 when a run failed."""
    stages = [s for s in opts.stage if s in ONLINE_SWEEP_STAGES]

    def settings_of(model_name: str) -> dict[str, Any]:
        return {"model": model_name, "steps": opts.steps, "warmup": opts.warmup, "lr": opts.lr,
                "threads": opts.threads, "stages": stages, "lengths": list(opts.sweep_lengths),
                "generations": list(opts.sweep_generations), "prompts": opts.sweep_prompts,
                "variants": opts.variants, "device": opts.device}

    report, json_path, work_dir, model_dir = open_sweep(opts, argv, settings_of, "alignkit-sweep-online-")
    grid = online_points(opts.sweep_lengths, opts.sweep_generations, opts.sweep_prompts, stages)
    report["grid"] = grid
    # Shortest and smallest first, so a sweep cut short by its budget has the start of every curve.
    todo = []
    for point in sorted(grid, key=lambda p: (p["length"] * p["completions"], p["stage"])):
        # GRPO: steps x prompts prompts (G completions each); PPO: steps x completions prompts (one response each).
        n_prompts = opts.steps * (opts.sweep_prompts if point["stage"] == "grpo" else point["completions"])
        data_dir = work_dir / "data" / f"prompt_{n_prompts}"
        for variant in variants_for(point["stage"], opts.variants):
            if _key(point, variant) in report["runs"]:
                continue
            if not (data_dir / "done").exists():
                workloads.write_datasets(workloads.canonical_rows("prompt", n_prompts), data_dir, "sweep_prompt")
                (data_dir / "done").write_text("")
            args = [*worker_variant_args(variant, point["stage"]), *worker_args(point)]
            args += (["--alignkit-dataset", "sweep_prompt", "--alignkit-dataset-dir", str(data_dir)]
                     if variant == "alignkit" else ["--trl-file", str(data_dir / "sweep_prompt.trl.jsonl")])
            todo.append((_key(point, variant), args, {"stage": point["stage"], "length": point["length"],
                                                      "generations": point["generations"],
                                                      "completions": point["completions"], "variant": variant}))
    failed, stopped = run_points(opts, report, json_path, work_dir, model_dir, todo)
    for run in report["runs"].values():
        if run.get("ok"):
            run["generated_tokens_per_measured_step"] = generated_per_step(run, run["completions"])
    report["complete"] = all(_key(p, v) in report["runs"] for p in grid for v in variants_for(p["stage"], opts.variants))
    report["fits"] = online_fits(report)
    return close_sweep(opts, report, json_path, work_dir, render_online_sweep(report), plot_online_sweep, failed,
                       stopped)


def _axis_runs(report: dict[str, Any], stage: str, variant: str, axis: str) -> list[dict[str, Any]]:
    s = report["settings"]
    runs = [r for r in report["runs"].values() if r.get("ok") and r["stage"] == stage and r["variant"] == variant]
    if axis == "length":
        return [r for r in runs if r["generations"] == s["generations"][0] and r["length"] in s["lengths"]]
    return [r for r in runs if r["length"] == s["lengths"][0] and r["generations"] in s["generations"]]


def online_fits(report: dict[str, Any]) -> dict[str, Any]:
    """Per stage, tool and axis: step time and peak RSS against thousands of generated tokens per step
    (`bench.sweep.linear_fit`: intercept, slope per 1k tokens, largest relative residual). Linear growth shows as
    small residuals; the slope is the cost of 1k more generated tokens."""
    fits: dict[str, Any] = {}
    for stage in report["settings"]["stages"]:
        for variant in variants_for(stage, report["settings"]["variants"]):
            for axis in ("length", "generations"):
                runs = [r for r in _axis_runs(report, stage, variant, axis)
                        if r.get("generated_tokens_per_measured_step")]
                xs = [r["generated_tokens_per_measured_step"] / 1000 for r in runs]
                fits[f"{stage} {variant} {axis}"] = {
                    "step_time_s": linear_fit(xs, [r["step_time_s"] for r in runs]),
                    "peak_rss_mb": linear_fit(xs, [r["peak_rss_mb"] for r in runs])}
    return fits


def render_online_sweep(report: dict[str, Any]) -> str:
    """The table (markdown): one row per point, each tool's step time, its generation/training split, tokens
    generated per step and peak RSS; then the linear fits."""
    s, v, m = report["settings"], report["versions"], report["machine"]
    lines = [
        f"Command: `{report['command']}`  ",
        f"Date: {report.get('date')}; machine: {m['cpu']}, {m['cores']} cores, {s['threads']} threads; "
        f"alignkit {v.get('alignkit')} ({v.get('alignkit_commit', '?')}), TRL {v['trl']}, transformers "
        f"{v['transformers']}, torch {v['torch']}.  ",
        f"Model: {s['model']}; LoRA r=8 alpha=16 on every linear layer but the head; alignkit at its `bf16: auto` "
        f"default (on a CPU with bf16 units it may choose bf16), TRL in fp32; {s['steps']} steps per run, "
        f"the first {s['warmup']} not timed; every run a fresh process. Length axis: at most L new tokens per "
        f"completion at G = {s['generations'][0]}; generations axis: G completions per prompt (GRPO; PPO: as many "
        f"prompts, one response each) at L = {s['lengths'][0]}, {s['prompts']} prompts per step. Sampling at "
        "temperature 1.0 stops at the end-of-sequence token, so generated tokens per step (the column) may be below "
        "completions x L. GRPO: the stage's defaults against TRL's GRPOTrainer; PPO: alignkit alone, 4 passes per "
        "rollout, the reward a LoRA reward adapter on the same base.",
        "",
        "| stage | axis | L | G | completions/step | run | step time (s) | generation (s) | training (s) "
        "| generated tokens/step | peak RSS (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for point in report["grid"]:
        for variant in variants_for(point["stage"], s["variants"]):
            r = report["runs"].get(_key(point, variant))
            head = (f"| {point['stage']} | {'+'.join(point['axes'])} | {point['length']} | {point['generations']} "
                    f"| {point['completions']} | {variant} |")
            if r is None:
                lines.append(head + " not run | | | | |")
            elif not r.get("ok"):
                lines.append(head + f" failed: {str(r.get('error'))[:60]} | | | | |")
            else:
                generated = r.get("generated_tokens_per_measured_step")
                lines.append(head + f" {r['step_time_s']:.2f} | {r.get('generation_s', 0):.2f} "
                             f"| {r.get('training_s', 0):.2f} | {generated:.0f} | {r['peak_rss_mb']:.0f} |"
                             if generated is not None else head + f" {r['step_time_s']:.2f} | | | | "
                             f"{r['peak_rss_mb']:.0f} |")
    fits = report.get("fits") or {}
    if fits:
        lines += ["", "| stage / tool / axis | step time against generated tokens | peak RSS against generated tokens |",
                  "|---|---|---|"]
        for name, fit in fits.items():
            cells = []
            for figure, unit in (("step_time_s", "s"), ("peak_rss_mb", "MB")):
                line = fit[figure]
                cells.append(f"{line['intercept']:.1f} {unit} + {line['slope']:.2f} {unit} per 1k tokens (largest "
                             f"residual {100 * line['max_relative_residual']:.0f}%)" if line else "—")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if not report.get("complete"):
        lines += ["", "Incomplete: some points have not run yet (rerun the command to go on)."]
    return "\n".join(lines) + "\n"


def plot_online_sweep(report: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    """`<name>_time.png` and `<name>_memory.png`: against L (left) and G (right), log scales."""
    s = report["settings"]

    def curves(figure):
        for stage in s["stages"]:
            for variant in variants_for(stage, s["variants"]):
                style = {"marker": "o" if stage == "grpo" else "s", "linestyle": "-" if variant == "alignkit" else "--"}
                for panel, axis in ((0, "length"), (1, "generations")):
                    yield panel, f"{stage} {variant}", style, [(r[axis], r[figure])
                                                               for r in _axis_runs(report, stage, variant, axis)]

    return plot_two_axes(out_dir, name, ((f"max completion length L (G = {s['generations'][0]})", s["lengths"]),
                                         (f"generations G ({s['prompts']} prompts, L = {s['lengths'][0]})",
                                          s["generations"])),
                         f"online stages, {s['model']}, {s['threads']} threads", curves)


__all__ = ["online_points", "worker_args", "generated_per_step", "online_fits", "render_online_sweep",
           "plot_online_sweep", "run_online_sweep"]
