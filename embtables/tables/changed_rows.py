"""``ChangedRows``: which rows of each table the engine's writes changed since the last save (the base of
incremental checkpoints and serving deltas): one byte a row, on the tables' device.

Marked by every write of a table's rows: a step's update (every row of a non-lazy optimizer's table), an
update applied occurrence by occurrence, a dynamic table's rows given to new keys, a load of a state dict
(every row). A refused step writes nothing and marks nothing. Cleared by a save and a restore. Writes made
outside the engine (into a tensor it handed out) are not seen.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from embtables.tables.state import TableState


class ChangedRows:
    """A bool [V] per table of ``states`` (local rows)."""

    def __init__(self, states: dict[str, TableState]) -> None:
        self.flags = {
            name: torch.zeros(s.weights.shape[0], dtype=torch.bool, device=s.weights.device)
            for name, s in states.items()
        }

    def mark(self, name: str, rows: Tensor) -> None:
        """Rows [R] (local ids, in range: they were just written) of table ``name`` changed."""
        flags = self.flags[name]
        flags.index_fill_(0, rows.to(flags.device, torch.int64).reshape(-1), True)

    def mark_all(self, name: str | None = None) -> None:
        """Every row of table ``name`` (of every table: None) changed."""
        for n, flags in self.flags.items():
            if name is None or n == name:
                flags.fill_(True)

    def rows(self) -> dict[str, Tensor]:
        """The changed rows of every table (local ids [R], ascending, int64, on the tables' device)."""
        return {name: torch.nonzero(flags).reshape(-1) for name, flags in self.flags.items()}

    def clear(self) -> None:
        for flags in self.flags.values():
            flags.zero_()

    def map(self, fn: Callable[[Tensor], Tensor]) -> None:
        """The flags moved as the tables were (``EmbeddingCollection.map_tensors``)."""
        self.flags = {name: fn(flags).to(torch.bool) for name, flags in self.flags.items()}
