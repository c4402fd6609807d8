"""Where a training step goes: wall time, and bytes and messages sent to other ranks, per named phase.

Off by default (a ``phase`` block then costs one global read). Benchmarks turn it on with ``enable()``,
run steps, and read ``snapshot()``. Phases nest; each phase's time is its own (exclusive of the phases
inside it), so the times of one step add up to the step. Messages and bytes (sent to other ranks,
counted by ``sharding.comm``) go to the innermost phase open when they are sent.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

_enabled = False
_times: dict[str, float] = {}
_calls: dict[str, int] = {}
_bytes: dict[str, int] = {}
_messages: dict[str, int] = {}
_local = threading.local()  # .stack: [[name, start, time spent in nested phases]], per thread


def _stack() -> list[list[Any]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def enable(on: bool = True) -> None:
    """Start (or stop) recording, from zero."""
    global _enabled
    _enabled = on
    reset()


def enabled() -> bool:
    return _enabled


def reset() -> None:
    for d in (_times, _calls, _bytes, _messages):
        d.clear()


class _Off:
    """The ``phase`` of a disabled profile: nothing to do (no generator built on the hot path)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """Record the time spent in this block (minus nested phases) under ``name``."""
    return _OFF if not _enabled else _recorded(name)


@contextlib.contextmanager
def _recorded(name: str) -> Iterator[None]:
    stack = _stack()
    frame: list[Any] = [name, time.perf_counter(), 0.0]
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()
        elapsed = time.perf_counter() - frame[1]
        _times[name] = _times.get(name, 0.0) + elapsed - frame[2]
        _calls[name] = _calls.get(name, 0) + 1
        if stack:
            stack[-1][2] += elapsed


def count_message(nbytes: int) -> None:
    """One message to the other ranks carrying ``nbytes`` (the payload this rank sent them)."""
    if not _enabled:
        return
    stack = _stack()
    name = stack[-1][0] if stack else "(outside any phase)"
    _messages[name] = _messages.get(name, 0) + 1
    _bytes[name] = _bytes.get(name, 0) + int(nbytes)


def snapshot(steps: int = 1) -> dict[str, dict[str, float]]:
    """``{phase: {"ms", "calls", "bytes", "messages"}}`` per step (totals divided by ``steps``)."""
    names = list(dict.fromkeys([*_times, *_messages]))
    return {
        n: {
            "ms": round(_times.get(n, 0.0) * 1e3 / steps, 3),
            "calls": round(_calls.get(n, 0) / steps, 2),
            "bytes": round(_bytes.get(n, 0) / steps),
            "messages": round(_messages.get(n, 0) / steps, 2),
        }
        for n in names
    }
