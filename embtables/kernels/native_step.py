"""The small-batch fast path of the native CPU kernels: a training step's lookup, phase 1 and phase 2 over
bags staged in one arena, with every table's addresses in ctypes arrays built once.

At batch 64 the four native calls of a step (staging, lookup, phase 1, phase 2) cost about 25 us in C and,
through the general wrappers of ``kernels/native.py``, about 160 us in Python: each call checks every
buffer it is given (ids, offsets and coefficients per feature, weights and slots per table) and builds
its argument arrays from lists. Here the buffers are checked as wholes, in the call that hands them to C:

- ``StagedBags``: every feature's ids, offsets and coefficients as ``stage_inputs_many`` wrote them into
  its arenas, with their addresses computed from the arenas' base at staging. A call re-checks the two
  arenas (dtype, contiguity, the same base address, at least the size staged) instead of 3F views, and
  C re-checks every offset and id against V as before.
- ``TableArrays``: the tables' weights and slots with their addresses, sizes and native workspaces. A
  call re-checks each tensor (the same object the arrays were built from, still contiguous at the same
  address with the same shape) before C writes it; any change (``.to()``, a restore that replaces a
  tensor, a ``resize_``) makes the caller build new arrays.

Status codes are those of the general calls (``native.lookup_many``, ``prepare_many``, ``apply_many``).
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.kernels.column_blocks import ColumnBlocks
from embtables.kernels.native import (
    NativeBufferError,
    Workspace,
    gradient_stride,
    library,
    require,
    slot_tensors,
    threads,
)
from embtables.kernels.native_abi import raise_for, unchecked
from embtables.kernels.stochastic_rounding import HALF_TYPES

_VP, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32

# Updates of at most this many values (unique rows x D) per table are checked exactly as they are written, by
# ``apply_checked``: below it that costs less than proving the update finite from the tables' value bounds
# (about 10 us a table in Python), above it more (measured: 512 x 1 ids on 8 tables of dim 24, about 11,000
# values a table, 0.30 vs 0.34 ms a step; 512 x 5, about 35,000, 1.18 vs 0.74 ms). At most ``ET_STAGED_MAX`` in
# csrc/float32_updates.c, past which C checks by a dry run first.
STAGED_MAX_VALUES = 1 << 14


class StagedBags:
    """F features' bags as ``stage`` staged them: ``views[f] = (ids [N_f], offsets [S_f + 1], coeffs [N_f] |
    None)``, the first two views of ``arena`` (int64), the coefficients of ``coef_arena`` (float32), and
    their addresses and sizes as ctypes arrays, computed from the arenas' base addresses at staging."""

    def __init__(
        self,
        arena: Tensor,
        coef_arena: Tensor,
        views: Sequence[tuple[Tensor, Tensor, Tensor | None]],
        sizes: tuple[Any, Any],
        addresses: tuple[Any, Any, Any],
        ends: tuple[int, int],
    ) -> None:
        self.arena, self.coef_arena = arena, coef_arena
        self.base, self.coef_base = arena.data_ptr(), coef_arena.data_ptr()
        self.views = tuple(views)
        self.n_ids, self.n_bags = sizes
        counts = list(self.n_bags)
        self.alike_bags = counts[0] if counts and counts.count(counts[0]) == len(counts) else -1  # S of all, or -1
        self.ids, self.offsets, self.coeffs = addresses
        self.ends = ends  # the arena elements every address lies in (checked at staging, re-checked per call)
        # the F batches [F] the caller built over these views, by its own key (``batch_ownership``: one list per
        # shape of the dense inputs); each batch holds the views, so ``serves`` takes them by identity
        self.built: dict[Any, list[Any]] = {}
        # the arena's first ``keys.numel()`` elements as staged, while a dynamic table's lookup holds rows written
        # over its features' keys in place (``dynamic_vocabularies``); None after each staging
        self.keys: Tensor | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_nothing, ())  # scratch addresses of this process: a copy or a pickle of a batch carries none

    def serves(self, batches: Sequence[Any]) -> bool:
        """Whether ``batches`` [F] are exactly the batches staged here, in order (each holds the staged views)."""
        if len(batches) != len(self.views):
            return False
        for built in self.built.values():  # the batches built over these views (each holds them)
            if all(map(operator.is_, batches, built)):
                return True
        for b, (ids, offsets, coeffs) in zip(batches, self.views):
            if b.ids is not ids or b.offsets is not offsets or b.coeffs is not coeffs:
                return False
        return True

    def check(self) -> None:
        """Re-check the arenas the addresses point into (the one check of every feature's bags)."""
        arena, coef = self.arena, self.coef_arena
        if not (
            type(arena) is Tensor
            and arena.dtype is torch.int64
            and arena.is_cpu
            and arena.is_contiguous()
            and arena.data_ptr() == self.base
            and arena.numel() >= self.ends[0]
            and type(coef) is Tensor
            and coef.dtype is torch.float32
            and coef.is_cpu
            and coef.is_contiguous()
            and coef.data_ptr() == self.coef_base
            and coef.numel() >= self.ends[1]
        ):
            raise NativeBufferError("embtables native kernel: a staging arena changed after its batch was staged.")


