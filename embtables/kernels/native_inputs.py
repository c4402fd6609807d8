"""The native CPU kernels' checked entry points on the input side: the staging of every feature's ids and
offsets (checked in C where they are copied) and the split of ids by owner rank for sharded lookups.
Every buffer is checked here, in the call that hands it to C (``kernels/native.py``'s rules)."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from embtables.kernels.native import NativeBufferError, library, pointer, require, require_optional
from embtables.kernels.native_args import array

OwnerSplit = tuple[Tensor, Tensor | None, Tensor, list[int]]  # local ids [N], coeffs [N] | None, offsets, counts [W]


def split_by_owner(parts: list[tuple[Tensor, Tensor, Tensor | None, str, int]], world: int) -> list[OwnerSplit] | None:
    """For each feature ``(ids [N], offsets [S+1], coeffs [N] | None, strategy "div" | "mod", V)``, its
    ids as local rows grouped by owner rank (stable), their coefficients (None when the feature's are
    None: all 1), each owner's bag offsets [W, S+1] and id counts [W], in one native call. Every buffer
    is checked first, and C re-checks every offset and id. None when the native path is off or an input
    is not usable."""
    lib = library()
    if lib is None or world < 1:
        return None
    n = len(parts)
    for ids, offsets, coeffs, strategy, vocab in parts:
        if strategy not in ("div", "mod") or vocab < 1:
            return None
        require(ids, "ids", torch.int64, (-1,))
        if require(offsets, "offsets", torch.int64, (-1,)).numel() < 1:
            raise NativeBufferError("embtables native kernel: offsets must hold at least one value.")
        require_optional(coeffs, "coeffs", torch.float32, (ids.numel(),))
    out_ids = [torch.empty(p[0].numel(), dtype=torch.int64) for p in parts]
    out_coeffs = [None if p[2] is None else torch.empty(p[0].numel(), dtype=torch.float32) for p in parts]
    out_offsets = [torch.empty((world, p[1].numel()), dtype=torch.int64) for p in parts]
    out_counts = [torch.empty(world, dtype=torch.int64) for _ in parts]
    arr = ctypes.c_void_p * n
    i64s = ctypes.c_int64 * n
    status = lib.et_split_by_owner(
        n,
        arr(*[p[0].data_ptr() for p in parts]),
        i64s(*[p[0].numel() for p in parts]),
        arr(*[p[1].data_ptr() for p in parts]),
        i64s(*[p[1].numel() - 1 for p in parts]),
        arr(*[pointer(p[2]) for p in parts]),
        (ctypes.c_int32 * n)(*[0 if p[3] == "div" else 1 for p in parts]),
        i64s(*[p[4] for p in parts]),
        world,
        arr(*[t.data_ptr() for t in out_ids]),
        arr(*[pointer(t) for t in out_coeffs]),
        arr(*[t.data_ptr() for t in out_offsets]),
        arr(*[t.data_ptr() for t in out_counts]),
    )
    if status != 0:
        raise NativeBufferError("embtables native kernel: split_by_owner got bad offsets or an id outside [0, V).")
    return [(i, c, o, k.tolist()) for i, c, o, k in zip(out_ids, out_coeffs, out_offsets, out_counts)]


InputPart = tuple[Tensor, Tensor | None, int, int]  # ids [N], row splits [S+1] | None (dense), V, combiner code
COMBINER_CODES = {"sum": 0, "mean": 1, "sqrtn": 2}  # of stage_inputs_many: the coefficients it computes


def staged_size(parts: list[InputPart]) -> tuple[int, int]:
    """The int64 and float32 elements ``stage_inputs_many`` writes for ``parts``: per feature its ids and
    offsets; the coefficients of the row-split features whose combiner is mean or sqrtn."""
    ints = sum(2 * ids.numel() + 1 if splits is None else ids.numel() + splits.numel() for ids, splits, _, _ in parts)
    floats = sum(ids.numel() for ids, splits, _, code in parts if code and splits is not None)
    return ints, floats


# ids [N], offsets [S+1] (views of the arena), every bag one id, coefficients [N] | None (every one 1)
StagedInput = tuple[Tensor, Tensor, bool, Tensor | None]


def stage_inputs_many(parts: list[InputPart], arena: Tensor, coef_arena: Tensor) -> list[StagedInput | None]:
    """For each ``(ids [N], row splits [S+1] | None, V, combiner code)``, copies of the ids and bag offsets
    ([S+1], or ``0..N`` for dense ids, one per bag) in ``arena`` (int64, at least ``staged_size(parts)[0]``
    long), checked there in the same C call: ids in ``[0, V)`` (V = 0: keys of a dynamic table, any int64),
    splits that start at 0, never decrease and end at N. None for a feature that breaks a rule; else
    ``(ids, offsets, single, coeffs)``: ``single`` says every bag holds exactly one id; ``coeffs`` (a view of
    ``coef_arena``, float32) are the mean / sqrtn coefficients of its ids, None when every coefficient is 1
    (sum, or one id per bag). Every buffer is checked first, so C never reads or writes past one."""
    lib = library()
    assert lib is not None
    n = len(parts)
    i64 = torch.int64
    id_ptr: list[int] = []
    split_ptr: list[int | None] = []
    n_ids, n_bags, vocab, codes, sizes = [], [], [], [], []  # type: list[int], list[int], list[int], list[int], list[int]
    for ids, splits, v, code in parts:
        require(ids, "ids", i64, (-1,))
        count = ids.numel()
        if splits is None:
            split_ptr.append(None)
            n_bags.append(-1)
            sizes += (count, count + 1)
        else:
            require(splits, "row splits", i64, (-1,))
            if splits.numel() < 1:
                raise NativeBufferError("embtables native kernel: row splits must hold at least one value.")
            split_ptr.append(splits.data_ptr())
            n_bags.append(splits.numel() - 1)
            sizes += (count, splits.numel())
        if code not in (0, 1, 2):
            raise NativeBufferError(f"embtables native kernel: unknown combiner code {code!r}.")
        id_ptr.append(ids.data_ptr())
        n_ids.append(count)
        vocab.append(v)
        codes.append(code)
    require(arena, "staging arena", i64, (-1,))
    require(coef_arena, "coefficient arena", torch.float32, (-1,))
    vp, i64s = ctypes.c_void_p, ctypes.c_int64
    status, single = (ctypes.c_int32 * n)(), (ctypes.c_int32 * n)()
    written = lib.et_stage_inputs_many(
        n,
        array("stage.ids", vp, id_ptr),
        array("stage.n_ids", i64s, n_ids),
        array("stage.splits", vp, split_ptr),
        array("stage.n_bags", i64s, n_bags),
        array("stage.vocab", i64s, vocab),
        arena.data_ptr(),
        arena.numel(),
        status,
        single,
        array("stage.codes", ctypes.c_int32, codes),
        coef_arena.data_ptr(),
        coef_arena.numel(),
    )
    if written < 0:
        raise NativeBufferError("embtables native kernel: the staging arenas are too small for the batch.")
    used = sum(sizes)
    views = torch.split_with_sizes(arena, [*sizes, arena.numel() - used]) if used else (arena[:0],) * (2 * n)
    out: list[StagedInput | None] = []
    coef_at = 0
    for f, (bad, one) in enumerate(zip(status, single)):
        coeffs = None
        if codes[f] and split_ptr[f] is not None:
            count = n_ids[f]
            coeffs = None if one else coef_arena[coef_at : coef_at + count]
            coef_at += count
        out.append(None if bad else (views[2 * f], views[2 * f + 1], bool(one), coeffs))
    return out
