"""The finiteness guard's bookkeeping: bounds on every table's values, and its errors.

Before a fused update the engine asks ``proven`` for bounds on every value the update writes
(``kernels/finite_guard.py`` computes them from the table's current bounds); an update that is proven
finite is written without a second pass, and the bounds it wrote are folded in. The bounds per tensor
(weights, *slots) are measured in one pass when unknown or stale (a tensor replaced or written outside
the fused update moves torch's version counter) and carried from update to update otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.errors import InputError
from embtables.kernels.finite_guard import update_bounds
from embtables.kernels.registry import record_of
from embtables.tables.state import TableState


@dataclasses.dataclass(eq=False)
class TableBounds:
    """Per tensor (weights, *slots): an upper bound on max |value| and a lower bound on min value,
    valid while ``stamp`` (data pointer and version of each tensor) is unchanged."""

    hi: list[float]
    lo: list[float]
    stamp: tuple[tuple[int, int], ...]
    measured: bool  # False once a proven (analytic, looser) bound was folded in


def _stamp(tensors: Sequence[Tensor]) -> tuple[tuple[int, int], ...]:
    return tuple((t.data_ptr(), t._version) for t in tensors)


class ValueBounds:
    """Per table: an upper bound on max |value| and a lower bound on min value of (weights, *slots)."""

    def __init__(self, states: dict[str, TableState]) -> None:
        self.states = states
        self._bounds: dict[str, TableBounds] = {}
        self._keeps_min: dict[str, set[int]] = {}  # per table: indices of (weights, *slots) that never decrease

    def forget(self, table_name: str) -> None:
        """The table was written outside the guard: measure it again before its next guarded update."""
        self._bounds.pop(table_name, None)

    def measured(self, table: ResolvedTable) -> tuple[list[float], list[float]]:
        """Bounds on max |value| and min value of each of the table's (weights, *slots), measured now unless
        known for these tensors (the same objects at the same versions)."""
        bounds = self._measured(table)
        return list(bounds.hi), list(bounds.lo)

    def forget_tables(self, names: Sequence[str]) -> None:
        """``forget`` every table of ``names``."""
        if self._bounds:
            for name in names:
                self._bounds.pop(name, None)

    def proven(self, table: ResolvedTable, lr: float, decay: float, gmax: float) -> tuple[float, ...] | None:
        """Bounds on every value this update writes, or None when it is not proven finite. Carried
        (analytic) bounds only grow, so before giving up they are measured again once."""
        opt = table.optimizer
        bounds = self._measured(table)
        new = update_bounds(opt, lr, decay, gmax, bounds.hi, bounds.lo)
        if new is None and not bounds.measured:
            bounds = self._measured(table, rescan=True)
            new = update_bounds(opt, lr, decay, gmax, bounds.hi, bounds.lo)
        return new

    def _measured(self, table: ResolvedTable, *, rescan: bool = False) -> TableBounds:
        """Bounds on the table's values: max |value| and min value per tensor (weights, *slots).

        Measured (one pass over the table) when unknown, when asked, or when any tensor was replaced or
        written in place outside the fused update (torch's version counter moved); kept up to date by
        every update."""
        state = self.states[table.name]
        tensors = (state.weights, *state.slot_tuple())
        stamp = _stamp(tensors)
        bounds = self._bounds.get(table.name)
        if bounds is None or bounds.stamp != stamp or rescan:
            hi, lo = [], []
            for t in tensors:
                if t.numel() == 0:
                    hi.append(0.0)
                    lo.append(0.0)
                    continue
                mn, mx = (float(v) for v in torch.aminmax(t))
                hi.append(max(abs(mn), abs(mx)))
                lo.append(mn)
            bounds = self._bounds[table.name] = TableBounds(hi, lo, stamp, measured=True)
        return bounds

    def after_write(self, table: ResolvedTable, maxabs: tuple[float, ...], *, measured: bool) -> None:
        """Fold bounds on the values an update wrote (``measured``: the largest |values| it really
        wrote; else the proven bounds) into the table's bounds."""
        bounds = self._bounds.get(table.name)
        if bounds is None:
            return
        state = self.states[table.name]
        bounds.hi = [max(h, m) for h, m in zip(bounds.hi, maxabs)]
        bounds.measured = bounds.measured and measured
        keeps_min = self._keeps_min.get(table.name)
        if keeps_min is None:
            # Monotone slots (Adagrad's, FTRL's, ProximalAdagrad's accumulators) never decrease; every other
            # slot may move towards 0. Index 0 is the weights.
            monotone = record_of(table.optimizer).monotone_slots
            keeps_min = {1 + i for i, s in enumerate(table.optimizer.slot_names) if s in monotone}
            self._keeps_min[table.name] = keeps_min
        bounds.lo = [v if i in keeps_min else min(v, 0.0) for i, v in enumerate(bounds.lo)]
        bounds.stamp = _stamp((state.weights, *state.slot_tuple()))

    def after_reset(self, table_name: str, written: Sequence[Tensor]) -> None:
        """Rows of a table were set to the values ``written`` (weights, *slots blocks; a dynamic table's
        reused rows): fold their max |value| and min value in, so the table needs no rescan."""
        bounds = self._bounds.get(table_name)
        if bounds is None:
            return
        for i, t in enumerate(written):
            if t.numel():
                mn, mx = (float(v) for v in torch.aminmax(t))
                bounds.hi[i] = max(bounds.hi[i], abs(mn), abs(mx))
                bounds.lo[i] = min(bounds.lo[i], mn)
        state = self.states[table_name]
        bounds.stamp = _stamp((state.weights, *state.slot_tuple()))

    def note_values_kept(self, table_name: str) -> None:
        """Tell the guard that in-place writes to a table put back values it held before (e.g. a
        pipelining snapshot swapped in and out), so its bounds still hold and need no rescan."""
        bounds = self._bounds.get(table_name)
        if bounds is not None:
            state = self.states[table_name]
            bounds.stamp = _stamp((state.weights, *state.slot_tuple()))


def non_finite_update(table: ResolvedTable, row: int, lr: float) -> InputError:
    slots = ", ".join(table.optimizer.slot_names) or "no slots"
    return InputError(
        f"table {table.name!r}: the update of row {row} would write a non-finite value (NaN or Inf) into the "
        f"weights or slots ({slots}) at learning rate {lr:g}: float32 overflow; no table or slot was changed. "
        "Lower the learning rate, clip the gradients (clipvalue=...) or check the table's values."
    )


def check_finite_rows(table: ResolvedTable, rows: Tensor, values: tuple[Tensor, ...], lr: float) -> None:
    """Raise ``non_finite_update`` when any of ``values`` ([U, D] each, row i is table row ``rows[i]``) is
    not finite."""
    ok = torch.ones(rows.shape, dtype=torch.bool, device=rows.device)
    for v in values:
        ok &= torch.isfinite(v).all(dim=1)
    if not bool(ok.all()):
        raise non_finite_update(table, int(rows[~ok][0]), lr)


def non_finite_gradient(table: ResolvedTable) -> InputError:
    return InputError(
        f"table {table.name!r}: the gradient reaching the table has NaN or Inf values; no table or slot was "
        "changed. Check the loss for overflow or lower the learning rate of the dense model."
    )
