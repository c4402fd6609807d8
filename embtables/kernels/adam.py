"""Adam row math (TPU form: no bias correction)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.optimizers import Adam


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: Adam, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(momenta, velocities)`` [U, D], gradients ``g`` [U, D].

    ``m <- b1 m + (1-b1) g; v <- b2 v + (1-b2) g^2; w <- w - lr m / den`` with
    ``den = sqrt(v + eps^2)`` (sum_inside_sqrt) or ``sqrt(v) + eps``.
    """
    m, v = slots
    b1, b2, eps = opt.beta_1, opt.beta_2, opt.epsilon
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * (g * g)
    den = torch.sqrt(v + eps * eps) if opt.sum_inside_sqrt else torch.sqrt(v) + eps
    return w - lr * m / den, (m, v)
