# ruff: noqa: SIM108  (Triton compiles if/else on constexpr flags; it gets no conditional expressions)
"""The fused GPU kernels (Triton): the pooled lookup of every feature in one launch, the per-row gradient
sums of one table, and the fused sparse update of one table for every optimizer.

Imported only through ``kernels/gpu.py``, which imports it when a CUDA table first needs it (Triton is
optional). The row math follows the native C kernels (``csrc/embtables_native.c``) line by line: the
same float32 constants (from each optimizer's kernel record), IEEE division and square roots
(``div_rn`` / ``sqrt_rn``; Triton's plain ``/`` is an approximate division) and no fused multiply-adds
(every launch passes ``enable_fp_fusion=False``), so a GPU table differs from a CPU one only where the
order of a sum differs or ``powf`` rounds differently. Dims: B bags, F features, N ids, U distinct rows,
D columns (padded to ``BLOCK_D``, a power of two).

Every kernel reads only what its masks allow: ids outside a table are never dereferenced (the lookup
flags them instead), and a program past the last distinct row does nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from embtables.kernels.registry import RECORDS

# The optimizer kinds, as the kernel records number them (the same numbers as the C kernels).
_KINDS = {r.config.__name__: r.native_kind for r in RECORDS}
K_SGD = tl.constexpr(_KINDS["SGD"])
K_ADAGRAD = tl.constexpr(_KINDS["Adagrad"])
K_ADAGRAD_MOMENTUM = tl.constexpr(_KINDS["AdagradMomentum"])
K_ADAM = tl.constexpr(_KINDS["Adam"])
K_FTRL = tl.constexpr(_KINDS["FTRL"])
K_PROXIMAL_ADAGRAD = tl.constexpr(_KINDS["ProximalAdagrad"])
K_MOMENTUM = tl.constexpr(_KINDS["Momentum"])
K_RMSPROP = tl.constexpr(_KINDS["RMSProp"])
K_CENTERED_RMSPROP = tl.constexpr(_KINDS["CenteredRMSProp"])
K_ADADELTA = tl.constexpr(_KINDS["Adadelta"])
K_PROXIMAL_YOGI = tl.constexpr(_KINDS["ProximalYogi"])
K_FREQUENCY_ESTIMATOR = tl.constexpr(_KINDS["FrequencyEstimator"])

F32_INF_BITS = tl.constexpr(0x7F800000)
SIGN_BIT = tl.constexpr(-2147483648)  # 0x80000000 as an int32


@triton.jit
def _abs_bits(x):
    """|x| as int32 bits: ordered like |x| for every float, NaN above +inf (>= F32_INF_BITS: not finite)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _row_max_bits(x, mask):
    """Each row's largest |x| where ``mask`` holds, as int32 bits ([ROWS] of a [ROWS, BLOCK_D] tile)."""
    return tl.max(tl.where(mask, _abs_bits(x), 0), axis=1)


@triton.jit
def _pow(x, e, LIBDEVICE: tl.constexpr):
    """``powf(x, e)`` for x >= 0: libdevice on the GPU; in Triton's CPU interpreter (tests), which has no
    libdevice, exp(e log x) in float64, rounded once, and 1 where e is 0 (C's powf(0, 0), where the
    logarithm would give -inf * 0)."""
    if LIBDEVICE:
        return libdevice.pow(x, e + tl.zeros_like(x))
    else:
        e_x = e + tl.zeros_like(x)  # a block: the interpreter's where takes blocks
        return tl.where(e_x == 0.0, 1.0, tl.exp(tl.log(x.to(tl.float64)) * e).to(tl.float32))


@triton.jit
def _proximal(prox, lr_t, l1, l2):
    """sign(prox) max(|prox| - lr_t l1, 0) / (1 + lr_t l2), with C's copysignf."""
    sh = tl.maximum(tl.abs(prox) - lr_t * l1, 0.0)
    signed = (sh.to(tl.int32, bitcast=True) | (prox.to(tl.int32, bitcast=True) & SIGN_BIT)).to(tl.float32, bitcast=True)
    return tl.div_rn(signed, 1.0 + lr_t * l2)


