"""``AffineRows``: the global row ids of a shard's local rows as three numbers, not one id a row.

A sharded table's rows are a div block, a mod stride or a whole table: local row i holds global row
``first + stride * i``. A half-precision table rounds each row's update with its global id (spec §12.1); held as
an int64 tensor [V_local], those ids cost 8 bytes a row (800 MB for 100M rows), as much as a bfloat16 row of 4
columns. The native kernels take the pair ``packed`` = [first, stride] with the length -1 (``csrc/half_tables.c``).

Shapes: U local rows asked for, V the shard's local rows.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class AffineRows:
    """Local row i of a shard of ``count`` rows is global row ``first + stride * i``."""

    first: int
    stride: int
    count: int

    def __post_init__(self) -> None:
        if self.first < 0 or self.stride < 1 or self.count < 0:
            raise ValueError(f"AffineRows: need first >= 0, stride >= 1, count >= 0, got {self}")

    def ids(self, rows: Tensor) -> Tensor:
        """The global ids [U] of local ``rows`` [U] (int64, on their device)."""
        return rows.to(torch.int64) * self.stride + self.first

    def tensor(self, device: torch.device | str | None = None) -> Tensor:
        """Every local row's global id [V] int64: what a kernel without the pair needs (the GPU's)."""
        return torch.arange(self.count, dtype=torch.int64, device=device) * self.stride + self.first

    @functools.cached_property
    def packed(self) -> Tensor:
        """[first, stride] int64 on the CPU, for the native kernels (passed with the length -1)."""
        return torch.tensor([self.first, self.stride], dtype=torch.int64)


GlobalRows = Tensor | AffineRows  # one id a local row (a dynamic table's keys), or the pair

__all__ = ["AffineRows", "GlobalRows"]
