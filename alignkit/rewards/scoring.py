"""Scoring with a reward model: where a reward is read, how a scored text is rendered, and `RewardScorer`.

A reward is the score at each sequence's *last real token*, found from the attention mask, so batches may be
padded on either side (`alignkit.model.heads.last_token_index`). Two ways to read it:

- `sequence_rewards(model, ...)`: `model` is a sequence-classification model (the rm stage's, a reward model
  loaded on its own). Its own `score` head runs inside its forward at every position (a forward hook captures
  that output, so any wrapper -- PEFT, DDP -- still runs its own forward). transformers' own pooling picks the
  rightmost token that is not `pad_token_id`, which with pad == eos (SmolLM2) is one token early for a
  sequence ending in eos.
- `head_rewards(model, head, ...)`: `model` is a causal LM (e.g. the policy's PEFT model with a reward
  adapter switched in, `reward_adapter_rewards`) and `head` a separate `nn.Linear`: the decoder runs without
  its LM head (no vocabulary-sized logits) and `head` reads the same last real token.

With `padding_free=True` the batch's real tokens run packed into rows with position ids restarting per
sequence (`alignkit.model.padding_free`), giving the same numbers without computing padding.

Text is rendered and tokenised with the data layer's chat template code, as in training (`encode_scored`), so
a pair scores here exactly as it did in evaluation. Plain transformers gives the same numbers from a saved
reward model: sequences end with the template's text after the end-of-turn token (ChatML's newline), which is
not the pad id, so its pooling at the rightmost non-pad token lands on the same position.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..data.collator import pad_sequences
from ..data.processors import infer_seqlen
from ..data.template import ChatFormatter
from ..config import ModelArguments
from ..model.adapters import use_adapter
from ..model.heads import find_score_head, gather_last_token_scores, last_hidden_states, last_token_index
from ..model.loader import load_tokenizer
from ..model.padding_free import flatten_for_model, last_token_per_sequence, packed_attention
from .reward_model import RewardAdapter, load_reward_model, reward_model_arguments

Messages = list[dict[str, str]]
Prompt = Union[str, Messages]


def sequence_rewards(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, padding_free: bool = False
) -> torch.Tensor:
    """One forward pass; each row's reward is the score at its last real token.

    Args:
        model: a sequence-classification model with `num_labels=1` (may be wrapped by PEFT or DDP).
        input_ids: [N, L] token ids, left- or right-padded.
        attention_mask: [N, L], 1 on real tokens.
        padding_free: run the batch's real tokens packed into rows (`alignkit.model.padding_free`) and read
            each score at its sequence's last token; the same rewards without computing padding.

    Returns:
        [N] float32 rewards (differentiable when grad is enabled).
    """
    flat = None
    if padding_free:
        flat = flatten_for_model(model, input_ids, attention_mask)
    captured: list[torch.Tensor] = []
    handle = find_score_head(model).register_forward_hook(lambda _module, _args, output: captured.append(output))
    try:
        if flat is None:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        else:
            # The model's own pad-id pooling result is ignored (with several rows it needs
            # `config.pad_token_id`, which the loader sets); the hook reads every position's score.
            with packed_attention(model, flat):
                model(input_ids=flat.input_ids, position_ids=flat.position_ids, use_cache=False)
    finally:
        handle.remove()
    expected = input_ids.shape if flat is None else flat.input_ids.shape
    if len(captured) != 1 or captured[0].shape[:2] != expected:
        raise RuntimeError("the score head did not run once on per-token hidden states; unsupported model layout.")
    if flat is None:
        return gather_last_token_scores(captured[0], attention_mask).float()
    scores = flat.from_rows(captured[0][..., 0])  # flat order
    return scores[last_token_per_sequence(flat.lengths)].float()


def head_rewards(
    model: nn.Module,
    head: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    padding_free: bool = False,
) -> torch.Tensor:
    """Rewards from a separate one-output `head` on `model`'s decoder, read at each last real token.

    Only the last token's hidden state goes through `head`, so this costs one decoder pass and N head rows.

    Args:
        model: causal-LM or sequence-classification model (wrappers allowed); its active adapter applies.
        head: module mapping [..., H] hidden states to [..., 1] (e.g. a reward adapter's score head).
        input_ids: [N, L], left- or right-padded.
        attention_mask: [N, L], 1 on real tokens.
        padding_free: run the real tokens as one row.

    Returns:
        [N] float32 rewards.
    """
    hidden, flat = last_hidden_states(model, input_ids, attention_mask, padding_free=padding_free)
    if flat is None:
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = hidden[rows, last_token_index(attention_mask).to(hidden.device)]
    else:
        last = hidden[0, last_token_per_sequence(flat.lengths)]
    return head(last.to(next(head.parameters()).dtype)).squeeze(-1).float()


def reward_adapter_rewards(
    model: nn.Module,
    reward: RewardAdapter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    padding_free: bool = False,
) -> torch.Tensor:
    """Score sequences with the named reward adapter and its head; the policy is switched back after.

    Runs under `torch.no_grad()`: rewards are targets for the policy, never differentiated.

    Args:
        model: the PEFT model holding `reward.name`.
        reward: what `load_reward_adapter` returned.
        input_ids: [N, L], left- or right-padded.
        attention_mask: [N, L], 1 on real tokens.
        padding_free: run the real tokens as one row.

    Returns:
        [N] float32 rewards, read at each sequence's last real token (as `sequence_rewards`).
    """
    with torch.no_grad(), use_adapter(model, reward.name):
        return head_rewards(model, reward.head, input_ids, attention_mask, padding_free=padding_free)


def as_messages(prompt: Prompt, system: Optional[str] = None) -> Messages:
    """A prompt as a message list: a string is one user turn; `system` goes first when given."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system:
        messages = [{"role": "system", "content": system}] + messages
    return messages


def encode_scored(formatter: ChatFormatter, prompt: Prompt, response: str, *, tools: Optional[str] = None,
                  cutoff_len: Optional[int] = None) -> list[int]:
    """Token ids of `prompt` followed by the assistant `response`, as the rm data layer builds them.

    The one rendering of a scored sequence: `RewardScorer` (`alignkit score`) and the reward-model reward
    functions of the online stages (`alignkit.rewards.model`) both use it, so a reward equals the score of the
    same text.

    Args:
        formatter: the template the reward model was trained with.
        prompt: a user message string or a list of messages.
        response: the assistant reply scored.
        tools: tool definitions (JSON text), as in the data layer.
        cutoff_len: most tokens; longer sequences lose the start of the prompt first, as in training.
    """
    messages = as_messages(prompt)
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


__all__ = [
    "Messages",
    "Prompt",
    "RewardScorer",
    "as_messages",
    "encode_scored",
    "head_rewards",
    "reward_adapter_rewards",
    "score_sequences",
    "sequence_rewards",
]
