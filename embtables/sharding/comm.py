"""The one module that imports ``torch.distributed``: thin, typed wrappers over its collectives.

Every other module asks this one about ranks and exchanges data through it, so the process-group
plumbing (the default group or a user's ``process_group=``) lives in one place. With no process group
initialised every function behaves as a world of one (rank 0, world size 1, collectives are identities).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import math
import os
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from embtables.sharding import shm_channel
from embtables.tables import phase_profile

ProcessGroup = Any  # torch.distributed.ProcessGroup; typed loosely so callers need not import it

logger = logging.getLogger("embtables")


# Bytes this process sent to other ranks through all_to_all_v, by kind of payload (for benchmarks
# and logs; a send to itself is not counted). Reset it freely.
bytes_sent: dict[str, int] = {}


class CollectiveError(RuntimeError):
    """A collective with the other ranks failed: a peer raised, died, or did not arrive in time."""


@contextlib.contextmanager
def _collective(what: str, group: ProcessGroup | None) -> Iterator[None]:
    """Re-raise a failed collective as ``CollectiveError`` saying what the ranks were doing."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # DistBackendError and gloo/NCCL errors are RuntimeErrors
        raise CollectiveError(
            f"embtables: rank {get_rank(group)} of {get_world_size(group)}: the {what} with the other ranks failed. "
            "Another rank raised an error, died, or did not reach this step within the process group's timeout "
            "(DistributedEmbedding(timeout=...) or init_process_group(timeout=...)); its own traceback has the "
            f"cause. Every rank must make the same calls in the same order. ({type(exc).__name__}: {exc})"
        ) from exc


_exit_hook_registered = False


# The shared-memory channel of each process group (None: the group's own collectives), by group object.
_channels: dict[Any, shm_channel.ShmChannel | None] = {}


def _open_channel(group: ProcessGroup | None) -> shm_channel.ShmChannel | None:
    """Set up the shared-memory channel of a gloo group whose ranks all run on one host (collective;
    every rank reaches the same answer, None when any rank cannot take part)."""
    if dist.get_backend(group) != "gloo" or get_world_size(group) < 2:
        return None
    rank, world = get_rank(group), get_world_size(group)
    here = shm_channel.host_identity()
    with _collective("set-up of the shared-memory channel", group):
        seen: list[Any] = [None] * world
        dist.all_gather_object(seen, (here, secrets.token_hex(8)), group=group)
        if here is None or any(identity != here for identity, _ in seen):
            return None
        token = str(seen[0][1])
        with contextlib.suppress(OSError):
            swept = shm_channel.sweep_orphans()
            if swept:
                logger.info("embtables: removed %d shared-memory file(s) left by killed jobs: %s", len(swept), swept)
        fds: list[int] = []
        channel = None
        try:
            with contextlib.suppress(OSError):
                fds.append(shm_channel.create_own(token, rank, world))
            made = [False] * world
            dist.all_gather_object(made, bool(fds), group=group)
            if all(made):
                with contextlib.suppress(OSError):
                    fds += [shm_channel.open_peer(token, r, world) for r in range(world) if r != rank]
                    ordered = fds[1 : rank + 1] + fds[:1] + fds[rank + 1 :]  # rank order, this rank's own in place
                    timeout_s = timeout_of(group)  # None: torch's documented default of 30 minutes
                    channel = shm_channel.ShmChannel(rank, world, ordered, 1800.0 if timeout_s is None else timeout_s)
            opened = [False] * world
            dist.all_gather_object(opened, channel is not None, group=group)
        finally:  # every rank has opened it, given up or failed: no name is left behind
            shm_channel.unlink_own(token, rank)
            if channel is not None and not all(opened):
                channel.close()  # closes every descriptor it holds
                channel = None
            elif channel is None:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
    return channel


def _channel(group: ProcessGroup | None) -> shm_channel.ShmChannel | None:
    """The group's shared-memory channel, set up at the first exchange (collective then). A channel that
    broke (every rank sees that in the same exchange or its next one) is closed, and the group's own
    collectives carry every later exchange: training, ``save`` and ``state_dict`` go on after a failure
    of the shared memory (a full /dev/shm), slower."""
    pg = group if group is not None else dist.group.WORLD
    if pg not in _channels:
        _channels[pg] = _open_channel(group)
    channel = _channels[pg]
    if channel is not None and channel.broken is not None:
        logger.warning(
            "embtables: rank %d: the shared-memory exchange broke (%s); the ranks exchange through the process "
            "group (%s) from now on",
            get_rank(group),
            channel.broken,
            dist.get_backend(group),
        )
        channel.close()
        _channels[pg] = channel = None
    return channel


