"""`alignkit.model.generation`: padding, completion masks, templates, stopping, and LoRA merging for generation."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from alignkit.config.parse import parse_config
from alignkit.data.template import ChatFormatter
from alignkit.errors import DataError
from alignkit.model import generation
from alignkit.model.generation import (completion_mask, decode, encode_prompts, generate, generate_with_decode,
                                       left_pad, merged_lora, packed_linears, pad_prompts, sample_from_probs,
                                       sampling_processors, stop_token_ids)

IM_END, ENDOFTEXT = 2, 0  # ids in the tiny tokenizer


@pytest.mark.parametrize("side", ["left", "right"])
def test_left_pad(side):
    """Rows [5 6 7] and [8 9] padded with 0 on either side become [5 6 7] and [0 8 9]."""
    if side == "right":
        ids, mask = torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    else:
        ids, mask = torch.tensor([[5, 6, 7], [0, 8, 9]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    left_ids, left_mask = left_pad(ids, mask, pad_token_id=0)
    assert left_ids.tolist() == [[5, 6, 7], [0, 8, 9]]
    assert left_mask.tolist() == [[1, 1, 1], [0, 1, 1]]


def test_left_pad_keeps_real_tokens_equal_to_pad_id():
    """pad == eos: a real eos (id 2) inside a row survives, padding goes by the mask only:
    [4 2 | 2] (last column padding) -> [2 | 4 2], and [2 4 2 5] with one pad in front stays as it is."""
    ids = torch.tensor([[4, 2, 2, 9], [2, 4, 2, 5]])
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]])
    left_ids, left_mask = left_pad(ids, mask, pad_token_id=2)
    assert left_ids.tolist() == [[2, 2, 4, 2], [2, 4, 2, 5]]
    assert left_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]


def test_pad_prompts_left_pads_lists():
    ids, mask = pad_prompts([[5, 6, 7], [8, 9], [4]], pad_token_id=2)
    assert ids.tolist() == [[5, 6, 7], [2, 8, 9], [2, 2, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="empty prompt"):
        pad_prompts([[5], []], pad_token_id=2)


def test_completion_mask_hand_computed():
    """Stop ids {2, 7}. Row by row (first stop kept, everything after it masked):
    [4 5 2 2 2] -> first stop at 2 -> 1 1 1 0 0, stopped
    [4 7 6 2 8] -> first stop at 1 (id 7) -> 1 1 0 0 0, stopped
    [4 5 6 8 9] -> no stop -> 1 1 1 1 1, truncated
    [2 9 9 9 9] -> stop at 0 -> 1 0 0 0 0, stopped
    [4 5 6 8 7] -> stop in the last column -> 1 1 1 1 1, stopped (not truncated)"""
    ids = torch.tensor([[4, 5, 2, 2, 2], [4, 7, 6, 2, 8], [4, 5, 6, 8, 9], [2, 9, 9, 9, 9], [4, 5, 6, 8, 7]])
    mask, truncated = completion_mask(ids, [2, 7])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True, False, False]


@pytest.fixture
def tokenizer_with_default_system(tiny_tokenizer):
    """The tiny ChatML tokenizer whose own template injects a default system turn (as SmolLM2's does)."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nBe kind.<|im_end|>\n' }}{% endif %}"
        + tiny_tokenizer.chat_template)
    return tok


def test_prompts_follow_the_configured_template(tokenizer_with_default_system):
    """The tokenizer's own template adds its system turn; `chatml` does not; `plain` is a transcript."""
    tok = tokenizer_with_default_system
    conversation = [[{"role": "user", "content": "What is 12 plus 7?"}]]
    expected_text = {
        None: "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nWhat is 12 plus 7?<|im_end|>\n"
              "<|im_start|>assistant\n",
        "chatml": "<|im_start|>user\nWhat is 12 plus 7?<|im_end|>\n<|im_start|>assistant\n",
        "plain": "Human: What is 12 plus 7?\nAssistant: ",
    }
    for template, text in expected_text.items():
        (ids,) = encode_prompts(ChatFormatter(tok, template), conversation)
        assert ids == tok(text, add_special_tokens=False)["input_ids"], template
    own, chatml = (encode_prompts(ChatFormatter(tok, t), conversation)[0] for t in (None, "chatml"))
    assert own.count(IM_END) == 2 and chatml.count(IM_END) == 1  # special tokens are single ids


