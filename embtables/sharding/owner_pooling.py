"""Pooling on the owner: for tables whose features are all combined (sum, mean, sqrtn), the ranks
holding the rows pool the bags and send back one partial sum per bag, not one row per unique id.

Forward, for every pooled feature f of this rank's batch and every owner r:

1. counts [W, 3F + 1] int64: the ids of f that r owns (n_rf) and the bags of f (S_f), whether f has
   coefficients other than 1, and the refusal flag;
2. ids and offsets int64: r's local rows of those ids, in bag order, and their bag offsets [S_f + 1];
3. coeffs float32 [n_rf]: each id's combiner coefficient (spec §2.1, computed next to the batch
   from all ids of its bag), for features that have them: an unweighted sum sends none (all 1), and
   when no rank sends any this message is left out;
4. back from r: the partial bags [S_f, D] over its rows; the rank adds the partials in rank order.

Backward, each rank sends d(activation) [S_f, D] to the owners holding ids of f (a leading flag says
whether it refused its gradient), and each owner runs phase 1 (dedup and sums, in C) over the ids it
was asked for: the same per-row sums as a single process, added in another order (float32 rounding,
spec §10.8). With a whole table on one rank ("table") the activations are bit-identical.

Bytes per feature and remote owner: about 20 per id forward, 4·D per bag each way, against 8 + 8·D
per unique id for row-returning lookups: owner pooling wins whenever bags are smaller than the
unique ids a rank asks of the other ranks (20-id bags of Zipf ids: about 3x fewer bytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.kernels import native, native_inputs
from embtables.sharding import comm
from embtables.sharding.plan import TablePlan
from embtables.tables import phase_profile
from embtables.tables.backends.interface import OUT_OF_MEMORY, OUT_OF_RANGE, PREPARED, GradientPart
from embtables.tables.collection import EmbeddingCollection
from embtables.tables.inputs import FeatureBatch
from embtables.tables.table_gradient import TableGradient


def owner_pooled(table: ResolvedTable, resolved: ResolvedConfig) -> bool:
    """Tables pooled on the owner: every feature combined (no sequence feature), gradient
    accumulation on (no-accumulation tables need every occurrence in global order), not quantized."""
    features = [resolved.features[f] for f in table.feature_indices]
    return (
        table.optimizer.use_gradient_accumulation
        and table.config.quantization_config is None
        and all(not f.config.is_sequence for f in features)
    )


@dataclasses.dataclass(eq=False)
class Asked:
    """One (source rank, feature) request an owner served: local rows [n], bag offsets [S+1], coeffs [n]
    (None: all 1)."""

    feature: int
    ids: Tensor
    offsets: Tensor
    coeffs: Tensor | None


@dataclasses.dataclass(eq=False)
class PooledContext:
    """What a pooled lookup left for its update: per feature, the ids each owner holds [W] counts and
    bags; per source rank, the requests this rank served."""

    sent: dict[int, list[int]]  # feature -> ids per owner [W]
    bags: dict[int, int]  # feature -> S_f of this rank's batch
    asked: list[list[Asked]]  # [W(source)] -> requests, in feature order


def pooled_lookup_exchange(
    features: Sequence[int],
    batches: Sequence[FeatureBatch],
    resolved: ResolvedConfig,
    plans: dict[str, TablePlan],
    local: EmbeddingCollection,
    rank: int,
    world: int,
    group: comm.ProcessGroup | None,
    refused: bool = False,
    admit: Callable[[Sequence[tuple[str, Tensor]]], list[Tensor]] | None = None,
) -> tuple[dict[int, Tensor], PooledContext, list[int]]:
    """Activations [S_f, D] of the pooled ``features`` (this rank's batch), pooled by their owners:
    split each bag by owner (plan), send the pieces (steps 1-3 of the module docstring), pool what
    this rank was asked for in one backend call, send the partials back and add them (step 4).

    ``refused``: this rank refused its batch (``batches`` is then ignored); the flag travels with the
    counts, and when any rank refused, nothing more is sent and the refusing ranks are returned (third
    element; empty otherwise) so that every rank raises together. ``admit``: called on every rank with the
    local rows [n] it was asked for, per table, before it pools them (an offloaded table's cache brings them
    into memory; it raises on every rank when any refused)."""
    with phase_profile.phase("owner pooling: split by owner"):
        if refused:
            split = _OwnerSplit({}, torch.zeros((world, 3 * len(features)), dtype=torch.int64), {}, {})
        else:
            split = _split_by_owner(features, batches, resolved, plans, local.device, world)
    with phase_profile.phase("owner pooling: send requests"):
        asked, refusing = _send_requests(split, features, rank, world, group, local.device, refused)
    if refusing:
        return {}, PooledContext(split.sent, split.bags, []), refusing
    tables = resolved.tables
    if admit is not None and local.offloaded:
        wanted: dict[str, list[Tensor]] = {}
        for a in (a for src in asked for a in src):
            wanted.setdefault(tables[resolved.features[a.feature].table_index].name, []).append(a.ids)
        names = [name for name in wanted if name in local.offloaded]
        slots = admit([(name, torch.cat(wanted[name])) for name in names])
        # an offloaded table's rows are pooled and updated in its cache's slots, in the order they were asked
        pieces = {name: iter(torch.split(s, [r.numel() for r in wanted[name]])) for name, s in zip(names, slots)}
        asked = [
            [
                dataclasses.replace(a, ids=next(pieces[name])) if name in pieces else a
                for a in src
                for name in (tables[resolved.features[a.feature].table_index].name,)
            ]
            for src in asked
        ]
    weights = [
        (a, local.states[tables[resolved.features[a.feature].table_index].name].weights) for src in asked for a in src
    ]
    with phase_profile.phase("owner pooling: pool"):
        partials = _pool(weights, local)
    dims = {f: tables[resolved.features[f].table_index].dim for f in features}
    with phase_profile.phase("owner pooling: return partials"):
        acts = _return_partials(partials, asked, split.bags, dims, features, rank, world, group, local.device)
    return acts, PooledContext(split.sent, split.bags, asked), []


@dataclasses.dataclass(eq=False)
class _OwnerSplit:
    """Every pooled feature's bags split by owner rank: ``parts[f][r]`` = (local rows [n_rf], offsets
    [S_f + 1], coeffs [n_rf] or None: all 1); ``counts`` [W, 3F] = (n_rf, S_f) per owner and feature,
    then per feature 1 when it has coefficients."""

    parts: dict[int, list[tuple[Tensor, Tensor, Tensor | None]]]
    counts: Tensor
    sent: dict[int, list[int]]
    bags: dict[int, int]


def _split_by_owner(
    features: Sequence[int],
    batches: Sequence[FeatureBatch],
    resolved: ResolvedConfig,
    plans: dict[str, TablePlan],
    device: torch.device,
    world: int,
) -> _OwnerSplit:
    """Plan: each feature's ids grouped by owner (stable, so bag order is kept), with per-owner offsets.
    Row-partitioned features go through one native counting sort; the rest (whole tables, or inputs
    the native path cannot take) through torch."""
    nfeat = len(features)
    split = _OwnerSplit({}, torch.zeros((world, 3 * nfeat), dtype=torch.int64), {}, {})
    fast = []
    for f in features:
        b, plan = batches[f], plans[_table_of(f, resolved)]
        whole = b.offsets.numel() > 0 and int(b.offsets[0]) == 0 and int(b.offsets[-1]) == b.ids.numel()
        if plan.strategy in ("div", "mod") and whole and native.usable(b.ids, b.offsets, b.coeffs):
            fast.append((f, (b.ids, b.offsets, b.coeffs, plan.strategy, plan.vocabulary_size)))
    done = native_inputs.split_by_owner([p for _, p in fast], world) if fast else None
    native_parts = dict(zip((f for f, _ in fast), done)) if done is not None else {}
    for k, f in enumerate(features):
        b = batches[f]
        if f in native_parts:
            local_ids, coeffs, offsets, n_per = native_parts[f]
            parts, start = [], 0
            for r in range(world):
                n = n_per[r]
                part_coeffs = None if coeffs is None else coeffs.narrow(0, start, n)
                parts.append((local_ids.narrow(0, start, n), offsets[r], part_coeffs))
                start += n
        else:
            parts, n_per = _split_in_torch(b, plans[_table_of(f, resolved)], device, world)
        split.parts[f] = parts
        split.sent[f], split.bags[f] = n_per, b.num_segments
        split.counts[:, 2 * k] = torch.tensor(n_per, dtype=torch.int64)
        split.counts[:, 2 * k + 1] = b.num_segments
        split.counts[:, 2 * nfeat + k] = int(b.coeffs is not None)
    return split


def _table_of(feature: int, resolved: ResolvedConfig) -> str:
    return resolved.tables[resolved.features[feature].table_index].name


def _split_in_torch(
    b: FeatureBatch, plan: TablePlan, device: torch.device, world: int
) -> tuple[list[tuple[Tensor, Tensor, Tensor | None]], list[int]]:
    """One feature's bags split by owner in torch: ``[(local rows, offsets [S+1], coeffs | None)]`` per rank."""
    coeffs = b.coeffs
    parts: list[tuple[Tensor, Tensor, Tensor | None]] = []
    if plan.strategy == "table":  # one owner: the batch as it is, nothing to sort
        n_per = [b.ids.numel() if r == plan.rank else 0 for r in range(world)]
        none = torch.zeros(b.num_segments + 1, dtype=torch.int64, device=device)
        for r in range(world):
            mine = r == plan.rank
            part_coeffs = None if coeffs is None else coeffs if mine else coeffs[:0]
            parts.append((b.ids if mine else b.ids[:0], b.offsets if mine else none, part_coeffs))
        return parts, n_per
    owner, local_ids = plan.owner(b.ids)
    order = torch.argsort(owner, stable=True)
    n_per = [int(c) for c in torch.bincount(owner, minlength=world).tolist()]
    seg, ids_sorted = b.seg[order], local_ids[order]
    coeffs = None if coeffs is None else coeffs[order]
    start = 0
    for r in range(world):
        n = n_per[r]
        offsets = torch.zeros(b.num_segments + 1, dtype=torch.int64, device=device)
        offsets[1:] = torch.cumsum(torch.bincount(seg.narrow(0, start, n), minlength=b.num_segments), 0)
        parts.append((ids_sorted.narrow(0, start, n), offsets, None if coeffs is None else coeffs.narrow(0, start, n)))
        start += n
    return parts, n_per


