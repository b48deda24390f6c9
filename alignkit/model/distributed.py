"""Whole weights for the passes that run a sharded model outside the training step.

Under DeepSpeed ZeRO-3 and FSDP each process holds a shard of every weight; a forward gathers each layer's
weights from all processes just before the layer runs and frees them after. That is right for a training
step, but the DPO reference precomputation runs many batches in a row, and generation (GRPO/PPO rollouts,
SFT prediction) runs one forward per new token: gathered layer by layer, the whole model crosses the network
once per token. `full_weights(model)` gathers the weights once for a block of work (one generation batch, one
precomputation pass) and puts the shards back on exit.

- ZeRO-3: the parameters DeepSpeed partitioned carry a `ds_id` attribute (set by `deepspeed.zero.Init`, which
  transformers' `from_pretrained` uses when the `deepspeed` config has stage 3). They are gathered with
  `deepspeed.zero.GatheredParameters(params, modifier_rank=None)` (read-only: nothing is written back).
  Once a DeepSpeed engine runs over the model, every submodule also carries the engine's hooks, which gather
  its weights before its forward and partition them again after it, gathered block or not; given the engine
  (`engine=`), the block is DeepSpeed's own `deepspeed.runtime.zero.unwrap_model_for_generation(engine)`
  instead, which gathers every weight once and takes those hooks off for the block (and puts them back).
  Without it (a model that no engine runs, or a DeepSpeed without that function) each forward inside the
  block gathers and frees its layers again: correct, as slow as no block.
- FSDP2 (`fully_shard`, accelerate's `fsdp_version: 2`): every `FSDPModule` is unsharded with `unshard()`
  and kept whole across forwards (`set_reshard_after_forward(False)`), then `reshard()`ed and given back its
  reshard-after-forward setting on exit. FSDP2 is first set up from the root (as its first forward would), so
  that a block before any forward gives the root back FSDP2's own choice for it (whole after forward).
- FSDP1 (`FullyShardedDataParallel` wrappers) offers `summon_full_params`, but no forward may run inside it,
  so FSDP1 models are yielded as they are (gathered per forward: correct, slower).
- Anything else (one process, DDP, ZeRO-0/1/2, which keep whole weights on every process): a no-op.
- A ZeRO-3 block nested in another over the same model (a reference pass inside the DPO precomputation's block) is
  a no-op: DeepSpeed's `GatheredParameters` partitions its parameters on exit, which would pull the weights from
  under the outer block.

`unwrap_without_importing_deepspeed()` stops accelerate from importing deepspeed in runs that never use it (see
there).

`zero3_enabled()` is transformers' switch that makes `from_pretrained` partition as it loads (`deepspeed.zero.Init`);
`zero3_switched_off()` turns it off for a block (the loader's one-time merge of `adapter_name_or_path`).

On the CPU here: the FSDP2 path with torch's `fully_shard` on gloo (and through the Trainer, GRPO's and PPO's
rollouts, in the distributed tests), ZeRO-3 with real DeepSpeed 0.19 on gloo (2 processes, the DPO reference pass,
GRPO's and PPO's rollouts given the engine, the partitioned reference of a full policy;
tests/distributed/test_distributed_deepspeed.py) and with DeepSpeed stubbed (unit tests), the no-op; see
docs/ARCHITECTURE.md. Not on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

from torch import nn

logger = logging.getLogger(__name__)

# Set on a ZeRO-3 model while a `full_weights` block holds its weights gathered.
_GATHERED_ATTR = "alignkit_weights_gathered"


def is_zero3_partitioned(param: nn.Parameter) -> bool:
    """Whether DeepSpeed ZeRO-3 has partitioned `param` (`deepspeed.zero.Init` gives such parameters a `ds_id`).

    Outside a gather such a parameter holds this process's partition (often an empty tensor), so code that reads
    weights outside their module's forward (fused kernels, the fused output-layer log-probs) must step aside.
    """
    return hasattr(param, "ds_id")


def zero3_enabled() -> bool:
    """Whether `from_pretrained` partitions the weights it loads (transformers' switch, on while the run's
    `TrainingArguments` hold a DeepSpeed config with ZeRO stage 3)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


@contextlib.contextmanager
def zero3_switched_off() -> Iterator[None]:
    """Within the block `from_pretrained` loads whole weights into CPU memory, as without DeepSpeed.

    transformers reads ZeRO-3 from one module-level weak reference to the run's `HfDeepSpeedConfig`
    (`set_hf_deepspeed_config`); it is taken away for the block and put back on exit. For work on whole weights
    that must not be partitioned (merging adapters into a base); nothing loaded here may be trained under ZeRO-3.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    reference = hf_deepspeed._hf_deepspeed_config_weak_ref  # transformers has no public getter for the object
    config = reference() if reference is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            hf_deepspeed.set_hf_deepspeed_config(config)


def zero3_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that DeepSpeed ZeRO-3 has partitioned; [] otherwise."""
    return [p for p in model.parameters() if is_zero3_partitioned(p)]


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that FSDP2's `fully_shard` has sharded; [] otherwise (or without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: no FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def sharding_of(model: nn.Module) -> str:
    """`"zero3"`, `"fsdp2"`, `"fsdp1"` or `"none"`: how `model`'s weights are split across processes."""
    if zero3_parameters(model):
        return "zero3"
    if fsdp2_modules(model):
        return "fsdp2"
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return "fsdp1"
    return "none"


