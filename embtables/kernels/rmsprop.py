"""RMSProp and centered RMSProp row math (spec §1.3, TF ApplyRMSProp / ApplyCenteredRMSProp)."""

from __future__ import annotations

import math

from torch import Tensor

from embtables.config.extra_optimizers import CenteredRMSProp, RMSProp
from embtables.kernels.float32 import as_float32, one_minus
from embtables.kernels.record import F32_MIN_NORMAL, KernelRecord, bounded, slot_domains_of
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


def _constants(opt: RMSProp | CenteredRMSProp, lr: float) -> dict[str, float]:
    return {
        "rho": as_float32(opt.rho),
        "one_minus_rho": one_minus(opt.rho),
        "momentum": as_float32(opt.momentum),
        "epsilon": as_float32(opt.epsilon),
    }


def _bounds(
    opt: RMSProp, lr: float, g: float, w_dec: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...] | None:
    eps = float(opt.epsilon)
    if lo[1] < 0 or not 0 <= opt.rho <= 1 or eps * (1 - 1e-6) < F32_MIN_NORMAL:
        return None
    den_min = math.sqrt(eps * (1 - 1e-6))  # ms >= 0, so sqrt(ms + eps) >= sqrt(eps), less one rounding
    if not bounded(abs(lr) * g):  # lr * g is formed before the division
        return None
    mom = abs(opt.momentum) * hi[2] + abs(lr) * g / den_min
    return (w_dec + mom, hi[1] + g * g, mom)


_NAMES = ("rho", "one_minus_rho", "momentum", "epsilon")
RECORD = KernelRecord(
    RMSProp,
    native_kind=7,
    native_name="rmsprop",
    update_rows=update_rows,
    constant_names=_NAMES,
    constants=_constants,
    bounds=_bounds,
    slot_domains=slot_domains_of({"ms": "nonnegative"}),
)
# Never proven finite (``ms - mg^2`` may round below zero): it always takes the exact dry run.
CENTERED_RECORD = KernelRecord(
    CenteredRMSProp,
    native_kind=8,
    native_name="rmsprop",  # one C kernel for both, told apart by its kind
    update_rows=update_rows_centered,
    constant_names=_NAMES,
    constants=_constants,
    slot_domains=slot_domains_of({"ms": "nonnegative"}),
)
