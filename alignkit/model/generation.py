"""Token-level generation shared by chat, the demo, SFT prediction, `alignkit eval` and the GRPO/PPO rollouts.

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

   Merging made generation faster on both the tiny and the bundled model (docs/performance.md, "Generation:
   merged LoRA and packed weights"), so `generate` merges by default (`merge_lora=True`).
5. Rollouts (`generate_with_decode`, `decode`): the same contract with a decode loop of our own instead of
   `model.generate`, for the knobs of `DECODE_KEYS`. Greedy output equals `generate`'s token for token;
   sampling uses `generate`'s logits processors (`sampling_processors`) and a caller-seeded generator. It
   prefills each distinct prompt once (a GRPO group repeats one prompt `num_generations` times) and draws
   each token with one uniform number per row instead of `torch.multinomial`'s one exponential per
   vocabulary entry. A decode step at batch 8 is otherwise the model's matrix multiplies; rollouts run them on
   oneDNN-packed copies of the weights with the LoRA adapter merged in (`packed_linears`, packed once per
   rollout, sibling projections that read one input stacked into one product; measured in docs/performance.md),
   and the KV cache grows in place (`_reserve_cache`) instead of being concatenated per token.
"""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from ..data.collator import pad_sequences, padding_token_id
from ..data.template import ChatFormatter, Message
from ..env import onednn_supports_bf16
from .decode_step import DecodeStep
from .lora_fused import quantized_base_layer, shadowed_forward
from .padding_free import attention_takes_any_mask


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
    already merged, and on a quantized base (QLoRA): merging there dequantizes each weight, adds the delta and
    quantizes again, which rounds the policy to another model and replaces the quantized tensors the put-back
    relies on; decoding then runs with the adapter unmerged. Use it under `torch.no_grad()`: gradients do not flow
    through merged weights.
    """
    layers = _lora_layers(model)
    unmergeable = not layers or not hasattr(model, "merge_adapter") or any(map(quantized_base_layer, layers))
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


def _packed_weight_supported() -> bool:
    """Whether this torch build has oneDNN and the packed-weight linear ops `packed_linears` uses."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _packed_forward(packed: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor, *args,
                    **kwargs) -> torch.Tensor:
    """`F.linear(x, W, bias)` with `W` in oneDNN's packed layout (`torch.ops.mkldnn._reorder_linear_weight`).

    The rows are cast to the packed weight's dtype (fp32, or bf16 under a bf16 autocast; see `packed_linears`):
    oneDNN has no product of rows and weights of different dtypes, and the layers before hand this one rows of
    either (under autocast an RMSNorm's output is fp32, an attention's or an MLP's bf16). The output is in that
    dtype too, as autocast's `F.linear` gives it. A cast of a few decode rows costs nothing next to the product.
    """
    rows = x.reshape(-1, x.size(-1)).to(packed.dtype).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.size(-1))


# Sibling layers that read one input, by the names the Llama family (Llama, Qwen, Mistral, SmolLM, Gemma) gives them:
# an attention's query/key/value projections and an MLP's gate and up projections.
SIBLING_LAYERS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _merge_into(block: torch.Tensor, weight: torch.Tensor, module: torch.nn.Module, names: Sequence[str]) -> None:
    """Write `weight` plus the deltas of `module`'s adapters `names` (`B A scale`) into the fp32 `block`.

    For fp32 factors of a plain `nn.Linear` each delta is one fused `addmm` into the block: PEFT's
    `get_delta_weight` materialises `B @ A`, scales it in another pass and the sum takes a third, which cost
    about three times as long on the bundled model's 210 layers (100 ms against 33 ms a rollout, AVX2 AMD EPYC;
    docs/performance.md). Transposed (`fan_in_fan_out`) or half-precision factors take PEFT's delta.
    """
    source = weight
    for name in names:
        a, b = module.lora_A[name].weight.detach(), module.lora_B[name].weight.detach()
        if module.fan_in_fan_out or not a.dtype == b.dtype == torch.float32:
            torch.add(source, module.get_delta_weight(name).float(), out=block)
        elif source is block:
            block.addmm_(b, a, alpha=module.scaling[name])
        else:
            torch.addmm(source.float(), b, a, alpha=module.scaling[name], out=block)
        source = block
    if source is not block:  # no adapter: the base weight alone
        block.copy_(weight)


def _base_linear(layer: torch.nn.Module) -> torch.nn.Module:
    """The `nn.Linear` holding a packed layer's weight: a LoRA layer's base layer, or the layer itself."""
    return layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer


