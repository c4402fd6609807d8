"""The GPU step's phases 1 and 2 for a group of tables (``kernels/triton_row_sums.py``,
``kernels/triton_update.py``): every feature's occurrences of the group deduplicated and summed per row
(``row_sums``), and the fused update of every table of the group in one launch (``update``: a dry run, then
the write). The buffer checks and launch helpers are ``kernels/gpu.py``'s; nothing here reads a value back
(no sync).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.config.catalogue import Optimizer
from embtables.kernels import gpu
from embtables.kernels.clip_decay import clip_limits
from embtables.kernels.record import KernelRecord
from embtables.kernels.registry import record_of
from embtables.kernels.triton_interpreter import interpreting

GradPart = tuple[Tensor, Tensor, "Tensor | None", Tensor, int]
# (ids [N_f], seg [N_f], coeffs [N_f] or None, grad [S_f, D], the feature's table among the group's)

STATS = 6  # a group's phase-1 statistics (``RowSums.stats``)
NEVER = 2**63 - 1  # ``found``: no key


class RowSums:
    """Phase 1 of a group of tables of one width D on the device, before any sync. The group's rows are one
    key space: table j's row r is key ``bases[j] + r``. ``rows`` [N] holds ``stats[0]`` valid keys (distinct,
    ascending); ``sums`` [N, D] their summed gradients, or None when not yet summed (the update sums them:
    ``update(..., inline=)``; ``materialize`` sums them here). ``stats`` int64 [STATS]: the number of distinct
    keys U; the largest |sum| as float32 bits (>= ``gpu.F32_INF_BITS``: not finite; of the runs longer than
    ``gpu.PIECE`` only while not summed); 1 when an id or a bag was outside its table or gradient; the longest
    run (occurrences of one key); unused; the largest |coefficient| as float32 bits."""

    def __init__(self, rows: Tensor, sums: Tensor | None, stats: Tensor, bases: list[int], sorted_: dict[str, Any]):
        self.rows, self.sums, self.stats, self.bases = rows, sums, stats, bases
        self.sorted = sorted_  # what the sums read: sorted occurrences, gradients, pieces, flags

    def table_rows(self, j: int) -> tuple[Tensor, Tensor]:
        """Table j's distinct rows [U_j] and summed gradients [U_j, D] (sums them if needed; one sync)."""
        sums = materialize(self)
        u = int(self.stats[0].item())
        keys = self.rows[:u]
        lo, hi = self.bases[j], self.bases[j + 1]
        mine = (keys >= lo) & (keys < hi)
        return keys[mine] - lo, sums[:u][mine]


@dataclasses.dataclass(frozen=True, eq=False)
class TableShare:
    """One table's part of a group's phase 1: table ``index`` of ``sums``."""

    sums: RowSums
    index: int


def every_row(rs: RowSums) -> RowSums:
    """The summed phase 1 ``rs`` of a group as an update of every row of its tables: keys 0..sum(V)-1, a zero
    sum where the batch has none (non-lazy optimizers), ``rs``'s phase-1 flag kept; made once per ``rs``. No
    sync."""
    made = rs.sorted.get("every_row")
    if made is not None:
        return made  # type: ignore[no-any-return]
    device, dim, v = rs.rows.device, rs.sorted["dim"], rs.bases[-1]
    sums = materialize(rs)
    full = torch.zeros((v + 1, dim), dtype=torch.float32, device=device)  # row V takes the keys past U
    n = rs.rows.numel()
    live = torch.arange(n, device=device) < rs.stats[0]
    full.index_copy_(0, torch.where(live & (rs.rows >= 0), rs.rows, v), sums)
    stats = rs.stats.clone()
    stats[0] = v
    sorted_ = {"n": v, "dim": dim, "has_coeffs": False, "parts": rs.sorted.get("parts", [])}
    made = rs.sorted["every_row"] = RowSums(torch.arange(v, device=device), full[:v], stats, rs.bases, sorted_)
    return made


