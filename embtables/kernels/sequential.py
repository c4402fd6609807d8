"""Vectorised forms of the no-accumulation update (spec §10.2: occurrences applied one at a time, in
order) for the optimizers where one exists (their kernel record's ``in_order``: SGD, one ``index_add_``,
bit-identical; Adagrad, a per-row prefix sum of g^2), so the torch path needs no Python round per repeat
of the hottest id.

Weight decay and weight clipping act between occurrences, and the other optimizers' state feeds back
nonlinearly. Those keep the round-by-round loop (``segments.occurrence_rounds``).
"""

from __future__ import annotations

from torch import Tensor

from embtables.config.catalogue import Optimizer
from embtables.kernels.registry import record_of


def has_vectorised_form(opt: Optimizer) -> bool:
    """True when ``apply_in_order_`` can apply ``opt``'s no-accumulation update without rounds."""
    plain = not opt.weight_decay_factor and opt.clip_weight_min is None and opt.clip_weight_max is None
    return plain and record_of(opt).in_order is not None


def apply_in_order_(
    weights: Tensor, slots: tuple[Tensor, ...], rows: Tensor, grads: Tensor, *, opt: Optimizer, lr: float
) -> None:
    """Apply occurrences ``rows`` [N] with gradients ``grads`` [N, D], in order, to ``weights`` [V, D]
    and ``slots`` (in place), for an optimizer with ``has_vectorised_form``."""
    if rows.numel() == 0:
        return
    in_order = record_of(opt).in_order
    assert in_order is not None
    in_order(weights, slots, rows, grads, opt, lr)
