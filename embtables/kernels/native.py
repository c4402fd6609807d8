"""The native CPU kernels' checked entry points: every buffer a C function reads or writes is checked here,
in the call that hands it to C (dtype, device, size, contiguity), and C re-checks every id and offset.

The library itself is built and loaded by ``kernels/native_library.py`` (``library()``, ``set_enabled()``);
tensors on other devices always take the torch path, which is the reference.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from embtables.config.catalogue import Optimizer
from embtables.kernels import storage_types
from embtables.kernels.clip_decay import clip_limits
from embtables.kernels.native_abi import NativeBufferError as NativeBufferError
from embtables.kernels.native_abi import raise_for, unchecked
from embtables.kernels.native_args import array
from embtables.kernels.native_library import OptParams as _OptParams
from embtables.kernels.native_library import library as library
from embtables.kernels.native_library import loaded
from embtables.kernels.native_library import set_enabled as set_enabled
from embtables.kernels.registry import record_of

_NATIVE_DTYPES = (torch.float32, torch.int64)


def usable(*tensors: Tensor | None) -> bool:
    """True when the native path is on and every tensor is a contiguous CPU float32 or int64 tensor."""
    if library() is None:
        return False
    for t in tensors:  # a loop, not all(genexpr): this runs several times per feature per step
        if t is not None and not (t.is_cpu and t.dtype in _NATIVE_DTYPES and t.is_contiguous()):
            return False
    return True


_ANY_1D = (-1,)


def require(t: object, what: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """``t`` as a contiguous CPU tensor of ``dtype`` and exactly ``shape`` (-1 = any), else raise.

    Every buffer is checked here, in the call that hands it to C, so C never reads past an allocation."""
    # the common case first, in one expression (this runs for every buffer of every native call)
    if type(t) is Tensor and t.dtype is dtype and t.is_cpu and t.is_contiguous():
        if shape == _ANY_1D:
            if t.dim() == 1:
                return t
        elif len(shape) == 2:
            if t.dim() == 2:
                rows, cols = t.shape
                if (shape[0] == -1 or shape[0] == rows) and (shape[1] == -1 or shape[1] == cols):
                    return t
        elif t.dim() == len(shape) and all(w == -1 or w == n for w, n in zip(shape, t.shape)):
            return t
    ok = isinstance(t, Tensor) and t.dtype == dtype and t.is_cpu and t.is_contiguous() and t.dim() == len(shape)
    if ok:
        assert isinstance(t, Tensor)
        for want, size in zip(shape, t.shape):
            if want != -1 and want != size:
                ok = False
    if not ok:
        got = (
            f"{t.dtype} {tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}"
            if isinstance(t, Tensor)
            else type(t).__name__
        )
        raise NativeBufferError(
            f"embtables native kernel: {what} must be a contiguous CPU {dtype} tensor of shape {shape}, got {got}."
        )
    assert isinstance(t, Tensor)
    return t


def require_optional(t: Tensor | None, what: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor | None:
    return None if t is None else require(t, what, dtype, shape)


def pointer(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def threads() -> int:
    return max(1, torch.get_num_threads())


def opt_params(opt: Optimizer, lr: float, decay: float, *, clip_gradients: bool) -> _OptParams:
    """The C parameter block for ``opt`` at learning rate ``lr`` and effective decay ``decay``: its
    kernel record's kind, flags and derived float32 constants (exactly as the torch kernels use them)."""
    try:
        record = record_of(opt)
    except TypeError as exc:  # never fall through to another optimizer's kernel
        raise NativeBufferError(f"embtables native kernel: no native kernel for {type(opt).__name__}.") from exc
    p = _OptParams()
    p.kind = record.native_kind
    p.glo, p.ghi, p.wlo, p.whi = clip_limits(opt, clip_gradients=clip_gradients)
    p.lr, p.decay = lr, decay
    flags, constants = record.native_flags(opt), record.native_constants(opt, lr)
    if flags:
        member = getattr(p.flags, record.native_name)
        for name, value in flags.items():
            setattr(member, name, int(bool(value)))
    if constants:
        member = getattr(p.constants, record.native_name)
        for name, constant in constants.items():
            setattr(member, name, constant)
    return p


