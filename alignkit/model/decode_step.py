"""One decode step of a Llama-family causal LM in plain tensor calls (`DecodeStep`), for `generation.decode`.

A decode step feeds one token per row through every layer. Its products are small, and transformers' forward
wraps them in a great deal of Python per layer: module calls through `nn.Module.__call__`, keyword handling and
decorators on every layer, attention and model, an attention-mask build per step (`create_causal_mask`), output
dataclasses. On the bundled SmolLM2-135M at 8 rows that Python and its small ops took about as long as the
products themselves (docs/performance.md, "The fifteenth session"). `DecodeStep` runs the same computation with
the model's own modules and weights, layer by layer:

- each RMSNorm, linear layer (plain, PEFT's LoRA layer, or the packed copy `generation.packed_linears` put in
  its place) and the rotary embedding run through their own `forward`, so their numerics are the model's;
- rotary positions are applied by the modeling file's own `apply_rotary_pos_emb`, keys and values go through the
  cache's own `update`, and attention is transformers' sdpa function with the mask its sdpa path builds for one query
  (padding columns masked, or no mask without padding);
- the MLP is `down(act(gate(x)) * up(x))`, the residual adds as the decoder layer's.

So its logits equal the model's forward at the same positions, cache and mask (tested per supported
architecture, with and without padding, LoRA and packing; greedy decoding equals `model.generate`).

It applies only where that equality is known: the exact decoder-layer classes of Llama, Qwen2 and Mistral
(`SUPPORTED_LAYERS`; Qwen2's and Mistral's only without a sliding window: Mistral's config sets one by default,
so its models take the step only with `sliding_window: null`), sdpa attention, no forward hooks
on any module (calling `forward` directly would skip them), and a model that is not training. Everywhere else
`DecodeStep.for_model` returns None and decode calls the model as before.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

# Decoder layers whose forward is exactly: pre-norm, q/k/v projections, rotary, cache update, attention, o_proj,
# residual, post-norm, gated MLP, residual (transformers 5.x modeling files).
SUPPORTED_LAYERS = {
    "LlamaDecoderLayer": "LlamaAttention",
    "Qwen2DecoderLayer": "Qwen2Attention",
    "MistralDecoderLayer": "MistralAttention",
}


def _causal_lm_parts(model: nn.Module) -> Optional[tuple[nn.Module, nn.Module]]:
    """(decoder, lm_head) of a plain or PEFT-wrapped `*ForCausalLM`, or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = getattr(base, "model", None), getattr(base, "lm_head", None)
    if decoder is None or head is None or not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        return None
    return decoder, head


def _has_hooks(model: nn.Module) -> bool:
    from torch.nn.modules import module as module_globals

    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class DecodeStep:
    """Logits of one new token per row, computed layer by layer with the model's own modules (module doc)."""

    def __init__(self, decoder: nn.Module, head: nn.Module, layers: list[nn.Module], attention, rotary):
        self.decoder, self.head, self.layers, self.attention, self.rotary = decoder, head, layers, attention, rotary

    @classmethod
    def for_model(cls, model: nn.Module) -> Optional["DecodeStep"]:
        """The step for `model`, or None where it does not apply (then call the model)."""
        parts = _causal_lm_parts(model)
        if parts is None or model.training:
            return None
        decoder, head = parts
        config = decoder.config
        if getattr(config, "_attn_implementation", None) != "sdpa" or getattr(config, "hidden_act", None) != "silu":
            return None
        if getattr(config, "sliding_window", None) is not None:  # Mistral's default: its mask would need the window
            return None
        layers = list(decoder.layers[: config.num_hidden_layers])
        for layer in layers:
            attention_class = SUPPORTED_LAYERS.get(type(layer).__name__)
            attn = getattr(layer, "self_attn", None)
            if (attention_class is None or type(attn).__name__ != attention_class
                    or type(layer).__module__ != type(attn).__module__
                    or type(layer.mlp).__name__ != type(layer).__name__.replace("DecoderLayer", "MLP")):
                return None
        if not layers or type(decoder.norm).__name__ != type(layers[0]).__name__.replace("DecoderLayer", "RMSNorm"):
            return None
        if _has_hooks(model):
            return None
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        rotary = sys.modules[type(layers[0]).__module__].apply_rotary_pos_emb
        return cls(decoder, head, layers, ALL_ATTENTION_FUNCTIONS["sdpa"], rotary)

    def __call__(self, tokens: torch.Tensor, position_ids: torch.Tensor, mask: Optional[torch.Tensor],
                 cache) -> torch.Tensor:
        """(batch, 1, vocab) logits of `tokens` (batch,) at `position_ids` (batch, 1).

        Args:
            mask: (batch, columns) 1 where a cache column (and the new token, last) is attended, or None when
                no row has padding (as decode passes the model).
            cache: the decode's `DynamicCache`; each layer's keys and values are appended through its `update`.
        """
        decoder = self.decoder
        hidden = decoder.embed_tokens.forward(tokens[:, None])
        cos, sin = decoder.rotary_emb.forward(hidden, position_ids)
        # transformers' sdpa mask for one query: True where attended, (batch, 1, 1, columns).
        attention_mask = None if mask is None else mask.bool()[:, None, None, :]
        batch = hidden.shape[0]
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm.forward(hidden)
            shape = (batch, 1, -1, attn.head_dim)
            q = attn.q_proj.forward(x).view(shape).transpose(1, 2)
            k = attn.k_proj.forward(x).view(shape).transpose(1, 2)
            v = attn.v_proj.forward(x).view(shape).transpose(1, 2)
            q, k = self.rotary(q, k, cos, sin)
            k, v = cache.update(k, v, index)
            out, _ = self.attention(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling)
            hidden = hidden + attn.o_proj.forward(out.reshape(batch, 1, -1).contiguous())
            x = layer.post_attention_layernorm.forward(hidden)
            mlp = layer.mlp
            gated = mlp.act_fn.forward(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x)
            hidden = hidden + mlp.down_proj.forward(gated)
        return self.head.forward(decoder.norm.forward(hidden))


__all__ = ["DecodeStep", "SUPPORTED_LAYERS"]
