"""ProximalAdagrad row math (spec §1.3, TF ApplyProximalAdagrad)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.extra_optimizers import ProximalAdagrad
from embtables.kernels.float32 import as_float32, scalar_over
from embtables.kernels.sqrt import sqrt_f32


def proximal_step(prox: Tensor, lr_t: Tensor, l1: float, l2: float) -> Tensor:
    """``sign(p) max(|p| - lr_t l1, 0) / (1 + lr_t l2)`` for ``prox``, ``lr_t`` [U, D] (l1, l2 float32)."""
    shrunk = torch.clamp(prox.abs() - lr_t * l1, min=0.0)
    return torch.sign(prox) * shrunk / (1.0 + lr_t * l2)


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: ProximalAdagrad, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(accumulators,)`` [U, D], gradients ``g`` [U, D].

    ``a <- a + g^2; lr_t = lr / sqrt(a); p = w - lr_t g; w <- sign(p) max(|p| - lr_t l1, 0) / (1 + lr_t l2)``.
    """
    (acc,) = slots
    acc = acc + g * g
    lr_t = scalar_over(lr, sqrt_f32(acc))
    prox = w - lr_t * g
    l1, l2 = as_float32(opt.l1_regularization_strength), as_float32(opt.l2_regularization_strength)
    return proximal_step(prox, lr_t, l1, l2), (acc,)