class StageLayouts:
    """The views and address arrays of the staging layouts seen lately (``stage``), by arena and sizes: a
    step whose features have the sizes of an earlier one, staged into the same arena, reuses its views
    [3F] and ctypes arrays instead of cutting and building them again (about 20 us a step at F = 8). At
    most ``KEEP`` layouts (they hold their arenas): all are forgotten when one more comes, and when the
    staging replaces an arena (``forget``)."""

    KEEP = 8

    def __init__(self) -> None:
        self.layouts: dict[tuple[Any, ...], _Layout] = {}

    def get(self, key: tuple[Any, ...], build: Callable[[], _Layout]) -> _Layout:
        layout = self.layouts.get(key)
        if layout is None:
            if len(self.layouts) >= self.KEEP:
                self.layouts.clear()
            layout = self.layouts[key] = build()
        return layout

    def forget(self) -> None:
        self.layouts.clear()


class _Layout:
    """One staging layout: F features of ``n_ids[f]`` ids and ``n_bags[f]`` bags (-1: dense, one bag per
    id) in ``int_arena`` [at least the size staged] and ``coef_arena``, with the id and offset views and
    addresses, and the staged bags by the C call's ``single`` flags (which features need no coefficients)."""

    def __init__(self, int_arena: Tensor, coef_arena: Tensor, n_ids: Sequence[int], n_bags: Sequence[int]) -> None:
        n = len(n_ids)
        self.int_arena, self.coef_arena = int_arena, coef_arena
        self.call_sizes = ((_I64 * n)(*n_ids), (_I64 * n)(*n_bags))  # what the staging call reads
        base = int_arena.data_ptr()
        self.call_scalars = (_I64(n), _VP(base), _I64(int_arena.numel()), _VP(coef_arena.data_ptr()),
                             _I64(coef_arena.numel()))  # fmt: skip
        # the call's input addresses and its status and single flags [F], filled call after call (under the lock)
        self.call_pointers: tuple[Any, Any] = ((_VP * n)(), (_VP * n)())
        self.call_flags = ((_I32 * n)(), (_I32 * n)())
        self.all_ok = bytes(4 * n)  # every status 0
        self.bag_counts = [count if bags < 0 else bags for count, bags in zip(n_ids, n_bags)]
        sizes: list[int] = []
        id_at: list[int] = []
        off_at: list[int] = []
        at = 0
        for count, bags in zip(n_ids, self.bag_counts):
            id_at.append(base + 8 * at)
            off_at.append(base + 8 * (at + count))
            sizes += (count, bags + 1)
            at += count + bags + 1
        self.at = at
        self.views = torch.split_with_sizes(int_arena, [*sizes, int_arena.numel() - at]) if n else ()
        self.n_ids = list(n_ids)
        self.sizes = (self.call_sizes[0], (_I64 * n)(*self.bag_counts))  # the ids' counts: one array, read only
        self.addresses = ((_VP * n)(*id_at), (_VP * n)(*off_at))
        self.ragged = [bags >= 0 for bags in n_bags]
        self.staged: dict[bytes, StagedBags] = {}

    def bags(self, single: Any, codes: Any) -> StagedBags:
        """The staged bags of this layout for the staging call's ``single`` flags [F] and the features'
        combiner ``codes`` [F] (built once per flags and codes)."""
        flags = bytes(single) + bytes(codes)
        bags = self.staged.get(flags)
        if bags is not None:
            return bags
        n = len(self.n_ids)
        coef_base = self.coef_arena.data_ptr()
        coef_at: list[int | None] = []
        out: list[tuple[Tensor, Tensor, Tensor | None]] = []
        coef = 0
        for f in range(n):
            coeffs = None
            if codes[f] and self.ragged[f]:
                count = self.n_ids[f]
                if not single[f]:
                    coeffs = self.coef_arena[coef : coef + count]
                coef_at.append(None if single[f] else coef_base + 4 * coef)
                coef += count
            else:
                coef_at.append(None)
            out.append((self.views[2 * f], self.views[2 * f + 1], coeffs))
        addresses = (*self.addresses, (_VP * n)(*coef_at))
        bags = self.staged[flags] = StagedBags(self.int_arena, self.coef_arena, out, self.sizes, addresses,
                                               (self.at, coef))  # fmt: skip
        return bags


