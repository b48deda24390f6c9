"""Tools for the tool-calling tests (`tools: tests/tool_functions.py:add`, ...): one that works, one that raises, one
that sleeps (past a short `tool_timeout`), one that returns 10 MB; and a reward that counts a completion's messages.
For `--environment-factory`: a counter environment, a class without `reset`, and a reward that reads `environments`."""

from __future__ import annotations

import math
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


class Counter:
    """An environment (TRL's contract): `reset` restarts the count and says what it was given; `bump` is its tool."""

    def reset(self, **row):
        self.row, self.count = row, 0
        return f" (count from 0; reset got {', '.join(sorted(row))}; {len(row['prompt'])} prompt messages)"

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much.
        """
        self.count += by
        return self.count


class NoReset:
    """Not an environment: no `reset`."""


def counted(completions, environments, answer, **kwargs):
    """Each row's count, read from its own `Counter` (NaN where the instance was not reset for this row's answer)."""
    assert len({id(e) for e in environments}) == len(environments) == len(completions), "one instance per row"
    return [float(e.count) if e.row.get("answer") == a else math.nan for e, a in zip(environments, answer)]


class ScoredCounter(Counter):
    """A `Counter` that owns its reward (TRL 1.16's `get_reward`): the count it reached."""

    def get_reward(self) -> float:
        return float(self.count)
