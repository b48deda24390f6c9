"""Tools for the tool-calling tests (`tools: tests/tool_functions.py:add`, ...): one that works, one that raises, one
that sleeps (past a short `tool_timeout`), one that returns 10 MB; and a reward that counts a completion's messages."""

from __future__ import annotations

import time


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: ignored.
    """
    raise RuntimeError("kaboom")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "woke"


def huge() -> str:
    """Returns 10 MB of text."""
    return "x" * 10_000_000


def calls_reward(completions, **kwargs):
    """The number of messages in each completion (assistant turns and tool results)."""
    return [float(len(c)) for c in completions]