@contextlib.contextmanager
def full_weights(model: nn.Module, engine: Optional[nn.Module] = None) -> Iterator[nn.Module]:
    """Within the block, `model` computes with whole weights gathered once (module docstring); yields it.

    Use it around one generation batch or one reference pass, not around a training step (the optimizer
    works on the shards). Gathering costs the memory of the whole model on each process for the block.

    Args:
        model: the model to run in the block.
        engine: the DeepSpeed engine running over `model`, if any: under ZeRO-3 its per-module hooks are taken
            off for the block, so the weights stay gathered across forwards.

    Example:
        with full_weights(policy) as model:
            generation = generate(model, tokenizer, ids, mask, stop_token_ids=stops)
    """
    kind = sharding_of(model)
    if kind == "zero3" and getattr(model, _GATHERED_ATTR, False):
        # Already inside a block over this model (a reference pass inside the DPO precomputation's block): a nested
        # `GatheredParameters` would partition the weights on its exit while the outer block still runs on them.
        yield model
    elif kind == "zero3":
        block = _zero3_generation(engine) if engine is not None else None
        with block or _zero3_gathered(zero3_parameters(model)):
            setattr(model, _GATHERED_ATTR, True)
            try:
                yield model
            finally:
                setattr(model, _GATHERED_ATTR, False)
    elif kind == "fsdp2":
        modules = fsdp2_modules(model)
        _lazy_init_fsdp2_root(model)
        before = [_reshards_after_forward(m) for m in modules]
        for module in modules:
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()
        try:
            yield model
        finally:
            for module, reshard in zip(modules, before):
                module.reshard()
                module.set_reshard_after_forward(reshard, recurse=False)
    else:
        yield model


def _zero3_gathered(params: list[nn.Parameter]) -> contextlib.AbstractContextManager:
    """DeepSpeed's documented gather of partitioned parameters, read-only (`modifier_rank=None`: nothing is
    broadcast back on exit)."""
    import deepspeed  # imported only under ZeRO-3, which already runs on DeepSpeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _zero3_generation(engine: nn.Module) -> Optional[contextlib.AbstractContextManager]:
    """DeepSpeed's gather-once block for an engine (`deepspeed.runtime.zero.unwrap_model_for_generation`: every
    weight gathered, the engine's module hooks off inside, back on exit), or None where this DeepSpeed lacks it."""
    try:
        from deepspeed.runtime.zero import unwrap_model_for_generation
    except ImportError:
        logger.warning("This DeepSpeed has no deepspeed.runtime.zero.unwrap_model_for_generation: under ZeRO-3 the "
                       "engine's hooks re-gather every layer at each forward of a rollout (correct, slower); a newer "
                       "DeepSpeed gathers once per rollout.")
        return None
    return unwrap_model_for_generation(engine)


def _lazy_init_fsdp2_root(model: nn.Module) -> None:
    """Have FSDP2 set up its state from `model`, the root, as its first forward would (a no-op after that).

    FSDP2 decides at that first forward that the root does not reshard after forward (its weights would be
    gathered again at once for the backward), unless `set_reshard_after_forward` was called on it before. A
    block entered before any forward (the first rollout of a run) would otherwise read the root's setting as
    "reshard", set it to False for the block and put "reshard" back on exit: from then on the root would
    reshard after every forward, and code that reads its weights after the model's call (PPO's value head, the
    fused output-layer log-probs) would find shards (DTensors). `_lazy_init` is FSDP2's own, private, hook-time
    set-up; it is idempotent.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    if isinstance(model, FSDPModule):
        model._get_fsdp_state()._lazy_init()


def _reshards_after_forward(module: nn.Module) -> bool:
    """An FSDP2 module's reshard-after-forward setting (True, FSDP2's default, when it cannot be read)."""
    state = module._get_fsdp_state()  # FSDPModule's accessor; the setting lives on its parameter groups
    groups = getattr(state, "_fsdp_param_groups", None) or []
    if not groups:
        return True
    return groups[0].post_forward_mesh_info is not None


def unwrap_without_importing_deepspeed() -> None:
    """accelerate's `extract_model_from_parallel` (which `Trainer.__init__` and every unwrap call) imports deepspeed
    whenever it is installed, only to test `isinstance(model, DeepSpeedEngine)`. No object can be a
    `DeepSpeedEngine` before deepspeed is imported, so the test is asked only once it is: that module's
    availability check becomes "installed and already imported". A run without DeepSpeed then never imports it
    (about 2 s of every start-up with the `deepspeed` or `dev` extra, and DeepSpeed's "Setting accelerator to CPU"
    line on a CPU machine); a DeepSpeed run imports it while its config is read, long before any unwrap.
    Idempotent."""
    import sys

    from accelerate.utils import other

    installed = getattr(other.is_deepspeed_available, "__wrapped__", other.is_deepspeed_available)

    def deepspeed_in_use() -> bool:
        return "deepspeed" in sys.modules and deepspeed_in_use.__wrapped__()

    deepspeed_in_use.__wrapped__ = installed
    other.is_deepspeed_available = deepspeed_in_use


__all__ = ["full_weights", "sharding_of", "zero3_enabled", "zero3_switched_off", "zero3_parameters", "fsdp2_modules",
           "unwrap_without_importing_deepspeed"]