def _sibling_groups(modules: Sequence[torch.nn.Module],
                    layers: Sequence[torch.nn.Module]) -> list[list[torch.nn.Module]]:
    """`layers` in groups that `packed_linears` packs as one weight: the members of a `SIBLING_LAYERS` set under one
    parent (any of `modules`), when all of them are in `layers` with the same input size and all or none with a
    bias; every other layer alone. Order: as in `layers`, each group where its first member is."""
    chosen = {id(m) for m in layers}
    group_of: dict[int, list[torch.nn.Module]] = {}
    for parent in modules:
        children = parent._modules
        for names in SIBLING_LAYERS:
            members = [children.get(name) for name in names]
            if any(m is None or id(m) not in chosen for m in members):
                continue
            bases = [_base_linear(m) for m in members]
            if len({b.in_features for b in bases}) == 1 and len({b.bias is None for b in bases}) == 1:
                for m in members:
                    group_of[id(m)] = members
    groups, seen = [], set()
    for m in layers:
        if id(m) in seen:
            continue
        group = group_of.get(id(m), [m])
        seen.update(id(g) for g in group)
        groups.append(group)
    return groups


class _SharedProduct:
    """One packed product for sibling layers that read the same input (`SIBLING_LAYERS`), served to each in turn.

    A decode step's products are small (a few rows), so one product with the siblings' weights stacked runs faster
    than one per sibling (the bundled model's linear layers at 8 rows, AVX2 AMD EPYC: 33.5 ms per step fused
    against 39.5 ms; docs/performance.md). The first sibling called with an input computes the whole product and
    keeps it; each other sibling called with that same tensor object, unchanged since (its version counter), takes
    its columns once. A sibling called with another tensor, a changed one, or a second time with the same one
    computes the product anew, so a model that calls its siblings on different inputs or in another order gets
    right outputs, only without the saving.
    """

    def __init__(self, packed: torch.Tensor, bias: Optional[torch.Tensor], sizes: Sequence[int]):
        self.packed, self.bias = packed, bias
        self.bounds = [0, *accumulate(sizes)]  # sibling i's columns: bounds[i]:bounds[i + 1]
        self.input: Optional[torch.Tensor] = None
        self.version: Optional[int] = None
        self.output: Optional[torch.Tensor] = None
        self.waiting: set[int] = set()

    def forward(self, index: int, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        version = None if x.is_inference() else x._version  # inference tensors keep no version counter
        if x is not self.input or version != self.version or index not in self.waiting:
            self.input, self.version, self.output = x, version, _packed_forward(self.packed, self.bias, x)
            self.waiting = set(range(len(self.bounds) - 1))
        self.waiting.discard(index)
        out = self.output[..., self.bounds[index]:self.bounds[index + 1]].contiguous()
        if not self.waiting:
            self.input = self.output = None  # every sibling served: hold no activations between steps
        return out


@contextmanager
def packed_linears(model, batch_size: int) -> Iterator[bool]:
    """While the block runs, every linear layer multiplies with a oneDNN-packed copy of its (LoRA-merged) weight.

    A decode step multiplies a handful of rows (one new token per completion) by every weight of the model;
    MKL's `F.linear` runs such skinny products far below the CPU's peak, and oneDNN with each weight reordered
    once into its blocked layout runs them markedly faster for a packing cost paid once (docs/performance.md,
    "Generation: merged LoRA and packed weights"). So rollouts pack once per generation round and decode tens
    of tokens with the packed copies.

    Plain LoRA layers are packed with the adapter merged (`W + B A scale`, computed layer by layer into a
    temporary that is dropped once packed), and their forward is the packed product alone, as PEFT's merged
    forward is; the model's parameters are never written. Siblings that read one input (`SIBLING_LAYERS`: q/k/v,
    gate/up) are stacked into one packed weight and served by one product (`_SharedProduct`). Memory: one packed
    copy of each linear weight while the block runs (the output head included), in place of `merged_lora`'s copies
    of the adapted weights. The
    outputs equal `F.linear`'s up to float rounding (summation order: about 1e-6 on logits of size ~10), which
    sampling cannot tell apart; only decoding uses them, never a pass whose log-probs or gradients train.

    The packed copies are bf16 when the block is entered under a bf16 CPU autocast (a `bf16` run's rollouts:
    `OnlineTrainer.sample` and PPO's rollout enter the run's autocast), fp32 otherwise. Under autocast every
    `F.linear` casts its weight to bf16 on each call anyway; packing the bf16 copy once halves the bytes a decode
    step reads and runs the product on the CPU's bf16 units (`python -m bench.decode_dtype_probe`: 1.6x on the
    bundled model's linear layers on an AMD EPYC with AVX512-BF16). The merge is computed in fp32 and rounded
    once, where autocast rounds base and adapter apart: sampling cannot tell the two apart. Weights stored in bf16
    (a frozen base under `precision.bf16_frozen_linears`) are merged in fp32 the same way. Where oneDNN cannot
    pack bf16 on this CPU (`alignkit.env.onednn_supports_bf16`; a run's config keeps bf16 off on such a CPU, so
    only an autocast entered by other code, such as a test patching bf16 support in, gets here), the copies are
    fp32 even under autocast, and the packed layers give fp32 outputs, which the layers after them take as they
    take an RMSNorm's.

    Yields False and changes nothing where it does not apply: no oneDNN in this torch build, weights that are
    not whole fp32 or bf16 tensors on the CPU (sharded ones outside `full_weights`), or LoRA layers other than plain
    linear ones (DoRA, LoRA biases, embeddings, a quantized base's bitsandbytes layers, which are never
    dequantized into packed copies): the caller then merges with `merged_lora`. Use it under
    `torch.no_grad()`.

    Args:
        model: a causal LM, plain or a `PeftModel`, in eval mode.
        batch_size: rows per product the packing is tuned for (the decode batch).
    """
    from peft.tuners.lora import Linear as LoraLinear, LoraLayer

    modules = list(model.modules())
    lora_layers = [m for m in modules if isinstance(m, LoraLayer)]
    plain_lora = all(type(m) is LoraLinear and type(m.get_base_layer()) is torch.nn.Linear
                     and not any(n in m.lora_variant or m.lora_bias.get(n) for n in m.lora_A) for m in lora_layers)
    weights = [m.weight for m in modules if type(m) is torch.nn.Linear]
    if (not _packed_weight_supported() or not plain_lora or not weights
            or any(w.dtype not in (torch.float32, torch.bfloat16) or w.device.type != "cpu"
                   or type(w.data) is not torch.Tensor
                   or w.numel() == 0 for w in weights)):  # sharded (DTensor) or ZeRO-3 placeholder weights
        yield False
        return
    # A LoRA layer's own linear modules (its base layer, `lora_A`, `lora_B`) run inside its packed forward.
    wrapped = {id(sub) for m in lora_layers for sub in m.modules() if sub is not m}
    dtype = (torch.bfloat16 if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
             and onednn_supports_bf16() else torch.float32)
    layers = [m for m in modules if type(m) is LoraLinear
              or (type(m) is torch.nn.Linear and id(m) not in wrapped)]
    # Merged weights are built in one reused buffer per shape: a fresh 1-5 MB tensor per layer costs its page
    # faults each round (a third of the packing time of the bundled model).
    scratch: dict[tuple[int, ...], torch.Tensor] = {}
    with ExitStack() as patched:
        for group in _sibling_groups(modules, layers):
            base = [_base_linear(m) for m in group]
            adapters = [[] if type(m) is not LoraLinear or m.merged or m.disable_adapters else
                        [name for name in m.active_adapters if name in m.lora_A] for m in group]
            if len(group) == 1 and not adapters[0]:
                weight = base[0].weight.detach()
            else:  # the group's (merged) weights stacked in one buffer, row blocks in the group's order
                shape = (sum(b.out_features for b in base), base[0].in_features)
                weight = scratch.setdefault(shape, torch.empty(shape, dtype=torch.float32))
                start = 0
                for module, layer, names in zip(group, base, adapters):
                    block = weight[start:start + layer.out_features]
                    start += layer.out_features
                    _merge_into(block, layer.weight.detach(), module, names)
            bias = None if base[0].bias is None else torch.cat([b.bias.detach() for b in base]).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype).contiguous(), batch_size)
            if len(group) == 1:
                patched.enter_context(shadowed_forward(group[0], partial(_packed_forward, packed, bias)))
                continue
            product = _SharedProduct(packed, bias, [b.out_features for b in base])
            for index, module in enumerate(group):
                patched.enter_context(shadowed_forward(module, partial(product.forward, index)))
        yield True


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
    model_inputs: Optional[dict[str, Any]] = None,
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
        model_inputs: more inputs of `model.generate` (a vision-language model's `pixel_values` and what comes with
            them, `data.multimodal.ImageProcessing.pixel_inputs`).

    Returns:
        A `Generation`. With `num_return_sequences=k`, row i*k+j is the j-th completion of prompt i and
        the prompts are repeated to match.
    """
    kwargs = dict(generation_kwargs or {})
    pad_token_id = padding_token_id(tokenizer)
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
                **{k: v.to(device) if torch.is_tensor(v) else v for k, v in (model_inputs or {}).items()},
                **kwargs,
            )
    finally:
        model.train(was_training)
    return _generation(tokenizer, prompt_ids.to(device), prompt_mask.to(device),
                       output[:, prompt_ids.shape[1]:].contiguous(), stop_token_ids)


def _generation(tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                stop_token_ids: Sequence[int]) -> Generation:
    """A `Generation` from left-padded prompts and the new tokens (k rows per prompt when there are k times as
    many completions: the prompts are repeated to match)."""
    repeats = completion_ids.shape[0] // prompt_ids.shape[0]
    if repeats > 1:
        prompt_ids = prompt_ids.repeat_interleave(repeats, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(repeats, dim=0)
    mask, truncated = completion_mask(completion_ids, stop_token_ids)
    texts = tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(completion_ids, mask)],
                                   skip_special_tokens=True)
    return Generation(prompt_ids, prompt_mask, completion_ids, mask, truncated, texts)


def generate_with_decode(
    model,
    tokenizer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    stop_token_ids: Sequence[int],
    generation_kwargs: dict[str, Any],
    generator: Generators = None,
    merge_lora: bool = True,
    on_step: Optional[StepHook] = None,
    image_inputs: Optional[dict[str, Any]] = None,
) -> Generation:
    """`generate`'s contract with the lean loop `decode` in place of `model.generate` (the online stages' rollouts).

    Args:
        model, tokenizer, input_ids, attention_mask, stop_token_ids: as in `generate`.
        image_inputs: a vision-language model's pixel inputs of the rows, laid out by row
            (`data.multimodal.ImageProcessing.row_pixel_inputs`); see `decode`.
        merge_lora: decode with the LoRA adapter merged: into oneDNN-packed copies of the weights where
            `packed_linears` applies (a CPU with oneDNN, plain LoRA; bf16 copies under a bf16 autocast), else with
            `merged_lora`.
        generation_kwargs: only the keys of `DECODE_KEYS` (`max_new_tokens` required).
        generator: random stream for sampling, or one per row (see `sample_from_probs`).
        on_step: `decode`'s per-step callback (streaming, rows stopped by the caller).

    Raises:
        ValueError: a key `decode` does not implement (beams, streamers, extra processors belong to `generate`).
    """
    unknown = sorted(set(generation_kwargs) - set(DECODE_KEYS))
    if unknown:
        raise ValueError(f"generation keys {unknown} are not supported by the rollout decoder (it takes "
                         f"{', '.join(DECODE_KEYS)}); use alignkit.model.generation.generate for them.")
    pad_token_id = padding_token_id(tokenizer)
    stop_token_ids = list(stop_token_ids)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = (t.to(device) for t in left_pad(input_ids, attention_mask, pad_token_id))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), ExitStack() as weights:
            # Packed weights (LoRA merged into them) where oneDNN applies, else the merged model.
            if merge_lora and not weights.enter_context(packed_linears(model, prompt_ids.size(0))):
                weights.enter_context(merged_lora(model))
            completion_ids = decode(model, prompt_ids, prompt_mask, stop_token_ids=stop_token_ids,
                                    pad_token_id=pad_token_id, generator=generator, on_step=on_step,
                                    image_inputs=image_inputs, **generation_kwargs)
    finally:
        model.train(was_training)
    return _generation(tokenizer, prompt_ids, prompt_mask, completion_ids, stop_token_ids)


# The knobs `decode` implements; other `model.generate` keys (beams, streamers, extra processors) go through `generate`.
DECODE_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
               "suppress_tokens")


def sampling_processors(prompt_mask: torch.Tensor, *, do_sample: bool, temperature: float = 1.0, top_p: float = 1.0,
                        top_k: int = 0, repetition_penalty: float = 1.0, min_p: Optional[float] = None):
    """The logits processors `model.generate` builds for these knobs, in its order: the repetition penalty
    (over the prompt and the new tokens, left padding excluded), then, when sampling, temperature, top-k,
    top-p, min-p. A knob at its neutral value (min-p: None) adds nothing, as in `generate`. transformers' own
    processor classes are used, so the distribution sampled from is `generate`'s by construction; top-p runs
    through `NucleusFilter`, which keeps the tokens the warper keeps without sorting the vocabulary where it can.

    Args:
        prompt_mask: (batch, prompt_len) 1 on real prompt tokens of the left-padded prompts.
        do_sample: False: greedy, only the repetition penalty applies.

    Returns:
        A `transformers.LogitsProcessorList` called as `processors(input_ids, scores)`.
    """
    from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    processors = LogitsProcessorList()
    if repetition_penalty is not None and repetition_penalty != 1.0:
        padding = (prompt_mask != 0).int().argmax(dim=1)  # columns of left padding per row
        processors.append(RepetitionPenaltyLogitsProcessor(float(repetition_penalty), prompt_ignore_length=padding))
    if do_sample:
        if temperature is not None and temperature != 1.0:
            processors.append(TemperatureLogitsWarper(float(temperature)))
        if top_k:
            processors.append(TopKLogitsWarper(top_k=int(top_k), min_tokens_to_keep=1))
        if top_p is not None and top_p < 1.0:
            processors.append(NucleusFilter(TopPLogitsWarper(top_p=float(top_p), min_tokens_to_keep=1)))
        if min_p is not None:
            processors.append(MinPLogitsWarper(min_p=float(min_p), min_tokens_to_keep=1))
    return processors


class NucleusFilter:
    """transformers' `TopPLogitsWarper` without sorting the whole vocabulary where the most likely tokens decide.

    The warper sorts every row's scores (SmolLM2's 49,152) to keep the smallest set of most likely tokens whose
    probability reaches `top_p`: 16 ms a call on eight rows of the bundled model's logits (2-core development CPU),
    4-5 ms after a top-k of 50, where a decode step's products take about 50 ms (docs/performance.md). A token is
    kept exactly when the probability of the tokens ranked above it is below `top_p` (the warper's rule, read from
    the top), so the `candidates` most likely tokens decide a row whenever they hold `top_p` of its probability:
    every token below them has at least that much above it. Such rows cost one `topk` and a log-sum-exp; any other
    row goes to the warper. Scores of kept tokens are returned unchanged, the others set to the warper's
    `filter_value`. Probabilities are summed in fp32: on bf16 scores (a bf16 decode) the warper sums in bf16, whose
    rounding can move its cut by a token, so there the kept tokens are those the warper keeps on the same scores in
    fp32.

    Args:
        warper: the `TopPLogitsWarper` whose `top_p`, `filter_value` and `min_tokens_to_keep` apply.
        candidates: how many of the most likely tokens to look at first.
    """

    def __init__(self, warper, candidates: int = 256) -> None:
        self.warper = warper
        self.candidates = candidates

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        top_p, keep_least = float(self.warper.top_p), int(self.warper.min_tokens_to_keep)
        k = min(max(self.candidates, keep_least), scores.size(-1))
        top_scores, top_ids = scores.topk(k, dim=-1)
        probs = (top_scores.float() - torch.logsumexp(scores.float(), dim=-1, keepdim=True)).exp()
        through = probs.cumsum(-1)
        above = through - probs  # the probability of the tokens ranked above each
        keep = above < top_p
        keep[:, :keep_least] = True
        kept = torch.full_like(scores, self.warper.filter_value)
        kept.scatter_(-1, top_ids, top_scores.masked_fill(~keep, self.warper.filter_value))
        undecided = (through[:, -1] < top_p) if k < scores.size(-1) else torch.zeros_like(keep[:, 0])
        if bool(undecided.any()):
            rows = undecided.nonzero().squeeze(1)
            kept[rows] = self.warper(input_ids[rows], scores[rows].float()).to(scores.dtype)
        return kept


Generators = Union[torch.Generator, Sequence[torch.Generator], None]
# `decode`'s per-step callback: (step, tokens) -> rows to stop now, or None.
StepHook = Callable[[int, torch.Tensor], Optional[torch.Tensor]]


def sample_from_probs(probs: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """One token per row drawn from `probs` by inverting its cumulative distribution.

    One uniform number per row, where `torch.multinomial` draws one exponential per vocabulary entry (about
    400k per step at batch 8 and SmolLM2's 49k vocabulary, a measurable part of a decode step on a CPU). The
    cumulative sum is taken in float64, so a token's share of [0, total) is its probability to within about
    1e-16. Tokens of probability 0 (cut by top-k/top-p) are never drawn: the first index whose cumulative sum
    exceeds the draw always has a positive probability. Example: probs [0.2, 0, 0.8], draw u = 0.5 → cumulative
    [0.2, 0.2, 1.0], first entry above 0.5 is index 2.

    Args:
        probs: (batch, vocab) non-negative rows (need not sum to exactly 1).
        generator: the random stream (seeded by the caller for reproducible sampling), or one stream per row:
            row i then draws from `generator[i]` alone, so its token does not depend on the rows beside it
            (the online stages' per-row seeds, `alignkit.rl.rollout.row_seeds`).

    Returns:
        (batch,) long token ids.
    """
    cumulative = probs.double().cumsum(-1)
    if generator is None or isinstance(generator, torch.Generator):
        draws = torch.rand(probs.size(0), 1, generator=generator, dtype=torch.float64, device=probs.device)
    else:
        if len(generator) != probs.size(0):
            raise ValueError(f"{len(generator)} per-row generators for {probs.size(0)} rows.")
        draws = torch.stack([torch.rand(1, generator=g, dtype=torch.float64, device=g.device) for g in generator])
        draws = draws.to(probs.device)
    tokens = torch.searchsorted(cumulative, draws * cumulative[:, -1:], right=True)
    return tokens.squeeze(1).clamp_(max=probs.size(-1) - 1)


# A shared prefix is prefilled apart when that saves at least this many token positions. The extra forward call
# streams every weight once more and runs the modules' Python: on the bundled model (AVX2 AMD EPYC, 2 threads)
# a 24-token prefix shared by 2 prompts prefilled 20 ms slower apart, by 4 prompts (72 positions saved) 55 ms
# faster, by 8 (168) 216 ms faster (docs/performance.md).
_SHARED_PREFIX_TOKENS = 40


def _shared_prefix_length(model, cache, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """How many leading real tokens `decode` prefills once for all rows of these left-padded, distinct prompts: the
    tokens every row starts with, less one (each row's own last token gives its first logits); 0 where sharing
    saves fewer than `_SHARED_PREFIX_TOKENS` positions, or where the cache or the attention could not take it (a
    cache layer other than a plain `DynamicLayer`, such as a sliding window; an attention other than sdpa or
    eager, which might not take padding in the middle of a row).
    """
    from transformers.cache_utils import DynamicLayer

    rows, width = prompt_ids.shape
    lengths = prompt_mask.sum(1)
    most = int(lengths.min()) - 1
    if rows < 2 or most * (rows - 1) < _SHARED_PREFIX_TOKENS or not bool((prompt_mask[:, -1] == 1).all()):
        return 0
    if not attention_takes_any_mask(model) or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return 0
    # Row b's real tokens start at column width - lengths[b]: align them at column 0 and compare with row 0.
    columns = torch.arange(most, device=prompt_ids.device)
    starts = (width - lengths)[:, None]
    heads = prompt_ids.gather(1, starts + columns)
    differs = (heads != heads[:1]).any(0)
    prefix = int(differs.int().argmax()) if bool(differs.any()) else most
    return prefix if prefix * (rows - 1) >= _SHARED_PREFIX_TOKENS else 0


def _prefill_shared_prefix(model, cache, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                           prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill left-padded prompts whose first `prefix` real tokens are the same: those once (one row), their keys
    and values then serve every row, and each row's remaining tokens run after them, left-padded.

    The cache then holds, per row, `[prefix | padding | the row's other tokens]` instead of `[padding | prompt]`:
    as many columns, the same positions (rotary reads the position ids, not the column), and the attention
    masks the padding wherever it sits, so the numbers are those of the usual prefill up to float rounding.

    Returns:
        `(logits [rows, 1, V], layout [rows, width])`: each row's last-token logits, and the cache columns' mask
        (1 on real tokens), which the decode steps extend.
    """
    rows, width = prompt_ids.shape
    device = prompt_ids.device
    pads = width - prompt_mask.sum(1, keepdim=True)
    shared = prompt_ids[0, int(pads[0]):int(pads[0]) + prefix]
    model(input_ids=shared[None], position_ids=torch.arange(prefix, device=device)[None], cache=cache,
          use_cache=True, logits_to_keep=1)
    for layer in cache.layers:  # the one row's keys and values, viewed as every row's
        if not layer.is_initialized:  # a layer the forward wrote nothing to keeps its lazy start
            continue
        layer.keys = layer.keys.expand(rows, *layer.keys.shape[1:])
        layer.values = layer.values.expand(rows, *layer.values.shape[1:])
    # Each row without its prefix: its padding, then its other tokens (columns pads + prefix onwards).
    columns = torch.arange(width - prefix, device=device)[None]
    source = torch.where(columns < pads, columns, columns + prefix)
    rest_ids, rest_mask = prompt_ids.gather(1, source), prompt_mask.gather(1, source)
    layout = torch.cat([prompt_mask.new_ones(rows, prefix), rest_mask], dim=1)
    padded = not bool((rest_mask == 1).all())
    logits = model(input_ids=rest_ids, attention_mask=layout if padded else None,
                   position_ids=(prefix + rest_mask.long().cumsum(-1) - 1).masked_fill(rest_mask == 0, 0),
                   cache=cache, use_cache=True, logits_to_keep=1).logits
    return logits, layout


def _reserve_cache(cache, rows: Optional[torch.Tensor], room: int) -> None:
    """Give each plain layer of a prefilled `DynamicCache` buffers with `room` free columns, selecting `rows`.

    `DynamicLayer.update` concatenates each new token onto the layer's whole cache (`torch.cat`: a fresh copy
    of all its keys and values per token and layer; about a tenth of a decode step of the bundled model at
    batch 8 in the profile). Here each layer's keys and values are copied once into buffers with room for the
    tokens still to come, its `keys`/`values` become views of the filled columns, and its `update` copies the
    new token into the next free column (`_update_in_place`). Attention sees the same numbers in the same
    shapes. Layers of other kinds (sliding windows, linear attention) keep their own update.

    Args:
        cache: a `DynamicCache` after the prefill.
        rows: the prefilled row each row of the batch takes (a GRPO group shares its prompt's row), or None.
        room: most tokens still to be appended.
    """
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if type(layer) is not DynamicLayer or not layer.is_initialized:
            if rows is not None:
                layer.batch_select_indices(rows)
            continue
        buffers = []
        for states in (layer.keys, layer.values):
            if rows is not None:
                states = states[rows]
            buffer = states.new_empty(*states.shape[:-2], states.size(-2) + room, states.size(-1))
            buffer[..., :states.size(-2), :] = states
            buffers.append(buffer)
        length = layer.keys.size(-2)
        layer.keys, layer.values = (buffer[..., :length, :] for buffer in buffers)
        layer.update = partial(_update_in_place, layer, *buffers)


def _update_in_place(layer, key_buffer: torch.Tensor, value_buffer: torch.Tensor, key_states: torch.Tensor,
                     value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """`DynamicLayer.update` into the buffers of `_reserve_cache`; concatenation once they are full."""
    from transformers.cache_utils import DynamicLayer

    start = layer.keys.size(-2)
    end = start + key_states.size(-2)
    if layer.keys.data_ptr() != key_buffer.data_ptr() or end > key_buffer.size(-2):
        return DynamicLayer.update(layer, key_states, value_states, *args, **kwargs)
    key_buffer[..., start:end, :] = key_states
    value_buffer[..., start:end, :] = value_states
    layer.keys, layer.values = key_buffer[..., :end, :], value_buffer[..., :end, :]
    return layer.keys, layer.values


def decode(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: Optional[float] = None,
    repetition_penalty: float = 1.0,
    suppress_tokens: Sequence[int] = (),
    generator: Generators = None,
    on_step: Optional[StepHook] = None,
    image_inputs: Optional[dict[str, Any]] = None,
) -> torch.Tensor:
    """New tokens for left-padded prompts: a lean decode loop over the model's forward with the KV cache.

    It does what `model.generate` does for greedy and multinomial sampling (same positions, masks and cache,
    same logits processors, rows stopping at their own stop token and padded after it), without its per-step
    machinery, and with savings of its own:

    - identical prompt rows (a GRPO group: one prompt repeated `num_generations` times) are prefilled once and
      their cache rows copied, so the prompt's forward pass is paid once per distinct prompt;
    - the leading tokens all distinct prompts share (a chat template's default system prompt: 24 tokens of
      SmolLM2's) are prefilled once for all of them where that saves enough (`_shared_prefix_length`);
    - a token is drawn with one uniform number per row (`sample_from_probs`) from the caller's `generator`;
    - each step after the prefill runs through `DecodeStep` where it applies (Llama-family layers, sdpa): the
      model's own modules called layer by layer without the forward's per-layer Python, same logits.

    Greedy output equals `model.generate`'s token for token (tested); sampled output follows the same
    distribution (same processors) but not the same random stream.

    Args:
        model: a causal LM (plain or `PeftModel`) in eval mode, accepting `cache` and `logits_to_keep`; the
            caller disables gradients and merges LoRA (see `generate`).
        prompt_ids, prompt_mask: (batch, prompt_len) left-padded prompts (`left_pad`).
        max_new_tokens: most new tokens per row.
        stop_token_ids: ids that end a row; empty: every row runs to `max_new_tokens`.
        pad_token_id: written after a row's stop token.
        do_sample, temperature, top_p, top_k, min_p, repetition_penalty: as in `model.generate`.
        suppress_tokens: ids never generated (`model.generate`'s key: their logits set to -inf first); a
            vision-language rollout suppresses its image tokens, which a completion must not hold.
        generator: random stream for sampling (None: torch's global one), or one per row (`sample_from_probs`).
        on_step: called after each step with the step's tokens, (batch,) long (the pad id in rows that had
            stopped); it may return a (batch,) bool tensor of rows to stop now (the server's stop strings and
            per-request token limits), their token of this step kept. `alignkit api` streams through it.
        image_inputs: a vision-language model's pixel inputs, laid out by row (`data.multimodal.ImageProcessing.
            row_pixel_inputs`): the prefill gets those of the rows it runs. Rows are prefilled once per distinct
            prompt *and images* (LLaVA's image tokens are the same for every image, so the ids alone cannot tell).

    Returns:
        (batch, new_len) long new tokens, `new_len <= max_new_tokens` (the loop ends when every row stopped).
    """
    from transformers import DynamicCache

    device = prompt_ids.device
    batch, prompt_len = prompt_ids.shape
    processors = sampling_processors(prompt_mask, do_sample=do_sample, temperature=temperature, top_p=top_p,
                                     top_k=top_k, repetition_penalty=repetition_penalty, min_p=min_p)
    stops = torch.as_tensor(list(stop_token_ids), dtype=torch.long, device=device)
    suppressed = torch.as_tensor(list(suppress_tokens), dtype=torch.long, device=device)
    # `generate` drops an all-ones mask (no padding), so the attention kernels see what they see there.
    padded = not bool((prompt_mask == 1).all())

    # Prefill each distinct prompt once (torch.unique sorts them), then give every row its prompt's cache row.
    key = [prompt_ids, prompt_mask]
    if image_inputs is not None:  # each row's images as one more column of the key: an id per distinct image set
        pixels = torch.cat([v.reshape(batch, -1).float() for _, v in sorted(image_inputs.items())], dim=1)
        key.append(torch.unique(pixels, dim=0, return_inverse=True)[1].to(device)[:, None])
    distinct, inverse = torch.unique(torch.cat(key, dim=1), dim=0, return_inverse=True)
    shared = distinct.size(0) < batch
    prefill_ids, prefill_mask = (distinct[:, :prompt_len], distinct[:, prompt_len:2 * prompt_len]) if shared \
        else (prompt_ids, prompt_mask)
    pixels = {}
    if image_inputs is not None:
        from ..data.multimodal import flat_image_inputs

        # One row of each distinct group (any: they hold the same prompt and images).
        rows = inverse.new_empty(distinct.size(0)).scatter_(0, inverse, torch.arange(batch, device=device)) \
            if shared else None
        pixels = {k: v.to(device) for k, v in flat_image_inputs(image_inputs, rows.cpu() if shared else None).items()}
    cache = DynamicCache(config=model.config)
    prefix = _shared_prefix_length(model, cache, prefill_ids, prefill_mask) if image_inputs is None else 0
    if prefix:
        logits, layout = _prefill_shared_prefix(model, cache, prefill_ids, prefill_mask, prefix)
    else:
        logits = model(input_ids=prefill_ids, attention_mask=prefill_mask if padded else None,
                       position_ids=(prefill_mask.long().cumsum(-1) - 1).masked_fill(prefill_mask == 0, 0),
                       cache=cache, use_cache=True, logits_to_keep=1, **pixels).logits
        layout = prefill_mask
    if shared:
        logits, layout = logits[inverse], layout[inverse]
    _reserve_cache(cache, inverse if shared else None, max_new_tokens)

    # The cache's columns: the prompts' (left padding, or the shared prefix first), then the new tokens.
    mask = torch.cat([layout, prompt_mask.new_ones(batch, max_new_tokens)], dim=1)
    sequences = torch.cat([prompt_ids, prompt_ids.new_full((batch, max_new_tokens), pad_token_id)], dim=1)
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    next_position = prompt_mask.long().sum(-1, keepdim=True)  # real tokens from 0, so the next one is at their count
    steps = 0
    lean = DecodeStep.for_model(model) if image_inputs is None else None
    for step in range(max_new_tokens):
        scores = logits[:, -1].float()
        if suppressed.numel():
            scores[:, suppressed] = -math.inf
        scores = processors(sequences[:, :prompt_len + step], scores)
        if do_sample:
            tokens = sample_from_probs(torch.softmax(scores, dim=-1), generator)
        else:
            tokens = scores.argmax(dim=-1)
        tokens = torch.where(unfinished, tokens, pad_token_id)
        sequences[:, prompt_len + step] = tokens
        steps = step + 1
        if stops.numel():
            unfinished &= ~torch.isin(tokens, stops)
        if on_step is not None:
            finished = on_step(step, tokens)
            if finished is not None:
                unfinished &= ~finished.to(device)
        if steps == max_new_tokens or not bool(unfinished.any()):
            break
        step_mask = mask[:, :prompt_len + steps] if padded else None
        if lean is not None:
            logits = lean(tokens, next_position, step_mask, cache)
        else:
            logits = model(input_ids=tokens[:, None], attention_mask=step_mask, position_ids=next_position,
                           cache=cache, use_cache=True, logits_to_keep=1).logits
        next_position = next_position + 1
    return sequences[:, prompt_len:prompt_len + steps]


def generate_replies(
    model,
    formatter: ChatFormatter,
    conversations: Sequence[list[Message]],
    generation_kwargs: dict[str, Any],
    batch_size: int = 8,
) -> list[str]:
    """Answer each conversation (messages ending with a user turn) in batches; replies stripped of
    surrounding whitespace. Prompts go through `formatter`'s template and stop at its end of turn."""
    pad_token_id = padding_token_id(formatter.tokenizer)
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
           "packed_linears", "NucleusFilter",
           "generate", "DECODE_KEYS", "sampling_processors", "sample_from_probs", "decode", "generate_with_decode",
           "generate_replies"]
