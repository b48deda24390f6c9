"""Where a training run's resident memory goes, phase by phase: `python -m bench.memory_phases [--variant qlora]`.

One alignkit run of the benchmark's workload (`bench.worker.run_alignkit`: the bundled model, LoRA r=8 on every
linear layer, batch 8, cutoff 256, sft by default) in this process, with a thread reading the resident set size
(`/proc/self/statm`) every few milliseconds and keeping its maximum per phase:

- `import` (until the run starts), `load` (tokenizer, data, model, adapter: until `on_train_begin`), `setup` (the
  Trainer's own set-up until the first step);
- per step: `forward` (from `on_step_begin` to the loss's backward call, `accelerate.Accelerator.backward`),
  `backward`, `optimizer` (`on_pre_optimizer_step` to `on_optimizer_step`) and `rest` (to the next step); an
  online stage (`--stage grpo|rloo|distill|online_dpo`) adds `generation` (the sampling call inside the step's
  forward phase), and each step records the resident size after it.

Per step it also sums what autograd saved for backward (unique storages handed to `saved_tensors_hooks`, parameters
left out) by dtype, and glibc's heap figures (`mallinfo2`: bytes in use, bytes free but kept by the process) at the
step's end, which tell live tensors from allocator caching. Environment knobs (`MALLOC_ARENA_MAX`, ...) apply as
set; `--trim` calls `malloc_trim(0)` after loading and after every step.

Prints one JSON object (and `--out FILE` writes it). The figures are memory: valid on a loaded machine; the times
it prints are not benchmarks.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")


def heap_mb() -> dict[str, float]:
    """glibc's view: `in_use` (malloc'd and not freed, mmapped chunks included), `free_kept` (freed, still mapped)."""
    try:
        fn = _libc.mallinfo2
    except AttributeError:
        return {}
    fn.restype = _Mallinfo2
    info = fn()
    return {"in_use": round((info.uordblks + info.hblkhd) / 2**20, 1), "free_kept": round(info.fordblks / 2**20, 1),
            "mmapped": round(info.hblkhd / 2**20, 1)}


class PhaseSampler:
    """Max RSS per phase label, sampled every `interval` seconds by a daemon thread (and at every change)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.phase = "import"
        self.peaks: dict[str, float] = {}
        self.order: list[str] = []
        self.interval = interval
        self._stop = False
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _note(self) -> None:
        value = rss_mb()
        with self._lock:
            if self.phase not in self.peaks:
                self.order.append(self.phase)
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), value)

    def _run(self) -> None:
        while not self._stop:
            self._note()
            time.sleep(self.interval)

    def set(self, phase: str) -> None:
        self._note()
        self.phase = phase
        self._note()

    def stop(self) -> None:
        self._note()
        self._stop = True


