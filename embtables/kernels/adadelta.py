"""Adadelta row math (spec §1.3, TF ApplyAdadelta)."""

from __future__ import annotations

import math

from torch import Tensor

from embtables.config.extra_optimizers import Adadelta
from embtables.kernels.float32 import as_float32, one_minus
from embtables.kernels.record import F32_MIN_NORMAL, KernelRecord, bounded, slot_domains_of
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


def _bounds(
    opt: Adadelta, lr: float, g: float, w_dec: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...] | None:
    eps = float(opt.epsilon)
    if lo[1] < 0 or lo[2] < 0 or not 0 <= opt.rho <= 1 or eps * (1 - 1e-6) < F32_MIN_NORMAL:
        return None
    u = math.sqrt(hi[2] + eps) / math.sqrt(eps * (1 - 1e-6)) * g * (1 + 1e-6)
    if not bounded(u, u * u):
        return None
    return (w_dec + abs(lr) * u, hi[1] + g * g, hi[2] + u * u)


RECORD = KernelRecord(
    Adadelta,
    native_kind=9,
    native_name="adadelta",
    update_rows=update_rows,
    constant_names=("rho", "one_minus_rho", "epsilon"),
    constants=lambda opt, lr: {
        "rho": as_float32(opt.rho),
        "one_minus_rho": one_minus(opt.rho),
        "epsilon": as_float32(opt.epsilon),
    },
    bounds=_bounds,
    slot_domains=slot_domains_of({"accumulators": "nonnegative", "updates": "nonnegative"}),
)
