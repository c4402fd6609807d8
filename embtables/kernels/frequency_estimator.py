"""FrequencyEstimator row math (spec §1.3, TF proto ``FrequencyEstimatorParameters``)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.extra_optimizers import FrequencyEstimator
from embtables.kernels.float32 import as_float32, one_minus


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