def stage(
    values: Sequence[Tensor],
    splits: Sequence[Tensor | None],
    vocab: Any,
    codes: Any,
    arena: Callable[[int, torch.dtype], Tensor],
    layouts: StageLayouts | None = None,
) -> StagedBags | None:
    """Every feature's ids and bag offsets copied into one int64 arena and checked there in one C call (the
    rules of ``native_inputs.stage_inputs_many``: ids in [0, V), row splits that start at 0, never decrease
    and end at N), with the mean / sqrtn coefficients in one float32 arena. ``values[f]`` [N_f] are int64
    ids, ``splits[f]`` [S_f + 1] their row splits or None (dense: one id per bag); ``vocab`` and ``codes``
    are ctypes arrays of each feature's V and combiner code; ``arena(n, dtype)`` gives a buffer of at least n
    elements; ``layouts`` keeps the views and addresses of layouts seen before (the same sizes in the same
    arenas give the same ``StagedBags``, its views holding the new batch). None when an input is not a
    contiguous 1-D int64 CPU tensor or breaks a rule (the general path then names it); nothing the caller
    sees changes."""
    calls = _calls()
    n = len(values)
    if len(splits) != n or len(vocab) != n or len(codes) != n:
        raise NativeBufferError("embtables native kernel: one split, vocabulary size and combiner per feature.")
    i64 = torch.int64
    ids_p: list[int] = []
    split_p: list[int | None] = []
    n_ids: list[int] = []
    n_bags: list[int] = []  # -1: dense
    ints = floats = 0
    for v, sp, code in zip(values, splits, codes):
        if not (type(v) is Tensor and v.dtype is i64 and v.is_cpu and v.is_contiguous() and v.dim() == 1):
            return None
        count = v.numel()
        ids_p.append(v.data_ptr())
        n_ids.append(count)
        if sp is None:
            split_p.append(None)
            n_bags.append(-1)
            ints += 2 * count + 1
            continue
        if not (type(sp) is Tensor and sp.dtype is i64 and sp.is_cpu and sp.is_contiguous() and sp.dim() == 1):
            return None
        bags = sp.numel() - 1
        if bags < 0:
            return None
        split_p.append(sp.data_ptr())
        n_bags.append(bags)
        ints += count + bags + 1
        if code:
            floats += count
    int_arena = require(arena(ints, i64), "staging arena", i64, (-1,))
    coef_arena = require(arena(floats, torch.float32), "coefficient arena", torch.float32, (-1,))
    base, coef_base = int_arena.data_ptr(), coef_arena.data_ptr()
    key = (base, int_arena.numel(), coef_base, coef_arena.numel(), *n_ids, *n_bags)

    def build() -> _Layout:
        return _Layout(int_arena, coef_arena, n_ids, n_bags)

    layout = build() if layouts is None else layouts.get(key, build)
    if layout.int_arena is not int_arena or layout.coef_arena is not coef_arena:
        layout = build()  # another tensor at a freed arena's address: never reuse its views
    status, single = layout.call_flags
    ids_arr, splits_arr = layout.call_pointers
    ids_arr[:] = ids_p
    splits_arr[:] = split_p
    call_ids, call_bags = layout.call_sizes
    n_c, base_c, cap_c, coef_c, coef_cap_c = layout.call_scalars
    written = calls.et_stage_inputs_many(
        n_c, ids_arr, call_ids, splits_arr, call_bags, vocab, base_c, cap_c, status, single, codes, coef_c,
        coef_cap_c,
    )  # fmt: skip
    if written < 0:
        raise NativeBufferError("embtables native kernel: the staging arenas are too small for the batch.")
    if bytes(status) != layout.all_ok:
        return None
    staged = layout.bags(single, codes)
    staged.keys = None  # the arena holds what was staged now
    return staged


