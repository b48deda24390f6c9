"""`bf16: auto`: train in bf16 autocast on a CPU only where a probe at the model's own shapes shows it faster.

A CPU with bf16 hardware (AVX512-BF16, AMX) runs a large bf16 matmul several times faster than fp32, yet a whole
training step of a small model may gain nothing: the step is not bound by large matmuls (norms, rotary, LoRA's
small matmuls, the optimizer, Python), and autocast adds a cast of every weight per call. So the choice is measured,
not assumed: one training forward and backward of a few hundred tokens of the model as built (adapters included),
timed in fp32 and under bf16 autocast, alternating; bf16 is chosen when it is at least `BF16_MARGIN` times faster.

- The probe is cached per machine and model shape in `alignkit_home()/precision_probe.json`, so it runs once.
- The choice is written to `output_dir/precision.json`; a resumed run reads it back, so a run keeps one
  precision from start to end (a bit-equal resume needs the same numerics).
- Under several processes rank 0 probes and the others take its choice.
- `ALIGNKIT_PRECISION_PROBE=off` makes `auto` fp32 without probing (the test suite sets it: its numbers are fp32).

Where `auto` is settled without a probe (`config.parse.choose_precision`): an accelerator with bf16 trains in
bf16, a CPU without bf16 hardware in fp32, and so does a DeepSpeed or FSDP run on a CPU, whose engine reads the
precision when its config is built, before the model exists.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

BF16_MARGIN = 1.10  # bf16 must be at least this much faster: within noise, fp32 keeps its precision
PROBE_ENV = "ALIGNKIT_PRECISION_PROBE"
PROBE_CACHE_FILE = "precision_probe.json"
CHOICE_FILE = "precision.json"
PROBE_ROWS, PROBE_TOKENS, PROBE_REPEATS = 2, 128, 3
# Part of the cache key: raised when a change to alignkit's fp32 or bf16 step moves their speeds, so a probe cached
# before it is taken again. 2: fp32 attention for short sequences, the fused LoRA node and output layer under autocast.
PROBE_REVISION = 2


def prefer_bf16(fp32_seconds: float, bf16_seconds: float, margin: float = BF16_MARGIN) -> bool:
    """Whether a step measured at `bf16_seconds` under autocast is worth leaving fp32 (`fp32_seconds`) for."""
    return bf16_seconds > 0 and fp32_seconds / bf16_seconds >= margin


def probe_enabled() -> bool:
    """False when `ALIGNKIT_PRECISION_PROBE` is `off`/`0`/`false`: `bf16: auto` then trains in fp32."""
    return os.environ.get(PROBE_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_key(model: nn.Module) -> str:
    """What the probe's result depends on: the CPU, torch and its thread count, the model's shape, how many of
    its weights train (LoRA or full) and alignkit's step code (`PROBE_REVISION`)."""
    config = getattr(model, "config", None)
    shape = [getattr(config, name, None) for name in
             ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size")]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return "|".join(map(str, [_cpu_model(), torch.__version__, f"threads={torch.get_num_threads()}", *shape,
                              f"trainable={trainable}", f"revision={PROBE_REVISION}"]))


def _training_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    output = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    logits = output.logits if hasattr(output, "logits") else output[0]
    # A log-partition per position costs what the stages' cross-entropy / log-prob gathers cost.
    return logits.float().logsumexp(-1).mean()


def probe_step_seconds(model: nn.Module, bf16: bool, input_ids: torch.Tensor) -> float:
    """Seconds of one training forward and backward of `input_ids` [rows, tokens], under bf16 autocast or not.

    Gradients are cleared afterwards; nothing else of the model changes.
    """
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = _training_loss(model, input_ids)
    loss.backward()
    seconds = time.perf_counter() - start
    for parameter in model.parameters():
        parameter.grad = None
    return seconds


