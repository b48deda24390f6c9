"""Cost curves: `python -m bench --sweep [--quick]`: step time and peak memory as the work grows.

Two axes, for sft and dpo, alignkit against TRL (by default TRL's best settings, `bench.worker.TRL_BEST`,
the stronger peer; `--variants` adds `trl_default`):

- length: every sequence exactly L tokens, L = 128 ... 2048, at a fixed number of sequences x length per step
  (`--sweep-tokens`, 2048 by default: SFT batch 2048 / L, and as many DPO pairs, so a DPO step holds twice
  the tokens, chosen and rejected);
- batch: a fixed length (`--sweep-batch-length`, 128) and batch 1 ... 32 (so tokens per step grow with it).

Every point is one fresh process per tool (`bench.worker`, as in `python -m bench`), trained for `--steps`
steps of which the first `--warmup` are not timed. The data of a point is generated (`bench.workloads`) and
then made *exactly* L tokens long under the model's own chat template (`exact_length_rows`), so the
sequence length is the one on the axis and not a spread around it.

Outputs in `--output-dir` (default `bench/results/`): `sweep.json` (every point, every run), `sweep.md`
(the table, also printed), `sweep_time.png` and `sweep_memory.png` (each: against length on the left,
against batch on the right; log scales). Points already in `sweep.json` with the same settings are kept
and skipped, so a sweep longer than one sitting runs in pieces: `--sweep-budget-s` stops starting new
points after that many seconds, and the next call goes on where it stopped (`--fresh` starts over).

Cost on the 2-core development CPU with the defaults (2 steps, 1 timed; alignkit and TRL best): about 35
minutes in all at 2 threads on a quiet machine (the length axis about 6 minutes for sft and 12 for dpo, the
batch axis the rest, most of it batch 32); run it in pieces of `--sweep-budget-s 660` under the heavy-job lock.
`--quick` uses the tiny model and a small grid (a smoke test, a minute or two).

`--stage grpo ppo` sweeps the online stages instead, over completion length and number of generations
(`bench.sweep_online`).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import workloads

SWEEP_STAGES = ("sft", "dpo")
LENGTHS = (128, 256, 512, 1024, 2048)
BATCHES = (1, 4, 16, 32)
QUICK = {"lengths": (128, 256), "batches": (1, 2, 4), "tokens": 256, "batch_length": 128}
# Words appended one at a time to bring an answer up to the exact length; the first one that adds exactly the
# missing token is kept (most byte-level BPE vocabularies have " a" as one token, small ones may not).
_FILLERS = (" a", " the", " and", " of", " to", ".", "!", "a")


def points(lengths: tuple[int, ...], batches: tuple[int, ...], tokens: int, batch_length: int,
           stages: list[str]) -> list[dict[str, Any]]:
    """The grid: one entry per (stage, length, batch); a batch-axis point that is also a length-axis point is
    listed once with both axes. On the length axis the batch (SFT rows, DPO pairs) is `tokens // length`.

    Example: lengths (128, 256), batches (1, 32), tokens 4096, batch length 128: sft and dpo each get (128, 32)
    on both axes, (256, 16) on the length axis and (128, 1) on the batch axis.
    """
    out: dict[tuple[str, int, int], dict[str, Any]] = {}
    for stage in stages:
        for length in lengths:
            batch = max(1, tokens // length)
            out.setdefault((stage, length, batch), {"stage": stage, "length": length, "batch": batch,
                                                    "axes": []})["axes"].append("length")
        for batch in batches:
            out.setdefault((stage, batch_length, batch), {"stage": stage, "length": batch_length, "batch": batch,
                                                          "axes": []})["axes"].append("batch")
    return list(out.values())


def exact_length_rows(tokenizer, kind: str, n: int, length: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` canonical rows (`workloads.canonical_rows`) whose chat-formatted conversations are exactly `length` tokens.

    Each answer (the response; chosen and rejected for `kind="pref"`) is first lengthened with more sentences
    of the same generator, trimmed word by word until the conversation fits, then topped up one filler word at
    a time. Prompts longer than half the length are trimmed first, so every row keeps a real answer.

    Raises:
        ValueError: when no filler word reaches the exact length under this tokenizer.
    """
    import random

    rng = random.Random(f"alignkit-sweep-{kind}-{seed}-{length}")
    rows = workloads.fit_to_cutoff(tokenizer, workloads.canonical_rows(kind, n, seed), length // 2)
    keys = ["response"] if kind == "sft" else ["chosen", "rejected"]
    out = []
    for index, row in enumerate(rows):
        row = dict(row)
        for key in keys:
            # Enough words to overshoot (about 1.3 tokens a word), then the longest prefix that fits.
            words = (row[key] + " " + workloads._sentences(rng, length)).split()
            low, high = 1, len(words)
            while low < high:
                middle = (low + high + 1) // 2
                row[key] = " ".join(words[:middle])
                if workloads.chat_length(tokenizer, row, key) <= length:
                    low = middle
                else:
                    high = middle - 1
            row[key] = " ".join(words[:low])
            while (have := workloads.chat_length(tokenizer, row, key)) < length:
                for filler in _FILLERS:
                    if have < workloads.chat_length(tokenizer, {**row, key: row[key] + filler}, key) <= length:
                        row[key] += filler
                        break
                else:
                    raise ValueError(f"row {index}, {key}: {have} tokens and no filler word adds exactly one more "
                                     f"towards {length} under this tokenizer; add one to bench.sweep._FILLERS.")
            if have != length:
                raise ValueError(f"row {index}, {key}: {have} tokens after fitting, expected {length}.")
        out.append(row)
    return out


def add_sweep_arguments(parser) -> None:
    """The `--sweep` options of `python -m bench` (the shared ones, `--model`, `--threads`, ... keep their meaning)."""
    group = parser.add_argument_group("cost curves (--sweep)")
    group.add_argument("--sweep", action="store_true", help="Measure step time and peak memory over lengths and "
                       "batch sizes for sft and dpo (bench/sweep.py) instead of the stage comparison.")
    group.add_argument("--quick", action="store_true", help="--sweep on the tiny model with a small grid (smoke test).")
    group.add_argument("--sweep-lengths", type=int, nargs="+", default=None, help=f"Default {LENGTHS}.")
    group.add_argument("--sweep-batches", type=int, nargs="+", default=None, help=f"Default {BATCHES}.")
    group.add_argument("--sweep-tokens", type=int, default=None,
                       help="Batch x length on the length axis (2048): SFT tokens per step; DPO has twice as many.")
    group.add_argument("--sweep-batch-length", type=int, default=None, help="Length of the batch axis (128).")
    group.add_argument("--sweep-generations", type=int, nargs="+", default=None,
                       help="--stage grpo ppo: the generations axis (default 4 8 16; bench/sweep_online.py).")
    group.add_argument("--sweep-prompts", type=int, default=None,
                       help="--stage grpo ppo: prompts per step on the generations axis (2).")
    group.add_argument("--sweep-budget-s", type=float, default=None,
                       help="Start no new point after this many seconds (rerun to go on).")
    group.add_argument("--sweep-name", default=None,
                       help="Base name of the sweep's outputs (default sweep; sweep_online for --stage grpo ppo).")
    group.add_argument("--fresh", action="store_true", help="Ignore points already in <sweep-name>.json.")


def finish_sweep_arguments(opts, parser, argv: list[str]) -> None:
    """Sweep defaults where the stage comparison's differ: 2 steps (1 timed), alignkit and TRL best; `--quick`."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    if "--steps" not in given:
        opts.steps = 2
    if "--warmup" not in given:
        opts.warmup = min(1, opts.steps - 1)
    if "--variants" not in given:
        opts.variants = ["alignkit", "trl_best"]
    if "alignkit" not in opts.variants:
        parser.error("--sweep compares alignkit with TRL: --variants must include alignkit.")
    if opts.quick and "--model" not in given:
        opts.model = "tiny"
    if is_online_sweep(opts, parser):
        from bench import sweep_online

        quick = sweep_online.QUICK if opts.quick else {}
        opts.sweep_name = opts.sweep_name or "sweep_online"
        opts.sweep_lengths = tuple(opts.sweep_lengths or quick.get("lengths", sweep_online.LENGTHS))
        opts.sweep_generations = tuple(opts.sweep_generations or quick.get("generations", sweep_online.GENERATIONS))
        opts.sweep_prompts = opts.sweep_prompts or quick.get("prompts", sweep_online.PROMPTS)
        return
    quick = QUICK if opts.quick else {}
    opts.sweep_name = opts.sweep_name or "sweep"
    opts.sweep_lengths = tuple(opts.sweep_lengths or quick.get("lengths", LENGTHS))
    opts.sweep_batches = tuple(opts.sweep_batches or quick.get("batches", BATCHES))
    opts.sweep_tokens = opts.sweep_tokens or quick.get("tokens", 2048)
    opts.sweep_batch_length = opts.sweep_batch_length or quick.get("batch_length", 128)


def is_online_sweep(opts, parser=None) -> bool:
    """True when `--stage` names only online stages (grpo, ppo: `bench.sweep_online`); a mix with sft/dpo is an
    error (their axes differ), reported through `parser` when given."""
    from bench.sweep_online import ONLINE_SWEEP_STAGES

    named = set(opts.stage or ())
    online = named & set(ONLINE_SWEEP_STAGES)
    if online and named - online:
        message = (f"--sweep --stage: {', '.join(sorted(online))} and {', '.join(sorted(named - online))} have "
                   "different axes; sweep them in two calls.")
        if parser is not None:
            parser.error(message)
        raise SystemExit(message)
    return bool(online)


def linear_fit(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """Least-squares line y = a + b x and its largest relative residual.

    Example: xs [1, 2, 3], ys [3, 5, 7]: b = 2, a = 1, every residual 0.
    """
    if len(xs) < 2 or len(set(xs)) < 2:
        return None
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    a = mean_y - b * mean_x
    worst = max(abs(y - (a + b * x)) / y for x, y in zip(xs, ys))
    return {"intercept": a, "slope": b, "max_relative_residual": worst}


def _settings(opts, model_name: str) -> dict[str, Any]:
    return {"model": model_name, "steps": opts.steps, "warmup": opts.warmup, "lr": opts.lr, "threads": opts.threads,
            "lengths": list(opts.sweep_lengths), "batches": list(opts.sweep_batches), "tokens": opts.sweep_tokens,
            "batch_length": opts.sweep_batch_length, "variants": opts.variants, "device": opts.device}


def _point_key(stage: str, length: int, batch: int, variant: str) -> str:
    return f"{stage} L{length} b{batch} {variant}"


def open_sweep(opts, argv: list[str] | None, settings_of, prefix: str) -> tuple[dict[str, Any], Path, Path, str]:
    """The report a sweep goes on with: the one in `<output-dir>/<sweep-name>.json` when its settings equal
    `settings_of(model name)` (and not `--fresh`), else a new one; with the command, versions and machine of this
    call. Returns (report, json path, work dir, model dir)."""
    from bench.run import machine_info, resolve_model, versions

    command = "python -m bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{opts.sweep_name}.json"
    work_dir = Path(opts.work_dir or tempfile.mkdtemp(prefix=prefix))
    (work_dir / "logs").mkdir(parents=True, exist_ok=True)
    model_name, model_dir = resolve_model(opts.model, work_dir)
    settings = settings_of(model_name)
    report: dict[str, Any] = {}
    if json_path.exists() and not opts.fresh:
        previous = json.loads(json_path.read_text(encoding="utf-8"))
        if previous.get("settings") == settings:
            report = previous
    report.setdefault("runs", {})
    report.update(settings=settings, command=command, versions=versions(),
                  machine=machine_info(opts.threads, opts.device))
    return report, json_path, work_dir, model_dir


def run_points(opts, report: dict[str, Any], json_path: Path, work_dir: Path, model_dir: str,
               todo: list[tuple[str, list[str], dict[str, Any]]]) -> tuple[bool, bool]:
    """Run each (key, worker arguments, fields) of `todo` in a fresh `bench.worker` process, in order, until
    `--sweep-budget-s` is spent; each result (with `fields`, the load average before it and the commit) goes into
    `report["runs"][key]` and the report is saved after every point, so a later call goes on. Returns (a run
    failed, the budget stopped it)."""
    from bench.run import run_worker

    started, failed = time.time(), False
    print(f"[sweep] {len(todo)} runs to do ({len(report['runs'])} kept from {json_path})", file=sys.stderr)
    for i, (key, args, fields) in enumerate(todo, 1):
        if opts.sweep_budget_s and time.time() - started > opts.sweep_budget_s:
            print(f"[sweep] budget of {opts.sweep_budget_s:.0f} s spent; {len(todo) - i + 1} runs left: run the "
                  "same command again to go on.", file=sys.stderr)
            return failed, True
        print(f"[sweep] {i}/{len(todo)} {key} ...", file=sys.stderr, flush=True)
        load = os.getloadavg()[0]
        common = ["--model-dir", model_dir, "--steps", str(opts.steps), "--warmup", str(opts.warmup),
                  "--lr", str(opts.lr), "--threads", str(opts.threads), "--device", opts.device]
        result = run_worker([*common, *args], opts.threads, opts.run_timeout,
                            work_dir / "logs" / f"{key.replace(' ', '_')}.log")
        result.pop("settings", None)
        result.update(fields, load_1min_before=round(load, 2), commit=report["versions"].get("alignkit_commit"))
        report["runs"][key] = result
        failed |= not result.get("ok")
        print("[sweep]   " + (f"{result['step_time_s']:.2f} s/step, {result['peak_rss_mb']:.0f} MB"
                               if result.get("ok") else f"FAILED: {result.get('error')}"), file=sys.stderr, flush=True)
        report["date"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        json_path.write_text(json.dumps(report, indent=1), encoding="utf-8")  # after every point: resumable
    return failed, False


def close_sweep(opts, report: dict[str, Any], json_path: Path, work_dir: Path, markdown: str, plot,
                failed: bool, stopped: bool) -> int:
    """Save the report, `<sweep-name>.md` and the plots (`plot(report, out_dir, name)`); print the table. Returns 1
    when a run failed, 3 when the budget stopped the sweep (call again to go on), 0 when complete."""
    report["date"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    json_path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    (json_path.parent / f"{opts.sweep_name}.md").write_text(markdown, encoding="utf-8")
    plot(report, json_path.parent, opts.sweep_name)
    print(markdown)
    print(f"[sweep] wrote {json_path}, .md and {opts.sweep_name}_time.png / _memory.png; logs in {work_dir / 'logs'}",
          file=sys.stderr)
    return 1 if failed else (3 if stopped else 0)


def worker_variant_args(variant: str, stage: str) -> list[str]:
    """`bench.worker`'s tool, variant and stage arguments for a sweep run of `variant`."""
    tool = "alignkit" if variant == "alignkit" else "trl"
    return ["--tool", tool, "--variant", "best" if variant == "trl_best" else "default", "--stage", stage]


def run_sweep(opts, argv: list[str] | None) -> int:
    """`python -m bench --sweep`: run the grid's missing points, then write the table and plots; 0 when complete,
    3 when the budget stopped it early (call again to go on), 1 when a run failed."""
    if is_online_sweep(opts):
        from bench.sweep_online import run_online_sweep

        return run_online_sweep(opts, argv)
    stages = [s for s in (opts.stage or SWEEP_STAGES) if s in SWEEP_STAGES]
    if not stages:
        raise SystemExit(f"--sweep measures {', '.join(SWEEP_STAGES)}; --stage named none of them.")
    report, json_path, work_dir, model_dir = open_sweep(opts, argv, lambda name: _settings(opts, name),
                                                        "alignkit-sweep-")
    grid = points(opts.sweep_lengths, opts.sweep_batches, opts.sweep_tokens, opts.sweep_batch_length, stages)
    report["grid"] = grid

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # The length axis of both stages first, shortest first, so a sweep cut short by its budget has both curves.
    order = sorted(grid, key=lambda p: ("length" not in p["axes"], p["length"] if "length" in p["axes"] else 0,
                                        p["batch"], p["stage"]))
    todo = []
    for point in order:
        stage, length, batch = point["stage"], point["length"], point["batch"]
        kind = "sft" if stage == "sft" else "pref"
        data_dir = work_dir / "data" / f"{kind}_L{length}_b{batch}"
        for variant in opts.variants:
            key = _point_key(stage, length, batch, variant)
            if key in report["runs"]:
                continue
            if not (data_dir / "done").exists():
                rows = exact_length_rows(tokenizer, kind, opts.steps * batch, length)
                workloads.write_datasets(rows, data_dir, f"sweep_{kind}")
                (data_dir / "done").write_text("")
            args = [*worker_variant_args(variant, stage), "--batch", str(batch), "--cutoff", str(length)]
            args += (["--alignkit-dataset", f"sweep_{kind}", "--alignkit-dataset-dir", str(data_dir)]
                     if variant == "alignkit" else ["--trl-file", str(data_dir / f"sweep_{kind}.trl.jsonl")])
            todo.append((key, args, {"stage": stage, "length": length, "batch": batch, "variant": variant}))
    failed, stopped = run_points(opts, report, json_path, work_dir, model_dir, todo)
    report["complete"] = all(_point_key(p["stage"], p["length"], p["batch"], v) in report["runs"]
                             for p in grid for v in opts.variants)
    report["memory_fits"] = memory_fits(report)
    return close_sweep(opts, report, json_path, work_dir, render_sweep(report), plot_sweep, failed, stopped)


def _ok_runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in report["runs"].values() if r.get("ok")]


