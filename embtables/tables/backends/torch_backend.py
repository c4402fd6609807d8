"""``TorchBackend``: the reference arithmetic in torch operations, for every table, input and device.

It serves every call whole; the other backends hand it what they leave (``interface.py``). Besides the
fused update of the distinct rows, two updates are not one pass over them: a non-lazy (dense) update of
every row, in chunks, and a no-accumulation update occurrence by occurrence with a backup of the rows it
touches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.kernels import sparse_update_
from embtables.kernels.finite_guard import update_is_finite
from embtables.kernels.lookup import occurrence_gradients, pooled_lookup
from embtables.kernels.segments import dedup_sum, occurrence_rounds, segments_from_offsets
from embtables.kernels.sequential import apply_in_order_, has_vectorised_form
from embtables.kernels.sparse_update import update_rows
from embtables.tables.backends.interface import (
    GRADIENT_NOT_FINITE,
    POOLED,
    PREPARED,
    BagPart,
    GradientPart,
    Lookup,
    Prepared,
    Restore,
    Update,
)
from embtables.tables.backends.table_set import TableSet
from embtables.tables.half_rows import as_float32, rounded_update
from embtables.tables.inputs import FeatureBatch
from embtables.tables.state import TableState
from embtables.tables.table_gradient import TableGradient
from embtables.tables.value_bounds import check_finite_rows, non_finite_gradient

_DENSE_CHUNK_ELEMENTS = 1 << 22  # rows x D per chunk of the non-lazy update (16 MiB of float32)


class TorchBackend:
    """The reference backend over ``tables``."""

    name = "torch"

    def __init__(self, tables: TableSet) -> None:
        self.tables = tables

    # ------------------------------------------------------------------ lookup
    def lookup(self, batches: Sequence[FeatureBatch], concat: bool) -> Lookup:
        self.tables.check_storage()
        return Lookup([self.lookup_feature(i, b) for i, b in enumerate(batches)], set())

    def lookup_feature(self, i: int, batch: FeatureBatch) -> Tensor:
        """Feature ``i``'s activations [*out_shape, D] (unchecked)."""
        table = self.tables.table_of(i)
        q = table.config.quantization_config
        acts = pooled_lookup(
            self.tables.states[table.name].weights,
            batch.ids,
            batch.seg,
            batch.offsets,
            batch.coeffs,
            quantization=None if q is None else (q.num_buckets, float(q.lower), float(q.upper)),
        )
        return acts.reshape(*batch.out_shape, table.dim)

    def pool(self, parts: Sequence[BagPart]) -> tuple[list[Tensor], int]:
        outs = [pooled_lookup(w, ids, segments_from_offsets(offsets), offsets, coeffs) for w, ids, offsets, coeffs in
                parts]  # fmt: skip
        return outs, POOLED

    # ------------------------------------------------------------------ phase 1
    def table_gradients(
        self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]
    ) -> dict[str, TableGradient]:
        return {t.name: self.table_gradient(t, batches, grads) for t in self.tables.tables}

    def table_gradient(
        self, table: ResolvedTable, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]
    ) -> TableGradient:
        """Table ``table``'s gradient from its features' activation gradients [S, D] (None = zero)."""
        device = self.tables.device
        ids_parts, grad_parts = [], []
        for f in table.feature_indices:
            batch, g = batches[f], grads[f]
            if g is None:
                per_id = torch.zeros((batch.ids.numel(), table.dim), dtype=torch.float32, device=device)
            else:
                per_id = occurrence_gradients(g, batch.seg, batch.coeffs)
            ids_parts.append(batch.ids)
            grad_parts.append(per_id)
        ids = torch.cat(ids_parts)
        per_id = torch.cat(grad_parts)
        accumulated = table.optimizer.use_gradient_accumulation
        if accumulated:
            rows, row_grads = dedup_sum(ids, per_id)
        else:
            # Occurrence order (spec §10.2): sample-major, then feature order, then position.
            num_features = len(table.feature_indices)
            keys = torch.cat(
                [batches[f].sample_index() * num_features + local for local, f in enumerate(table.feature_indices)]
            )
            order = torch.sort(keys, stable=True).indices
            rows, row_grads = ids[order], per_id[order]
        if not bool(torch.isfinite(row_grads).all()):
            raise non_finite_gradient(table)
        return TableGradient(table, rows, row_grads, accumulated=accumulated)

    def prepare(self, table: ResolvedTable, parts: Sequence[GradientPart], *, scratch: str = "") -> Prepared:
        device = self.tables.states[table.name].weights.device
        if not parts:
            empty = torch.empty(0, dtype=torch.int64, device=device)
            return Prepared(PREPARED, TableGradient(table, empty, torch.empty((0, table.dim), device=device), True))
        ids = torch.cat([p[0] for p in parts])
        per_id = torch.cat([_occurrences(p, table.dim) for p in parts])
        rows, sums = dedup_sum(ids, per_id)
        status = PREPARED if bool(torch.isfinite(sums).all()) else GRADIENT_NOT_FINITE
        return Prepared(status, TableGradient(table, rows, sums, accumulated=True))

    # ------------------------------------------------------------------ phase 2
    def write_step(self, table_grads: Sequence[TableGradient], lrs: dict[str, float]) -> bool:
        return False

    def checked_updates(self, updates: Sequence[Update], *, check_in_write: bool = False) -> list[Any | None]:
        return [self.checked_update(tg, lr, decay) for tg, lr, decay in updates]

    def checked_update(self, tg: TableGradient, lr: float, decay: float) -> Callable[[], None]:
        """Check one accumulated update (writes nothing); returns the function that writes it."""
        tg = tg.materialized()
        assert tg.rows is not None and tg.grads is not None
        state = self.tables.states[tg.table.name]
        opt = tg.table.optimizer
        rows, grads = tg.rows, tg.grads
        if not opt.lazy:  # every row is updated: bounds over the whole table
            gmax = float(grads.abs().max()) if grads.numel() else 0.0
            rounded = self._rounded if tg.table.config.half else None
            # a half table's rounded values are always checked: the proof bounds float32 results only
            if rounded is not None or not update_is_finite(opt, lr, decay, gmax, *self.tables.bounds(tg.table, None)):
                dense_update(state, tg.table, rows, grads, lr, write=False, rounded=rounded)
            return lambda: dense_update(state, tg.table, rows, grads, lr, write=True, rounded=rounded)
        if rows.numel() == 0:
            return _nothing
        slots = state.slot_tuple()
        w_new, s_new = update_rows(
            as_float32(state.weights.index_select(0, rows)),
            tuple(as_float32(s.index_select(0, rows)) for s in slots),
            grads,
            opt=opt,
            lr=lr,
            clip_gradients=True,
        )
        if tg.table.config.half:  # rounded to the storage types, then checked (float16 overflows to inf)
            w_new, s_new = self._rounded(tg.table, rows, w_new, s_new)
        check_finite_rows(tg.table, rows, (w_new, *s_new), lr)

        def write() -> None:
            state.weights.index_copy_(0, rows, w_new)
            for dst, src in zip(slots, s_new):
                dst.index_copy_(0, rows, src)

        return write

    def _rounded(
        self, table: ResolvedTable, rows: Tensor, weights: Tensor, slots: Sequence[Tensor]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """A half table's float32 update of local ``rows`` rounded to its storage types (``half_rows``)."""
        state = self.tables.states[table.name]
        slot_dtype = state.slot_tuple()[0].dtype if slots else torch.float32
        grows = self.tables.global_ids(table, rows)
        return rounded_update(table, grows, self.tables.step, weights, slots, state.weights.dtype, slot_dtype)

    def settle(self) -> None:
        return None  # every error is raised in the call that finds it

    def write(self, writes: Sequence[Callable[[], None]]) -> None:
        for write in writes:
            write()

    def sequential(self, tg: TableGradient, lr: float) -> Restore:
        opt = tg.table.optimizer
        state = self.tables.states[tg.table.name]

        def run(rows: Tensor, grads: Tensor) -> None:
            slots = state.slot_tuple()
            if has_vectorised_form(opt) and apply_in_order_(state.weights, slots, rows, grads, opt=opt, lr=lr):
                return
            for positions in occurrence_rounds(rows):
                sparse_update_(
                    state.weights, slots, rows[positions], grads[positions], opt=opt, lr=lr, clip_gradients=False
                )

        return applied_with_backup(state, tg, lr, run)


def applied_with_backup(
    state: TableState, tg: TableGradient, lr: float, run: Callable[[Tensor, Tensor], None]
) -> Restore:
    """``run(rows [N], grads [N, D])`` (a no-accumulation update of ``state``) with a backup of the touched
    rows: restores them and raises when any result is not finite. Returns the function that undoes it."""
    assert tg.rows is not None and tg.grads is not None
    tensors = (state.weights, *state.slot_tuple())
    touched = torch.unique(tg.rows)
    backup = [t.index_select(0, touched) for t in tensors]

    def restore() -> None:
        for t, b in zip(tensors, backup):
            t.index_copy_(0, touched, b)

    try:
        run(tg.rows, tg.grads)
        check_finite_rows(tg.table, touched, tuple(t.index_select(0, touched) for t in tensors), lr)
    except BaseException:
        restore()
        raise
    return restore


Rounding = Callable[[ResolvedTable, Tensor, Tensor, Sequence[Tensor]], tuple[Tensor, tuple[Tensor, ...]]]


def dense_update(
    state: TableState,
    table: ResolvedTable,
    rows: Tensor,
    grads: Tensor,
    lr: float,
    *,
    write: bool,
    rounded: Rounding | None = None,
) -> None:
    """Non-lazy update of every row of ``state`` [V, D] from the summed gradients ``grads`` [U, D] of ``rows``
    [U], in chunks of rows so the temporaries stay a small fraction of the table; ``write=False`` only checks
    that every result is finite. ``rounded``: a half table's rounding of a chunk's rows (``_rounded``)."""
    slots = state.slot_tuple()
    vocab, dim = state.weights.shape
    order = torch.argsort(rows)
    rows, grads = rows[order], grads[order]
    chunk = max(1, _DENSE_CHUNK_ELEMENTS // max(1, dim))
    for start in range(0, vocab, chunk):
        stop = min(vocab, start + chunk)
        lo, hi = (int(i) for i in torch.searchsorted(rows, torch.tensor([start, stop], device=rows.device)))
        g = torch.zeros((stop - start, dim), dtype=torch.float32, device=state.weights.device)
        g.index_copy_(0, rows[lo:hi] - start, grads[lo:hi])
        w_new, s_new = update_rows(
            as_float32(state.weights[start:stop]),
            tuple(as_float32(s[start:stop]) for s in slots),
            g,
            opt=table.optimizer,
            lr=lr,
            clip_gradients=True,
        )
        if rounded is not None:
            w_new, s_new = rounded(table, torch.arange(start, stop, device=rows.device), w_new, s_new)
        if write:
            state.weights[start:stop] = w_new
            for dst, src in zip(slots, s_new):
                dst[start:stop] = src
        else:
            check_finite_rows(table, torch.arange(start, stop, device=rows.device), (w_new, *s_new), lr)


def _occurrences(part: GradientPart, dim: int) -> Tensor:
    """The gradient of every id occurrence of ``part`` [N, D]."""
    ids, offsets, coeffs, grad = part
    if grad is None:
        return torch.zeros((ids.numel(), dim), dtype=torch.float32, device=ids.device)
    return occurrence_gradients(grad, segments_from_offsets(offsets), coeffs)


def _nothing() -> None:
    return None
