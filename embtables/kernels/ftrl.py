"""FTRL row math (spec §1.3, TF v2 / SparseCore program)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.optimizers import FTRL
from embtables.kernels.float32 import as_float32, times
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
