"""Adagrad row math (TPU form): ``a <- a + g^2; w <- w - lr * g / sqrt(a)``, no epsilon."""

from __future__ import annotations

import math

import torch
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


def apply_in_order_(
    weights: Tensor, slots: tuple[Tensor, ...], rows: Tensor, grads: Tensor, opt: Adagrad, lr: float
) -> None:
    """Occurrences ``rows`` [N] with gradients ``grads`` [N, D] applied in order to ``weights`` [V, D] and the
    accumulators: the accumulator before occurrence k of a row is ``a_0 + sum_{j<=k} g_j^2``, a per-row prefix
    sum, computed in float64 and rounded once (the sequential loop rounds at every addition, so this agrees
    with the native kernels to float32 rounding, not bit for bit); then ``w <- w - lr*g_k/sqrt(a_k)`` in order
    is one ``index_add_``."""
    (acc,) = slots
    order = torch.sort(rows, stable=True).indices  # occurrences of one row stay in order
    r, g = rows[order], grads[order]
    sq = (g * g).double()
    csum = torch.cumsum(sq, 0)
    start = torch.ones(r.numel(), dtype=torch.bool, device=r.device)
    start[1:] = r[1:] != r[:-1]
    first = torch.cummax(torch.where(start, torch.arange(r.numel(), device=r.device), 0), 0).values
    before_row = torch.where((first > 0).unsqueeze(1), csum[(first - 1).clamp(min=0)], 0.0)  # [N, D]
    a_k = (acc.index_select(0, r).double() + (csum - before_row)).float()
    step = (lr * g) / sqrt_f32(a_k)
    last = torch.ones_like(start)
    last[:-1] = start[1:]
    acc.index_copy_(0, r[last], a_k[last])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    weights.index_add_(0, rows, -step[inverse])  # back in occurrence order: index_add_ adds in index order


RECORD = KernelRecord(
    Adagrad,
    native_kind=1,
    native_name="adagrad",
    update_rows=update_rows,
    bounds=_bounds,
    slot_domains=slot_domains_of({"accumulators": "positive"}),  # the update divides by sqrt(a)
    v1_names=(("initial_accumulator_value", "initial_accumulator"),),
    in_order=apply_in_order_,
)
