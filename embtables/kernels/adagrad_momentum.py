"""AdagradMomentum row math (spec §1.3)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.optimizers import AdagradMomentum
from embtables.kernels.float32 import as_float32, neg_reciprocal, one_minus


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: AdagradMomentum, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(accumulators, momenta)`` [U, D], gradients ``g`` [U, D].

    ``a <- a + g^2`` (or ``b2 a + (1-b2) g^2`` when beta2 != 1); ``s = (a + eps)^(-1/exponent) g``;
    ``m <- mu m + s``; ``u = mu m + s`` with Nesterov else ``m``; ``w <- w - lr u``.
    """
    acc, mom = slots
    b2, mu = as_float32(opt.beta2), as_float32(opt.momentum)
    acc = acc + g * g if b2 == 1 else b2 * acc + one_minus(b2) * (g * g)
    scaled = torch.pow(acc + as_float32(opt.epsilon), neg_reciprocal(opt.exponent)) * g
    mom = mu * mom + scaled
    step = mu * mom + scaled if opt.use_nesterov else mom
    return w - lr * step, (acc, mom)
