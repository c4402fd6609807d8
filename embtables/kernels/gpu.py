"""The checked entry points of the fused GPU kernels (``kernels/triton_kernels.py``, Triton).

Triton is optional and imported on first use: without it (or with ``EMBTABLES_GPU_KERNELS=0``) CUDA
tables take the torch kernels, which stay the reference. Every buffer a kernel reads is checked here
(dtype, device, contiguity, shape) in the call that launches it; what only the data can tell (ids
inside the table, offsets inside the ids) the kernels check themselves, flag in a status tensor and
never dereference. Reading a status is the caller's one host sync per phase.

Tests run the same kernels on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1`` and
``set_enabled(True, on_cpu=True)``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from embtables.config.catalogue import Optimizer
from embtables.kernels import native_library
from embtables.kernels.clip_decay import clip_limits
from embtables.kernels.record import KernelRecord
from embtables.kernels.registry import record_of
from embtables.kernels.triton_interpreter import interpreting

_state: dict[str, Any] = {"module": None, "failed": False, "enabled": True, "on_cpu": False, "deferred": None}
F32_INF_BITS = 0x7F800000
_MAX_GRID_Y = 65535
_PIECE = 128  # occurrences of a run summed by one lane; longer runs are cut into pieces and joined
_SUMS_UNROLL = 4  # occurrences whose loads a lane of the per-row sums has in flight
_TILE_FLOATS = 2048  # floats in a tile of rows (ROWS x BLOCK_D)
_TILE_WARPS = 0  # warps of a tile's program (0: one per 512 floats of the tile)
_LOOKUP_FLOATS = 1024  # floats of table rows a lookup program loads at once (BAGS x BLOCK_N x BLOCK_D)
_LOOKUP_WARPS = 1  # warps of a lookup program
_LOOKUP_BLOCK_N = 32  # most ids of a bag a lookup program loads at once


class GpuBufferError(RuntimeError):
    """A buffer handed to a GPU kernel is not what the kernel reads (an embtables bug, never user input)."""


def _module() -> ModuleType | None:
    if _state["module"] is None and not _state["failed"]:
        try:
            from embtables.kernels import triton_kernels
        except Exception:  # no Triton, or one too old for these kernels: the torch kernels serve
            _state["failed"] = True
            return None
        _state["module"] = triton_kernels
    module: ModuleType | None = _state["module"]
    return module


def set_enabled(enabled: bool, *, on_cpu: bool = False) -> None:
    """Turn the fused GPU kernels on or off (tests compare them with the torch kernels). ``on_cpu``: also
    for CPU tables, through Triton's interpreter (only with ``TRITON_INTERPRET=1``; tests only)."""
    _state["enabled"] = bool(enabled)
    _state["on_cpu"] = bool(on_cpu)
    native_library.count_switch()  # a backend chosen before the switch is chosen again


def set_deferred_errors(deferred: bool | None) -> None:
    """Whether GPU backends chosen from now on raise a step's errors at the next call (no host sync in a
    steady-state step; the default) or in the call itself (one sync per call). None: the default, or
    ``EMBTABLES_GPU_ERRORS`` (``immediate`` / ``deferred``) when set."""
    _state["deferred"] = deferred
    native_library.count_switch()  # a backend chosen before the switch is chosen again


def deferred_errors() -> bool:
    """See ``set_deferred_errors``."""
    if _state["deferred"] is not None:
        return bool(_state["deferred"])
    return os.environ.get("EMBTABLES_GPU_ERRORS", "deferred").strip().lower() != "immediate"


def usable(device: torch.device) -> bool:
    """True when tables on ``device`` take the fused GPU kernels."""
    if device.type != "cuda" and not _state["on_cpu"]:  # CPU tables: the first test (this runs every step)
        return False
    if not _state["enabled"] or os.environ.get("EMBTABLES_GPU_KERNELS") == "0":
        return False
    if device.type == "cuda":
        return not interpreting() and _module() is not None
    return device.type == "cpu" and _state["on_cpu"] and interpreting() and _module() is not None


def usable_for(table: Tensor) -> bool:
    """``usable(table.device)``, answered for a CPU table without building a device object (every step)."""
    if not table.is_cuda and not _state["on_cpu"]:
        return False
    return usable(table.device)


