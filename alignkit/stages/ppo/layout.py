"""PPO's rollout layout: response lengths, sequences packed to the right, the policy/critic forward and the
rollout container."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ...constants import IGNORE_INDEX

# ---------------------------------------------------------------------------------------------------
# Response lengths (the length sampler); the pure maths of PPO is in `alignkit.rl`
# ---------------------------------------------------------------------------------------------------


def truncate_to_lengths(mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Cut each row's response mask to its first `lengths[i]` tokens.

    Args:
        mask: [N, T] response mask (1 up to and including the stop token).
        lengths: [N] most tokens each response keeps.

    Returns:
        [N, T] same dtype. Example: mask [[1, 1, 1, 0], [1, 1, 1, 1]], lengths [2, 3] ->
        [[1, 1, 0, 0], [1, 1, 1, 0]].
    """
    positions = torch.arange(mask.shape[1], device=mask.device)
    return mask * (positions.unsqueeze(0) < lengths.to(mask.device).unsqueeze(1)).to(mask.dtype)


def sample_response_lengths(low: int, high: int, count: int, seed: int, step: int) -> torch.Tensor:
    """The length sampler: `count` response lengths drawn uniformly from `[low, high]` (both included).

    Seeded by `(seed, step)` alone (numpy's `SeedSequence`), so step k draws the same lengths in a resumed
    run as in an uninterrupted one, without any state to save, and the global RNG is not touched.

    Returns:
        [count] long tensor.
    """
    if not 1 <= low <= high:
        raise ValueError(f"response lengths [{low}, {high}]: need 1 <= low <= high.")
    rng = np.random.default_rng([seed, step])
    return torch.as_tensor(rng.integers(low, high + 1, size=count), dtype=torch.long)


def pack_right(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, response_mask: torch.Tensor,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay each prompt + response out contiguously from column 0, right-padded, with the response labelled.

    Generation leaves `[left-padded prompt | response + filler]`; here each row's real tokens move to the left
    end (a stable sort of the mask keeps their order), so position ids 0, 1, ... are each token's true position
    in the padded and the padding-free forward alike (`alignkit.model.generation.left_pad` is the mirror image).

    Args:
        prompt_ids, prompt_mask: [N, P] left-padded prompts.
        completion_ids, response_mask: [N, C] responses; the mask is 1 on the response's tokens.
        pad_token_id: written into the padding.

    Returns:
        `(input_ids, attention_mask, labels)`, each [N, P + C]; labels are the response tokens, -100 elsewhere.
        Example: prompt [pad, 5, 6] (mask [0, 1, 1]), response [7, 8] (mask [1, 0]), pad 0 ->
        input_ids [5, 6, 7, 0, 0], attention_mask [1, 1, 1, 0, 0], labels [-100, -100, 7, -100, -100].
    """
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1)
    labelled = torch.cat([torch.zeros_like(prompt_mask), response_mask.to(prompt_mask.dtype)], dim=1)
    order = torch.sort(mask, dim=1, descending=True, stable=True).indices
    mask = torch.gather(mask, 1, order)
    ids = torch.gather(ids, 1, order).masked_fill(mask == 0, pad_token_id)
    labels = ids.masked_fill(torch.gather(labelled, 1, order) == 0, IGNORE_INDEX)
    return ids, mask, labels


# ---------------------------------------------------------------------------------------------------
# Forward passes of the policy, the reference and the critic
# ---------------------------------------------------------------------------------------------------


def policy_forward(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, *,
    padding_free: bool = False, call: Optional[nn.Module] = None,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Log-probs of the labelled tokens and the decoder's last hidden states, from one call of the whole model
    (`alignkit.model.logprobs.labelled_forward`, the per-token forward every stage shares).

    The model runs as a whole (`call`, e.g. a DeepSpeed engine around `model`, or `model` itself), so every weight
    is used inside a module's forward: under DeepSpeed ZeRO-3 each module's hooks gather its weights for its
    forward and again for its backward, and the engine's own forward bookkeeping runs, as in a Trainer's training
    step. The hidden states entering the output layer feed the value head; the output layer sees only the
    positions that predict a labelled token, so no `[N, L, V]` logits are formed.

    Args:
        model: the causal LM (PEFT wrapper allowed); its output layer and decoder are found in it.
        input_ids, attention_mask: [N, L] sequences laid out by `pack_right`.
        labels: [N, L], -100 where no log-prob is wanted (all -100: only the hidden states are wanted; the output
            layer then runs on no position).
        padding_free: run the real tokens packed into rows (`alignkit.model.padding_free`).
        call: what to call instead of `model` (a wrapper whose forward runs `model`'s); None: `model`.

    Returns:
        `(logps, hidden, flat)`: logps [N, L - 1] float32, column t holding `log p(labels[:, t + 1])`, 0 where
        unlabelled; hidden and flat as `alignkit.model.heads.last_hidden_states` returns them ([N, L, H] and None,
        or [1, T, H] in flat order and the `FlatBatch`).
    """
    from ...model.logprobs import labelled_forward

    scored = labelled_forward(model, input_ids, attention_mask, labels, padding_free=padding_free, call=call,
                              keep_hidden=True)
    return scored.padded()[0], scored.hidden, scored.flat


@dataclass
class Rollout:
    """One rollout, laid out by `pack_right`; per-token tensors are [N, L - 1], column t scoring token t + 1.

    Attributes:
        input_ids, attention_mask, labels: [N, L] the prompt + response sequences.
        mask: [N, L - 1] float, 1 where column t scores a response token.
        logps, ref_logps, values: at rollout time, of the policy, the reference and the critic.
        advantages, returns: from GAE (advantages whitened when asked).
        scores: [N] the combined score of each response (normalised with ppo_score_norm).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    logps: torch.Tensor
    ref_logps: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    scores: torch.Tensor

    def rows(self, index: torch.Tensor) -> "Rollout":
        return Rollout(**{name: getattr(self, name)[index] for name in self.__dataclass_fields__})
