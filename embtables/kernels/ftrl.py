"""FTRL row math (spec §1.3, TF v2 / SparseCore program)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.optimizers import FTRL
from embtables.kernels.float32 import as_float32, times
from embtables.kernels.record import KernelRecord, bounded
from embtables.kernels.sqrt import sqrt_f32


def _power(n: Tensor, p: float, allow_zero: bool) -> Tensor:
    """``n ** p``; with ``allow_zero`` an accumulator equal to 0 gives 0 instead of inf/NaN (spec §10.3)."""
    out = sqrt_f32(n) if p == 0.5 else torch.pow(n, p)
    if allow_zero:
        out = torch.where(n == 0, torch.zeros_like(out), out)
    return out


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: FTRL, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D] (already decayed), slots ``(accumulators, linears)`` [U, D], gradients ``g``.

    With ``p = -learning_rate_power``: ``n' = n + g^2``, ``delta = n'^p - n^p``;
    plain: ``z += g - (delta/lr) w``, ``N = clamp(z, -l1, l1) - z``, ``Dn = (n'^p + beta)/lr + 2 l2``;
    multiply_linear_by_learning_rate: ``z += lr g - delta w``, ``N = clamp(z, -lr l1, lr l1) - z``,
    ``Dn = n'^p + 2 lr l2 + beta``; then ``w = N / Dn``.
    """
    n, z = slots
    p = as_float32(-opt.learning_rate_power)
    beta = as_float32(opt.beta)
    n_new = n + g * g
    pow_new = _power(n_new, p, opt.allow_zero_accumulator)
    delta = pow_new - _power(n, p, opt.allow_zero_accumulator)
    if opt.multiply_linear_by_learning_rate:
        lim = times(lr, opt.l1_regularization_strength)
        z = z + lr * g - delta * w
        numer = torch.clamp(z, -lim, lim) - z
        den = pow_new + times(2.0, lr, opt.l2_regularization_strength) + beta
    else:
        lim = as_float32(opt.l1_regularization_strength)
        z = z + g - (delta / lr) * w
        numer = torch.clamp(z, -lim, lim) - z
        den = (pow_new + beta) / lr + times(2.0, opt.l2_regularization_strength)
    w_new = numer / den
    if opt.allow_zero_accumulator:  # spec §10.3: a zero numerator gives 0 even over a zero denominator
        w_new = torch.where(numer == 0, torch.zeros_like(w_new), w_new)
    return w_new, (n_new, z)


def _constants(opt: FTRL, lr: float) -> dict[str, float]:
    l1, l2 = opt.l1_regularization_strength, opt.l2_regularization_strength
    scaled = opt.multiply_linear_by_learning_rate  # l1 and 2 * l2 times the learning rate
    return {
        "power": as_float32(-opt.learning_rate_power),
        "l1": times(lr, l1) if scaled else as_float32(l1),
        "beta": as_float32(opt.beta),
        "two_l2": times(2.0, lr, l2) if scaled else times(2.0, l2),
    }


def _bounds(
    opt: FTRL, lr: float, g: float, w_dec: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...] | None:
    p = -float(opt.learning_rate_power)
    n_min = lo[1]
    if not lr > 0 or not p >= 0 or not n_min >= 0 or (n_min == 0 and not opt.allow_zero_accumulator and p > 0):
        return None
    n_max = hi[1] + g * g
    power_max = max(1.0, n_max) ** p if p > 0 else 1.0  # n^p over n in [n_min, n_max]
    power_min = (n_min**p if n_min > 0 else 0.0) if p > 0 else 1.0
    l1, l2, beta = (float(opt.l1_regularization_strength), float(opt.l2_regularization_strength), float(opt.beta))
    if opt.multiply_linear_by_learning_rate:
        z = hi[2] + lr * g + power_max * w_dec
        den_min = power_min + 2.0 * lr * l2 + beta
        extra = lr * l1
    else:
        z = hi[2] + g + (power_max / lr) * w_dec
        den_min = (power_min + beta) / lr + 2.0 * l2
        extra = l1
    if not den_min > 1e-30 or not bounded(n_max, power_max, power_max / lr, z + extra):
        return None
    return ((z + extra) / den_min, n_max, z)


RECORD = KernelRecord(
    FTRL,
    native_kind=4,
    native_name="ftrl",
    update_rows=update_rows,
    flag_names=("multiply_linear_by_learning_rate", "allow_zero_accumulator"),
    flags=lambda opt: {
        "multiply_linear_by_learning_rate": opt.multiply_linear_by_learning_rate,
        "allow_zero_accumulator": opt.allow_zero_accumulator,
    },
    constant_names=("power", "l1", "beta", "two_l2"),
    constants=_constants,
    bounds=_bounds,
    slot_domains=lambda opt: ("nonnegative" if opt.allow_zero_accumulator else "positive", "any"),
    divides_by_learning_rate=lambda opt: not opt.multiply_linear_by_learning_rate,
    power_is_sqrt=lambda constants: constants["power"] == 0.5,
)