def test_stop_token_ids_per_template(tiny_tokenizer):
    """The end-of-turn token comes first, then eos when it differs; a template whose end-of-turn text
    the tokenizer cannot produce as one token is refused."""
    assert ChatFormatter(tiny_tokenizer).stop_token_ids() == [IM_END]  # ChatML with eos == <|im_end|>
    other_eos = copy.deepcopy(tiny_tokenizer)
    other_eos.eos_token = "<|endoftext|>"
    assert ChatFormatter(other_eos, "chatml").stop_token_ids() == [IM_END, ENDOFTEXT]
    assert ChatFormatter(other_eos).stop_token_ids() == [IM_END, ENDOFTEXT]
    assert ChatFormatter(other_eos, "plain").stop_token_ids() == [ENDOFTEXT]  # plain closes a reply with eos
    with pytest.raises(DataError, match=r"'llama3'.*<\|eot_id\|>.*not have as single tokens"):
        ChatFormatter(tiny_tokenizer, "llama3")
    text_end = copy.deepcopy(tiny_tokenizer)
    text_end.chat_template = ("{% for m in messages %}{{ m.role + ': ' + m.content + ' END' }}{% endfor %}"
                              "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(DataError, match=r"'END'.*not a special token"):
        ChatFormatter(text_end).stop_token_ids()
    no_template = copy.deepcopy(other_eos)
    no_template.chat_template = None
    assert stop_token_ids(no_template) == [ENDOFTEXT]  # a base model for `stage: pt`


class ForceTokens(LogitsProcessor):
    """Makes row r emit `tokens[r][t]` at step t, so stopping can be tested on a random model."""

    def __init__(self, tokens: list[list[int]], prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        forced = torch.full_like(scores, float("-inf"))
        for row, tokens in enumerate(self.tokens):
            forced[row, tokens[step]] = 0.0
        return forced


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def test_generate_stops_each_row_at_end_of_turn(tiny_model, tiny_tokenizer):
    """With eos != <|im_end|>, ChatML rows stop at <|im_end|> (row 0, step 3) or eos (row 2, step 2);
    row 1 never stops and is truncated at max_new_tokens=5. After a stop the row holds the pad id."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.eos_token = "<|endoftext|>"
    formatter = ChatFormatter(tok, "chatml")
    ids, mask = pad_prompts(encode_prompts(formatter, [[{"role": "user", "content": q}] for q in
                                                       ("What is 12 plus 7?", "Name a colour", "Hi")]), IM_END)
    forced = [[5, 6, IM_END, 9, 9], [7, 7, 7, 7, 7], [8, ENDOFTEXT, 9, 9, 9]]
    out = generate(tiny_model, tok, ids, mask, stop_token_ids=formatter.stop_token_ids(),
                   generation_kwargs={"max_new_tokens": 5, "do_sample": False,
                                      "logits_processor": LogitsProcessorList([ForceTokens(forced, ids.shape[1])])})
    assert out.completion_ids.tolist() == [[5, 6, IM_END, IM_END, IM_END], [7, 7, 7, 7, 7],
                                           [8, ENDOFTEXT, IM_END, IM_END, IM_END]]
    assert out.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert out.truncated.tolist() == [False, True, False]
    assert out.texts == [tok.decode([5, 6]), tok.decode([7] * 5), tok.decode([8])]
    assert torch.equal(out.prompt_ids, ids) and torch.equal(out.prompt_mask, mask)


def test_generate_left_pads_uses_kv_cache_and_restores_train_mode(tiny_model, tiny_tokenizer, monkeypatch):
    """Right-padded prompts are left-aligned; after the prompt each forward sees one new token (the KV
    cache is used although the config turned it off); the model is back in train mode afterwards."""
    model = copy.deepcopy(tiny_model)
    model.config.use_cache = False
    model.train()
    seen_lengths = []
    real_forward = type(model).forward

    def recording_forward(self, *args, **kwargs):
        seen_lengths.append(kwargs["input_ids"].shape[1])
        assert not self.training and not torch.is_grad_enabled()
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", recording_forward)
    ids, mask = torch.tensor([[5, 17, 30, 44], [7, 8, 2, 2]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = generate(model, tiny_tokenizer, ids, mask, stop_token_ids=[],
                   generation_kwargs={"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False})
    assert model.training
    assert out.prompt_ids.tolist() == [[5, 17, 30, 44], [2, 2, 7, 8]]
    assert seen_lengths == [4, 1, 1, 1]
    monkeypatch.undo()
    alone = model.generate(input_ids=torch.tensor([[7, 8]]), max_new_tokens=4, min_new_tokens=4,
                           do_sample=False, pad_token_id=2)[0, 2:]
    assert out.completion_ids[1].tolist() == alone.tolist()


def test_generate_repeats_prompts_for_several_sequences(tiny_model, tiny_tokenizer):
    ids, mask = torch.tensor([[5, 6], [2, 7]]), torch.tensor([[1, 1], [0, 1]])
    torch.manual_seed(0)
    out = generate(tiny_model, tiny_tokenizer, ids, mask, stop_token_ids=[IM_END],
                   generation_kwargs={"max_new_tokens": 3, "do_sample": True, "num_return_sequences": 2})
    assert out.prompt_ids.tolist() == [[5, 6], [5, 6], [2, 7], [2, 7]]
    assert out.completion_ids.shape[0] == out.truncated.shape[0] == len(out.texts) == 4


@pytest.fixture
def lora_model(tiny_model_dir, tmp_path, save_perturbed_adapter):
    """A trainable PeftModel whose LoRA B matrices are random (as if trained), in train mode."""
    model = save_perturbed_adapter(tiny_model_dir, tmp_path / "adapter")
    model.train()
    return model


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def test_merged_generation_equals_unmerged_and_restores_weights_bit_exactly(lora_model, tiny_tokenizer):
    before = _snapshot(lora_model)
    ids, mask = pad_prompts([[5, 17, 30, 44, 9], [7, 8], [40, 41, 42]], IM_END)
    kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    unmerged = generate(lora_model, tiny_tokenizer, ids, mask, stop_token_ids=[IM_END], generation_kwargs=kwargs,
                        merge_lora=False)
    merged = generate(lora_model, tiny_tokenizer, ids, mask, stop_token_ids=[IM_END], generation_kwargs=kwargs)
    assert merged.completion_ids.tolist() == unmerged.completion_ids.tolist()
    assert len(set(map(tuple, merged.completion_ids.tolist()))) > 1  # rows differ: the comparison means something
    after = _snapshot(lora_model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert lora_model.training and not any(getattr(m, "merged", False) for m in lora_model.modules())


def test_merged_lora_merges_inside_and_leaves_disabled_adapter_alone(lora_model):
    """Inside the block the base weights carry the adapter (and the LoRA path is skipped, so the
    output is unchanged); with the adapter disabled (the reference policy) nothing is merged."""
    layer = next(m for m in lora_model.modules() if hasattr(m, "lora_A") and len(m.lora_A))
    original = layer.get_base_layer().weight
    original_data = original.data
    batch = torch.tensor([[5, 17, 30, 44, 9]])
    lora_model.eval()
    with torch.no_grad():
        expected = lora_model(input_ids=batch).logits
        with merged_lora(lora_model) as merged:
            assert merged and layer.merged
            assert layer.get_base_layer().weight is original  # the same parameter, new data
            assert not torch.equal(original.data, original_data)
            torch.testing.assert_close(lora_model(input_ids=batch).logits, expected, atol=1e-5, rtol=0)
        assert original.data.data_ptr() == original_data.data_ptr() and not layer.merged
        with lora_model.disable_adapter(), merged_lora(lora_model) as merged:
            assert not merged and not layer.merged


def test_merged_lora_computes_each_delta_once(lora_model, monkeypatch):
    """Plain LoRA: the delta B @ A of each layer is computed for the merge only; leaving the block drops the
    merged copies without PEFT's unmerge, which would compute every delta a second time to subtract it."""
    from peft.tuners.lora import LoraLayer

    calls = []
    layers = [m for m in lora_model.modules() if isinstance(m, LoraLayer)]
    for cls in {type(layer) for layer in layers}:  # lora.Linear etc. override the base method
        monkeypatch.setattr(cls, "get_delta_weight",
                            lambda self, adapter, _original=cls.get_delta_weight: calls.append(self) or _original(self, adapter))
    with torch.no_grad(), merged_lora(lora_model) as merged:
        assert merged and len(calls) == len(layers)
    assert len(calls) == len(layers) and not any(layer.merged for layer in layers)


def test_merge_into_equals_peft_deltas_for_fused_and_fallback_factors():
    """`_merge_into` writes `W + sum of B A scale` over the given adapters: the fused `addmm` for fp32 factors and
    PEFT's `get_delta_weight` for bf16 ones give the same block as PEFT's deltas added by hand; no adapter names
    copy the base weight; the layer's own tensors are not written."""
    from peft import LoraConfig, get_peft_model

    from alignkit.model.generation import _merge_into

    torch.manual_seed(0)
    peft_model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(6, 4)),
                                LoraConfig(r=2, lora_alpha=4, target_modules=["0"]), adapter_name="one")
    peft_model.add_adapter("two", LoraConfig(r=3, lora_alpha=6, target_modules=["0"]))
    layer = peft_model.base_model.model[0]
    for name in ("one", "two"):
        torch.nn.init.normal_(layer.lora_B[name].weight)
    weight = layer.get_base_layer().weight.detach()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    expected = weight + layer.get_delta_weight("one") + layer.get_delta_weight("two")
    block = torch.full_like(weight, float("nan"))
    with torch.no_grad():
        _merge_into(block, weight, layer, ["one", "two"])
    torch.testing.assert_close(block, expected, atol=1e-6, rtol=0)
    assert (expected - weight).abs().max() > 0.1  # the deltas are there to be merged
    with torch.no_grad():
        _merge_into(block, weight, layer, [])
    assert torch.equal(block, weight)
    layer.lora_A["two"].to(torch.bfloat16)
    layer.lora_B["two"].to(torch.bfloat16)
    with torch.no_grad():
        _merge_into(block, weight, layer, ["one", "two"])
    half = weight + layer.get_delta_weight("one") + layer.get_delta_weight("two").float()
    torch.testing.assert_close(block, half, atol=1e-6, rtol=0)
    assert all(torch.equal(before[k].to(v.dtype), v) for k, v in layer.state_dict().items())


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
def test_packed_linears_equal_the_merged_model_and_write_no_weight(lora_model):
    """Inside the block every LoRA layer and the plain head run oneDNN-packed copies with the adapter merged in:
    the logits equal the merged model's up to float rounding; with the adapter disabled (the reference policy)
    they equal the base model's. Afterwards every layer has the forward it had (the fused LoRA one included) and
    every weight is bit-for-bit as before."""
    from peft.tuners.lora import LoraLayer

    before = _snapshot(lora_model)
    forwards = {name: m.__dict__.get("forward") for name, m in lora_model.named_modules()}
    lora_model.eval()
    batch = torch.tensor([[5, 17, 30, 44, 9], [7, 8, 40, 41, 42]])
    patched = [m for m in lora_model.modules() if isinstance(m, LoraLayer)] + [lora_model.get_output_embeddings()]
    with torch.no_grad():
        with merged_lora(lora_model):
            merged = lora_model(input_ids=batch).logits
        with lora_model.disable_adapter():
            base = lora_model(input_ids=batch).logits
        with packed_linears(lora_model, batch_size=2) as packed:
            assert packed and all("forward" in m.__dict__ for m in patched)
            got = lora_model(input_ids=batch).logits
        with lora_model.disable_adapter(), packed_linears(lora_model, batch_size=2) as packed:
            assert packed
            got_base = lora_model(input_ids=batch).logits
    assert (merged - base).abs().max() > 1e-3  # the adapter changes the logits: the comparison means something
    torch.testing.assert_close(got, merged, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_base, base, atol=1e-5, rtol=0)
    assert {name: m.__dict__.get("forward") for name, m in lora_model.named_modules()} == forwards
    assert all(torch.equal(before[name], t) for name, t in _snapshot(lora_model).items())


