"""SGD row math: ``w <- w - lr * g``."""

from __future__ import annotations

from torch import Tensor

from embtables.config.optimizers import SGD


def update_rows(
    w: Tensor, slots: tuple[Tensor, ...], g: Tensor, *, opt: SGD, lr: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """New weights for rows ``w`` [U, D] given gradients ``g`` [U, D]; SGD has no slots."""
    del opt
    return w - lr * g, slots
