"""The torch-path updates that are not one fused pass over the unique rows: a non-lazy (dense) update of every
row, in chunks, and a no-accumulation update occurrence by occurrence with a backup of the rows it touches.
``EmbeddingCollection`` (``tables/collection.py``) calls them for its tables."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from embtables.config import ResolvedTable
from embtables.kernels import native, sparse_update_
from embtables.kernels.clip_decay import effective_weight_decay
from embtables.kernels.segments import occurrence_rounds
from embtables.kernels.sequential import apply_in_order_, has_vectorised_form
from embtables.kernels.sparse_update import update_rows
from embtables.tables.state import TableState
from embtables.tables.table_gradient import TableGradient
from embtables.tables.value_bounds import check_finite_rows

_DENSE_CHUNK_ELEMENTS = 1 << 22  # rows x D per chunk of the torch-path non-lazy update (16 MiB of float32)


def dense_update(
    state: TableState, table: ResolvedTable, rows: Tensor, grads: Tensor, lr: float, *, write: bool
) -> None:
    """Non-lazy update of every row of ``state`` [V, D] from the summed gradients ``grads`` [U, D] of ``rows``
    [U], on the torch path, in chunks of rows so the temporaries stay a small fraction of the table;
    ``write=False`` only checks that every result is finite."""
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
            state.weights[start:stop],
            tuple(s[start:stop] for s in slots),
            g,
            opt=table.optimizer,
            lr=lr,
            clip_gradients=True,
        )
        if write:
            state.weights[start:stop] = w_new
            for dst, src in zip(slots, s_new):
                dst[start:stop] = src
        else:
            check_finite_rows(table, torch.arange(start, stop, device=rows.device), (w_new, *s_new), lr)


def apply_sequential_or_restore(state: TableState, tg: TableGradient, lr: float) -> Callable[[], None]:
    """Apply a no-accumulation update (occurrence by occurrence) to ``state`` with a backup of the touched
    rows; restores them and raises if any result is not finite. Returns the function that undoes it."""
    assert tg.rows is not None and tg.grads is not None
    opt = tg.table.optimizer
    slots = state.slot_tuple()
    tensors = (state.weights, *slots)
    touched = torch.unique(tg.rows)
    backup = [t.index_select(0, touched) for t in tensors]

    def restore() -> None:
        for t, b in zip(tensors, backup):
            t.index_copy_(0, touched, b)

    try:
        if native.usable(state.weights, *slots, tg.rows, tg.grads):
            decay = effective_weight_decay(opt.weight_decay_factor, opt.weight_decay_multiplied_by_lr, lr)
            params = native.opt_params(opt, lr, decay, clip_gradients=False)
            native.apply_sequential(tg.rows, tg.grads.contiguous(), state.weights, slots, params)
        elif has_vectorised_form(opt):
            apply_in_order_(state.weights, slots, tg.rows, tg.grads, opt=opt, lr=lr)
        else:
            for round_positions in occurrence_rounds(tg.rows):
                sparse_update_(
                    state.weights,
                    slots,
                    tg.rows[round_positions],
                    tg.grads[round_positions],
                    opt=opt,
                    lr=lr,
                    clip_gradients=False,
                )
        after = tuple(t.index_select(0, touched) for t in tensors)
        check_finite_rows(tg.table, touched, after, lr)
    except BaseException:
        restore()
        raise
    return restore
