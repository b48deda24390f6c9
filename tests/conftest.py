"""Shared fixtures: a tiny random model directory built locally, and an offline environment."""

from __future__ import annotations

import contextlib
import gc
import os
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
# `bf16: auto` trains in fp32 without probing: the suite's numbers (parity, resume, 1 vs 2 processes) are fp32 ones
# on every CPU. tests/unit/test_precision.py turns the probe on where it tests it.
os.environ.setdefault("ALIGNKIT_PRECISION_PROBE", "off")

import pytest  # noqa: E402


def _cpu_description() -> str:
    """The CPU's model name and the flags that change float results or speed (bf16, AMX, AVX-512), so a
    failure report says which machine it came from (the machines differ from session to session)."""
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    shown = " ".join(f for f in wanted if f in flags) or "none of avx2/avx512f/avx512_bf16/amx"
    return f"{model}, {os.cpu_count()} cores; flags: {shown}"


def pytest_sessionstart(session):
    """Print the machine first, whatever the verbosity (`scripts/test.sh` runs pytest with -q)."""
    import torch

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
    reporter.write_line(f"cpu: {_cpu_description()}; torch {torch.__version__}, ATen capability "
                        f"{torch.backends.cpu.get_cpu_capability()}"
                        + (f", MKL_ENABLE_INSTRUCTIONS={mkl}" if mkl else ""))


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, transformers, peft, alignkit, every test module) out of the cyclic
    collector's way, as `alignkit.env.start_up_imports` does for a command. The tests then build and drop models
    and trainers in this process, and each full collection walked those libraries' objects too: on
    `tests/stages tests/parity` the two workers spent 31 and 29 s in full collections, 6.3 and 7.5 s with this
    (docs/testing.md)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path to a tiny LlamaForCausalLM (2 layers, hidden 64) + ChatML tokenizer with pad == eos."""
    from alignkit.model.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Keep caches written by a test (tokenised data, converted models) inside its tmp dir,
    except the bundled model cache, which slow tests share through ALIGNKIT_HOME when set."""
    if "ALIGNKIT_HOME" not in os.environ:
        monkeypatch.setenv("ALIGNKIT_HOME", str(tmp_path / "alignkit_home"))
    monkeypatch.setenv("ALIGNKIT_DATA_CACHE", str(tmp_path / "data_cache"))


def _save_perturbed_adapter(model_dir, out_dir, head="causal_lm", seed=1, over=None):
    """Save a fresh LoRA adapter over `model_dir` whose lora_B is random (PEFT starts it at zero, so an
    untouched adapter would change nothing), as if trained; returns the model with the adapter active.
    `over`: adapter_name_or_path merged into the base first, recorded beside the adapter as a run records it."""
    import torch

    from alignkit.config.parse import parse_config
    from alignkit.model.loader import load_model, save_base_adapters

    config = parse_config({"model_name_or_path": str(model_dir), "adapter_name_or_path": over and str(over)})
    # lora_A (and a fresh score head) come from the global RNG: seed it, so the adapter does not depend on
    # which tests ran before (merge-vs-unmerged rounding checks near 1e-5 flipped with the test order).
    torch.manual_seed(seed)
    model = load_model(config.model, config.finetuning, is_trainable=True, head=head)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    model.eval()
    model.save_pretrained(out_dir)
    save_base_adapters(model, out_dir)
    return model


