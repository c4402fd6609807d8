"""The checked entry points of the fused GPU kernels (``kernels/triton_kernels.py``, Triton): the switches,
the buffer checks and launch helpers every entry point uses, the lookup and the input staging; the step's
phases 1 and 2 are ``kernels/gpu_step.py``'s.

Triton is optional and imported on first use: without it (or with ``EMBTABLES_GPU_KERNELS=0``) CUDA
tables take the torch kernels, which stay the reference. Every buffer a kernel reads is checked here
(dtype, device, contiguity, shape) in the call that launches it; what only the data can tell (ids
inside the table, offsets inside the ids) the kernels check themselves, flag in a status tensor and
never dereference. Nothing here reads a value back: the caller reads the statuses (``DeviceChecks``).

Tests run the same kernels on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1`` and
``set_enabled(True, on_cpu=True)``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from embtables.kernels import native_library, storage_types
from embtables.kernels.triton_interpreter import interpreting

_state: dict[str, Any] = {"module": None, "failed": False, "enabled": True, "on_cpu": False, "deferred": None}
F32_INF_BITS = 0x7F800000
MAX_GRID_Y = 65535
PIECE = 128  # occurrences of a run summed by one lane; longer runs are cut into pieces and joined
SUMS_UNROLL = 4  # occurrences whose loads a lane of the per-row sums has in flight
_TILE_FLOATS = 2048  # floats in a tile of rows (ROWS x BLOCK_D)
_TILE_WARPS = 0  # warps of a tile's program (0: one per 512 floats of the tile)
_LOOKUP_FLOATS = 1024  # floats of table rows a lookup program loads at once (BAGS x BLOCK_N x BLOCK_D)
_LOOKUP_WARPS = 1  # warps of a lookup program
_LOOKUP_BLOCK_N = 32  # most ids of a bag a lookup program loads at once
_ALIGN_HINTS = True  # tell the sums and the update that aligned tables, slots and gradients are (16-byte loads)


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


def kernels() -> ModuleType:
    module = _module()
    if module is None:
        raise GpuBufferError("embtables GPU kernel: Triton is not available.")
    return module


def _pow2(n: int, lo: int = 1) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def check_buffer(t: object, what: str, dtype: torch.dtype, device: torch.device, ndim: int) -> Tensor:
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


def checked_contiguous(t: object, what: str, dtype: torch.dtype, device: torch.device, ndim: int) -> Tensor:
    t = check_buffer(t, what, dtype, device, ndim)
    if not t.is_contiguous():
        raise GpuBufferError(f"embtables GPU kernel: {what} must be contiguous.")
    return t


def tile(dim: int) -> tuple[int, int, int]:
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


def is_aligned(t: Tensor, row_stride: int) -> bool:
    """``t`` starts 16 bytes aligned and its rows (``row_stride`` floats apart) do too."""
    return t.data_ptr() % 16 == 0 and row_stride % 4 == 0


def addresses(values: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int64).to(device, non_blocking=True)


def feature_chunks(meta: Tensor, columns: int, n: int) -> Iterator[tuple[int, int, list[Tensor]]]:
    """``(lo, hi, views)`` for features lo..hi-1 of ``meta`` (``columns`` columns of ``n`` per-feature values,
    one column after another), in chunks of at most ``MAX_GRID_Y`` features: a grid's second dimension, one
    program row per feature, holds at most 65535."""
    for lo in range(0, n, MAX_GRID_Y):
        hi = min(n, lo + MAX_GRID_Y)
        yield lo, hi, [meta[i * n + lo : i * n + hi] for i in range(columns)]


def check_refused(refused: Tensor | None, device: torch.device) -> None:
    if refused is not None and checked_contiguous(refused, "refused", torch.int64, device, 1).shape != (1,):
        raise GpuBufferError("embtables GPU kernel: refused must be [1].")


def check_coefficients(coeffs: Tensor | None, ids: Tensor, device: torch.device) -> None:
    if coeffs is not None and checked_contiguous(coeffs, "coefficients", torch.float32, device, 1).shape != ids.shape:
        raise GpuBufferError("embtables GPU kernel: coefficients must match the ids.")


LookupPart = tuple[Tensor, Tensor, Tensor, "Tensor | None"]  # (table [V, D], ids [N], offsets [S+1], coeffs [N])
GPU_CODES = {t.dtype: t.gpu_code for t in storage_types.STORAGE_TYPES}  # ``triton_common.T_*`` by dtype


def lookup_many(parts: Sequence[LookupPart], outs: Sequence[Tensor], refused: Tensor | None = None) -> Tensor:
    """Pool every feature in one launch: feature f reads ``parts[f]`` (a float32, bfloat16 or float16 table,
    widened as read) and writes ``outs[f]`` [S_f, D_f]
    (rows any stride apart, unit column stride). Returns the status [F] int32 (1: an id outside the table
    or broken offsets, 2: a non-finite activation) without reading it (no sync); sets ``refused`` (int64
    [1]) when a status is not 0."""
    k = kernels()
    device = outs[0].device
    n = len(parts)
    firsts, meta = [0], []
    block_d, pool = 1, 1
    for (table, ids, offsets, coeffs), out in zip(parts, outs):
        kind = getattr(table, "dtype", None)
        checked_contiguous(table, "a table", kind if kind in GPU_CODES else torch.float32, device, 2)
        checked_contiguous(ids, "ids", torch.int64, device, 1)
        checked_contiguous(offsets, "offsets", torch.int64, device, 1)
        s, dim = offsets.numel() - 1, table.shape[1]
        check_coefficients(coeffs, ids, device)
        check_buffer(out, "an output", torch.float32, device, 2)
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
        [GPU_CODES[t.dtype] for t, *_ in meta],
        [t.shape[1] for t, *_ in meta],
        [t.shape[0] for t, *_ in meta],
        [i.data_ptr() for _, i, *_ in meta],
        [i.numel() for _, i, *_ in meta],
        [o.data_ptr() for _, _, o, *_ in meta],
        [0 if c is None else c.data_ptr() for *_, c, _ in meta],
        [o.data_ptr() for *_, o in meta],
        [o.stride(0) for *_, o in meta],
    ]
    flat = addresses([v for col in columns for v in col], device)
    views, at = [], 0
    for col in columns:
        views.append(flat[at : at + len(col)])
        at += len(col)
    dims = {t.shape[1] for t, *_ in meta}
    types = {t.dtype for t, *_ in meta}
    aligned = all(is_aligned(t, 0) and is_aligned(o, o.stride(0)) for t, *_, o in meta)
    bags, block_n, block_d, warps = _lookup_shape(pool, block_d, n)
    check_refused(refused, device)
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
        TYPE=GPU_CODES[types.pop()] if len(types) == 1 else 3,  # 3: each feature's (``triton_lookup.T_MIXED``)
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return status


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
    k = kernels()
    device = parts[0][0].device
    check_refused(refused, device)
    flags = torch.zeros(len(parts), dtype=torch.int32, device=device)
    longest, bags, at, bag_at = 0, 1, [0], [0]
    for ids, splits, vocab, mode, _ in parts:
        checked_contiguous(ids, "ids", torch.int64, device, 1)
        if splits is not None:
            checked_contiguous(splits, "row splits", torch.int64, device, 1)
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
    meta = addresses([v for col in columns for v in col], device)
    n = len(parts)
    block = 1024
    passes = (0, 1) if drops and any(p[3] for p in parts) else (0,)
    for stage_pass in passes:
        for lo, hi, views in feature_chunks(meta, len(columns), n):
            k.stage_kernel[(-(-longest // block), hi - lo)](
                *views, segs, coeffs, negs, flags[lo:hi],
                segs if refused is None else refused, bags.bit_length(), BLOCK=block, REFUSE=refused is not None,
                DROPS=drops, PASS=stage_pass,
            )  # fmt: skip
    return flags, segs, coeffs
