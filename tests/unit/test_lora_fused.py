"""The fused LoRA linear layer computes what PEFT's computes: values and every gradient, and falls back when not plain."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from alignkit.model.lora_fused import fuse_lora_linears, lora_linear


def test_lora_linear_hand_computed():
    """x = [[1, 2]], W = I, b = [1, 0], A = [[1, 1]], B = [[1], [2]], scaling 0.5:
    x W^T + b = [2, 2]; down = x A^T = 3; + 0.5 * 3 * [1, 2] = [3.5, 5].
    Upstream gradient [1, 1]: g_down = g B = 3; dx = g W + 0.5 * 3 * A = [2.5, 2.5];
    dA = 0.5 * 3 * x = [[1.5, 3]]; dB = 0.5 * g^T down = [[1.5], [1.5]]."""
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    a = torch.tensor([[1.0, 1.0]], requires_grad=True)
    b = torch.tensor([[1.0], [2.0]], requires_grad=True)
    out = lora_linear(x, torch.eye(2), torch.tensor([1.0, 0.0]), a, b, 0.5)
    assert out.tolist() == [[3.5, 5.0]]
    out.sum().backward()
    assert x.grad.tolist() == [[2.5, 2.5]] and a.grad.tolist() == [[1.5, 3.0]] and b.grad.tolist() == [[1.5], [1.5]]


def test_lora_linear_matches_unfused_with_trainable_base():
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=generator, requires_grad=True)
               for shape in [(2, 5, 6), (7, 6), (7,), (3, 6), (7, 3)]]
    x, w, bias, a, b = tensors
    upstream = torch.randn(2, 5, 7, generator=generator)
    ours = torch.autograd.grad((lora_linear(x, w, bias, a, b, 2.0) * upstream).sum(), tensors)
    reference = torch.nn.functional.linear(x, w, bias) + (x @ a.T @ b.T) * 2.0
    expected = torch.autograd.grad((reference * upstream).sum(), tensors)
    torch.testing.assert_close(lora_linear(x, w, bias, a, b, 2.0), reference)
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want)


def _peft(tiny_model_dir, dropout=0.0):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                  target_modules="all-linear", init_lora_weights=False))
    return peft_model


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fused_peft_model_equals_peft(tiny_model_dir, monkeypatch):
    """Every LoRA linear of the tiny model is fused; loss and every LoRA gradient equal PEFT's own forward;
    a deep copy computes with its own weights; disabled adapters (the reference model) take PEFT's path."""
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    plain = _peft(tiny_model_dir)
    fused = copy.deepcopy(plain)
    assert fuse_lora_linears(fused) == 14  # 7 linear layers x 2 decoder layers
    assert fuse_lora_linears(fused) == 0  # installed once
    loss_p, grads_p = _loss_and_grads(plain, ids)
    calls = []
    original = lora_linear.__globals__["_LoraLinear"].apply
    monkeypatch.setattr(lora_linear.__globals__["_LoraLinear"], "apply",
                        lambda *a: calls.append(1) or original(*a))
    loss_f, grads_f = _loss_and_grads(fused, ids)
    assert len(calls) == 14
    torch.testing.assert_close(loss_f, loss_p, atol=1e-6, rtol=1e-6)
    assert grads_f.keys() == grads_p.keys() and any("lora_A" in n for n in grads_f)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_f[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    copied = copy.deepcopy(fused)
    with torch.no_grad():
        for name, param in copied.named_parameters():
            if "lora_B" in name:
                param.zero_()
    with torch.no_grad():
        base_logits = copied.get_base_model()(input_ids=ids).logits  # lora_B = 0: the copy is the base model
        copied_logits = copied(input_ids=ids).logits
        fused_logits = fused(input_ids=ids).logits
    torch.testing.assert_close(copied_logits, base_logits)
    assert not torch.allclose(fused_logits, copied_logits)
    calls.clear()
    with fused.disable_adapter(), torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, base_logits)
    assert calls == []


def test_lora_linear_with_dropped_input_matches_unfused():
    """The adapter reads `dropped` (dropout's output) while the base reads `x`: values and the gradients of x,
    dropped, W, b, A and B equal the unfused formula's, with a trainable base and with a frozen one."""
    generator = torch.Generator().manual_seed(0)
    for base_trainable in (True, False):
        shapes = [(2, 5, 6), (7, 6), (7,), (3, 6), (7, 3)]
        x, w, bias, a, b = (torch.randn(shape, generator=generator) for shape in shapes)
        dropped = x * (torch.rand(x.shape, generator=generator) > 0.5) * 2  # a dropout mask of p = 0.5
        tensors = [t.requires_grad_(base_trainable or (t is not w and t is not bias))
                   for t in (x, w, bias, a, b, dropped)]
        upstream = torch.randn(2, 5, 7, generator=generator)
        wanted = [t for t in tensors if t.requires_grad]
        out = lora_linear(x, w, bias, a, b, 2.0, dropped)
        reference = torch.nn.functional.linear(x, w, bias) + (dropped @ a.T @ b.T) * 2.0
        torch.testing.assert_close(out, reference)
        for got, want in zip(torch.autograd.grad((out * upstream).sum(), wanted),
                             torch.autograd.grad((reference * upstream).sum(), wanted)):
            torch.testing.assert_close(got, want)


