"""Rollouts for the online stages (GRPO, PPO): sample completions, score them, read their log-probs.

Each function takes a model, tensors or lists and returns tensors; none reads a trainer or a config, so
GRPO and PPO share them as they are.

- `sample_completions`: one batch of prompts (token ids) → a `Generation` (left-padded prompts, completion
  ids, `completion_mask` up to and including each row's stop token, `truncated`), sampled by the lean decode
  loop (`alignkit.model.generation.decode`: each distinct prompt prefilled once, no `model.generate`
  machinery per token), each row from a random stream of its own (`row_seeds`: the round's `rollout_seed`
  and the row's place in the round's global batch), so the same round gives the same completions in a
  resumed run and with any number of processes, and with the LoRA adapter merged while decoding
  (`merged_lora`).
- `completion_logps`: per-token log-probs (and, for metrics, entropies) of the completion tokens under a
  model, logits divided by the sampling temperature, as the policy gradient needs them.
- `trl_prompts` / `trl_completions`: prompts and completions in the shapes TRL's reward functions take.
- `VLLMColocateSampler`: the same `Generation` from vLLM in the training process (GPU only, not run here).
- `score_completions`: the reward functions' `[N, F]` matrix and the weighted `[N]` reward.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch

from ..constants import IGNORE_INDEX
from ..data.collator import padding_token_id
from ..data.multimodal import flat_image_inputs
from ..errors import RewardFunctionError
from ..model.generation import Generation, generate_with_decode, pad_prompts
from ..model.logprobs import elementwise_rows, labelled_forward, selective_log_softmax
from ..model.padding_free import activation_checkpointing, model_config, uses_per_sequence_attention


def rollout_seed(seed: int, round_index: int) -> int:
    """The sampling seed of generation round `round_index` of a run seeded with `seed`.

    Seeding each round on its own (rather than drawing from one running generator) makes a round's
    completions depend only on the weights and this number, so a run resumed from a checkpoint samples
    what the uninterrupted run sampled. Example: seed 42, round 3 → 42 * 1_000_003 + 3 = 42000129.
    """
    return (seed * 1_000_003 + round_index) % (2**63 - 1)


def row_seeds(seed: int, first_row: int, count: int) -> list[int]:
    """Sampling seeds of rows `first_row .. first_row + count - 1` of a round whose seed is `seed`.

    A row's seed depends on the round and on the row's place in the round's whole batch (over all
    processes), not on which process holds it. Example: seed 7, rows 2 and 3 → `rollout_seed(7, 2)` =
    7_000_023 and `rollout_seed(7, 3)` = 7_000_024.
    """
    return [rollout_seed(seed, first_row + i) for i in range(count)]


def sample_completions(
    model,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    *,
    stop_token_ids: Sequence[int],
    generation_kwargs: dict[str, Any],
    seed: int,
    first_row: int = 0,
    merge_lora: bool = True,
    seeds: Optional[Sequence[int]] = None,
    image_inputs: Optional[dict[str, Any]] = None,
) -> Generation:
    """Sample one completion per prompt row, each row under its own seed, leaving the global RNG as it was.

    With `do_sample` row i draws its tokens from a generator of its own seeded with `row_seeds(seed,
    first_row, N)[i]` (one uniform number per token, `alignkit.model.generation.sample_from_probs`): a row's
    completion depends on the weights, its prompt, the round's seed and its place in the round's batch,
    not on the other rows beside it, so a batch split over several processes (each passing the global
    index of its first row) samples what one process would.

    Args:
        model: the policy (plain or a `PeftModel`); put in eval mode while decoding, restored after.
        tokenizer: gives the pad id and decodes the completions.
        prompt_ids: token ids per row (a prompt repeated k times gives k rows, each sampled on its own).
        stop_token_ids: ids that end a row (the template's end of turn, `ChatFormatter.stop_token_ids()`).
        generation_kwargs: `max_new_tokens`, `do_sample`, `temperature`, `top_p`, `top_k`, `min_p`,
            `repetition_penalty`, `suppress_tokens` (`alignkit.model.generation.DECODE_KEYS`), with
            `model.generate`'s meaning.
        seed: the round's sampling seed (`rollout_seed`).
        first_row: the index of `prompt_ids[0]` in the round's whole batch (over all processes).
        merge_lora: decode with the LoRA adapter merged into the base weights (restored exactly after).
        seeds: each row's seed, in place of `row_seeds(seed, first_row, N)` (a tool rollout's later turns).
        image_inputs: a vision-language model's pixel inputs of the rows, laid out by row
            (`alignkit.data.multimodal.ImageProcessing.row_pixel_inputs`); the prompts' prefill sees them.

    Returns:
        A `Generation` (see `alignkit.model.generation`).
    """
    input_ids, attention_mask = pad_prompts(prompt_ids, padding_token_id(tokenizer))
    device = next(model.parameters()).device
    generators = [torch.Generator(device=device).manual_seed(row_seed)
                  for row_seed in (seeds if seeds is not None else row_seeds(seed, first_row, len(prompt_ids)))]
    return generate_with_decode(model, tokenizer, input_ids, attention_mask, stop_token_ids=stop_token_ids,
                                generation_kwargs=generation_kwargs, generator=generators, merge_lora=merge_lora,
                                image_inputs=image_inputs)


def generation_from_token_lists(tokenizer, prompt_ids: Sequence[Sequence[int]],
                                completions: Sequence[Sequence[int]], stop_token_ids: Sequence[int]) -> Generation:
    """A `Generation` from completions given as token lists (another engine's output, or fixed ones in tests).

    Each completion is cut after its first stop token; the rest are right-padded with the pad id and masked.
    A completion without a stop token is `truncated`.

    Args:
        tokenizer: gives the pad id and decodes the texts.
        prompt_ids: token ids per row.
        completions: new token ids per row.
        stop_token_ids: ids that end a completion.
    """
    stops = set(int(t) for t in stop_token_ids)
    rows = []
    for ids in completions:
        ids = [int(t) for t in ids]
        end = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        rows.append(ids[:end])
    pad_id = padding_token_id(tokenizer)
    width = max(1, max(len(r) for r in rows))
    completion_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(width) < lengths[:, None]).long()
    truncated = torch.tensor([not r or r[-1] not in stops for r in rows])
    prompts, prompt_mask = pad_prompts(prompt_ids, pad_id)
    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    return Generation(prompts, prompt_mask, completion_ids, mask, truncated, texts)


def vllm_weight_items(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of `model` under the names of the plain checkpoint, for `vLLM ... load_weights`.

    Under PEFT, call it with the adapter merged (`merged_lora`): LoRA's own matrices are skipped, and
    PEFT's prefix (`base_model.model.`) and the wrapped layers' `.base_layer` are removed, so
    `base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` becomes
    `model.layers.0.self_attn.q_proj.weight`.
    """
    for name, param in model.named_parameters():
        if "lora_" in name or ".original_module." in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        yield name, param.detach()


class VLLMColocateSampler:
    """Sampling with vLLM in the training process (TRL's colocate mode); GPU only.

    Written against vLLM's documented offline API (`LLM`, `SamplingParams`, `LLM.generate` with token-id
    prompts, one `SamplingParams` per request) and the in-process weight loading TRL 1.16 uses
    (`llm_engine.model_executor.driver_worker.model_runner.model.load_weights`). No GPU was available to
    this project, so this class has not run; its pure parts (`vllm_weight_items`,
    `generation_from_token_lists`) are tested on the CPU.

    Args:
        model_path: the policy's base model folder (vLLM loads it once; the trained weights are pushed
            in by `sync_weights` before each generation round that follows an update).
        gpu_memory_utilization: share of GPU memory vLLM may take.
        max_model_len: longest prompt + completion (None: the model's own limit).
        dtype: the training model's dtype, so vLLM samples from the same numbers.
    """

    def __init__(self, model_path: str, *, gpu_memory_utilization: float, max_model_len: Optional[int],
                 dtype: torch.dtype) -> None:
        from vllm import LLM

        self.llm = LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       dtype=str(dtype).removeprefix("torch."), distributed_executor_backend="external_launcher",
                       seed=0)
        self.synced_step: Optional[int] = None

    def sync_weights(self, model) -> None:
        """Load the policy's current weights (LoRA merged) into vLLM and drop its prefix cache."""
        from ..model.generation import merged_lora

        engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        with torch.no_grad(), merged_lora(model):
            engine_model.load_weights(list(vllm_weight_items(model)))
        self.llm.reset_prefix_cache()

    def sample(self, tokenizer, prompt_ids: Sequence[Sequence[int]], *, stop_token_ids: Sequence[int],
               generation_kwargs: dict[str, Any], seed: int, first_row: int = 0) -> Generation:
        """One completion per row, each under its own seed (`row_seeds(seed, first_row, N)`: a shared seed would
        give every copy of a prompt the same completion, and the global row index keeps a process's rows
        apart from another's)."""
        from vllm import SamplingParams

        params = [SamplingParams(
            n=1, temperature=generation_kwargs.get("temperature", 1.0), top_p=generation_kwargs.get("top_p", 1.0),
            top_k=generation_kwargs.get("top_k") or -1,
            min_p=generation_kwargs.get("min_p") or 0.0,
            repetition_penalty=generation_kwargs.get("repetition_penalty", 1.0),
            max_tokens=generation_kwargs["max_new_tokens"], stop_token_ids=list(stop_token_ids), seed=row_seed,
        ) for row_seed in row_seeds(seed, first_row, len(prompt_ids))]
        outputs = self.llm.generate([{"prompt_token_ids": list(map(int, ids))} for ids in prompt_ids],
                                    sampling_params=params, use_tqdm=False)
        completions = [list(output.outputs[0].token_ids) for output in outputs]
        return generation_from_token_lists(tokenizer, prompt_ids, completions, stop_token_ids)


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
        step = elementwise_rows(rows.size(-1))
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
    share_prompts: bool = True,
    image_inputs: Optional[dict[str, Any]] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs of the completion tokens, `log softmax(logits / temperature)[token]`.

    The model runs on `[prompt; completion]` (prompts left-padded, completions right-padded by their
    mask) and only the last `C + 1` positions reach the output layer: position `P - 1 + j` predicts
    completion token j. Dividing by the sampling temperature scores the tokens under the distribution
    they were sampled from, as TRL does.

    Rows that share a prompt (a GRPO group) share its forward pass (`share_prompts`). Under per-sequence attention
    (sdpa, gradient checkpointing or not: `alignkit.model.padding_free.uses_per_sequence_attention`) the batch runs
    padding-free (`completion_token_logits`): each sequence's real tokens once, a prompt (or any longer prefix)
    already run for an earlier row of the batch not again (`flatten_for_model`'s shared prefixes), the padding after
    short completions not at all, and only the completion's positions reach the output layer. Other attention
    implementations (eager, flash attention) run each distinct prompt once with its KV cache shared by its group
    (`_shared_prompt_logits`). Both give the one padded pass's numbers up to float rounding, with and without
    gradients, at masked positions excepted (left at 0; callers mask them).

    Args:
        model: a causal LM accepting `logits_to_keep` and `cache` (a `PeftModel` forwards them).
        prompt_ids, prompt_mask: `[N, P]` left-padded prompts and their mask.
        completion_ids, completion_mask: `[N, C]` completions and their mask (0 after the stop token).
        temperature: sampling temperature (> 0).
        batch_size: rows per forward pass (default: all at once); bounds activation memory without grad.
        with_entropy: also return each position's entropy (no gradient; for the `entropy` metric).
        share_prompts: run each distinct prompt once per forward pass (the KV-cache pass is left out under
            gradient checkpointing with gradients on, where transformers turns the cache off).
        image_inputs: a vision-language model's pixel inputs of the rows, laid out by row
            (`alignkit.data.multimodal.ImageProcessing.row_pixel_inputs`). Such rows run the padded forward with
            their images, as TRL scores them: the shared layouts tell prompts apart by their token ids, which a
            LLaVA prompt's image tokens do not distinguish.

    Returns:
        `(logps [N, C] float32, entropy [N, C] float32 or None)`; values at masked positions are
        meaningless (0 or computed), so callers mask them.
    """
    length = completion_ids.size(1)
    step = batch_size or prompt_ids.size(0)
    share_prompts = share_prompts and image_inputs is None
    padding_free = share_prompts and uses_per_sequence_attention(model)
    # Otherwise the KV-cache pass, which cannot run where checkpointed layers drop the cache (transformers turns
    # `use_cache` off while gradients are on).
    kv_cache = share_prompts and not padding_free and not (
        torch.is_grad_enabled() and model.training and activation_checkpointing(model))
    all_logps, all_entropy = [], []
    for start in range(0, prompt_ids.size(0), step):
        rows = slice(start, min(start + step, prompt_ids.size(0)))
        shared = _shared_prompt_logits(model, prompt_ids[rows], prompt_mask[rows], completion_ids[rows],
                                       completion_mask[rows]) if kv_cache else None
        if shared is None:
            # The per-token forward on [prompt; completion], padding-free with shared prefixes or padded, scoring the
            # completion's real tokens only.
            logits, place = completion_token_logits(
                model, prompt_ids[rows], prompt_mask[rows], completion_ids[rows], completion_mask[rows],
                padding_free=padding_free,
                model_inputs=flat_image_inputs(image_inputs, rows) if image_inputs is not None else None)
            if temperature != 1.0:
                logits = logits / temperature
            count = completion_ids[rows].size(0)
            logps = torch.zeros(count, length, dtype=torch.float32, device=logits.device)
            all_logps.append(logps.index_put(place, selective_log_softmax(logits, completion_ids[rows][place])))
            if with_entropy:
                entropy = torch.zeros(count, length, dtype=torch.float32, device=logits.device)
                all_entropy.append(entropy.index_put(place, token_entropy(logits)))
            continue
        # Position P - 1 (the prompt's last, shared) predicts token 0; completion positions predict 1 .. C - 1.
        first, rest = shared
        parts = [(first, completion_ids[rows, :1])]
        if rest is not None:
            parts.append((rest, completion_ids[rows, 1:]))
        logps, entropy = [], []
        for logits, index in parts:
            if temperature != 1.0:
                logits = logits / temperature
            logps.append(selective_log_softmax(logits, index))
            if with_entropy:
                entropy.append(token_entropy(logits))
        all_logps.append(torch.cat(logps, dim=1))
        if with_entropy:
            all_entropy.append(torch.cat(entropy, dim=1))
    return torch.cat(all_logps), (torch.cat(all_entropy) if with_entropy else None)


def completion_token_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                            completion_ids: torch.Tensor, completion_mask: torch.Tensor, *, padding_free: bool = True,
                            model_inputs: Optional[dict[str, Any]] = None
                            ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The logits predicting each real completion token, for a loss over the whole vocabulary (distillation's
    divergence): `(logits [K, V], (row [K], column [K]))`, K the completion mask's ones and where each goes in the
    `[N, C]` layout, in row-major order (the same for any two models).

    The per-token forward (`model.logprobs.labelled_forward`) on `[prompt; completion]`, padding-free by default:
    only real tokens reach the model (each sequence attended on its own, so a row's numbers do not depend on the
    batch it shares) and only the completion's positions the output layer. `completion_logps` scores rollouts through
    it, padding-free with shared prompts under per-sequence attention, padded with a vision-language model's pixel
    inputs as `model_inputs` or without `share_prompts`.
    """
    scored = labelled_forward(
        model, torch.cat([prompt_ids, completion_ids], dim=1), torch.cat([prompt_mask, completion_mask], dim=1),
        torch.cat([torch.full_like(prompt_ids, IGNORE_INDEX),
                   completion_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)], dim=1),
        logits=True, padding_free=padding_free, model_inputs=model_inputs)
    width = scored.shape[1]
    # Column P - 1 + j of the [N, P + C] layout predicts completion token j.
    rows = torch.div(scored.place, width, rounding_mode="floor")
    return scored.values, (rows, scored.place - rows * width - (prompt_ids.size(1) - 1))


