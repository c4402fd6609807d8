"""A cheap proof that a fused update writes only finite values, from bounds on its inputs.

An update must never write NaN or Inf into a table or slot (issue: "a legal call never produces
NaN/Inf silently"). Checking every new row exactly costs a second pass over the touched rows (40% of
a step on the standard workload), so the engine first asks ``update_is_finite``: from the largest
|summed gradient| (measured in phase 1 for free), the learning rate, the optimizer's constants and
per-tensor bounds (the largest |value| of the weights and of each slot, and the smallest value of each
slot, measured by the engine over the rows the update touches) it bounds, in float64 interval
arithmetic, every value the row update computes. Only when a bound passes ``SAFE`` (far below
float32's 3.4e38, so float32 rounding cannot reach it) does the engine run the exact dry run. The
proof is conservative: ``True`` means finite for every row; ``False`` means "not proven", never "not
finite".
"""

from __future__ import annotations

from collections.abc import Sequence

from embtables.config.catalogue import Optimizer
from embtables.kernels.record import F32_MIN_NORMAL, SAFE, bounded
from embtables.kernels.registry import record_of

__all__ = ["SAFE", "update_bounds", "update_is_finite"]


def update_is_finite(
    opt: Optimizer, lr: float, decay: float, gmax: float, hi: Sequence[float], lo: Sequence[float]
) -> bool:
    """True when the update provably writes only finite weights and slots (see ``update_bounds``)."""
    return update_bounds(opt, lr, decay, gmax, hi, lo) is not None


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

    A positive ``lo`` below the smallest normal float32 counts as 0: the kernels read subnormals as zero (spec
    §1.5), so such an accumulator divides by zero.
    """
    hi_ = tuple(hi)
    lo_ = tuple(0.0 if 0 < v < F32_MIN_NORMAL else v for v in lo)
    if not bounded(lr, decay, gmax, *hi_):
        return None
    glo, ghi = opt.gradient_clip_bounds
    g = gmax
    if glo is not None and ghi is not None:
        g = min(g, max(abs(glo), abs(ghi)))
    w_dec = hi_[0] * (1.0 + abs(decay))
    if not bounded(w_dec, g * g):
        return None
    prove = record_of(opt).bounds
    out = None if prove is None else prove(opt, lr, g, w_dec, hi_, lo_)
    return out if out is not None and bounded(*out) else None
