"""Pooled lookup over a canonical batch, and the per-occurrence gradient of it (spec §2.1).

A feature batch is canonical when it is ``ids`` [N], a non-decreasing segment index ``seg`` [N]
into S output rows, ``offsets`` [S+1] and optional per-id coefficients ``coeffs`` [N] (already
``s_b * w_k``; None means 1). Pooled, sequence and dense inputs all reduce to this form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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
    A half-precision table's rows are read as float32 and pooled in float32, in the order a float32 table's
    are (the gathered rows [N, D] pooled as a table of their own)."""
    num_segments = offsets.numel() - 1
    if quantization is None:
        if table.dtype != torch.float32:
            rows = table.index_select(0, ids).to(torch.float32)
            ids = torch.arange(ids.numel(), dtype=torch.int64, device=ids.device)
            return F.embedding_bag(ids, rows, offsets, mode="sum", per_sample_weights=coeffs, include_last_offset=True)
        return F.embedding_bag(ids, table, offsets, mode="sum", per_sample_weights=coeffs, include_last_offset=True)
    rows = quantize(table.index_select(0, ids), *quantization)
    if coeffs is not None:
        rows = rows * coeffs.unsqueeze(1)
    out = torch.zeros((num_segments, table.shape[1]), dtype=table.dtype, device=table.device)
    return out.index_add_(0, seg, rows)


def occurrence_gradients(grad: Tensor, seg: Tensor, coeffs: Tensor | None) -> Tensor:
    """Per-occurrence gradients [N, D] = ``coeffs[k] * grad[seg[k]]`` from ``grad`` [S, D]."""
    g = grad.index_select(0, seg)
    return g if coeffs is None else g * coeffs.unsqueeze(1)
