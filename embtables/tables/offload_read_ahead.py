"""``ReadAhead``: a staged batch's missing rows read from an offloaded table's files in the background, while the
step before it computes (docs/offload.md, "Reading ahead").

``OffloadedRows.prefetch`` starts it with the rows that are not cached; the batch's admission takes the values
of the rows it still misses instead of reading them, after waiting for what the disk has not delivered yet (the
disk wait). The values are those of the files when they were read, so they are used only when nothing could
have written those rows since: the cache counts its admissions and other writes to the files (``epoch``), and a
read-ahead started at another epoch is dropped.

Shapes: K rows read ahead, M rows an admission misses, D the width.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch
from torch import Tensor

Reader = Callable[[str, Tensor, Tensor], None]  # (part, rows [K] ascending, values [K, D]) -> read into values


class ReadAhead:
    """At most one read-ahead of one table shard at a time, on one background thread."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._rows: Tensor | None = None
        self._values: dict[str, Tensor] = {}
        self._done: concurrent.futures.Future[None] | None = None
        self._epoch = -1

    def start(self, rows: Tensor, shapes: dict[str, tuple[int, torch.dtype]], read: Reader, epoch: int) -> None:
        """Read ``rows`` [K] (ascending) of every part (``shapes``: part -> (D, dtype)) with ``read``, in the
        background; ``epoch``: the cache's, now. A read-ahead still running is waited for and dropped first."""
        self.drop()
        if rows.numel() == 0:
            return
        values = {part: torch.empty((rows.numel(), dim), dtype=dtype) for part, (dim, dtype) in shapes.items()}

        def run() -> None:
            for part, buffer in values.items():
                read(part, rows, buffer)

        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embtables-read-ahead")
        self._rows, self._values, self._epoch = rows, values, epoch
        self._done = self._pool.submit(run)

    def take(self, missing: Tensor, epoch: int) -> tuple[Tensor, dict[str, Tensor]] | None:
        """For ``missing`` [M] (ascending) at the cache's ``epoch``: (which of them were read ahead [M] bool,
        {part: their values [H, D]}), after waiting for the read; None when there is nothing usable (no
        read-ahead, another epoch, or its read failed: the admission reads them and reports any error). The
        read-ahead is used once."""
        rows, values, done, started = self._rows, self._values, self._done, self._epoch
        self._rows, self._values, self._done = None, {}, None
        if rows is None or done is None:
            return None
        try:
            done.result()
        except OSError:
            return None
        if started != epoch:
            return None
        at = torch.searchsorted(rows, missing).clamp(max=rows.numel() - 1)
        found = rows[at] == missing
        return found, {part: v[at[found]] for part, v in values.items()}

    def drop(self) -> None:
        """Wait for a read-ahead still running and forget it."""
        done = self._done
        self._rows, self._values, self._done = None, {}, None
        if done is not None:
            concurrent.futures.wait([done])

    def close(self) -> None:
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["ReadAhead"]
