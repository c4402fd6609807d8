"""The finiteness guard's inputs and errors.

Before a fused update the engine asks ``finite_guard.update_is_finite`` whether the update provably writes
only finite values, from bounds on the values it reads: the largest |value| and the smallest value of the
weights and of each slot. Those bounds are measured in the step that writes, over exactly the rows the
update touches (``native.Workspace.touched_bounds`` in C; ``rows_bounds`` on the torch and GPU paths), never
carried from an earlier step: a write the engine cannot see (an in-place torch edit, ``tensor.data``, a NumPy
view, ``load_state_dict``, ``restore``) changes the values and their bounds together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedFeature, ResolvedTable
from embtables.errors import InputError


def rows_bounds(tensors: Sequence[Tensor], rows: Tensor | None) -> tuple[list[float], list[float]]:
    """Per tensor of ``tensors`` ([V, D] each: weights, *slots), the largest |value| (inf when any value is
    not finite) and the smallest value over rows ``rows`` [U] (None: every row). One host synchronisation."""
    return read_bounds(bounds_tensor(tensors, rows))


def bounds_tensor(tensors: Sequence[Tensor], rows: Tensor | None) -> Tensor:
    """``rows_bounds`` as a [len(tensors), 2] float32 tensor on the tensors' device, not read (no sync):
    several tables' bounds are read together (``read_bounds`` of their ``torch.cat``)."""
    stats = []
    for t in tensors:
        part = t if rows is None else t.index_select(0, rows)
        if part.numel() == 0:
            stats.append(torch.zeros(2, dtype=torch.float32, device=t.device))
            continue
        mn, mx = torch.aminmax(part)
        finite = torch.isfinite(part).all()
        big = torch.where(finite, torch.maximum(mx.abs(), mn.abs()), torch.full_like(mx, float("inf")))
        stats.append(torch.stack((big, mn)).to(torch.float32))  # a half-precision table's bounds as float32
    return torch.stack(stats) if stats else torch.zeros((0, 2), dtype=torch.float32)


def read_bounds(stats: Tensor) -> tuple[list[float], list[float]]:
    """(largest |value| per tensor, smallest value per tensor) of a ``bounds_tensor``: one host sync."""
    values = stats.tolist()
    return [v[0] for v in values], [v[1] for v in values]


class NonFiniteUpdateError(InputError):
    """An update refused because it would write a non-finite value: its ``table``, the ``row`` as the storage that
    refused it numbers it (an offloaded table's cache slot, a shard's local row, until a caller that knows the
    table's numbering renames it: ``renamed``), and the learning rate ``lr``. Built from a message alone (as
    ``type(error)(message)`` re-raises it) it has no table, and is never renamed."""

    def __init__(self, message: str, table: ResolvedTable | None = None, row: int = -1, lr: float = 0.0) -> None:
        super().__init__(message)
        self.table, self.row, self.lr = table, row, lr

    def renamed(self, row: int, where: str = "") -> NonFiniteUpdateError:
        """The same refusal naming ``row`` (the table's own number for the refused one), after ``where``."""
        assert self.table is not None
        return non_finite_update(self.table, row, self.lr, where)

    def __reduce__(self) -> tuple[Any, ...]:
        return (NonFiniteUpdateError, (str(self), self.table, self.row, self.lr))


def non_finite_update(table: ResolvedTable, row: int, lr: float, where: str = "") -> NonFiniteUpdateError:
    """The refusal of an update of ``table`` that would write a non-finite value into (storage) ``row``; ``where``
    prefixes the message (a rank)."""
    slots = ", ".join(table.optimizer.slot_names) or "no slots"
    kinds = {table.config.storage, table.config.slot_storage if table.optimizer.slot_names else "float32"}
    overflow = " or ".join(f"{k} overflow{' (|value| > 65504)' if k == 'float16' else ''}" for k in sorted(kinds))
    message = (
        f"{where}table {table.name!r}: the update of row {row} would write a non-finite value (NaN or Inf) into the "
        f"weights or slots ({slots}) at learning rate {lr:g}: {overflow}; no table or slot was changed. "
        "Lower the learning rate, clip the gradients (clipvalue=...) or check the table's values."
    )
    return NonFiniteUpdateError(message, table, row, lr)


def check_finite_rows(table: ResolvedTable, rows: Tensor, values: tuple[Tensor, ...], lr: float) -> None:
    """Raise ``non_finite_update`` when any of ``values`` ([U, D] each, row i is table row ``rows[i]``) is
    not finite."""
    ok = torch.ones(rows.shape, dtype=torch.bool, device=rows.device)
    for v in values:
        ok &= torch.isfinite(v).all(dim=1)
    if not bool(ok.all()):
        raise non_finite_update(table, int(rows[~ok][0]), lr)


def non_finite_activations(feature: ResolvedFeature, table: ResolvedTable) -> InputError:
    return InputError(
        f"feature {feature.name!r} (table {table.name!r}): the looked-up activations overflow float32 (a sum of "
        "large rows or weights is not finite); no table or slot was changed. Check the weights of this feature "
        "and the table's values."
    )


def non_finite_gradient(table: ResolvedTable) -> InputError:
    return InputError(
        f"table {table.name!r}: the gradient reaching the table has NaN or Inf values; no table or slot was "
        "changed. Check the loss for overflow or lower the learning rate of the dense model."
    )
