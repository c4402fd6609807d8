"""Routing of a rank's ids to the ranks that own them, batched over all tables.

A lookup moves three messages per step whatever the number of tables T (W ranks):

1. counts [W, T + 1] int64 (``all_to_all``): row r holds how many unique ids of each table this rank
   asks rank r for, and in its last column whether this rank's batch was refused (so every rank
   learns of a bad batch from the first message and all raise at the same point);
2. the ids themselves, as local rows of their owners, grouped by destination rank then table;
3. the rows answering them, flattened float32, grouped by source rank then table.

The update sends one message back along the same routes: per destination, a one-element flag (this
rank refused its gradient) followed by the per-unique-id gradient sums, grouped by table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from embtables.sharding import comm
from embtables.sharding.plan import TablePlan


@dataclasses.dataclass(eq=False)
class IdRoute:
    """One table's unique ids of one rank's batch, in *owner order*: grouped by owner rank (ascending
    ids within a group). Rows, gradient sums and messages all use this order, so nothing is permuted.

    ``unique`` [U] the ids sorted; ``position`` [U] where each of them sits in owner order;
    ``ids`` [U] the ids in owner order; ``local`` [U] their owners' local rows in owner order;
    ``inverse`` [N] the owner-order position of every id (all features of the table concatenated);
    ``send_counts`` [W] how many unique ids each rank owns."""

    unique: Tensor
    position: Tensor
    ids: Tensor
    local: Tensor
    inverse: Tensor
    send_counts: list[int]


@dataclasses.dataclass(eq=False)
class TableRoute:
    """An ``IdRoute`` and the other side of its exchange: ``recv_rows`` [M] the local rows other ranks
    asked this rank for (source-rank order) and ``recv_counts`` [W] how many came from each rank."""

    ids: IdRoute
    recv_rows: Tensor
    recv_counts: list[int]


def route_ids(ids: Tensor, plan: TablePlan) -> IdRoute:
    """Deduplicate ``ids`` [N] and arrange the unique ids in owner order."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    owner, local = plan.owner(unique)
    counts = [int(c) for c in torch.bincount(owner, minlength=plan.world_size).tolist()]
    if plan.strategy == "mod" and plan.world_size > 1:
        order = torch.argsort(owner, stable=True)
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=order.device)
        return IdRoute(unique, position, unique[order], local[order], position[inverse], counts)
    # div blocks and whole tables: owners never decrease with the id, so sorted order is owner order.
    return IdRoute(unique, torch.arange(unique.numel(), device=unique.device), unique, local, inverse, counts)


def exchange_ids(
    per_table: Sequence[tuple[Tensor, list[int]]], refused: bool, world: int, group: comm.ProcessGroup | None
) -> tuple[list[tuple[Tensor, list[int]]], list[int]]:
    """Send each table's local rows (sorted by owner, with their counts per owner [W]) to their owners.

    Returns, per table, the rows asked of this rank [M_t] (source-rank order) with the counts per
    source [W], and the ranks whose batch was refused (empty when none was)."""
    num_tables = len(per_table)
    counts = torch.zeros((world, num_tables + 1), dtype=torch.int64, device=comm.collective_device(group))
    for t, (_, c) in enumerate(per_table):
        counts[:, t] = torch.tensor(c, dtype=torch.int64, device=counts.device)
    counts[:, num_tables] = int(refused)
    recv_counts_t, _ = comm.all_to_all_v(counts, [1] * world, group, recv_counts=[1] * world)
    got = recv_counts_t.tolist()  # [W(source)][T + 1]
    refusing = [r for r in range(world) if got[r][num_tables] != 0]
    if refusing:
        return [], refusing
    recv_counts = [row[:num_tables] for row in got]
    device = per_table[0][0].device if per_table else counts.device
    pieces = []
    starts = [[0] * world for _ in per_table]
    for t, (_, c) in enumerate(per_table):
        acc = 0
        for r in range(world):
            starts[t][r] = acc
            acc += c[r]
    for r in range(world):
        for t, (rows, c) in enumerate(per_table):
            pieces.append(rows.narrow(0, starts[t][r], c[r]))
    send = pieces or torch.empty(0, dtype=torch.int64, device=device)
    send_split = [sum(c[r] for _, c in per_table) for r in range(world)]
    recv_split = [sum(int(n) for n in recv_counts[s]) for s in range(world)]
    recv, _ = comm.all_to_all_v(send, send_split, group, recv_counts=recv_split)
    out: list[list[Tensor]] = [[] for _ in per_table]
    offset = 0
    for s in range(world):
        for t in range(num_tables):
            n = int(recv_counts[s][t])
            out[t].append(recv.narrow(0, offset, n))
            offset += n
    return [(torch.cat(parts), [int(recv_counts[s][t]) for s in range(world)]) for t, parts in enumerate(out)], []


