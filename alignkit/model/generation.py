"""Token-level generation shared by chat, the demo, SFT prediction and (next) GRPO/PPO rollouts.

One path from prompts to completions:

1. Prompts are rendered by the configured template (`ChatFormatter`: the tokenizer's own, `chatml`,
   `llama3` or `plain`) and tokenised exactly as the data layer tokenises them for training
   (`encode_prompts`), or arrive as token ids already (the data layer's prompt-only rows).
2. Batches are left-padded (`pad_prompts`, `left_pad`), so every row's new tokens start at the same
   column. Rows are found by the attention mask, never by the pad id (pad == eos in SmolLM2).
3. `generate` runs `model.generate` in eval mode without gradients and with the KV cache (training turns
   `config.use_cache` off), stopping each row at the template's end-of-turn token
   (`ChatFormatter.stop_token_ids`). It returns token ids and masks, not only text: `completion_mask`
   covers each completion up to and including its first stop token, and `truncated` marks rows that ran
   out of `max_new_tokens` before stopping (GRPO's `mask_truncated_completions`).
4. LoRA cost: with an unmerged adapter every decoded token pays the adapter's extra matmuls and kernel
   launches in each targeted layer. `merged_lora` merges the active adapter into copies of the base
   weights for the duration of generation and puts the original tensors back afterwards, so training
   sees bit-for-bit the weights it had (PEFT's merge/unmerge round trip is not exact in fp32). Putting
   them back skips PEFT's unmerge for plain LoRA: it would compute every delta a second time only to
   subtract it from the copies that are dropped.

   Measured on this CPU (2 cores shared with other programs, fp32, LoRA r=8 on all linear layers with
   random non-zero B, greedy, batch 8, exactly 32 new tokens, best of 2 alternating repeats;
   `python scripts/bench_lora_generation.py --model tiny` and `--model bundled`, 2026-11-30):

   - tiny model (2 layers, hidden 64): unmerged 3.14 s, merged 2.75 s (merge + restore alone 0.02 s);
   - bundled SmolLM2-135M-Instruct: unmerged 283.8 s, merged 216.5 s (merge + restore alone 16.1 s).

   The bundled run shared the cores with a load average of 7 to 15 (it got about a quarter of a core:
   6.8 CPU-minutes in 26.6 minutes), so its absolute times are inflated several-fold; both arms ran
   alternately under the same load, and merging was faster on both models (12% and 24%).
   So `generate` merges by default (`merge_lora=True`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from ..data.collator import _pad_id, pad_sequences
from ..data.template import ChatFormatter, Message


@dataclass
class Generation:
    """What one batch of generation produced, row by row.

    Attributes:
        prompt_ids: (batch, prompt_len) the prompts, left-padded.
        prompt_mask: (batch, prompt_len) 1 on real prompt tokens.
        completion_ids: (batch, completion_len) the new tokens only; after a row's first stop token
            they are filler (the pad id) and masked out.
        completion_mask: (batch, completion_len) 1 up to and including the first stop token, 0 after.
        truncated: (batch,) bool, True where the row hit `max_new_tokens` without a stop token.
        texts: the completions decoded without special tokens (masked tokens excluded).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor
    texts: list[str]


