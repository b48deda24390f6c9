"""Test-only: lets accelerate start DeepSpeed on a CPU-only machine, so the suite runs real DeepSpeed (gloo).

Python imports `sitecustomize` at start-up from the path; the distributed harness puts this folder first on the
`PYTHONPATH` of a run only when a test asks for it (`dist.train(..., cpu_gates=True)`), with
`ALIGNKIT_TEST_CPU_DEEPSPEED=1`. Nothing in alignkit imports it.

Why a gate needs lifting: accelerate 1.15 (`PartialState._prepare_backend`) picks a process-group backend only for
GPU-like devices, or for the CPU under `use_cpu`, and under `use_cpu` it leaves DeepSpeed out. On a CPU-only
machine a DeepSpeed run therefore gets no backend, counts one process, and DeepSpeed (which joins the launched
processes itself, over gloo on the CPU) disagrees with it. Here the missing backend becomes `gloo` for a launched
worker, which is what accelerate would hand DeepSpeed on a GPU machine with `nccl`; DeepSpeed 0.19's CPU accelerator
then runs ZeRO over gloo.
"""

import os

if os.environ.get("ALIGNKIT_TEST_CPU_DEEPSPEED") == "1":
    from accelerate import state as _state

    _prepare_backend = _state.PartialState._prepare_backend

    def _with_gloo(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = _prepare_backend(self, cpu, sagemaker_dp, backend)
        if chosen is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", kind
        return chosen, kind

    _state.PartialState._prepare_backend = _with_gloo
