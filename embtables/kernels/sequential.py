"""Vectorised forms of the no-accumulation update (spec §10.2: occurrences applied one at a time, in
order) for the optimizers where one exists (their kernel record's ``in_order``: SGD, one ``index_add_``,
bit-identical; Adagrad, a per-row prefix sum of g^2), so the torch path needs no Python round per repeat
of the hottest id.

Weight decay and weight clipping act between occurrences, and the other optimizers' state feeds back
nonlinearly. Those keep the round-by-round loop (``segments.occurrence_rounds``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.catalogue import Optimizer
from embtables.kernels.registry import record_of


def has_vectorised_form(opt: Optimizer) -> bool:
    """True when ``apply_in_order_`` can apply ``opt``'s no-accumulation update without rounds."""
    plain = not opt.weight_decay_factor and opt.clip_weight_min is None and opt.clip_weight_max is None
    return plain and record_of(opt).in_order is not None


# Every nonzero magnitude in [2^-50, 2^50] (touched weights and slots, gradients, the learning rate): then no
# product (lr * g, g^2: at least 2^-100), quotient (by sqrt(a) <= 2^25) or sum (of multiples of 2^-73, or of
# values apart by more than a factor 2) in these forms is a nonzero subnormal, so skipping the flush of each
# occurrence's results (spec §1.5) changes nothing.
_FLUSH_FREE = (2.0**-50, 2.0**50)


def apply_in_order_(
    weights: Tensor, slots: tuple[Tensor, ...], rows: Tensor, grads: Tensor, *, opt: Optimizer, lr: float
) -> bool:
    """Apply occurrences ``rows`` [N] with gradients ``grads`` [N, D], in order, to ``weights`` [V, D]
    and ``slots`` (in place), for an optimizer with ``has_vectorised_form``. Returns False, changing nothing,
    when a value is outside the range where the vectorised form flushes subnormals as each occurrence's
    update would (``_FLUSH_FREE``): the caller then applies the occurrences round by round."""
    if rows.numel() == 0:
        return True
    in_order = record_of(opt).in_order
    assert in_order is not None
    touched = torch.unique(rows)
    values = [grads, *(t.index_select(0, touched) for t in (weights, *slots))]
    low, high = _FLUSH_FREE
    if not low <= abs(lr) <= high and lr != 0:
        return False
    for v in values:
        magnitude = v.abs()
        if bool(((magnitude < low) & (magnitude != 0)).any()) or bool((magnitude > high).any()):
            return False
    in_order(weights, slots, rows, grads, opt, lr)
    return True
