"""The GPU per-row gradient sums of a group of tables of one width (Triton): every feature's occurrences
gathered as keys of one key space (table j's row r is key ``bases[j] + r``), sorted, marked and gathered,
the runs of equal keys found, each run summed in occurrence order in pieces, long runs joined."""

from __future__ import annotations

import triton
import triton.language as tl

from embtables.kernels.triton_common import abs_bits, row_max_bits, z


@triton.jit
def gather_kernel(
    id_ptrs,  # int64 [F]: address of each feature's ids [N_f] (int64)
    seg_ptrs,  # int64 [F]: address of each feature's bag index of every id [N_f] (int64)
    coeff_ptrs,  # int64 [F]: address of each feature's coefficients [N_f] (float32), 0 for none
    counts,  # int64 [F]: N_f
    at,  # int64 [F]: where feature f's occurrences begin in the outputs
    vocabs,  # int64 [F]: V of each feature's table
    bases,  # int64 [F]: the first key of each feature's table
    keys,  # int32 or int64 [N] out: base + id, or -1 for an id outside [0, V) (-1 itself: dropped at staging)
    segs,  # int64 [N] out
    coeffs,  # float32 [N] out (written when HAS_COEFFS; 1 where a feature has none)
    feats,  # int64 [N] out: the feature of each occurrence
    stats,  # int64 [STATS]: [2] := 1 when an id is outside its table
    KEY64: tl.constexpr,  # int64 keys (the group's rows do not fit int32)
    HAS_COEFFS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Every feature's occurrences of a group in one launch: program (b, f) gathers block b of feature f.
    An id outside its table becomes key -1 (sorted first, a run the update never writes) and is flagged,
    unless it is -1: an id the staging dropped."""
    b = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1)
    n = tl.load(counts + f)
    o = b * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(tl.load(id_ptrs + f).to(tl.pointer_type(tl.int64)) + o, mask=m, other=0)
    ok = (x >= 0) & (x < tl.load(vocabs + f))
    key = tl.where(ok, x + tl.load(bases + f), -1)
    ok = ok | (x == -1)  # an id dropped at staging: skipped, not flagged
    out = tl.load(at + f) + o
    if KEY64:
        tl.store(keys + out, key, mask=m)
    else:
        tl.store(keys + out, key.to(tl.int32), mask=m)
    seg = tl.load(tl.load(seg_ptrs + f).to(tl.pointer_type(tl.int64)) + o, mask=m, other=0)
    tl.store(segs + out, seg, mask=m)
    tl.store(feats + out, o * 0 + f, mask=m)
    if HAS_COEFFS:
        caddr = tl.load(coeff_ptrs + f)
        c = tl.load(caddr.to(tl.pointer_type(tl.float32)) + o, mask=m & ((o * 0 + caddr) != 0), other=1.0)
        tl.store(coeffs + out, c, mask=m)
    if tl.max(tl.where(m & (~ok), 1, 0), axis=0) > 0:
        tl.atomic_max(stats + 2, 1)


@triton.jit
def sort_marks_kernel(
    sorted_keys,  # int32 or int64 [N]: the group's keys, sorted (stable: equal keys keep occurrence order)
    perm,  # int64 [N]: the occurrence of each sorted position
    segs,  # int64 [N]: the bag of each occurrence (in gathered order)
    coeffs,  # float32 [N] (read when HAS_COEFFS)
    feats,  # int64 [N] (read when MULTI)
    sorted_ids,  # int64 [N] out: the sorted keys
    is_start,  # int64 [N] out: 1 where a run of equal ids begins
    sorted_segs,  # int64 [N] out: segs in sorted order
    sorted_coeffs,  # float32 [N] out (written when HAS_COEFFS)
    sorted_feats,  # int64 [N] out (written when MULTI)
    grad_nrows,  # rows of the one feature's gradient (not MULTI)
    grad_rows,  # int64 [F_t] (MULTI): rows of each feature's gradient
    stats,  # int64 [6]: [2] := 1 when a key is outside [0, V) or a bag outside its gradient; [5] max |coeff| bits
    N,
    V,  # the group's keys: the sum of its tables' rows
    HAS_COEFFS: tl.constexpr,
    MULTI: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per sorted position: the id as int64, where runs begin, and the occurrence's bag (coefficient,
    feature) gathered into sorted order, so that the sums read them without following ``perm``. Ids and
    bags are checked here (they changed since the lookup validated them only if a buffer was written in
    between), before any sum or update reads them."""
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    km = k < N
    key = tl.load(sorted_keys + k, mask=km, other=0)
    prev = tl.load(sorted_keys + k - 1, mask=km & (k > 0), other=0)
    row = key.to(tl.int64)
    tl.store(sorted_ids + k, row, mask=km)
    tl.store(is_start + k, tl.where((k == 0) | (key != prev), 1, 0).to(tl.int64), mask=km)
    p = tl.load(perm + k, mask=km, other=0)
    seg = tl.load(segs + p, mask=km, other=0)
    tl.store(sorted_segs + k, seg, mask=km)
    if MULTI:
        f = tl.load(feats + p, mask=km, other=0)
        tl.store(sorted_feats + k, f, mask=km)
        nrows = tl.load(grad_rows + f, mask=km, other=0)
    else:
        nrows = grad_nrows
    bad = km & ((row < -1) | (row >= V) | (seg < 0) | (seg >= nrows))  # key -1: dropped, or flagged by the gather
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.atomic_max(stats + 2, 1)
    if HAS_COEFFS:
        c = tl.load(coeffs + p, mask=km, other=0.0)
        tl.store(sorted_coeffs + k, c, mask=km)
        tl.atomic_max(stats + 5, tl.max(tl.where(km, abs_bits(c), 0), axis=0).to(tl.int64))


@triton.jit
def run_starts_kernel(
    is_start,  # int64 [N]
    runs1,  # int64 [N]: the inclusive cumulative sum of is_start (1 + the run of each sorted position)
    sorted_ids,  # int64 [N]
    starts,  # int64 [N + 2] out: the first sorted position of each run; N from the U-th entry on
    rows_out,  # int64 [N] out: the row of run r (U valid)
    stats,  # int64 [6]: [0] := U, the number of runs (distinct rows)
    N,
    BLOCK: tl.constexpr,
):
    """Where each run begins (run r at ``starts[r]``, ``starts[U:] = N``), its row, and the number of runs."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    u = tl.load(runs1 + N - 1)
    begins = (i < N) & (tl.load(is_start + i, mask=i < N, other=0) != 0)
    r = tl.load(runs1 + i, mask=begins, other=1) - 1
    tl.store(starts + r, i, mask=begins)
    tl.store(rows_out + r, tl.load(sorted_ids + i, mask=begins, other=0), mask=begins)
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
    if ALIGNED:  # every gradient 16-byte aligned, its rows too (checked by the caller)
        at = tl.multiple_of(at, 4)
        grad = tl.multiple_of(grad, 16)
    g = z(tl.load((grad + at)[:, None] + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0))
    if HAS_COEFFS:  # subnormal operands and products flushed (spec §1.5)
        g = z(g * z(tl.load(coeffs + k, mask=valid, other=1.0))[:, None])
    return g, tl.where(valid & (~ok), 1, 0)


@triton.jit
def run_sums(
    k,
    length,
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
    UNROLL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Lane r of a [ROWS, BLOCK_D] tile sums the gradients of sorted occurrences ``k[r]`` ..
    ``k[r] + length[r] - 1`` one at a time, in order (the C kernel's additions: the CPU's bits); returns
    the sums and [ROWS] counts of bags outside their gradient (not read)."""
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    bad = tl.zeros([ROWS], dtype=tl.int32)
    longest = tl.max(length, axis=0)
    for j0 in range(0, longest, UNROLL):
        for jj in tl.static_range(UNROLL):  # unrolled: the loads of UNROLL occurrences are in flight
            j = j0 + jj
            g, outside = _piece_gradients(
                k + j, j < length, segs, coeffs, feats, grad0, grad_ld, grad_nrows, grad_ptrs, grad_lds,
                grad_rows, d, dm, HAS_COEFFS, MULTI, ALIGNED,
            )  # fmt: skip
            bad += outside
            acc = z(acc + g)  # a masked-off occurrence adds +0.0: exact
    return acc, bad


@triton.jit
def _sum_pieces(
    run, first, end, k, lead, segs, coeffs, feats, grad0, grad_ld, grad_nrows, grad_ptrs, grad_lds, grad_rows,
    sums, pieces, stats, D,
    HAS_COEFFS: tl.constexpr, MULTI: tl.constexpr, ALIGNED: tl.constexpr, PIECE: tl.constexpr,
    UNROLL: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Lane r sums the piece of run ``run[r]`` (``first`` .. ``end``) that begins at sorted position ``k[r]``
    where ``lead[r]``: the run's sum when it is this one piece, else into ``pieces``."""
    length = tl.where(lead, tl.minimum(end - k, PIECE), 0)
    if tl.max(length, axis=0) > 0:
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        acc, bad = run_sums(
            k, length, segs, coeffs, feats, grad0, grad_ld, grad_nrows, grad_ptrs, grad_lds, grad_rows, d, dm,
            HAS_COEFFS, MULTI, ALIGNED, UNROLL, ROWS, BLOCK_D,
        )  # fmt: skip
        whole = lead & (end - first <= PIECE)  # the run is this one piece
        m2 = whole[:, None] & dm[None, :]
        tl.store(sums + run[:, None] * D + d[None, :], acc, mask=m2)
        part = lead & (end - first > PIECE)
        slot = (k // PIECE) * 2 + tl.where(length == PIECE, 1, 0)
        tl.store(pieces + slot[:, None] * D + d[None, :], acc, mask=part[:, None] & dm[None, :])
        tl.atomic_max(stats + 1, tl.max(row_max_bits(acc, m2), axis=0).to(tl.int64))
        if tl.sum(bad, axis=0) > 0:
            tl.atomic_max(stats + 2, 1)


@triton.jit
def piece_sums_kernel(
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
    sums,  # float32 [N, D]: summed gradient of distinct row u (U rows valid; not written when LONG_ONLY)
    pieces,  # float32 [2 ceil(N / PIECE), D]: the pieces of runs longer than PIECE, for piece_join_kernel
    stats,  # int64 [6]: [1] max over |sums| as bits (>= F32_INF_BITS: not finite); [2] 1 when a bag was
    # outside its gradient (changed since the lookup validated it); [3] the longest run (FIRST)
    N,
    D,
    HAS_COEFFS: tl.constexpr,
    MULTI: tl.constexpr,
    ALIGNED: tl.constexpr,  # every gradient and gradient row starts 16 bytes aligned
    FIRST: tl.constexpr,  # the first pieces (lanes are runs), else the later ones (lanes are positions)
    LONG_ONLY: tl.constexpr,  # only runs longer than PIECE: FIRST measures, the other pass sums all their pieces
    PIECE: tl.constexpr,
    UNROLL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The per-row gradient sums, pass 1. A run of equal sorted ids is cut into pieces of PIECE occurrences
    from its start, each summed by one lane of a [ROWS, BLOCK_D] tile one occurrence at a time, in
    occurrence order. FIRST: the longest run goes to ``stats[3]`` and (unless LONG_ONLY) lane u sums the
    first piece of run u (two contiguous loads find it); else, only when a run is longer than PIECE, lane
    k sums the piece that begins at sorted position k, if one does and it is not a first piece (LONG_ONLY:
    first pieces too). A run of at most PIECE occurrences is one piece, written as its distinct row's sum
    (the C kernel's additions: the CPU's bits); the pieces of a longer run go to ``pieces`` (slot
    2 (k // PIECE) + (a whole piece), unique: two pieces that begin in the same PIECE positions are a run's
    short last one and the next run's whole first one)."""
    lane = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    if FIRST:
        first = tl.load(starts + lane, mask=lane < N, other=N)
        end = tl.load(starts + lane + 1, mask=first < N, other=N)
        tl.atomic_max(stats + 3, tl.max(tl.where(first < N, end - first, 0), axis=0))
        if not LONG_ONLY:
            _sum_pieces(
                lane, first, end, first, first < N, segs, coeffs, feats, grad0, grad_ld, grad_nrows, grad_ptrs,
                grad_lds, grad_rows, sums, pieces, stats, D, HAS_COEFFS, MULTI, ALIGNED, PIECE, UNROLL, ROWS,
                BLOCK_D,
            )  # fmt: skip
    else:
        todo = tl.load(stats + 3)
        km = (lane < N) & ((lane * 0 + todo) > PIECE)  # blocks only in masks (Triton 3.9's interpreter)
        run = tl.load(runs1 + lane, mask=km, other=1) - 1
        first = tl.load(starts + run, mask=km, other=0)
        end = tl.load(starts + run + 1, mask=km, other=0)
        if LONG_ONLY:  # every piece of a long run, its first included
            lead = km & (end - first > PIECE) & ((lane - first) % PIECE == 0)
        else:  # the pieces after the first
            lead = km & (lane > first) & ((lane - first) % PIECE == 0)
        _sum_pieces(
            run, first, end, lane, lead, segs, coeffs, feats, grad0, grad_ld, grad_nrows, grad_ptrs, grad_lds,
            grad_rows, sums, pieces, stats, D, HAS_COEFFS, MULTI, ALIGNED, PIECE, UNROLL, ROWS, BLOCK_D,
        )  # fmt: skip


@triton.jit
def piece_join_kernel(
    starts,  # int64 [N + 2]
    sums,  # float32 [N, D] (not IN_PLACE)
    pieces,  # float32 [2 ceil(N / PIECE), D]: piece_sums_kernel's pieces
    stats,  # int64 [6]: [1] max |sum| bits; [3] read: the longest run (nothing to do unless > PIECE)
    N,
    D,
    IN_PLACE: tl.constexpr,  # a long run's sum replaces its first piece (slot 2 (first // PIECE) + 1)
    PIECE: tl.constexpr,
    UNROLL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Pass 2: lane u of a tile adds the pieces of run u, if it is longer than PIECE, in order (within
    float32 rounding of the CPU's one-occurrence-at-a-time order)."""
    if tl.load(stats + 3) > PIECE:
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
                    acc = z(acc + tl.load(pieces + slot[:, None] * D + d[None, :], mask=m, other=0.0))
            m2 = joined[:, None] & dm[None, :]
            if IN_PLACE:  # the lane read its first piece's slot above; no other lane reads or writes it
                tl.store(pieces + ((first // PIECE) * 2 + 1)[:, None] * D + d[None, :], acc, mask=m2)
            else:
                tl.store(sums + u[:, None] * D + d[None, :], acc, mask=m2)
            tl.atomic_max(stats + 1, tl.max(row_max_bits(acc, m2), axis=0).to(tl.int64))
