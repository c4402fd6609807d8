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

_state: dict[str, Any] = {"module": None, "failed": False, "enabled": True, "on_cpu": False}
F32_INF_BITS = 0x7F800000
_MAX_GRID_Y = 65535
_PIECE = 128  # occurrences of a run summed by one lane; longer runs are cut into pieces and joined
_SUMS_UNROLL = 4  # occurrences whose loads a lane of the per-row sums has in flight
_TILE_FLOATS = 2048  # floats in a tile of rows (ROWS x BLOCK_D)
_TILE_WARPS = 0  # warps of a tile's program (0: one per 512 floats of the tile)
_LOOKUP_FLOATS = 1024  # floats of table rows a lookup program loads at once (BAGS x BLOCK_N x BLOCK_D)
_LOOKUP_WARPS = 1  # warps of a lookup program
_LOOKUP_BLOCK_N = 32  # most ids of a bag a lookup program loads at once
DEFER_SUMS = 1  # 1: a lazy table's per-row sums are made by its update (``row_sums(defer=True)``) when proven finite


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


def _check_coefficients(coeffs: Tensor | None, ids: Tensor, device: torch.device) -> None:
    if coeffs is not None and _checked_contiguous(coeffs, "coefficients", torch.float32, device, 1).shape != ids.shape:
        raise GpuBufferError("embtables GPU kernel: coefficients must match the ids.")


LookupPart = tuple[Tensor, Tensor, Tensor, "Tensor | None"]  # (table [V, D], ids [N], offsets [S+1], coeffs [N])