def _packed_weights(model) -> dict[str, torch.Tensor]:
    """The packed weight each layer multiplies with inside a `packed_linears` block, by module name (siblings
    sharing one product name the same tensor)."""
    from alignkit.model.generation import _packed_forward, _SharedProduct

    found = {}
    for name, m in model.named_modules():
        forward = vars(m).get("forward")
        func = getattr(forward, "func", None)
        if func is _packed_forward:
            found[name] = forward.args[0]
        elif isinstance(getattr(func, "__self__", None), _SharedProduct):
            found[name] = func.__self__.packed
    return found


def _packed_dtypes(model) -> set:
    """The dtypes of the packed weights the model's layers multiply with inside a `packed_linears` block."""
    return {w.dtype for w in _packed_weights(model).values()}


@needs_onednn
def test_packed_linears_pack_siblings_as_one_product_and_skip_lora_factors(lora_model):
    """Each attention's q/k/v projections share one packed product, each MLP's gate/up projections another;
    o_proj, down_proj and the head are packed alone, and a LoRA layer's own `lora_A`/`lora_B`/base modules are
    never packed (they run inside the layer's packed forward: packing them cost a third of the packing time)."""
    lora_model.eval()
    with torch.no_grad(), packed_linears(lora_model, batch_size=2) as packed:
        assert packed
        weights = _packed_weights(lora_model)
    layers = lora_model.config.num_hidden_layers
    assert len(weights) == 7 * layers + 1  # every projection of every layer, and the head
    assert not any(part in name for name in weights for part in ("lora_A", "lora_B", "base_layer"))
    shared = {}
    for name, weight in weights.items():
        shared.setdefault(id(weight), []).append(name.rsplit(".", 1)[-1])
    assert sorted(map(tuple, shared.values())) == sorted(
        [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",)] * layers
        + [("lm_head",)])


@needs_onednn
def test_shared_product_serves_siblings_in_any_order_and_recomputes_for_another_input():
    """A shared product equals each sibling's own `F.linear` whatever the calls: in the model's order, in another
    order, one sibling twice with the same input (recomputed, not served stale), or a sibling with a new tensor
    (the earlier input's columns are not handed out for it)."""
    from alignkit.model.generation import _SharedProduct

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, 6, generator=g) for n in (5, 3, 3)]
    biases = [torch.randn(n, generator=g) for n in (5, 3, 3)]
    product = _SharedProduct(torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights), 2), torch.cat(biases),
                             [5, 3, 3])
    x, y = torch.randn(2, 1, 6, generator=g), torch.randn(2, 1, 6, generator=g)

    def check(index, inputs):
        got = product.forward(index, inputs)
        assert got.shape == (2, 1, weights[index].size(0)) and got.is_contiguous()
        torch.testing.assert_close(got, torch.nn.functional.linear(inputs, weights[index], biases[index]))

    for index in (0, 1, 2):
        check(index, x)
    assert product.input is None and product.output is None  # all served: nothing held between steps
    for index, inputs in ((1, x), (1, x), (0, y), (2, x), (2, y), (0, x)):
        check(index, inputs)
    check(0, x)
    x.mul_(2.0)  # an in-place change to the same tensor object between two siblings is seen
    check(1, x)


