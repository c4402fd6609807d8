"""Segment arithmetic on flat id lists: offsets, dedup-and-sum, occurrence rounds. O(N log N)."""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.kernels.subnormals import flush


def offsets_from_segments(seg: Tensor, num_segments: int) -> Tensor:
    """Offsets [S+1] of a non-decreasing segment index ``seg`` [N] over ``num_segments`` (S) segments."""
    counts = torch.bincount(seg, minlength=num_segments)
    out = torch.zeros(num_segments + 1, dtype=torch.int64, device=seg.device)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def segments_from_offsets(offsets: Tensor, num_elements: int | None = None) -> Tensor:
    """The segment index [N] of every element, from offsets [S+1] (inverse of ``offsets_from_segments``).
    ``num_elements`` (N, when the caller knows it) spares a CUDA device a sync to size the result."""
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(
        torch.arange(counts.numel(), device=offsets.device), counts, output_size=num_elements
    )


def segment_sum(values: Tensor, seg: Tensor, num_segments: int) -> Tensor:
    """Sum ``values`` [N, ...] into ``num_segments`` rows by segment index ``seg`` [N]."""
    out = torch.zeros((num_segments, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, seg, values)


def dedup_sum(ids: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """Unique rows [U] (sorted) and the float32 sum of ``grads`` [N, D] per unique row [U, D], subnormal sums
    flushed to zero (spec §1.5; ``grads`` are flushed already: ``lookup.occurrence_gradients``)."""
    rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    summed = torch.zeros((rows.numel(), grads.shape[1]), dtype=torch.float32, device=grads.device)
    summed.index_add_(0, inverse, grads.to(torch.float32))
    return rows, flush(summed)


def occurrence_rounds(ids: Tensor) -> list[Tensor]:
    """Split positions 0..N-1 of ``ids`` [N] into rounds of distinct ids, keeping occurrence order.

    Round k holds the positions of the (k+1)-th occurrence of every id that occurs more than k
    times, so applying round 0, then round 1, ... applies each id's occurrences in order while
    every round is one vectorised update over distinct rows (spec §10.2).
    """
    n = ids.numel()
    if n == 0:
        return []
    order = torch.sort(ids, stable=True).indices  # stable: equal ids keep occurrence order
    sorted_ids = ids[order]
    pos = torch.arange(n, device=ids.device)
    is_start = torch.ones(n, dtype=torch.bool, device=ids.device)
    is_start[1:] = sorted_ids[1:] != sorted_ids[:-1]
    group_start = torch.cummax(torch.where(is_start, pos, torch.zeros_like(pos)), 0).values
    rank = torch.empty_like(pos)
    rank[order] = pos - group_start
    num_rounds = int(rank.max().item()) + 1
    by_round = torch.sort(rank, stable=True).indices
    counts = torch.bincount(rank, minlength=num_rounds).tolist()
    return list(torch.split(by_round, counts))