def _send_requests(
    split: _OwnerSplit,
    features: Sequence[int],
    rank: int,
    world: int,
    group: comm.ProcessGroup | None,
    device: torch.device,
    refused: bool = False,
) -> tuple[list[list[Asked]], list[int]]:
    """Send: counts (with the coefficient flags and the refusal flag), then ids and offsets (int64), then
    the coeffs of the features that have them (float32; no message when no rank has any), grouped by
    destination, then feature. Returns what each source rank asked of this one, ``asked[source][k]``
    (its own pieces for ``source == rank``, never sent), and the ranks that refused their batch (then
    nothing but the counts was sent)."""
    counts = torch.cat([split.counts, torch.full((world, 1), int(refused), dtype=torch.int64)], dim=1)
    got, _ = comm.all_to_all_v(counts.to(comm.collective_device(group)), [1] * world, group, recv_counts=[1] * world)
    recv_counts = got.tolist()  # [W(source)][3F + 1]
    refusing = [r for r in range(world) if recv_counts[r][-1] != 0]
    if refusing:
        return [], refusing
    nfeat = len(features)
    ints, floats, int_split, float_split = [], [], [], []
    for r in range(world):
        ni = nf = 0
        for f in features:
            ids_r, offsets_r, coeffs_r = split.parts[f][r]
            if r != rank:
                ints += [ids_r, offsets_r]
                ni += ids_r.numel() + offsets_r.numel()
                if coeffs_r is not None:
                    floats.append(coeffs_r)
                    nf += coeffs_r.numel()
        int_split.append(ni)
        float_split.append(nf)
    recv_int_split = [
        0 if s == rank else sum(c[2 * k] + c[2 * k + 1] + 1 for k in range(nfeat)) for s, c in enumerate(recv_counts)
    ]
    recv_float_split = [
        0 if s == rank else sum(c[2 * k] for k in range(nfeat) if c[2 * nfeat + k]) for s, c in enumerate(recv_counts)
    ]
    # Every rank has every rank's flags (each sent its row to all): all skip the coefficients or none does.
    any_coeffs = any(c[2 * nfeat + k] for c in recv_counts for k in range(nfeat))
    empty_i = torch.empty(0, dtype=torch.int64, device=device)
    empty_f = torch.empty(0, dtype=torch.float32, device=device)
    recv_i, _ = comm.all_to_all_v(ints or empty_i, int_split, group, recv_int_split)
    recv_f = empty_f
    if any_coeffs:
        recv_f, _ = comm.all_to_all_v(floats or empty_f, float_split, group, recv_float_split)
    asked: list[list[Asked]] = []
    oi = of = 0
    for s in range(world):
        mine: list[Asked] = []
        for k, f in enumerate(features):
            if s == rank:
                mine.append(Asked(f, *split.parts[f][rank]))
                continue
            n, nb = recv_counts[s][2 * k], recv_counts[s][2 * k + 1]
            coeffs = None
            if recv_counts[s][2 * nfeat + k]:
                coeffs = recv_f.narrow(0, of, n)
                of += n
            mine.append(Asked(f, recv_i.narrow(0, oi, n), recv_i.narrow(0, oi + n, nb + 1), coeffs))
            oi += n + nb + 1
        asked.append(mine)
    return asked, []


