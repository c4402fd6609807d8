"""Vectorised forms of the no-accumulation update (spec §10.2: occurrences applied one at a time, in
order) for the optimizers where one exists, so the torch path needs no Python round per repeat of
the hottest id.

- SGD: ``w <- w - lr*g`` applied in order is one ``index_add_`` of ``-lr*g``. On CPU ``index_add_``
  adds each row's sources one after another in index order, in float32, so this is bit-identical to
  the sequential loop.
- Adagrad: the accumulator before occurrence k of a row is ``a_0 + sum_{j<=k} g_j^2``, a per-row
  prefix sum. It is computed in float64 and rounded once, where the sequential loop rounds at every
  addition, so it agrees with the native kernels to float32 rounding, not bit for bit. Then
  ``w <- w - lr*g_k/sqrt(a_k)`` in order is one ``index_add_``.

Weight decay and weight clipping act between occurrences, and the other optimizers' state feeds back
nonlinearly. Those keep the round-by-round loop (``segments.occurrence_rounds``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.config.catalogue import Optimizer
from embtables.config.optimizers import SGD, Adagrad
from embtables.kernels.sqrt import sqrt_f32


def has_vectorised_form(opt: Optimizer) -> bool:
    """True when ``apply_in_order_`` can apply ``opt``'s no-accumulation update without rounds."""
    plain = not opt.weight_decay_factor and opt.clip_weight_min is None and opt.clip_weight_max is None
    return plain and type(opt) in (SGD, Adagrad)


def apply_in_order_(
    weights: Tensor, slots: tuple[Tensor, ...], rows: Tensor, grads: Tensor, *, opt: Optimizer, lr: float
) -> None:
    """Apply occurrences ``rows`` [N] with gradients ``grads`` [N, D], in order, to ``weights`` [V, D]
    and ``slots`` (in place), for an optimizer with ``has_vectorised_form``."""
    if rows.numel() == 0:
        return
    if isinstance(opt, SGD):
        weights.index_add_(0, rows, grads * -lr)  # (-lr) * g == -(lr * g) exactly
        return
    (acc,) = slots
    order = torch.sort(rows, stable=True).indices  # occurrences of one row stay in order
    r, g = rows[order], grads[order]
    sq = (g * g).double()
    csum = torch.cumsum(sq, 0)
    start = torch.ones(r.numel(), dtype=torch.bool, device=r.device)
    start[1:] = r[1:] != r[:-1]
    first = torch.cummax(torch.where(start, torch.arange(r.numel(), device=r.device), 0), 0).values
    before_row = torch.where((first > 0).unsqueeze(1), csum[(first - 1).clamp(min=0)], 0.0)  # [N, D]
    a_k = (acc.index_select(0, r).double() + (csum - before_row)).float()
    step = (lr * g) / sqrt_f32(a_k)
    last = torch.ones_like(start)
    last[:-1] = start[1:]
    acc.index_copy_(0, r[last], a_k[last])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    weights.index_add_(0, rows, -step[inverse])  # back in occurrence order: index_add_ adds in index order
