"""SGD row math: ``w <- w - lr * g``."""

from __future__ import annotations

from torch import Tensor

from embtables.config.optimizers import SGD
from embtables.kernels.record import KernelRecord


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: SGD, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """New weights for rows ``w`` [U, D] given gradients ``g`` [U, D]; SGD has no slots."""
    del opt
    return w - lr * g, slots


def _bounds(
    opt: SGD, lr: float, g: float, w_dec: float, hi: tuple[float, ...], lo: tuple[float, ...]
) -> tuple[float, ...]:
    return (w_dec + abs(lr) * g,)


RECORD = KernelRecord(SGD, native_kind=0, native_name="sgd", update_rows=update_rows, bounds=_bounds)
