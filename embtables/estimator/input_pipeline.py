"""The Estimator's input pipeline: the next batches are pulled from ``input_fn``'s iterator and
converted (feature columns -> engine inputs, labels) on one background thread while the current step
trains, ``depth`` batches ahead, in order.

Results come back in the iterator's order with their errors in place: a batch that fails to convert
is reported at its own step, after every earlier step was applied, exactly as without prefetching;
an exception raised by the iterator itself is raised at the step that would have read it.

Both threads run Python and share the GIL: with CPython's default switch interval (5 ms) the training
thread, back from a torch or native call that released the GIL, may wait up to 5 ms for the converting
thread to hand it back. While a pipeline prefetches, the interval is at most ``SWITCH_INTERVAL_S``
(1 ms; restored on exit): the MovieLens job's folds take 10% less time (1.07-1.20 s -> 0.96-1.07 s).

Whether reading ahead pays depends on how much of the conversion releases the GIL: on a 2-core machine,
with batches converted several at a time (``batches.py``), the MovieLens model's Estimator step is slower
one ahead at batch 512 (+34-52% over a bare loop against +17-38% in place) and no faster at 4096 (+14-17%
against +8-12%). ``input_prefetch="auto"`` (the Estimator's default) times both on its first steps
(``Probe``, over as many calls as it takes) and keeps one ahead only when it is clearly faster.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
SWITCH_INTERVAL_S = 0.001
PROBE_STEPS = 32  # input_prefetch="auto": steps timed each way before choosing (16 misled it on a noisy VM)
AHEAD_GAIN = 0.9  # ... and one ahead is kept only when its median step is at most this x the in-place one


@dataclasses.dataclass
class Probe:
    """``input_prefetch="auto"``: steps timed in place, then one ahead (``steps`` each, over as many calls
    as it takes; the first step of a call and the first after a switch are not counted), then the way
    kept in ``chosen``: one ahead when its median step is at least 10% shorter (``AHEAD_GAIN``), else in
    place (32 steps of a noisy machine do not tell a few percent apart; in place is the simpler way)."""

    steps: int = PROBE_STEPS
    in_place: list[float] = dataclasses.field(default_factory=list)
    ahead: list[float] = dataclasses.field(default_factory=list)
    chosen: int | None = None

    def depth(self) -> int:
        if self.chosen is not None:
            return self.chosen
        return 0 if len(self.in_place) < self.steps else 1

    def record(self, depth: int, seconds: float) -> None:
        if self.chosen is not None:
            return
        (self.in_place if depth == 0 else self.ahead).append(seconds)
        if len(self.ahead) >= self.steps:
            self.chosen = 1 if statistics.median(self.ahead) <= AHEAD_GAIN * statistics.median(self.in_place) else 0


class Prefetched(Generic[T]):
    """``fetch()`` called ``depth`` calls ahead on one worker thread (``depth`` 0: called in place).

    ``next()`` returns what the next ``fetch()`` returned, or raises what it raised. ``fetch`` runs on
    the worker one call at a time, in order, so it may read a non-thread-safe iterator; ``depth`` may
    change between calls (``set_depth``): fetches already queued are returned first, in order.

    With a ``probe`` (``input_prefetch="auto"``) the depth is the probe's: each step is timed from one
    ``next()`` to the next (the consumer's step included) and recorded under the depth it ran with."""

    def __init__(self, fetch: Callable[[], T], depth: int, probe: Probe | None = None) -> None:
        self.fetch = fetch
        self.probe = probe
        self.depth = probe.depth() if probe is not None else depth
        self.pending: collections.deque[concurrent.futures.Future[T]] = collections.deque()
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._last: float | None = None  # when the previous next() began (None: not counted)

    def set_depth(self, depth: int) -> None:
        self.depth = depth

    def next(self) -> T:
        """The next result (``depth`` more fetches are then queued behind it)."""
        if self.probe is not None and self.probe.chosen is None:
            self._time_step()
        if self.pending:
            result = self.pending.popleft().result()
        elif self.depth == 0:
            return self.fetch()
        else:
            result = self._submit().result()
        while len(self.pending) < self.depth:
            self.pending.append(self._submit())
        return result

    def _submit(self) -> concurrent.futures.Future[T]:
        if self.worker is None:
            self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embtables-input")
        return self.worker.submit(self.fetch)

    def _time_step(self) -> None:
        assert self.probe is not None
        now = time.perf_counter()
        if self._last is not None:
            self.probe.record(self.depth, now - self._last)
        self._last = now
        depth = self.probe.depth()
        if depth != self.depth:
            self.set_depth(depth)
            self._last = None  # the first step after a switch warms the new way up: not counted

    def close(self) -> None:
        """Stop fetching ahead: fetches not started are cancelled, the one running is waited for."""
        for future in self.pending:
            future.cancel()
        self.pending.clear()
        if self.worker is not None:
            self.worker.shutdown(wait=True, cancel_futures=True)
            self.worker = None


@contextlib.contextmanager
def prefetched(fetch: Callable[[], T], depth: int, probe: Probe | None = None) -> Iterator[Prefetched[T]]:
    """A ``Prefetched`` that is closed on exit (also when the consumer stops early or raises)."""
    pipeline = Prefetched(fetch, depth, probe)
    before = sys.getswitchinterval()
    shorter = (depth > 0 or probe is not None) and before > SWITCH_INTERVAL_S
    if shorter:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield pipeline
    finally:
        pipeline.close()
        if shorter and sys.getswitchinterval() == SWITCH_INTERVAL_S:  # unless someone else changed it since
            sys.setswitchinterval(before)