def all_finite(tensors: list[Tensor]) -> bool:
    """True when no value of the float32 ``tensors`` is NaN or Inf: one native pass (an integer max over
    the bit patterns, which vectorises), or torch when a tensor is not a contiguous CPU float32 one."""
    lib = library()
    if lib is None or not all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.layout == torch.strided
        for t in tensors
    ):
        return all(bool(torch.isfinite(t).all()) for t in tensors)
    n = len(tensors)
    ptrs = (ctypes.c_void_p * n)(*[t.data_ptr() for t in tensors])
    return bool(lib.et_all_finite(n, ptrs, (ctypes.c_int64 * n)(*[t.numel() for t in tensors])))


def round_rows(
    values: Tensor,
    rows: Tensor,
    seed: int,
    step: int,
    table: int,
    dtype: torch.dtype,
    *,
    stochastic: bool = True,
    out: Tensor | None = None,
) -> Tensor | None:
    """``values`` [U, D] (float32) stochastically rounded to ``dtype`` (bfloat16 or float16) by the C kernels,
    row u's random bits from (seed, step, table, ``rows[u]``, column): ``stochastic_rounding.round_to`` with
    ``random_bits``, bit for bit (docs/spec.md §12); ``stochastic=False``: to nearest, ties to even (the rows'
    ids and the seeds unused). ``out``: an int16 [U, D] to write into (a benchmark reuses one). None when the
    native library is not built."""
    lib = library()
    if lib is None:
        return None
    record = storage_types.BY_DTYPE.get(dtype)
    if record is None or not record.half:
        raise TypeError(f"round_rows: {dtype} is not a half type.")
    require(values, "values", torch.float32, (-1, -1))
    require(rows, "rows", torch.int64, (values.shape[0],))
    if out is None:
        out = torch.empty(values.shape, dtype=torch.int16)
    require(out, "out", torch.int16, tuple(values.shape))
    lib.et_round_rows(values.data_ptr(), values.shape[0], values.shape[1], rows.data_ptr(), seed, step, table,
                      record.c_kind, int(stochastic), out.data_ptr())  # fmt: skip
    return out.view(dtype)


def rounding_path(vector: bool | None = None) -> bool | None:
    """Whether the C kernels round half rows with their vector loops (8 values at a time, this CPU's widest
    integer vectors) or their scalar ones: the same bits, the vector loops by default. ``vector`` sets it for
    the process (the tests force each path and compare); returns the path before, None without the library."""
    lib = library()
    if lib is None:
        return None
    return bool(lib.et_round_path(-1 if vector is None else int(vector)))


def bounds_path(lanes: int | None = None) -> int | None:
    """The lanes of the C bounds pass (``Workspace.touched_bounds``): 16 where the library is built with
    AVX-512, else 8; the same bounds either way. ``lanes`` sets them for the process (8, or 16 where built with
    AVX-512; the tests force each path and compare); returns the lanes before, None without the library."""
    lib = library()
    if lib is None:
        return None
    return int(lib.et_bounds_path(0 if lanes is None else int(lanes)))


def changed_marker(items: list[tuple[Workspace, Tensor, bool, int]]) -> Callable[[], None]:
    """For each (workspace, changed flags, dense, V): the call that marks ``changed`` at every row the
    workspace's latest update wrote (every row when ``dense``), all in one native call; the flags are a bool
    [V] (``ChangedRows``). The buffers are checked here and
    the call's arguments built once: the marker may be called after every step while the workspaces and flags
    stay these (it holds them)."""
    lib = library()
    assert lib is not None
    n = len(items)
    for _, changed, _, v in items:
        require(changed, "changed rows", torch.bool, (v,))
    handles = (ctypes.c_void_p * n)(*[item[0].handle for item in items])
    flags = (ctypes.c_void_p * n)(*[item[1].data_ptr() for item in items])
    vocab = (ctypes.c_int64 * n)(*[item[3] for item in items])
    mode = (ctypes.c_int32 * n)(*[int(item[2]) for item in items])  # bit 0: dense
    count, fn = ctypes.c_int64(n), unchecked(lib).et_mark_changed
    held = list(items)

    def mark() -> None:
        assert held  # the workspaces and flags stay alive while the marker does
        fn(count, handles, flags, vocab, mode)

    return mark


