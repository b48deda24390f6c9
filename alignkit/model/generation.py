"""Batched generation from chat prompts: left padding, KV cache, only the new tokens returned."""

from __future__ import annotations

from typing import Any, Sequence

import torch


@torch.no_grad()
def generate_replies(
    model,
    tokenizer,
    conversations: Sequence[list[dict[str, str]]],
    generation_kwargs: dict[str, Any],
    batch_size: int = 8,
) -> list[str]:
    """Answer each conversation (a list of `{"role", "content"}` ending with a user turn).

    Prompts are rendered with the tokenizer's chat template plus the generation prompt, padded on
    the left so that every row's new tokens start at the same column, and generated with the KV cache.
    Only the tokens after the prompt are decoded.
    """
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    replies: list[str] = []
    try:
        for start in range(0, len(conversations), batch_size):
            chunk = conversations[start : start + batch_size]
            texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chunk]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            output = model.generate(
                **batch,
                use_cache=True,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **generation_kwargs,
            )
            new_tokens = output[:, batch["input_ids"].shape[1] :]
            replies.extend(t.strip() for t in tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return replies
