"""A cheap proof that a fused update writes only finite values, from bounds on its inputs.

An update must never write NaN or Inf into a table or slot (issue: "a legal call never produces
NaN/Inf silently"). Checking every new row exactly costs a second pass over the touched rows (40% of
a step on the standard workload), so the engine first asks ``update_is_finite``: from the largest
|summed gradient| (measured in phase 1 for free), the learning rate, the optimizer's constants and
per-tensor bounds on the table (the largest |value| of the weights and of each slot, and the smallest
value of each slot, tracked by the engine) it bounds, in float64 interval arithmetic, every value the
row update computes. Only when a bound passes ``SAFE`` (far below float32's 3.4e38, so float32
rounding cannot reach it) does the engine run the exact dry run. The proof is conservative: ``True``
means finite for every row; ``False`` means "not proven", never "not finite".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from embtables.config.catalogue import Optimizer
from embtables.config.extra_optimizers import (
    Adadelta,
    FrequencyEstimator,
    Momentum,
    ProximalAdagrad,
    ProximalYogi,
    RMSProp,
)
from embtables.config.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam

SAFE = 1e30  # every bounded intermediate must stay below this (float32 max is 3.4e38)
_F32_MIN_NORMAL = 1.1754944e-38


def _ok(*values: float) -> bool:
    return all(math.isfinite(v) and abs(v) < SAFE for v in values)


def update_is_finite(
    opt: Optimizer, lr: float, decay: float, gmax: float, hi: Sequence[float], lo: Sequence[float]
) -> bool:
    """True when the update provably writes only finite weights and slots (see ``update_bounds``)."""
    return update_bounds(opt, lr, decay, gmax, hi, lo) is not None


def bounds_compound(opt: Optimizer) -> bool:
    """True when the bounds of ``update_bounds`` grow geometrically over steps (FTRL: the weight is a
    quotient of its state), so the engine measures written values instead of carrying the bounds."""
    return isinstance(opt, FTRL)


def update_bounds(
    opt: Optimizer, lr: float, decay: float, gmax: float, hi: Sequence[float], lo: Sequence[float]
) -> tuple[float, ...] | None:
    """Upper bounds on |new value| of (weights, *slots) over every updated row, or None when the
    update is not proven finite.

    Args:
      opt: the table's optimizer config.
      lr: the learning rate of this step (float32 value); decay: the effective weight decay.
      gmax: max |summed gradient| over the updated rows (0 for rows with no gradient).
      hi: bound on max |value| of (weights, *slots), in ``opt.slot_names`` order.
      lo: bound on min value of (weights, *slots) (used for accumulators that divide).
    """
    if not _ok(lr, decay, gmax, *hi):
        return None
    lo_, hi_ = tuple(lo), tuple(hi)
    glo, ghi = opt.gradient_clip_bounds
    g = gmax
    if glo is not None and ghi is not None:
        g = min(g, max(abs(glo), abs(ghi)))
    lr_abs = abs(lr)
    w_dec = hi_[0] * (1.0 + abs(decay))
    if not _ok(w_dec, g * g):
        return None
    out: tuple[float, ...] | None = None
    if isinstance(opt, SGD):
        out = (w_dec + lr_abs * g,)
    elif isinstance(opt, Adagrad):
        a_min = lo_[1]
        if a_min > 0:
            # |g| / sqrt(a + g^2) <= 1, except when g^2 underflows: then |g| < 2e-19 and a >= a_min.
            ratio = max(1.001, 2e-19 / math.sqrt(a_min))
            out = (w_dec + lr_abs * ratio, hi_[1] + g * g)
    elif isinstance(opt, AdagradMomentum):
        if lo_[1] >= 0 and 0 < opt.beta2 <= 1 and opt.exponent > 0:
            precond = float(opt.epsilon) ** (-1.0 / float(opt.exponent))  # (a + eps)^(-1/exponent), a >= 0
            scaled = precond * g
            m_new = abs(opt.momentum) * hi_[2] + scaled
            update = abs(opt.momentum) * m_new + scaled if opt.use_nesterov else m_new
            if _ok(precond, scaled, update, hi_[1] + g * g + float(opt.epsilon)):
                out = (w_dec + lr_abs * update, hi_[1] + g * g, m_new)
    elif isinstance(opt, Adam):
        eps = float(opt.epsilon)
        den_min = eps if not opt.sum_inside_sqrt else math.sqrt(max(eps * eps * (1 - 1e-6), 0.0))
        if lo_[2] >= 0 and den_min >= _F32_MIN_NORMAL:
            m_new = max(hi_[1], g)
            out = (w_dec + lr_abs * m_new / den_min, m_new, hi_[2] + g * g + eps * eps)
    elif isinstance(opt, FTRL):
        out = _ftrl_bounds(opt, lr, w_dec, g, hi_, lo_)
    else:
        out = _extra_bounds(opt, lr, w_dec, g, hi_, lo_)
    return out if out is not None and _ok(*out) else None


def _extra_bounds(
    opt: Optimizer, lr: float, w_dec: float, g: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...] | None:
    """Bounds for the TPUEstimator-era optimizers (CenteredRMSProp is never proven: ``ms - mg^2`` may round
    below zero, so it always takes the exact dry run)."""
    lr_abs = abs(lr)
    if isinstance(opt, Momentum):
        m_new = abs(opt.momentum) * hi[1] + g
        step = g + abs(opt.momentum) * m_new if opt.use_nesterov else m_new
        return (w_dec + lr_abs * step, m_new)
    if isinstance(opt, RMSProp):
        eps = float(opt.epsilon)
        if lo[1] < 0 or not 0 <= opt.rho <= 1 or eps * (1 - 1e-6) < _F32_MIN_NORMAL:
            return None
        den_min = math.sqrt(eps * (1 - 1e-6))  # ms >= 0, so sqrt(ms + eps) >= sqrt(eps), less one rounding
        if not _ok(lr_abs * g):  # lr * g is formed before the division
            return None
        mom = abs(opt.momentum) * hi[2] + lr_abs * g / den_min
        return (w_dec + mom, hi[1] + g * g, mom)
    if isinstance(opt, Adadelta):
        eps = float(opt.epsilon)
        if lo[1] < 0 or lo[2] < 0 or not 0 <= opt.rho <= 1 or eps * (1 - 1e-6) < _F32_MIN_NORMAL:
            return None
        u = math.sqrt(hi[2] + eps) / math.sqrt(eps * (1 - 1e-6)) * g * (1 + 1e-6)
        if not _ok(u, u * u):
            return None
        return (w_dec + lr_abs * u, hi[1] + g * g, hi[2] + u * u)
    if isinstance(opt, ProximalAdagrad):
        a_min = lo[1]
        if not a_min > 0 or lr < 0:  # lr >= 0 keeps the proximal denominator 1 + lr_t * l2 >= 1
            return None
        lr_t = lr_abs / math.sqrt(a_min)
        ratio = max(1.001, 2e-19 / math.sqrt(a_min))  # |g| / sqrt(a + g^2), as for Adagrad
        l1, l2 = float(opt.l1_regularization_strength), float(opt.l2_regularization_strength)
        if not _ok(lr_t, lr_t * max(l1, l2)):
            return None
        return (w_dec + lr_abs * ratio, hi[1] + g * g)
    if isinstance(opt, ProximalYogi):
        eps = float(opt.epsilon)
        if lo[1] < 0 or lr < 0 or eps < _F32_MIN_NORMAL:  # v stays >= 0, so sqrt(v) + eps >= eps
            return None
        lr_t = lr_abs / eps
        m_new = max(hi[2], g)
        l1, l2 = float(opt.l1_regularization_strength), float(opt.l2_regularization_strength)
        if not _ok(lr_t, lr_t * m_new, lr_t * max(l1, l2)):
            return None
        return (w_dec + lr_t * m_new, hi[1] + g * g, m_new)
    if isinstance(opt, FrequencyEstimator):
        dc = lr_abs + hi[1]  # |t - last|, and min(., max_delta) only lowers it
        threshold = float(opt.outlier_threshold) * w_dec  # only compared, never written
        if not _ok(dc, threshold):
            return None
        return (w_dec + dc, lr_abs)
    return None


def _ftrl_bounds(
    opt: FTRL, lr: float, w_dec: float, g: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...] | None:
    p = -float(opt.learning_rate_power)
    n_min = lo[1]
    if not lr > 0 or not p >= 0 or not n_min >= 0 or (n_min == 0 and not opt.allow_zero_accumulator and p > 0):
        return None
    n_max = hi[1] + g * g
    power_max = max(1.0, n_max) ** p if p > 0 else 1.0  # n^p over n in [n_min, n_max]
    power_min = (n_min**p if n_min > 0 else 0.0) if p > 0 else 1.0
    l1, l2, beta = (float(opt.l1_regularization_strength), float(opt.l2_regularization_strength), float(opt.beta))
    if opt.multiply_linear_by_learning_rate:
        z = hi[2] + lr * g + power_max * w_dec
        den_min = power_min + 2.0 * lr * l2 + beta
        extra = lr * l1
    else:
        z = hi[2] + g + (power_max / lr) * w_dec
        den_min = (power_min + beta) / lr + 2.0 * l2
        extra = l1
    if not den_min > 1e-30 or not _ok(n_max, power_max, power_max / lr, z + extra):
        return None
    return ((z + extra) / den_min, n_max, z)
