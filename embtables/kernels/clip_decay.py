"""Gradient clipping, decoupled weight decay and weight clipping (spec §1.1 steps 4, 5, 7; 10.1)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.catalogue import Optimizer
from embtables.kernels.float32 import as_float32, times


def clip_gradient(g: Tensor, lower: float | None, upper: float | None) -> Tensor:
    """Clamp the accumulated per-row gradient ``g`` [U, D] elementwise; None is an open side."""
    if lower is None and upper is None:
        return g
    return torch.clamp(g, min=lower, max=upper)


def decay_weights(w: Tensor, factor: float) -> Tensor:
    """``w - factor * w`` for updated rows [U, D] (decoupled weight decay). With factor 0 that is ``w + 0``, as
    the C and GPU kernels compute it: it changes only the sign of a zero (-0 - 0 * -0 = +0)."""
    if not factor:
        return w + 0.0
    return w - factor * w


def clip_weights(w: Tensor, lower: float | None, upper: float | None) -> Tensor:
    """Clamp the new weights [U, D]; None is an open side."""
    if lower is None and upper is None:
        return w
    return torch.clamp(w, min=lower, max=upper)


def clip_limits(opt: Optimizer, *, clip_gradients: bool = True) -> tuple[float, float, float, float]:
    """(gradient min, gradient max, weight min, weight max) of ``opt`` as the fused kernels take them: an
    open side is -inf / +inf (a clamp to it changes nothing)."""
    inf = float("inf")
    glo, ghi = opt.gradient_clip_bounds if clip_gradients else (None, None)
    wlo, whi = opt.clip_weight_min, opt.clip_weight_max
    return (
        -inf if glo is None else float(glo),
        inf if ghi is None else float(ghi),
        -inf if wlo is None else float(wlo),
        inf if whi is None else float(whi),
    )


def effective_weight_decay(factor: float | None, multiply_by_lr: bool, lr: float) -> float:
    """``lambda * lr`` when the multiply flag is set, else ``lambda``; 0 when decay is off."""
    if not factor:
        return 0.0
    return times(factor, lr) if multiply_by_lr else as_float32(factor)


def optimizer_decay(opt: Optimizer, lr: float) -> float:
    """``effective_weight_decay`` of ``opt``'s decay settings at learning rate ``lr``."""
    return effective_weight_decay(opt.weight_decay_factor, opt.weight_decay_multiplied_by_lr, lr)
