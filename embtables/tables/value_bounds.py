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

import torch
from torch import Tensor

from embtables.config import ResolvedTable
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
        stats.append(torch.stack((big, mn)))
    return torch.stack(stats) if stats else torch.zeros((0, 2), dtype=torch.float32)


def bounds_of_many(groups: Sequence[tuple[Sequence[Tensor], Tensor | None]]) -> list[Tensor]:
    """``bounds_tensor`` of every group ``(tensors, rows)``, not read (no sync). The groups with rows (a lazy
    update's, a few rows of each table) are measured together: their rows gathered into one vector and
    reduced per tensor by segment, a few launches for all tables instead of about ten per tensor; a group
    without rows (every row of its tables) is measured in place, tensor by tensor, copying nothing."""
    out: list[Tensor | None] = [None] * len(groups)
    flat: list[Tensor] = []
    sizes: list[int] = []
    batched: list[tuple[int, int]] = []  # (group, how many tensors) measured together
    for g, (tensors, rows) in enumerate(groups):
        if rows is None:
            out[g] = bounds_tensor(tensors, None)
            continue
        for t in tensors:
            flat.append(t.index_select(0, rows).reshape(-1))
            sizes.append(int(rows.numel()) * (t.shape[1] if t.dim() > 1 else 1))
        batched.append((g, len(tensors)))
    if flat:
        device = flat[0].device
        values = torch.cat(flat)
        n = len(flat)
        seg = torch.repeat_interleave(
            torch.arange(n, device=device), torch.tensor(sizes, device=device), output_size=values.numel()
        )
        zeros = torch.zeros(n, dtype=torch.float32, device=device)
        big = zeros.scatter_reduce(0, seg, values.abs(), "amax", include_self=False)  # 0 for an empty part
        low = zeros.scatter_reduce(0, seg, values, "amin", include_self=False)
        bad = zeros.index_add(0, seg, (~torch.isfinite(values)).to(torch.float32)) > 0
        # a tensor with a value that is not finite proves nothing: inf and -inf (as aminmax's NaN would)
        big = torch.where(bad, torch.full_like(big, float("inf")), big)
        low = torch.where(bad, torch.full_like(low, float("-inf")), low)
        stats = torch.stack((big, low), dim=1)
        at = 0
        for g, k in batched:
            out[g] = stats[at : at + k]
            at += k
    return [o for o in out if o is not None]


def read_bounds(stats: Tensor) -> tuple[list[float], list[float]]:
    """(largest |value| per tensor, smallest value per tensor) of a ``bounds_tensor``: one host sync."""
    values = stats.tolist()
    return [v[0] for v in values], [v[1] for v in values]


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
