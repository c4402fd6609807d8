"""Pooled lookup over a canonical batch, and the per-occurrence gradient of it (spec §2.1).

A feature batch is canonical when it is ``ids`` [N], a non-decreasing segment index ``seg`` [N]
into S output rows, ``offsets`` [S+1] and optional per-id coefficients ``coeffs`` [N] (already
``s_b * w_k``; None means 1). Pooled, sequence and dense inputs all reduce to this form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from embtables.kernels.subnormals import flush


def quantize(x: Tensor, num_buckets: int, lower: float, upper: float) -> Tensor:
    """Simulated quantization of looked-up values (spec §2.1)."""
    step = (upper - lower) / (num_buckets - 1)
    x = torch.clamp(x, lower, upper)
    return torch.floor((x - lower) / step + 0.5) * step + lower


def pooled_lookup(
    table: Tensor,
    ids: Tensor,
    seg: Tensor,
    offsets: Tensor,
    coeffs: Tensor | None,
    *,
    quantization: tuple[int, float, float] | None = None,
) -> Tensor:
    """``out[s] = sum_{k in s} coeffs[k] * table[ids[k]]``: [S, D] float32 from ``table`` [V, D]; empty -> 0.
    The gathered rows [N, D] are read as float32 with subnormals flushed to zero, pooled in float32 in the
    order of a plain embedding bag over them, and the pooled values flushed (spec §1.5)."""
    rows = flush(table.index_select(0, ids).to(torch.float32))
    if quantization is not None:
        rows = quantize(rows, *quantization)
    if coeffs is not None:
        rows = flush(rows * flush(coeffs).unsqueeze(1))
    if _sums_stay_normal(rows):
        positions = torch.arange(ids.numel(), dtype=torch.int64, device=ids.device)
        return F.embedding_bag(positions, rows, offsets, mode="sum", include_last_offset=True)
    return _summed_in_rounds(rows, seg, offsets)


def _sums_stay_normal(products: Tensor) -> bool:
    """Whether every nonzero magnitude of ``products`` [N, D] is at least 2^-100: float32 values that large
    are multiples of 2^-123, so no partial sum of them (nor the sum) is a nonzero subnormal, and a plain sum
    is what the C kernels' running sum with every result flushed gives."""
    return not bool((F.hardshrink(products, 2.0**-100) != products).any())


def _summed_in_rounds(products: Tensor, seg: Tensor, offsets: Tensor) -> Tensor:
    """``products`` [N, D] summed per bag [S, D] in id order with every partial sum flushed: round k adds the
    k-th product of every bag that has one."""
    out = torch.zeros((offsets.numel() - 1, products.shape[1]), dtype=torch.float32, device=products.device)
    position = torch.arange(seg.numel(), device=seg.device) - offsets[seg]
    for k in range(int(position.max()) + 1 if seg.numel() else 0):
        at = (position == k).nonzero().squeeze(1)
        out = flush(out.index_add_(0, seg[at], products[at]))
    return out


def occurrence_gradients(grad: Tensor, seg: Tensor, coeffs: Tensor | None) -> Tensor:
    """Per-occurrence gradients [N, D] = ``coeffs[k] * grad[seg[k]]`` from ``grad`` [S, D], subnormals flushed."""
    g = flush(grad.index_select(0, seg))
    return g if coeffs is None else flush(g * flush(coeffs).unsqueeze(1))
