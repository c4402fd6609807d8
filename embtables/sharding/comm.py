"""The one module that imports ``torch.distributed``: thin, typed wrappers over its collectives.

Every other module asks this one about ranks and exchanges data through it, so the process-group
plumbing (the default group or a user's ``process_group=``) lives in one place. With no process group
initialised every function behaves as a world of one (rank 0, world size 1, collectives are identities).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup = Any  # torch.distributed.ProcessGroup; typed loosely so callers need not import it


def is_distributed(group: ProcessGroup | None = None) -> bool:
    """True when a process group is usable: ``group`` given, or the default group initialised."""
    if not dist.is_available():
        return False
    return group is not None or dist.is_initialized()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (0 when not distributed)."""
    return int(dist.get_rank(group)) if is_distributed(group) else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks W in ``group`` (1 when not distributed)."""
    return int(dist.get_world_size(group)) if is_distributed(group) else 1


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (no-op when not distributed)."""
    if is_distributed(group):
        dist.barrier(group)


def all_gather_object(obj: object, group: ProcessGroup | None = None) -> list[Any]:
    """``[obj of rank 0, ..., obj of rank W-1]`` (picklable objects); ``[obj]`` when not distributed."""
    if not is_distributed(group):
        return [obj]
    out: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: object, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``src`` is a rank of ``group``); ``obj`` when not distributed."""
    if not is_distributed(group):
        return obj
    box = [obj]
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast_object_list(box, src=global_src, group=group)
    return box[0]


def all_to_all_v(send: Tensor, send_counts: list[int], group: ProcessGroup | None = None) -> tuple[Tensor, list[int]]:
    """Exchange rows with every rank: the first ``send_counts[0]`` rows of ``send`` [N, ...] go to rank
    0, the next ``send_counts[1]`` to rank 1, and so on. Returns the received rows [M, ...], concatenated
    in source-rank order, and how many came from each rank [W]. The counts are exchanged first, so
    every rank may send a different number of rows (including none)."""
    world = get_world_size(group)
    if len(send_counts) != world or sum(send_counts) != send.shape[0] or min(send_counts, default=0) < 0:
        raise ValueError(
            f"all_to_all_v: send_counts {send_counts} must have {world} non-negative entries adding up to the "
            f"{send.shape[0]} rows sent."
        )
    if not is_distributed(group):
        return send.clone(), list(send_counts)
    counts = torch.tensor(send_counts, dtype=torch.int64, device=send.device)
    recv_counts_t = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts_t, counts, group=group)
    recv_counts = [int(c) for c in recv_counts_t.tolist()]
    out = torch.empty((sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(out, send.contiguous(), recv_counts, list(send_counts), group=group)
    return out, recv_counts


def all_gather_v(local: Tensor, group: ProcessGroup | None = None) -> list[Tensor]:
    """Every rank's ``local`` [n_r, ...] (the first dimension may differ between ranks), in rank order."""
    if not is_distributed(group):
        return [local.clone()]
    sizes = [int(n) for n in all_gather_object(int(local.shape[0]), group)]
    biggest = max(sizes)
    padded = torch.zeros((biggest, *local.shape[1:]), dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded, group=group)
    return [t[:n] for t, n in zip(out, sizes)]


def any_rank(flag: bool, group: ProcessGroup | None = None) -> bool:
    """True on every rank when ``flag`` is True on at least one (so all ranks take the same branch,
    e.g. all refuse a step in which one rank saw a bad id)."""
    if not is_distributed(group):
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
