"""FTRL row math (SPEC 1.3, TF v2 / SparseCore program)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.optimizers import FTRL


def _power(n: Tensor, p: float, allow_zero: bool) -> Tensor:
    """``n ** p``; with ``allow_zero`` an accumulator equal to 0 gives 0 instead of inf/NaN (SPEC 10.3)."""
    out = torch.pow(n, p)
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
    p = -opt.learning_rate_power
    l1, l2, beta = opt.l1_regularization_strength, opt.l2_regularization_strength, opt.beta
    n_new = n + g * g
    pow_new = _power(n_new, p, opt.allow_zero_accumulator)
    delta = pow_new - _power(n, p, opt.allow_zero_accumulator)
    if opt.multiply_linear_by_learning_rate:
        z = z + lr * g - delta * w
        numer = torch.clamp(z, -lr * l1, lr * l1) - z
        den = pow_new + 2.0 * lr * l2 + beta
    else:
        z = z + g - (delta / lr) * w
        numer = torch.clamp(z, -l1, l1) - z
        den = (pow_new + beta) / lr + 2.0 * l2
    return numer / den, (n_new, z)
