"""Momentum row math (spec §1.3, TF ApplyMomentum)."""

from __future__ import annotations

from torch import Tensor

from embtables.config.extra_optimizers import Momentum
from embtables.kernels.float32 import as_float32


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: Momentum, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(momenta,)`` [U, D], gradients ``g`` [U, D].

    ``m <- mu m + g``; ``w <- w - lr m``, or with Nesterov ``w <- w - lr (g + mu m)``.
    """
    (mom,) = slots
    mu = as_float32(opt.momentum)
    mom = mu * mom + g
    step = g + mu * mom if opt.use_nesterov else mom
    return w - lr * step, (mom,)
