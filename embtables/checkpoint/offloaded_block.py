"""An offloaded table's rows as one block of a checkpoint's file, in their storage type (docs/offload.md): read from the
table's files a piece at a time with ``pread`` (rows never read: their initial values, computed, not written),
so a save streams file to file in the memory of one piece, whatever the table's size."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from embtables.tables.offload_cache import OffloadedRows


class OffloadedBlock:
    """Rows [0, ``rows``) of ``part`` ("" or a slot name) of an offloaded table shard, as the block writer
    reads an array (``shape``, ``size``, ``itemsize``, ``dtype``, ``ndim``) and ``write``s it."""

    def __init__(self, source: OffloadedRows, part: str, rows: int) -> None:
        self.source, self.part = source, part
        self.shape = (rows, source.dim)
        self.size = rows * source.dim
        stored = source.tensors[part].dtype
        self.stored = str(stored).removeprefix("torch.")  # float32, bfloat16 or float16
        self.itemsize = stored.itemsize
        self.dtype = np.dtype(np.float32)  # a state block (its values are float32 when read)
        self.ndim = 2

    def write(self, f: Any, chunk_bytes: int, progress: Callable[[int], None]) -> int:
        """Write the rows in pieces of about ``chunk_bytes``; returns their CRC-32."""
        crc = zlib.crc32(b"")
        step = max(1, chunk_bytes // (self.itemsize * self.source.dim))
        for lo in range(0, self.shape[0], step):
            rows = self.source.read_rows(self.part, lo, min(self.shape[0], lo + step))
            piece = (rows.view(torch.int16) if self.itemsize == 2 else rows).numpy()
            data = np.ascontiguousarray(piece).data.cast("B")
            f.write(data)
            crc = zlib.crc32(data, crc)
            progress(len(data))
        return crc
