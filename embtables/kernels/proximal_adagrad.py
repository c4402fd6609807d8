"""ProximalAdagrad row math (spec §1.3, TF ApplyProximalAdagrad)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from embtables.config.extra_optimizers import ProximalAdagrad
from embtables.kernels.adagrad import step_ratio_bound
from embtables.kernels.float32 import as_float32, scalar_over
from embtables.kernels.record import KernelRecord, bounded, slot_domains_of
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


def _bounds(
    opt: ProximalAdagrad, lr: float, g: float, w_dec: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...] | None:
    a_min = lo[1]
    if not a_min > 0 or lr < 0:  # lr >= 0 keeps the proximal denominator 1 + lr_t * l2 >= 1
        return None
    lr_t = abs(lr) / math.sqrt(a_min)
    l1, l2 = float(opt.l1_regularization_strength), float(opt.l2_regularization_strength)
    if not bounded(lr_t, lr_t * max(l1, l2)):
        return None
    return (w_dec + abs(lr) * step_ratio_bound(a_min), hi[1] + g * g)


RECORD = KernelRecord(
    ProximalAdagrad,
    native_kind=5,
    native_name="proximal_adagrad",
    update_rows=update_rows,
    constant_names=("l1", "l2"),
    constants=lambda opt, lr: {
        "l1": as_float32(opt.l1_regularization_strength),
        "l2": as_float32(opt.l2_regularization_strength),
    },
    bounds=_bounds,
    slot_domains=slot_domains_of({"accumulators": "positive"}),
    v1_names=(("initial_accumulator_value", "initial_accumulator"),),
)
