"""Per-token log-prob gathering: values, gradients, label shift, and that no second [N, L, V] copy is made."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from alignkit.model import logprobs
from alignkit.model.logprobs import (
    forward_sequence_logps,
    forward_token_logps,
    head_log_softmax,
    selective_log_softmax,
    sequence_logps,
    token_logps,
)


def test_selective_log_softmax_hand_computed():
    """logits [0, ln 3] -> softmax [1/4, 3/4]: log p(1) = ln(3/4), log p(0) = ln(1/4).

    A second row [0, 0, 0]: every token has log p = ln(1/3).
    """
    logits = torch.tensor([[0.0, math.log(3.0), -1e4], [0.0, 0.0, 0.0]])
    out = selective_log_softmax(logits, torch.tensor([1, 2]))
    assert out.tolist() == pytest.approx([math.log(0.75), math.log(1 / 3)], abs=1e-6)
    out = selective_log_softmax(logits, torch.tensor([0, 0]))
    assert out.tolist() == pytest.approx([math.log(0.25), math.log(1 / 3)], abs=1e-6)


@pytest.mark.parametrize("chunk_elements", [7, 1 << 24])  # several chunks per call, and one
def test_selective_log_softmax_matches_log_softmax_gather(monkeypatch, chunk_elements):
    monkeypatch.setattr(logprobs, "ELEMENTWISE_CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 11, (3, 5))
    weights = torch.randn(3, 5, dtype=torch.float64)

    ours = selective_log_softmax(logits, index)
    (ours.double() * weights).sum().backward()
    grad_ours = logits.grad.clone()
    logits.grad = None
    reference = logits.log_softmax(-1).gather(-1, index[..., None]).squeeze(-1)
    (reference * weights).sum().backward()

    assert torch.allclose(ours.double(), reference, atol=1e-6)
    assert torch.allclose(grad_ours, logits.grad, atol=1e-6)


def test_bf16_logits_get_fp32_maths():
    """bf16 logits: log-probs and gradients equal the fp32 computation on the same (rounded) values."""
    torch.manual_seed(0)
    logits16 = (torch.randn(2, 3, 50) * 5).bfloat16().requires_grad_(True)
    logits32 = logits16.detach().float().requires_grad_(True)
    index = torch.randint(0, 50, (2, 3))
    out16 = selective_log_softmax(logits16, index)
    out32 = logits32.log_softmax(-1).gather(-1, index[..., None]).squeeze(-1)
    assert out16.dtype == torch.float32
    assert torch.allclose(out16, out32, atol=1e-5)
    out16.sum().backward()
    out32.sum().backward()
    assert logits16.grad.dtype == torch.bfloat16
    assert torch.allclose(logits16.grad.float(), logits32.grad, atol=1e-2)


def test_backward_leaves_fp32_logits_untouched():
    logits = torch.randn(2, 4, 9, requires_grad=True)
    before = logits.detach().clone()
    selective_log_softmax(logits, torch.zeros(2, 4, dtype=torch.long)).sum().backward()
    assert torch.equal(logits.detach(), before)


def test_token_logps_shifts_and_masks():
    """Position t scores label t+1. Uniform logits over V=4 give ln(1/4) per labelled token.

    labels row 0: [-100, -100, 3, 1] -> next-token labels [-100, 3, 1] -> mask [F, T, T]
    labels row 1: [-100, 2, -100, -100] -> [2, -100, -100] -> mask [T, F, F]
    sums: row 0 = 2 ln(1/4), row 1 = ln(1/4); lengths 2 and 1.
    """
    logits = torch.zeros(2, 4, 4)
    labels = torch.tensor([[-100, -100, 3, 1], [-100, 2, -100, -100]])
    logps, mask = token_logps(logits, labels)
    assert mask.tolist() == [[False, True, True], [True, False, False]]
    q = math.log(0.25)
    assert logps.flatten().tolist() == pytest.approx([0.0, q, q, q, 0.0, 0.0])
    sums, lengths = sequence_logps(logits, labels)
    assert sums.tolist() == pytest.approx([2 * q, q])
    assert lengths.tolist() == [2, 1]


def test_token_logps_reads_the_right_vocabulary_entry():
    """Logit 10 on token 2 at position 0, else 0, V=3: log p(2) = 10 - ln(e^10 + 2)."""
    logits = torch.zeros(1, 2, 3)
    logits[0, 0, 2] = 10.0
    logps, _ = token_logps(logits, torch.tensor([[-100, 2]]))
    assert logps[0, 0].item() == pytest.approx(10 - math.log(math.exp(10) + 2), abs=1e-6)


class _AllocationRecorder(TorchDispatchMode):
    """Records the element count of every new tensor an aten op returns (views of an input are not new)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        input_storages = {a.untyped_storage().data_ptr() for a in inputs}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in input_storages:
                self.sizes.append(t.numel())
        return out


