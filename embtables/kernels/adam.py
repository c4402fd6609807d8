"""Adam row math (TPU form: no bias correction)."""

from __future__ import annotations

import math

from torch import Tensor

from embtables.config.optimizers import Adam
from embtables.kernels.float32 import as_float32, one_minus, times
from embtables.kernels.record import F32_MIN_NORMAL, KernelRecord, slot_domains_of
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


def _constants(opt: Adam, lr: float) -> dict[str, float]:
    return {
        "beta_1": as_float32(opt.beta_1),
        "one_minus_beta_1": one_minus(opt.beta_1),
        "beta_2": as_float32(opt.beta_2),
        "one_minus_beta_2": one_minus(opt.beta_2),
        "epsilon_squared": times(opt.epsilon, opt.epsilon),
        "epsilon": as_float32(opt.epsilon),
    }


def _bounds(
    opt: Adam, lr: float, g: float, w_dec: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...] | None:
    eps = float(opt.epsilon)
    den_min = eps if not opt.sum_inside_sqrt else math.sqrt(max(eps * eps * (1 - 1e-6), 0.0))
    if not (lo[2] >= 0 and den_min >= F32_MIN_NORMAL):
        return None
    m_new = max(hi[1], g)
    return (w_dec + abs(lr) * m_new / den_min, m_new, hi[2] + g * g + eps * eps)


RECORD = KernelRecord(
    Adam,
    native_kind=3,
    native_name="adam",
    update_rows=update_rows,
    flag_names=("sum_inside_sqrt",),
    flags=lambda opt: {"sum_inside_sqrt": opt.sum_inside_sqrt},
    constant_names=("beta_1", "one_minus_beta_1", "beta_2", "one_minus_beta_2", "epsilon_squared", "epsilon"),
    constants=_constants,
    bounds=_bounds,
    slot_domains=slot_domains_of({"velocities": "nonnegative"}),
    v1_names=(("beta_1", "beta1"), ("beta_2", "beta2")),
)
