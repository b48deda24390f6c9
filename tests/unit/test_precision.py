"""`bf16: auto`: the choice rule, the probe's bookkeeping, where the config settles it, and a training run that
follows it (tests/stages/test_bf16_auto.py) (`alignkit.model.precision`, `alignkit.config.parse.settle_auto_bf16`)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch import nn

from alignkit.config import parse as parse_module
from alignkit.config.parse import parse_config, settle_auto_bf16
from alignkit.errors import ConfigError
from alignkit.model import precision
from tests.helpers import tiny_config


def test_prefer_bf16_needs_the_margin():
    # 1.00 s in fp32 against 0.95 s in bf16 is 1.05x: within noise, fp32 stays. 0.90 s is 1.11x: bf16.
    assert not precision.prefer_bf16(1.0, 0.95)
    assert precision.prefer_bf16(1.0, 0.90)
    assert precision.prefer_bf16(1.1, 1.0)  # exactly the margin
    assert not precision.prefer_bf16(1.0, 2.0)
    assert not precision.prefer_bf16(1.0, 0.0)  # no measurement is no evidence


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"vocab_size": 11})()
        self.embed = nn.Embedding(11, 4)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4, 11)

    def forward(self, input_ids, attention_mask=None):
        return (self.head(self.drop(self.embed(input_ids))),)


def test_measure_alternates_takes_medians_and_restores_state():
    model = Tiny().eval()
    calls = []
    fake = {False: iter([9.0, 3.0, 2.0, 4.0]), True: iter([9.0, 1.0, 5.0, 2.0])}  # warm-up first, then 3 each

    def timer(m, bf16, input_ids):
        assert m.training and input_ids.shape == (precision.PROBE_ROWS, precision.PROBE_TOKENS)
        torch.rand(1), random.random()  # as dropout would: the caller's streams must not move
        calls.append(bf16)
        return next(fake[bf16])

    torch.manual_seed(5), random.seed(5)
    want = torch.rand(1), random.random()
    torch.manual_seed(5), random.seed(5)
    figures = precision.measure(model, timer=timer, repeats=3)
    assert figures == {"fp32_s": 3.0, "bf16_s": 2.0}  # medians of (3, 2, 4) and (1, 5, 2)
    assert calls == [False, True] * 4
    assert not model.training
    assert (torch.rand(1), random.random()) == want


def test_probe_step_runs_forward_backward_and_clears_gradients():
    model = Tiny()
    seconds = precision.probe_step_seconds(model, True, torch.randint(0, 11, (2, 5)))
    assert seconds > 0 and all(p.grad is None for p in model.parameters())


def test_probed_choice_is_cached_per_machine_and_model(tmp_path, monkeypatch):
    monkeypatch.setattr("alignkit.env.cpu_supports_bf16", lambda: True)
    monkeypatch.setenv(precision.PROBE_ENV, "on")
    runs = []
    monkeypatch.setattr(precision, "measure", lambda model: runs.append(1) or {"fp32_s": 2.0, "bf16_s": 1.0})
    bf16, reason = precision.probed_choice(Tiny(), tmp_path)
    assert bf16 and reason.startswith("probe:") and "2.00x" in reason
    cache = json.loads((tmp_path / precision.PROBE_CACHE_FILE).read_text())
    assert list(cache) == [precision.probe_key(Tiny())]
    bf16, reason = precision.probed_choice(Tiny(), tmp_path)
    assert bf16 and reason.startswith("cached probe:") and len(runs) == 1
    monkeypatch.setattr(precision, "PROBE_REVISION", precision.PROBE_REVISION + 1)  # new step code: probe again
    bf16, reason = precision.probed_choice(Tiny(), tmp_path)
    assert reason.startswith("probe:") and len(runs) == 2
    monkeypatch.setattr("alignkit.env.cpu_supports_bf16", lambda: False)
    assert precision.probed_choice(Tiny(), tmp_path) == (False, "this CPU has no bf16 hardware (AVX512-BF16 or AMX)")


@pytest.mark.parametrize("given, accelerator, accelerator_bf16, cpu_bf16, engine, want", [
    ({}, False, False, True, False, "auto"),  # a CPU with bf16 hardware: left for the probe
    ({}, False, False, False, False, False),  # no bf16 hardware: fp32
    ({}, False, False, True, True, False),  # DeepSpeed/FSDP read the precision before the model exists
    ({"fp16": True}, True, True, True, False, False),
    ({}, True, True, True, False, True),  # an accelerator with bf16: TRL's default
    ({}, True, False, True, False, False),
    ({"use_cpu": True}, True, True, True, False, "auto"),  # use_cpu on a GPU machine: the CPU rule
    ({"bf16": True}, False, False, True, False, True),  # forced choices are kept
    ({"bf16": False}, False, False, True, False, False),
])
def test_settle_auto_bf16(monkeypatch, given, accelerator, accelerator_bf16, cpu_bf16, engine, want):
    monkeypatch.setattr(parse_module, "_has_accelerator", lambda: accelerator)
    monkeypatch.setattr(parse_module, "_accelerator_has_bf16", lambda: accelerator_bf16)
    monkeypatch.setattr(parse_module, "_cpu_has_bf16", lambda: cpu_bf16)
    kwargs = {"bf16": "auto", **given}
    settle_auto_bf16(kwargs, engine=engine)
    assert kwargs["bf16"] == want


def test_config_default_is_auto_and_bad_values_are_named(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(parse_module, "_cpu_has_bf16", lambda: True)
    config = tiny_config(tiny_model_dir, tmp_path / "out", stage="sft", dataset="x.json")
    assert config.training.bf16 is False and config.training.bf16_auto  # fp32 until a trainer settles it
    config = tiny_config(tiny_model_dir, tmp_path / "out", stage="sft", dataset="x.json", bf16="AUTO")
    assert config.training.bf16_auto
    config = tiny_config(tiny_model_dir, tmp_path / "out", stage="sft", dataset="x.json", bf16=False)
    assert config.training.bf16 is False and not config.training.bf16_auto
    with pytest.raises(ConfigError, match="bf16"):
        parse_config({"model_name_or_path": tiny_model_dir, "dataset": "x.json"}, ["bf16=maybe"])


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_frozen_linears_keeps_autocast_numbers_and_a_tied_head(tiny_model_dir, tied):
    """A frozen model run under bf16 autocast gives bit-equal logits with its linear weights stored in bf16; a head
    tied to the input embedding, the embedding, norms and trainable weights stay fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=tied).eval()
    model.requires_grad_(False)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = model(input_ids=ids).logits
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    converted = precision.bf16_frozen_linears(model)
    assert converted == len(linears) - (1 if tied else 0)
    assert (model.lm_head.weight.dtype == torch.float32) is tied
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_bf16_frozen_linears_leaves_trainable_weights():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].requires_grad_(False)
    assert precision.bf16_frozen_linears(model) == 1
    assert model[0].weight.dtype == torch.float32 and model[1].weight.dtype == torch.bfloat16


