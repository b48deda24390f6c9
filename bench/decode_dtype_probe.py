"""Does a rollout's decode step get faster with bf16 weights? `python -m bench.decode_dtype_probe [--rows 8]`.

One decode step of the bundled model's linear layers as `model.generation.packed_linears` runs them: every
projection of its 30 layers (q, k, v, o, gate, up, down at SmolLM2-135M's shapes) and the 49152x576 output layer,
each weight packed by oneDNN (`torch.ops.mkldnn._reorder_linear_weight`) for `--rows` rows, multiplied by random
rows, once with fp32 weights and rows and once with bf16 weights and rows. Prints the seconds per step of each
(`--steps` timed steps after 3 warm-ups) as one JSON object. Random weights: the time does not depend on the values.
On a CPU where oneDNN cannot pack bf16 weights (`alignkit.env.onednn_supports_bf16`: x86 without AVX512 BW/VL/DQ
or AVX-NE-CONVERT), `bf16_s` is null and `bf16_skipped` says why; the rollouts then decode in fp32 as well.
"""

from __future__ import annotations

import argparse
import json
import os
import time

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
# (out, in) of one layer's projections: q, k, v, o, gate, up, down.
LAYER_SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN),
                (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def step_seconds(dtype, rows: int, steps: int) -> float:
    import torch

    shapes = LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i).to(dtype), rows) for o, i in shapes]
    inputs = {size: torch.randn(rows, size).to(dtype) for size in (HIDDEN, INTERMEDIATE)}

    def step():
        for (_, size), weight in zip(shapes, packed):
            torch.ops.mkldnn._linear_pointwise(inputs[size], weight, None, "none", [], "")

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_dtype_probe", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8, help="rows per product (the decode batch).")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    opts = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
    import torch

    from alignkit.env import onednn_supports_bf16

    torch.set_num_threads(opts.threads)
    result = {"rows": opts.rows, "threads": opts.threads, "steps": opts.steps,
              "fp32_s": round(step_seconds(torch.float32, opts.rows, opts.steps), 5)}
    if onednn_supports_bf16():
        result["bf16_s"] = round(step_seconds(torch.bfloat16, opts.rows, opts.steps), 5)
    else:
        result["bf16_s"] = None
        result["bf16_skipped"] = ("oneDNN has no bf16 weight packing on this CPU (it needs AVX512 BW, VL and DQ, "
                                  "or AVX-NE-CONVERT); packed_linears keeps fp32 weights here")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
