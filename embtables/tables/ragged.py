"""``Ragged``: a batch of variable-length id lists, like ``tf.RaggedTensor`` of rank 2."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class Ragged:
    """B rows of variable length: ``values`` [N] and ``row_splits`` [B+1] (row b is
    ``values[row_splits[b]:row_splits[b+1]]``), as ``tf.RaggedTensor.from_row_splits``.

    Validation happens when the batch is enqueued, where errors can name the feature.
    """

    values: Tensor
    row_splits: Tensor

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int | float]], dtype: torch.dtype = torch.int64) -> Ragged:
        """``Ragged.from_lists([[1, 2], [], [3]])``."""
        lengths = [len(r) for r in rows]
        flat = [v for r in rows for v in r]
        if not dtype.is_floating_point:
            for v in flat:
                if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                    raise TypeError(
                        f"Ragged.from_lists: ids must be integers, got {v!r} ({type(v).__name__}); a float id would be "
                        "truncated silently. Convert the ids to int first, or pass dtype=torch.float32 for weights."
                    )
        values = torch.tensor(flat, dtype=dtype)
        return cls.from_lengths(values, torch.tensor(lengths, dtype=torch.int64))

    @classmethod
    def from_lengths(cls, values: Tensor, lengths: Tensor) -> Ragged:
        """Rows of ``lengths`` [B] over ``values`` [N]."""
        splits = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths.to(torch.int64), 0, out=splits[1:])
        return cls(values, splits)

    @property
    def nrows(self) -> int:
        return int(self.row_splits.numel()) - 1

    def lengths(self) -> Tensor:
        return self.row_splits[1:] - self.row_splits[:-1]

    def to(self, device: torch.device | str) -> Ragged:
        return Ragged(self.values.to(device), self.row_splits.to(device))
