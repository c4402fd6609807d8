"""Derived optimizer constants in float32, as TF computes them (spec: all arithmetic is float32).

TF receives float32 hyper-parameters and derives ``1 - beta_1``, ``eps * eps``, ``2 * l2``,
``lr * l1``, ``-1 / exponent``... in float32. Computing them in Python's float64 and rounding once
gives a different float32 (``1 - beta_2`` for beta_2 = 0.999 is off by 1.3e-5 relative), so both
kernel paths take their constants from here. Each function returns a Python float that holds a
float32 value exactly.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from embtables.config.optimizers import as_float32 as as_float32  # the one float32 rounding
from embtables.kernels.subnormals import flush_scalar


def one_minus(x: float) -> float:
    """``1 - x`` in float32."""
    return float(np.float32(1.0) - np.float32(x))


def times(*xs: float) -> float:
    """The product of ``xs`` in float32, left to right, subnormal operands and products flushed to zero as the
    kernels' arithmetic flushes them (spec §1.5)."""
    out = np.float32(1.0)
    with np.errstate(over="ignore", under="ignore"):
        for i, x in enumerate(xs):
            operand = np.float32(flush_scalar(float(np.float32(x))))
            out = operand if i == 0 else np.float32(flush_scalar(float(out * operand)))
    return float(out)


def neg_reciprocal(x: float) -> float:
    """``-1 / x`` in float32."""
    return float(np.float32(-1.0) / np.float32(x))


def scalar_over(s: float, t: Tensor) -> Tensor:
    """``s / t`` with IEEE division of each element. (``float / tensor`` in torch multiplies by the
    reciprocal, one rounding more than C's ``s / x`` and TF's, so it can differ in the last bit.)"""
    return torch.full_like(t, s) / t