class Bags:
    """Several features' bags for one native call: each feature's ``ids [N]``, ``offsets [S+1]`` and
    ``coeffs [N] | None`` checked (the one place these rules live) and their addresses and sizes
    collected, in call order."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.n_ids: list[int] = []
        self.offsets: list[int] = []
        self.n_bags: list[int] = []
        self.coeffs: list[int | None] = []

    def add(self, ids: Tensor, offsets: Tensor, coeffs: Tensor | None) -> int:
        """Check and collect one feature's bags; returns their count S."""
        require(ids, "ids", torch.int64, (-1,))
        require(offsets, "offsets", torch.int64, (-1,))
        bags = offsets.numel() - 1
        if bags < 0:
            raise NativeBufferError("embtables native kernel: offsets must hold at least one value.")
        if coeffs is not None:
            require(coeffs, "coeffs", torch.float32, (ids.numel(),))
        self.ids.append(ids.data_ptr())
        self.n_ids.append(ids.numel())
        self.offsets.append(offsets.data_ptr())
        self.n_bags.append(bags)
        self.coeffs.append(None if coeffs is None else coeffs.data_ptr())
        return bags


def lookup_many(
    parts: list[tuple[Tensor, Tensor, Tensor, Tensor | None]], into: tuple[Tensor, list[int]] | None = None
) -> tuple[list[Tensor], int]:
    """Several lookups in one parallel region: for each ``(table [V, D], ids [N], offsets [S+1],
    coeffs [N] | None)`` the pooled ``[S, D]`` activations. ``into = (out [S, W], starts)`` writes them as
    column blocks ``out[:, starts[f] : starts[f] + D]`` of one float32 buffer (every part has S bags) and
    returns ``[out]``; else each gets its own tensor. Every buffer is checked first; C re-checks every
    offset and id against V in the same call. Returns the outputs and a status: 0 ok, 1 an id outside
    [0, V) or bad offsets (outputs unusable), 2 a non-finite activation."""
    lib = library()
    assert lib is not None
    n = len(parts)
    f32 = torch.float32
    w_ptr, dims, vocab = [], [], []  # type: list[int], list[int], list[int]
    bags_in = Bags()
    n_bags = bags_in.n_bags
    checked: set[int] = set()  # tables already checked in this call (features sharing a table)
    for table, ids, offsets, coeffs in parts:
        if id(table) not in checked:
            require(table, "table", f32, (-1, -1))
            checked.add(id(table))
        bags_in.add(ids, offsets, coeffs)
        vocab_size, dim = table.shape
        w_ptr.append(table.data_ptr())
        dims.append(dim)
        vocab.append(vocab_size)
    if into is None:
        outs = [torch.empty((bags, dim), dtype=f32) for bags, dim in zip(n_bags, dims)]
        out_ptr, ld = [o.data_ptr() for o in outs], dims
    else:
        buf, starts = into
        require(buf, "output", f32, (-1, -1))
        rows, width = buf.shape
        if len(starts) != n or any(
            bags != rows or st < 0 or st + dim > width for bags, dim, st in zip(n_bags, dims, starts)
        ):
            raise NativeBufferError("embtables native kernel: the output columns do not fit the shared buffer.")
        base = buf.data_ptr()
        outs, out_ptr, ld = [buf], [base + 4 * st for st in starts], [width] * n
    vp, c64 = ctypes.c_void_p, ctypes.c_int64
    status = lib.et_lookup_many(
        n,
        array("lookup.w", vp, w_ptr),
        array("lookup.dims", c64, dims),
        array("lookup.vocab", c64, vocab),
        array("lookup.ids", vp, bags_in.ids),
        array("lookup.n_ids", c64, bags_in.n_ids),
        array("lookup.offsets", vp, bags_in.offsets),
        array("lookup.n_bags", c64, n_bags),
        array("lookup.coeffs", vp, bags_in.coeffs),
        array("lookup.out", vp, out_ptr),
        array("lookup.ld", c64, ld),
        threads(),
    )
    return outs, int(status)


# One table's phase 2 for ``apply_many``: (workspace, weights, slots, params, dense, check).
ApplyItem = tuple["Workspace", Tensor, tuple[Tensor, ...], _OptParams, bool, bool]


