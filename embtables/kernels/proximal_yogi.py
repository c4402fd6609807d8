"""ProximalYogi row math (spec §1.3; lazy, no bias correction)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.extra_optimizers import ProximalYogi
from embtables.kernels.float32 import as_float32, one_minus, scalar_over
from embtables.kernels.proximal_adagrad import proximal_step
from embtables.kernels.record import F32_MIN_NORMAL, KernelRecord, bounded, slot_domains_of
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


def _constants(opt: ProximalYogi, lr: float) -> dict[str, float]:
    return {
        "beta_1": as_float32(opt.beta_1),
        "one_minus_beta_1": one_minus(opt.beta_1),
        "one_minus_beta_2": one_minus(opt.beta_2),
        "epsilon": as_float32(opt.epsilon),
        "l1": as_float32(opt.l1_regularization_strength),
        "l2": as_float32(opt.l2_regularization_strength),
    }


def _bounds(
    opt: ProximalYogi, lr: float, g: float, w_dec: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...] | None:
    eps = float(opt.epsilon)
    if lo[1] < 0 or lr < 0 or eps < F32_MIN_NORMAL:  # v stays >= 0, so sqrt(v) + eps >= eps
        return None
    lr_t = abs(lr) / eps
    m_new = max(hi[2], g)
    l1, l2 = float(opt.l1_regularization_strength), float(opt.l2_regularization_strength)
    if not bounded(lr_t, lr_t * m_new, lr_t * max(l1, l2)):
        return None
    return (w_dec + lr_t * m_new, hi[1] + g * g, m_new)


RECORD = KernelRecord(
    ProximalYogi,
    native_kind=10,
    native_name="proximal_yogi",
    update_rows=update_rows,
    constant_names=("beta_1", "one_minus_beta_1", "one_minus_beta_2", "epsilon", "l1", "l2"),
    constants=_constants,
    bounds=_bounds,
    slot_domains=slot_domains_of({"v": "nonnegative"}),
    v1_names=(("beta_1", "beta1"), ("beta_2", "beta2")),
)