class TableArrays:
    """T tables' weights [V_t, D_t] and slots (at most 3, each like its weights) with their addresses, sizes
    and native workspaces, and the table of each of F features, as ctypes arrays for the fast calls.
    ``current`` says whether they still describe ``tensors``; else the caller builds new ones. ``half``: some
    table is stored in a half type (spec §12); phase 1 (``prepare``) serves it, the lookup and phase 2 of
    these calls read float32 rows only and refuse such arrays."""

    def __init__(
        self,
        tensors: Sequence[tuple[Tensor, tuple[Tensor, ...]]],
        workspaces: Sequence[Workspace],
        feature_tables: Sequence[int],
    ) -> None:
        held: list[Tensor] = []
        w_ptr, s_ptr = [], ([], [], [])  # type: list[int], tuple[list[int | None], list[int | None], list[int | None]]
        self.half = False
        for (weights, slots), ws in zip(tensors, workspaces, strict=True):
            if weights.dtype in HALF_TYPES:
                self.half = True
                require(weights, "weights", weights.dtype, (-1, ws.dim))
                stored = [require(t, "slot", t.dtype, tuple(weights.shape)) for t in slots]
                if len(stored) > 3 or any(t.dtype not in (torch.float32, *HALF_TYPES) for t in stored):
                    raise NativeBufferError(
                        "embtables native kernel: a half table's slots are not stored by the kernels."
                    )
                checked: tuple[Tensor | None, ...] = (*stored, *([None] * (3 - len(stored))))  # one per s_ptr
            else:
                require(weights, "weights", torch.float32, (-1, ws.dim))
                checked = slot_tensors(weights, slots)
            held += [weights, *slots]
            w_ptr.append(weights.data_ptr())
            for i, s in enumerate(checked):
                s_ptr[i].append(None if s is None else s.data_ptr())
        self.tensors = tuple(held)
        self.weight_at = [sum(1 + len(slots) for _, slots in tensors[:t]) for t in range(len(tensors))]
        self.layout = tuple((t.data_ptr(), tuple(t.shape)) for t in held)
        self.shapes = [tuple(w.shape) for w, _ in tensors]
        t_count = len(tensors)
        self.count = t_count
        self.count_c = _I64(t_count)  # the untyped calls take ctypes scalars
        self.workspaces = tuple(workspaces)
        self.w = (_VP * t_count)(*w_ptr)
        self.s = tuple((_VP * t_count)(*p) for p in s_ptr)
        self.vocab = (_I64 * t_count)(*[s[0] for s in self.shapes])
        self.dims = (_I64 * t_count)(*[s[1] for s in self.shapes])
        self.handles = (_VP * t_count)(*[ws.handle for ws in workspaces])
        self.feature_tables = tuple(feature_tables)
        f_count = len(feature_tables)
        self.features, self.features_c = f_count, _I64(f_count)
        self.fw = (_VP * f_count)(*[w_ptr[t] for t in feature_tables])
        self.fdims = (_I64 * f_count)(*[self.shapes[t][1] for t in feature_tables])
        self.fvocab = (_I64 * f_count)(*[self.shapes[t][0] for t in feature_tables])
        # phase 1 reads features grouped by table: feature order when each table's features are consecutive
        order = sorted(range(f_count), key=lambda f: (feature_tables[f], f))
        self.grouped = order == list(range(f_count))
        firsts = [0] * (t_count + 1)
        for t in feature_tables:
            firsts[t + 1] += 1
        for t in range(t_count):
            firsts[t + 1] += firsts[t]
        self.first = (_I64 * (t_count + 1))(*firsts)
        self.order = order
        # phase 2's fixed arguments and its outputs, reused call after call (under the module's lock)
        self.zeros, self.ones = (_I32 * t_count)(), (_I32 * t_count)(*([1] * t_count))
        self.maxabs = (ctypes.c_float * (4 * t_count))()
        self.status, self.bad = (_I32 * t_count)(), (_I64 * t_count)()
        # Scratch for phase 2's proof: bounds on max |value| (hi) and min value (lo) of the rows each update touches
        # (weights, *slots), measured in the writing call (``apply_checked``); proven[t] = 1 for a table whose
        # update they proved finite (written without a backup).
        self.hi, self.lo = (ctypes.c_double * (4 * t_count))(), (ctypes.c_double * (4 * t_count))()
        self.proven = (_I32 * t_count)()
        # phase 1's gradient addresses and row strides [F] and its statuses [T], filled call after call
        self.gradients: tuple[Any, Any] = ((_VP * f_count)(), (_I64 * f_count)())
        self.prepared = (_I32 * t_count)()
        self.params: tuple[tuple[Any, ...], Any, Any] = ((), None, None)  # (blocks, their addresses, dense flags)
        self._fit: tuple[Any, tuple[int, ...], int, int, Any] | None = None  # the last layout ``columns_fit`` passed

    def columns_fit(self, n_bags: Any, starts: Sequence[int], rows: int, width: int) -> Any:
        """The row strides [F] (all ``width``) of F feature blocks in a [rows, width] buffer, after checking that
        feature f has ``n_bags[f] == rows`` bags and its D_f columns from ``starts[f]`` lie inside; None when
        one does not fit. The last layout that fits is remembered (``n_bags`` by identity: a staged layout's
        own array, never written after it was built)."""
        fit = self._fit
        starts = tuple(starts)
        if fit is not None and fit[0] is n_bags and fit[1] == starts and fit[2] == rows and fit[3] == width:
            return fit[4]
        dims = self.fdims
        if len(starts) != len(dims) or len(n_bags) != len(dims):
            return None
        for f, start in enumerate(starts):
            if n_bags[f] != rows or start < 0 or start + dims[f] > width:
                return None
        ld = (_I64 * len(dims))(*([width] * len(dims)))
        self._fit = (n_bags, starts, rows, width, ld)
        return ld

    def current_weights(self, weights: Sequence[Tensor]) -> bool:
        """``current`` for the tables' weights alone (what a lookup reads)."""
        if len(weights) != self.count:
            return False
        tensors, layout = self.tensors, self.layout
        for t, i in zip(weights, self.weight_at):
            ptr, shape = layout[i]
            if t is not tensors[i] or t.data_ptr() != ptr or t.shape != shape or not t.is_contiguous():
                return False
        return True

    def current(self, tensors: Sequence[Tensor]) -> bool:
        """Whether ``tensors`` (weights and slots, table by table) are the tensors these arrays were built
        from, each still contiguous at the address and with the shape recorded."""
        if len(tensors) != len(self.tensors):
            return False
        for t, held, (ptr, shape) in zip(tensors, self.tensors, self.layout):
            if t is not held or t.data_ptr() != ptr or t.shape != shape or not t.is_contiguous():
                return False
        return True