class SavedBytes:
    """What autograd saves for backward during one step's forward: unique non-parameter storages, MB by dtype."""

    def __init__(self, model) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, tuple[str, int]] = {}
        self.context = None

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen[ptr] = (str(tensor.dtype).replace("torch.", ""), storage.nbytes())
        return tensor

    def start(self) -> None:
        import torch

        self.seen = {}
        self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.context.__enter__()

    def finish(self) -> dict[str, float]:
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None
        by_dtype: dict[str, float] = {}
        for dtype, nbytes in self.seen.values():
            by_dtype[dtype] = by_dtype.get(dtype, 0.0) + nbytes / 2**20
        return {k: round(v, 1) for k, v in sorted(by_dtype.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory_phases", description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=["default", "qlora"], default="default",
                   help="default: fp32 LoRA; qlora: the 4-bit base of bench.worker.QLORA.")
    p.add_argument("--stage", default="sft", choices=["sft", "grpo", "rloo", "distill", "online_dpo"],
                   help="online stages add a `generation` phase per step (the sampling call).")
    p.add_argument("--model", default="smollm2-135m-instruct", help="as `python -m bench --model`.")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cutoff", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) after loading and after every step.")
    p.add_argument("--extra", nargs="*", default=[], help="key=value alignkit settings added for this run.")
    p.add_argument("--out", default=None)
    opts = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sampler = PhaseSampler()
    started = time.perf_counter()

    import accelerate
    import torch
    from transformers import TrainerCallback

    from bench import run as bench_run, worker

    torch.set_num_threads(opts.threads)
    events: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []

    def mark(label: str) -> None:
        events.append({"at": label, "rss_mb": round(rss_mb(), 1), "t": round(time.perf_counter() - started, 2)})

    original_backward = accelerate.Accelerator.backward
    saved: dict[str, SavedBytes] = {}

    def backward(self, loss, **kwargs):
        steps[-1]["saved_for_backward_mb"] = saved["hook"].finish()
        steps[-1]["rss_before_backward_mb"] = round(rss_mb(), 1)
        sampler.set(f"step{len(steps)}.backward")
        return original_backward(self, loss, **kwargs)

    accelerate.Accelerator.backward = backward

    class Phases(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            mark("train_begin")
            saved["hook"] = SavedBytes(model)
            if opts.trim:
                _libc.malloc_trim(0)
                mark("train_begin_trimmed")
            sampler.set("setup")

        def on_step_begin(self, args, state, control, **kwargs):
            steps.append({"step": len(steps) + 1, "rss_at_begin_mb": round(rss_mb(), 1)})
            sampler.set(f"step{len(steps)}.forward")
            saved["hook"].start()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            steps[-1]["rss_after_backward_mb"] = round(rss_mb(), 1)
            sampler.set(f"step{len(steps)}.optimizer")

        def on_optimizer_step(self, args, state, control, **kwargs):
            steps[-1]["rss_after_optimizer_mb"] = round(rss_mb(), 1)
            sampler.set(f"step{len(steps)}.rest")

        def on_step_end(self, args, state, control, **kwargs):
            steps[-1]["heap_at_end_mb"] = heap_mb()
            if opts.trim:
                _libc.malloc_trim(0)
                steps[-1]["rss_after_trim_mb"] = round(rss_mb(), 1)

    saved_env = {key: os.environ.get(key) for key in ("HF_DATASETS_CACHE", "ALIGNKIT_DATA_CACHE")}
    try:
        with tempfile.TemporaryDirectory(prefix="alignkit-memphases-") as tmp:
            work = Path(tmp)
            _, model_dir = bench_run.resolve_model(opts.model, work)
            data = bench_run.prepare_data(model_dir, [opts.stage], opts.steps * opts.batch, opts.cutoff, work)
            os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets")
            os.environ["ALIGNKIT_DATA_CACHE"] = str(work / "alignkit_data")
            mark("imported_and_data_written")
            sampler.set("load")
            stage_data = data[bench_run.data_kind(opts.stage)]
            args = ["--tool", "alignkit", "--variant", opts.variant, "--stage", opts.stage, "--model-dir", model_dir,
                    "--alignkit-dataset", stage_data["alignkit_dataset"],
                    "--alignkit-dataset-dir", stage_data["alignkit_dataset_dir"], "--steps", str(opts.steps),
                    "--batch", str(opts.batch), "--cutoff", str(opts.cutoff), "--threads", str(opts.threads),
                    "--output-dir", str(work / "out"), "--extra", *opts.extra]
            if opts.stage in worker.ONLINE_STAGES:  # the sampling call is a phase of its own
                import alignkit.stages.online as online

                sample = online.sample_completions

                def phased_sample(*a, **k):
                    sampler.set(f"step{len(steps)}.generation")
                    out = sample(*a, **k)
                    steps[-1]["rss_after_generation_mb"] = round(rss_mb(), 1)
                    sampler.set(f"step{len(steps)}.forward")
                    return out

                online.sample_completions = phased_sample
            try:
                phases = Phases()
                phases.recorder = worker.StepRecorder()  # the worker times generation through it
                worker.run_alignkit(worker.parse_args(args), phases)
            finally:
                if opts.stage in worker.ONLINE_STAGES:
                    online.sample_completions = sample
            mark("train_end")
    finally:  # leave the process as it was (the smoke test runs this inside pytest)
        sampler.stop()
        accelerate.Accelerator.backward = original_backward
        if "hook" in saved and saved["hook"].context is not None:
            saved["hook"].finish()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    import resource

    result = {
        "variant": opts.variant, "env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "trim": opts.trim, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "phase_peaks_mb": {k: round(sampler.peaks[k], 1) for k in sampler.order}, "events": events, "steps": steps,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if opts.out:
        Path(opts.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