@pytest.fixture
def float64_models(monkeypatch):
    """Load every model of the test in float64 (where the config says `infer_dtype: auto`).

    For tests that compare two computations that are equal in exact arithmetic but round differently: a merged
    adapter (W + BA rounded once) against the unmerged one (Wx + B(Ax)), or a packed row against padded ones.
    In float32 their gap is the rounding of every summation in the network, and it depends on the CPU's kernels
    (MKL's AVX-512 sgemm sums in another order than its AVX2 one: 2.4e-5 apart on a reward of 1.3 on an Intel
    Xeon, 1.4e-5 on an AMD EPYC). In float64 the same gap is about 2^-29 times smaller, far below one float32 ulp
    of the result, so the rewards (returned as float32) may differ by one ulp at most; anything more is a real
    difference in what is computed. Returns that bound as `torch.testing.assert_close` keywords: one float32 ulp
    relative (2^-23), and 1e-12 absolute for float64's own rounding (terms of magnitude ~10 times 2^-52)."""
    import torch

    from alignkit.model import loader

    resolve = loader.resolve_dtype
    monkeypatch.setattr(loader, "resolve_dtype", lambda name: torch.float64 if name == "auto" else resolve(name))
    return {"rtol": 2.0 ** -23, "atol": 1e-12}


@pytest.fixture
def save_perturbed_adapter():
    """`save_perturbed_adapter(model_dir, out_dir, head="causal_lm", seed=1, over=None)` -> model with a non-zero
    LoRA adapter (over the adapters `over` names, merged and recorded)."""
    return _save_perturbed_adapter


@pytest.fixture
def reward_adapter_dir(tiny_model_dir, tmp_path):
    """An rm run's LoRA output over the tiny model (task_type SEQ_CLS, `score` in modules_to_save), its
    score head shifted off its initial values as if trained."""
    import torch

    out = tmp_path / "rm_lora"
    trained = _save_perturbed_adapter(tiny_model_dir, out, head="reward")
    with torch.no_grad():
        trained.base_model.model.score.modules_to_save["default"].weight.add_(1.0)
    trained.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def bundled_model_dir(tmp_path_factory):
    """The bundled SmolLM2-135M-Instruct converted once per test session (for `slow` tests).

    Uses $ALIGNKIT_HOME's cache when the variable is set (so a developer's converted copy is reused),
    else converts into a temp dir that every xdist worker of the session shares (the base temp dir's parent is
    the session's; the conversion's file lock lets one worker convert while the others wait for it: 30 s of
    conversion a worker, once).
    """
    from alignkit.model import bundled

    if "ALIGNKIT_HOME" not in os.environ:
        mp = pytest.MonkeyPatch()
        shared = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):
            shared = shared.parent
        mp.setenv("ALIGNKIT_HOME", str(shared / "bundled_home"))
        try:
            return str(bundled.ensure_bundled_model())
        finally:
            mp.undo()
    return str(bundled.ensure_bundled_model())


class SimulatedCrash(Exception):
    """Stands for the training process dying (resume tests)."""


@pytest.fixture
def record_forward_shapes(monkeypatch):
    """`record_forward_shapes(model) -> list`: until the test ends, every forward of `model`'s class appends the
    shape of its `input_ids` (a tuple) to the returned list, then runs as before (counts the passes a batch
    takes and their sizes). A decode step that `DecodeStep` runs instead of the model's forward is recorded
    the same way, as `(rows, 1)`."""
    from alignkit.model.decode_step import DecodeStep

    def record(model) -> list[tuple[int, ...]]:
        seen: list[tuple[int, ...]] = []
        real_forward = type(model).forward
        real_step = DecodeStep.__call__

        def recording_forward(self, *args, **kwargs):
            seen.append(tuple(kwargs["input_ids"].shape))
            return real_forward(self, *args, **kwargs)

        def recording_step(self, tokens, *args, **kwargs):
            seen.append((tokens.shape[0], 1))
            return real_step(self, tokens, *args, **kwargs)

        monkeypatch.setattr(type(model), "forward", recording_forward)
        monkeypatch.setattr(DecodeStep, "__call__", recording_step)
        return seen

    return record


@pytest.fixture
def stop_after_step():
    """`stop_after_step(n)` -> a callback that ends training cleanly after step n with a checkpoint of it, as a
    run interrupted there and resumed later would have left."""
    from transformers import TrainerCallback

    class StopAfterStep(TrainerCallback):
        def __init__(self, step: int) -> None:
            self.step = step

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == self.step:
                control.should_save = True
                control.should_training_stop = True

    return StopAfterStep