def transport(group: ProcessGroup | None = None) -> str:
    """How the per-step exchanges of ``group`` travel: ``"shared memory"`` between the processes of one
    host, else the backend's name (``"gloo"``, ``"nccl"``); ``"local"`` when not distributed. Collective
    the first time (it sets the channel up)."""
    if not is_distributed(group) or get_world_size(group) < 2:
        return "local"
    return "shared memory" if _channel(group) is not None else str(dist.get_backend(group))


def _leave_at_exit() -> None:
    """At interpreter exit: tear down the process groups (embtables' and, if the program left it up,
    the default one) before Python finalises. Left alive, gloo's threads can outlive the interpreter
    and end the process with SIGABRT ("terminate called without an active exception") in about one
    exit in four, so torchrun reports a finished job as failed. Modules caught in reference cycles are
    collected first, so the groups they hold are released now and not during finalisation."""
    gc.collect()
    for channel in _channels.values():
        if channel is not None:
            channel.close()
    _channels.clear()
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def clean_exit() -> None:
    """Make this process leave its process groups cleanly at exit (idempotent; called whenever
    embtables joins or uses a distributed group)."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_leave_at_exit)
        _exit_hook_registered = True


def new_group(timeout_s: float | None, group: ProcessGroup | None = None) -> ProcessGroup:
    """A process group over the ranks of ``group`` (default: all) whose collectives give up after
    ``timeout_s`` seconds (None: the backend's default). Collective: every rank of the default group
    must call it."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    with _collective("creation of embtables' process group", group):
        return dist.new_group(ranks=ranks, timeout=timeout)


def timeout_of(group: ProcessGroup | None = None) -> float | None:
    """The timeout in seconds of ``group``'s collectives (default: the default group), as given to
    ``init_process_group(timeout=...)``; None where the backend does not say."""
    try:
        pg = group if group is not None else dist.group.WORLD
        backend = pg._get_backend(collective_device(group))  # type: ignore[union-attr]
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


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


def collective_device(group: ProcessGroup | None = None) -> torch.device:
    """Where small control tensors (counts, flags) must live for ``group``'s backend: the current
    CUDA device under NCCL, else the CPU."""
    if is_distributed(group) and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (no-op when not distributed)."""
    if is_distributed(group):
        with _collective("barrier", group):
            dist.barrier(group)


def all_gather_object(obj: object, group: ProcessGroup | None = None) -> list[Any]:
    """``[obj of rank 0, ..., obj of rank W-1]`` (picklable objects); ``[obj]`` when not distributed."""
    if not is_distributed(group):
        return [obj]
    out: list[Any] = [None] * get_world_size(group)
    phase_profile.count_message(0)  # pickled: its size is not known here
    with _collective("exchange of objects", group):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: object, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``src`` is a rank of ``group``); ``obj`` when not distributed."""
    if not is_distributed(group):
        return obj
    box = [obj]
    global_src = dist.get_global_rank(group, src) if group is not None else src
    with _collective("broadcast of an object", group):
        dist.broadcast_object_list(box, src=global_src, group=group)
    return box[0]


def all_to_all_v(
    send: Tensor | Sequence[Tensor],
    send_counts: list[int],
    group: ProcessGroup | None = None,
    recv_counts: list[int] | None = None,
) -> tuple[Tensor, list[int]]:
    """Exchange rows with every rank: the first ``send_counts[0]`` rows of ``send`` [N, ...] go to rank
    0, the next ``send_counts[1]`` to rank 1, and so on. Returns the received rows [M, ...], concatenated
    in source-rank order, and how many came from each rank [W]. Unless the caller already knows
    ``recv_counts``, the sizes travel too, so every rank may send a different number of rows (including
    none). ``send`` may be a list of pieces with the same dtype and row shape, read as their
    concatenation along dim 0 (over shared memory they are copied straight into the message)."""
    pieces = [send] if isinstance(send, Tensor) else list(send)
    if not pieces:
        raise ValueError("all_to_all_v: nothing to send: give a tensor (it may have 0 rows) or at least one piece.")
    first = pieces[0]
    if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] or p.device != first.device for p in pieces):
        raise ValueError("all_to_all_v: the pieces to send must share one dtype, device and row shape.")
    rows = sum(int(p.shape[0]) for p in pieces)
    world = get_world_size(group)
    if len(send_counts) != world or sum(send_counts) != rows or min(send_counts, default=0) < 0:
        raise ValueError(
            f"all_to_all_v: send_counts {send_counts} must have {world} non-negative entries adding up to the "
            f"{rows} rows sent."
        )
    if not is_distributed(group):
        return torch.cat(pieces) if len(pieces) > 1 else first.clone(), list(send_counts)
    if recv_counts is not None and len(recv_counts) != world:
        raise ValueError(f"all_to_all_v: recv_counts {recv_counts} must have {world} entries.")
    rank, row_bytes = get_rank(group), math.prod(first.shape[1:]) * first.element_size()
    key = "float" if first.is_floating_point() else "int"
    payload = row_bytes * (sum(send_counts) - send_counts[rank])  # a send to itself is not counted
    channel = _channel(group) if first.device.type == "cpu" else None
    if channel is not None and row_bytes > 0:
        bytes_sent[key] = bytes_sent.get(key, 0) + payload
        phase_profile.count_message(payload)  # the sizes travel with the rows: no counts message
        raw = [p.contiguous().view(torch.uint8).reshape(-1) for p in pieces if p.numel()]
        expect = None if recv_counts is None else [c * row_bytes for c in recv_counts]
        with _collective("exchange of ids, rows or gradients", group):
            got, sizes = channel.exchange(raw, [c * row_bytes for c in send_counts], expect, "exchange of rows")
        if any(n % row_bytes for n in sizes):
            raise CollectiveError(
                f"embtables: rank {rank}: the ranks sent {sizes} bytes, not whole rows of {row_bytes} bytes: they "
                "exchange different kinds of rows. Every rank must make the same calls in the same order."
            )
        out = got.view(first.dtype).reshape(sum(sizes) // row_bytes, *first.shape[1:])
        return out, [n // row_bytes for n in sizes]
    whole = torch.cat(pieces) if len(pieces) > 1 else first.contiguous()
    if recv_counts is None:
        counts = torch.tensor(send_counts, dtype=torch.int64, device=whole.device)
        recv_counts_t = torch.empty_like(counts)
        phase_profile.count_message(8 * (world - 1))
        with _collective("exchange of row counts", group):
            dist.all_to_all_single(recv_counts_t, counts, group=group)
        recv_counts = [int(c) for c in recv_counts_t.tolist()]
    out = torch.empty((sum(recv_counts), *whole.shape[1:]), dtype=whole.dtype, device=whole.device)
    bytes_sent[key] = bytes_sent.get(key, 0) + payload
    phase_profile.count_message(payload)
    with _collective("exchange of ids, rows or gradients", group):
        dist.all_to_all_single(out, whole, recv_counts, list(send_counts), group=group)
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
    with _collective("gather of table rows", group):
        dist.all_gather(out, padded, group=group)
    return [t[:n] for t, n in zip(out, sizes)]


# The operations a phase header names (their index is the code sent); append only.
PHASES = (
    "lookup", "eval lookup", "apply_gradients", "flush", "save", "restore", "state read", "state load",
    "dense gradients",
)  # fmt: skip
_PHASE_MAGIC = 0x6574_7068  # "etph": tells a phase header from any other 4 x int64 message

# What a header's tag is, by phase, when it is not the tables' fingerprint (for the error message).
_TAG_MEANS = {"dense gradients": "numbers of dense gradient values"}

# Headers exchanged by this process (for benchmarks: the phase check's share of a step). Reset freely.
phase_checks = 0


def check_phase(phase: str, step: int, tag: int, group: ProcessGroup | None = None) -> None:
    """Before an operation's first exchange: every rank sends a fixed-size header (phase, step, ``tag``:
    the fingerprint of the tables involved) and compares all of them, so ranks out of step (one in
    ``apply_gradients`` of step 3, another already in the lookup of step 4; one skipping ``save``) raise
    ``CollectiveError`` on every rank, naming each rank's phase and step, instead of exchanging messages of
    different sizes (which aborts a gloo process). No-op when not distributed."""
    global phase_checks
    if not is_distributed(group):
        return
    world = get_world_size(group)
    if world == 1:  # a group of one (torchrun --nproc_per_node=1): nobody to compare with
        return
    mine = torch.tensor([_PHASE_MAGIC, PHASES.index(phase), int(step), int(tag)], dtype=torch.int64)
    mine = mine.to(collective_device(group))
    phase_profile.count_message(32 * (world - 1))
    channel = _channel(group) if mine.device.type == "cpu" else None
    if channel is not None:
        raw = [mine.view(torch.uint8)] * world
        with _collective(f"phase check before {phase} of step {step}", group):
            got, _ = channel.exchange(raw, [32] * world, [32] * world, f"phase check before {phase}")
        out = got.view(torch.int64).reshape(world, 4)
    else:
        out = _exchange_headers(mine, phase, step, group)
    phase_checks += 1
    headers = out.tolist()
    if all(h == headers[0] for h in headers):
        return
    _raise_out_of_step(headers, phase, step, group)


def _exchange_headers(mine: Tensor, phase: str, step: int, group: ProcessGroup | None) -> Tensor:
    """The phase headers through the process group: ``mine`` [4] to every rank; every rank's [W, 4]."""
    rank, world = get_rank(group), get_world_size(group)
    out = torch.empty((world, 4), dtype=torch.int64, device=mine.device)
    out[rank] = mine
    with _collective(f"phase check before {phase} of step {step}", group):
        # Point-to-point to every other rank: on gloo over localhost this takes about half the time of
        # an all_to_all and a quarter of an all_gather of the same 32 bytes (0.19 vs 0.41 vs 0.74 ms).
        ops = []
        for peer in range(world):
            if peer != rank:
                to = dist.get_global_rank(group, peer) if group is not None else peer
                ops += [dist.P2POp(dist.isend, mine, to, group), dist.P2POp(dist.irecv, out[peer], to, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


def _raise_out_of_step(headers: list[list[int]], phase: str, step: int, group: ProcessGroup | None) -> None:
    """Raise ``CollectiveError`` for phase headers [W][4] that differ, naming what each rank is doing."""
    world = len(headers)

    def where(h: list[int]) -> str:
        if h[0] != _PHASE_MAGIC or not 0 <= h[1] < len(PHASES):
            return "in a collective that is not an embtables operation"
        return f"in {PHASES[h[1]]} of step {h[2]}"

    ranks = ", ".join(f"rank {r} is {where(h)}" for r, h in enumerate(headers))
    if all(h[:3] == headers[0][:3] for h in headers):  # same operation, different tables or sizes
        what = _TAG_MEANS.get(phase, "the fingerprint of the tables (another embedding module?)")
        raise CollectiveError(
            f"embtables: rank {get_rank(group)} of {world}: the ranks are in {phase} of step {step} with different "
            f"{what}: {[h[3] for h in headers]} by rank. Nothing was exchanged. Build the same model on every rank "
            "and call the modules in the same order."
        )
    raise CollectiveError(
        f"embtables: rank {get_rank(group)} of {world}: the ranks are out of step: {ranks}. Nothing was exchanged "
        "and no table or slot was changed by this call. Every rank must call lookup, apply_gradients, flush, save, "
        "restore and state_dict in the same order, the same number of times (one apply_gradients per training "
        "lookup); fix the control flow that lets one rank run ahead."
    )


def any_rank(flag: bool, group: ProcessGroup | None = None, *, channel: bool = True) -> bool:
    """True on every rank when ``flag`` is True on at least one (so all ranks take the same branch,
    e.g. all refuse a step in which one rank saw a bad id). ``channel=False``: through the process
    group, never setting up a shared-memory channel for it (a one-off question)."""
    if not is_distributed(group):
        return bool(flag)
    return _max_of_ranks(int(bool(flag)), group, channel) > 0


def max_over_ranks(value: int, group: ProcessGroup | None = None) -> int:
    """The largest of every rank's ``value`` (one small all_reduce; ``value`` when not distributed)."""
    if not is_distributed(group):
        return int(value)
    return _max_of_ranks(int(value), group)


def _max_of_ranks(value: int, group: ProcessGroup | None, through_channel: bool = True) -> int:
    """The largest ``value`` over the ranks: through the shared-memory channel (every rank sends its
    value to every other), else one all_reduce."""
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    phase_profile.count_message(8)
    channel = _channel(group) if t.device.type == "cpu" and through_channel else None
    with _collective("agreement on the step", group):
        if channel is not None:
            world = get_world_size(group)
            got, _ = channel.exchange([t.view(torch.uint8)] * world, [8] * world, [8] * world, "agreement")
            return int(got.view(torch.int64).max())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def all_reduce_mean_(tensors: list[Tensor], group: ProcessGroup | None = None, step: int = 0) -> None:
    """Average each tensor over the ranks, in place (dense-model gradients of training step ``step``;
    one flat message, after a phase header carrying its size: ranks whose gradients differ in size,
    or that are out of step, raise ``CollectiveError`` on every rank)."""
    if not is_distributed(group):
        return
    check_phase("dense gradients", step, sum(t.numel() for t in tensors), group)
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(collective_device(group))
    with _collective("average of dense gradients", group):
        dist.all_reduce(flat, group=group)
    flat /= get_world_size(group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def init_from_environment() -> bool:
    """Join the process group ``torchrun`` describes (``WORLD_SIZE`` > 1 in the environment; NCCL when
    CUDA is available, else gloo) unless one is up already. True when running distributed."""
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return False
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    clean_exit()
    return True


def shutdown() -> None:
    """Leave the process group joined by ``init_from_environment`` (no-op when there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears the group down while another still talks on it
        dist.destroy_process_group()