def apply_many(items: list[ApplyItem]) -> list[int]:
    """``Workspace.apply`` for several tables in one native call, all or nothing: tables whose ``check``
    is set get the exact dry run (``Workspace.check``) first, and when any would write a non-finite
    value no table is written. Returns, per table, the row whose update is not finite (-1: none; when any
    is not -1, nothing was written)."""
    lib = library()
    assert lib is not None
    n = len(items)
    f32 = torch.float32
    handles, w_ptr, vocab, dims, params = [], [], [], [], []  # type: list[int], list[int], list[int], list[int], list[Any]
    s_ptr: tuple[list[int | None], list[int | None], list[int | None]] = ([], [], [])
    flags: tuple[list[int], list[int], list[int]] = ([], [], [])
    for ws, weights, slots, p, dense, check in items:
        require(weights, "weights", f32, (-1, ws.dim))
        s0, s1, s2 = slot_tensors(weights, slots)
        s_ptr[0].append(None if s0 is None else s0.data_ptr())
        s_ptr[1].append(None if s1 is None else s1.data_ptr())
        s_ptr[2].append(None if s2 is None else s2.data_ptr())
        handles.append(ws.handle)
        w_ptr.append(weights.data_ptr())
        vocab.append(weights.shape[0])
        dims.append(ws.dim)
        params.append(ctypes.addressof(p))  # kept alive by ``items`` for the call
        flags[0].append(int(dense))
        flags[1].append(0)  # nothing measured: the C call's maxabs output is not read
        flags[2].append(int(check))
    vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    maxabs = (ctypes.c_float * (4 * n))()
    status, bad = (i32 * n)(), (i64 * n)()
    lib.et_apply_many(
        n,
        array("apply.handles", vp, handles),
        array("apply.w", vp, w_ptr),
        array("apply.s0", vp, s_ptr[0]),
        array("apply.s1", vp, s_ptr[1]),
        array("apply.s2", vp, s_ptr[2]),
        array("apply.vocab", i64, vocab),
        array("apply.dims", i64, dims),
        array("apply.params", vp, params),
        array("apply.dense", i32, flags[0]),
        array("apply.measure", i32, flags[1]),
        array("apply.check", i32, flags[2]),
        threads(),
        maxabs,
        status,
        bad,
        None,  # no bounds: every checked table is checked exactly (the fast path proves small updates)
        None,
        None,
    )
    raise_for("et_apply_many", status)
    return list(bad)


