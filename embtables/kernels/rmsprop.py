"""RMSProp and centered RMSProp row math (spec §1.3, TF ApplyRMSProp / ApplyCenteredRMSProp)."""

from __future__ import annotations

from torch import Tensor

from embtables.config.extra_optimizers import CenteredRMSProp, RMSProp
from embtables.kernels.float32 import as_float32, one_minus
from embtables.kernels.sqrt import sqrt_f32


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: RMSProp, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(ms, mom)`` [U, D], gradients ``g`` [U, D].

    ``ms <- rho ms + (1-rho) g^2; mom <- mu mom + lr g / sqrt(ms + eps); w <- w - mom``.
    """
    ms, mom = slots
    rho, mu, eps = as_float32(opt.rho), as_float32(opt.momentum), as_float32(opt.epsilon)
    ms = rho * ms + one_minus(opt.rho) * (g * g)
    mom = mu * mom + lr * g / sqrt_f32(ms + eps)
    return w - mom, (ms, mom)


def update_rows_centered(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: CenteredRMSProp, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(ms, mom, mg)`` [U, D], gradients ``g`` [U, D].

    ``mg <- rho mg + (1-rho) g``; ``ms`` as RMSProp; ``mom <- mu mom + lr g / sqrt(ms - mg^2 + eps)``;
    ``w <- w - mom``.
    """
    ms, mom, mg = slots
    rho, mu, eps = as_float32(opt.rho), as_float32(opt.momentum), as_float32(opt.epsilon)
    one_minus_rho = one_minus(opt.rho)
    mg = rho * mg + one_minus_rho * g
    ms = rho * ms + one_minus_rho * (g * g)
    mom = mu * mom + lr * g / sqrt_f32(ms - mg * mg + eps)
    return w - mom, (ms, mom, mg)
