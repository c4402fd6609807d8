"""Correctly rounded float32 square root on the torch path.

``torch.sqrt`` on CPU float32 uses a vectorised approximation that is 1 ulp off IEEE ``sqrtf`` for
some inputs; the native kernels (and TF) use the correctly rounded ``sqrtf``. The square root of a
float32 computed in float64 and rounded to float32 is exactly ``sqrtf`` (float64 has more than
2 * 24 + 2 bits, so the double rounding is innocuous), so both kernel paths agree bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sqrt_f32(x: Tensor) -> Tensor:
    """IEEE-exact ``sqrtf`` of a float32 tensor (any shape)."""
    if x.dtype != torch.float32:
        return torch.sqrt(x)
    return torch.sqrt(x.double()).float()