def exchange_rows(
    answers: Sequence[Tensor],
    routes: Sequence[TableRoute],
    dims: Sequence[int],
    rank: int,
    world: int,
    group: comm.ProcessGroup | None,
) -> list[Tensor]:
    """Send each table's answer rows [M_t, D_t] (aligned with ``recv_rows``) back to the ranks that asked.

    Returns, per table, the rows of this rank's unique ids [U_t, D_t] in owner order. This rank's
    answers to itself never enter the message."""
    asked = [r.recv_counts for r in routes]
    wanted = [r.ids.send_counts for r in routes]
    flat, split = _pack(answers, asked, dims, world, None, rank)
    recv, _ = comm.all_to_all_v(flat, split, group, recv_counts=_sizes(wanted, dims, world, False, rank))
    own = [a.narrow(0, sum(c[:rank]), c[rank]) for a, c in zip(answers, asked)]
    return _unpack(recv, wanted, dims, world, None, rank, own)[1]


def exchange_sums(
    sums: Sequence[Tensor],
    routes: Sequence[TableRoute],
    dims: Sequence[int],
    refused: bool,
    rank: int,
    world: int,
    group: comm.ProcessGroup | None,
) -> tuple[list[Tensor], list[int]]:
    """Send each table's per-unique-id gradient sums [U_t, D_t] (owner order) to the owners.

    Returns, per table, the sums other ranks sent for this rank's rows [M_t, D_t], aligned with
    ``recv_rows``, and the ranks that refused their gradient (empty when none did)."""
    wanted = [r.ids.send_counts for r in routes]
    asked = [r.recv_counts for r in routes]
    flat, split = _pack(sums, wanted, dims, world, float(refused), rank)
    recv, _ = comm.all_to_all_v(flat, split, group, recv_counts=_sizes(asked, dims, world, True, rank))
    own = [x.narrow(0, sum(c[:rank]), c[rank]) for x, c in zip(sums, wanted)]
    flags, parts = _unpack(recv, asked, dims, world, float(refused), rank, own)
    return parts, [s for s, f in enumerate(flags) if f != 0.0]


def _sizes(counts: Sequence[list[int]], dims: Sequence[int], world: int, flags: bool, skip: int) -> list[int]:
    """Elements per rank of a message packed by ``_pack`` with these per-table counts."""
    return [0 if r == skip else int(flags) + sum(c[r] * d for c, d in zip(counts, dims)) for r in range(world)]


def _pack(
    tables: Sequence[Tensor],
    counts: Sequence[list[int]],
    dims: Sequence[int],
    world: int,
    flags: float | None,
    skip: int,
) -> tuple[Tensor, list[int]]:
    """Flatten per-table rows [n_t, D_t] (grouped by rank, ``counts[t][r]`` rows each) into one float32
    message grouped by rank, then table; with ``flags``, each rank's part starts with that value.
    Rank ``skip`` (this rank) gets nothing: its part stays where it is."""
    device = tables[0].device if tables else torch.device("cpu")
    pieces: list[Tensor] = []
    split = []
    starts = [0] * len(tables)
    flag = None if flags is None else torch.full((1,), flags, dtype=torch.float32, device=device)
    for r in range(world):
        size = 0
        if flag is not None and r != skip:
            pieces.append(flag)
            size += 1
        for t, (rows, dim) in enumerate(zip(tables, dims)):
            n = counts[t][r]
            if r != skip:
                pieces.append(rows.narrow(0, starts[t], n).reshape(-1))
                size += n * dim
            starts[t] += n
        split.append(size)
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float32, device=device)
    return flat, split


def _unpack(
    flat: Tensor,
    counts: Sequence[list[int]],
    dims: Sequence[int],
    world: int,
    own_flag: float | None,
    skip: int,
    own: Sequence[Tensor],
) -> tuple[list[float], list[Tensor]]:
    """The inverse of ``_pack`` on the receiving side: per-rank flags and per-table rows [n_t, D_t],
    with this rank's own part (``own``, per table) in its place."""
    got_flags: list[float] = []
    parts: list[list[Tensor]] = [[] for _ in dims]
    offset = 0
    for r in range(world):
        if r == skip:
            if own_flag is not None:
                got_flags.append(own_flag)
            for t in range(len(dims)):
                parts[t].append(own[t])
            continue
        if own_flag is not None:
            got_flags.append(float(flat[offset]))
            offset += 1
        for t, dim in enumerate(dims):
            n = counts[t][r]
            parts[t].append(flat.narrow(0, offset, n * dim).view(n, dim))
            offset += n * dim
    return got_flags, [p[0] if len(p) == 1 else torch.cat(p) for p in parts]
