#!/usr/bin/env bash
# Install (once) and run `alignkit demo`: a short LoRA SFT of the bundled SmolLM2-135M-Instruct,
# printing the same prompts' answers before and after.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec "${ALIGNKIT_VENV:-$root/.venv}/bin/alignkit" demo "$@"
