"""``PackedBits``: one bit per row of a table, packed eight to a byte (an offloaded table's "changed since the
last save" rows, whose bookkeeping must not grow with its vocabulary by more than that: 12.5 MB per 100M rows).

Shapes: V rows, R rows marked or returned.
"""

from __future__ import annotations

import torch
from torch import Tensor

_UNPACK_CHUNK = 1 << 20  # bytes unpacked at a time by ``rows`` (8x that in rows)


class PackedBits:
    """V bits in a uint8 [ceil(V / 8)] on the CPU: bit ``r % 8`` (least significant first) of byte ``r // 8`` is
    row r's."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.bytes = torch.zeros(-(-size // 8), dtype=torch.uint8)

    def mark(self, rows: Tensor) -> None:
        """Set the bits of rows [R] (in [0, V))."""
        rows = torch.unique(rows.to("cpu", torch.int64).reshape(-1))  # distinct: one byte's bits add up to their OR
        if rows.numel() == 0:
            return
        where, index = torch.unique(torch.div(rows, 8, rounding_mode="floor"), return_inverse=True)
        bits = torch.zeros(where.numel(), dtype=torch.int32).index_add_(0, index, 1 << (rows % 8).to(torch.int32))
        self.bytes[where] = self.bytes[where] | bits.to(torch.uint8)

    def mark_all(self) -> None:
        """Set every bit (those past the last row stay clear)."""
        self.bytes.fill_(0xFF)
        tail = self.size % 8
        if tail:
            self.bytes[-1] = (1 << tail) - 1

    def clear(self) -> None:
        self.bytes.zero_()

    def rows(self) -> Tensor:
        """The rows whose bit is set [R], ascending int64."""
        shifts = torch.arange(8, dtype=torch.uint8)
        parts = []
        for start in range(0, self.bytes.numel(), _UNPACK_CHUNK):
            chunk = self.bytes[start : start + _UNPACK_CHUNK]
            bits = (chunk[:, None] >> shifts[None, :]) & 1  # [n, 8]
            parts.append(torch.nonzero(bits.reshape(-1)).reshape(-1) + start * 8)
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


__all__ = ["PackedBits"]
