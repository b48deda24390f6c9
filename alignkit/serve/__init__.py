"""`alignkit api`: an OpenAI-compatible server for the base model and its adapters (docs/api.md).

    engine.py   ServedModels (one base, each adapter a named PEFT adapter and a model id), BatchEngine (bounded
                queue, one worker thread batching waiting requests into one decode of the rollout decoder)
    app.py      the FastAPI routes, request checks and OpenAI-shaped errors, server-sent events
    tools.py    tool calls read from and written to the chat template's own format

Needs the `api` extra (FastAPI, uvicorn, sse-starlette); `serve` checks for it before any model loads.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Optional

from ..errors import ConfigError

logger = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_installed() -> None:
    """Raise a ConfigError naming the install command when the `api` extra is missing."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn", "sse_starlette") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"alignkit api needs {', '.join(missing)}: pip install 'alignkit[api]'.")


def parse_adapters(items: list[str]) -> dict[str, str]:
    """`--adapter NAME=DIR` items as {name: dir}; a bare DIR is named after its folder.

    Raises:
        ConfigError: an empty name or a name given twice.
    """
    from pathlib import Path

    adapters: dict[str, str] = {}
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep:
            name, folder = Path(item.rstrip("/")).name, item
        if not name or not folder:
            raise ConfigError(f"--adapter {item!r}: write NAME=DIR (the model id clients ask for, then the adapter "
                              "directory).")
        if name in adapters:
            raise ConfigError(f"--adapter {item!r}: the model id {name!r} is given twice.")
        adapters[name] = folder
    return adapters


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only."""
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(model_args, adapters: dict[str, str], *, template: Optional[str], base_id: str, host: str, port: int,
          api_key: Optional[str], max_tokens: int, max_batch_rows: int = 16, max_queue: int = 64,
          default_system: Optional[str] = None) -> None:
    """Load the models and serve them until interrupted (see `alignkit api --help`)."""
    check_installed()
    import uvicorn

    from .app import create_app
    from .engine import BatchEngine, ServedModels

    if not is_loopback(host):
        logger.warning("alignkit api on %s: anyone who can reach this address can use the models%s. Keep it on "
                       "127.0.0.1 (an SSH tunnel reaches it from elsewhere).", host,
                       "" if api_key else " (no --api-key is set)")
    models = ServedModels(model_args, adapters, template, base_id, default_system)
    engine = BatchEngine(models, max_batch_rows=max_batch_rows, max_queue=max_queue)
    app = create_app(engine, api_key=api_key, max_tokens_default=max_tokens)
    logger.info("Serving %s on http://%s:%d/v1", ", ".join(models.models), host, port)
    uvicorn.run(app, host=host, port=port, log_level="warning")


__all__ = ["serve", "parse_adapters", "is_loopback", "check_installed"]
