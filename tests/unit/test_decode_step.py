"""`alignkit.model.decode_step.DecodeStep`: one decode step in plain tensor calls equals the model's forward."""

from __future__ import annotations

import pytest
import torch

from alignkit.model.decode_step import DecodeStep
from alignkit.model.generation import _reserve_cache, packed_linears

VOCAB = 97


def _config(architecture: str, **extra):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                  attn_implementation="sdpa")
    if architecture == "qwen2":
        common.update(use_sliding_window=False)
    if architecture == "mistral":
        common.update(sliding_window=None)
    common.update(extra)
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "mistral": transformers.MistralConfig}[architecture]
    return config_class(**common)


def _model(architecture: str, seed: int = 0, **extra):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(architecture, **extra)).eval()
    # Random biases where the architecture has them (Qwen2's q/k/v), so a step that dropped them would differ.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
    return model


def _prompts():
    """Two left-padded rows: [5 17 30 8] and [_ _ 7 9]."""
    ids = torch.tensor([[5, 17, 30, 8], [2, 2, 7, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    return ids, mask


def _prefill(model, ids, mask, padded: bool, room: int):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    model(input_ids=ids, attention_mask=mask if padded else None, position_ids=positions, cache=cache,
          use_cache=True, logits_to_keep=1)
    _reserve_cache(cache, None, room)
    return cache


def _three_steps(model, step, padded: bool) -> list[torch.Tensor]:
    """Logits of three decode steps (tokens 11, 23, 41 in every row), by `step` or, if None, the model's forward."""
    ids, mask = _prompts()
    if not padded:
        ids, mask = ids[:1], mask[:1]
    cache = _prefill(model, ids, mask, padded, room=3)
    position = mask.long().sum(-1, keepdim=True)
    full = torch.cat([mask, mask.new_ones(mask.size(0), 3)], dim=1)
    out = []
    for i, token in enumerate((11, 23, 41)):
        tokens = torch.full((ids.size(0),), token)
        step_mask = full[:, :ids.size(1) + i + 1] if padded else None
        if step is None:
            logits = model(input_ids=tokens[:, None], attention_mask=step_mask, position_ids=position, cache=cache,
                           use_cache=True, logits_to_keep=1).logits
        else:
            logits = step(tokens, position, step_mask, cache)
        out.append(logits)
        position = position + 1
    return out


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("padded", [True, False])
def test_step_logits_equal_the_model_forward(architecture, padded):
    """Three steps after a prefill: `DecodeStep`'s logits equal the model's forward (same cache, positions,
    mask) within float rounding, for each supported architecture, with and without padding."""
    model = _model(architecture, attention_bias=True) if architecture != "qwen2" else _model(architecture)
    step = DecodeStep.for_model(model)
    assert step is not None
    with torch.no_grad():
        expected = _three_steps(model, None, padded)
        got = _three_steps(model, step, padded)
    for e, g in zip(expected, got):
        assert g.shape == e.shape == (2 if padded else 1, 1, VOCAB)
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_step_runs_lora_and_packed_weights(tiny_model_dir, tmp_path, save_perturbed_adapter):
    """A PEFT LoRA model (adapter not merged), then the same under `packed_linears`: the step's logits equal
    the model's forward in each case, and the adapter changes them (so the step applied it)."""
    model = save_perturbed_adapter(tiny_model_dir, tmp_path / "adapter").eval()
    step = DecodeStep.for_model(model)
    assert step is not None
    with torch.no_grad():
        expected = _three_steps(model, None, padded=True)
        got = _three_steps(model, step, padded=True)
        with packed_linears(model, batch_size=2) as packed:
            assert packed
            got_packed = _three_steps(model, step, padded=True)
        with model.disable_adapter():
            base = _three_steps(model, step, padded=True)
    for e, g, p, b in zip(expected, got, got_packed, base):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p, e, rtol=1e-4, atol=1e-4)
        assert (e - b).abs().max() > 1e-3


def test_step_applies_only_where_its_equality_is_known():
    """None for eager attention, a non-SiLU MLP, a Qwen2 model with sliding-window layers, a Mistral model with
    a sliding window, a model in training mode, a module with a forward hook; a step for the same model without
    them."""
    assert DecodeStep.for_model(_model("llama")) is not None
    assert DecodeStep.for_model(_model("llama", attn_implementation="eager")) is None
    assert DecodeStep.for_model(_model("llama", hidden_act="gelu")) is None
    assert DecodeStep.for_model(_model("qwen2", use_sliding_window=True, sliding_window=8,
                                       max_window_layers=0)) is None
    assert DecodeStep.for_model(_model("mistral", sliding_window=4096)) is None  # Mistral's default window
    assert DecodeStep.for_model(_model("llama").train()) is None
    hooked = _model("llama")
    handle = hooked.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert DecodeStep.for_model(hooked) is None
    handle.remove()
    assert DecodeStep.for_model(hooked) is not None