SHAPE_CACHE_PROBE = """
import ctypes, os, sys
if sys.argv[1] == "alignkit":
    import alignkit  # noqa: F401  (sets the caches' capacities, unless exported)
else:
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = os.environ["LRU_CACHE_CAPACITY"] = "1024"  # their defaults
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def in_use():
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20

torch.set_num_threads(1)
weight = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
def step(rows):
    torch.nn.functional.linear(torch.randn(rows, 256, dtype=torch.bfloat16, requires_grad=True), weight).sum().backward()
for _ in range(3):
    step(64)
for rows in range(100, 130):  # a new token count each step, as padding-free batches and rollouts give
    step(rows)
before = in_use()  # capped caches are full by now
for rows in range(130, 170):
    step(rows)
print(in_use() - before)
"""


def test_importing_alignkit_bounds_onednn_shape_caches(tmp_path):
    """oneDNN's and ideep's per-shape kernel caches (1024 entries each by default, never freed) made a bf16 run's
    heap grow with every new token count: importing alignkit caps them, so once 30 shapes have filled them, 40 more
    leave the heap about where it was, where the default capacities keep tens of MB more."""
    import ctypes.util
    import subprocess
    import sys

    if not ctypes.util.find_library("c") or not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2"):
        pytest.skip("needs glibc's mallinfo2")
    script = tmp_path / "probe.py"
    script.write_text(SHAPE_CACHE_PROBE)
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}

    def growth(mode: str) -> float:
        out = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return float(out.stdout.strip().splitlines()[-1])

    uncapped = growth("default")
    if uncapped < 20:
        pytest.skip(f"this torch/CPU runs bf16 products without oneDNN's caches (heap +{uncapped:.1f} MB uncapped)")
    capped = growth("alignkit")
    assert capped < uncapped / 4, (capped, uncapped)
