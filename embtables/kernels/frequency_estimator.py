"""FrequencyEstimator row math (spec §1.3, TF proto ``FrequencyEstimatorParameters``)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.extra_optimizers import FrequencyEstimator
from embtables.kernels.float32 import as_float32, one_minus
from embtables.kernels.record import KernelRecord, bounded


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: FrequencyEstimator, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Rows ``w`` [U, D] (the estimate D), slots ``(last_hit_step,)`` [U, D]; ``g`` is ignored and ``lr`` is
    the global step t.

    ``delta = t - last; dc = min(delta, max_delta); out = delta >= outlier_threshold D;
    D <- dc if out else D (1-tau) + dc tau; last <- t``.
    """
    del g
    (last,) = slots
    t = lr
    delta = t - last
    dc = torch.clamp(delta, max=as_float32(opt.max_delta))
    outlier = delta >= as_float32(opt.outlier_threshold) * w
    smoothed = w * one_minus(opt.tau) + dc * as_float32(opt.tau)
    return torch.where(outlier, dc, smoothed), (torch.full_like(last, t),)


def _bounds(
    opt: FrequencyEstimator, lr: float, g: float, w_dec: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...] | None:
    dc = abs(lr) + hi[1]  # |t - last|, and min(., max_delta) only lowers it
    threshold = float(opt.outlier_threshold) * w_dec  # only compared, never written
    if not bounded(dc, threshold):
        return None
    return (w_dec + dc, abs(lr))


RECORD = KernelRecord(
    FrequencyEstimator,
    native_kind=11,
    native_name="frequency_estimator",
    update_rows=update_rows,
    constant_names=("max_delta", "outlier_threshold", "one_minus_tau", "tau"),
    constants=lambda opt, lr: {
        "max_delta": as_float32(opt.max_delta),
        "outlier_threshold": as_float32(opt.outlier_threshold),
        "one_minus_tau": one_minus(opt.tau),
        "tau": as_float32(opt.tau),
    },
    bounds=_bounds,
)
