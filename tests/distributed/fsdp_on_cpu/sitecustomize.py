"""Lets accelerate turn on FSDP in a multi-process CPU (gloo) run, for the distributed tests only.

accelerate 1.15 makes an FSDP request (`fsdp` training argument, or `ACCELERATE_USE_FSDP=true`) into
`DistributedType.FSDP` only on GPU-like devices: in `AcceleratorState.__init__` the multi-process CPU type
`MULTI_CPU` is not among the types that become FSDP, so on a CPU the run stays plain data parallel (DDP).
torch's FSDP2 (`fully_shard`) itself trains on the CPU with gloo, so the tests lift that one gate: after
accelerate has set its state up, a multi-process CPU state given an FSDP plugin becomes FSDP with that plugin,
exactly what the GPU branch does. Nothing else of accelerate or transformers is changed.

The patch also marks `AcceleratorState.fsdp_on_cpu = True`, which `alignkit.hparams` reads so that it does not
refuse FSDP on this CPU-only machine (without the patch the refusal stands: a user's run would silently be DDP).

Python imports `sitecustomize` at start-up from the first `sys.path` entry that holds one: the harness puts
this folder first on the workers' PYTHONPATH (`DistHarness.train(..., fsdp_on_cpu=True)`).
"""

from accelerate.state import AcceleratorState, DistributedType, PartialState

_accelerate_init = AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _accelerate_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP


AcceleratorState.__init__ = _init_with_fsdp_on_cpu
AcceleratorState.fsdp_on_cpu = True
