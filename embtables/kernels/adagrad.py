"""Adagrad row math (TPU form): ``a <- a + g^2; w <- w - lr * g / sqrt(a)``, no epsilon."""

from __future__ import annotations

import math

from torch import Tensor

from embtables.config.optimizers import Adagrad
from embtables.kernels.record import KernelRecord, slot_domains_of
from embtables.kernels.sqrt import sqrt_f32


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: Adagrad, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D], slots ``(accumulators,)`` [U, D], gradients ``g`` [U, D]."""
    del opt
    (acc,) = slots
    acc = acc + g * g
    return w - lr * g / sqrt_f32(acc), (acc,)


def _bounds(
    opt: Adagrad, lr: float, g: float, w_dec: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...] | None:
    if not lo[1] > 0:
        return None
    return (w_dec + abs(lr) * step_ratio_bound(lo[1]), hi[1] + g * g)


def step_ratio_bound(a_min: float) -> float:
    """A bound on |g| / sqrt(a + g^2) for accumulators of at least ``a_min`` > 0: at most 1, except when
    g^2 underflows in float32; then |g| < 2e-19 and a >= a_min."""
    return max(1.001, 2e-19 / math.sqrt(a_min))


RECORD = KernelRecord(
    Adagrad,
    native_kind=1,
    native_name="adagrad",
    update_rows=update_rows,
    bounds=_bounds,
    slot_domains=slot_domains_of({"accumulators": "positive"}),  # the update divides by sqrt(a)
    v1_names=(("initial_accumulator_value", "initial_accumulator"),),
)
