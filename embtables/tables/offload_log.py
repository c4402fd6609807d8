"""``WriteLog``: an offloaded table shard's written-back records appended to a log file, merged into the row file
later, a chunk of whole pages at a time (docs/offload.md, "The write log").

A record is smaller than a page. Written in place with ``pwrite``, a record whose page has left the page cache
makes the kernel read that page first: where the disk is the limit, every write-back would cost a random read
beside the row read it makes room for. Appended to the log instead, a batch of write-backs is one sequential
write. Each append is a *run*: its rows ascending, at log slots [first, first + K). The index (every row in the
log, ascending, with the slot of its latest record) tells a read where a row's values are.

When an append would overflow the log's ``capacity`` records, the log is *merged*: the row file's chunks (whole
pages, ``lcm(R, 4096)`` bytes: a record never straddles one) that hold a logged row are read, the runs' records
written over them in run order (a later run's record of a row wins), and the chunks written back whole (no
page is read by the kernel before a write: each is written in full), a piece of rows at a time, then synced;
the log is empty after it. Its memory is the index and the runs' rows (12 bytes a record of a shard of up to
2**31 rows, at most ``capacity`` records; 24 beyond) and one piece.

Shapes: K rows of a batch, L logged rows, R the bytes of a record.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from embtables.tables.offload_residency import find_sorted, index_dtype, merge_sorted

RowIO = Callable[[int, int, Tensor, int, Tensor, bool], None]  # (fd, size, buffer, row bytes, rows, write)

_PAGE = 4096
_MAX_CHUNK = 64 << 10  # a chunk is whole pages up to this size, else a record (the kernel reads its edges)
_PIECE_BYTES = 64 << 20  # the chunks a merge holds in memory at once


def chunk_bytes(record_bytes: int) -> int:
    """The bytes of the row file's unit of a merge: the least multiple of both a record and a page, when at
    most 64 KiB, else one record."""
    whole = math.lcm(record_bytes, _PAGE)
    return whole if whole <= _MAX_CHUNK else record_bytes


class WriteLog:
    """The log of one table shard (see the module docstring): ``fd`` open for reading and writing, ``capacity``
    records of ``record_bytes`` for a row file of ``rows`` rows; ``io`` reads or writes rows of a file by index
    (``et_offload_rows``). Rows and slots come in and go out as int64; they are kept narrower
    (``index_dtype``)."""

    def __init__(self, fd: int, capacity: int, record_bytes: int, rows: int, io: RowIO) -> None:
        self.fd, self.capacity, self.record_bytes, self._io = fd, capacity, record_bytes, io
        self._row_dtype, self._slot_dtype = index_dtype(rows), index_dtype(capacity)
        self.head = 0  # records appended since the last merge (the log's used slots [0, head))
        self.merges = 0  # merges done
        self.runs: list[tuple[Tensor, int]] = []  # (rows [K] ascending, first slot), oldest first
        # (rows [L] ascending, slot [L] of each one's latest record): replaced whole, never changed in place
        self.index: tuple[Tensor, Tensor] = self._empty()

    def _empty(self) -> tuple[Tensor, Tensor]:
        return torch.zeros(0, dtype=self._row_dtype), torch.zeros(0, dtype=self._slot_dtype)

    def __len__(self) -> int:
        return int(self.index[0].numel())

    def find(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(whether each of ``rows`` [K] is in the log [K] bool, the log slot of each one that is [H])."""
        logged, slots = self.index
        at, found = find_sorted(logged, rows)
        return found, slots[at[found]].to(torch.int64)

    def fits(self, k: int) -> bool:
        """Whether ``k`` more records fit before a merge."""
        return self.head + k <= self.capacity

    def append(self, rows: Tensor, records: Tensor) -> None:
        """Append the records [K, R] of ``rows`` [K] (ascending, distinct; ``fits(K)``) as one run: one sequential
        write (an ``OSError`` leaves the log as it was), then the index."""
        k = int(rows.numel())
        if k == 0:
            return
        first = self.head
        self._io(self.fd, self.capacity * self.record_bytes, records, self.record_bytes,
                 torch.arange(first, first + k, dtype=torch.int64), True)  # fmt: skip
        self.head += k
        rows = rows.to(self._row_dtype, copy=True)
        self.runs.append((rows, first))
        logged, slots = self.index
        given = torch.arange(first, first + k, dtype=self._slot_dtype)
        at, present = find_sorted(logged, rows)
        slots = slots.clone()  # the index is replaced whole: a reader holding the old one keeps it as it was
        slots[at[present]] = given[present]  # a logged row's newer record
        fresh = ~present
        logged, (slots,) = merge_sorted(logged, rows[fresh], [(slots, given[fresh])])
        self.index = (logged, slots)

    def merge(self, home_fd: int, home_size: int) -> None:
        """Write every logged row's latest record into the row file (``home_fd``, ``home_size`` bytes: a multiple
        of ``chunk_bytes``), a piece of chunks at a time, then sync it; the log is empty after it. An
        ``OSError`` leaves the log as it was (its rows still read from it)."""
        logged = self.index[0]
        if logged.numel() == 0:
            self.clear()
            return
        size = chunk_bytes(self.record_bytes)
        per_chunk = size // self.record_bytes
        chunks = torch.unique_consecutive(torch.div(logged.to(torch.int64), per_chunk, rounding_mode="floor"))
        most = max(1, _PIECE_BYTES // size)
        for start in range(0, int(chunks.numel()), most):
            piece = chunks[start : start + most]  # every logged row in [lo, hi) lies in one of these chunks
            lo, hi = int(piece[0]) * per_chunk, (int(piece[-1]) + 1) * per_chunk
            self._merge_piece(home_fd, home_size, piece, lo, hi, size)
        self.merges += 1
        self.clear()

    def _merge_piece(self, home_fd: int, home_size: int, chunks: Tensor, lo: int, hi: int, size: int) -> None:
        """Read ``chunks`` [P] (ascending) of the row file, write over them every run's records of rows in
        [lo, hi) (oldest run first), write them back."""
        per_chunk = size // self.record_bytes
        buffer = torch.empty((int(chunks.numel()), size), dtype=torch.uint8)
        self._io(home_fd, home_size, buffer, size, chunks, False)
        records = buffer.view(-1, self.record_bytes)
        for rows, first in self.runs:
            bounds = torch.searchsorted(rows, torch.tensor([lo, hi], dtype=rows.dtype))
            a, z = int(bounds[0]), int(bounds[1])
            if a == z:
                continue
            got = torch.empty((z - a, self.record_bytes), dtype=torch.uint8)
            self._io(self.fd, self.capacity * self.record_bytes, got, self.record_bytes,
                     torch.arange(first + a, first + z, dtype=torch.int64), False)  # fmt: skip
            mine = rows[a:z].to(torch.int64)
            at = torch.searchsorted(chunks, torch.div(mine, per_chunk, rounding_mode="floor")) * per_chunk
            records[at + mine % per_chunk] = got
        self._io(home_fd, home_size, buffer, size, chunks, True)

    def clear(self) -> None:
        """Forget every record (after a merge, or when every row is written anew: a restore)."""
        self.head = 0
        self.runs = []
        self.index = self._empty()


__all__ = ["WriteLog", "chunk_bytes"]