def _repeat_cache_rows(cache, rows: torch.Tensor) -> None:
    """Keep rows `rows` (with repeats) of every layer of a `DynamicCache`, as its `batch_select_indices` does, but
    through `index_select`, whose backward sums a repeated row's gradients in index order.

    transformers selects with `keys[rows]`, whose backward is `index_put_(accumulate=True)`: on a CPU it adds with
    atomics from several threads once the tensor passes ATen's grain size (32768 elements), so a prompt's gradient,
    the sum over its group's copies, came out in a different float order from run to run: a GRPO run with tools
    (prompts long with the tool schemas, so this pass) trained 1.5e-8 apart after one step and 2e-7 in a later loss.
    Layer kinds with more state than keys and values keep transformers' own method.
    """
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if type(layer).batch_select_indices is not DynamicLayer.batch_select_indices:
            layer.batch_select_indices(rows)
        elif layer.get_seq_length() > 0:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)


def _shared_prompt_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                          completion_mask: torch.Tensor) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """The logits `completion_logps` needs, with each distinct prompt run once; None when no two rows share one.

    The distinct prompts run first with the KV cache on (and with gradients when enabled: the cache keeps the
    graph), their cache rows are copied to every row of their group (indexing, so in backward each copy's
    gradient is summed into the one prompt pass), then the completions run on that cache. Positions and masks
    are those of the one-pass forward (positions 0 .. P + C - 1 by column, the mask `[prompt_mask;
    completion_mask]`), so the logits equal it up to float rounding. The last completion token is not fed: its
    logits would predict past the completion.

    Returns:
        `(first [N, 1, V], rest [N, C - 1, V] or None when C == 1)`: the logits at the prompt's last position
        and at completion positions 0 .. C - 2.
    """
    from transformers import DynamicCache

    distinct, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
    if distinct.size(0) == prompt_ids.size(0):
        return None
    prompt_len = prompt_ids.size(1)
    cache = DynamicCache(config=model_config(model))
    first = model(input_ids=distinct[:, :prompt_len], attention_mask=distinct[:, prompt_len:], cache=cache,
                  use_cache=True, logits_to_keep=1).logits.index_select(0, inverse)
    if completion_ids.size(1) == 1:
        return first, None
    _repeat_cache_rows(cache, inverse)
    attention_mask = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)
    rest = model(input_ids=completion_ids[:, :-1], attention_mask=attention_mask, cache=cache, use_cache=True,
                 logits_to_keep=0).logits
    return first, rest


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
    rewards = combine_rewards(per_function, reward_functions.weights)
    if torch.isinf(rewards).any():  # each value fits float32 (checked), their weighted sum may not
        row = int(torch.isinf(rewards).nonzero()[0])
        values = ", ".join(f"{name} {value:.4g}" for name, value in zip(reward_functions.names, per_function[row].tolist()))
        raise RewardFunctionError(f"the weighted reward of row {row} ({values}; weights "
                                  f"{reward_functions.weights.tolist()}) is beyond float32's range: make the rewards "
                                  "or reward_weights smaller.")
    return per_function, rewards


__all__ = ["rollout_seed", "row_seeds", "sample_completions", "generation_from_token_lists",
           "completion_token_logits",
           "vllm_weight_items",
           "VLLMColocateSampler", "token_entropy", "completion_logps", "trl_prompts",
           "trl_completions", "score_completions"]