def _return_partials(
    partials: list[Tensor],
    asked: list[list[Asked]],
    bags: dict[int, int],
    dims: dict[int, int],
    features: Sequence[int],
    rank: int,
    world: int,
    group: comm.ProcessGroup | None,
    device: torch.device,
) -> dict[int, Tensor]:
    """Receive: each partial [S_f, D] goes back to the rank that asked for it; each rank adds the
    partials of its features in rank order (its own in its place) -> activations [S_f, D]."""
    out_pieces, out_split = [], []
    idx = 0
    own: dict[int, Tensor] = {}
    for s in range(world):
        size = 0
        for a in asked[s]:
            p = partials[idx]
            idx += 1
            if s == rank:
                own[a.feature] = p
            else:
                out_pieces.append(p.reshape(-1))
                size += p.numel()
        out_split.append(size)
    back_split = [0 if r == rank else sum(bags[f] * dims[f] for f in features) for r in range(world)]
    empty_f = torch.empty(0, dtype=torch.float32, device=device)
    recv_back, _ = comm.all_to_all_v(out_pieces or empty_f, out_split, group, back_split)
    partials_of: dict[int, list[Tensor]] = {f: [] for f in features}
    offset = 0
    for r in range(world):
        for f in features:
            part = own[f] if r == rank else recv_back.narrow(0, offset, bags[f] * dims[f]).view(bags[f], dims[f])
            if r != rank:
                offset += bags[f] * dims[f]
            partials_of[f].append(part)
    acts: dict[int, Tensor] = {}
    for f, parts in partials_of.items():  # added in rank order: ((p_0 + p_1) + p_2) + ...
        acts[f] = torch.add(parts[0], parts[1]) if len(parts) > 1 else parts[0].clone()
        for part in parts[2:]:
            acts[f].add_(part)
    return acts