def measure(model: nn.Module, timer: Callable[[nn.Module, bool, torch.Tensor], float] = probe_step_seconds,
            repeats: int = PROBE_REPEATS) -> dict[str, float]:
    """Median seconds per probe step in fp32 and in bf16 autocast: one warm-up each, then `repeats` alternating
    pairs. The random streams (dropout draws from them) and the model's train/eval mode are restored after."""
    states = (torch.get_rng_state(), random.getstate())
    was_training = model.training
    device = next(model.parameters()).device
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 1000)
    input_ids = torch.randint(0, vocab, (PROBE_ROWS, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    input_ids = input_ids.to(device)
    model.train()
    try:
        timer(model, False, input_ids), timer(model, True, input_ids)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for bf16 in (False, True):
                times[bf16].append(timer(model, bf16, input_ids))
    finally:
        model.train(was_training)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
    return {"fp32_s": statistics.median(times[False]), "bf16_s": statistics.median(times[True])}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(partial, path)


def probed_choice(model: nn.Module, cache_dir: Path) -> tuple[bool, str]:
    """bf16 or not for this model on this machine, from the cache or a new probe; with the reason in words."""
    from ..env import cpu_supports_bf16

    if not cpu_supports_bf16():
        return False, "this CPU has no bf16 hardware (AVX512-BF16 or AMX)"
    if not probe_enabled():
        return False, f"{PROBE_ENV}=off"
    key = probe_key(model)
    cache_path = cache_dir / PROBE_CACHE_FILE
    cache = _read_json(cache_path)
    figures = cache.get(key)
    origin = "cached probe"
    if not (isinstance(figures, dict) and {"fp32_s", "bf16_s"} <= set(figures)):
        figures = measure(model)
        origin = "probe"
        cache[key] = figures
        try:
            _write_json(cache_path, cache)
        except OSError as err:  # a read-only home only costs a probe per run
            logger.debug("precision probe not cached (%s)", err)
    bf16 = prefer_bf16(figures["fp32_s"], figures["bf16_s"])
    speed = figures["fp32_s"] / figures["bf16_s"] if figures["bf16_s"] > 0 else float("inf")
    reason = (f"{origin}: a training step of {PROBE_ROWS}x{PROBE_TOKENS} tokens took {figures['fp32_s']:.3f} s in "
              f"fp32 and {figures['bf16_s']:.3f} s in bf16 autocast ({speed:.2f}x; bf16 needs {BF16_MARGIN:.2f}x)")
    return bf16, reason


def _agree_across_processes(bf16: bool) -> bool:
    """Rank 0's choice, on every process (their probes could differ by noise)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return bf16
    choice = [bf16]
    torch.distributed.broadcast_object_list(choice, src=0)
    return bool(choice[0])


def resolve_auto_bf16(model: nn.Module, args: Any) -> bool:
    """Settle `bf16: auto` for a run about to start: set `args.bf16` (and the mixed-precision mode accelerate
    reads) and say which and why in one info line. Returns whether bf16 was chosen.

    Only a training run probes; an evaluation-only run, or one with the probe off, stays in fp32 (logged at
    debug level: nothing was chosen). A probed choice is recorded in `output_dir` for the run's resumption.
    """
    from ..env import alignkit_home

    args.bf16_auto = False  # settled here: a second trainer on the same arguments keeps it
    record_path = Path(args.output_dir) / CHOICE_FILE
    record = _read_json(record_path) if not getattr(args, "overwrite_output_dir", False) else {}
    if "bf16" in record:
        bf16, reason, probed = bool(record["bf16"]), f"chosen when this run started, {record_path}", False
    elif not args.do_train or not probe_enabled():
        bf16, reason, probed = False, "no training" if not args.do_train else f"{PROBE_ENV}=off", False
    else:
        bf16, reason = probed_choice(model, alignkit_home())
        probed = True
    bf16 = _agree_across_processes(bf16)
    if probed and getattr(args, "process_index", 0) == 0:
        _write_json(record_path, {"bf16": bf16, "reason": reason})
    args.bf16 = bf16
    args.mixed_precision = "bf16" if bf16 else "no"
    logger.log(logging.INFO if probed or "bf16" in record else logging.DEBUG,
               "bf16=auto: training in %s (%s).", "bf16 autocast" if bf16 else "fp32", reason)
    return bf16


def bf16_frozen_linears(model: nn.Module) -> int:
    """Store a frozen model's linear weights in bf16, for a model that only ever runs under bf16 autocast (a
    distillation teacher in a `bf16` run). Returns how many weights were converted.

    Autocast casts an fp32 weight to bf16 (round to nearest even, as `.to(torch.bfloat16)`) at every call, so the
    numbers are unchanged; the weights take half the memory and no call pays the cast. Left as they are: biases
    (added in the matmul's own dtype either way), weights shared with the input embedding (a tied output layer:
    the embedding feeds the fp32 residual stream), and non-float or quantized weights. The weights left in fp32 are
    copied out of the checkpoint's memory map, which then closes, so the converted fp32 pages stop counting.

    Example: the bundled model (30 layers of 7 projections, tied output layer) has 210 linear weights converted,
    106 M of its 134.5 M weights; its teacher logits under autocast are bit-equal before and after.
    """
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = {id(embeddings.weight)} if embeddings is not None and hasattr(embeddings, "weight") else set()
    converted = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module) is not nn.Linear or weight is None or id(weight) in tied
                or weight.dtype not in (torch.float32, torch.float16) or weight.requires_grad):
            continue
        weight.data = weight.data.to(torch.bfloat16)
        converted += 1
    if converted:  # the fp32 weights left are views of the checkpoint's memory map: free it (`own_mapped_weights`)
        from .loader import own_mapped_weights

        own_mapped_weights(model)
    return converted


__all__ = ["BF16_MARGIN", "bf16_frozen_linears", "CHOICE_FILE", "PROBE_CACHE_FILE", "PROBE_ENV", "measure",
           "prefer_bf16", "probe_enabled", "probe_key", "probe_step_seconds", "probed_choice", "resolve_auto_bf16"]
