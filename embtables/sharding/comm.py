"""The one module that imports ``torch.distributed``: thin, typed wrappers over its collectives.

Every other module asks this one about ranks and exchanges data through it, so the process-group
plumbing (the default group or a user's ``process_group=``) lives in one place. With no process group
initialised every function behaves as a world of one (rank 0, world size 1, collectives are identities).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

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
