"""LoRA linear layers in one autograd node: the adapter's update added inside the base matmul's output buffer.

PEFT's `lora.Linear` computes `base(x) + lora_B(lora_A(dropout(x))) * scaling` as separate operations, so every
adapted layer makes three more `[tokens, out_features]` tensors in the forward (the adapter's output, its scaled
copy, the sum) and as many element-wise passes in the backward. With LoRA on every linear layer of a 30-layer
model that is about 400 such passes per step over tensors as large as the layer's output, memory-bound work that
model-FLOPs utilisation does not count. `_LoraLinear` does the same arithmetic with `addmm`'s scale-and-add:

    forward:  out = x W^T + b;  down = x A^T;  out += scaling * down B^T          (in place, no temporaries)
    backward: g_down = g B;  dx = g W + scaling * g_down A;  dA = scaling * g_down^T x;  dB = scaling * g^T down

(plus dW = g^T x and db = sum(g) for a trainable base layer). It saves `x` and `down` for backward, as the
unfused layers do. With LoRA dropout (`lora_dropout` > 0, while training) the adapter reads `d = dropout(x)` in
place of `x`: `down = d A^T`, and the node returns d's gradient `scaling * g_down A` apart from x's (`g W`), for the
dropout's own backward to mask; it then saves `d` instead of `x` (and `x` too only for a trainable base).

`fuse_lora_linears` installs it on every plain LoRA linear layer of a PEFT model. The fused path runs only in the
plain case: adapters enabled and not merged, one active adapter with no variant but DoRA (below), its dropout
`nn.Dropout` or none, an `nn.Linear` base layer with matching dtypes, no LoRA bias, no per-call adapter names, no
DeepSpeed ZeRO-3 partitions (whose weights only the modules' own calls gather); anything else calls PEFT's own forward,
unchanged.

Under autocast (a `bf16` run) the node runs in the autocast dtype on inputs cast once before it, as autocast
would cast them (the casts are autograd nodes, so the fp32 adapter gets fp32 gradients). The frozen base weight's
bf16 copy is made once and kept until the weight changes (`frozen_cast`), where autocast casts it at every call:
PEFT's path under autocast also casts the input twice per layer (base and adapter) and adds in three more
element-wise passes. Bundled model, LoRA on every linear layer, forward and backward of 8 x 90 tokens in bf16
autocast: see docs/performance.md ("bf16 steps"). A layer whose adapters are disabled (the reference model of every
stage under LoRA) runs its base product on the same kept copy (`_frozen_base_forward`).

The LoRA variants: rsLoRA (`use_rslora`) changes only `scaling` and PiSSA (`pissa_init`) only the starting weights,
so both are plain here and fused. DoRA (`use_dora`, a peft variant in `lora_variant`) is fused too while its dropout
is not in effect: PEFT's output `base(x) + (s - 1) * W x + s * scaling * B A x`, with s = magnitude / ||W + scaling *
B A|| per output row (the norm without gradient), is `s * (x W^T + scaling * x A^T B^T) + bias`, the node's product
times one factor (`dora_scale`); under an autocast the products run in its dtype and the adapter's up-projection
and the sum in fp32, as PEFT sums them (a bf16 sum rounds the adapter's small part against the base's). With LoRA
dropout in effect PEFT recomputes the base product on the dropped input, and that case runs PEFT's forward. LoRA+
(`loraplus_lr_ratio`) is an optimizer setting. tests/unit/test_lora_variants.py checks each against peft.

A quantized base (`quantization_bit`, QLoRA) is never fused: its LoRA layers are PEFT's bitsandbytes classes
(`lora.bnb.Linear4bit`, `Linear8bitLt`), which `fuse_lora_linears` leaves alone, because the fused node would need
the base weight whole and dequantizing it per call into a full-precision copy is the memory QLoRA exists to save.
PEFT's forward runs the base layer's own quantized matmul and adds the adapter (`quantized_base_layer`).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .distributed import is_zero3_partitioned


class _LoraLinear(torch.autograd.Function):
    """`F.linear(x, weight, bias) + scaling * (d @ lora_a.T) @ lora_b.T` as one node, `d` being `dropped` (the
    adapter's input after LoRA dropout) or `x` itself (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, dropped):
        rows = x.reshape(-1, x.size(-1))
        adapter_rows = rows if dropped is None else dropped.reshape(-1, dropped.size(-1))
        out = F.linear(rows, weight, bias)
        down = adapter_rows @ lora_a.T
        out.addmm_(down, lora_b.T, alpha=scaling)
        # With dropout the adapter's gradient reads the dropped copy, and `x` is needed only for a trainable base
        # weight's gradient: a frozen base keeps one `[tokens, in]` tensor saved per layer, as without dropout.
        saved_rows = rows if dropped is None or weight.requires_grad else None
        ctx.save_for_backward(saved_rows, None if dropped is None else adapter_rows, weight, lora_a, lora_b, down)
        ctx.scaling, ctx.input_shape, ctx.has_bias = scaling, x.shape, bias is not None
        ctx.dropped_shape = None if dropped is None else dropped.shape
        return out.view(*x.shape[:-1], out.size(-1))

    @staticmethod
    def backward(ctx, grad_out):
        rows, adapter_rows, weight, lora_a, lora_b, down = ctx.saved_tensors
        if adapter_rows is None:
            adapter_rows = rows
        scaling = ctx.scaling
        g = grad_out.reshape(-1, grad_out.size(-1))
        # The rank-r products are formed with the wide side as the output: `[r, out] @ [out, tokens]` rather than
        # `[tokens, out] @ [out, r]` (and `[r, tokens] @ [tokens, out]` for dB below). MKL runs an output only r
        # columns wide 2-4x slower (the bundled model's 1086-token RM batch: dB of an MLP layer 1.84 ms against
        # 0.44; docs/performance.md). `g_down` is then a transposed view, which `addmm_` and `.T @` take as is.
        g_down = (lora_b.T @ g.T).T  # [tokens, r]
        grad_x = grad_weight = grad_bias = grad_a = grad_b = grad_dropped = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ weight
            if ctx.dropped_shape is None:
                grad_x.addmm_(g_down, lora_a, alpha=scaling)
            grad_x = grad_x.view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = g.T @ rows
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g.sum(0)
        if ctx.needs_input_grad[3]:
            grad_a = torch.mm(g_down.T, adapter_rows).mul_(scaling)
        if ctx.needs_input_grad[4]:
            grad_b = torch.mm(down.T, g).mul_(scaling).T.contiguous()
        if ctx.dropped_shape is not None and ctx.needs_input_grad[6]:
            grad_dropped = torch.mm(g_down, lora_a).mul_(scaling).view(ctx.dropped_shape)
        return grad_x, grad_weight, grad_bias, grad_a, grad_b, None, grad_dropped


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scaling: float, dropped: torch.Tensor | None = None) -> torch.Tensor:
    """A LoRA-adapted linear layer in one autograd node.

    Args:
        x: `[..., in]` input.
        weight: `[out, in]` base weight; bias: `[out]` or None.
        lora_a: `[r, in]`; lora_b: `[out, r]`; scaling: `lora_alpha / r` (or PEFT's rsLoRA scaling).
        dropped: the adapter's input when LoRA dropout is in effect (`dropout(x)`, shaped as `x`); None: `x`.

    Returns:
        `[..., out]`: `x @ weight.T + bias + scaling * (dropped @ lora_a.T) @ lora_b.T`.
    """
    return _LoraLinear.apply(x, weight, bias, lora_a, lora_b, scaling, dropped)