def column_block_outputs(tables: TableArrays, n_bags: Any, out: Tensor, starts: Sequence[int]) -> tuple[Any, Any]:
    """The addresses [F] and row strides [F] of every feature's column block ``out[:, starts[f] : starts[f] + D_f]``
    of one shared output ``out`` [S, W] float32 (the concatenated activations; every feature has S bags), for the
    float32 and the half lookups alike. Raises ``NativeBufferError`` when a block does not fit."""
    out = require(out, "output", torch.float32, (-1, -1))
    rows, width = out.shape
    ld = tables.columns_fit(n_bags, starts, rows, width)
    if ld is None:
        raise NativeBufferError("embtables native kernel: the output columns do not fit the shared buffer.")
    base = out.data_ptr()
    return (_VP * len(starts))(*[base + 4 * s for s in starts]), ld


def lookup(tables: TableArrays, bags: StagedBags, outs: Sequence[Tensor], starts: Sequence[int] | None) -> int:
    """Every feature's pooled activations in one call: into column blocks ``out[:, starts[f] : starts[f] + D_f]``
    of ``outs[0]`` [S, W] (``starts`` given; every feature has S bags), into ``outs[0][f]`` of one block
    [F, S, D] (no ``starts``; every feature has S bags and width D), else into ``outs[f]`` [S_f, D_f].
    Returns 0, 1 (an id outside [0, V) or bad offsets) or 2 (a non-finite activation)."""
    calls = _calls()
    if tables.half:
        raise NativeBufferError("embtables native kernel: the fast lookup reads float32 tables only.")
    bags.check()
    f_count = len(bags.views)
    if f_count != tables.features:
        raise NativeBufferError("embtables native kernel: the staged bags are not one per feature of the tables.")
    n_bags = bags.n_bags
    if starts is not None:
        if len(outs) != 1:
            raise NativeBufferError("embtables native kernel: one shared output buffer is needed.")
        out_ptr, ld = column_block_outputs(tables, n_bags, outs[0], starts)
    elif len(outs) == 1 and outs[0].dim() == 3:  # one block [F, S, D]: feature f's output is block[f]
        dims = tables.fdims
        block = require(outs[0], "output", torch.float32, (f_count, -1, -1))
        _, rows, dim = block.shape
        if any(n != rows for n in n_bags) or any(d != dim for d in dims):
            raise NativeBufferError("embtables native kernel: the features' outputs are not all [S, D] alike.")
        base, step = block.data_ptr(), 4 * rows * dim
        out_ptr = (_VP * f_count)(*range(base, base + step * f_count, step)) if step else (_VP * f_count)()
        ld = dims
    else:
        if len(outs) != f_count:
            raise NativeBufferError("embtables native kernel: one output per staged feature is needed.")
        for f, o in enumerate(outs):
            require(o, "output", torch.float32, (n_bags[f], tables.fdims[f]))
        out_ptr = (_VP * f_count)(*[o.data_ptr() for o in outs])
        ld = tables.fdims
    args = (bags.ids, bags.n_ids, bags.offsets, n_bags, bags.coeffs, out_ptr, ld)
    return int(calls.et_lookup_many(tables.features_c, tables.fw, tables.fdims, tables.fvocab, *args, _c_threads()))