def _pool(requests: list[tuple[Asked, Tensor]], local: EmbeddingCollection) -> list[Tensor]:
    """Partial bags [S, D] of every request over this rank's rows (one backend call for all)."""
    if not requests:
        return []
    outs, status = local.pool([(w, a.ids, a.offsets, a.coeffs) for a, w in requests])
    if status == OUT_OF_RANGE:
        raise RuntimeError("a rank asked for rows outside this rank's shard (an embtables bug).")
    return outs


def pooled_gradient_exchange(
    features: Sequence[int],
    grads: Sequence[Tensor | None],
    context: PooledContext,
    refused: bool,
    resolved: ResolvedConfig,
    rank: int,
    world: int,
    group: comm.ProcessGroup | None,
) -> tuple[dict[int, list[Tensor]], list[int]]:
    """Send d(activation) [S_f, D] of each pooled feature to the owners holding its ids. Returns, per
    feature, the gradients of the requests this rank served (aligned with ``context.asked``, one per
    source rank) and the ranks that refused their gradient."""
    dims = {f: resolved.tables[resolved.features[f].table_index].dim for f in features}
    device = next((g.device for g in grads if g is not None), torch.device("cpu"))
    flag = torch.full((1,), float(refused), dtype=torch.float32, device=device)
    pieces, split = [], []
    for r in range(world):
        if r == rank:
            split.append(0)
            continue
        size = 1
        pieces.append(flag)
        for f in features:
            if context.sent[f][r]:
                g = grads[f]
                g = torch.zeros((context.bags[f], dims[f]), device=device) if g is None or refused else g
                pieces.append(g.reshape(-1))
                size += g.numel()
        split.append(size)
    expected = []
    for s in range(world):
        n = (
            0
            if s == rank
            else 1
            + sum(
                a.offsets.numel() - 1 and (a.offsets.numel() - 1) * dims[a.feature] if a.ids.numel() else 0
                for a in context.asked[s]
            )
        )
        expected.append(n)
    recv, _ = comm.all_to_all_v(pieces or torch.empty(0, dtype=torch.float32, device=device), split, group, expected)
    out: dict[int, list[Tensor]] = {f: [] for f in features}
    refusing = []
    offset = 0
    for s in range(world):
        if s == rank:
            if refused:
                refusing.append(s)
            for a in context.asked[s]:
                g = grads[a.feature]
                out[a.feature].append(
                    g
                    if g is not None and not refused
                    else torch.zeros((context.bags[a.feature], dims[a.feature]), device=device)
                )
            continue
        if float(recv[offset]) != 0.0:
            refusing.append(s)
        offset += 1
        for a in context.asked[s]:
            nb, d = a.offsets.numel() - 1, dims[a.feature]
            if a.ids.numel():
                out[a.feature].append(recv.narrow(0, offset, nb * d).view(nb, d))
                offset += nb * d
            else:
                out[a.feature].append(torch.zeros((nb, d), device=device))
    return out, refusing


def owner_table_gradient(
    table: ResolvedTable,
    local_table: ResolvedTable,
    context: PooledContext,
    grads: dict[int, list[Tensor]],
    local: EmbeddingCollection,
) -> tuple[TableGradient, bool]:
    """The owner's summed gradient of its rows of ``table`` from every request it served (phase 1 in
    C when possible), and whether every sum is finite."""
    parts: list[GradientPart] = []
    for s, requests in enumerate(context.asked):
        for a in requests:
            if a.feature in table.feature_indices and a.ids.numel():
                parts.append((a.ids, a.offsets, a.coeffs, grads[a.feature][s].contiguous()))
    prepared = local.prepare(local_table, parts)
    if prepared.status == OUT_OF_MEMORY:
        raise MemoryError(f"table {table.name!r}: out of memory while summing gradients.")
    if prepared.gradient is None:  # the backend's inputs changed under it: the reference sums them again
        prepared = local.reference.prepare(local_table, parts)
    assert prepared.gradient is not None
    return prepared.gradient, prepared.status == PREPARED
