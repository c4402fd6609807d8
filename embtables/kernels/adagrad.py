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
    # |g| / sqrt(a + g^2) <= 1, except when g^2 underflows: then |g| < 2e-19 and a >= a_min.
    ratio = max(1.001, 2e-19 / math.sqrt(lo[1]))
    return (w_dec + abs(lr) * ratio, hi[1] + g * g)


RECORD = KernelRecord(
    Adagrad,
    native_kind=1,
    native_name="adagrad",
    update_rows=update_rows,
    bounds=_bounds,
    slot_domains=slot_domains_of({"accumulators": "positive"}),  # the update divides by sqrt(a)
    monotone_slots=frozenset({"accumulators"}),
    v1_names=(("initial_accumulator_value", "initial_accumulator"),),
)