@needs_onednn
@pytest.mark.parametrize("onednn_bf16", [True, False], ids=["onednn-bf16", "no-onednn-bf16"])
def test_packed_linears_pack_copies_in_the_autocast_dtype(lora_model, monkeypatch, onednn_bf16):
    """Entered under a bf16 CPU autocast (a bf16 run's rollout), every packed copy is bf16 and each packed layer
    gives bf16 outputs, as autocast's `F.linear` does; the logits are the autocast merged model's up to bf16
    rounding (the merge is rounded once, where autocast rounds base and adapter apart), far closer than the
    adapter's own effect. Entered without autocast the copies stay fp32. Where oneDNN cannot pack bf16 (an
    AVX2-only AMD EPYC raised "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
    in every bf16 rollout) the copies are fp32 under autocast too, with the same logits."""
    if onednn_bf16 and not generation.onednn_supports_bf16():
        pytest.skip("oneDNN packs bf16 only with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; the fp32 case runs here")
    monkeypatch.setattr(generation, "onednn_supports_bf16", lambda: onednn_bf16)
    packed_dtype = torch.bfloat16 if onednn_bf16 else torch.float32
    lora_model.eval()
    batch = torch.tensor([[5, 17, 30, 44, 9], [7, 8, 40, 41, 42]])
    head = lora_model.get_output_embeddings()
    seen = []
    hook = head.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            with merged_lora(lora_model):
                merged = lora_model(input_ids=batch).logits.float()
            with lora_model.disable_adapter():
                base = lora_model(input_ids=batch).logits.float()
            with packed_linears(lora_model, batch_size=2) as packed:
                assert packed
                copies = _packed_dtypes(lora_model)
                got = lora_model(input_ids=batch).logits.float()
        with torch.no_grad(), packed_linears(lora_model, batch_size=2) as packed:
            fp32_copies = _packed_dtypes(lora_model)
    finally:
        hook.remove()
    assert copies == {packed_dtype} and fp32_copies == {torch.float32}
    assert seen[2] == packed_dtype  # the packed head's own output
    effect = (merged - base).abs().max()
    assert effect > 1e-2
    assert (got - merged).abs().max() < effect / 4


