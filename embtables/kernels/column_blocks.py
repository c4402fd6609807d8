"""A gradient of F features side by side: the column blocks [B, D_f] of one tensor [B, W].

The gradient of concatenated activations (``concat_activations=True``) holds every feature's gradient as a
block of columns. One process's phase 1 reads each block in place, through the whole tensor's address
(``native_step.prepare``), so the F views are made only when something else asks for a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch
from torch import Tensor


class ColumnBlocks(Sequence[Tensor]):
    """F column blocks of ``whole`` [B, W]: block f is ``whole[:, starts[f] : starts[f] + dims[f]]`` [B, D_f].
    The blocks must tile the columns in order (``starts[f + 1] == starts[f] + dims[f]``, W their sum), as
    ``ConcatLayout`` lays them out; the views are cut on first use."""

    def __init__(self, whole: Tensor, starts: Sequence[int], dims: Sequence[int]) -> None:
        self.whole = whole
        self.starts = tuple(starts)
        self.dims = tuple(dims)
        self._views: list[Tensor] | None = None

    def blocks(self) -> list[Tensor]:
        """The F views [B, D_f]."""
        if self._views is None:
            self._views = list(torch.split_with_sizes(self.whole, list(self.dims), dim=1))
        return self._views

    def __len__(self) -> int:
        return len(self.dims)

    @overload
    def __getitem__(self, index: int) -> Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Tensor]: ...

    def __getitem__(self, index: int | slice) -> Tensor | Sequence[Tensor]:
        return self.blocks()[index]