def _kernels() -> ModuleType:
    module = _module()
    if module is None:
        raise GpuBufferError("embtables GPU kernel: Triton is not available.")
    return module


def _pow2(n: int, lo: int = 1) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def _check(t: object, what: str, dtype: torch.dtype, device: torch.device, ndim: int) -> Tensor:
    if not (
        isinstance(t, Tensor)
        and t.dtype == dtype
        and t.device == device
        and t.dim() == ndim
        and t.layout == torch.strided
        and not t.is_nested
    ):
        raise GpuBufferError(f"embtables GPU kernel: {what} must be a {ndim}-D {dtype} tensor on {device}.")
    return t


def _checked_contiguous(t: object, what: str, dtype: torch.dtype, device: torch.device, ndim: int) -> Tensor:
    t = _check(t, what, dtype, device, ndim)
    if not t.is_contiguous():
        raise GpuBufferError(f"embtables GPU kernel: {what} must be contiguous.")
    return t


def _tile(dim: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK_D, num_warps) of a kernel that works on a [ROWS, BLOCK_D] tile of rows: about 2048
    floats a program, in four warps."""
    block_d = _pow2(dim, 16)
    rows = max(1, min(32, _TILE_FLOATS // block_d))
    return rows, block_d, _TILE_WARPS or max(1, min(8, rows * block_d // 512))


def _lookup_shape(pool: int, dim: int, features: int) -> tuple[int, int, int, int]:
    """(BAGS, BLOCK_N, BLOCK_D, warps) of the lookup for bags of up to about ``pool`` ids of ``dim`` columns:
    a [BAGS, BLOCK_N, BLOCK_D] tile of about ``_LOOKUP_FLOATS`` floats (a program pools several short bags
    at once), its [BAGS, features] search for each bag's feature kept small; more warps only for a tile
    that one row already makes larger (wide tables: at most 32 floats a thread)."""
    block_d = _pow2(dim, 16)
    block_n = max(2, min(_pow2(pool, 2), _LOOKUP_BLOCK_N, _LOOKUP_FLOATS // block_d))
    bags = max(1, min(_LOOKUP_FLOATS // (block_n * block_d), 8192 // _pow2(features)))
    bags = 1 << (bags.bit_length() - 1)  # a power of two
    floats = bags * block_n * block_d
    return bags, block_n, block_d, max(_LOOKUP_WARPS, min(8, floats // 1024))


def _aligned(t: Tensor, row_stride: int) -> bool:
    """``t`` starts 16 bytes aligned and its rows (``row_stride`` floats apart) do too."""
    return t.data_ptr() % 16 == 0 and row_stride % 4 == 0


def _addresses(values: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int64).to(device, non_blocking=True)


def _check_refused(refused: Tensor | None, device: torch.device) -> None:
    if refused is not None and _checked_contiguous(refused, "refused", torch.int64, device, 1).shape != (1,):
        raise GpuBufferError("embtables GPU kernel: refused must be [1].")


def _check_coefficients(coeffs: Tensor | None, ids: Tensor, device: torch.device) -> None:
    if coeffs is not None and _checked_contiguous(coeffs, "coefficients", torch.float32, device, 1).shape != ids.shape:
        raise GpuBufferError("embtables GPU kernel: coefficients must match the ids.")


LookupPart = tuple[Tensor, Tensor, Tensor, "Tensor | None"]  # (table [V, D], ids [N], offsets [S+1], coeffs [N])


def lookup_many(parts: Sequence[LookupPart], outs: Sequence[Tensor], refused: Tensor | None = None) -> Tensor:
    """Pool every feature in one launch: feature f reads ``parts[f]`` and writes ``outs[f]`` [S_f, D_f]
    (rows any stride apart, unit column stride). Returns the status [F] int32 (1: an id outside the table
    or broken offsets, 2: a non-finite activation) without reading it (no sync); sets ``refused`` (int64
    [1]) when a status is not 0."""
    k = _kernels()
    device = outs[0].device
    n = len(parts)
    firsts, meta = [0], []
    block_d, pool = 1, 1
    for (table, ids, offsets, coeffs), out in zip(parts, outs):
        _checked_contiguous(table, "a table", torch.float32, device, 2)
        _checked_contiguous(ids, "ids", torch.int64, device, 1)
        _checked_contiguous(offsets, "offsets", torch.int64, device, 1)
        s, dim = offsets.numel() - 1, table.shape[1]
        _check_coefficients(coeffs, ids, device)
        _check(out, "an output", torch.float32, device, 2)
        if s < 0 or tuple(out.shape) != (s, dim) or (s > 1 and out.stride(0) < dim) or (dim > 1 and out.stride(1) != 1):
            raise GpuBufferError(f"embtables GPU kernel: an output must be [{s}, {dim}] with unit column stride.")
        firsts.append(firsts[-1] + s)
        meta.append((table, ids, offsets, coeffs, out))
        block_d = max(block_d, dim)
        pool = max(pool, -(-ids.numel() // max(s, 1)))
    status = torch.zeros(n, dtype=torch.int32, device=device)
    if firsts[-1] == 0:
        return status
    columns = [
        firsts,
        [t.data_ptr() for t, *_ in meta],
        [t.shape[1] for t, *_ in meta],
        [t.shape[0] for t, *_ in meta],
        [i.data_ptr() for _, i, *_ in meta],
        [i.numel() for _, i, *_ in meta],
        [o.data_ptr() for _, _, o, *_ in meta],
        [0 if c is None else c.data_ptr() for *_, c, _ in meta],
        [o.data_ptr() for *_, o in meta],
        [o.stride(0) for *_, o in meta],
    ]
    flat = _addresses([v for col in columns for v in col], device)
    views, at = [], 0
    for col in columns:
        views.append(flat[at : at + len(col)])
        at += len(col)
    dims = {t.shape[1] for t, *_ in meta}
    aligned = all(_aligned(t, 0) and _aligned(o, o.stride(0)) for t, *_, o in meta)
    bags, block_n, block_d, warps = _lookup_shape(pool, block_d, n)
    _check_refused(refused, device)
    k.lookup_kernel[(-(-firsts[-1] // bags),)](
        *views,
        status,
        status if refused is None else refused,
        F=n,
        FP=_pow2(n),
        DIM=dims.pop() if len(dims) == 1 else 0,
        ALIGNED=aligned and all(t.shape[1] % 4 == 0 for t, *_ in meta),
        BAGS=bags,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        REFUSE=refused is not None,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return status


GradPart = tuple[Tensor, Tensor, "Tensor | None", Tensor, int]
# (ids [N_f], seg [N_f], coeffs [N_f] or None, grad [S_f, D], the feature's table among the group's)

STATS = 6  # a group's phase-1 statistics (``RowSums.stats``)
NEVER = 2**63 - 1  # ``found``: no key


class RowSums:
    """Phase 1 of a group of tables of one width D on the device, before any sync. The group's rows are one
    key space: table j's row r is key ``bases[j] + r``. ``rows`` [N] holds ``stats[0]`` valid keys (distinct,
    ascending); ``sums`` [N, D] their summed gradients, or None when not yet summed (the update sums them:
    ``update(..., inline=)``; ``materialize`` sums them here). ``stats`` int64 [STATS]: the number of distinct
    keys U; the largest |sum| as float32 bits (>= ``F32_INF_BITS``: not finite; of the runs longer than
    ``_PIECE`` only while not summed); 1 when an id or a bag was outside its table or gradient; the longest
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
    """The summed phase 1 ``rs`` of one table as an update of every row of the table: keys 0..V-1, a zero
    sum where the batch has none (a non-lazy optimizer), ``rs``'s phase-1 flag kept. No sync."""
    if len(rs.bases) != 2:
        raise GpuBufferError("embtables GPU kernel: every_row takes the phase 1 of one table.")
    device, dim, v = rs.rows.device, rs.sorted["dim"], rs.bases[1]
    sums = materialize(rs)
    full = torch.zeros((v + 1, dim), dtype=torch.float32, device=device)  # row V takes the keys past U
    n = rs.rows.numel()
    live = torch.arange(n, device=device) < rs.stats[0]
    full.index_copy_(0, torch.where(live & (rs.rows >= 0), rs.rows, v), sums)
    stats = rs.stats.clone()
    stats[0] = v
    sorted_ = {"n": v, "dim": dim, "has_coeffs": False}
    return RowSums(torch.arange(v, device=device), full[:v], stats, rs.bases, sorted_)


