"""AdagradMomentum row math (SPEC 1.3)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.optimizers import AdagradMomentum


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: AdagradMomentum, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(accumulators, momenta)`` [U, D], gradients ``g`` [U, D].

    ``a <- a + g^2`` (or ``b2 a + (1-b2) g^2`` when beta2 != 1); ``s = (a + eps)^(-1/exponent) g``;
    ``m <- mu m + s``; ``u = mu m + s`` with Nesterov else ``m``; ``w <- w - lr u``.
    """
    acc, mom = slots
    acc = acc + g * g if opt.beta2 == 1 else opt.beta2 * acc + (1.0 - opt.beta2) * (g * g)
    scaled = torch.pow(acc + opt.epsilon, -1.0 / opt.exponent) * g
    mom = opt.momentum * mom + scaled
    step = opt.momentum * mom + scaled if opt.use_nesterov else mom
    return w - lr * step, (acc, mom)
