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


def apply_in_order_(
    weights: Tensor, slots: tuple[Tensor, ...], rows: Tensor, grads: Tensor, opt: SGD, lr: float
) -> None:
    """Occurrences ``rows`` [N] with gradients ``grads`` [N, D] applied in order to ``weights`` [V, D]: one
    ``index_add_`` of ``-lr * g``. On CPU ``index_add_`` adds each row's sources one after another in index
    order, in float32, so this is bit-identical to the sequential loop."""
    weights.index_add_(0, rows, grads * -lr)  # (-lr) * g == -(lr * g) exactly


RECORD = KernelRecord(
    SGD, native_kind=0, native_name="sgd", update_rows=update_rows, bounds=_bounds, in_order=apply_in_order_
)