def row_sums(parts: Sequence[GradPart], vocabularies: Sequence[int], dim: int, *, summed: bool = True) -> RowSums:
    """Dedup the occurrences of the features ``parts`` of a group of tables (``vocabularies``: each one's V)
    and sum each distinct row's gradients (occurrence order within a row), all on the device in a fixed
    number of launches, whatever the number of tables and features: no sync. ``summed=False``: sum only
    the runs longer than ``_PIECE`` here (their pieces joined in place); the update sums the others as it
    applies them."""
    k = _kernels()
    device = parts[0][3].device
    for ids, seg, coeffs, grad, j in parts:
        _checked_contiguous(ids, "ids", torch.int64, device, 1)
        if _checked_contiguous(seg, "segments", torch.int64, device, 1).shape != ids.shape:
            raise GpuBufferError("embtables GPU kernel: segments must match the ids.")
        _check_coefficients(coeffs, ids, device)
        _check(grad, "a gradient", torch.float32, device, 2)
        if grad.shape[1] != dim or (dim > 1 and grad.stride(1) != 1) or (grad.shape[0] > 1 and grad.stride(0) < dim):
            raise GpuBufferError(f"embtables GPU kernel: a gradient must be [S, {dim}] with unit column stride.")
        if not 0 <= j < len(vocabularies):
            raise GpuBufferError("embtables GPU kernel: a part names a table outside its group.")
    if any(v <= 0 for v in vocabularies):
        raise GpuBufferError("embtables GPU kernel: a table needs a positive vocabulary size.")
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
    pieces = torch.empty((2 * -(-n // _PIECE), dim), dtype=torch.float32, device=device)
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
    meta = _addresses([v for col in columns for v in col] + grad_meta, device)  # one copy to the device
    nf = len(parts)
    block = 1024
    for lo in range(0, nf, _MAX_GRID_Y):  # a grid's second dimension holds at most 65535 programs
        hi = min(nf, lo + _MAX_GRID_Y)
        k.gather_kernel[(-(-max(counts[lo:hi]) // block), hi - lo)](
            *(meta[i * nf + lo : i * nf + hi] for i in range(len(columns))), keys, segs, coeffs, feats, stats,
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
        "aligned": dim % 4 == 0 and all(_aligned(g, g.stride(0)) for g in grads),
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
        meta = _addresses(columns, dummy.device)
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


def _sum_runs(rs: RowSums, *, long_only: bool) -> Tensor | None:
    """Launch the per-row sums of ``rs`` (no sync): every run's into a new [N, D] (returned), or with
    ``long_only`` the runs longer than ``_PIECE`` only, joined in place in their pieces (None)."""
    k = _kernels()
    s = rs.sorted
    n, dim = s["n"], s["dim"]
    sums = None if long_only else torch.empty((n, dim), dtype=torch.float32, device=rs.rows.device)
    tile_rows, block_d, warps = _tile(dim)
    out = s["pieces"] if sums is None else sums  # LONG_ONLY writes no sums
    for first_pieces in (True, False):  # the later pieces' launch returns at once unless a run is long
        k.piece_sums_kernel[(-(-n // tile_rows),)](
            s["runs1"], s["starts"], *s["occurrences"], out, s["pieces"], rs.stats, n, dim,
            HAS_COEFFS=s["has_coeffs"], MULTI=s["multi"], ALIGNED=s["aligned"], FIRST=first_pieces,
            LONG_ONLY=long_only, PIECE=_PIECE, UNROLL=_SUMS_UNROLL, ROWS=tile_rows, BLOCK_D=block_d,
            num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    k.piece_join_kernel[(-(-n // tile_rows),)](
        s["starts"], out, s["pieces"], rs.stats, n, dim, IN_PLACE=long_only, PIECE=_PIECE, UNROLL=8,
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


def update_parameters(opt: Optimizer, lr: float, decay: float) -> dict[str, Any]:
    """The scalar arguments and flags of ``update_kernel`` for ``opt`` at ``lr`` and effective ``decay``:
    the kernel record's float32 constants and flags, as the native C kernels get them."""
    record: KernelRecord = record_of(opt)
    named = record.native_constants(opt, lr)
    constants = list(named.values())
    if len(constants) > 6:
        raise GpuBufferError(f"embtables GPU kernel: {type(opt).__name__} has more than 6 constants.")
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
    }


TableTensors = tuple[Tensor, Sequence[Tensor]]  # (weights [V, D], slots [V, D] each, in the optimizer's order)


def step_flags(device: torch.device) -> tuple[Tensor, Tensor]:
    """A fresh (refused int64 [1] = 0, found int64 [2] = ``NEVER``) for ``update``."""
    return torch.zeros(1, dtype=torch.int64, device=device), torch.full((2,), NEVER, dtype=torch.int64, device=device)


def update(
    rs: RowSums,
    tables: Sequence[TableTensors | None],
    params: dict[str, Any],
    *,
    write: bool,
    refused: Tensor,
    found: Tensor | None = None,
    inline: bool = False,
) -> None:
    """The fused update of the distinct keys of ``rs`` in one launch for every table of its group that
    ``tables`` names (None: a table this launch leaves alone; every named one takes ``params``), with
    ``rs.sums``, or with ``inline`` each row's gradients summed as it is applied (``rs`` not summed).
    ``write=False`` is the dry run: it writes no table or slot, puts the first key whose gradient or new
    values would not be finite in ``found`` [2] (``step_flags``; min over launches) and sets ``refused`` [1]
    when there is one or when phase 1 flagged an input. ``write=True`` writes nothing when ``refused`` is
    set. Nothing is read back (no sync)."""
    k = _kernels()
    device = rs.rows.device
    dim = rs.sorted["dim"]
    if len(tables) != len(rs.bases) - 1:
        raise GpuBufferError("embtables GPU kernel: one entry per table of the group.")
    addresses: list[int] = []
    for j, entry in enumerate(tables):
        if entry is None:
            addresses += [0, 0, 0, 0]
            continue
        weights, slots = entry
        _checked_contiguous(weights, "a table", torch.float32, device, 2)
        if tuple(weights.shape) != (rs.bases[j + 1] - rs.bases[j], dim):
            raise GpuBufferError(f"embtables GPU kernel: a table of the group must be [V, {dim}].")
        for s in slots:
            if _checked_contiguous(s, "a slot", torch.float32, device, 2).shape != weights.shape:
                raise GpuBufferError("embtables GPU kernel: every slot must have the table's shape.")
        if len(slots) != params["NSLOTS"]:
            raise GpuBufferError("embtables GPU kernel: the slots do not match the optimizer.")
        addresses += [weights.data_ptr(), *(s.data_ptr() for s in slots), *([weights.data_ptr()] * (3 - len(slots)))]
    _check_refused(refused, device)
    if not write and (found is None or _checked_contiguous(found, "found", torch.int64, device, 1).shape != (2,)):
        raise GpuBufferError("embtables GPU kernel: a dry run needs found [2].")
    n = rs.sorted["n"]
    if inline and rs.sums is not None:
        raise GpuBufferError("embtables GPU kernel: an inline update takes row sums not yet summed.")
    if n == 0 or dim == 0:
        return
    if inline:
        occurrences: tuple[Any, ...] = (rs.sorted["starts"], *rs.sorted["occurrences"], rs.sorted["pieces"])
        srt = rs.sorted
        flags = {"HAS_COEFFS": srt["has_coeffs"], "MULTI": srt["multi"], "ALIGNED": srt["aligned"]}
    else:
        if rs.sums is None or tuple(rs.sums.shape) != (n, dim):
            raise GpuBufferError(f"embtables GPU kernel: gradient sums must be [{n}, {dim}].")
        occurrences = (rs.rows,) * 11  # not read
        flags = {"HAS_COEFFS": False, "MULTI": False, "ALIGNED": False}
    steps = max(0, (len(rs.bases) - 2).bit_length())  # ceil(log2(T)) for T tables
    padded = rs.bases + [rs.bases[-1]] * ((1 << steps) + 1 - len(rs.bases))
    meta = _addresses(padded + addresses, device)
    tile_rows, block_d, warps = _tile(dim)
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
        LIBDEVICE=not interpreting(),
        WRITE=write,
        INLINE=inline,
        **flags,
        T_STEPS=steps,
        PIECE=_PIECE,
        UNROLL=_SUMS_UNROLL,
        ROWS=tile_rows,
        BLOCK_D=block_d,
        num_warps=warps,
        enable_fp_fusion=False,
    )


def bits_to_float(bits: Sequence[int]) -> tuple[float, ...]:
    """int32 bit patterns of non-negative floats (the kernels' maxima) as floats."""
    return tuple(torch.tensor(list(bits), dtype=torch.int32).view(torch.float32).tolist())


StagePart = tuple[Tensor, "Tensor | None", int, int, bool]
# (ids [N], row splits [B+1] or None (dense), V, coefficient mode, whether negative ids are dropped)


def stage_inputs(parts: Sequence[StagePart], refused: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The input rules of every feature, each id's bag and its coefficient, in one launch (two when a feature
    that drops negative ids has coefficients): ids in [0, V), row splits that start at 0, never decrease and
    end at N; mode 1 (mean) writes 1/c and mode 2 (sqrtn) 1/sqrt(c) for an id of a bag of c ids (IEEE
    division and square root: torch's bits). A feature that drops negative ids has them rewritten to -1 in
    its ``ids`` (the lookup and phase 1 skip them; their coefficient is 0 and c counts the others) instead of
    flagged. Returns (flags [F] int32, 0 where every rule holds; bags [sum N] int64 and coefficients [sum N]
    float32, feature after feature, written for features with row splits and with a nonzero mode), unread
    (no sync); sets ``refused`` (int64 [1]) when a flag is not 0."""
    k = _kernels()
    device = parts[0][0].device
    _check_refused(refused, device)
    flags = torch.zeros(len(parts), dtype=torch.int32, device=device)
    longest, bags, at, bag_at = 0, 1, [0], [0]
    for ids, splits, vocab, mode, _ in parts:
        _checked_contiguous(ids, "ids", torch.int64, device, 1)
        if splits is not None:
            _checked_contiguous(splits, "row splits", torch.int64, device, 1)
            bags = max(bags, splits.numel() - 1)
        if vocab <= 0:
            raise GpuBufferError("embtables GPU kernel: a table needs a positive vocabulary size.")
        if mode not in (0, 1, 2):
            raise GpuBufferError("embtables GPU kernel: a coefficient mode is 0, 1 or 2.")
        longest = max(longest, ids.numel(), 0 if splits is None else splits.numel())
        at.append(at[-1] + ids.numel())
        bag_at.append(bag_at[-1] + (0 if splits is None else max(splits.numel() - 1, 0)))
    segs = torch.empty(at[-1], dtype=torch.int64, device=device)
    coeffs = torch.empty(at[-1], dtype=torch.float32, device=device)
    if longest == 0:
        return flags, segs, coeffs
    drops = any(p[4] for p in parts)
    negs = torch.zeros(max(bag_at[-1], 1), dtype=torch.int64, device=device) if drops else segs
    columns = [
        [i.data_ptr() for i, *_ in parts],
        [i.numel() for i, *_ in parts],
        [p[2] for p in parts],
        [0 if s is None else s.data_ptr() for _, s, *_ in parts],
        [0 if s is None else s.numel() for _, s, *_ in parts],
        [p[3] for p in parts],
        [int(p[4]) for p in parts],
        at[:-1],
        bag_at[:-1],
    ]
    meta = _addresses([v for col in columns for v in col], device)
    n = len(parts)
    block = 1024
    passes = (0, 1) if drops and any(p[3] for p in parts) else (0,)
    for stage_pass in passes:
        for lo in range(0, n, _MAX_GRID_Y):  # a grid's second dimension holds at most 65535 programs
            hi = min(n, lo + _MAX_GRID_Y)
            k.stage_kernel[(-(-longest // block), hi - lo)](
                *(meta[i * n + lo : i * n + hi] for i in range(len(columns))), segs, coeffs, negs, flags[lo:hi],
                segs if refused is None else refused, bags.bit_length(), BLOCK=block, REFUSE=refused is not None,
                DROPS=drops, PASS=stage_pass,
            )  # fmt: skip
    return flags, segs, coeffs