def prepare(tables: TableArrays, bags: StagedBags, grads: Sequence[Tensor | None]) -> list[int]:
    """Phase 1 of every table into its workspace (``native.prepare_many``) from the staged bags and each
    feature's gradient [S_f, D_f] | None, contiguous or a column block of a wider one. Returns the
    statuses per table."""
    calls = _calls()
    bags.check()
    f_count = len(bags.views)
    if f_count != tables.features:
        raise NativeBufferError("embtables native kernel: the staged bags are not one per feature of the tables.")
    g_ptr: list[int | None] = []
    ld: list[int] = []
    if type(grads) is ColumnBlocks:  # read in place through the whole gradient's address, no view per feature
        g_ptr, ld = _column_block_pointers(tables, bags, grads)
    else:
        f32 = torch.float32
        for g, n, dim in zip(grads, bags.n_bags, tables.fdims):
            if g is None:
                g_ptr.append(None)
                ld.append(dim)
                continue
            # the common case inline (a contiguous float32 CPU [S, D] gradient), else gradient_stride's checks
            fits = type(g) is Tensor and g.dtype is f32 and g.is_cpu and g.is_contiguous() and g.shape == (n, dim)
            ld.append(dim if fits else gradient_stride(g, n, dim))
            g_ptr.append(g.data_ptr())
    if len(g_ptr) != f_count:
        raise NativeBufferError("embtables native kernel: one gradient per staged feature is needed.")
    if tables.grouped:
        ids, n_ids, offsets, n_bags, coeffs = bags.ids, bags.n_ids, bags.offsets, bags.n_bags, bags.coeffs
        grads_arr, ld_arr = tables.gradients
        grads_arr[:] = g_ptr
        ld_arr[:] = ld
    else:
        o = tables.order
        ids = (_VP * f_count)(*[bags.ids[f] for f in o])
        n_ids = (_I64 * f_count)(*[bags.n_ids[f] for f in o])
        offsets = (_VP * f_count)(*[bags.offsets[f] for f in o])
        n_bags = (_I64 * f_count)(*[bags.n_bags[f] for f in o])
        coeffs = (_VP * f_count)(*[bags.coeffs[f] for f in o])
        grads_arr = (_VP * f_count)(*[g_ptr[f] for f in o])
        ld_arr = (_I64 * f_count)(*[ld[f] for f in o])
    statuses = tables.prepared
    calls.et_prepare_many(
        tables.count_c,
        tables.first,
        ids,
        n_ids,
        offsets,
        n_bags,
        coeffs,
        grads_arr,
        ld_arr,
        tables.dims,
        tables.vocab,
        _c_threads(),
        tables.handles,
        statuses,
    )
    return list(statuses)


