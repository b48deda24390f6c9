"""Canonical examples → token ids and labels, one function per kind of example.

Every function works on chunks produced by `ChatFormatter.chunks` so label masks come from positions.
`cutoff_len` is honoured the same way everywhere: the prompt keeps its end (where the generation prompt
is) and loses its beginning, the response keeps its beginning; an example whose response would get no
tokens at all is dropped (and reported by the caller), never trained on.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import sys
from typing import Any, Optional, Sequence

from ..constants import IGNORE_INDEX
from .multimodal import IMAGE_COLUMN, ImageProcessing, image_tokens_whole, mask_image_labels, tokenize_with_images
from .template import ChatFormatter, adds_bos

logger = logging.getLogger(__name__)
REPORT_ROWS = 5  # rows named in a warning


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """Split `cutoff_len` tokens between a prompt and a response that do not fit together.

    A short response (under half the budget) is kept whole; else a short prompt is kept whole and the
    response gets the rest; else both are cut in proportion to their lengths (LLaMA-Factory's rule).

    Args:
        source_len: prompt tokens.
        target_len: response tokens.
        cutoff_len: the budget.

    Returns:
        (new_source_len, new_target_len), summing to at most `cutoff_len`.
    """
    if target_len * 2 < cutoff_len:
        max_target = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target = cutoff_len - source_len
    else:
        max_target = int(cutoff_len * target_len / (source_len + target_len))
    new_target = min(max_target, target_len)
    new_source = min(max(cutoff_len - new_target, 0), source_len)
    return new_source, new_target


def _tokenize(tokenizer, texts: list[str], expansions: Sequence[Sequence[int]] = ()) -> list[list[int]]:
    # Special tokens are written by the template as text; the tokenizer must not add its own bos/eos.
    if not texts:
        return []
    if expansions:  # a vision-language example: each <image> placeholder becomes its image's tokens
        return tokenize_with_images(tokenizer, texts, expansions)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _left_cut(ids: list[int], keep: int) -> list[int]:
    return ids[len(ids) - keep:] if keep > 0 else []


def encode_supervised(formatter: ChatFormatter, example: dict, cutoff_len: int,
                      train_on_prompt: bool = False, mask_history: bool = False,
                      expansions: Sequence[Sequence[int]] = ()) -> Optional[dict[str, list[int]]]:
    """Token ids of a conversation with labels on every assistant reply (or on everything).

    Truncation: whole turns are kept from the start while they fit; if not even the first turn fits,
    its prompt and reply share the budget (`infer_seqlen`). With `mask_history` (LLaMA-Factory's key) only the
    last reply is labelled, and turns are kept from the end instead, so the trained turn is never the one cut.

    Returns:
        `input_ids`, `attention_mask`, `labels` (-100 where not trained), or None when no reply token fits.
    """
    chunks = formatter.chunks(example["messages"], tools=example.get("tools"))
    ids = _tokenize(formatter.tokenizer, [text for text, _ in chunks], expansions)
    turns: list[tuple[list[int], list[int]]] = []
    pending: list[int] = []
    for (_, trained), chunk_ids in zip(chunks, ids):
        if trained:
            turns.append((pending, chunk_ids))
            pending = []
        else:
            pending = pending + chunk_ids
    order = turns[::-1] if mask_history else turns
    kept: list[tuple[list[int], list[int]]] = []
    used = 0
    for prompt_ids, reply_ids in order:
        if used + len(prompt_ids) + len(reply_ids) > cutoff_len:
            break
        kept.append((prompt_ids, reply_ids))
        used += len(prompt_ids) + len(reply_ids)
    if not kept:
        prompt_ids, reply_ids = order[0]
        source_len, target_len = infer_seqlen(len(prompt_ids), len(reply_ids), cutoff_len)
        if target_len == 0:
            return None
        kept = [(_left_cut(prompt_ids, source_len), reply_ids[:target_len])]
    if mask_history:
        kept.reverse()
    input_ids: list[int] = []
    labels: list[int] = []
    for turn, (prompt_ids, reply_ids) in enumerate(kept):
        trained = not mask_history or turn == len(kept) - 1
        input_ids += prompt_ids + reply_ids
        labels += (prompt_ids if train_on_prompt else [IGNORE_INDEX] * len(prompt_ids))
        labels += reply_ids if trained else [IGNORE_INDEX] * len(reply_ids)
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def encode_generation_eval(formatter: ChatFormatter, example: dict, cutoff_len: int,
                           expansions: Sequence[Sequence[int]] = ()) -> Optional[dict[str, list[int]]]:
    """For `predict_with_generate`: the prompt (ending with the generation prompt) and, as `labels`, the
    reference reply's ids (no -100). Returns None when no reply token fits."""
    messages, tools = example["messages"], example.get("tools")
    prompt_text = formatter.prompt_text(messages[:-1], tools=tools)
    reply_text = formatter.reply_text(messages[:-1], messages[-1]["content"], tools=tools)
    prompt_ids, reply_ids = _tokenize(formatter.tokenizer, [prompt_text, reply_text], expansions)
    source_len, target_len = infer_seqlen(len(prompt_ids), len(reply_ids), cutoff_len)
    if target_len == 0:
        return None
    prompt_ids = _left_cut(prompt_ids, source_len)
    return {"input_ids": prompt_ids, "attention_mask": [1] * len(prompt_ids), "labels": reply_ids[:target_len]}


def encode_pairwise(formatter: ChatFormatter, example: dict, cutoff_len: int,
                    expansions: Sequence[Sequence[int]] = ()) -> tuple[Optional[dict[str, Any]], str]:
    """Chosen and rejected sequences sharing one prompt, labels -100 on the prompt.

    Returns:
        (features, "") or (None, reason) when the pair is dropped: identical replies, or no reply token
        fits in `cutoff_len`, or the replies become identical after truncation.
    """
    if example["chosen"] == example["rejected"]:
        return None, "chosen and rejected are identical"
    prompt, tools = example["prompt"], example.get("tools")
    texts = [formatter.prompt_text(prompt, tools=tools), formatter.reply_text(prompt, example["chosen"], tools=tools),
             formatter.reply_text(prompt, example["rejected"], tools=tools)]
    prompt_ids, chosen_ids, rejected_ids = _tokenize(formatter.tokenizer, texts, expansions)
    source_len, target_len = infer_seqlen(len(prompt_ids), max(len(chosen_ids), len(rejected_ids)), cutoff_len)
    if target_len == 0:
        return None, f"no response token fits in cutoff_len={cutoff_len}"
    prompt_ids = _left_cut(prompt_ids, source_len)
    chosen_ids, rejected_ids = chosen_ids[:target_len], rejected_ids[:target_len]
    if chosen_ids == rejected_ids:
        return None, f"chosen and rejected are identical within cutoff_len={cutoff_len}"
    features: dict[str, Any] = {}
    for name, reply_ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        features[f"{name}_input_ids"] = prompt_ids + reply_ids
        features[f"{name}_attention_mask"] = [1] * (len(prompt_ids) + len(reply_ids))
        features[f"{name}_labels"] = [IGNORE_INDEX] * len(prompt_ids) + reply_ids
    if example.get("margin") is not None:
        features["margin"] = example["margin"]
    return features, ""


def encode_unpaired(formatter: ChatFormatter, example: dict, cutoff_len: int,
                    expansions: Sequence[Sequence[int]] = ()) -> Optional[dict[str, Any]]:
    """One KTO reply after its prompt, labels -100 on the prompt, and its `desirable` flag.

    Returns:
        `input_ids`, `attention_mask`, `labels`, `desirable`; None when no reply token fits in `cutoff_len`.
    """
    prompt, tools = example["prompt"], example.get("tools")
    prompt_ids, reply_ids = _tokenize(formatter.tokenizer, [formatter.prompt_text(prompt, tools=tools),
                                                            formatter.reply_text(prompt, example["completion"], tools=tools)],
                                     expansions)
    source_len, target_len = infer_seqlen(len(prompt_ids), len(reply_ids), cutoff_len)
    if target_len == 0:
        return None
    prompt_ids, reply_ids = _left_cut(prompt_ids, source_len), reply_ids[:target_len]
    return {"input_ids": prompt_ids + reply_ids, "attention_mask": [1] * (len(prompt_ids) + len(reply_ids)),
            "labels": [IGNORE_INDEX] * len(prompt_ids) + reply_ids, "desirable": bool(example["desirable"])}


def encode_prompt(formatter: ChatFormatter, example: dict, cutoff_len: int,
                  expansions: Sequence[Sequence[int]] = ()) -> tuple[dict[str, Any], int]:
    """The prompt for RL generation (left-truncated to `cutoff_len`) plus the row's other columns.

    `prompt_messages` and `prompt_conversational` keep the prompt as written, for reward functions, which
    take it in TRL's shapes: the messages for a conversational row, the user's text for a standard one
    (alpaca, or a TRL `prompt` string).

    Returns:
        (the features, how many tokens were cut from the prompt's start: report them with `warn_cut_prompts`,
        since the policy then sees less than the reward functions do).
    """
    (prompt_ids,) = _tokenize(formatter.tokenizer, [formatter.prompt_text(example["prompt"], tools=example.get("tools"))],
                              expansions)
    cut = max(len(prompt_ids) - cutoff_len, 0)
    prompt_ids = _left_cut(prompt_ids, len(prompt_ids) - cut)
    features: dict[str, Any] = {k: v for k, v in example["extra"].items()
                                if k not in ("input_ids", "attention_mask")}
    features.update(input_ids=prompt_ids, attention_mask=[1] * len(prompt_ids), prompt_messages=example["prompt"],
                    prompt_conversational=example.get("conversational", True))
    return features, cut


def warn_cut_prompts(cut: list[tuple[str, int]], total: int, cutoff_len: int) -> None:
    """Say which prompts `encode_prompt` cut: [(row reference, tokens cut)] of `total` prompts."""
    if cut:
        logger.warning(
            "Cut the start off %d of %d prompts longer than cutoff_len=%d tokens (up to %d tokens each): the policy "
            "sees only their end, the reward functions the whole prompt. Rows: %s%s. Raise cutoff_len or shorten "
            "those prompts.", len(cut), total, cutoff_len, max(n for _, n in cut),
            ", ".join(ref for ref, _ in cut[:REPORT_ROWS]), " ..." if len(cut) > REPORT_ROWS else "")


def encode_pretrain(tokenizer, texts: list[str], cutoff_len: int) -> dict[str, list[list[int]]]:
    """Concatenate the texts (each closed by eos, opened by bos when the tokenizer adds one) and cut the
    stream into blocks of `cutoff_len` tokens; the last block may be shorter. Every token is trained."""
    bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for ids in _tokenize(tokenizer, texts):
        stream += bos + ids + eos
    blocks = [stream[i: i + cutoff_len] for i in range(0, len(stream), cutoff_len)]
    return {"input_ids": blocks, "attention_mask": [[1] * len(b) for b in blocks], "labels": [list(b) for b in blocks]}


# Examples per task handed to a tokenisation worker process (`tokenize_examples(num_workers=...)`), and the fewest
# examples per worker worth forking for: below that a process costs more than it saves.
WORKER_CHUNK = 512
MIN_EXAMPLES_PER_WORKER = 256
# What forked workers read (set in the parent just before the pool forks, so nothing is pickled to them).
_FORK_STATE: Optional[tuple] = None


def tokenize_examples(examples: list[tuple[str, dict]], kind: str, formatter: ChatFormatter, cutoff_len: int,
                      train_on_prompt: bool = False, for_generation: bool = False, mask_history: bool = False,
                      images: Optional[ImageProcessing] = None, num_workers: Optional[int] = None,
                      ) -> tuple[dict[str, list], list[tuple[str, str]]]:
    """Tokenise canonical examples of one kind.

    Args:
        examples: (reference for messages, e.g. `data/x.json row 3`; canonical example) pairs.
        kind: `text`, `supervised`, `preference`, `unpaired` or `prompt`.
        formatter: the chat template.
        cutoff_len: most tokens per sequence.
        train_on_prompt: sft/pt: also train on prompt tokens.
        mask_history: sft: train on the last reply only (`encode_supervised`).
        for_generation: sft: prompt-only inputs with reference-reply labels (predict_with_generate).
        images: a vision-language model's processor: each example's `images` become its image tokens (never
            labelled), the paths are kept in an `images` column, and an example whose image tokens `cutoff_len`
            would cut is dropped.
        num_workers: `preprocessing_num_workers`: tokenise in this many forked processes, in order, with the
            same result as one (`text` examples are one batched call to the fast tokenizer, which uses its own
            threads). Fewer where the examples are few (`MIN_EXAMPLES_PER_WORKER` each); one off Linux.

    Returns:
        (columns as a dict of lists, [(reference, reason)] of the dropped examples).
    """
    if kind == "text":
        return encode_pretrain(formatter.tokenizer, [ex["text"] for _, ex in examples], cutoff_len), []
    options = (kind, formatter, cutoff_len, train_on_prompt, for_generation, mask_history, images)
    workers = min(num_workers or 1, len(examples) // MIN_EXAMPLES_PER_WORKER)
    # Forked workers on Linux only: macOS's system libraries are not safe to use in a child forked from a process
    # that has loaded them (why Python starts its processes there by spawning), and Windows cannot fork.
    if workers > 1 and sys.platform.startswith("linux"):
        rows, dropped, cut = _encode_in_workers(examples, options, workers)
    else:
        if workers > 1:
            logger.warning("preprocessing_num_workers=%d: tokenising in one process (workers are forked on Linux "
                           "only).", num_workers)
        rows, dropped, cut = _encode_examples(examples, *options)
    warn_cut_prompts(cut, len(examples), cutoff_len)
    return _to_columns(rows, fill={"margin": 0.0}), dropped


def _encode_in_workers(examples: list[tuple[str, dict]], options: tuple, workers: int
                       ) -> tuple[list[dict[str, Any]], list[tuple[str, str]], list[tuple[str, int]]]:
    """`_encode_examples` over slices of `examples` in `workers` forked processes, joined in order."""
    global _FORK_STATE
    bounds = [(i, min(i + WORKER_CHUNK, len(examples))) for i in range(0, len(examples), WORKER_CHUNK)]
    rows: list[dict[str, Any]] = []
    dropped: list[tuple[str, str]] = []
    cut: list[tuple[str, int]] = []
    _FORK_STATE = (examples, options)
    # A fast tokenizer that used its threads before the fork warns in each child and turns them off there;
    # the children inherit this setting instead (each works serially, as a worker should).
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            for part in pool.map(_encode_slice, bounds):
                rows += part[0]
                dropped += part[1]
                cut += part[2]
    finally:
        _FORK_STATE = None
        if parallelism is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism
    return rows, dropped, cut


def _encode_slice(bounds: tuple[int, int]):
    """A worker's task: the examples `bounds` delimits, from the state its parent forked with."""
    examples, options = _FORK_STATE
    return _encode_examples(examples[bounds[0]: bounds[1]], *options)


def _encode_examples(examples: list[tuple[str, dict]], kind: str, formatter: ChatFormatter, cutoff_len: int,
                     train_on_prompt: bool, for_generation: bool, mask_history: bool,
                     images: Optional[ImageProcessing],
                     ) -> tuple[list[dict[str, Any]], list[tuple[str, str]], list[tuple[str, int]]]:
    """The rows of the examples kept, the (reference, reason) of those dropped, and the prompts cut."""
    rows: list[dict[str, Any]] = []
    dropped: list[tuple[str, str]] = []
    cut: list[tuple[str, int]] = []
    for ref, example in examples:
        paths = (example.get("images") or []) if images is not None else []
        expansions = [images.expansion(path) for path in paths] if paths else []
        if kind == "supervised":
            feats = (encode_generation_eval(formatter, example, cutoff_len, expansions) if for_generation
                     else encode_supervised(formatter, example, cutoff_len, train_on_prompt, mask_history, expansions))
            reason = f"no response token fits in cutoff_len={cutoff_len}"
        elif kind == "preference":
            feats, reason = encode_pairwise(formatter, example, cutoff_len, expansions)
        elif kind == "unpaired":
            feats = encode_unpaired(formatter, example, cutoff_len, expansions)
            reason = f"no reply token fits in cutoff_len={cutoff_len}"
        else:
            (feats, tokens_cut), reason = encode_prompt(formatter, example, cutoff_len, expansions), ""
            if tokens_cut:
                cut.append((ref, tokens_cut))
        if feats is not None and images is not None:
            feats, reason = _with_images(feats, paths, expansions, images, cutoff_len, reason)
        if feats is None:
            dropped.append((ref, reason))
        else:
            rows.append(feats)
    return rows, dropped, cut


def _with_images(feats: dict[str, Any], paths: list[str], expansions: list, images: ImageProcessing,
                 cutoff_len: int, reason: str) -> tuple[Optional[dict[str, Any]], str]:
    """`feats` with image positions unlabelled and the image paths kept; None when cutoff_len cut an image."""
    special = images.special_ids(expansions)
    for prefix in ("", "chosen_", "rejected_"):
        ids = feats.get(f"{prefix}input_ids")
        if ids is None:
            continue
        if not image_tokens_whole(ids, expansions, images.image_token_id):
            return None, f"cutoff_len={cutoff_len} cuts into an image's tokens"
        if len(feats.get(f"{prefix}labels") or ()) == len(ids):  # a generation prompt's labels are the reply
            feats[f"{prefix}labels"] = mask_image_labels(ids, feats[f"{prefix}labels"], special)
    return dict(feats, **{IMAGE_COLUMN: list(paths)}), reason


def _to_columns(rows: list[dict[str, Any]], fill: dict[str, Any]) -> dict[str, list]:
    """Rows → columns; a column some rows lack gets `fill`'s value (0.0 margin = no margin) or None."""
    names: list[str] = []
    for row in rows:
        names += [k for k in row if k not in names]
    return {name: [row.get(name, fill.get(name)) for row in rows] for name in names}
