"""`alignkit env`: the versions and hardware facts to paste into a bug report; where alignkit keeps its files; how many
processes were launched."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any, Iterator

LIBRARIES = ("torch", "transformers", "peft", "datasets", "accelerate", "trl")


def alignkit_home() -> Path:
    """`$ALIGNKIT_HOME`, or `~/.cache/alignkit` when unset: the converted bundled model and data caches live there."""
    return Path(os.environ.get("ALIGNKIT_HOME") or Path.home() / ".cache" / "alignkit").expanduser()


def launched_processes() -> int:
    """How many processes the launcher started (torchrun's, accelerate's or DeepSpeed's `WORLD_SIZE`; 1 alone).

    The one place `WORLD_SIZE` is read: the config parser, the data layer and the stages' checks ask here.
    """
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


# What DeepSpeed's logger (named "DeepSpeed", printing to stdout) says on a machine without GPUs whenever deepspeed is
# imported; accelerate imports it in every run where it is installed (`extract_model_from_parallel`).
DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU"


def _not_the_deepspeed_cpu_notice(record: logging.LogRecord) -> bool:
    return DEEPSPEED_CPU_NOTICE not in record.getMessage()


def silence_deepspeed_cpu_notice() -> None:
    """Drop DeepSpeed's "Setting accelerator to CPU" warning, for a run that does not use DeepSpeed.

    With deepspeed installed (the `dev` and `deepspeed` extras), accelerate imports it while the Trainer is
    built, whether the run uses it or not, and on a CPU-only machine DeepSpeed then prints that line on stdout.
    Only that line goes, and only from DeepSpeed's logger; nothing is imported here. Call it when DeepSpeed is
    not configured: in a DeepSpeed run the line says something true about the run.
    """
    ds_logger = logging.getLogger("DeepSpeed")  # the logger DeepSpeed creates later is this same object
    if _not_the_deepspeed_cpu_notice not in ds_logger.filters:
        ds_logger.addFilter(_not_the_deepspeed_cpu_notice)


def _compile_on_first_call(real_compile):
    """A stand-in for `torch.compile` that sets up each compiled function at its first call instead of at once.

    `torch.compile(fn)` compiles nothing until `fn` is called, but its set-up at decoration imports torch's whole
    compiler (`torch._inductor`, to read its configuration). Here that set-up waits for the first call; a set-up
    that fails then leaves the function uncompiled, as bitsandbytes' own wrapper does when it fails at decoration.
    Anything but a plain function (a module) goes to `torch.compile` at once.
    """
    import functools
    import inspect

    def compile(model=None, **kwargs):
        if model is None:  # used as `@torch.compile(dynamic=False)`
            return lambda fn: compile(fn, **kwargs)
        if not inspect.isfunction(model):
            return real_compile(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **call_kwargs):
            nonlocal compiled
            if compiled is None:
                try:
                    compiled = real_compile(model, **kwargs)
                except Exception:
                    compiled = model
            return compiled(*args, **call_kwargs)

        return first_call_compiles

    return compile


class _CompileOnFirstCallLoader:
    """Runs bitsandbytes' package code with `_compile_on_first_call` in place of `torch.compile`; every other
    loader attribute (resource readers and the like) is the real loader's."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        import torch

        real_compile = torch.compile
        torch.compile = _compile_on_first_call(real_compile)
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = real_compile


class _BitsandbytesFinder:
    """A `sys.meta_path` entry that hands bitsandbytes' import to `_CompileOnFirstCallLoader`; other names pass."""

    def __init__(self):
        self._finding = False

    def find_spec(self, name, path=None, target=None):
        if name != "bitsandbytes" or self._finding:
            return None
        import importlib.util

        self._finding = True  # the real finders, not this one, find it
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _CompileOnFirstCallLoader(spec.loader)
        return spec


def defer_compile_set_up_in_bitsandbytes() -> None:
    """Keep bitsandbytes' import from importing torch's compiler: 1.3-2 s of every process's start-up.

    peft imports bitsandbytes whenever it is installed (the qlora and dev extras), quantized model or not, and
    bitsandbytes wraps four of its CPU kernels in `torch.compile` as it is imported; that set-up alone imports
    `torch._inductor`, which nothing else in a run needs (docs/performance.md, "The twentieth session"). With this,
    that set-up happens at a kernel's first call instead (a QLoRA run that uses one); what runs is unchanged.
    Called as alignkit is imported; no effect where bitsandbytes is imported already.
    """
    import sys

    if "bitsandbytes" in sys.modules or any(isinstance(f, _BitsandbytesFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BitsandbytesFinder())


@contextlib.contextmanager
def start_up_imports() -> Iterator[None]:
    """Run a command's first import of torch and the training stack with the cyclic garbage collector paused.

    Python 3.11 collects after every 700 new container objects, and an import of torch, transformers, peft and
    alignkit's stages creates some 640,000 that live as long as the process. Each full collection walks them all:
    in a tiny model's 6-step `alignkit train` the collector ran 1.1 s, 0.8 s of it in 8 full collections, and
    the run took 10.3-10.9 s against 8.4-8.6 s with this (docs/performance.md, "The twenty-first session"). Here
    what is garbage beforehand is collected, the collector pauses for the block, and what the block built is then
    frozen (`gc.freeze`: kept out of every later collection, as it would have survived them) before the collector
    resumes; the block's own garbage (some 12,000 objects) stays. In a process that has imported torch already (a
    notebook, the test suite) nothing changes.
    """
    if "torch" in sys.modules or not gc.isenabled():
        yield
        return
    gc.collect()  # garbage from before is collected, not frozen
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _version(distribution: str) -> str | None:
    import importlib.metadata  # here, not at the top: `alignkit --help` imports this module and needs none of it

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_check(owner: Any, name: str) -> bool:
    """One of torch's private hardware checks (`owner.name()`); False where this torch lacks it or it raises."""
    probe = getattr(owner, name, None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def onednn_supports_bf16() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (on x86 it needs AVX512 BW, VL and DQ, or AVX-NE-CONVERT;
    on ARM the BF16 extension): its bf16 weight packing raises without them."""
    import torch

    return _torch_check(torch.ops.mkldnn, "_is_mkldnn_bf16_supported")


def cpu_supports_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic in hardware, so that bf16 training is not slower than fp32.

    x86: AVX512-BF16 or AMX, as torch detects them (oneDNN's bf16 matmuls use these); without them bf16
    is emulated and runs several times slower than fp32. Other architectures: oneDNN's own check (on
    ARM, the BF16 extension). torch exposes these checks only as private functions, so a torch without
    them counts as "no".
    """
    import torch

    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return (_torch_check(torch.cpu, "_is_avx512_bf16_supported")
                or _torch_check(torch.cpu, "_is_amx_tile_supported"))
    return onednn_supports_bf16()


def env_info() -> dict[str, Any]:
    """Versions of alignkit, Python and the libraries it builds on, and what torch sees of the hardware.

    Libraries that are not installed (trl is optional) are left out.
    """
    import torch

    info: dict[str, Any] = {
        "alignkit": _version("alignkit"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for name in LIBRARIES:
        version = _version(name)
        if version is not None:
            info[name] = version
    if torch.cuda.is_available():
        info["device"] = f"cuda: {torch.cuda.get_device_name(0)}"
        info["device_count"] = torch.cuda.device_count()
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
    else:
        info["device"] = "cpu"
        info["device_count"] = 1
        # Hardware bf16 (AVX512-BF16/AMX); without it bf16 runs far slower than fp32 and `bf16: true` trains in fp32.
        info["bf16_supported"] = cpu_supports_bf16()
    info["num_threads"] = torch.get_num_threads()
    return info


def format_env(info: dict[str, Any]) -> str:
    """One `- key: value` line per entry, aligned, for the terminal or an issue."""
    width = max((len(k) for k in info), default=0)
    return "\n".join(f"- {key.ljust(width)}: {value}" for key, value in info.items())


__all__ = ["DEEPSPEED_CPU_NOTICE", "alignkit_home", "cpu_supports_bf16", "env_info", "format_env", "launched_processes",
           "onednn_supports_bf16", "silence_deepspeed_cpu_notice"]
