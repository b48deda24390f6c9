"""Build DeepSpeed's JIT ops that a CPU run uses (CPU Adam for ZeRO offload, the shared-memory all-reduce) into
torch's extension cache (`TORCH_EXTENSIONS_DIR`), so that the first DeepSpeed run or test does not spend minutes
compiling them.

A no-op where DeepSpeed is not installed; an op that does not apply to this machine's accelerator is skipped.
Run by scripts/test.sh before the suite, into a folder of the venv and the CPU; safe to run again (a built op is
only loaded).
"""

from __future__ import annotations

import importlib.util
import sys
import time

OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")


def main() -> int:
    if importlib.util.find_spec("deepspeed") is None:
        return 0
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for name in OPS:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"setup: DeepSpeed op {name} does not apply here; skipped", file=sys.stderr)
            continue
        start = time.monotonic()
        builder.load(verbose=False)
        print(f"setup: DeepSpeed op {builder.absolute_name()} ready ({time.monotonic() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