@triton.jit
def lookup_kernel(
    firsts,  # int64 [F + 1]: the first global bag of each feature
    table_ptrs,  # int64 [F]: address of each feature's table [V, D] (float32, rows D apart)
    dims,  # int64 [F]
    vocabs,  # int64 [F]
    id_ptrs,  # int64 [F]: address of each feature's ids [N_f] (int64)
    id_counts,  # int64 [F]: N_f (offsets outside [0, N_f] are flagged, never followed)
    offset_ptrs,  # int64 [F]: address of each feature's offsets [S_f + 1] (int64)
    coeff_ptrs,  # int64 [F]: address of each feature's coefficients [N_f] (float32), 0 for none
    out_ptrs,  # int64 [F]: address of each feature's first output element
    out_lds,  # int64 [F]: elements between output rows
    status,  # int32 [F]: |= 1 an id outside the table, |= 2 a non-finite activation
    F: tl.constexpr,
    FP: tl.constexpr,  # F rounded up to a power of two
    DIM: tl.constexpr,  # every table's dim when they share one (0: read ``dims``)
    ALIGNED: tl.constexpr,  # every table and output row starts 16 bytes aligned: 16-byte loads and stores
    BAGS: tl.constexpr,  # bags a program pools (a power of two), of any features
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """BAGS consecutive bags of every feature per program, as a [BAGS, BLOCK_N, BLOCK_D] tile of rows:
    ``out[b] = sum_k coeffs[k] * table[ids[k]]``; empty bags give 0."""
    i = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)  # [BAGS] global bags
    live = i < tl.load(firsts + F)
    fo = tl.arange(0, FP)
    ends = tl.load(firsts + 1 + fo, mask=fo < F, other=9223372036854775807)
    f = tl.where(live, tl.sum((ends[None, :] <= i[:, None]).to(tl.int32), axis=1), 0)  # [BAGS] features
    s = i - tl.load(firsts + f)
    table = tl.load(table_ptrs + f).to(tl.pointer_type(tl.float32))
    vocab = tl.load(vocabs + f)
    ids = tl.load(id_ptrs + f).to(tl.pointer_type(tl.int64))
    offsets = tl.load(offset_ptrs + f).to(tl.pointer_type(tl.int64))
    coeff_addr = tl.load(coeff_ptrs + f)
    coeffs = coeff_addr.to(tl.pointer_type(tl.float32))
    out = tl.load(out_ptrs + f).to(tl.pointer_type(tl.float32))
    ld = tl.load(out_lds + f)
    d = tl.arange(0, BLOCK_D)
    if DIM > 0:
        dim = DIM
        dm = live[:, None] & (d < DIM)[None, :]  # [BAGS, BLOCK_D]
    else:
        dim = tl.load(dims + f)[:, None]
        dm = live[:, None] & (d[None, :] < dim)
    if ALIGNED:
        table = tl.multiple_of(table, 16)
        out = tl.multiple_of(out, 16)
    start = tl.load(offsets + s, mask=live, other=0)
    end = tl.load(offsets + s + 1, mask=live, other=0)
    n_ids = tl.load(id_counts + f)
    bad = tl.where(live & ((start < 0) | (end > n_ids) | (start > end)), 1, 0)
    end = tl.where(bad > 0, start, end)  # a broken bag reads nothing
    longest = tl.max(end - start, axis=0)
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BAGS, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, longest, BLOCK_N):
        k = start[:, None] + k0 + n[None, :]  # [BAGS, BLOCK_N]
        km = k < end[:, None]
        row = tl.load(ids[:, None] + k, mask=km, other=0)
        ok = km & (row >= 0) & (row < vocab[:, None])
        bad += tl.sum((km & (~ok)).to(tl.int32), axis=1)
        c = tl.load(coeffs[:, None] + k, mask=ok & (coeff_addr != 0)[:, None], other=1.0)
        at = row * dim
        if ALIGNED:
            at = tl.multiple_of(at, [4, 4])
        vals = tl.load(
            table[:, None, None] + at[:, :, None] + d[None, None, :], mask=ok[:, :, None] & dm[:, None, :], other=0.0
        )
        acc += tl.sum(vals * c[:, :, None], axis=1)
    out_at = s * ld
    if ALIGNED:
        out_at = tl.multiple_of(out_at, 4)
    tl.store(out[:, None] + out_at[:, None] + d[None, :], acc, mask=dm)
    nonfinite = _row_max_bits(acc, dm) >= F32_INF_BITS
    flag = tl.where(bad > 0, 1, 0) | tl.where(nonfinite, 2, 0)
    tl.atomic_or(status + f, flag, mask=flag != 0)