def test_packed_linears_leave_dora_to_merged_lora(tiny_model):
    """A LoRA variant (DoRA) is not packed (the block yields False and patches nothing): the caller merges it."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=2, target_modules="all-linear", use_dora=True))
    with torch.no_grad(), packed_linears(model, batch_size=2) as packed:
        assert not packed and not any("forward" in m.__dict__ for m in model.modules())


def test_reserved_cache_equals_concatenation(tiny_model):
    """After `_reserve_cache` each layer's keys/values are views into buffers with room for new tokens, and each
    update gives what `DynamicCache`'s concatenation gives (rows [1, 0, 1] of a 2-row prefill, 3 new tokens with
    room for 2: the third falls back to concatenation)."""
    from transformers import DynamicCache

    from alignkit.model.generation import _reserve_cache

    ids = torch.tensor([[5, 17, 30], [7, 8, 9]])
    rows = torch.tensor([1, 0, 1])
    with torch.no_grad():
        ours, theirs = DynamicCache(config=tiny_model.config), DynamicCache(config=tiny_model.config)
        tiny_model(input_ids=ids, past_key_values=ours, use_cache=True)
        tiny_model(input_ids=ids, past_key_values=theirs, use_cache=True)
        _reserve_cache(ours, rows, room=2)
        theirs.batch_select_indices(rows)
        for step, token in enumerate([4, 6, 8]):
            position = torch.full((3, 1), 3 + step)
            a = tiny_model(input_ids=torch.full((3, 1), token), position_ids=position, past_key_values=ours,
                           use_cache=True).logits
            b = tiny_model(input_ids=torch.full((3, 1), token), position_ids=position, past_key_values=theirs,
                           use_cache=True).logits
            assert torch.equal(a, b)
            for mine, reference in zip(ours.layers, theirs.layers):
                assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)
        assert ours.layers[0].keys.shape[-2] == 6


def test_merge_unmerge_round_trip_is_not_exact_in_fp32(lora_model):
    """Why `merged_lora` restores saved tensors instead of unmerging: (W + BA) - BA != W bit for bit."""
    before = _snapshot(lora_model)
    with torch.no_grad():
        lora_model.merge_adapter()
        lora_model.unmerge_adapter()
    after = _snapshot(lora_model)
    assert any(not torch.equal(before[name], after[name]) for name in before)


def test_chat_uses_the_template_key(tiny_model_dir, monkeypatch):
    """`template=plain` reaches the model as the plain transcript; a template the tokenizer cannot stop
    on is refused before any generation."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from alignkit.chat import chat

    sent = []
    real_generate = LlamaForCausalLM.generate

    def recording_generate(self, *args, **kwargs):
        sent.append(kwargs["input_ids"].tolist())
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "generate", recording_generate)
    config = parse_config({"model_name_or_path": tiny_model_dir, "max_new_tokens": 3})
    chat(config.model, config.generating, prompt="Name a colour", template="plain", stream=io.StringIO())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert sent == [[tokenizer("Human: Name a colour\nAssistant: ", add_special_tokens=False)["input_ids"]]]
    with pytest.raises(DataError, match="llama3"):
        chat(config.model, config.generating, prompt="hi", template="llama3", stream=io.StringIO())
    assert len(sent) == 1


# ---- the lean decode loop used for rollouts ----

def _hf_greedy(model, ids, mask, max_new_tokens, stop_ids, **kwargs):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=IM_END, eos_token_id=stop_ids, **kwargs)
    return out[:, ids.shape[1]:]


# 20 leading tokens several prompts share (a chat template's system prompt): `decode` prefills them once.
SHARED = [11, 23, 4, 37, 9, 50, 13, 28, 6, 45, 19, 33, 8, 41, 26, 15, 48, 7, 31, 22]