def _column_block_pointers(
    tables: TableArrays, bags: StagedBags, grads: ColumnBlocks
) -> tuple[list[int | None], list[int]]:
    """The address and row stride of every feature's block of a ``ColumnBlocks`` gradient, after checking the
    whole gradient (a float32 CPU [S, W] tensor with unit column stride and rows at least W apart) and that
    block f, [S_f, D_f] at column ``starts[f]``, lies inside it (S_f the feature's staged bags)."""
    whole = grads.whole
    if not (type(whole) is Tensor and whole.dtype is torch.float32 and whole.is_cpu and whole.dim() == 2):
        require(whole, "gradient", torch.float32, (-1, -1))  # raises, naming what is wrong
        raise NativeBufferError("embtables native kernel: the gradient is not a float32 CPU [S, W] tensor.")
    rows, width = whole.shape
    row, column = whole.stride()
    if (column != 1 and width > 1) or (row < width and rows > 1) or len(grads.starts) != len(tables.fdims):
        raise NativeBufferError("embtables native kernel: the gradient's rows are not laid out as [S, W].")
    starts = grads.starts
    if tables.columns_fit(bags.n_bags, starts, rows, width) is None:
        raise NativeBufferError("embtables native kernel: a feature's gradient columns do not fit the gradient.")
    base = whole.data_ptr()
    pointers: list[int | None] = [base + 4 * s for s in starts]
    return pointers, [max(row, width)] * len(starts)  # one row: its stride reads nothing