@triton.jit
def sort_marks_kernel(
    sorted_keys,  # int32 or int64 [N]: the table's ids, sorted (stable: equal ids keep occurrence order)
    perm,  # int64 [N]: the occurrence of each sorted position
    segs,  # int64 [N]: the bag of each occurrence (in occurrence order)
    coeffs,  # float32 [N] (read when HAS_COEFFS)
    feats,  # int64 [N] (read when MULTI)
    sorted_ids,  # int64 [N] out: the sorted ids
    is_start,  # int64 [N] out: 1 where a run of equal ids begins
    sorted_segs,  # int64 [N] out: segs in sorted order
    sorted_coeffs,  # float32 [N] out (written when HAS_COEFFS)
    sorted_feats,  # int64 [N] out (written when MULTI)
    N,
    HAS_COEFFS: tl.constexpr,
    MULTI: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per sorted position: the id as int64, where runs begin, and the occurrence's bag (coefficient,
    feature) gathered into sorted order, so that the sums read them without following ``perm``."""
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    km = k < N
    key = tl.load(sorted_keys + k, mask=km, other=0)
    prev = tl.load(sorted_keys + k - 1, mask=km & (k > 0), other=0)
    tl.store(sorted_ids + k, key.to(tl.int64), mask=km)
    tl.store(is_start + k, tl.where((k == 0) | (key != prev), 1, 0).to(tl.int64), mask=km)
    p = tl.load(perm + k, mask=km, other=0)
    tl.store(sorted_segs + k, tl.load(segs + p, mask=km, other=0), mask=km)
    if HAS_COEFFS:
        tl.store(sorted_coeffs + k, tl.load(coeffs + p, mask=km, other=0.0), mask=km)
    if MULTI:
        tl.store(sorted_feats + k, tl.load(feats + p, mask=km, other=0), mask=km)


@triton.jit
def run_starts_kernel(
    is_start,  # int64 [N]
    runs1,  # int64 [N]: the inclusive cumulative sum of is_start (1 + the run of each sorted position)
    starts,  # int64 [N + 2] out: the first sorted position of each run; N from the U-th entry on
    stats,  # int64 [4]: [0] := U, the number of runs (distinct rows)
    N,
    BLOCK: tl.constexpr,
):
    """Where each run begins (run r at ``starts[r]``, ``starts[U:] = N``) and the number of runs."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    u = tl.load(runs1 + N - 1)
    begins = (i < N) & (tl.load(is_start + i, mask=i < N, other=0) != 0)
    r = tl.load(runs1 + i, mask=begins, other=1) - 1
    tl.store(starts + r, i, mask=begins)
    tl.store(starts + i, i * 0 + N, mask=(i >= u) & (i < N + 2))
    if tl.program_id(0) == 0:
        tl.store(stats, u)


