"""Which padding-free layout is cheapest on this CPU: the measurement behind `alignkit.model.padding_free`.

    python bench/padding_free_layouts.py            # hidden-48 tiny model (2 layers)
    SMOL=1 python bench/padding_free_layouts.py     # SmolLM2-135M's layer shape (hidden 576), 2 layers
    THREADS=1 REPS=5 CASES=mix32-512,chats8 python bench/padding_free_layouts.py

One forward + backward of `forward_sequence_logps` (the DPO / SFT training forward) per layout, on fixed
length mixes at batch 32 (and 8 short chats), random weights, fp32. Layouts: padded; all real tokens in
one row (alignkit before issue 11); rows packed best-fit decreasing and bounded by the batch's longest
sequence, by 1024 or by 2048 tokens; and each sequence attended on its own (one row, a Python loop of
sdpa calls per sequence in every layer: what a variable-length kernel does, without one). Reports the
median process CPU seconds over `REPS` alternating repetitions (CPU time, not wall time, because other
programs share the cores; with THREADS=2 under load, OpenMP threads spinning while their partner waits for
a core inflate it too, so THREADS=1 gives the cleanest comparison) and the 1-minute load average. Not a test.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from alignkit.model.logprobs import forward_sequence_logps
from alignkit.model.tiny import build_tiny_model


def per_sequence_attention(module, query, key, value, attention_mask, **kwargs):
    """Causal sdpa on each sequence of a single row separately (sequences start where positions reset)."""
    positions = kwargs["position_ids"][0]
    starts = (positions == 0).nonzero().squeeze(-1).tolist() + [positions.numel()]
    passed = {k: v for k, v in kwargs.items() if k in ("dropout", "scaling")}
    outputs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **passed)[0]
               for a, b in zip(starts[:-1], starts[1:])]
    return torch.cat(outputs, 1), None


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    AttentionInterface.register("per_sequence", per_sequence_attention)
    smol = bool(os.environ.get("SMOL"))
    if smol:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                             num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True))
    else:
        model = build_tiny_model(512, hidden_size=48)
    model.config.max_position_embeddings = 4096

    def lengths(low: int, high: int, n: int, seed: int) -> list[int]:
        return torch.randint(low, high + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    cases = {"mix32-512": lengths(32, 512, 32, 1), "chats8": lengths(40, 199, 8, 2),
             "long+short32": [512] * 4 + lengths(16, 127, 28, 3)}
    if not smol:
        cases = {"all512": [512] * 32, **cases}
    if os.environ.get("CASES"):
        cases = {name: sizes for name, sizes in cases.items() if name in os.environ["CASES"].split(",")}
    # (name, padding_free, row bound, attention implementation)
    layouts = [("padded", False, 0, "sdpa"), ("one row", True, None, "sdpa"), ("rows<=longest", True, 0, "sdpa"),
               ("rows<=1024", True, 1024, "sdpa"), ("rows<=2048", True, 2048, "sdpa")]
    if not smol:
        layouts.append(("per-sequence attention", True, None, "per_sequence"))

    import alignkit.model.logprobs as logprobs

    for name, sizes in cases.items():
        width = max(sizes)
        input_ids = torch.randint(3, 500, (len(sizes), width))
        attention_mask = (torch.arange(width)[None] < torch.tensor(sizes)[:, None]).long()
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :20] = -100  # a prompt
        seconds: dict[str, list[float]] = {layout[0]: [] for layout in layouts}
        for _ in range(int(os.environ.get("REPS", "3"))):
            for layout, padding_free, bound, attention in layouts:
                if layout == "one row" and len(set(sizes)) == 1:
                    continue  # issue 11's quadratic case: minutes at 32 x 512, and measured there already
                model.config._attn_implementation = attention
                # The library picks the bound itself (`row_token_bound`); override it to compare layouts.
                logprobs.row_token_bound = lambda _model, bound=bound: bound
                started = time.process_time()
                model.zero_grad()
                sums, _ = forward_sequence_logps(model, input_ids, attention_mask, labels, padding_free=padding_free)
                sums.sum().backward()
                seconds[layout].append(time.process_time() - started)
        medians = {k: round(statistics.median(v), 2) for k, v in seconds.items() if v}
        print(f"{name} ({sum(sizes)} tokens): {medians}  load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