@pytest.fixture(scope="module")
def varied_model(tiny_model):
    """The tiny model with its own random output head: with the head tied to the embeddings it only repeats the
    last prompt token under greedy decoding, which would make any comparison of decoders trivially equal."""
    model = copy.deepcopy(tiny_model).eval()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(
        torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    return model


@pytest.mark.parametrize("prompts", [
    [[5, 17, 30, 44, 9], [7, 8], [40, 41, 42]],             # padded, all distinct
    [[5, 17, 30], [7, 8], [5, 17, 30], [7, 8], [7, 8]],     # repeated prompts: prefilled once each
    [[5, 17, 30], [6, 18, 31]],                             # no padding: no mask, as in generate
    [SHARED + [5, 17, 30], SHARED + [7, 8], SHARED + [40, 41, 42, 43], SHARED + [7, 8]],  # shared prefix, padded
    [SHARED + [5, 17], SHARED + [6, 18], SHARED + [7, 19]],  # shared prefix, no padding
])
@pytest.mark.parametrize("repetition_penalty", [1.0, 1.3])
def test_decode_greedy_equals_hf_generate(varied_model, prompts, repetition_penalty):
    """Greedy `decode` gives `model.generate`'s tokens exactly (same positions, masks, cache, processors),
    including where rows stop: the stop id is the token row 1 emits at step 5 of an unstopped run, so row 1
    stops there at the latest and the others stop at it or run on; after a stop both write the pad id."""
    ids, mask = pad_prompts(prompts, IM_END)
    unstopped = _hf_greedy(varied_model, ids, mask, 12, [], repetition_penalty=repetition_penalty)
    stop = int(unstopped[1, 5])
    expected = _hf_greedy(varied_model, ids, mask, 12, [stop], repetition_penalty=repetition_penalty)
    with torch.no_grad():
        got = decode(varied_model, ids, mask, max_new_tokens=12, stop_token_ids=[stop], pad_token_id=IM_END,
                     repetition_penalty=repetition_penalty)
    assert got.tolist() == expected.tolist()
    first_stop = got[1].tolist().index(stop)  # step 5 or earlier, where the token came up before
    assert first_stop <= 5 and (got[1, first_stop + 1:] == IM_END).all()
    assert len(set(map(tuple, got.tolist()))) > 1  # rows differ: the comparison means something


def test_decode_suppress_tokens_equals_hf_generate(varied_model):
    """`suppress_tokens` (a vision-language rollout's image tokens): greedy `decode` gives `model.generate`'s tokens
    under its key of that name, and never the suppressed ids, which the unsuppressed run does emit."""
    ids, mask = pad_prompts([[5, 17, 30, 44, 9], [7, 8]], IM_END)
    unsuppressed = _hf_greedy(varied_model, ids, mask, 8, [])
    suppress = sorted({int(unsuppressed[0, 0]), int(unsuppressed[1, 2])})
    expected = _hf_greedy(varied_model, ids, mask, 8, [], suppress_tokens=suppress)
    with torch.no_grad():
        got = decode(varied_model, ids, mask, max_new_tokens=8, stop_token_ids=[], pad_token_id=IM_END,
                     suppress_tokens=suppress)
    assert got.tolist() == expected.tolist()
    assert not torch.isin(got, torch.tensor(suppress)).any()


def test_decode_tells_prompts_apart_by_their_images(varied_model, record_forward_shapes):
    """Rows with the same token ids but different images are prefilled apart, each with its own pixels (`image_inputs`
    laid out by row); rows sharing ids and image once. The pixels reach the prefill only."""
    model = copy.deepcopy(varied_model)
    seen = record_forward_shapes(model)
    given = []
    original = model.forward

    def forward(*args, **kwargs):
        given.append(kwargs.pop("pixel_values", None))
        return original(*args, **kwargs)

    model.forward = forward
    ids, mask = pad_prompts([[5, 17, 30]] * 4, IM_END)
    images = torch.tensor([1.0, 1.0, 2.0, 2.0])[:, None, None].expand(4, 1, 3).clone()  # rows 0-1 and 2-3 share one
    with torch.no_grad():
        decode(model, ids, mask, max_new_tokens=2, stop_token_ids=[], pad_token_id=IM_END,
               image_inputs={"pixel_values": images, "image_counts": torch.ones(4, dtype=torch.long)})
    assert seen == [(2, 3), (4, 1)]
    assert given[0].tolist() == [[1.0] * 3, [2.0] * 3] and given[1] is None


def test_decode_prefills_each_distinct_prompt_once(varied_model, record_forward_shapes):
    """A GRPO batch (2 prompts x 3) runs its prompt forward on 2 rows, then decodes all 6 one token at a time."""
    model = copy.deepcopy(varied_model)
    seen = record_forward_shapes(model)
    ids, mask = pad_prompts([[5, 17, 30]] * 3 + [[7, 8]] * 3, IM_END)
    with torch.no_grad():
        out = decode(model, ids, mask, max_new_tokens=4, stop_token_ids=[], pad_token_id=IM_END)
    assert seen == [(2, 3), (6, 1), (6, 1), (6, 1)]
    assert out.tolist()[:3] == [out.tolist()[0]] * 3  # greedy: a group's rows are the same


def test_decode_prefills_a_shared_prefix_once(varied_model, record_forward_shapes, monkeypatch):
    """Distinct prompts that start alike: the 20 shared tokens run once on one row, then each distinct prompt's
    other tokens (left-padded to 4) after them; the prefill's last-token logits equal the usual padded prefill's,
    and the cache layout puts the padding after the prefix. Below `_SHARED_PREFIX_TOKENS` saved positions, or
    with another attention implementation, the usual prefill runs."""
    from transformers import DynamicCache

    from alignkit.model.generation import _prefill_shared_prefix, _shared_prefix_length

    model = copy.deepcopy(varied_model)
    prompts = [SHARED + [5, 17, 30], SHARED + [7, 8], SHARED + [40, 41, 42, 43], SHARED + [7, 8]]
    ids, mask = pad_prompts(prompts, IM_END)
    cache = DynamicCache(config=model.config)
    assert _shared_prefix_length(model, cache, ids, mask) == 20
    assert _shared_prefix_length(model, cache, ids[:2], mask[:2]) == 0  # 20 positions saved: not worth a call
    ids_near = ids.clone()
    ids_near[1, -4] = 12  # row 1's 19th real token differs (row 1 has 2 columns of padding): a prefix of 18
    assert _shared_prefix_length(model, cache, ids_near, mask) == 18
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                         logits_to_keep=1).logits
        logits, layout = _prefill_shared_prefix(model, cache, ids, mask, 20)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    assert layout.tolist() == [[1] * 20 + [0] + [1] * 3, [1] * 20 + [0, 0, 1, 1], [1] * 24, [1] * 20 + [0, 0, 1, 1]]
    assert cache.get_seq_length() == ids.shape[1]
    seen = record_forward_shapes(model)
    with torch.no_grad():
        decode(model, ids, mask, max_new_tokens=3, stop_token_ids=[], pad_token_id=IM_END)
    assert seen == [(1, 20), (3, 4), (4, 1), (4, 1)]
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
    assert _shared_prefix_length(model, DynamicCache(config=model.config), ids, mask) == 0