def _saved_full_size_tensors(fn, logits: torch.Tensor) -> int:
    """How many tensors of the logits' size autograd saves for backward, other than the logits themselves."""
    count = 0

    def pack(t):
        nonlocal count
        if t.numel() >= logits.numel() and t.data_ptr() != logits.data_ptr():
            count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits)
    return count


@pytest.mark.parametrize("chunk_elements", [4000, 1 << 24])  # 4 rows per chunk, and all rows in one
def test_no_second_full_vocabulary_copy_is_saved_or_allocated(monkeypatch, chunk_elements):
    """The naive log_softmax+gather saves (and allocates) a second [N, L, V] tensor; ours does neither.

    Forward: count tensors of the full size kept for backward. Backward: count full-size tensors the
    ops create; one (the gradient of the logits) is unavoidable, the naive way makes several.
    """
    monkeypatch.setattr(logprobs, "ELEMENTWISE_CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(0)
    logits = torch.randn(4, 16, 1000, requires_grad=True)
    labels = torch.randint(0, 1000, (4, 16))
    full = logits.numel()

    def naive(x):
        nxt = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=0)
        return x.log_softmax(-1).gather(-1, nxt[..., None]).sum()

    def ours(x):
        return token_logps(x, labels)[0].sum()

    assert _saved_full_size_tensors(naive, logits) >= 1  # the probe sees the copy when there is one
    assert _saved_full_size_tensors(ours, logits) == 0

    def full_size_allocations(fn) -> int:
        logits.grad = None
        loss = fn(logits)
        with _AllocationRecorder() as rec:
            loss.backward()
        return sum(size >= full for size in rec.sizes)

    assert full_size_allocations(naive) >= 2
    assert full_size_allocations(ours) == 1


