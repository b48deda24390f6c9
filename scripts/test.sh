#!/usr/bin/env bash
# Install (once) the test stack (scripts/setup.sh test: the dev and board extras and the system's Chromium) and run the
# test suite. Extra arguments go to pytest (e.g. -m "not slow").
# --fast (first argument): the tier to run while working: tests/unit without the bundled-model and multi-process
# tests (docs/testing.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" test
cd "$root"
venv="${ALIGNKIT_VENV:-$root/.venv}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
  set -- tests/unit -m "not slow and not distributed" "$@"
fi
# DeepSpeed (dev extra) compiles its C++ ops (CPU Adam, the shared-memory all-reduce) with -march=native on first
# use, minutes on 2 cores. They are built here, before the suite (not for the fast tier, which runs no DeepSpeed),
# into a folder of this venv and this CPU: in torch's shared default (~/.cache/torch_extensions) another venv's
# build (a second checkout, a CI clone) replaced them, and the next DeepSpeed test recompiled them on both cores
# (docs/testing.md). An op that does not apply to this machine is skipped.
cpu="$( { grep -m1 '^model name' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo; } 2>/dev/null | sha256sum | cut -c1-12)"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$venv/torch_extensions/$cpu}"
if [ "$fast" = 0 ] && [ ! -e "$TORCH_EXTENSIONS_DIR/.built" ]; then
  "$venv/bin/python" scripts/build_deepspeed_ops.py && mkdir -p "$TORCH_EXTENSIONS_DIR" && touch "$TORCH_EXTENSIONS_DIR/.built"
fi
# Tests run in parallel worker processes (pytest-xdist), one per core up to 4: most tests spend their time in
# single-threaded work (subprocess start-up, imports, Python overhead around a tiny model), which left a second core
# idle (docs/testing.md). ALIGNKIT_TEST_WORKERS=0 runs everything in this one process (e.g. to use a debugger).
workers="${ALIGNKIT_TEST_WORKERS:-$(n="$(nproc)"; echo $(( n < 4 ? n : 4 )))}"
# One torch thread per worker (and per process a test starts), unless set: N workers with N threads each on N
# cores oversubscribe them, and OpenMP's threads then wait on each other at every parallel region. On the 2-core
# EPYC, tests/stages/test_{sft,dpo,grpo}.py took 28 s with one thread against 39 s with two (docs/testing.md).
if [ "$workers" != 0 ]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
exec "$venv/bin/python" -m pytest -q -n "$workers" --dist worksteal "$@"
