"""``ReadAhead``: a staged batch's missing rows read from an offloaded table's files in the background, while the
step before it computes (docs/offload.md, "Reading ahead").

``OffloadedRows.prefetch`` starts it with the rows that are not cached; the batch's admission takes the values
of the rows it still misses instead of reading them, after waiting for what the disk has not delivered yet (the
disk wait). The values are those of the files when they were read, so they are used only when nothing could
have written those rows since: the cache counts its admissions and other writes to the files (``epoch``), and a
read-ahead started at another epoch is dropped.

Shapes: K rows read ahead, M rows an admission misses, R the bytes of a row's record.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch
from torch import Tensor

Reader = Callable[[Tensor, Tensor], None]  # (rows [K] ascending, records [K, R]) -> read into records


class ReadAhead:
    """At most one read-ahead of one table shard at a time, on one background thread."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._rows: Tensor | None = None
        self._records: Tensor | None = None
        self._done: concurrent.futures.Future[None] | None = None
        self._epoch = -1

    def start(self, rows: Tensor, empty: Callable[[int], Tensor], read: Reader, epoch: int) -> None:
        """Read the records of ``rows`` [K] (ascending) into ``empty(K)`` with ``read``, in the background;
        ``epoch``: the cache's, now. A read-ahead still running is waited for and dropped first."""
        self.drop()
        if rows.numel() == 0:
            return
        records = empty(int(rows.numel()))
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embtables-read-ahead")
        self._rows, self._records, self._epoch = rows, records, epoch
        self._done = self._pool.submit(read, rows, records)

    def take(self, missing: Tensor, epoch: int) -> tuple[Tensor, Tensor] | None:
        """For ``missing`` [M] (ascending) at the cache's ``epoch``: (which of them were read ahead [M] bool,
        their records [H, R]), after waiting for the read; None when there is nothing usable (no read-ahead,
        another epoch, or its read failed: the admission reads them and reports any error). The read-ahead is
        used once."""
        rows, records, done, started = self._rows, self._records, self._done, self._epoch
        self._rows, self._records, self._done = None, None, None
        if rows is None or records is None or done is None:
            return None
        try:
            done.result()
        except OSError:
            return None
        if started != epoch:
            return None
        at = torch.searchsorted(rows, missing).clamp(max=rows.numel() - 1)
        found = rows[at] == missing
        return found, records[at[found]]

    def drop(self) -> None:
        """Wait for a read-ahead still running and forget it."""
        done = self._done
        self._rows, self._records, self._done = None, None, None
        if done is not None:
            concurrent.futures.wait([done])

    def close(self) -> None:
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["ReadAhead"]