def encode_prompts(formatter: ChatFormatter, conversations: Sequence[list[Message]],
                   tools: Optional[Sequence[Optional[str]]] = None) -> list[list[int]]:
    """Token ids of each conversation followed by the template's generation prompt.

    Special tokens are written by the template as text, so the tokenizer adds none of its own: the ids
    equal the prompt part of a training example rendered by the same template.

    Args:
        formatter: the template (see `ChatFormatter`).
        conversations: lists of `{"role", "content"}` messages, each ending where the reply should start.
        tools: optional tool definitions per conversation (JSON text), as in the data layer.
    """
    tools = list(tools) if tools is not None else [None] * len(conversations)
    texts = [formatter.prompt_text(messages, tools=t) for messages, t in zip(conversations, tools)]
    return formatter.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def pad_prompts(prompt_ids: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of prompt ids → left-padded (input_ids, attention_mask), both (batch, longest prompt)."""
    if any(len(ids) == 0 for ids in prompt_ids):
        raise ValueError("an empty prompt cannot be generated from: every prompt needs at least one token.")
    rows = [list(ids) for ids in prompt_ids]
    return pad_sequences(rows, pad_token_id, side="left"), pad_sequences([[1] * len(r) for r in rows], 0, side="left")


def left_pad(input_ids: torch.Tensor, attention_mask: torch.Tensor,
             pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every row's real tokens to the right end, whatever side the batch was padded on.

    Generation appends new tokens after the last column, so prompts must end there. Rows are found by
    the attention mask, never by the pad id (pad == eos in SmolLM2, and a real eos may sit in a prompt).

    Args:
        input_ids: (batch, seq) prompt ids, padded on either side.
        attention_mask: (batch, seq) 1 on real tokens.
        pad_token_id: id written into the freed columns.

    Returns:
        (input_ids, attention_mask), both (batch, seq), left-padded.
    """
    mask = attention_mask.bool()
    # A stable sort of the mask puts each row's padding first and keeps its real tokens in order.
    order = torch.sort(mask.int(), dim=1, stable=True).indices
    left_ids = torch.gather(input_ids, 1, order)
    left_mask = torch.gather(attention_mask, 1, order)
    return left_ids.masked_fill(left_mask == 0, pad_token_id), left_mask


def completion_mask(completion_ids: torch.Tensor,
                    stop_token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Which new tokens belong to each completion, and which completions never stopped.

    A completion ends with its first stop token, which is kept (the model is trained and scored on
    ending its turn); what `generate` writes after it is filler.

    Args:
        completion_ids: (batch, length) new tokens.
        stop_token_ids: ids that end a turn.

    Returns:
        (mask, truncated): mask (batch, length) long, 1 up to and including the first stop token and 0
        after it, all 1 in a row without one; truncated (batch,) bool, True for rows without a stop token.
    """
    stops = torch.isin(completion_ids, torch.as_tensor(list(stop_token_ids), dtype=completion_ids.dtype,
                                                       device=completion_ids.device))
    # Stop tokens strictly before each position; a position is in the completion while there are none.
    stops_before = torch.cumsum(stops.long(), dim=1) - stops.long()
    return (stops_before == 0).long(), ~stops.any(dim=1)


def stop_token_ids(tokenizer, template: Optional[str] = None) -> list[int]:
    """`ChatFormatter(tokenizer, template).stop_token_ids()`; for a tokenizer without a chat template and
    no `template` (a base model trained with `stage: pt`), its eos alone."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return ChatFormatter(tokenizer, template).stop_token_ids()


def _lora_layers(model) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextmanager
def merged_lora(model) -> Iterator[bool]:
    """Merge the active LoRA adapter into the base weights while the block runs; yields whether it did.

    Decoding then costs what the base model costs. The merge writes into copies of the base tensors, and
    on exit the original tensors are put back untouched, so the weights training sees afterwards are
    bit-for-bit the ones it had (merge followed by unmerge is not exact in fp32), and each delta `B @ A`
    is computed once (PEFT's unmerge, which would compute it again, runs only for variants such as DoRA
    whose caches need it). Memory: one extra copy of the adapted layers' weights while the block runs.

    Nothing is done (yields False) for a model without LoRA layers (a plain model, or adapters merged at
    load time), when the adapter is disabled (`with model.disable_adapter():`, the reference policy) or
    already merged. Use it under `torch.no_grad()`: gradients do not flow through merged weights.
    """
    layers = _lora_layers(model)
    unmergeable = not layers or not hasattr(model, "merge_adapter")
    if unmergeable or any(layer.disable_adapters or layer.merged for layer in layers):
        yield False
        return
    originals: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    for layer in layers:
        for param in layer.get_base_layer().parameters(recurse=False):
            originals.append((param, param.data))
            param.data = param.data.clone()
    try:
        model.merge_adapter()
        yield True
    finally:
        if any(name in getattr(layer, "lora_variant", {}) for layer in layers for name in layer.merged_adapters):
            # Variants (DoRA) keep caches that only their own unmerge clears.
            model.unmerge_adapter()
        else:
            # Plain LoRA: PEFT's unmerge would recompute every delta (B @ A) only to subtract it from copies
            # that are dropped below; clearing its record of the merge is all the bookkeeping there is.
            for layer in layers:
                layer.merged_adapters.clear()
        for param, data in originals:
            param.data = data


def generate(
    model,
    tokenizer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    stop_token_ids: Sequence[int],
    generation_kwargs: Optional[dict[str, Any]] = None,
    merge_lora: bool = True,
    streamer=None,
) -> Generation:
    """Generate completions for a batch of tokenised prompts.

    Args:
        model: a causal LM, plain or a `PeftModel`.
        tokenizer: gives the pad id and decodes the texts.
        input_ids: (batch, seq) prompts, padded on either side (they are left-padded here).
        attention_mask: (batch, seq) 1 on real prompt tokens.
        stop_token_ids: ids that end a row (`ChatFormatter.stop_token_ids()`); each row stops at its own.
            Empty: no row stops before `max_new_tokens`.
        generation_kwargs: for `model.generate` (`GeneratingArguments.to_generation_kwargs()`:
            `max_new_tokens`, sampling knobs, ...; also `logits_processor`).
        merge_lora: merge an unmerged LoRA adapter for the duration (`merged_lora`); faster on this CPU.
        streamer: a transformers streamer (batch 1), for chat.

    Returns:
        A `Generation`. With `num_return_sequences=k`, row i*k+j is the j-th completion of prompt i and
        the prompts are repeated to match.
    """
    kwargs = dict(generation_kwargs or {})
    pad_token_id = _pad_id(tokenizer)
    stop_token_ids = list(stop_token_ids)
    prompt_ids, prompt_mask = left_pad(input_ids, attention_mask, pad_token_id)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), (merged_lora(model) if merge_lora else nullcontext()):
            output = model.generate(
                input_ids=prompt_ids.to(device),
                attention_mask=prompt_mask.to(device),
                use_cache=True,  # even when training turned it off in the model's config
                pad_token_id=pad_token_id,
                # An empty list (not None, which means the model's own eos) runs to max_new_tokens.
                eos_token_id=stop_token_ids,
                streamer=streamer,
                **kwargs,
            )
    finally:
        model.train(was_training)
    completion_ids = output[:, prompt_ids.shape[1]:].contiguous()
    repeats = completion_ids.shape[0] // prompt_ids.shape[0]
    if repeats > 1:
        prompt_ids = prompt_ids.repeat_interleave(repeats, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(repeats, dim=0)
    mask, truncated = completion_mask(completion_ids, stop_token_ids)
    texts = tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(completion_ids, mask)],
                                   skip_special_tokens=True)
    return Generation(prompt_ids.to(device), prompt_mask.to(device), completion_ids, mask, truncated, texts)


def generate_replies(
    model,
    formatter: ChatFormatter,
    conversations: Sequence[list[Message]],
    generation_kwargs: dict[str, Any],
    batch_size: int = 8,
) -> list[str]:
    """Answer each conversation (messages ending with a user turn) in batches; replies stripped of
    surrounding whitespace. Prompts go through `formatter`'s template and stop at its end of turn."""
    pad_token_id = _pad_id(formatter.tokenizer)
    stop_ids = formatter.stop_token_ids()
    replies: list[str] = []
    for start in range(0, len(conversations), batch_size):
        input_ids, attention_mask = pad_prompts(encode_prompts(formatter, conversations[start:start + batch_size]),
                                                pad_token_id)
        out = generate(model, formatter.tokenizer, input_ids, attention_mask, stop_token_ids=stop_ids,
                       generation_kwargs=generation_kwargs)
        replies.extend(text.strip() for text in out.texts)
    return replies


__all__ = ["Generation", "stop_token_ids", "encode_prompts", "pad_prompts", "left_pad", "completion_mask", "merged_lora",
           "generate", "generate_replies"]
