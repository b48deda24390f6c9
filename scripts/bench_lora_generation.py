"""Does merging an unmerged LoRA adapter for the duration of generation pay off on this machine?

    python scripts/bench_lora_generation.py [--model tiny|bundled|both] [--repeats 2]

For each model: a trainable LoRA adapter (r=8, all linear layers, lora_B made non-zero as if trained),
8 chat prompts, greedy, 32 new tokens with no early stop, timed with the adapter unmerged and with
`merged_lora` (merge and restore included), alternating so that load from other programs hits both.
The figures are quoted in `alignkit/model/generation.py`'s docstring. Measure with nothing else running.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from alignkit.config.parse import parse_config
from alignkit.data.template import ChatFormatter
from alignkit.model.generation import encode_prompts, generate, merged_lora, pad_prompts
from alignkit.model.loader import load_model, load_tokenizer

PROMPTS = ["What is 12 plus 7?", "Name a colour.", "Translate to French: good morning.",
           "Write a short poem about the sea.", "Explain why the sky is blue.", "List three fruits.",
           "What is the capital of France?", "Tom has 5 apples and buys 3 more. How many?"]


def _model_dir(name: str) -> str:
    if name == "tiny":
        from alignkit.model.tiny import save_tiny_model

        return str(save_tiny_model(tempfile.mkdtemp()))
    from alignkit.model.bundled import ensure_bundled_model

    return str(ensure_bundled_model())


def measure(name: str, repeats: int, new_tokens: int) -> dict[str, float]:
    config = parse_config({"model_name_or_path": _model_dir(name), "lora_rank": 8, "lora_target": "all"})
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, config.finetuning, is_trainable=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    formatter = ChatFormatter(tokenizer)
    ids, mask = pad_prompts(encode_prompts(formatter, [[{"role": "user", "content": p}] for p in PROMPTS]),
                            tokenizer.pad_token_id)
    # No stop token, so every run decodes exactly `new_tokens` steps.
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    generate(model, tokenizer, ids, mask, stop_token_ids=[], generation_kwargs={"max_new_tokens": 2})  # warm-up
    times: dict[str, list[float]] = {"unmerged": [], "merged": [], "merge_and_restore": []}
    for _ in range(repeats):
        for merge in (False, True):
            start = time.perf_counter()
            generate(model, tokenizer, ids, mask, stop_token_ids=[], generation_kwargs=kwargs, merge_lora=merge)
            times["merged" if merge else "unmerged"].append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad(), merged_lora(model):
            pass
        times["merge_and_restore"].append(time.perf_counter() - start)
    return {k: min(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "bundled", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}; batch {len(PROMPTS)}, {args.new_tokens} new tokens, greedy")
    for name in (["tiny", "bundled"] if args.model == "both" else [args.model]):
        t = measure(name, args.repeats, args.new_tokens)
        print(f"{name}: unmerged {t['unmerged']:.3f} s, merged {t['merged']:.3f} s "
              f"(merge + restore alone {t['merge_and_restore']:.3f} s); best of {args.repeats}", flush=True)


if __name__ == "__main__":
    main()
