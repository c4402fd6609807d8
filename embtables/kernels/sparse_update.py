"""The fused sparse update of one table: clip -> decay -> optimizer -> weight clip, once per row.

The row math of each optimizer comes from its kernel record (``kernels/registry.py``).
"""

from __future__ import annotations

from torch import Tensor

from embtables.config.catalogue import Optimizer
from embtables.kernels.clip_decay import clip_gradient, clip_weights, decay_weights, optimizer_decay
from embtables.kernels.record import RowUpdateFn
from embtables.kernels.registry import record_of
from embtables.kernels.subnormals import flush, flushing


def get_row_update(opt: object) -> RowUpdateFn:
    """The row math for ``opt``; raises ``TypeError`` listing the supported optimizer types."""
    return record_of(opt).update_rows


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: Optimizer, lr: float, clip_gradients: bool
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The per-row pipeline on gathered rows ``w`` [U, D], ``slots`` [U, D] each, ``g`` [U, D], float32, with
    subnormal operands and results flushed to zero at every operation as the C kernels do (spec §1.5)."""
    w, g, slots = flush(w), flush(g), tuple(flush(s) for s in slots)
    if clip_gradients:
        g = clip_gradient(g, *opt.gradient_clip_bounds)
    decay = optimizer_decay(opt, lr)
    with flushing():
        w = decay_weights(w, decay)
        w, slots = get_row_update(opt)(w, slots, g, opt=opt, lr=lr)
        return clip_weights(w, opt.clip_weight_min, opt.clip_weight_max), slots


def sparse_update_(
    weights: Tensor,
    slots: tuple[Tensor, ...],
    rows: Tensor | None,
    grads: Tensor,
    *,
    opt: Optimizer,
    lr: float,
    clip_gradients: bool = True,
) -> None:
    """Update ``weights`` [V, D] and ``slots`` [V, D] in place at distinct ``rows`` [U] with ``grads`` [U, D].

    ``rows=None`` means every row (``grads`` is then [V, D]): the dense update of non-lazy Adam.
    """
    if rows is None:
        w_new, s_new = update_rows(weights, slots, grads, opt=opt, lr=lr, clip_gradients=clip_gradients)
        weights.copy_(w_new)
        for dst, src in zip(slots, s_new):
            dst.copy_(src)
        return
    if rows.numel() == 0:
        return
    w_new, s_new = update_rows(
        weights.index_select(0, rows),
        tuple(s.index_select(0, rows) for s in slots),
        grads,
        opt=opt,
        lr=lr,
        clip_gradients=clip_gradients,
    )
    weights.index_copy_(0, rows, w_new.to(weights.dtype))
    for dst, src in zip(slots, s_new):
        dst.index_copy_(0, rows, src.to(dst.dtype))