def updates_fit_checking(tables: TableArrays, dims: Any = None) -> bool:
    """Whether every table's prepared update (unique rows x D) has at most ``STAGED_MAX_VALUES`` values; ``dims``
    [T] (a ctypes int64 array): the D to count each table's rows by, 0 to leave a table out (the tables' own D
    when None)."""
    most = _calls().et_prepared_values_max(tables.count_c, tables.handles, tables.dims if dims is None else dims)
    return int(most) <= STAGED_MAX_VALUES


def apply_checked(tables: TableArrays, params: Sequence[Any], dense: Sequence[int]) -> list[int]:
    """Phase 2 of every table from its prepared workspace, each proven finite from bounds on the rows it touches
    (SGD, Adagrad, Adam: measured in the same call, then written without a backup: ``tables.proven[t]`` = 1)
    or checked exactly in the writing call (all tables before any is written; ``native.apply_many`` with
    ``check`` set and nothing measured). ``params`` are the tables' ``native.opt_params`` blocks, ``dense`` 1 for
    a non-lazy table. Returns per table the row whose update is not finite (-1: none; when any is not -1,
    nothing was written)."""
    calls = _calls()
    if tables.half:
        raise NativeBufferError("embtables native kernel: the fast update writes float32 tables only.")
    t_count = tables.count
    if len(params) != t_count or len(dense) != t_count:
        raise NativeBufferError("embtables native kernel: one parameter block per table is needed.")
    blocks, p_arr, d_arr = tables.params
    params, dense = tuple(params), tuple(dense)
    if params != blocks or d_arr is None or dense != tuple(d_arr):  # the blocks compare by identity (ctypes structures)
        p_arr = (_VP * t_count)(*[ctypes.addressof(p) for p in params])
        d_arr = (_I32 * t_count)(*dense)
        tables.params = (params, p_arr, d_arr)  # holds the blocks while their addresses are used
    status, bad = tables.status, tables.bad
    s0, s1, s2 = tables.s
    calls.et_apply_many(
        tables.count_c, tables.handles, tables.w, s0, s1, s2, tables.vocab, tables.dims, p_arr, d_arr, tables.zeros,
        tables.ones, _c_threads(), tables.maxabs, status, bad, tables.hi, tables.lo, tables.proven,
    )  # fmt: skip
    raise_for("et_apply_many", status)
    return list(bad)


def param_array(tables: TableArrays, params: Sequence[Any]) -> Any:
    """The addresses of the tables' optimizer blocks ``params`` (``native.opt_params``, one per table) as a
    ctypes array, kept on ``tables`` with the blocks while they are the same objects."""
    blocks, p_arr, d_arr = tables.params
    params = tuple(params)
    if len(params) != tables.count:
        raise NativeBufferError("embtables native kernel: one parameter block per table is needed.")
    if p_arr is None or params != blocks:  # the blocks compare by identity (ctypes structures)
        p_arr = (_VP * tables.count)(*[ctypes.addressof(p) for p in params])
        tables.params = (params, p_arr, d_arr)  # holds the blocks while their addresses are used
    return p_arr


def _calls() -> ctypes.CDLL:
    """The fast calls without argument conversion (``native_abi.unchecked``): every argument a ctypes
    object of its C type."""
    lib = library()
    assert lib is not None
    return unchecked(lib)


def _c_threads() -> ctypes.c_int:
    return ctypes.c_int(threads())


def _nothing() -> None:
    return None