def test_dropout_in_training_is_fused_and_equals_peft(tiny_model_dir, monkeypatch):
    """LoRA dropout (p = 0.5) while training: every layer takes the fused node, and from the same random state the
    loss and every LoRA gradient equal PEFT's own forward (the same masks, drawn in the same order); in eval the
    dropout is off and the node gets no dropped copy."""
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    plain = _peft(tiny_model_dir, dropout=0.5)
    fused = copy.deepcopy(plain)
    fuse_lora_linears(fused)
    calls = []
    original = lora_linear.__globals__["_LoraLinear"].apply
    monkeypatch.setattr(lora_linear.__globals__["_LoraLinear"], "apply",
                        lambda *a: calls.append(a[-1] is not None) or original(*a))
    results = []
    for model in (plain, fused):
        model.train()
        torch.manual_seed(7)
        results.append(_loss_and_grads(model, ids))
    assert calls == [True] * 14
    (loss_p, grads_p), (loss_f, grads_f) = results
    torch.testing.assert_close(loss_f, loss_p, atol=1e-6, rtol=1e-6)
    assert grads_f.keys() == grads_p.keys() and any("lora_A" in n for n in grads_f)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_f[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    torch.manual_seed(8)  # another draw: another loss (the dropout is really on)
    assert not torch.allclose(_loss_and_grads(fused, ids)[0], loss_f)
    calls.clear()
    fused.eval()
    with torch.no_grad():
        fused(input_ids=ids)
    assert calls == [False] * 14


def test_autocast_runs_the_fused_node_in_bf16(tiny_model_dir, monkeypatch):
    """Under bf16 autocast (the `bf16` training path) the fused node runs in bf16 on inputs cast once, as autocast
    casts them: the loss and the adapter's gradients (fp32, the parameters' dtype) agree with PEFT's own forward
    under autocast to bf16's precision, the frozen base weights are cast once and the copy reused until a weight
    changes in place."""
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    plain = _peft(tiny_model_dir)
    fused = copy.deepcopy(plain)
    fuse_lora_linears(fused)
    calls = []
    original = lora_linear.__globals__["_LoraLinear"].apply
    monkeypatch.setattr(lora_linear.__globals__["_LoraLinear"], "apply", lambda *a: calls.append(a[1].dtype) or original(*a))
    results = []
    for model in (plain, fused):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert calls == [torch.bfloat16] * 14
    (loss_p, grads_p), (loss_f, grads_f) = results
    torch.testing.assert_close(loss_f, loss_p, atol=2e-2, rtol=2e-2)
    assert grads_f.keys() == grads_p.keys() and all(g.dtype == torch.float32 for g in grads_f.values())
    for name, grad in grads_p.items():
        cosine = torch.nn.functional.cosine_similarity(grads_f[name].flatten(), grad.flatten(), dim=0)
        assert cosine > 0.99, name
    layer = fused.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    copy_before = layer.weight._alignkit_cast[1]
    assert copy_before.dtype == torch.bfloat16 and torch.equal(copy_before, layer.weight.to(torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused(input_ids=ids)
    assert layer.weight._alignkit_cast[1] is copy_before  # reused
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place change (a merge) makes a new copy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused(input_ids=ids)
    assert torch.equal(layer.weight._alignkit_cast[1], layer.weight.to(torch.bfloat16))


def test_the_fused_forward_comes_back_after_a_generation_round(tiny_model_dir, monkeypatch):
    """Decoding shadows every linear layer's forward with a packed one (`packed_linears`); after it, the LoRA layers
    train through the fused path again. (It was deleted: after a GRPO/PPO round training took PEFT's forward.)"""
    from alignkit.model.generation import packed_linears
    from alignkit.model.lora_fused import shadowed_forward

    fused = _peft(tiny_model_dir)
    fuse_lora_linears(fused)
    lora_layers = [m for m in fused.modules() if "forward" in vars(m)]
    before = [vars(m)["forward"] for m in lora_layers]
    with torch.no_grad(), packed_linears(fused.eval(), batch_size=2) as packed:
        assert packed and all(vars(m)["forward"] is not f for m, f in zip(lora_layers, before))
    assert [vars(m)["forward"] for m in lora_layers] == before
    calls = []
    original = lora_linear.__globals__["_LoraLinear"].apply
    monkeypatch.setattr(lora_linear.__globals__["_LoraLinear"], "apply", lambda *a: calls.append(1) or original(*a))
    _loss_and_grads(fused.train(), torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1)))
    assert len(calls) == 14
    plain = torch.nn.Linear(2, 2)  # a layer without an instance forward gets its class's back
    with shadowed_forward(plain, lambda x: x):
        assert "forward" in vars(plain)
    assert "forward" not in vars(plain)


def _dora(tiny_model_dir, dropout=0.0):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, use_dora=True,
                                             target_modules="all-linear", init_lora_weights=False))
    with torch.no_grad():  # a magnitude away from the initial norms, so the factor is not 1
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(torch.linspace(0.5, 1.5, param.numel()))
    return model


