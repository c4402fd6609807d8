"""``ChangedRows``: which rows of each table the engine's writes changed since the last save (the base of
incremental checkpoints and serving deltas): one byte a row on the tables' device; for an offloaded table, one
flag a cache slot (written since it was read: what the cache writes back) and one bit a row in the cache
(``OffloadedRows.changed``: its bookkeeping must not grow with its vocabulary by more than that).

Marked by every write of a table's rows: a step's update (every row of a non-lazy optimizer's table), an
update applied occurrence by occurrence, a dynamic table's rows given to new keys, a load of a state dict
(every row). A refused step writes nothing and marks nothing. Cleared by a save and a restore. Writes made
outside the engine (into a tensor it handed out) are not seen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from embtables.tables.offload_cache import OffloadedRows
from embtables.tables.state import TableState


class ChangedRows:
    """Per table of ``states`` (V rows each): a bool [V] by row; for the tables in ``offloaded`` the cache's
    bool [C] by slot (``OffloadedRows.dirty``, the same tensor), the rows themselves in the cache."""

    def __init__(self, states: dict[str, TableState], offloaded: Mapping[str, OffloadedRows] | None = None) -> None:
        self.offloaded = dict(offloaded or {})
        self.sizes = {name: int(s.weights.shape[0]) for name, s in states.items()}
        self.flags = {
            name: self.offloaded[name].dirty
            if name in self.offloaded
            else torch.zeros(v, dtype=torch.bool, device=states[name].weights.device)
            for name, v in self.sizes.items()
        }

    def mark(self, name: str, rows: Tensor) -> None:
        """Rows [R] (the ids the engine wrote: a cache's slots for an offloaded table; in range) of table
        ``name`` changed."""
        flags = self.flags[name]
        flags.index_fill_(0, rows.to(flags.device, torch.int64).reshape(-1), True)

    def mark_all(self, name: str | None = None) -> None:
        """Every row of table ``name`` (of every table: None) changed."""
        for n, flags in self.flags.items():
            if name is not None and n != name:
                continue
            cache = self.offloaded.get(n)
            if cache is None:
                flags.fill_(True)
            else:
                cache.mark_all_changed()

    def rows(self) -> dict[str, Tensor]:
        """The changed rows of every table (local ids [R], ascending, int64, on the tables' device)."""
        return {
            name: self.offloaded[name].changed_rows() if name in self.offloaded else torch.nonzero(flags).reshape(-1)
            for name, flags in self.flags.items()
        }

    def clear(self) -> None:
        for name, flags in self.flags.items():
            cache = self.offloaded.get(name)
            if cache is None:
                flags.zero_()
            else:
                cache.clear_changed()

    def map(self, fn: Callable[[Tensor], Tensor]) -> None:
        """The flags moved as the tables were (``EmbeddingCollection.map_tensors``); an offloaded table's stay on
        the CPU with its cache."""
        self.flags = {
            name: flags if name in self.offloaded else fn(flags).to(torch.bool) for name, flags in self.flags.items()
        }