def test_forward_token_logps_skips_prompt_logits_but_matches_full_forward(tiny_model_dir):
    """Keeping logits only from the first labelled position gives the same log-probs as the full forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    torch.manual_seed(0)
    input_ids = torch.randint(3, 500, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    labels = input_ids.clone()
    labels[0, :4] = -100
    labels[1, :5] = -100
    labels[1, 7:] = -100
    with torch.no_grad():
        logps, mask = forward_token_logps(model, input_ids, attention_mask, labels)
        full_logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    expected, expected_mask = token_logps(full_logits, labels)
    assert logps.shape == (2, 8)
    assert torch.equal(mask, expected_mask)
    assert torch.allclose(logps, expected, atol=1e-5)


@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("chunk_elements", [1 << 24, 7 * 10])  # one chunk; chunks of 7 rows of a 10-word vocabulary
def test_head_log_softmax_equals_linear_then_selective_log_softmax(monkeypatch, chunk_elements, trainable):
    """The fused output layer gives the log-probs and gradients (hidden; weight and bias when trainable) of
    `selective_log_softmax(F.linear(hidden, weight, bias), index)`, over 23 rows (several chunks, a short last one)."""
    import alignkit.model.logprobs as logprobs

    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 6, generator=generator, requires_grad=True)
    weight = torch.randn(10, 6, generator=generator, requires_grad=trainable)
    bias = torch.randn(10, generator=generator, requires_grad=trainable)
    index = torch.randint(0, 10, (23,), generator=generator)
    upstream = torch.randn(23, generator=generator)
    ours = logprobs.head_log_softmax(hidden, weight, bias, index)
    grads = torch.autograd.grad((ours * upstream).sum(), [t for t in (hidden, weight, bias) if t.requires_grad])
    expected = torch.nn.functional.linear(hidden, weight, bias).log_softmax(-1).gather(-1, index[:, None])[:, 0]
    reference = torch.autograd.grad((expected * upstream).sum(), [t for t in (hidden, weight, bias) if t.requires_grad])
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"\[K, H\]"):
        logprobs.head_log_softmax(hidden[None], weight, bias, index)


@pytest.mark.parametrize("trainable", [False, True])
def test_head_log_softmax_under_bf16_autocast_is_the_bf16_product_once_cast(monkeypatch, trainable):
    """Under bf16 autocast the chunks multiply bf16 copies cast once (a frozen weight's copy kept until it changes),
    and the log-softmax over each chunk is fp32 in blocks of rows: the log-probs and gradients are those of
    `selective_log_softmax` over the autocast product `F.linear(hidden, weight)` in bf16, in several chunks and
    blocks (a short last one of each)."""
    import alignkit.model.logprobs as logprobs

    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 9 * 50)  # chunks of 9 rows
    monkeypatch.setattr(logprobs, "ELEMENTWISE_CHUNK_ELEMENTS", 4 * 50)  # blocks of 4 rows
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=trainable)
    index = torch.randint(0, 50, (23,), generator=generator)
    upstream = torch.randn(23, generator=generator)
    params = [t for t in (hidden, weight) if t.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = logprobs.head_log_softmax(hidden, weight, None, index)
        logits = torch.nn.functional.linear(hidden, weight)
    assert logits.dtype == torch.bfloat16 and ours.dtype == torch.float32
    grads = torch.autograd.grad((ours * upstream).sum(), params)
    expected = logits.float().log_softmax(-1).gather(-1, index[:, None])[:, 0]
    reference = torch.autograd.grad((expected * upstream).sum(), params)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, reference):  # bf16 products of the softmax: bf16's precision
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    if not trainable:
        assert torch.equal(weight._alignkit_cast[1], weight.to(torch.bfloat16))


def test_head_log_softmax_hand_computed():
    """H = 1, weight [[1], [0]], no bias, hidden [[ln 3]]: logits (ln 3, 0), softmax (3/4, 1/4).
    log p(0) = ln 3 - ln 4 = ln 0.75; d/dh = W[0] - (3/4 * 1 + 1/4 * 0) = 1/4."""
    hidden = torch.tensor([[math.log(3.0)]], requires_grad=True)
    out = head_log_softmax(hidden, torch.tensor([[1.0], [0.0]]), None, torch.tensor([0]))
    out.sum().backward()
    assert out.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert hidden.grad.item() == pytest.approx(0.25, abs=1e-6)


def test_labelled_log_probs_use_the_fused_head_without_vocabulary_logits(tiny_model_dir, monkeypatch):
    """On a llama model neither layout of the shared per-token forward calls the output layer's own forward (no
    [K, V] logits), and both give the log-probs and hidden-state gradients of the plain full-logits forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    calls = []
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: calls.append(self.out_features)
                        or torch.nn.functional.linear(x, self.weight, self.bias))
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 300, (3, 9), generator=generator)
    attention_mask = torch.tensor([[1] * 9, [1] * 7 + [0, 0], [1] * 4 + [0] * 5])
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :3] = -100
    vocab = model.config.vocab_size

    def gradient():
        return model.model.layers[0].mlp.down_proj.weight.grad.clone()

    model.zero_grad()
    calls.clear()
    want, _ = sequence_logps(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
    want.sum().backward()
    want_grad = gradient()
    assert vocab in calls  # the plain forward does form the logits
    for padding_free in (False, True):
        model.zero_grad()
        calls.clear()
        sums, _ = forward_sequence_logps(model, input_ids, attention_mask, labels, padding_free=padding_free)
        sums.sum().backward()
        assert vocab not in calls, padding_free
        torch.testing.assert_close(sums, want, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(gradient(), want_grad, atol=1e-5, rtol=1e-4)


def test_labelled_log_probs_run_the_head_under_the_autocast_the_model_ran_under(tiny_model_dir):
    """A mixed-precision wrapper autocasts `model.forward` alone (accelerate's does), so the fused log-probs,
    computed after the call, re-enter that autocast: the output layer's product is bf16 as it would be inside the
    model (the unfused path's bf16 logits), not fp32. Without the wrapper nothing is autocast."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 300, (3, 9), generator=generator)
    attention_mask = torch.tensor([[1] * 9, [1] * 7 + [0, 0], [1] * 4 + [0] * 5])
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :3] = -100

    def both():
        fused = logprobs.labelled_forward(model, input_ids, attention_mask, labels)
        unfused = logprobs.labelled_forward(model, input_ids, attention_mask, labels, logits=True)
        return fused.values, selective_log_softmax(unfused.values.float(), unfused.targets), unfused.values.dtype

    with torch.no_grad():
        fp32, fp32_unfused, dtype = both()
        assert dtype == torch.float32
        torch.testing.assert_close(fp32, fp32_unfused, atol=1e-5, rtol=1e-5)
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
        bf16, bf16_unfused, dtype = both()
    assert dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu")
    torch.testing.assert_close(bf16, bf16_unfused, atol=1e-5, rtol=1e-5)
    assert (bf16 - fp32).abs().max() > 1e-3  # the bf16 product is told apart from the fp32 one
