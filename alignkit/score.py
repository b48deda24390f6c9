"""Score responses with a trained reward model: `RewardScorer` for Python, `score_file` for `alignkit score`.

`model_dir` is what an rm run wrote: a LoRA output directory (its `adapter_config.json` names the base,
and the adapter, with its trained `score` head, is merged into it on load, after the adapters the run started
from, which its `base_adapters.json` records: an RM trained from an SFT adapter scores on base + SFT) or a full model (a full
fine-tuning run, or `alignkit export` of an adapter). Conversations are rendered and tokenised with the
data layer's chat template code, as in training, so a pair scores here exactly as it did in evaluation.
Each reward is read at the sequence's last real token from the attention mask
(`alignkit.model.heads.sequence_rewards`), so batches may be padded on either side.

Plain transformers gives the same numbers from the saved model: sequences end with the template's text
after the end-of-turn token (ChatML's newline), which is not the pad id, so its pooling at the rightmost
non-pad token lands on the same position.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .data.collator import pad_sequences
from .data.processors import infer_seqlen
from .data.template import ChatFormatter
from .config import ModelArguments
from .errors import DataError
from .files import parse_mapping
from .model.heads import sequence_rewards

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]
Prompt = Union[str, Messages]


def _as_messages(prompt: Prompt, system: Optional[str] = None) -> Messages:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system:
        messages = [{"role": "system", "content": system}] + messages
    return messages


def encode_scored(formatter: ChatFormatter, prompt: Prompt, response: str, *, tools: Optional[str] = None,
                  cutoff_len: Optional[int] = None) -> list[int]:
    """Token ids of `prompt` followed by the assistant `response`, as the rm data layer builds them.

    The one rendering of a scored sequence: `alignkit score` and the reward-model reward functions of the
    online stages (`alignkit.rewards.model`) both use it, so a reward equals the score of the same text.

    Args:
        formatter: the template the reward model was trained with.
        prompt: a user message string or a list of messages.
        response: the assistant reply scored.
        tools: tool definitions (JSON text), as in the data layer.
        cutoff_len: most tokens; longer sequences lose the start of the prompt first, as in training.
    """
    messages = _as_messages(prompt)
    prompt_text = formatter.prompt_text(messages, tools=tools)
    reply_text = formatter.reply_text(messages, response, tools=tools)
    prompt_ids, reply_ids = formatter.tokenizer([prompt_text, reply_text], add_special_tokens=False)["input_ids"]
    if cutoff_len is not None and len(prompt_ids) + len(reply_ids) > cutoff_len:
        keep_prompt, keep_reply = infer_seqlen(len(prompt_ids), len(reply_ids), cutoff_len)
        prompt_ids = prompt_ids[len(prompt_ids) - keep_prompt:] if keep_prompt else []
        reply_ids = reply_ids[:keep_reply]
    return prompt_ids + reply_ids


def score_sequences(score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], sequences: Sequence[list[int]],
                    pad_token_id: int, device, *, batch_size: int = 8, padding_side: str = "right") -> list[float]:
    """Pad token id lists `batch_size` at a time and score them with `score(input_ids, attention_mask) -> [B]`.

    Shared by `RewardScorer` and the reward-model reward functions (`alignkit.rewards.model`).
    """
    scores: list[float] = []
    for start in range(0, len(sequences), batch_size):
        batch = [list(ids) for ids in sequences[start:start + batch_size]]
        input_ids = pad_sequences(batch, pad_token_id, side=padding_side).to(device)
        attention_mask = pad_sequences([[1] * len(ids) for ids in batch], 0, side=padding_side).to(device)
        scores.extend(score(input_ids, attention_mask).float().cpu().tolist())
    return scores


class RewardScorer:
    """A reward model ready to score (prompt, response) pairs or whole conversations.

    Args:
        model_dir: rm output directory (LoRA adapter or full model) or an exported model.
        template: the chat template used in training (`template` key); None = the tokenizer's own.
        cutoff_len: most tokens per sequence; longer ones lose the start of the prompt first, as in
            training. None: no truncation.
        batch_size: sequences per forward pass.
        padding_side: `right` or `left`; the scores do not depend on it.
        device: where to run; default cuda when available, else cpu.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        template: Optional[str] = None,
        cutoff_len: Optional[int] = None,
        batch_size: int = 8,
        padding_side: str = "right",
        device: Optional[str] = None,
    ) -> None:
        from .model.loader import load_reward_model, load_tokenizer, reward_model_arguments

        model_dir = str(model_dir)
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"reward model directory {model_dir!r} does not exist; give an rm run's output_dir.")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side={padding_side!r}: choose left or right.")
        model_args = reward_model_arguments(model_dir)
        # The run saved its tokenizer beside the weights; fall back to the base's for a bare adapter.
        has_tokenizer = (Path(model_dir) / "tokenizer_config.json").is_file()
        self.tokenizer = load_tokenizer(ModelArguments(model_name_or_path=model_dir) if has_tokenizer else model_args)
        self.model = load_reward_model(model_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device)
        self.formatter = ChatFormatter(self.tokenizer, template)
        self.cutoff_len = cutoff_len
        self.batch_size = batch_size
        self.padding_side = padding_side

    def encode(self, prompt: Prompt, response: str, tools: Optional[str] = None) -> list[int]:
        """Token ids of `prompt` followed by the assistant `response`, as the rm data layer builds them."""
        return encode_scored(self.formatter, prompt, response, tools=tools, cutoff_len=self.cutoff_len)

    @torch.no_grad()
    def score_ids(self, sequences: Sequence[list[int]]) -> list[float]:
        """Rewards of already tokenised sequences, `batch_size` at a time."""
        return score_sequences(lambda ids, mask: sequence_rewards(self.model, ids, mask), sequences,
                               self.tokenizer.pad_token_id, self.device, batch_size=self.batch_size,
                               padding_side=self.padding_side)

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
        """One reward per (prompt, response); a prompt is a user message string or a list of messages."""
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses; give one response per prompt.")
        return self.score_ids([self.encode(p, r) for p, r in zip(prompts, responses)])

    def score_messages(self, conversations: Sequence[Messages]) -> list[float]:
        """One reward per conversation; the last message of each is the assistant response scored."""
        prompts, responses = [], []
        for i, messages in enumerate(conversations):
            if not messages or messages[-1].get("role") != "assistant":
                raise ValueError(f"conversation {i} does not end with an assistant message; that is what is scored.")
            prompts.append(messages[:-1])
            responses.append(messages[-1]["content"])
        return self.score(prompts, responses)


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = parse_mapping(line, f"{path} line {line_no}", syntax="json", error=DataError,
                                expected="expected a JSON object", hint="Write one object per line.")
            rows.append((line_no, row))
    return rows


