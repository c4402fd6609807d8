"""ProximalYogi row math (spec §1.3; lazy, no bias correction)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.extra_optimizers import ProximalYogi
from embtables.kernels.float32 import as_float32, one_minus, scalar_over
from embtables.kernels.proximal_adagrad import proximal_step
from embtables.kernels.sqrt import sqrt_f32


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: ProximalYogi, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(v, m)`` [U, D], gradients ``g`` [U, D].

    ``m <- b1 m + (1-b1) g; v <- v - (1-b2) sign(v - g^2) g^2; lr_t = lr / (sqrt(v) + eps);
    p = w - lr_t m; w <- sign(p) max(|p| - lr_t l1, 0) / (1 + lr_t l2)``.
    """
    v, m = slots
    g2 = g * g
    m = as_float32(opt.beta_1) * m + one_minus(opt.beta_1) * g
    v = v - one_minus(opt.beta_2) * torch.sign(v - g2) * g2
    lr_t = scalar_over(lr, sqrt_f32(v) + as_float32(opt.epsilon))
    prox = w - lr_t * m
    l1, l2 = as_float32(opt.l1_regularization_strength), as_float32(opt.l2_regularization_strength)
    return proximal_step(prox, lr_t, l1, l2), (v, m)
