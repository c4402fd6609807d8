"""The fused sparse update of one table: clip -> decay -> optimizer -> weight clip, once per row.

Dispatch from optimizer config to row math happens here and nowhere else (``ROW_UPDATES``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from embtables.config.catalogue import Optimizer
from embtables.config.extra_optimizers import (
    Adadelta,
    CenteredRMSProp,
    FrequencyEstimator,
    Momentum,
    ProximalAdagrad,
    ProximalYogi,
    RMSProp,
)
from embtables.config.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam
from embtables.kernels import (
    adadelta,
    adagrad,
    adagrad_momentum,
    adam,
    frequency_estimator,
    ftrl,
    momentum,
    proximal_adagrad,
    proximal_yogi,
    rmsprop,
    sgd,
)
from embtables.kernels.clip_decay import clip_gradient, clip_weights, decay_weights, effective_weight_decay

RowUpdateFn = Callable[..., tuple[Tensor, tuple[Tensor, ...]]]

ROW_UPDATES: dict[type[Any], RowUpdateFn] = {
    SGD: sgd.update_rows,
    Adagrad: adagrad.update_rows,
    AdagradMomentum: adagrad_momentum.update_rows,
    Adam: adam.update_rows,
    FTRL: ftrl.update_rows,
    ProximalAdagrad: proximal_adagrad.update_rows,
    Momentum: momentum.update_rows,
    RMSProp: rmsprop.update_rows,
    CenteredRMSProp: rmsprop.update_rows_centered,
    Adadelta: adadelta.update_rows,
    ProximalYogi: proximal_yogi.update_rows,
    FrequencyEstimator: frequency_estimator.update_rows,
}


def get_row_update(opt: object) -> RowUpdateFn:
    """The row math for ``opt``; raises ``TypeError`` listing the supported optimizer types."""
    fn = ROW_UPDATES.get(type(opt))
    if fn is None:
        supported = ", ".join(c.__name__ for c in ROW_UPDATES)
        raise TypeError(f"No sparse update for optimizer type {type(opt).__name__}; supported: {supported}.")
    return fn


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: Optimizer, lr: float, clip_gradients: bool
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The per-row pipeline on gathered rows ``w`` [U, D], ``slots`` [U, D] each, ``g`` [U, D]."""
    if clip_gradients:
        g = clip_gradient(g, *opt.gradient_clip_bounds)
    decay = effective_weight_decay(opt.weight_decay_factor, opt.weight_decay_multiplied_by_lr, lr)
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