def row_sums(parts: Sequence[GradPart], vocabularies: Sequence[int], dim: int, *, summed: bool = True) -> RowSums:
    """Dedup the occurrences of the features ``parts`` of a group of tables (``vocabularies``: each one's V)
    and sum each distinct row's gradients (occurrence order within a row), all on the device in a fixed
    number of launches, whatever the number of tables and features: no sync. ``summed=False``: sum only
    the runs longer than ``gpu.PIECE`` here (their pieces joined in place); the update sums the others as it
    applies them."""
    k = gpu.kernels()
    device = parts[0][3].device
    for ids, seg, coeffs, grad, j in parts:
        gpu.checked_contiguous(ids, "ids", torch.int64, device, 1)
        if gpu.checked_contiguous(seg, "segments", torch.int64, device, 1).shape != ids.shape:
            raise gpu.GpuBufferError("embtables GPU kernel: segments must match the ids.")
        gpu.check_coefficients(coeffs, ids, device)
        gpu.check_buffer(grad, "a gradient", torch.float32, device, 2)
        if grad.shape[1] != dim or (dim > 1 and grad.stride(1) != 1) or (grad.shape[0] > 1 and grad.stride(0) < dim):
            raise gpu.GpuBufferError(f"embtables GPU kernel: a gradient must be [S, {dim}] with unit column stride.")
        if not 0 <= j < len(vocabularies):
            raise gpu.GpuBufferError("embtables GPU kernel: a part names a table outside its group.")
    if any(v <= 0 for v in vocabularies):
        raise gpu.GpuBufferError("embtables GPU kernel: a table needs a positive vocabulary size.")
    bases = [0]
    for v in vocabularies:
        bases.append(bases[-1] + int(v))
    stats = torch.zeros(STATS, dtype=torch.int64, device=device)
    counts = [p[0].numel() for p in parts]
    n = sum(counts)
    rows = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        empty = {"n": 0, "dim": dim, "has_coeffs": False}
        return RowSums(rows, torch.empty((0, dim), device=device) if summed else None, stats, bases, empty)
    has_coeffs = any(p[2] is not None for p in parts)
    key64 = bases[-1] > 2**31 - 1  # int32 keys sort in half the radix passes
    keys = torch.empty(n, dtype=torch.int64 if key64 else torch.int32, device=device)
    segs = torch.empty(n, dtype=torch.int64, device=device)
    coeffs = torch.empty(n, dtype=torch.float32, device=device) if has_coeffs else segs
    feats = torch.empty(n, dtype=torch.int64, device=device)
    grads = [p[3] for p in parts]
    pieces = torch.empty((2 * -(-n // gpu.PIECE), dim), dtype=torch.float32, device=device)
    at = [0]
    for c in counts[:-1]:
        at.append(at[-1] + c)
    columns = [
        [p[0].data_ptr() for p in parts],
        [p[1].data_ptr() for p in parts],
        [0 if p[2] is None else p[2].data_ptr() for p in parts],
        counts,
        at,
        [int(vocabularies[p[4]]) for p in parts],
        [bases[p[4]] for p in parts],
    ]
    grad_meta = [] if len(grads) == 1 else [g.data_ptr() for g in grads] + [g.stride(0) for g in grads] + [
        g.shape[0] for g in grads]  # fmt: skip
    meta = gpu.addresses([v for col in columns for v in col] + grad_meta, device)  # one copy to the device
    nf = len(parts)
    block = 1024
    for lo, hi, views in gpu.feature_chunks(meta, len(columns), nf):
        k.gather_kernel[(-(-max(counts[lo:hi]) // block), hi - lo)](
            *views, keys, segs, coeffs, feats, stats,
            KEY64=key64, HAS_COEFFS=has_coeffs, BLOCK=block,
        )  # fmt: skip
    grad_args = _gradient_arguments(grads, pieces, segs, meta[len(columns) * nf :])
    multi = len(grads) > 1
    sorted_keys, perm = torch.sort(keys, stable=True)  # stable: equal keys keep occurrence order
    sorted_ids = torch.empty(n, dtype=torch.int64, device=device)
    is_start = torch.empty(n, dtype=torch.int64, device=device)
    sorted_segs = torch.empty(n, dtype=torch.int64, device=device)
    sorted_coeffs = torch.empty(n, dtype=torch.float32, device=device) if has_coeffs else sorted_segs
    sorted_feats = torch.empty(n, dtype=torch.int64, device=device) if multi else sorted_segs
    k.sort_marks_kernel[(-(-n // block),)](
        sorted_keys, perm, segs, coeffs, feats, sorted_ids, is_start, sorted_segs, sorted_coeffs, sorted_feats,
        grad_args[2], grad_args[5], stats, n, bases[-1], HAS_COEFFS=has_coeffs, MULTI=multi, BLOCK=block,
    )  # fmt: skip
    runs1 = torch.cumsum(is_start, 0)
    starts = torch.empty(n + 2, dtype=torch.int64, device=device)
    k.run_starts_kernel[(-(-(n + 2) // block),)](is_start, runs1, sorted_ids, starts, rows, stats, n, BLOCK=block)
    sorted_: dict[str, Any] = {
        "n": n,
        "dim": dim,
        "runs1": runs1,
        "starts": starts,
        "occurrences": (sorted_segs, sorted_coeffs, sorted_feats, *grad_args),
        "grads": grads,  # kept alive: the kernels may hold only their addresses
        "pieces": pieces,
        "has_coeffs": has_coeffs,
        "multi": multi,
        "aligned": dim % 4 == 0 and all(gpu.is_aligned(g, g.stride(0)) for g in grads),
    }
    rs = RowSums(rows, None, stats, bases, sorted_)
    if summed:
        rs.sums = _sum_runs(rs, long_only=False)
    else:
        _sum_runs(rs, long_only=True)
    return rs


def _gradient_arguments(grads: Sequence[Tensor], dummy: Tensor, segs: Tensor, meta: Tensor | None = None) -> tuple[
        Any, ...]:  # fmt: skip
    """The gradient arguments of the per-row sums (``grad0, grad_ld, grad_nrows, grad_ptrs, grad_lds,
    grad_rows``): one feature's gradient itself (no addresses to copy to the device), or several features'
    addresses, row strides and rows (``meta``, when already on the device; ``dummy`` and ``segs``: float32
    and int64 buffers never read)."""
    if len(grads) == 1:
        g = grads[0]
        return (g, g.stride(0), g.shape[0], segs, segs, segs)
    if meta is None:
        columns = [g.data_ptr() for g in grads] + [g.stride(0) for g in grads] + [g.shape[0] for g in grads]
        meta = gpu.addresses(columns, dummy.device)
    nf = len(grads)
    return (dummy, 0, 0, meta[:nf], meta[nf : 2 * nf], meta[2 * nf :])


def own_gradients(rs: RowSums) -> None:
    """Not yet summed ``rs`` reads copies of its gradients from now on, so that a caller may write into the
    gradients it passed (an update held back by pipelining lands after the next step's backward)."""
    s = rs.sorted
    if rs.sums is not None or s["n"] == 0:
        return
    grads = [g.clone() for g in s["grads"]]
    segs = s["occurrences"][0]
    s["grads"] = grads
    s["occurrences"] = (*s["occurrences"][:3], *_gradient_arguments(grads, s["pieces"], segs))


def _aligned(sorted_: dict[str, Any]) -> bool:
    """Whether the sums may load the gradients of ``sorted_`` 16 bytes at a time (``gpu._ALIGN_HINTS`` on)."""
    return bool(sorted_["aligned"]) and bool(gpu._ALIGN_HINTS)


def _sum_runs(rs: RowSums, *, long_only: bool) -> Tensor | None:
    """Launch the per-row sums of ``rs`` (no sync): every run's into a new [N, D] (returned), or with
    ``long_only`` the runs longer than ``gpu.PIECE`` only, joined in place in their pieces (None)."""
    k = gpu.kernels()
    s = rs.sorted
    n, dim = s["n"], s["dim"]
    sums = None if long_only else torch.empty((n, dim), dtype=torch.float32, device=rs.rows.device)
    tile_rows, block_d, warps = gpu.tile(dim)
    out = s["pieces"] if sums is None else sums  # LONG_ONLY writes no sums
    for first_pieces in (True, False):  # the later pieces' launch returns at once unless a run is long
        k.piece_sums_kernel[(-(-n // tile_rows),)](
            s["runs1"], s["starts"], *s["occurrences"], out, s["pieces"], rs.stats, n, dim,
            HAS_COEFFS=s["has_coeffs"], MULTI=s["multi"], ALIGNED=_aligned(s), FIRST=first_pieces,
            LONG_ONLY=long_only, PIECE=gpu.PIECE, UNROLL=gpu.SUMS_UNROLL, ROWS=tile_rows, BLOCK_D=block_d,
            num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    k.piece_join_kernel[(-(-n // tile_rows),)](
        s["starts"], out, s["pieces"], rs.stats, n, dim, IN_PLACE=long_only, PIECE=gpu.PIECE, UNROLL=8,
        ROWS=tile_rows, BLOCK_D=block_d, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return sums


def materialize(rs: RowSums) -> Tensor:
    """The summed gradients [N, D] of ``rs`` (launched here when not yet summed, no sync; ``rs.stats[1]``
    then holds the exact largest |sum|)."""
    if rs.sums is None:
        if rs.sorted["n"] == 0:
            rs.sums = torch.empty((0, rs.sorted["dim"]), device=rs.rows.device)
        else:
            rs.sums = _sum_runs(rs, long_only=False)
    assert rs.sums is not None
    return rs.sums


def update_parameters(
    opt: Optimizer,
    lr: float,
    decay: float,
    *,
    row_dtype: torch.dtype = torch.float32,
    slot_dtype: torch.dtype = torch.float32,
    stochastic: bool = False,
) -> dict[str, Any]:
    """The scalar arguments and flags of ``update_kernel`` for ``opt`` at ``lr`` and effective ``decay``:
    the kernel record's float32 constants and flags, as the native C kernels get them; the storage types of
    the tables' weights and slots, and whether half values are rounded stochastically (spec §12)."""
    if row_dtype not in gpu.GPU_CODES or slot_dtype not in gpu.GPU_CODES:
        raise gpu.GpuBufferError(f"embtables GPU kernel: no storage type {row_dtype} / {slot_dtype}.")
    record: KernelRecord = record_of(opt)
    named = record.native_constants(opt, lr)
    constants = list(named.values())
    if len(constants) > 6:
        raise gpu.GpuBufferError(f"embtables GPU kernel: {type(opt).__name__} has more than 6 constants.")
    constants += [0.0] * (6 - len(constants))
    flags = [bool(v) for v in record.native_flags(opt).values()] + [False, False]
    return {
        "scalars": (
            float(lr),
            float(decay),
            *clip_limits(opt),
            *constants,
        ),
        "KIND": record.native_kind,
        "NSLOTS": len(type(opt).SLOT_NAMES),
        "FLAG0": flags[0],
        "FLAG1": flags[1],
        "POW_IS_SQRT": record.power_is_sqrt(named),
        "ROW_TYPE": gpu.GPU_CODES[row_dtype],
        "SLOT_TYPE": gpu.GPU_CODES[slot_dtype],
        "STOCHASTIC": bool(stochastic) and (row_dtype, slot_dtype) != (torch.float32, torch.float32),
    }


TableTensors = tuple[Tensor, Sequence[Tensor]]  # (weights [V, D], slots [V, D] each, in the optimizer's order)
Rounding = tuple["Tensor | None", int]  # (the global id [V] of each row or None: its own, ``table_state``)
_DTYPES = {v: k for k, v in gpu.GPU_CODES.items()}


def found_cells(device: torch.device) -> Tensor:
    """A fresh found int64 [2] = ``NEVER`` for a dry run of ``update``."""
    return torch.full((2,), NEVER, dtype=torch.int64, device=device)


def step_flags(device: torch.device) -> tuple[Tensor, Tensor]:
    """A fresh (refused int64 [1] = 0, found int64 [2] = ``NEVER``) for ``update``."""
    return torch.zeros(1, dtype=torch.int64, device=device), found_cells(device)


def update(
    rs: RowSums,
    tables: Sequence[TableTensors | None],
    params: dict[str, Any],
    *,
    write: bool,
    refused: Tensor,
    found: Tensor | None = None,
    inline: bool = False,
    changed: Sequence[Tensor | None] | None = None,
    rounding: Sequence[Rounding | None] | None = None,
) -> None:
    """The fused update of the distinct keys of ``rs`` in one launch for every table of its group that
    ``tables`` names (None: a table this launch leaves alone; every named one takes ``params``), with
    ``rs.sums``, or with ``inline`` each row's gradients summed as it is applied (``rs`` not summed).
    ``write=False`` is the dry run: it writes no table or slot, puts the first key whose gradient or new
    values would not be finite in ``found`` [2] (``step_flags``; min over launches) and sets ``refused`` [1]
    when there is one or when phase 1 flagged an input. ``write=True`` writes nothing when ``refused`` is
    set. ``changed``: per table, a bool [V] whose rows the write sets where it writes (None: none).
    ``rounding``: per table, what the stochastic rounding of half values hashes (``Rounding``; None: rows are
    their own ids, state 0). Nothing is read back (no sync)."""
    k = gpu.kernels()
    device = rs.rows.device
    dim = rs.sorted["dim"]
    if len(tables) != len(rs.bases) - 1:
        raise gpu.GpuBufferError("embtables GPU kernel: one entry per table of the group.")
    addresses: list[int] = []
    aligned_tables = bool(gpu._ALIGN_HINTS) and dim % 4 == 0
    row_dtype, slot_dtype = _DTYPES[params["ROW_TYPE"]], _DTYPES[params["SLOT_TYPE"]]
    for j, entry in enumerate(tables):
        if entry is None:
            addresses += [0] * 7
            continue
        weights, slots = entry
        gpu.checked_contiguous(weights, "a table", row_dtype, device, 2)
        if tuple(weights.shape) != (rs.bases[j + 1] - rs.bases[j], dim):
            raise gpu.GpuBufferError(f"embtables GPU kernel: a table of the group must be [V, {dim}].")
        for s in slots:
            if gpu.checked_contiguous(s, "a slot", slot_dtype, device, 2).shape != weights.shape:
                raise gpu.GpuBufferError("embtables GPU kernel: every slot must have the table's shape.")
        given = None if rounding is None else rounding[j]
        global_rows, state = (None, 0) if given is None else given
        if global_rows is not None and gpu.checked_contiguous(
            global_rows, "global row ids", torch.int64, device, 1
        ).shape != (weights.shape[0],):
            raise gpu.GpuBufferError("embtables GPU kernel: global row ids must be [V] for every table.")
        if not 0 <= state < 2**32:
            raise gpu.GpuBufferError("embtables GPU kernel: a rounding state is a 32-bit value.")
        if len(slots) != params["NSLOTS"]:
            raise gpu.GpuBufferError("embtables GPU kernel: the slots do not match the optimizer.")
        marks = None if changed is None else changed[j]
        if marks is not None and gpu.checked_contiguous(marks, "changed rows", torch.bool, device, 1).shape != (
            weights.shape[0],
        ):
            raise gpu.GpuBufferError("embtables GPU kernel: changed rows must be [V] for every table.")
        aligned_tables = aligned_tables and all(t.data_ptr() % 16 == 0 for t in (weights, *slots))
        addresses += [weights.data_ptr(), *(s.data_ptr() for s in slots), *([weights.data_ptr()] * (3 - len(slots)))]
        addresses.append(0 if marks is None else marks.data_ptr())
        addresses += [0 if global_rows is None else global_rows.data_ptr(), state]
    gpu.check_refused(refused, device)
    if not write and (found is None or gpu.checked_contiguous(found, "found", torch.int64, device, 1).shape != (2,)):
        raise gpu.GpuBufferError("embtables GPU kernel: a dry run needs found [2].")
    n = rs.sorted["n"]
    if inline and rs.sums is not None:
        raise gpu.GpuBufferError("embtables GPU kernel: an inline update takes row sums not yet summed.")
    if n == 0 or dim == 0:
        return
    if inline:
        occurrences: tuple[Any, ...] = (rs.sorted["starts"], *rs.sorted["occurrences"], rs.sorted["pieces"])
        srt = rs.sorted
        flags = {"HAS_COEFFS": srt["has_coeffs"], "MULTI": srt["multi"], "ALIGNED": _aligned(srt)}
    else:
        if rs.sums is None or tuple(rs.sums.shape) != (n, dim):
            raise gpu.GpuBufferError(f"embtables GPU kernel: gradient sums must be [{n}, {dim}].")
        occurrences = (rs.rows,) * 11  # not read
        flags = {"HAS_COEFFS": False, "MULTI": False, "ALIGNED": False}
    steps = max(0, (len(rs.bases) - 2).bit_length())  # ceil(log2(T)) for T tables
    padded = rs.bases + [rs.bases[-1]] * ((1 << steps) + 1 - len(rs.bases))
    host = padded + addresses
    cached = rs.sorted.get("update_meta")
    if cached is not None and cached[0] == host:
        meta = cached[1]  # the dry run's copy of these very addresses (checked again above): no second copy
    else:
        meta = gpu.addresses(host, device)
        rs.sorted["update_meta"] = (host, meta)
    tile_rows, block_d, warps = gpu.tile(dim)
    k.update_kernel[(-(-n // tile_rows),)](
        rs.rows,
        rs.stats,
        meta[: len(padded)],
        meta[len(padded) :],
        rs.rows if rs.sums is None else rs.sums,  # INLINE: not read
        *occurrences,
        refused,
        refused if found is None else found,  # written by the dry run only
        dim,
        *params["scalars"],
        KIND=params["KIND"],
        NSLOTS=params["NSLOTS"],
        FLAG0=params["FLAG0"],
        FLAG1=params["FLAG1"],
        POW_IS_SQRT=params["POW_IS_SQRT"],
        ROW_TYPE=params["ROW_TYPE"],
        SLOT_TYPE=params["SLOT_TYPE"],
        STOCHASTIC=params["STOCHASTIC"],
        ALIGNED_TABLES=aligned_tables,
        LIBDEVICE=not interpreting(),
        WRITE=write,
        INLINE=inline,
        **flags,
        T_STEPS=steps,
        PIECE=gpu.PIECE,
        UNROLL=gpu.SUMS_UNROLL,
        ROWS=tile_rows,
        BLOCK_D=block_d,
        num_warps=warps,
        enable_fp_fusion=False,
    )