def test_dora_is_fused_and_equals_peft_in_fp32_and_under_bf16_autocast(tiny_model_dir, monkeypatch):
    """DoRA without dropout in effect takes the fused node and a per-row factor: the loss and the gradients of A, B and
    the magnitude equal PEFT's DoRA forward in fp32 (1e-6). Under a bf16 autocast (products in bf16, the sum in
    fp32) every gradient stays within cosine 0.995 of the fp32 one (PEFT's own bf16 path: 0.9948 at worst on this
    model, which a bf16 sum would have pushed to 0.9896 here)."""
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    plain = _dora(tiny_model_dir)
    fused = copy.deepcopy(plain)
    assert fuse_lora_linears(fused) == 14
    calls = []
    original = lora_linear.__globals__["_LoraLinear"].apply
    monkeypatch.setattr(lora_linear.__globals__["_LoraLinear"], "apply", lambda *a: calls.append(1) or original(*a))
    (loss_p, grads_p), (loss_f, grads_f) = _loss_and_grads(plain, ids), _loss_and_grads(fused, ids)
    assert len(calls) == 14
    torch.testing.assert_close(loss_f, loss_p, atol=1e-6, rtol=1e-6)
    assert grads_f.keys() == grads_p.keys() and any("lora_magnitude_vector" in n for n in grads_f)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_f[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    fused.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss.detach(), loss_p, atol=1e-2, rtol=1e-2)
    for name, grad in grads_p.items():  # PEFT's fp32 gradients
        low = dict(fused.named_parameters())[name].grad
        assert low.dtype == torch.float32
        assert torch.nn.functional.cosine_similarity(low.flatten(), grad.flatten(), dim=0) > 0.995, name


def test_dora_with_dropout_in_training_takes_peft_path(tiny_model_dir, monkeypatch):
    """PEFT's DoRA recomputes the base product on the dropped input while its dropout is in effect: that case keeps
    PEFT's forward; in eval (dropout off) the layers are fused again."""
    model = _dora(tiny_model_dir, dropout=0.5)
    fuse_lora_linears(model)
    calls = []
    original = lora_linear.__globals__["_LoraLinear"].apply
    monkeypatch.setattr(lora_linear.__globals__["_LoraLinear"], "apply", lambda *a: calls.append(1) or original(*a))
    ids = torch.randint(3, 300, (1, 6))
    model.train()
    model(input_ids=ids)
    assert calls == []
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert len(calls) == 14


def test_disabled_adapters_under_autocast_keep_the_weight_cast(tiny_model_dir, monkeypatch):
    """Adapters disabled (the reference model) under a bf16 autocast: every layer runs its base product on the kept
    bf16 copy (`frozen_cast`, made once per weight) and the logits equal PEFT's own path's exactly."""
    import alignkit.model.lora_fused as lora_fused

    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    fused = _peft(tiny_model_dir)
    fuse_lora_linears(fused)
    fused.eval()
    calls = []
    original = lora_fused._frozen_base_forward
    monkeypatch.setattr(lora_fused, "_frozen_base_forward", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), fused.disable_adapter():
        ours = fused(input_ids=ids).logits
        assert len(calls) == 14
        casts = [layer.get_base_layer().weight._alignkit_cast[1] for layer in fused.modules()
                 if hasattr(layer, "lora_A")]
        again = fused(input_ids=ids).logits
        assert all(layer.get_base_layer().weight._alignkit_cast[1] is cast for layer, cast in
                   zip([m for m in fused.modules() if hasattr(m, "lora_A")], casts))  # cast once, kept
        monkeypatch.setattr(lora_fused, "_plain_disabled", lambda *a: False)  # PEFT's `base_layer(x)`
        peft_logits = fused(input_ids=ids).logits
    assert torch.equal(ours, peft_logits) and torch.equal(again, peft_logits)
    calls.clear()
    with torch.no_grad(), fused.disable_adapter():  # no autocast: PEFT's path
        fused(input_ids=ids)
    assert calls == []
