#!/usr/bin/env bash
# Install (once) and run the test suite. Extra arguments go to pytest (e.g. -m "not slow").
# --fast (first argument): the tier to run while working: tests/unit without the bundled-model and multi-process
# tests (docs/testing.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- tests/unit -m "not slow and not distributed" "$@"
fi
exec "${ALIGNKIT_VENV:-$root/.venv}/bin/python" -m pytest -q "$@"
