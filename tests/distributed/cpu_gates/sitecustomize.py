"""Test-only: lifts accelerate's two device gates so that FSDP2 and DeepSpeed run for real on this CPU (gloo).

Python imports `sitecustomize` at start-up from the first `sys.path` entry that holds one: the distributed harness
puts this folder first on the PYTHONPATH of a run's processes when a test asks for it
(`DistHarness.train(..., cpu_gates=True)`). Nothing in alignkit imports it; nothing else of accelerate or
transformers is changed. Both gates are in accelerate 1.15:

- FSDP: an FSDP request (`fsdp` training argument, or `ACCELERATE_USE_FSDP=true`) becomes `DistributedType.FSDP`
  only on GPU-like devices: in `AcceleratorState.__init__` the multi-process CPU type `MULTI_CPU` is not among the
  types that become FSDP, so on a CPU the run stays plain data parallel (DDP). torch's FSDP2 (`fully_shard`) trains
  on the CPU with gloo, so after accelerate has set its state up, a multi-process CPU state given an FSDP plugin
  becomes FSDP with that plugin, exactly what the GPU branch does. The patch also marks
  `AcceleratorState.fsdp_on_cpu = True`, which `alignkit.config.parse` reads so that it does not refuse FSDP on this
  CPU-only machine (without the patch the refusal stands: a user's run would silently be DDP).
- DeepSpeed: `PartialState._prepare_backend` picks a process-group backend only for GPU-like devices, or for the
  CPU under `use_cpu`, and under `use_cpu` it leaves DeepSpeed out. A DeepSpeed run on a CPU-only machine therefore
  gets no backend and counts one process, while DeepSpeed (which joins the launched processes itself, over gloo
  with its CPU accelerator) counts them all; alignkit refuses that (`config.parse._check_deepspeed_processes`). Here the
  missing backend of a launched worker becomes `gloo`, what accelerate would hand DeepSpeed as `nccl` on GPUs.
  Runs that are not DeepSpeed runs are untouched: alignkit sets `use_cpu` for them, and then accelerate picks gloo
  itself.
"""

import os

from accelerate.state import AcceleratorState, DistributedType, PartialState

_accelerate_init = AcceleratorState.__init__
_prepare_backend = PartialState._prepare_backend


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _accelerate_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def _backend_with_gloo(self, cpu=False, sagemaker_dp=False, backend=None):
    chosen, kind = _prepare_backend(self, cpu, sagemaker_dp, backend)
    if chosen is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
        return "gloo", kind
    return chosen, kind


AcceleratorState.__init__ = _init_with_fsdp_on_cpu
AcceleratorState.fsdp_on_cpu = True
PartialState._prepare_backend = _backend_with_gloo
