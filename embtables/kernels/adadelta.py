"""Adadelta row math (spec §1.3, TF ApplyAdadelta)."""

from __future__ import annotations

from torch import Tensor

from embtables.config.extra_optimizers import Adadelta
from embtables.kernels.float32 import as_float32, one_minus
from embtables.kernels.sqrt import sqrt_f32


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: Adadelta, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(accumulators, updates)`` [U, D], gradients ``g`` [U, D].

    ``a <- rho a + (1-rho) g^2; u = sqrt(upd + eps) / sqrt(a + eps) g; upd <- rho upd + (1-rho) u^2;
    w <- w - lr u``.
    """
    acc, upd = slots
    rho, eps, one_minus_rho = as_float32(opt.rho), as_float32(opt.epsilon), one_minus(opt.rho)
    acc = rho * acc + one_minus_rho * (g * g)
    u = sqrt_f32(upd + eps) / sqrt_f32(acc + eps) * g
    upd = rho * upd + one_minus_rho * (u * u)
    return w - lr * u, (acc, upd)
