"""What `bf16: auto` measures, on the model at hand: `python -m bench.precision_probe [--model M] [--rounds N]`.

Loads the model as a LoRA training run does (r=8, every linear layer), runs the probe of
`alignkit.model.precision` `--rounds` times (each: one warm-up per precision, then 3 alternating pairs) and prints
each round's fp32 and bf16-autocast seconds per step of 2x128 tokens, their ratio, the choice, and a 2048^2 matmul
in both precisions for scale. Run it alone on the machine; nothing is cached.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def matmul_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from alignkit.config.schema import FinetuningArguments, ModelArguments
    from alignkit.env import cpu_supports_bf16
    from alignkit.model.loader import load_model
    from alignkit.model.precision import _cpu_model, measure, prefer_bf16

    model = load_model(ModelArguments(model_name_or_path=args.model),
                       FinetuningArguments(finetuning_type="lora", lora_rank=8, lora_target="all"), is_trainable=True)
    rounds = []
    for _ in range(args.rounds):
        figures = measure(model)
        figures["ratio"] = figures["fp32_s"] / figures["bf16_s"]
        figures["bf16_chosen"] = prefer_bf16(figures["fp32_s"], figures["bf16_s"])
        rounds.append(figures)
        print(json.dumps(figures), flush=True)
    print(json.dumps({"cpu": _cpu_model(), "bf16_hardware": cpu_supports_bf16(), "threads": torch.get_num_threads(),
                      "matmul_gflops_fp32": round(matmul_gflops(torch.float32), 1),
                      "matmul_gflops_bf16": round(matmul_gflops(torch.bfloat16), 1), "model": args.model}))


if __name__ == "__main__":
    main()
