"""``ChangedRows``: which rows of each table the engine's writes changed since the last save (the base of
incremental checkpoints and serving deltas): one byte a row on the tables' device, or one bit a row (``packed``:
an offloaded table, whose bookkeeping must not grow with its vocabulary by more than that).

Marked by every write of a table's rows: a step's update (every row of a non-lazy optimizer's table), an
update applied occurrence by occurrence, a dynamic table's rows given to new keys, a load of a state dict
(every row). A refused step writes nothing and marks nothing. Cleared by a save and a restore. Writes made
outside the engine (into a tensor it handed out) are not seen.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import Tensor

from embtables.tables.state import TableState

_UNPACK_CHUNK = 1 << 20  # bytes of packed flags unpacked at a time by ``rows`` (8x that in rows)


class ChangedRows:
    """Per table of ``states`` (local rows, V each): a bool [V], or for the tables in ``packed`` a uint8
    [ceil(V / 8)] on the CPU whose bit ``r % 8`` (least significant first) of byte ``r // 8`` is row r's."""

    def __init__(self, states: dict[str, TableState], packed: Collection[str] = ()) -> None:
        self.sizes = {name: int(s.weights.shape[0]) for name, s in states.items()}
        self.packed = frozenset(packed)
        self.flags = {
            name: torch.zeros(-(-v // 8), dtype=torch.uint8)
            if name in self.packed
            else torch.zeros(v, dtype=torch.bool, device=states[name].weights.device)
            for name, v in self.sizes.items()
        }

    def mark(self, name: str, rows: Tensor) -> None:
        """Rows [R] (local ids, in range: they were just written) of table ``name`` changed."""
        flags = self.flags[name]
        rows = rows.to(flags.device, torch.int64).reshape(-1)
        if name not in self.packed:
            flags.index_fill_(0, rows, True)
            return
        rows = torch.unique(rows)  # distinct rows: one byte's bits then add up to their OR
        where, index = torch.unique(torch.div(rows, 8, rounding_mode="floor"), return_inverse=True)
        bits = torch.zeros(where.numel(), dtype=torch.int32).index_add_(0, index, 1 << (rows % 8).to(torch.int32))
        flags[where] = flags[where] | bits.to(torch.uint8)

    def mark_all(self, name: str | None = None) -> None:
        """Every row of table ``name`` (of every table: None) changed."""
        for n, flags in self.flags.items():
            if name is not None and n != name:
                continue
            if n not in self.packed:
                flags.fill_(True)
                continue
            flags.fill_(0xFF)
            tail = self.sizes[n] % 8
            if tail:  # bits past the last row stay clear
                flags[-1] = (1 << tail) - 1

    def rows(self) -> dict[str, Tensor]:
        """The changed rows of every table (local ids [R], ascending, int64, on the tables' device)."""
        out = {}
        for name, flags in self.flags.items():
            if name not in self.packed:
                out[name] = torch.nonzero(flags).reshape(-1)
                continue
            shifts = torch.arange(8, dtype=torch.uint8)
            parts = []
            for start in range(0, flags.numel(), _UNPACK_CHUNK):
                chunk = flags[start : start + _UNPACK_CHUNK]
                bits = (chunk[:, None] >> shifts[None, :]) & 1  # [n, 8]
                parts.append(torch.nonzero(bits.reshape(-1)).reshape(-1) + start * 8)
            out[name] = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        return out

    def clear(self) -> None:
        for flags in self.flags.values():
            flags.zero_()

    def map(self, fn: Callable[[Tensor], Tensor]) -> None:
        """The flags moved as the tables were (``EmbeddingCollection.map_tensors``); packed flags stay on the
        CPU with their (offloaded) tables."""
        self.flags = {
            name: flags if name in self.packed else fn(flags).to(torch.bool) for name, flags in self.flags.items()
        }