def slot_tensors(weights: Tensor, slots: tuple[Tensor, ...]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The (at most three) slots of a [V, D] table, each checked to be [V, D] float32 like it."""
    if len(slots) > 3:
        raise NativeBufferError(f"embtables native kernel: at most 3 slots, got {len(slots)}.")
    shape = weights.shape
    checked: list[Tensor | None] = [None, None, None]
    for i, slot in enumerate(slots):
        # the common case in one expression (every native update checks every slot)
        if not (
            type(slot) is Tensor
            and slot.dtype is torch.float32
            and slot.is_cpu
            and slot.is_contiguous()
            and slot.shape == shape
        ):
            require(slot, f"slot {i}", torch.float32, tuple(shape))  # raises, naming what is wrong
        checked[i] = slot
    return checked[0], checked[1], checked[2]


class Workspace:
    """One table's native scratch memory, reused every step (steady-state steps allocate nothing; a
    buffer over 4x a step's need is freed and sized again, so one huge step does not pin memory).

    After ``prepare_many`` (or ``load``) it holds phase 1 of that step: the unique rows and their
    summed gradients, until the next ``prepare_many`` on it. It is scratch: a copy or a pickle of a
    module never carries it (a pending update is copied as tensors, see ``TableGradient``).
    """

    def __init__(self, dim: int) -> None:
        lib = library()
        assert lib is not None
        handle = lib.et_workspace_new()
        if not handle:
            raise MemoryError("embtables: could not allocate a native workspace.")
        self._handle: int | None = handle
        self.dim = dim

    @property
    def handle(self) -> int:
        assert self._handle is not None, "the workspace was freed"
        return self._handle

    @property
    def num_rows(self) -> int:
        lib = library()
        assert lib is not None
        return int(lib.et_prepared_size(self.handle))

    @property
    def nbytes(self) -> int:
        """Bytes of scratch memory held now (at most ~4x the last step's need beyond 1 MiB buffers)."""
        lib = library()
        assert lib is not None
        return int(lib.et_workspace_bytes(self.handle))

    @property
    def gradient_max_abs(self) -> float:
        """An upper bound on max |G| over the prepared summed gradients (0 when there are none): the most
        occurrences of one row x the largest |coefficient| x the largest |incoming gradient| when that is below
        1e37 (then no sum can overflow, and phase 1 does not read the sums again), else the exact max |G|."""
        lib = library()
        assert lib is not None
        return float(lib.et_prepared_gmax(self.handle))

    def rows_and_grads(self) -> tuple[Tensor, Tensor]:
        """Copies of the prepared unique rows [U] and summed gradients [U, D]."""
        lib = library()
        assert lib is not None
        u = self.num_rows
        rows = torch.empty(u, dtype=torch.int64)
        grads = torch.empty((u, self.dim), dtype=torch.float32)
        lib.et_prepared_copy(self.handle, rows.data_ptr(), grads.data_ptr())
        return rows, grads

    def load(self, rows: Tensor, grads: Tensor, vocabulary_size: int) -> int:
        """Fill the workspace with distinct ``rows`` [U] in [0, V) and summed ``grads`` [U, D], as phase 1
        would. Returns 0 ok, 2 out of memory, 3 a row out of range or repeated (workspace left empty)."""
        lib = library()
        assert lib is not None
        require(rows, "rows", torch.int64, (-1,))
        require(grads, "grads", torch.float32, (rows.numel(), self.dim))
        return int(
            lib.et_workspace_load(
                self.handle, rows.data_ptr(), grads.data_ptr(), rows.numel(), self.dim, vocabulary_size
            )
        )

    def check(self, weights: Tensor, slots: tuple[Tensor, ...], params: _OptParams, *, dense: bool) -> int:
        """Phase 2 dry run: -1 when the update would write only finite values, else a row id whose
        update is not finite. Nothing is written."""
        lib = library()
        assert lib is not None
        require(weights, "weights", torch.float32, (-1, self.dim))
        s0, s1, s2 = slot_tensors(weights, slots)
        bad = int(
            lib.et_check(
                self.handle,
                weights.data_ptr(),
                pointer(s0),
                pointer(s1),
                pointer(s2),
                weights.shape[0],
                self.dim,
                ctypes.byref(params),
                int(dense),
                threads(),
            )
        )
        raise_for("et_check", bad, f"optimizer kind {params.kind}")
        return bad

    def touched_bounds(
        self, weights: Tensor, slots: tuple[Tensor, ...], *, dense: bool
    ) -> tuple[list[float], list[float]]:
        """Bounds on the values the prepared update reads, measured now over exactly its rows (every row when
        ``dense``): the largest |value| (inf when any is not finite) of the weights and each slot, and the
        smallest value of each slot (NaN or -inf when one is; -inf for the weights, whose smallest value no
        proof reads and the pass does not measure)."""
        lib = library()
        assert lib is not None
        require(weights, "weights", torch.float32, (-1, self.dim))
        s0, s1, s2 = slot_tensors(weights, slots)
        hi, lo = (ctypes.c_double * 4)(), (ctypes.c_double * 4)()
        status = int(
            lib.et_touched_bounds(
                self.handle, weights.data_ptr(), pointer(s0), pointer(s1), pointer(s2), weights.shape[0], self.dim,
                int(dense), threads(), hi, lo,
            )
        )  # fmt: skip
        raise_for("et_touched_bounds", status)
        n = 1 + len(slots)
        return list(hi)[:n], list(lo)[:n]

    def apply(self, weights: Tensor, slots: tuple[Tensor, ...], params: _OptParams, *, dense: bool) -> None:
        """Phase 2: the fused per-row update of ``weights`` [V, D] and ``slots`` (in place)."""
        apply_many([(self, weights, slots, params, dense, False)])

    def __deepcopy__(self, memo: dict[int, Any]) -> Workspace:
        return Workspace(self.dim)  # scratch memory: a copy gets its own, never the same handle

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("embtables: a native Workspace is scratch memory and is never pickled.")

    def __del__(self) -> None:
        lib = loaded()
        if getattr(self, "_handle", None) is not None and lib is not None:
            lib.et_workspace_free(self._handle)
        self._handle = None


FeaturePart = tuple[Tensor, Tensor, Tensor | None, Tensor | None]


def gradient_rows(grad: Tensor, dim: int) -> int | None:
    """The row stride of a CPU float32 gradient [S, D] the native phase 1 reads: D when contiguous, the
    wider row of a column block (a feature's columns of the concatenated activations' gradient) when its
    rows are ``stride(0) >= D`` floats apart with unit column stride; None otherwise."""
    if grad.dim() == 2:
        rows, cols = grad.stride()
        if cols == 1 and rows >= dim:  # contiguous (rows == D) or a column block
            return int(rows)
    return dim if grad.is_contiguous() else None  # a size-1 dimension may carry any stride


def gradient_stride(grad: Tensor, bags: int, dim: int) -> int:
    """The row stride phase 1 reads a gradient with, after checking that it is a CPU float32 [S, D] tensor
    (``bags`` x ``dim``), contiguous or a column block (``gradient_rows``); raises otherwise."""
    fits = type(grad) is Tensor and grad.dtype is torch.float32 and grad.is_cpu and grad.shape == (bags, dim)
    row = gradient_rows(grad, dim) if fits else None
    if row is None:
        require(grad, "gradient", torch.float32, (bags, dim))  # raises, naming what is wrong
        raise NativeBufferError("embtables native kernel: the gradient's rows are not laid out as [S, D].")
    return row


def prepare_many(tables: list[tuple[Workspace, int, list[FeaturePart]]]) -> list[int]:
    """Phase 1 for several tables in one call: for each ``(workspace, V, parts)``, where every part is a
    feature's ``(ids [N], offsets [S+1], coeffs [N] | None, grad [S, D] | None)``, dedup the ids and
    sum the gradients into the workspace. A gradient is contiguous or a column block of a wider one (rows
    ``stride(0)`` apart, see ``gradient_rows``). Every buffer is checked first and C re-checks every
    offset and id against V. Returns a status per table: 0 ok, 1 non-finite gradient, 2 out of memory,
    3 an id outside [0, V) or bad offsets."""
    lib = library()
    assert lib is not None
    first = [0]
    bags_in = Bags()
    g_ptr, strides = [], []  # type: list[int | None], list[int]
    for ws, _, table_parts in tables:
        dim = ws.dim
        for ids, offsets, coeffs, grad in table_parts:
            bags = bags_in.add(ids, offsets, coeffs)
            g_ptr.append(None if grad is None else grad.data_ptr())
            strides.append(dim if grad is None else gradient_stride(grad, bags, dim))
        first.append(len(bags_in.ids))
    t = len(tables)
    vp, c64 = ctypes.c_void_p, ctypes.c_int64
    statuses = (ctypes.c_int * t)()
    lib.et_prepare_many(
        t,
        array("prepare.first", c64, first),
        array("prepare.ids", vp, bags_in.ids),
        array("prepare.n_ids", c64, bags_in.n_ids),
        array("prepare.offsets", vp, bags_in.offsets),
        array("prepare.n_bags", c64, bags_in.n_bags),
        array("prepare.coeffs", vp, bags_in.coeffs),
        array("prepare.grads", vp, g_ptr),
        array("prepare.strides", c64, strides),
        array("prepare.dims", c64, [ws.dim for ws, _, _ in tables]),
        array("prepare.vocab", c64, [v for _, v, _ in tables]),
        threads(),
        array("prepare.handles", vp, [ws.handle for ws, _, _ in tables]),
        statuses,
    )
    return list(statuses)


def apply_sequential(
    rows: Tensor, grads: Tensor, weights: Tensor, slots: tuple[Tensor, ...], params: _OptParams
) -> None:
    """Apply occurrences one at a time, in order (no accumulation): ``rows`` [N], ``grads`` [N, D]."""
    lib = library()
    assert lib is not None
    require(weights, "weights", torch.float32, (-1, -1))
    require(rows, "rows", torch.int64, (-1,))
    require(grads, "grads", torch.float32, (rows.numel(), weights.shape[1]))
    s0, s1, s2 = slot_tensors(weights, slots)
    status = lib.et_apply_sequential(
        rows.data_ptr(),
        grads.data_ptr(),
        rows.numel(),
        weights.data_ptr(),
        pointer(s0),
        pointer(s1),
        pointer(s2),
        weights.shape[0],
        weights.shape[1],
        ctypes.byref(params),
        threads(),
    )
    raise_for("et_apply_sequential", status, f"optimizer kind {params.kind}")
    if status != 0:
        raise NativeBufferError("embtables native kernel: a row id is outside the table.")