@pytest.fixture
def crash_before_step():
    """`crash_before_step(n)` -> a callback that raises `SimulatedCrash` when step n is about to start, i.e.
    after step n - 1 has been logged and its checkpoint saved, as when the process is killed there."""
    from transformers import TrainerCallback

    class CrashBeforeStep(TrainerCallback):
        def __init__(self, step: int) -> None:
            self.step = step

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == self.step:
                raise SimulatedCrash(f"killed before step {self.step}")

    return CrashBeforeStep


# ---------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3 on the CPU, with stand-ins for its parameter partitioning (DeepSpeed is not installed and needs an
# accelerator). What DeepSpeed documents and these keep: outside a gather every partitioned parameter holds an empty
# tensor on each process (its `ds_id` marks it, `ds_numel` keeps its size); `deepspeed.zero.Init`, which transformers'
# `from_pretrained` enters when `is_deepspeed_zero3_enabled()`, leaves the loaded model partitioned and without hooks;
# an engine puts hooks on every module that gather the module's own parameters before its forward, release them after
# it, and gather them again before its backward; `deepspeed.zero.GatheredParameters(params)` gathers the given ones for
# its block and partitions them all on exit. So a code path that reads a weight outside a module call of an engine or
# outside a gather reads an empty tensor and fails. What this cannot show: real shards over several processes,
# DeepSpeed's prefetching, NCCL.
# ---------------------------------------------------------------------------------------------------


class StandInPartitions:
    """ZeRO-3's parameter contract on one process (the section comment above), over every parameter of `model`.

    Args:
        model: the module whose parameters to partition (now).
        hooks: put an engine's per-module gather/release hooks on it (False: as `zero.Init` leaves a model).
    A parameter partitioned by another `StandInPartitions` (at load) is taken over, as an engine takes over what
    `zero.Init` partitioned.
    """

    def __init__(self, model, hooks: bool = True) -> None:
        self.model = model
        self.params = list(model.parameters())
        self.whole: dict[int, object] = {}
        for param in self.params:
            owner = getattr(param, "ds_owner", None)
            if owner is not None and owner is not self:
                owner.give_up(param)
        for number, param in enumerate(self.params):
            param.ds_id = number  # what `sharding_of` and `full_weights` look for
            param.ds_numel = param.numel()
            param.ds_owner = self
        self.handles: list = []
        self.generation_blocks = 0
        self.gathers = 0  # `GatheredParameters` blocks entered over these parameters
        if hooks:
            self._add_hooks()
        self.partition(self.params)

    def partition(self, params) -> None:
        import torch

        for param in params:
            if param.ds_id not in self.whole:
                self.whole[param.ds_id] = param.data
                param.data = torch.empty(0, dtype=param.dtype)

    def gather(self, params) -> None:
        for param in params:
            if param.ds_id in self.whole:
                param.data = self.whole.pop(param.ds_id)

    def give_up(self, param) -> None:
        """Hand `param` over whole (to an engine's partitions)."""
        self.gather([param])
        self.params = [p for p in self.params if p is not param]

    def is_partitioned(self) -> bool:
        return len(self.whole) == len(self.params)

    def _add_hooks(self) -> None:
        import torch

        for module in self.model.modules():
            own = list(module.parameters(recurse=False))
            if not own:
                continue

            def before(_module, _args, own=own):
                self.gather(own)

            def after(_module, _args, output, own=own):
                outputs = output if isinstance(output, (tuple, list)) else [output]
                for tensor in outputs:
                    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                        tensor.register_hook(lambda grad, own=own: self.gather(own))  # DeepSpeed's pre-backward
                self.partition(own)

            self.handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    @contextlib.contextmanager
    def generation_block(self):
        """`deepspeed.runtime.zero.unwrap_model_for_generation(engine)`."""
        self.generation_blocks += 1
        self.gather(self.params)
        for handle in self.handles:
            handle.remove()
        self.handles = []
        try:
            yield self.model
        finally:
            self._add_hooks()
            self.partition(self.params)

    @contextlib.contextmanager
    def whole_weights(self):
        self.gather(self.params)
        try:
            yield
        finally:
            self.partition(self.params)