def _row_to_pair(path: Path, line_no: int, row: dict[str, Any]) -> tuple[Messages, str]:
    """(prompt messages, response) from a row with `messages`, or `prompt` + `response` (+ optional `system`)."""
    where = f"{path} line {line_no}"
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict) \
                or messages[-1].get("role") != "assistant":
            raise DataError(f"{where}: `messages` must be a list of {{role, content}} ending with the assistant "
                            "message to score.")
        return messages[:-1], str(messages[-1].get("content", ""))
    missing = [key for key in ("prompt", "response") if key not in row]
    if missing:
        raise DataError(f"{where}: missing {' and '.join(f'`{m}`' for m in missing)}; each row needs `prompt` and "
                        f"`response` (or `messages` ending with an assistant turn). Columns found: {sorted(row)}.")
    if not isinstance(row["response"], str):
        raise DataError(f"{where}: `response` must be a string, got {type(row['response']).__name__}.")
    return _as_messages(row["prompt"], row.get("system")), row["response"]


def score_file(
    model_dir: str | os.PathLike,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    batch_size: int = 8,
    cutoff_len: Optional[int] = None,
    template: Optional[str] = None,
) -> int:
    """Read jsonl rows (`prompt` + `response`, or `messages`), write them back with a `score` added.

    Args:
        model_dir: rm output directory or exported reward model.
        input_path: jsonl file, one row per response to score.
        output_path: where the scored rows go (same order, every input column kept).
        batch_size: sequences per forward pass.
        cutoff_len: most tokens per sequence (None: no truncation).
        template: the chat template used in training (None: the tokenizer's own).

    Returns:
        The number of rows scored.

    Raises:
        DataError: a row is not JSON or lacks the fields; the message names the file, line and field.
    """
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"input file {str(input_path)!r} does not exist.")
    rows = _read_jsonl(input_path)  # validate every row before the model loads
    pairs = [_row_to_pair(input_path, line_no, row) for line_no, row in rows]
    scorer = RewardScorer(model_dir, template=template, cutoff_len=cutoff_len, batch_size=batch_size)
    scores = scorer.score([p for p, _ in pairs], [r for _, r in pairs])
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "w", encoding="utf-8") as f:
        for (_, row), score in zip(rows, scores):
            f.write(json.dumps({**row, "score": score}, ensure_ascii=False) + "\n")
    logger.info("Scored %d rows from %s into %s", len(rows), input_path, output_path)
    return len(rows)


__all__ = ["RewardScorer", "encode_scored", "score_file", "score_sequences"]
