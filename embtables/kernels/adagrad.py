"""Adagrad row math (TPU form): ``a <- a + g^2; w <- w - lr * g / sqrt(a)``, no epsilon."""

from __future__ import annotations

from torch import Tensor

from embtables.config.optimizers import Adagrad
from embtables.kernels.sqrt import sqrt_f32


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: Adagrad, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(accumulators,)`` [U, D], gradients ``g`` [U, D]."""
    del opt
    (acc,) = slots
    acc = acc + g * g
    return w - lr * g / sqrt_f32(acc), (acc,)
