"""Where one alignkit training step spends its time: `python -m bench.profile_step --stage sft`.

Runs the same training as `python -m bench` (`bench.worker.run_alignkit`: the bundled model, LoRA r=8 on every
linear layer but the head, the generated workload fitted to `--cutoff`, `--batch` rows per step) and records one
step after `--warmup` steps with `torch.profiler` (CPU, operator level). Prints the operators with the most self
time and each one's share of the step, and the shares by kind: matrix products (`aten::mm`, `addmm`, `bmm`),
attention kernels, optimizer, and the rest (element-wise ops, copies, indexing). Not a test; run it alone, under
the heavy-job lock, like the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

KINDS = (  # (kind, substrings of operator names), first match wins
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("optimizer", ("_foreach_", "adam", "Optimizer.step", "lerp", "addcdiv", "addcmul")),
)


def kind_of(name: str) -> str:
    """The kind of an operator: `kind_of("aten::addmm") == "matmul"`, `kind_of("aten::mul") == "other"`."""
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


ROLLOUT = "alignkit.rollout"  # the profiler label around an online stage's sampling call


def rollout_split(events) -> dict:
    """Self CPU seconds inside and outside the `ROLLOUT` label (an online step's sampling call, the label's own
    self time included, and the rest of the step), and the training part's seconds per operator."""
    seconds = {"rollout": 0.0, "training": 0.0}
    training_ops: dict[str, float] = {}
    for e in events:
        if e.name == ROLLOUT:  # its own self time: the Python of the sampling loop and the model's modules
            seconds["rollout"] += e.self_cpu_time_total / 1e6
            continue
        parent, inside = e.cpu_parent, False
        while parent is not None and not inside:
            inside, parent = parent.name == ROLLOUT, parent.cpu_parent
        part = "rollout" if inside else "training"
        seconds[part] += e.self_cpu_time_total / 1e6
        if part == "training":
            training_ops[e.name] = training_ops.get(e.name, 0.0) + e.self_cpu_time_total / 1e6
    return {**seconds, "training_ops": training_ops}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=["sft", "rm", "dpo", "grpo"], default="sft")
    p.add_argument("--model", default="smollm2-135m-instruct", help="As for `python -m bench --model`.")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cutoff", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2, help="Steps before the profiled one.")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=20, help="Operators to list.")
    p.add_argument("--num-generations", type=int, default=4, help="GRPO, as for `python -m bench`.")
    p.add_argument("--max-completion-length", type=int, default=32, help="GRPO, as for `python -m bench`.")
    p.add_argument("--alignkit-bf16", choices=["false", "true", "auto"], default="auto",
                   help="Precision, as for `python -m bench --alignkit-bf16`.")
    p.add_argument("--extra", nargs="*", default=[], help="key=value training settings added for this run.")
    p.add_argument("--output", default=None, help="Also write the table and shares as JSON here.")
    opts = p.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from transformers import TrainerCallback

    from bench import run as bench_run
    from bench.worker import StepRecorder, make_callback, run_alignkit

    torch.set_num_threads(opts.threads)
    work = Path(tempfile.mkdtemp(prefix="alignkit-profile-"))
    os.environ["ALIGNKIT_DATA_CACHE"] = str(work / "cache")
    steps = opts.warmup + 1
    _, model_dir = bench_run.resolve_model(opts.model, work)
    data = bench_run.prepare_data(model_dir, [opts.stage], steps * opts.batch, opts.cutoff, work,
                                  num_generations=opts.num_generations)
    kind = bench_run.data_kind(opts.stage)
    profiled: dict = {}

    class _Profile(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == opts.warmup:
                profiled["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiled["profiler"].__enter__()
                profiled["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if "profiler" in profiled and "seconds" not in profiled:
                profiled["seconds"] = time.perf_counter() - profiled["start"]
                profiled["profiler"].__exit__(None, None, None)

    recorder = StepRecorder()
    # The worker's own parser fills every option the run reads, so this profile cannot drift from the benchmark's.
    from bench.worker import parse_args as worker_args

    opts_run = worker_args([
        "--tool", "alignkit", "--stage", opts.stage, "--model-dir", str(model_dir),
        "--alignkit-dataset", data[kind]["alignkit_dataset"],
        "--alignkit-dataset-dir", data[kind]["alignkit_dataset_dir"],
        "--cutoff", str(opts.cutoff), "--output-dir", str(work / "out"), "--batch", str(opts.batch),
        "--steps", str(steps), "--warmup", str(opts.warmup), "--threads", str(opts.threads),
        "--num-generations", str(opts.num_generations), "--max-completion-length", str(opts.max_completion_length),
        "--alignkit-bf16", opts.alignkit_bf16, "--extra", *opts.extra])
    # An online stage's rollout runs under a profiler label, so the table can be split into rollout and training.
    import alignkit.stages.online as online

    sample_completions = online.sample_completions

    def labelled_rollout(*args, **kwargs):
        with torch.profiler.record_function(ROLLOUT):
            return sample_completions(*args, **kwargs)

    online.sample_completions = labelled_rollout
    # run_alignkit imports run_train when called: wrap it so the profiling callback joins the benchmark's own.
    import alignkit.train

    run_train = alignkit.train.run_train
    alignkit.train.run_train = lambda config, callbacks: run_train(config, callbacks=[*callbacks, _Profile()])
    try:
        run_alignkit(opts_run, make_callback(recorder))
    finally:
        alignkit.train.run_train = run_train
        online.sample_completions = sample_completions
    events = profiled["profiler"].key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    shares: dict[str, float] = {}
    for e in events:
        shares[kind_of(e.key)] = shares.get(kind_of(e.key), 0.0) + e.self_cpu_time_total / total
    tokens = recorder.batch_tokens[opts.warmup] if len(recorder.batch_tokens) > opts.warmup else None
    print(f"{opts.stage}: profiled step {opts.warmup + 1}: {profiled['seconds']:.2f} s under the profiler, "
          f"{tokens} real tokens, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    print("| operator | self CPU (s) | share | calls |\n|---|---|---|---|")
    rows = []
    for e in ranked[: opts.rows]:
        rows.append({"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
                     "calls": e.count})
        print(f"| {e.key} | {e.self_cpu_time_total / 1e6:.3f} | {100 * e.self_cpu_time_total / total:.1f}% | {e.count} |")
    print("shares by kind: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(shares.items(), key=lambda x: -x[1])))
    parts = rollout_split(profiled["profiler"].events())
    if parts["rollout"]:
        print(f"self CPU by part: rollout {parts['rollout']:.2f} s, training {parts['training']:.2f} s")
        top = sorted(parts["training_ops"].items(), key=lambda x: -x[1])[:12]
        print("training part, top operators: " + ", ".join(f"{name} {t:.3f} s" for name, t in top))
    if opts.output:
        Path(opts.output).write_text(json.dumps({"stage": opts.stage, "step_s": profiled["seconds"], "tokens": tokens,
                                                 "ops": rows, "shares": shares}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
