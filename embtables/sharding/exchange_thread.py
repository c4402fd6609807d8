"""Where a pipelined sharded module's background work runs: on an exchange thread of its own, or in place.

Pipelining (``pipeline_execution_with_tensor_core=True``) lets the early lookup of the next batch, the exchange
and sums of the last ``apply_gradients`` and the landing of the held-back update run while the caller computes
its dense model. That overlap pays when the dense model runs elsewhere (a GPU) or on cores the exchange thread
does not need. When every core of a rank is already busy with the dense model (no GPU, and no core left over
beyond the threads torch computes with), the two take turns on the same cores and the thread only adds its
switches: measured at 0.95x the synchronous step (W = 2 on 2 cores, one thread a rank, docs/sharding.md).
There the same work runs in place, in the calling thread, in the same order: the results are the same bits
either way (the lookup still reads the tables before the held-back update lands), only the overlap is gone.

Chosen once when the module is built, and the same on every rank (every rank's collectives must come in the
same order): the thread is used only when every rank has room for it. ``EMBTABLES_PIPELINE_THREAD`` forces the
choice: ``background`` or ``in_place`` (``auto``, the default, decides as above).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Any

import torch

from embtables.sharding import comm

logger = logging.getLogger("embtables")

ENV = "EMBTABLES_PIPELINE_THREAD"
CHOICES = ("auto", "background", "in_place")


@dataclasses.dataclass(frozen=True)
class RankRoom:
    """What one rank says about its room for an exchange thread: its host, the cores it may run on, the threads
    torch computes with, whether a GPU can take its dense model, and what ``EMBTABLES_PIPELINE_THREAD`` asks."""

    host: str
    cores: int
    threads: int
    gpu: bool
    forced: str  # EMBTABLES_PIPELINE_THREAD as this rank read it ("auto" when unset); checked by ``decide``


def _check_forced(rooms: list[RankRoom]) -> None:
    """Every rank raises the same ``ValueError`` when any rank's ``EMBTABLES_PIPELINE_THREAD`` is not a choice."""
    for i, r in enumerate(rooms):
        if r.forced not in CHOICES:
            raise ValueError(
                f"{ENV}={r.forced!r} on rank {i} is not a choice: use 'background' (pipelined work on its own "
                "thread), 'in_place' (in the calling thread) or 'auto' (the thread only where a GPU or a spare core "
                "can take it)."
            )


def this_rank(device: torch.device) -> RankRoom:
    """This process's ``RankRoom``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    gpu = device.type == "cuda" or torch.cuda.is_available()
    forced = os.environ.get(ENV, "").strip().lower() or "auto"
    return RankRoom(socket.gethostname(), cores, torch.get_num_threads(), gpu, forced)


def wants_thread(rank: RankRoom, ranks_on_host: int) -> bool:
    """Whether ``rank`` has room for the exchange thread: forced, or a GPU for the dense model, or more cores for
    itself (its cores shared with the other ranks of its host) than the threads torch computes with."""
    if rank.forced != "auto":
        return rank.forced == "background"
    return rank.gpu or rank.cores // max(1, ranks_on_host) > rank.threads


def without_room(rooms: list[RankRoom]) -> list[int]:
    """The ranks of ``rooms`` with no room for the exchange thread; the same answer (or the same error) from the
    same list on every rank."""
    _check_forced(rooms)
    hosts = [r.host for r in rooms]
    return [i for i, r in enumerate(rooms) if not wants_thread(r, hosts.count(r.host))]


def decide(rooms: list[RankRoom]) -> bool:
    """The thread only when every rank wants it."""
    return not without_room(rooms)


def choose(device: torch.device, group: Any) -> bool:
    """Whether a pipelined sharded module runs its background work on an exchange thread (collective: every
    rank reaches the same answer). The choice is logged once on rank 0."""
    mine = this_rank(device)
    rooms = [RankRoom(**r) for r in comm.all_gather_object(dataclasses.asdict(mine), group)]
    short = without_room(rooms)
    if comm.get_rank(group) == 0:
        if not short:
            logger.info("embtables: pipelined work runs on an exchange thread, overlapping the dense model")
        else:
            r = rooms[short[0]]
            logger.info(
                "embtables: pipelined work runs in place (same results, no overlap): rank %d %s; %s=background "
                "overlaps it anyway",
                short[0],
                "asked for it"
                if r.forced == "in_place"
                else f"has no GPU and {r.cores} core(s) shared by its host's ranks for {r.threads} torch thread(s)",
                ENV,
            )
    return not short
