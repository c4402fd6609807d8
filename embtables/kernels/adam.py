"""Adam row math (TPU form: no bias correction)."""

from __future__ import annotations

from torch import Tensor

from embtables.config.optimizers import Adam
from embtables.kernels.float32 import as_float32, one_minus, times
from embtables.kernels.sqrt import sqrt_f32


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: Adam, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(momenta, velocities)`` [U, D], gradients ``g`` [U, D].

    ``m <- b1 m + (1-b1) g; v <- b2 v + (1-b2) g^2; w <- w - lr m / den`` with
    ``den = sqrt(v + eps^2)`` (sum_inside_sqrt) or ``sqrt(v) + eps``.
    """
    m, v = slots
    b1, b2, eps = as_float32(opt.beta_1), as_float32(opt.beta_2), as_float32(opt.epsilon)
    m = b1 * m + one_minus(b1) * g
    v = b2 * v + one_minus(b2) * (g * g)
    den = sqrt_f32(v + times(eps, eps)) if opt.sum_inside_sqrt else sqrt_f32(v) + eps
    return w - lr * m / den, (m, v)