@pytest.mark.parametrize("knobs", [
    {},
    {"temperature": 0.7},
    {"top_k": 5},
    {"top_p": 0.6},
    {"temperature": 1.5, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.2},
    {"repetition_penalty": 0.8},
    {"min_p": 0.1},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.95, "min_p": 0.05},
])
def test_sampling_processors_equal_hf_generate_processors(tiny_model, knobs):
    """On fixed logits, the scores `decode` samples from equal those `model.generate` builds for the same knobs
    (its own `_get_logits_processor`, so the order and the padding rule of the repetition penalty are checked)."""
    from transformers import GenerationConfig

    torch.manual_seed(3)
    scores = torch.randn(3, 50) * 3
    input_ids = torch.tensor([[IM_END, IM_END, 4, 9, 4], [IM_END, 7, 8, 9, 10], [11, 12, 13, 9, 14]])
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    config = GenerationConfig(do_sample=True, temperature=knobs.get("temperature", 1.0), top_k=knobs.get("top_k", 0),
                              top_p=knobs.get("top_p", 1.0), repetition_penalty=knobs.get("repetition_penalty", 1.0),
                              min_p=knobs.get("min_p"))
    theirs = tiny_model._get_logits_processor(generation_config=config, input_ids_seq_length=input_ids.shape[1],
                                              encoder_input_ids=input_ids, prefix_allowed_tokens_fn=None,
                                              logits_processor=None, device="cpu",
                                              model_kwargs={"attention_mask": prompt_mask})
    ours = sampling_processors(prompt_mask, do_sample=True, **knobs)
    expected, got = theirs(input_ids, scores.clone()), ours(input_ids, scores.clone())
    assert torch.equal(torch.isinf(expected), torch.isinf(got))
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    if knobs.get("repetition_penalty", 1.0) != 1.0:
        # Row 0's padding (id 2) is not penalised; its real token 4 is.
        assert got[0, IM_END] == scores[0, IM_END] / knobs.get("temperature", 1.0) or torch.isinf(got[0, IM_END])


def test_nucleus_filter_hand_computed():
    """probs [0.6, 0.25, 0.1, 0.05]: a token is kept when the probability ranked above it is below top_p. top_p 0.8
    keeps the first two (0, 0.6 above; 0.85 above the third); 0.9 the first three. With 2 candidates, top_p 0.8 is
    decided by them (they hold 0.85) and the warper is not asked; at 0.9 they hold too little, so it is."""
    from transformers import TopPLogitsWarper

    from alignkit.model.generation import NucleusFilter

    scores = torch.tensor([[0.6, 0.25, 0.1, 0.05]]).log()
    asked = []

    class Counting(TopPLogitsWarper):
        def __call__(self, input_ids, scores):
            asked.append(scores.shape[0])
            return super().__call__(input_ids, scores)

    for top_p, kept in ((0.8, [0, 1]), (0.9, [0, 1, 2])):
        for candidates in (256, 2):
            asked.clear()
            out = NucleusFilter(Counting(top_p=top_p), candidates=candidates)(torch.zeros(1, 1, dtype=torch.long),
                                                                                scores.clone())
            assert torch.isfinite(out[0]).nonzero().squeeze(1).tolist() == kept, (top_p, candidates)
            assert torch.equal(out[0, kept], scores[0, kept])
            assert asked == ([1] if (candidates, top_p) == (2, 0.9) else [])