@contextlib.contextmanager
def _stand_in_gathered_parameters(params):
    """`deepspeed.zero.GatheredParameters(params, modifier_rank=None)`: every given parameter gathered for the block,
    all of them partitioned on exit (as DeepSpeed's `__exit__` does, gathered before the block or not)."""
    params = list(params)
    owners = {id(p.ds_owner): p.ds_owner for p in params}
    for owner in owners.values():
        owner.gathers += 1
    for param in params:
        param.ds_owner.gather([param])
    try:
        yield
    finally:
        for param in params:
            param.ds_owner.partition([param])


class _StandInDeepSpeedConfig:
    """What transformers reads from the run's `HfDeepSpeedConfig` through its weak reference (`is_zero3`, `config`)."""

    config = {"zero_optimization": {"stage": 3}}

    def is_zero3(self) -> bool:
        return True


@pytest.fixture
def zero3_loading(monkeypatch):
    """`install()` switches transformers' ZeRO-3 on (`is_deepspeed_zero3_enabled()` is True until the test ends) and
    stands in for `zero.Init` at load: `loader._load_base` loads the whole model with ZeRO-3 switched off (DeepSpeed
    is not here), then partitions it without hooks (`StandInPartitions(model, hooks=False)`), as `from_pretrained`
    under ZeRO-3 leaves it. `deepspeed.zero.GatheredParameters`, as alignkit's `full_weights` enters it, is the
    stand-in's gather. Returns the list of models loaded from then on (each one's parameters carry `ds_owner`).

    `install(policy_whole=True)`: a Trainer's own model is given back its whole weights when `Trainer.__init__`
    returns (before a stage trainer builds its reference), standing in for the DeepSpeed engine the Trainer would
    build over it, which gathers its weights for its forwards and backwards; that engine is not stood in for."""
    from transformers.integrations import deepspeed as hf_deepspeed

    from alignkit.model import distributed, loader

    def install(policy_whole: bool = False) -> list:
        config = _StandInDeepSpeedConfig()
        # What `set_hf_deepspeed_config(config)` does, undone when the test ends; the module keeps `config` alive.
        monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", weakref.ref(config))
        monkeypatch.setattr(hf_deepspeed, "_stand_in_config", config, raising=False)
        loaded: list = []
        real_load = loader._load_base

        def load_partitioned(model_args, head, head_comes_later=False):
            if not distributed.zero3_enabled():
                return real_load(model_args, head, head_comes_later)
            with distributed.zero3_switched_off():
                model = real_load(model_args, head, head_comes_later)
            StandInPartitions(model, hooks=False)
            loaded.append(model)
            return model

        monkeypatch.setattr(loader, "_load_base", load_partitioned)
        monkeypatch.setattr(distributed, "_zero3_gathered", _stand_in_gathered_parameters)
        if policy_whole:
            import transformers

            trainer_init = transformers.Trainer.__init__

            def init(self, *args, **kwargs):
                trainer_init(self, *args, **kwargs)
                for param in self.model.parameters():
                    if hasattr(param, "ds_owner"):
                        param.ds_owner.give_up(param)
                        del param.ds_owner, param.ds_id, param.ds_numel

            monkeypatch.setattr(transformers.Trainer, "__init__", init)
        return loaded

    return install


@pytest.fixture
def zero3_partitions():
    """The `StandInPartitions` class (an engine's partitions: `StandInPartitions(model)`)."""
    return StandInPartitions
