"""``TableSet``: what every backend reads about the tables of one collection, built once.

A backend (``tables/backends/``) never sees the collection that drives it: it gets the resolved config,
the live table states (a device move replaces their tensors in place, so the set stays current), the
columns of the concatenated activations, the bounds of the values an update reads, and the one check of
looked-up activations that names the feature at fault.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.errors import InputError
from embtables.kernels import native
from embtables.kernels.affine_rows import AffineRows, GlobalRows
from embtables.tables.changed_rows import ChangedRows
from embtables.tables.concatenated import column_starts
from embtables.tables.state import TableState
from embtables.tables.value_bounds import non_finite_activations, rows_bounds


class TableSet:
    """The tables of ``resolved`` held in ``states`` (``{table name: TableState}``, shared with the caller)."""

    def __init__(
        self, resolved: ResolvedConfig, states: dict[str, TableState], changed: ChangedRows | None = None
    ) -> None:
        self.resolved = resolved
        self.states = states
        self.changed = changed  # the rows written since the last save (the GPU's write kernel marks them)
        self.tables = resolved.tables
        self.features = resolved.features
        # column_starts of the config: where each feature's D columns start in the concatenated [B, W]
        self.starts, self.width = column_starts(resolved)
        # half-precision tables (spec §12): the step an update is written at, and each sharded table's global
        # row id of every local row (absent: local rows are global)
        self.step = 0
        self.global_rows: dict[str, GlobalRows] = {}
        self.half = any(t.config.half for t in resolved.tables)
        # what each table's tensors must stay: per table its state, then (dtype, shape) of its weights and slots
        self._kept = [
            (table, states[table.name], [(t.dtype, t.shape) for t in states[table.name].tensors().values()])
            for table in self.tables
        ]

    def check_storage(self) -> None:
        """Raise ``InputError`` naming the first table whose weights or a slot is no longer a tensor of the dtype
        and shape it was made with (``.data`` assigned another tensor; torch refuses another device there): the
        kernels would misread it. Nothing is read or written before this check, so nothing changes."""
        for table, state, kept in self._kept:
            weights = state.weights
            dtype, shape = kept[0]
            if weights.dtype is not dtype or weights.shape != shape:
                self._replaced(table, "weights", weights, dtype, shape)
            for (dtype, shape), (name, slot) in zip(kept[1:], state.slots.items()):
                if slot.dtype is not dtype or slot.shape != shape:
                    self._replaced(table, f"slot {name!r}", slot, dtype, shape)

    @staticmethod
    def _replaced(table: ResolvedTable, what: str, t: Tensor, dtype: torch.dtype, shape: torch.Size) -> None:
        raise InputError(
            f"table {table.name!r}: its {what} are now a {str(t.dtype).removeprefix('torch.')} {list(t.shape)} "
            f"tensor (replaced through .data, or resized); they must stay {str(dtype).removeprefix('torch.')} "
            f"{list(shape)}. Write values into the tensor instead (tensor.data.copy_(values), or "
            "load_state_dict). Nothing was changed by this call."
        )

    def global_ids(self, table: ResolvedTable, rows: Tensor) -> Tensor:
        """The global row ids [U] of local ``rows`` [U] of ``table``."""
        mapping = self.global_rows.get(table.name)
        if isinstance(mapping, AffineRows):
            return mapping.ids(rows)
        return rows if mapping is None else mapping.to(rows.device)[rows]

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def weights(self) -> Tensor:
        """The first table's weights (what decides the device and the backend)."""
        return next(iter(self.states.values())).weights

    def table_of(self, feature_index: int) -> ResolvedTable:
        return self.tables[self.features[feature_index].table_index]

    def bounds(self, table: ResolvedTable, rows: Tensor | None) -> tuple[list[float], list[float]]:
        """``rows_bounds`` of the table's weights and slots over ``rows`` [U] (None: every row)."""
        state = self.states[table.name]
        return rows_bounds((state.weights, *state.slot_tuple()), rows)

    def check_finite(self, activations: Sequence[Tensor], checked: set[int] | None = None) -> None:
        """Raise naming the first feature whose activations are not all finite (skipping those ``checked``)."""
        if not checked and native.all_finite(list(activations)):  # one pass; the scan below names the culprit
            return
        for i, acts in enumerate(activations):
            if checked is not None and i in checked:
                continue
            if not bool(torch.isfinite(acts).all()):
                raise non_finite_activations(self.features[i], self.table_of(i))