@pytest.mark.parametrize("candidates", [256, 16])
@pytest.mark.parametrize("top_k", [0, 50])
def test_nucleus_filter_equals_the_warper_on_a_large_vocabulary(candidates, top_k):
    """64 rows over a 49,152-token vocabulary, peaked to flat (some rows decided by the candidates, others handed
    to the warper): the kept tokens and their scores equal transformers' `TopPLogitsWarper` exactly, alone and
    after a top-k of 50, as `sampling_processors` orders them."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    from alignkit.model.generation import NucleusFilter

    generator = torch.Generator().manual_seed(7)
    scales = torch.linspace(0.5, 12.0, 64)[:, None]
    scores = torch.randn(64, 49152, generator=generator) * scales
    input_ids = torch.zeros(64, 3, dtype=torch.long)
    if top_k:
        scores = TopKLogitsWarper(top_k=top_k)(input_ids, scores)
    for top_p in (0.3, 0.7, 0.9, 0.99):
        warper = TopPLogitsWarper(top_p=top_p)
        expected = warper(input_ids, scores.clone())
        got = NucleusFilter(warper, candidates=candidates)(input_ids, scores.clone())
        assert torch.equal(got, expected), top_p
        # bf16 scores, summed in fp32: what the warper keeps from the same scores in fp32, as a multiset per row
        # (bf16 ties many scores; which of several equal scores at the cut is kept is the sort's arbitrary choice).
        half = scores.bfloat16()
        got = NucleusFilter(warper, candidates=candidates)(input_ids, half.clone())
        expected = warper(input_ids, half.float())
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.float().sort(-1).values, expected.sort(-1).values), top_p


def test_sample_from_probs_hand_computed_and_frequencies():
    """probs [0.2, 0, 0.8]: cumulative [0.2, 0.2, 1.0]; a draw u picks the first entry above u, so index 1
    (probability 0) is never drawn. Over 20000 seeded draws the frequencies of a 4-way distribution are
    within 0.015 of its probabilities (binomial std at most 0.0035)."""
    probs = torch.tensor([[0.2, 0.0, 0.8]]).repeat(5000, 1)
    draws = sample_from_probs(probs, torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, 2}
    assert abs((draws == 0).float().mean().item() - 0.2) < 0.015
    target = torch.tensor([0.1, 0.4, 0.3, 0.2])
    draws = sample_from_probs(target.repeat(20000, 1), torch.Generator().manual_seed(1))
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert (freq - target).abs().max().item() < 0.015
    again = sample_from_probs(target.repeat(20000, 1), torch.Generator().manual_seed(1))
    assert torch.equal(draws, again)  # seeded: reproducible


def test_decode_sampling_is_seeded_and_follows_the_processors(varied_model):
    """The same generator seed gives the same completions, another seed others; with top_k=1 sampling is
    greedy decoding (only the top token survives), which checks the processors are applied."""
    ids, mask = pad_prompts([[5, 17, 30]] * 4 + [[7, 8]] * 4, IM_END)
    model = varied_model

    def run(seed, **knobs):
        with torch.no_grad():
            return decode(model, ids, mask, max_new_tokens=6, stop_token_ids=[], pad_token_id=IM_END, do_sample=True,
                          generator=torch.Generator().manual_seed(seed), **knobs)

    assert torch.equal(run(0), run(0)) and not torch.equal(run(0), run(1))
    assert len(set(map(tuple, run(0)[:4].tolist()))) > 1  # a group's rows are sampled independently
    with torch.no_grad():
        greedy = decode(model, ids, mask, max_new_tokens=6, stop_token_ids=[], pad_token_id=IM_END)
    assert torch.equal(run(0, top_k=1), greedy)
    assert torch.equal(run(0, min_p=1.0), greedy)  # min-p at 1 keeps only the most likely token
    assert not torch.equal(run(0, min_p=0.0), greedy)


def test_generate_with_decode_matches_generate_and_restores_the_model(lora_model, tiny_tokenizer):
    """Through the rollout entry point (LoRA merged, train mode restored, weights untouched), greedy completions,
    masks and texts equal `generate`'s; an unsupported key is refused by name."""
    before = _snapshot(lora_model)
    ids, mask = pad_prompts([[5, 17, 30, 44, 9], [7, 8], [40, 41, 42]], IM_END)
    kwargs = {"max_new_tokens": 8, "do_sample": False}
    ours = generate_with_decode(lora_model, tiny_tokenizer, ids, mask, stop_token_ids=[IM_END], generation_kwargs=kwargs)
    theirs = generate(lora_model, tiny_tokenizer, ids, mask, stop_token_ids=[IM_END], generation_kwargs=kwargs)
    width = ours.completion_ids.shape[1]
    assert ours.completion_ids.tolist() == theirs.completion_ids[:, :width].tolist()
    assert ours.completion_mask.tolist() == theirs.completion_mask[:, :width].tolist()
    assert ours.texts == theirs.texts and ours.truncated.tolist() == theirs.truncated.tolist()
    assert lora_model.training and all(torch.equal(before[n], t) for n, t in _snapshot(lora_model).items())
    with pytest.raises(ValueError, match="num_beams"):
        generate_with_decode(lora_model, tiny_tokenizer, ids, mask, stop_token_ids=[IM_END],
                             generation_kwargs={"max_new_tokens": 2, "num_beams": 2})