@triton.jit
def _piece_gradients(
    k,
    valid,
    segs,
    coeffs,
    feats,
    grad0,
    grad_ld,
    grad_nrows,
    grad_ptrs,
    grad_lds,
    grad_rows,
    d,
    dm,
    HAS_COEFFS: tl.constexpr,
    MULTI: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """The (coefficient-scaled) gradients [ROWS, BLOCK_D] of sorted occurrences ``k`` [ROWS] (zeros where
    not ``valid``), and [ROWS] 1 where a bag is outside its feature's gradient (then not read), else 0.
    ``segs``, ``coeffs``, ``feats``: per occurrence, in sorted order. One feature: its gradient ``grad0``
    (``grad_nrows`` rows, ``grad_ld`` apart); several (MULTI): their addresses, strides and rows."""
    seg = tl.load(segs + k, mask=valid, other=0)
    if MULTI:
        f = tl.load(feats + k, mask=valid, other=0)
        grad = tl.load(grad_ptrs + f).to(tl.pointer_type(tl.float32))
        ld = tl.load(grad_lds + f)
        nrows = tl.load(grad_rows + f)
    else:
        grad = grad0
        ld = grad_ld
        nrows = grad_nrows
    ok = valid & (seg >= 0) & (seg < nrows)
    at = seg * ld
    if ALIGNED:
        at = tl.multiple_of(at, 4)
        if not MULTI:
            grad = tl.multiple_of(grad, 16)
    g = tl.load((grad + at)[:, None] + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
    if HAS_COEFFS:
        g = g * tl.load(coeffs + k, mask=valid, other=1.0)[:, None]
    return g, tl.where(valid & (~ok), 1, 0)


@triton.jit
def piece_sums_kernel(
    sorted_ids,  # int64 [N]: the table's ids, sorted (stable: equal ids keep occurrence order)
    runs1,  # int64 [N]: 1 + the run (distinct row) of each sorted position
    starts,  # int64 [N + 2]: first sorted position of each run; N past the last one
    segs,  # int64 [N]: the bag of each sorted occurrence, in its feature's gradient
    coeffs,  # float32 [N]: each sorted occurrence's coefficient (read when HAS_COEFFS)
    feats,  # int64 [N]: each sorted occurrence's feature among the table's (read when MULTI)
    grad0,  # float32: the gradient of a table's one feature (not MULTI)
    grad_ld,
    grad_nrows,
    grad_ptrs,  # int64 [F_t] (MULTI): address of each feature's gradient (float32 rows, ld apart)
    grad_lds,  # int64 [F_t]
    grad_rows,  # int64 [F_t]: rows of each feature's gradient (a bag outside them is flagged, not read)
    rows_out,  # int64 [N]: distinct row u (U valid)
    sums,  # float32 [N, D]: summed gradient of distinct row u (U rows valid)
    pieces,  # float32 [2 ceil(N / PIECE), D]: the pieces of runs longer than PIECE, for piece_join_kernel
    stats,  # int64 [4]: [1] max over |sums| as bits (>= F32_INF_BITS: not finite); [2] 1 when an id or bag
    # was outside the table or the gradient (changed since the lookup validated it); [3] 1 when a run is
    # longer than PIECE
    N,
    D,
    V,
    HAS_COEFFS: tl.constexpr,
    MULTI: tl.constexpr,
    ALIGNED: tl.constexpr,  # every gradient and gradient row starts 16 bytes aligned
    FIRST: tl.constexpr,  # the first pieces (lanes are runs), else the later ones (lanes are positions)
    PIECE: tl.constexpr,
    UNROLL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The per-row gradient sums, pass 1. A run of equal sorted ids is cut into pieces of PIECE occurrences
    from its start, each summed by one lane of a [ROWS, BLOCK_D] tile one occurrence at a time, in
    occurrence order. FIRST: lane u sums the first piece of run u (two contiguous loads find it); else,
    only when a run is longer than PIECE (``stats[3]``), lane k sums the later piece that begins at
    sorted position k, if one does. A run of at most PIECE occurrences is one piece, written as its
    distinct row's sum (the C kernel's additions: the CPU's bits); the pieces of a longer run go to
    ``pieces`` (slot 2 (k // PIECE) + (a whole piece), unique: two pieces that begin in the same PIECE
    positions are a run's short last one and the next run's whole first one)."""
    lane = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    if FIRST:
        run = lane
        first = tl.load(starts + run, mask=lane < N, other=N)
        end = tl.load(starts + run + 1, mask=first < N, other=N)
        k = first
        lead = first < N
    else:
        todo = tl.load(stats + 3)
        km = (lane < N) & ((lane * 0 + todo) != 0)  # blocks only in masks (Triton 3.9's interpreter)
        run = tl.load(runs1 + lane, mask=km, other=1) - 1
        first = tl.load(starts + run, mask=km, other=0)
        end = tl.load(starts + run + 1, mask=km, other=0)
        k = lane
        lead = km & (k > first) & ((k - first) % PIECE == 0)  # lane k begins a later piece
    length = tl.where(lead, tl.minimum(end - k, PIECE), 0)
    longest = tl.max(length, axis=0)
    if longest > 0:
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        row = tl.load(sorted_ids + k, mask=lead, other=0)
        bad = tl.where(lead & ((row < 0) | (row >= V)), 1, 0)
        for j0 in range(0, longest, UNROLL):
            for jj in tl.static_range(UNROLL):  # unrolled: the loads of UNROLL occurrences are in flight
                j = j0 + jj
                g, outside = _piece_gradients(
                    k + j, j < length, segs, coeffs, feats, grad0, grad_ld, grad_nrows, grad_ptrs, grad_lds,
                    grad_rows, d, dm, HAS_COEFFS, MULTI, ALIGNED,
                )  # fmt: skip
                bad += outside
                acc += g  # a masked-off occurrence adds +0.0: exact
        whole = lead & (end - first <= PIECE)  # the run is this one piece
        tl.store(rows_out + run, row, mask=whole)
        m2 = whole[:, None] & dm[None, :]
        tl.store(sums + run[:, None] * D + d[None, :], acc, mask=m2)
        part = lead & (end - first > PIECE)
        slot = (k // PIECE) * 2 + tl.where(length == PIECE, 1, 0)
        tl.store(pieces + slot[:, None] * D + d[None, :], acc, mask=part[:, None] & dm[None, :])
        tl.atomic_max(stats + 1, tl.max(_row_max_bits(acc, m2), axis=0).to(tl.int64))
        if tl.sum(bad, axis=0) > 0:
            tl.atomic_max(stats + 2, 1)
        if tl.sum(part.to(tl.int32), axis=0) > 0:
            tl.atomic_max(stats + 3, 1)


@triton.jit
def piece_join_kernel(
    sorted_ids,  # int64 [N]
    starts,  # int64 [N + 2]
    rows_out,  # int64 [N]
    sums,  # float32 [N, D]
    pieces,  # float32 [2 ceil(N / PIECE), D]: piece_sums_kernel's pieces
    stats,  # int64 [4]: [1] max |sum| bits; [3] read: 0 when no run is longer than PIECE (nothing to do)
    N,
    D,
    PIECE: tl.constexpr,
    UNROLL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Pass 2: lane u of a tile adds the pieces of run u, if it is longer than PIECE, in order (within
    float32 rounding of the CPU's one-occurrence-at-a-time order)."""
    if tl.load(stats + 3) != 0:
        u = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        first = tl.load(starts + u, mask=u < N, other=N)
        end = tl.load(starts + u + 1, mask=first < N, other=N)
        joined = end - first > PIECE
        count = tl.where(joined, (end - first + PIECE - 1) // PIECE, 0)
        most = tl.max(count, axis=0)
        if most > 0:
            d = tl.arange(0, BLOCK_D)
            dm = d < D
            acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
            for i0 in range(0, most, UNROLL):
                for ii in tl.static_range(UNROLL):
                    i = i0 + ii
                    at = first + i * PIECE
                    slot = (at // PIECE) * 2 + tl.where(end - at >= PIECE, 1, 0)
                    m = (i < count)[:, None] & dm[None, :]
                    acc += tl.load(pieces + slot[:, None] * D + d[None, :], mask=m, other=0.0)
            row = tl.load(sorted_ids + first, mask=joined, other=0)
            tl.store(rows_out + u, row, mask=joined)
            m2 = joined[:, None] & dm[None, :]
            tl.store(sums + u[:, None] * D + d[None, :], acc, mask=m2)
            tl.atomic_max(stats + 1, tl.max(_row_max_bits(acc, m2), axis=0).to(tl.int64))


@triton.jit
def update_kernel(
    rows,  # int64 [U]: distinct rows
    sums,  # float32 [U, D]: their summed gradients
    weights,  # float32 [V, D]
    s0,  # float32 [V, D] slots, in the optimizer's slot order (unused ones: any float32 buffer)
    s1,
    s2,
    bad_row,  # int64 [1]: min over rows whose new values are not finite (V when none; the dry run only)
    maxabs,  # int32 [4]: max |new value| bits of (weights, *slots) when MEASURE
    U,
    D,
    V,
    lr,
    decay,
    glo,
    ghi,
    wlo,
    whi,
    c0,
    c1,
    c2,
    c3,
    c4,
    c5,
    KIND: tl.constexpr,
    NSLOTS: tl.constexpr,
    FLAG0: tl.constexpr,
    FLAG1: tl.constexpr,
    POW_IS_SQRT: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    WRITE: tl.constexpr,
    MEASURE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """ROWS distinct rows per program, as a [ROWS, BLOCK_D] tile: gradient clip -> decay -> optimizer ->
    weight clip (the C kernels' ``et_row_*``, element by element), constants ``c0..c5`` and flags in each
    kernel record's order. WRITE=False is the dry run: it only finds the first row that would not be finite."""
    u = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    um = u < U
    row = tl.load(rows + u, mask=um, other=-1)
    d = tl.arange(0, BLOCK_D)
    # rows come from the per-row sums, which checked them: a guard
    dm = (um & (row >= 0) & (row < V))[:, None] & (d < D)[None, :]
    at = row[:, None] * D + d[None, :]
    g = tl.load(sums + u[:, None] * D + d[None, :], mask=dm, other=0.0)
    g = tl.where(g < glo, glo, g)
    g = tl.where(g > ghi, ghi, g)
    x = tl.load(weights + at, mask=dm, other=0.0)
    x = x - decay * x
    a = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    b = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    c = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    if NSLOTS >= 1:
        a = tl.load(s0 + at, mask=dm, other=0.0)
    if NSLOTS >= 2:
        b = tl.load(s1 + at, mask=dm, other=0.0)
    if NSLOTS >= 3:
        c = tl.load(s2 + at, mask=dm, other=0.0)
    if KIND == K_SGD:
        x = x - lr * g
    elif KIND == K_ADAGRAD:
        a = a + g * g
        x = x - tl.div_rn(lr * g, tl.sqrt_rn(a))
    elif KIND == K_ADAGRAD_MOMENTUM:  # c0 momentum, c1 -1/exponent, c2 beta2, c3 1 - beta2, c4 epsilon
        if FLAG1:  # beta2 == 1: a plain sum
            a = a + g * g
        else:
            a = c2 * a + c3 * (g * g)
        scaled = _pow(a + c4, c1, LIBDEVICE) * g
        b = c0 * b + scaled
        if FLAG0:  # Nesterov
            x = x - lr * (c0 * b + scaled)
        else:
            x = x - lr * b
    elif KIND == K_ADAM:  # c0 beta_1, c1 1 - beta_1, c2 beta_2, c3 1 - beta_2, c4 epsilon^2, c5 epsilon
        a = c0 * a + c1 * g
        b = c2 * b + c3 * (g * g)
        if FLAG0:  # sum_inside_sqrt
            den = tl.sqrt_rn(b + c4)
        else:
            den = tl.sqrt_rn(b) + c5
        x = x - tl.div_rn(lr * a, den)
    elif KIND == K_FTRL:  # c0 power, c1 l1 (lr * l1), c2 beta, c3 2 * l2 (times lr); FLAG0 multiply_linear
        nn = a + g * g
        if POW_IS_SQRT:
            pw_new = tl.sqrt_rn(nn)
            pw_old = tl.sqrt_rn(a)
        else:
            pw_new = _pow(nn, c0, LIBDEVICE)
            pw_old = _pow(a, c0, LIBDEVICE)
        if FLAG1:  # allow_zero_accumulator
            pw_new = tl.where(nn == 0.0, 0.0, pw_new)
            pw_old = tl.where(a == 0.0, 0.0, pw_old)
        delta = pw_new - pw_old
        if FLAG0:
            b = b + lr * g - delta * x
            den = pw_new + c3 + c2
        else:
            b = b + g - tl.div_rn(delta, lr + tl.zeros_like(delta)) * x
            den = tl.div_rn(pw_new + c2, lr + tl.zeros_like(pw_new)) + c3
        numer = tl.where(b < -c1, -c1, tl.where(b > c1, c1, b)) - b
        a = nn
        x = tl.div_rn(numer, den)
        if FLAG1:
            x = tl.where(numer == 0.0, 0.0, x)
    elif KIND == K_PROXIMAL_ADAGRAD:  # c0 l1, c1 l2
        a = a + g * g
        lr_t = tl.div_rn(lr + tl.zeros_like(a), tl.sqrt_rn(a))
        x = _proximal(x - lr_t * g, lr_t, c0, c1)
    elif KIND == K_MOMENTUM:  # c0 momentum
        a = c0 * a + g
        if FLAG0:
            x = x - lr * (g + c0 * a)
        else:
            x = x - lr * a
    elif KIND == K_RMSPROP:  # c0 rho, c1 1 - rho, c2 momentum, c3 epsilon
        a = c0 * a + c1 * (g * g)
        b = c2 * b + tl.div_rn(lr * g, tl.sqrt_rn(a + c3))
        x = x - b
    elif KIND == K_CENTERED_RMSPROP:  # slots ms, mom, mg
        a = c0 * a + c1 * (g * g)
        c = c0 * c + c1 * g
        b = c2 * b + tl.div_rn(lr * g, tl.sqrt_rn(a - c * c + c3))
        x = x - b
    elif KIND == K_ADADELTA:  # c0 rho, c1 1 - rho, c2 epsilon
        a = c0 * a + c1 * (g * g)
        step = tl.div_rn(tl.sqrt_rn(b + c2), tl.sqrt_rn(a + c2)) * g
        b = c0 * b + c1 * (step * step)
        x = x - lr * step
    elif KIND == K_PROXIMAL_YOGI:  # slots v, m; c0 beta_1, c1 1 - beta_1, c2 1 - beta_2, c3 epsilon, c4 l1, c5 l2
        g2 = g * g
        b = c0 * b + c1 * g
        diff = a - g2
        step = c2 * g2
        a = tl.where(diff > 0.0, a - step, tl.where(diff < 0.0, a + step, a - 0.0 * g2))
        lr_t = tl.div_rn(lr + tl.zeros_like(a), tl.sqrt_rn(a) + c3)
        x = _proximal(x - lr_t * b, lr_t, c4, c5)
    else:  # K_FREQUENCY_ESTIMATOR: lr is the global step; c0 max_delta, c1 outlier, c2 1 - tau, c3 tau
        delta = lr - a
        dc = tl.where(delta > c0, c0, delta)
        smoothed = x * c2 + dc * c3
        threshold = c1 * x
        x = tl.where(delta >= threshold, dc, smoothed)
        a = lr + tl.zeros_like(a)
    x = tl.where(x < wlo, wlo, x)
    x = tl.where(x > whi, whi, x)
    bits = _row_max_bits(x, dm)  # [ROWS]: each row's largest |value|, as bits
    bits_a = _row_max_bits(a, dm)
    bits_b = _row_max_bits(b, dm)
    bits_c = _row_max_bits(c, dm)
    worst = bits
    if NSLOTS >= 1:
        worst = tl.maximum(worst, bits_a)
    if NSLOTS >= 2:
        worst = tl.maximum(worst, bits_b)
    if NSLOTS >= 3:
        worst = tl.maximum(worst, bits_c)
    if not WRITE:  # the dry run: the first row that would not be finite
        first_bad = tl.min(tl.where(worst >= F32_INF_BITS, row, V), axis=0)
        if first_bad < V:
            tl.atomic_min(bad_row, first_bad)
    else:
        tl.store(weights + at, x, mask=dm)
        if NSLOTS >= 1:
            tl.store(s0 + at, a, mask=dm)
        if NSLOTS >= 2:
            tl.store(s1 + at, b, mask=dm)
        if NSLOTS >= 3:
            tl.store(s2 + at, c, mask=dm)
    if MEASURE:
        tl.atomic_max(maxabs, tl.max(bits, axis=0))
        if NSLOTS >= 1:
            tl.atomic_max(maxabs + 1, tl.max(bits_a, axis=0))
        if NSLOTS >= 2:
            tl.atomic_max(maxabs + 2, tl.max(bits_b, axis=0))
        if NSLOTS >= 3:
            tl.atomic_max(maxabs + 3, tl.max(bits_c, axis=0))


@triton.jit
def validate_kernel(
    id_ptrs,  # int64 [F]: address of each feature's ids [N_f] (int64)
    id_counts,  # int64 [F]
    vocabs,  # int64 [F]
    split_ptrs,  # int64 [F]: address of each feature's row splits [B_f + 1] (int64); unread when split_counts is 0
    split_counts,  # int64 [F]: B_f + 1, or 0 for a dense input (no splits)
    flags,  # int32 [F]: |= 1 an id outside [0, V); |= 2 row splits that decrease, or do not start at 0 and end at N_f
    BLOCK: tl.constexpr,
):
    """The input rules of every feature in one launch: program (b, f) checks block b of feature f."""
    b = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1)
    n = tl.load(id_counts + f)
    vocab = tl.load(vocabs + f)
    ids = tl.load(id_ptrs + f).to(tl.pointer_type(tl.int64))
    o = b * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(ids + o, mask=m, other=0)
    flag = tl.where(tl.max(tl.where(m & ((x < 0) | (x >= vocab)), 1, 0), axis=0) > 0, 1, 0)
    ns = tl.load(split_counts + f)
    splits = tl.load(split_ptrs + f).to(tl.pointer_type(tl.int64))
    ms = o + 1 < ns
    lo = tl.load(splits + o, mask=ms, other=0)
    hi = tl.load(splits + o + 1, mask=ms, other=0)
    flag |= tl.where(tl.max(tl.where(ms & (hi < lo), 1, 0), axis=0) > 0, 2, 0)
    if (b == 0) & (ns > 0):
        first = tl.load(splits)
        last = tl.load(splits + ns - 1)
        flag |= tl.where((first != 0) | (last != n), 2, 0)
    if flag != 0:
        tl.atomic_or(flags + f, flag)
