"""`alignkit env`: the versions and hardware facts to paste into a bug report; where alignkit keeps its files."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

LIBRARIES = ("torch", "transformers", "peft", "datasets", "accelerate", "trl")


def alignkit_home() -> Path:
    """`$ALIGNKIT_HOME`, or `~/.cache/alignkit` when unset: the converted bundled model and data caches live there."""
    return Path(os.environ.get("ALIGNKIT_HOME") or Path.home() / ".cache" / "alignkit").expanduser()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def env_info() -> dict[str, Any]:
    """Versions of alignkit, Python and the libraries it builds on, and what torch sees of the hardware.

    Libraries that are not installed (trl is optional) are left out.
    """
    import torch

    info: dict[str, Any] = {
        "alignkit": _version("alignkit"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for name in LIBRARIES:
        version = _version(name)
        if version is not None:
            info[name] = version
    if torch.cuda.is_available():
        info["device"] = f"cuda: {torch.cuda.get_device_name(0)}"
        info["device_count"] = torch.cuda.device_count()
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
    else:
        info["device"] = "cpu"
        info["device_count"] = 1
        # Hardware bf16 (AVX512-BF16/AMX) as oneDNN sees it; without it bf16 runs far slower than fp32.
        mkldnn = torch.backends.mkldnn
        info["bf16_supported"] = bool(getattr(mkldnn, "is_bf16_supported", lambda: False)())
    info["num_threads"] = torch.get_num_threads()
    return info


def format_env(info: dict[str, Any]) -> str:
    """One `- key: value` line per entry, aligned, for the terminal or an issue."""
    width = max((len(k) for k in info), default=0)
    return "\n".join(f"- {key.ljust(width)}: {value}" for key, value in info.items())


__all__ = ["alignkit_home", "env_info", "format_env"]