def frozen_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in `dtype` (an autocast's), for a product the caller runs with autocast off.

    Autocast casts a weight that requires no gradient (LoRA's frozen base, a tied output layer) again at every call,
    a full pass over it each time, and the bundled model's 30 layers cast 106 M weights a forward that way. Here
    a frozen weight is cast once and the copy kept on the tensor until its storage or version changes (an
    in-place merge, a load); a trainable weight is cast per call, as autocast does (the cast is then an autograd
    node, so its gradient comes back in the weight's dtype). The copy rounds as autocast's cast does.
    """
    if weight.dtype == dtype:
        return weight
    if weight.requires_grad:
        return weight.to(dtype)
    key = (weight.data_ptr(), weight._version, dtype)
    cached = getattr(weight, "_alignkit_cast", None)
    if cached is None or cached[0] != key:
        cached = (key, weight.detach().to(dtype))
        weight._alignkit_cast = cached
    return cached[1]


def quantized_base_layer(layer: nn.Module) -> bool:
    """True when the LoRA layer's base layer holds quantized weights (bitsandbytes' `Linear4bit` / `Linear8bitLt`:
    integer storage), which neither the fused path nor an in-place merge may treat as a float weight."""
    base = layer.get_base_layer()
    return type(base).__module__.startswith("bitsandbytes") or any(
        not param.is_floating_point() for param in base.parameters(recurse=False))


def _plain_adapter(layer: nn.Module, x: torch.Tensor) -> str | None:
    """The one active adapter of `layer` when the fused path computes exactly what PEFT would, else None."""
    if layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1:
        return None
    name = active[0]
    if name not in layer.lora_A:
        return None
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, (nn.Identity, nn.Dropout)):
        return None
    dora = name in getattr(layer, "lora_variant", {})
    if dora and not _fusable_dora(layer, name, dropout):
        return None
    base, lora_a, lora_b = layer.get_base_layer(), layer.lora_A[name], layer.lora_B[name]
    if type(base) is not nn.Linear or lora_b.bias is not None or lora_a.bias is not None:
        return None
    weights = [base.weight, lora_a.weight, lora_b.weight]
    if dora:
        weights.append(layer.lora_magnitude_vector[name].weight)
    if any(is_zero3_partitioned(p) for p in weights):
        # DeepSpeed ZeRO-3: a weight is whole only inside its own module's forward and backward (the engine's
        # hooks gather it there), so reading `base.weight` here would read this process's empty partition.
        return None
    if torch.is_autocast_enabled(x.device.type):  # `_fused_forward` casts every input to the autocast dtype
        if not (x.is_floating_point() and base.weight.dtype == lora_a.weight.dtype == lora_b.weight.dtype
                and base.weight.is_floating_point()):
            return None
    elif not (x.dtype == base.weight.dtype == lora_a.weight.dtype == lora_b.weight.dtype):
        return None
    return name


def _plain_disabled(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether `layer` runs its base layer alone (adapters disabled, as for the reference model) under an autocast,
    with an unmerged `nn.Linear` base of float weights that are whole here (not ZeRO-3 partitions)."""
    if not layer.disable_adapters or layer.merged or not torch.is_autocast_enabled(x.device.type):
        return False
    base = layer.get_base_layer()
    return (type(base) is nn.Linear and x.is_floating_point() and base.weight.is_floating_point()
            and not is_zero3_partitioned(base.weight))


def _frozen_base_forward(base: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`base(x)` as the autocast computes it, its frozen weight's cast kept (`frozen_cast`) instead of made per call.

    PEFT runs a disabled adapter's layer as `base_layer(x)`, and the autocast then casts the fp32 weight to bf16 at
    every call: a reference forward of the bundled model casts all its 106 M frozen weights again. The copy is the
    one the fused path keeps for the same weight, so it costs no memory of its own, and it rounds as the autocast's
    cast does: the output is the same tensor.
    """
    dtype = torch.get_autocast_dtype(x.device.type)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.to(dtype), frozen_cast(base.weight, dtype),
                        None if base.bias is None else base.bias.to(dtype))


def _fusable_dora(layer: nn.Module, name: str, dropout: nn.Module) -> bool:
    """Whether adapter `name`'s variant is DoRA on a linear layer in the case the fused path computes: its dropout
    not in effect (PEFT then runs the magnitude's rescaling on the base output it already has; with dropout it
    recomputes the base product on the dropped input, which this path does not)."""
    from peft.tuners.lora.variants import DoraLinearVariant

    return (isinstance(layer.lora_variant[name], DoraLinearVariant) and not layer.fan_in_fan_out
            and (isinstance(dropout, nn.Identity) or not layer.training))


class _RowScale(torch.autograd.Function):
    """`y * scale` (`scale` `[out]`, per output row) that saves `y` for the factor's gradient in `saved_dtype`: DoRA's
    sum comes out in fp32 under a bf16 autocast, and keeping it in fp32 for the magnitude's gradient alone held one
    more fp32 `[tokens, out]` tensor per adapted layer (PEFT keeps its two bf16 products for that gradient)."""

    @staticmethod
    def forward(ctx, y, scale, saved_dtype):
        ctx.save_for_backward(y.to(saved_dtype) if ctx.needs_input_grad[1] else None, scale)
        return y * scale

    @staticmethod
    def backward(ctx, grad):
        y, scale = ctx.saved_tensors
        grad_y = grad * scale if ctx.needs_input_grad[0] else None
        grad_scale = None
        if ctx.needs_input_grad[1]:
            grad_scale = (grad.reshape(-1, grad.size(-1)) * y.reshape(-1, y.size(-1))).sum(0, dtype=scale.dtype)
        return grad_y, grad_scale, None


def dora_scale(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
               magnitude: torch.Tensor) -> torch.Tensor:
    """DoRA's per-output factor `magnitude / ||weight + scaling * lora_b @ lora_a||` (row norms), `[out]`.

    The norm carries no gradient, as in PEFT and the DoRA paper (section 4.3: treated as a constant); `magnitude`
    gets its gradient through the quotient. Computed in the base weight's dtype (PEFT's, outside an autocast).
    """
    with torch.no_grad():
        norm = torch.linalg.norm(weight.addmm(lora_b.to(weight.dtype), lora_a.to(weight.dtype), alpha=scaling),
                                 dim=1)
    return magnitude / norm


def _fused_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Installed as a bound method of each PEFT `lora.Linear` (so `copy.deepcopy` rebinds it to the copy)."""
    if not args and not kwargs and _plain_disabled(self, x):
        return _frozen_base_forward(self.get_base_layer(), x)
    name = None if args or kwargs else _plain_adapter(self, x)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)  # PEFT's own forward
    if name in getattr(self, "lora_variant", {}):
        return _dora_forward(self, name, x)
    base = self.get_base_layer()
    weight, bias, lora_a, lora_b = base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight
    dropout = self.lora_dropout[name]
    # LoRA dropout in effect: on `x` as PEFT applies it (before any cast; the same draws in the same order).
    dropped = dropout(x) if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0 else None
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return lora_linear(x, weight, bias, lora_a, lora_b, self.scaling[name], dropped)
    # What autocast would do, once: every input cast to its dtype (the casts are autograd nodes, so the fp32 adapter
    # weights get fp32 gradients), then the node runs in that dtype with autocast off inside it.
    dtype = torch.get_autocast_dtype(device)
    with torch.autocast(device, enabled=False):
        return lora_linear(x.to(dtype), frozen_cast(weight, dtype), None if bias is None else bias.to(dtype),
                           lora_a.to(dtype), lora_b.to(dtype), self.scaling[name],
                           None if dropped is None else dropped.to(dtype))


def _dora_forward(self: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """DoRA (`_fusable_dora`): PEFT's `base(x) + (s - 1) * (W x) + s * scaling * B A x` is `s * (W x + scaling * B A
    x) + bias`, s = `dora_scale`; the bracket is the node's product (no dropout in effect here), then the factor."""
    base = self.get_base_layer()
    weight, bias, lora_a, lora_b = base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight
    scaling = self.scaling[name]
    scale = dora_scale(weight, lora_a, lora_b, scaling, self.lora_magnitude_vector[name].weight)
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        out = _RowScale.apply(lora_linear(x, weight, None, lora_a, lora_b, scaling), scale, x.dtype)
        return out if bias is None else out + bias
    dtype = torch.get_autocast_dtype(device)
    with torch.autocast(device, enabled=False):
        # The products in the autocast dtype, the adapter's up-projection and the sum in fp32, as PEFT sums them (a
        # bf16 sum, the node's, rounds the adapter's small part against the base's).
        rows = x.to(dtype).reshape(-1, x.size(-1))
        out = torch.addmm(F.linear(rows, frozen_cast(weight, dtype)).float(),
                          F.linear(rows, lora_a.to(dtype)).float(), lora_b.float().T, alpha=scaling)
    # The fp32 sum is kept in the autocast dtype for the magnitude's gradient (`_RowScale`).
    out = _RowScale.apply(out.view(*x.shape[:-1], out.size(-1)), scale, dtype)
    return out if bias is None else out + bias


def fuse_lora_linears(model: nn.Module) -> int:
    """Route every PEFT `lora.Linear` of `model` through `lora_linear` when its case is plain (module docstring).

    Returns:
        How many layers now take the fused path when it applies.
    """
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if type(module) is LoraLinear and "forward" not in vars(module):
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count


@contextlib.contextmanager
def shadowed_forward(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """Within the block, `module` runs `forward` (an instance attribute shadowing its class's); after it, the
    forward it had comes back, including an instance one such as `fuse_lora_linears`' (deleting the attribute
    instead would drop the fused path for the rest of the run: training after a GRPO round then took PEFT's
    unfused forward, and a resumed run, fused until its first round, did not train bit-equal to the straight one).
    """
    previous = vars(module).get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


__all__ = ["dora_scale", "frozen_cast", "lora_linear", "fuse_lora_linears", "quantized_base_layer", "shadowed_forward"]