def memory_fits(report: dict[str, Any]) -> dict[str, Any]:
    """Per stage and tool, peak RSS against tokens per step along the batch axis (`linear_fit`: MB and MB per
    1k tokens), and the spread of peak RSS along the length axis (fixed tokens: flat when memory is linear)."""
    settings, fits = report["settings"], {}
    for run in _ok_runs(report):
        fits.setdefault(f"{run['stage']} {run['variant']}", [])
    for name in fits:
        stage, variant = name.split()
        runs = [r for r in _ok_runs(report) if r["stage"] == stage and r["variant"] == variant]
        batch_axis = [r for r in runs if r["length"] == settings["batch_length"] and r["batch"] in settings["batches"]]
        tokens = [r["batch"] * r["length"] * (2 if stage == "dpo" else 1) / 1000 for r in batch_axis]
        fit = linear_fit(tokens, [r["peak_rss_mb"] for r in batch_axis])
        length_axis = [r["peak_rss_mb"] for r in runs
                       if r["length"] in settings["lengths"] and r["batch"] == max(1, settings["tokens"] // r["length"])]
        fits[name] = {"batch_axis_fit_mb_per_1k_tokens": fit,
                      "length_axis_rss_mb": {"min": min(length_axis), "max": max(length_axis)} if length_axis else None}
    return fits


def render_sweep(report: dict[str, Any]) -> str:
    """The sweep table (markdown): one row per point, alignkit beside each TRL variant and their ratios."""
    s, v, m = report["settings"], report["versions"], report["machine"]
    variants = s["variants"]
    others = [x for x in variants if x != "alignkit"]
    lines = [
        f"Command: `{report['command']}`  ",
        f"Date: {report.get('date')}; machine: {m['cpu']}, {m['cores']} cores, {s['threads']} threads; "
        f"alignkit {v.get('alignkit')} ({v.get('alignkit_commit', '?')}), TRL {v['trl']}, transformers "
        f"{v['transformers']}, torch {v['torch']}.  ",
        f"Model: {s['model']}; LoRA r=8 alpha=16 on every linear layer but the head; alignkit at its `bf16: auto` "
        f"default (on a CPU with bf16 units it may choose bf16), TRL in fp32; {s['steps']} steps per "
        f"run, the first {s['warmup']} not timed; every run a fresh process. Every sequence is exactly L tokens "
        f"(DPO: chosen and rejected both L). Length axis: batch x L = {s['tokens']} (SFT batch and DPO pairs = "
        f"{s['tokens']}/L, so a DPO step holds {2 * s['tokens']} tokens); batch axis: L = {s['batch_length']}.  ",
        "Peak RSS is the whole process (model weights, libraries and the step's activations). "
        + ("TRL runs use its best settings (`TRL_BEST`)." if others == ["trl_best"] else ""),
        "",
        "| stage | axis | L | batch | tokens/step | " + " | ".join(
            f"{x} s/step | {x} MB" for x in variants) + " | " + " | ".join(
            f"time alignkit/{x} | memory alignkit/{x}" for x in others) + " |",
        "|" + "---|" * (5 + 2 * len(variants) + 2 * len(others)),
    ]
    for point in report["grid"]:
        runs = {x: report["runs"].get(_point_key(point["stage"], point["length"], point["batch"], x)) for x in variants}
        counted = [r for r in runs.values() if r and r.get("ok") and r.get("tokens_per_step")]
        tokens = (sum(counted[0]["tokens_per_step"]) / len(counted[0]["tokens_per_step"]) if counted else
                  point["batch"] * point["length"] * (2 if point["stage"] == "dpo" else 1))
        cells = []
        for x in variants:
            r = runs[x]
            if r is None:
                cells += ["not run", ""]
            elif not r.get("ok"):
                cells += [f"failed: {str(r.get('error'))[:60]}", ""]
            else:
                cells += [f"{r['step_time_s']:.2f}", f"{r['peak_rss_mb']:.0f}"]
        for x in others:
            a, b = runs.get("alignkit"), runs[x]
            if a and b and a.get("ok") and b.get("ok"):
                cells += [f"{a['step_time_s'] / b['step_time_s']:.2f}x", f"{a['peak_rss_mb'] / b['peak_rss_mb']:.2f}x"]
            else:
                cells += ["", ""]
        lines.append(f"| {point['stage']} | {'+'.join(point['axes'])} | {point['length']} | {point['batch']} "
                     f"| {tokens:.0f} | " + " | ".join(cells) + " |")
    fits = report.get("memory_fits") or {}
    if fits:
        lines += ["", "| stage / tool | peak RSS along the batch axis | peak RSS along the length axis (fixed tokens) |",
                  "|---|---|---|"]
        for name, fit in fits.items():
            line = fit["batch_axis_fit_mb_per_1k_tokens"]
            spread = fit["length_axis_rss_mb"]
            lines.append(f"| {name} | " + (f"{line['intercept']:.0f} MB + {line['slope']:.0f} MB per 1k tokens "
                                           f"(largest residual {100 * line['max_relative_residual']:.0f}%)"
                                           if line else "—")
                         + " | " + (f"{spread['min']:.0f}–{spread['max']:.0f} MB" if spread else "—") + " |")
    if not report.get("complete"):
        lines += ["", "Incomplete: some points have not run yet (rerun the command to go on)."]
    return "\n".join(lines) + "\n"


def plot_two_axes(out_dir: Path, name: str, axes: tuple[tuple[str, list[int]], tuple[str, list[int]]], title: str,
                  curves) -> list[Path]:
    """`<name>_time.png` and `<name>_memory.png`, each two log-log panels (step time, then peak RSS).

    Args:
        axes: (x label, x ticks) of the left and the right panel.
        title: what follows the figure's label in the title.
        curves: `curves(figure)` yields (panel 0 or 1, legend label, style, [(x, y), ...]) for "step_time_s" or
            "peak_rss_mb"; empty point lists are skipped.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for figure, label, file_tag in (("step_time_s", "step time (s)", "time"), ("peak_rss_mb", "peak RSS (MB)",
                                                                              "memory")):
        fig, panels = plt.subplots(1, 2, figsize=(11, 4.2))
        for panel, legend, style, xy in curves(figure):
            if xy:
                panels[panel].plot(*zip(*sorted(xy)), label=legend, **style)
        for axis, (xlabel, ticks) in zip(panels, axes):
            axis.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=label)
            axis.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
            axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize=8)
        fig.suptitle(f"{label}, {title}")
        fig.tight_layout()
        path = out_dir / f"{name}_{file_tag}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_sweep(report: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    """`<name>_time.png` and `<name>_memory.png`: each against length (left) and batch (right), log scales."""
    s = report["settings"]
    runs = _ok_runs(report)

    def curves(figure):
        for stage in SWEEP_STAGES:
            for variant in s["variants"]:
                mine = [r for r in runs if r["stage"] == stage and r["variant"] == variant]
                style = {"marker": "o" if stage == "sft" else "s",
                         "linestyle": "-" if variant == "alignkit" else "--"}
                yield 0, f"{stage} {variant}", style, [(r["length"], r[figure]) for r in mine
                                                       if r["length"] in s["lengths"]
                                                       and r["batch"] == max(1, s["tokens"] // r["length"])]
                yield 1, f"{stage} {variant}", style, [(r["batch"], r[figure]) for r in mine
                                                       if r["length"] == s["batch_length"] and r["batch"] in s["batches"]]

    return plot_two_axes(out_dir, name, ((f"sequence length L (batch x L = {s['tokens']})", s["lengths"]),
                                         (f"batch (L = {s['batch_length']})", s["batches"])),
                         f"{s['model']}, {s['threads']} threads", curves)


__all__ = ["points", "exact_length_rows", "linear_fit", "memory_fits", "render_sweep", "plot_two_axes", "plot_sweep",
           "open_sweep", "run_points", "close_sweep", "run_sweep"]
