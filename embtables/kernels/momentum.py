"""Momentum row math (spec §1.3, TF ApplyMomentum)."""

from __future__ import annotations

from torch import Tensor

from embtables.config.extra_optimizers import Momentum
from embtables.kernels.float32 import as_float32
from embtables.kernels.record import KernelRecord


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


def _bounds(
    opt: Momentum, lr: float, g: float, w_dec: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...]:
    m_new = abs(opt.momentum) * hi[1] + g
    step = g + abs(opt.momentum) * m_new if opt.use_nesterov else m_new
    return (w_dec + abs(lr) * step, m_new)


RECORD = KernelRecord(
    Momentum,
    native_kind=6,
    native_name="momentum",
    update_rows=update_rows,
    flag_names=("use_nesterov",),
    flags=lambda opt: {"use_nesterov": opt.use_nesterov},
    constant_names=("momentum",),
    constants=lambda opt, lr: {"momentum": as_float32(opt.momentum)},
    bounds=_bounds,
)
