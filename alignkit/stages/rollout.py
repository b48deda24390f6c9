"""Rollouts for the online stages (GRPO, PPO): sample completions, score them, read their log-probs.

Each function takes a model, tensors or lists and returns tensors; none reads a trainer or a config, so
GRPO and PPO share them as they are.

- `sample_completions`: one batch of prompts (token ids) → a `Generation` (left-padded prompts, completion
  ids, `completion_mask` up to and including each row's stop token, `truncated`), sampled under a seed of
  its own (`rollout_seed`), so the same round gives the same completions in a resumed run, and with the
  LoRA adapter merged while decoding (`alignkit.model.generation.merged_lora`).
- `completion_logps`: per-token log-probs (and, for metrics, entropies) of the completion tokens under a
  model, logits divided by the sampling temperature, as the policy gradient needs them.
- `trl_prompts` / `trl_completions`: prompts and completions in the shapes TRL's reward functions take.
- `score_completions`: the reward functions' `[N, F]` matrix and the weighted `[N]` reward.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from ..data.collator import _pad_id
from ..model.generation import Generation, generate, pad_prompts
from ..model.logprobs import selective_log_softmax

# Rows of logits per entropy chunk: bounds the softmax temporary to about this many elements.
_ENTROPY_CHUNK_ELEMENTS = 1 << 24


def rollout_seed(seed: int, round_index: int) -> int:
    """The sampling seed of generation round `round_index` of a run seeded with `seed`.

    Seeding each round on its own (rather than drawing from one running generator) makes a round's
    completions depend only on the weights and this number, so a run resumed from a checkpoint samples
    what the uninterrupted run sampled. Example: seed 42, round 3 → 42 * 1_000_003 + 3 = 42000129.
    """
    return (seed * 1_000_003 + round_index) % (2**63 - 1)


def sample_completions(
    model,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    *,
    stop_token_ids: Sequence[int],
    generation_kwargs: dict[str, Any],
    seed: int,
    merge_lora: bool = True,
) -> Generation:
    """Sample one completion per prompt row with its own seed, leaving the global RNG as it was.

    Args:
        model: the policy (plain or a `PeftModel`); put in eval mode while decoding, restored after.
        tokenizer: gives the pad id and decodes the completions.
        prompt_ids: token ids per row (a prompt repeated k times gives k rows, each sampled on its own).
        stop_token_ids: ids that end a row (the template's end of turn, `ChatFormatter.stop_token_ids()`).
        generation_kwargs: for `model.generate` (`max_new_tokens`, `do_sample`, `temperature`, ...).
        seed: sampling seed (`rollout_seed`).
        merge_lora: decode with the LoRA adapter merged into the base weights (restored exactly after).

    Returns:
        A `Generation` (see `alignkit.model.generation`).
    """
    input_ids, attention_mask = pad_prompts(prompt_ids, _pad_id(tokenizer))
    devices = [torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return generate(model, tokenizer, input_ids, attention_mask, stop_token_ids=stop_token_ids,
                        generation_kwargs=generation_kwargs, merge_lora=merge_lora)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax of `logits` over the last dimension, row chunk by row chunk, without gradient.

    `H = logsumexp(z) - sum_v softmax(z)_v * z_v`. Example: logits [0, 0] give H = log 2 = 0.6931.

    Args:
        logits: `[..., V]`.

    Returns:
        `[...]` float32 entropies (nats).
    """
    with torch.no_grad():
        rows = logits.reshape(-1, logits.size(-1))
        out = torch.empty(rows.size(0), dtype=torch.float32, device=logits.device)
        step = max(1, _ENTROPY_CHUNK_ELEMENTS // max(rows.size(-1), 1))
        for start in range(0, rows.size(0), step):
            chunk = rows[start:start + step].float()
            probs = chunk.softmax(-1)
            out[start:start + step] = torch.logsumexp(chunk, -1) - (probs * chunk).sum(-1)
        return out.view(logits.shape[:-1])


def completion_logps(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    batch_size: Optional[int] = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs of the completion tokens, `log softmax(logits / temperature)[token]`.

    The model runs on `[prompt; completion]` (prompts left-padded, completions right-padded by their
    mask) and only the last `C + 1` positions reach the output layer: position `P - 1 + j` predicts
    completion token j. Dividing by the sampling temperature scores the tokens under the distribution
    they were sampled from, as TRL does.

    Args:
        model: a causal LM accepting `logits_to_keep` (a `PeftModel` forwards it).
        prompt_ids, prompt_mask: `[N, P]` left-padded prompts and their mask.
        completion_ids, completion_mask: `[N, C]` completions and their mask (0 after the stop token).
        temperature: sampling temperature (> 0).
        batch_size: rows per forward pass (default: all at once); bounds activation memory without grad.
        with_entropy: also return each position's entropy (no gradient; for the `entropy` metric).

    Returns:
        `(logps [N, C] float32, entropy [N, C] float32 or None)`; values at masked positions are computed
        but meaningless, so callers mask them.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    length = completion_ids.size(1)
    step = batch_size or input_ids.size(0)
    all_logps, all_entropy = [], []
    for start in range(0, input_ids.size(0), step):
        end = start + step
        logits = model(input_ids=input_ids[start:end], attention_mask=attention_mask[start:end], use_cache=False,
                       logits_to_keep=length + 1).logits
        if temperature != 1.0:
            logits = logits / temperature
        # The last kept position predicts past the completion: give it a dummy index and drop it.
        index = F.pad(completion_ids[start:end], (0, 1), value=0)
        all_logps.append(selective_log_softmax(logits, index)[:, :-1])
        if with_entropy:
            all_entropy.append(token_entropy(logits)[:, :-1])
    logps = torch.cat(all_logps)
    return logps, (torch.cat(all_entropy) if with_entropy else None)


def trl_prompts(messages: Sequence[list[dict[str, str]]], conversational: Sequence[bool]) -> list[Any]:
    """Prompts in TRL's shapes: the messages of a conversational row, the last user turn's text otherwise."""
    out: list[Any] = []
    for row, is_conversational in zip(messages, conversational):
        if is_conversational:
            out.append([{"role": m["role"], "content": m["content"]} for m in row])
        else:
            out.append(next(m["content"] for m in reversed(row) if m["role"] == "user"))
    return out


def trl_completions(texts: Sequence[str], conversational: Sequence[bool]) -> list[Any]:
    """Completions in TRL's shapes: `[{"role": "assistant", "content": text}]` or the text itself."""
    return [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, conversational)]


def score_completions(
    reward_functions,
    prompts: list[Any],
    completions: list[Any],
    columns: dict[str, list],
    completion_ids: Optional[list[list[int]]] = None,
    truncated: Optional[Sequence[bool]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every reward function on every completion, and their weighted sum.

    Args:
        reward_functions: `alignkit.rewards.RewardFunctions` (`.names`, `.weights [F]`, callable → `[N, F]`).
        prompts, completions: TRL shapes (`trl_prompts`, `trl_completions`).
        columns: the dataset's other columns, one list of N values each (keyword arguments of user functions).
        completion_ids: token ids of each completion (up to and including its stop token).
        truncated: N flags, True where a completion hit the length limit without stopping.

    Returns:
        `(per_function [N, F] float32 with NaN where a function returned None, rewards [N])`: the weighted
        sum ignoring NaN (`alignkit.rewards.combine_rewards`), NaN where every function returned None.
    """
    from ..rewards import combine_rewards

    per_function = reward_functions(prompts, completions, columns, completion_ids=completion_ids,
                                    truncated=truncated).float()
    return per_function, combine_rewards(per_function, reward_functions.weights)


__all__ = ["rollout_seed", "sample_completions", "token_entropy", "completion_logps", "trl_prompts",
           "trl_completions", "score_completions"]
