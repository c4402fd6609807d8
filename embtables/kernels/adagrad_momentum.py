"""AdagradMomentum row math (spec §1.3)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.optimizers import AdagradMomentum
from embtables.kernels.float32 import as_float32, neg_reciprocal, one_minus
from embtables.kernels.record import KernelRecord, bounded, slot_domains_of


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


def _constants(opt: AdagradMomentum, lr: float) -> dict[str, float]:
    return {
        "momentum": as_float32(opt.momentum),
        "neg_inv_exponent": neg_reciprocal(opt.exponent),
        "beta2": as_float32(opt.beta2),
        "one_minus_beta2": one_minus(opt.beta2),
        "epsilon": as_float32(opt.epsilon),
    }


def _bounds(
    opt: AdagradMomentum, lr: float, g: float, w_dec: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...] | None:
    if not (lo[1] >= 0 and 0 < opt.beta2 <= 1 and opt.exponent > 0):
        return None
    precond = float(opt.epsilon) ** (-1.0 / float(opt.exponent))  # (a + eps)^(-1/exponent), a >= 0
    scaled = precond * g
    m_new = abs(opt.momentum) * hi[2] + scaled
    update = abs(opt.momentum) * m_new + scaled if opt.use_nesterov else m_new
    if not bounded(precond, scaled, update, hi[1] + g * g + float(opt.epsilon)):
        return None
    return (w_dec + abs(lr) * update, hi[1] + g * g, m_new)


RECORD = KernelRecord(
    AdagradMomentum,
    native_kind=2,
    native_name="adagrad_momentum",
    update_rows=update_rows,
    flag_names=("use_nesterov", "beta2_is_one"),
    flags=lambda opt: {"use_nesterov": opt.use_nesterov, "beta2_is_one": as_float32(opt.beta2) == 1},
    constant_names=("momentum", "neg_inv_exponent", "beta2", "one_minus_beta2", "epsilon"),
    constants=_constants,
    bounds=_bounds,
    slot_domains=slot_domains_of({"accumulators": "nonnegative"}),
)