def lookup_many(parts: Sequence[LookupPart], outs: Sequence[Tensor]) -> Tensor:
    """Pool every feature in one launch: feature f reads ``parts[f]`` and writes ``outs[f]`` [S_f, D_f]
    (rows any stride apart, unit column stride). Returns the status [F] int32 (1: an id outside the table
    or broken offsets, 2: a non-finite activation) without reading it (no sync)."""
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
    k.lookup_kernel[(-(-firsts[-1] // bags),)](
        *views,
        status,
        F=n,
        FP=_pow2(n),
        DIM=dims.pop() if len(dims) == 1 else 0,
        ALIGNED=aligned and all(t.shape[1] % 4 == 0 for t, *_ in meta),
        BAGS=bags,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return status


GradPart = tuple[Tensor, Tensor, "Tensor | None", Tensor]  # (ids [N_f], seg [N_f], coeffs [N_f], grad [S_f, D])


STATS = 6  # a table's phase-1 statistics (``RowSums.stats``)


class RowSums:
    """One table's distinct rows and (summed or, deferred, summable) gradients on the device, before their
    one sync. ``rows`` [N] holds ``stats[0]`` valid rows; ``sums`` [N, D] their summed gradients, or None
    when deferred (the update sums them: ``update(..., inline=)``; ``materialize`` sums them here).
    ``stats`` int64 [STATS]: the number of distinct rows U; the largest |sum| as float32 bits (>=
    ``F32_INF_BITS``: not finite; deferred: of the runs longer than ``_PIECE`` only); 1 when an id or a
    bag was outside the table or its gradient; the longest run (occurrences of one row); deferred: the
    largest |gradient| and |coefficient| as float32 bits (0 without coefficients)."""

    def __init__(self, rows: Tensor, sums: Tensor | None, stats: Tensor, sorted_: dict[str, Any]) -> None:
        self.rows, self.sums, self.stats = rows, sums, stats
        self.sorted = sorted_  # what the sums read: sorted occurrences, gradients, pieces, flags

    def sum_bound(self, stats: Sequence[int]) -> float:
        """Deferred: a bound on every |sum| from this table's ``stats`` (read back): the longest short run
        times the largest |gradient| and |coefficient| (a float32 sum of n terms of at most m in size is at
        most n m (1 + 2^-24)^n), and the long runs' exact largest |sum|; inf when not finite."""
        longest, gbits, cbits = stats[3], stats[4], stats[5]
        has_coeffs = self.sorted["has_coeffs"]
        if gbits >= F32_INF_BITS or (has_coeffs and cbits >= F32_INF_BITS) or stats[1] >= F32_INF_BITS:
            return float("inf")
        g, c, joined = bits_to_float([gbits, cbits if has_coeffs else 0x3F800000, stats[1]])
        return max(min(longest, _PIECE) * g * c * (1.0 + 2.0**-16), joined)


def row_sums(
    parts: Sequence[GradPart], vocabulary_size: int, dim: int, stats: Tensor | None = None, *, defer: bool = False
) -> RowSums:
    """Dedup the occurrences of one table's features (``parts``) and sum each distinct row's gradients
    (occurrence order within a row), all on the device: no sync. ``stats``: a zeroed int64 [STATS] to
    fill (one row of a [T, STATS] that the caller reads for every table at once), else one is made.
    ``defer``: sum only the runs longer than ``_PIECE`` here (their pieces joined in place) and measure
    the largest |gradient| instead; the update sums the others as it applies them."""
    k = _kernels()
    device = parts[0][3].device
    for ids, seg, coeffs, grad in parts:
        _checked_contiguous(ids, "ids", torch.int64, device, 1)
        if _checked_contiguous(seg, "segments", torch.int64, device, 1).shape != ids.shape:
            raise GpuBufferError("embtables GPU kernel: segments must match the ids.")
        _check_coefficients(coeffs, ids, device)
        _check(grad, "a gradient", torch.float32, device, 2)
        if grad.shape[1] != dim or (dim > 1 and grad.stride(1) != 1) or (grad.shape[0] > 1 and grad.stride(0) < dim):
            raise GpuBufferError(f"embtables GPU kernel: a gradient must be [S, {dim}] with unit column stride.")
    if stats is None:
        stats = torch.zeros(STATS, dtype=torch.int64, device=device)
    elif _checked_contiguous(stats, "stats", torch.int64, device, 1).shape != (STATS,):
        raise GpuBufferError(f"embtables GPU kernel: stats must be [{STATS}].")
    multi = len(parts) > 1
    ids = torch.cat([p[0] for p in parts]) if multi else parts[0][0]
    n = ids.numel()
    rows = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        empty = {"n": 0, "dim": dim, "has_coeffs": False}
        return RowSums(rows, None if defer else torch.empty((0, dim), device=device), stats, empty)
    segs = torch.cat([p[1] for p in parts]) if multi else parts[0][1]
    has_coeffs = any(p[2] is not None for p in parts)
    coeffs = (
        torch.cat([p[2] if p[2] is not None else torch.ones_like(p[1], dtype=torch.float32) for p in parts])
        if has_coeffs
        else segs
    )
    feats = torch.cat([torch.full_like(p[0], i) for i, p in enumerate(parts)]) if multi else segs  # unused unless multi
    grads = [p[3] for p in parts]
    pieces = torch.empty((2 * -(-n // _PIECE), dim), dtype=torch.float32, device=device)
    grad_args = _gradient_arguments(grads, pieces, segs)
    # int32 keys sort in half the radix passes; the sort is stable, so equal ids keep occurrence order
    keys = ids.to(torch.int32) if vocabulary_size <= 2**31 - 1 else ids
    sorted_keys, perm = torch.sort(keys, stable=True)
    sorted_ids = torch.empty(n, dtype=torch.int64, device=device)
    is_start = torch.empty(n, dtype=torch.int64, device=device)
    sorted_segs = torch.empty(n, dtype=torch.int64, device=device)
    sorted_coeffs = torch.empty(n, dtype=torch.float32, device=device) if has_coeffs else sorted_segs
    sorted_feats = torch.empty(n, dtype=torch.int64, device=device) if multi else sorted_segs
    block = 1024
    k.sort_marks_kernel[(-(-n // block),)](
        sorted_keys, perm, segs, coeffs, feats, sorted_ids, is_start, sorted_segs, sorted_coeffs, sorted_feats,
        grad_args[2], grad_args[5], stats, n, vocabulary_size, HAS_COEFFS=has_coeffs, MULTI=multi, BLOCK=block,
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
    rs = RowSums(rows, None, stats, sorted_)
    if defer:
        _sum_runs(rs, long_only=True)
        tile_rows, block_d, warps = _tile(dim)
        for g in (g for g in grads if g.shape[0] > 0):
            k.max_abs_kernel[(-(-g.shape[0] // tile_rows),)](
                g, g.stride(0), g.shape[0], dim, stats[4:5], ROWS=tile_rows, BLOCK_D=block_d, num_warps=warps
            )
    else:
        rs.sums = _sum_runs(rs, long_only=False)
    return rs


def _gradient_arguments(grads: Sequence[Tensor], dummy: Tensor, segs: Tensor) -> tuple[Any, ...]:
    """The gradient arguments of the per-row sums (``grad0, grad_ld, grad_nrows, grad_ptrs, grad_lds,
    grad_rows``): one feature's gradient itself (no addresses to copy to the device), or several features'
    addresses, row strides and rows (``dummy`` and ``segs``: float32 and int64 buffers never read)."""
    if len(grads) == 1:
        g = grads[0]
        return (g, g.stride(0), g.shape[0], segs, segs, segs)
    columns = [g.data_ptr() for g in grads] + [g.stride(0) for g in grads] + [g.shape[0] for g in grads]
    meta, nf = _addresses(columns, dummy.device), len(grads)
    return (dummy, 0, 0, meta[:nf], meta[nf : 2 * nf], meta[2 * nf :])


def own_gradients(rs: RowSums) -> None:
    """Deferred ``rs`` reads copies of its gradients from now on, so that a caller may write into the
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
    """The summed gradients [N, D] of deferred ``rs`` (launched here, no sync; ``rs.stats[1]`` then holds
    the exact largest |sum|); the sums themselves when they were not deferred."""
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


def update(
    rows: Tensor,
    sums: Tensor | None,
    weights: Tensor,
    slots: Sequence[Tensor],
    params: dict[str, Any],
    *,
    write: bool,
    measure: bool,
    inline: RowSums | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """The fused update of distinct ``rows`` [U] with ``sums`` [U, D] (``write=False``: the dry run), or
    with ``inline`` (a deferred ``row_sums``, whose first U rows are ``rows``; ``sums`` None) summing
    each row's gradients as it applies them.
    Returns (bad_row [1] int64, the dry run's: the smallest row whose new values are not finite, V when
    none; maxabs [4] int32 bits of max |new value| of (weights, *slots) when ``measure``), unread (no
    sync); None for what was not asked (a proven write allocates nothing)."""
    k = _kernels()
    device = weights.device
    _checked_contiguous(weights, "a table", torch.float32, device, 2)
    v, dim = weights.shape
    for s in slots:
        if _checked_contiguous(s, "a slot", torch.float32, device, 2).shape != weights.shape:
            raise GpuBufferError("embtables GPU kernel: every slot must have the table's shape.")
    if len(slots) != params["NSLOTS"]:
        raise GpuBufferError("embtables GPU kernel: the slots do not match the optimizer.")
    u = _checked_contiguous(rows, "rows", torch.int64, device, 1).numel()
    if inline is None:
        if _checked_contiguous(sums, "gradient sums", torch.float32, device, 2).shape != (u, dim):
            raise GpuBufferError(f"embtables GPU kernel: gradient sums must be [{u}, {dim}].")
    elif (
        sums is not None
        or inline.sorted["dim"] != dim
        or u > inline.sorted["n"]
        or rows.data_ptr() != inline.rows.data_ptr()
    ):
        raise GpuBufferError("embtables GPU kernel: an inline update takes its row sums' rows and no sums.")
    bad_row = None if write else torch.full((1,), v, dtype=torch.int64, device=device)
    maxabs = torch.zeros(4, dtype=torch.int32, device=device) if measure else None
    if u == 0 or dim == 0:
        return bad_row, maxabs
    if inline is None:
        occurrences: tuple[Any, ...] = (weights,) * 11  # not read
        flags = {"INLINE": False, "HAS_COEFFS": False, "MULTI": False, "ALIGNED": False}
    else:
        srt = inline.sorted
        occurrences = (srt["starts"], *srt["occurrences"], srt["pieces"])
        flags = {"INLINE": True, "HAS_COEFFS": srt["has_coeffs"], "MULTI": srt["multi"], "ALIGNED": srt["aligned"]}
    spare = [*slots, weights, weights, weights][:3]  # slots the optimizer lacks: never read
    tile_rows, block_d, warps = _tile(dim)
    k.update_kernel[(-(-u // tile_rows),)](
        rows,
        weights if sums is None else sums,  # INLINE: not read
        *occurrences,
        weights,
        *spare,
        rows if bad_row is None else bad_row,  # not written unless asked for
        weights if maxabs is None else maxabs,
        u,
        dim,
        v,
        *params["scalars"],
        KIND=params["KIND"],
        NSLOTS=params["NSLOTS"],
        FLAG0=params["FLAG0"],
        FLAG1=params["FLAG1"],
        POW_IS_SQRT=params["POW_IS_SQRT"],
        LIBDEVICE=not interpreting(),
        WRITE=write,
        MEASURE=measure,
        **flags,
        PIECE=_PIECE,
        UNROLL=_SUMS_UNROLL,
        ROWS=tile_rows,
        BLOCK_D=block_d,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return bad_row, maxabs


def bits_to_float(bits: Sequence[int]) -> tuple[float, ...]:
    """int32 bit patterns of non-negative floats (the kernels' maxima) as floats."""
    return tuple(torch.tensor(list(bits), dtype=torch.int32).view(torch.float32).tolist())


ValidatePart = tuple[Tensor, "Tensor | None", int]  # (ids [N], row splits [B+1] or None (dense), V)


def validate_inputs(parts: Sequence[ValidatePart]) -> Tensor:
    """The input rules of every feature in one launch: ids in [0, V), row splits that start at 0, never
    decrease and end at N. Returns flags [F] int32 (0: every rule holds), unread (no sync)."""
    k = _kernels()
    device = parts[0][0].device
    flags = torch.zeros(len(parts), dtype=torch.int32, device=device)
    longest = 0
    for ids, splits, vocab in parts:
        _checked_contiguous(ids, "ids", torch.int64, device, 1)
        if splits is not None:
            _checked_contiguous(splits, "row splits", torch.int64, device, 1)
        if vocab <= 0:
            raise GpuBufferError("embtables GPU kernel: a table needs a positive vocabulary size.")
        longest = max(longest, ids.numel(), 0 if splits is None else splits.numel())
    if longest == 0:
        return flags
    columns = [
        [i.data_ptr() for i, _, _ in parts],
        [i.numel() for i, _, _ in parts],
        [v for _, _, v in parts],
        [0 if s is None else s.data_ptr() for _, s, _ in parts],
        [0 if s is None else s.numel() for _, s, _ in parts],
    ]
    meta = _addresses([v for col in columns for v in col], device)
    n = len(parts)
    block = 1024
    for lo in range(0, n, _MAX_GRID_Y):  # a grid's second dimension holds at most 65535 programs
        hi = min(n, lo + _MAX_GRID_Y)
        k.validate_kernel[(-(-longest // block), hi - lo)](
            *(meta[i * n + lo : i * n + hi] for i in range(len(columns))), flags[lo:hi], BLOCK=block
        )
    return flags
