"""The GPU lookup (Triton): every feature's pooled bags in one launch, and the input rules of every feature
in one launch (``kernels/gpu.py`` checks the buffers and launches them)."""

from __future__ import annotations

import triton
import triton.language as tl

from embtables.kernels.triton_common import (
    F32_INF_BITS,
    T_BFLOAT16,
    T_FLOAT16,
    T_FLOAT32,
    row_max_bits,
    typed,
    widened,
    z,
)

T_MIXED = tl.constexpr(3)  # the lookup's TYPE when its tables differ: each feature's storage read from ``types``


@triton.jit
def lookup_kernel(
    firsts,  # int64 [F + 1]: the first global bag of each feature
    table_ptrs,  # int64 [F]: address of each feature's table [V, D] (storage TYPE, rows D apart)
    types,  # int64 [F]: each table's storage (``triton_common.T_*``; read when TYPE is T_MIXED)
    dims,  # int64 [F]
    vocabs,  # int64 [F]
    id_ptrs,  # int64 [F]: address of each feature's ids [N_f] (int64)
    id_counts,  # int64 [F]: N_f (offsets outside [0, N_f] are flagged, never followed)
    offset_ptrs,  # int64 [F]: address of each feature's offsets [S_f + 1] (int64)
    coeff_ptrs,  # int64 [F]: address of each feature's coefficients [N_f] (float32), 0 for none
    out_ptrs,  # int64 [F]: address of each feature's first output element
    out_lds,  # int64 [F]: elements between output rows
    status,  # int32 [F]: |= 1 an id outside the table, |= 2 a non-finite activation
    refused,  # int64 [1]: set when a status is (REFUSE)
    F: tl.constexpr,
    FP: tl.constexpr,  # F rounded up to a power of two
    DIM: tl.constexpr,  # every table's dim when they share one (0: read ``dims``)
    ALIGNED: tl.constexpr,  # every table and output row starts 16 bytes aligned: 16-byte loads and stores
    BAGS: tl.constexpr,  # bags a program pools (a power of two), of any features
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    REFUSE: tl.constexpr,
    TYPE: tl.constexpr,  # the storage of every table (float32 or a half type, widened as read), or T_MIXED
):
    """BAGS consecutive bags of every feature per program, as a [BAGS, BLOCK_N, BLOCK_D] tile of rows:
    ``out[b] = sum_k coeffs[k] * table[ids[k]]``; empty bags give 0."""
    i = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)  # [BAGS] global bags
    live = i < tl.load(firsts + F)
    fo = tl.arange(0, FP)
    ends = tl.load(firsts + 1 + fo, mask=fo < F, other=9223372036854775807)
    f = tl.where(live, tl.sum((ends[None, :] <= i[:, None]).to(tl.int32), axis=1), 0)  # [BAGS] features
    s = i - tl.load(firsts + f)
    table_addr = tl.load(table_ptrs + f)
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
        bad += tl.sum((km & (~ok) & (row != -1)).to(tl.int32), axis=1)  # -1: an id dropped at staging
        # every k < end is inside the bag's coefficients; a row outside the table loads no values, so its
        # coefficient is harmless (masking it by ``ok`` too miscompiles in Triton 3.6 at some tile shapes)
        c = tl.load(coeffs[:, None] + k, mask=km & ((coeff_addr[:, None] + k * 0) != 0), other=1.0)
        at = row * dim
        if ALIGNED:
            at = tl.multiple_of(at, [4, 4])
        vals = _rows(table_addr, types, f, at, ok[:, :, None] & dm[:, None, :], d, ALIGNED, TYPE)
        # subnormal rows, coefficients, products and block sums flushed (spec §1.5); the sum of a block of BLOCK_N
        # products is a tree, as its order is (within float32 rounding of the C kernels' running sum)
        acc = z(acc + z(tl.sum(z(z(vals) * z(c)[:, :, None]), axis=1)))
    out_at = s * ld
    if ALIGNED:
        out_at = tl.multiple_of(out_at, 4)
    tl.store(out[:, None] + out_at[:, None] + d[None, :], acc, mask=dm)
    nonfinite = row_max_bits(acc, dm) >= F32_INF_BITS
    flag = tl.where(bad > 0, 1, 0) | tl.where(nonfinite, 2, 0)
    tl.atomic_or(status + f, flag, mask=flag != 0)
    if REFUSE:
        tl.atomic_max(refused, 1, mask=tl.max(flag, axis=0) != 0)


@triton.jit
def _rows(table_addr, types, f, at, mask, d, ALIGNED: tl.constexpr, TYPE: tl.constexpr):
    """The [BAGS, BLOCK_N, BLOCK_D] values of rows ``at`` (element offsets) of each bag's table at
    ``table_addr`` [BAGS] as float32: in storage TYPE, or with T_MIXED in each feature's own (``types``)."""
    if TYPE == T_MIXED:
        kind = tl.load(types + f)[:, None, None]
        v32 = _typed_rows(table_addr, at, mask & (kind == T_FLOAT32), d, ALIGNED, T_FLOAT32)
        v16 = _typed_rows(table_addr, at, mask & (kind != T_FLOAT32), d, ALIGNED, T_BFLOAT16)
        bits16 = (v16.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
        return tl.where(kind == T_FLOAT32, v32, tl.where(kind == T_BFLOAT16, v16, widened(bits16, T_FLOAT16)))
    else:
        return _typed_rows(table_addr, at, mask, d, ALIGNED, TYPE)


@triton.jit
def _typed_rows(table_addr, at, mask, d, ALIGNED: tl.constexpr, TYPE: tl.constexpr):
    """``_rows`` of tables of storage TYPE (bfloat16 for a float16 table: the same 16 bits)."""
    table = typed(table_addr, TYPE)
    if ALIGNED:
        table = tl.multiple_of(table, 16)
    raw = tl.load(table[:, None, None] + at[:, :, None] + d[None, None, :], mask=mask, other=0)
    return widened(raw, TYPE)


@triton.jit
def stage_kernel(
    id_ptrs,  # int64 [F]: address of each feature's ids [N_f] (int64; a dropping feature's are rewritten)
    id_counts,  # int64 [F]
    vocabs,  # int64 [F]
    split_ptrs,  # int64 [F]: address of each feature's row splits [B_f + 1] (int64); unread when split_counts is 0
    split_counts,  # int64 [F]: B_f + 1, or 0 for a dense input (no splits)
    modes,  # int64 [F]: the coefficients to write: 0 none (sum), 1 1/c (mean), 2 1/sqrt(c) (sqrtn), c the bag's ids
    drops,  # int64 [F]: 1 where a negative id is dropped (rewritten -1, its coefficient 0), not an error
    seg_at,  # int64 [F]: where feature f's ids begin in ``segs`` and ``coeffs``
    bag_at,  # int64 [F]: where feature f's bags begin in ``negs``
    segs,  # int64 [N] out: the bag of every id of a feature with row splits
    coeffs,  # float32 [N] out: the coefficient of every id of a feature whose mode is not 0
    negs,  # int64 [sum B] (DROPS): the dropped ids of each bag (zeroed; PASS 0 counts, PASS 1 reads)
    flags,  # int32 [F]: |= 1 an id outside [0, V); |= 2 row splits that decrease, or do not start at 0 and end at N_f
    refused,  # int64 [1]: set when a flag is (REFUSE)
    steps,  # binary search steps: at least log2 of the largest B_f
    BLOCK: tl.constexpr,
    REFUSE: tl.constexpr,
    DROPS: tl.constexpr,  # some feature drops negative ids: PASS 0 counts them per bag, PASS 1 writes coefficients
    PASS: tl.constexpr,
):
    """The input rules of every feature, and each id's bag and coefficient, in one launch (two when a feature
    drops negative ids and has coefficients: its bags' sizes are known after the first): program (b, f)
    does block b of feature f. Bags are found by a binary search of the row splits that reads only inside
    them, so broken splits (flagged) give wrong bags but no wild read."""
    b = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1)
    n = tl.load(id_counts + f)
    ids = tl.load(id_ptrs + f).to(tl.pointer_type(tl.int64))
    o = b * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(ids + o, mask=m, other=0)
    drop = tl.load(drops + f) != 0
    dropped = m & (x < 0) & drop
    ns = tl.load(split_counts + f)
    splits = tl.load(split_ptrs + f).to(tl.pointer_type(tl.int64))
    if PASS == 0:
        bad_id = m & (x >= tl.load(vocabs + f)) | (m & (x < 0) & (~drop))
        flag = tl.where(tl.max(tl.where(bad_id, 1, 0), axis=0) > 0, 1, 0)
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
            if REFUSE:
                tl.atomic_max(refused, 1)
        tl.store(ids + o, x * 0 - 1, mask=dropped)
    if ns > 0:
        bags = ns - 1
        low = tl.zeros([BLOCK], dtype=tl.int64)
        high = low + bags
        for _ in range(steps):  # the last bag s with splits[s] <= o
            mid = (low + high) // 2
            go = tl.load(splits + mid, mask=m & (mid < bags), other=0) <= o
            low = tl.where(go, mid, low)
            high = tl.where(go, high, mid)
        at = tl.load(seg_at + f) + o
        if PASS == 0:
            tl.store(segs + at, low, mask=m)
        mode = tl.load(modes + f)
        if DROPS:
            neg_at = tl.load(bag_at + f) + low
            if PASS == 0:
                tl.atomic_add(negs + neg_at, o * 0 + 1, mask=dropped)
            elif mode != 0:
                less = tl.load(negs + neg_at, mask=m, other=0)
                c = _bag_coefficients(splits, low, bags, less, m, mode, o, BLOCK)
                tl.store(coeffs + at, tl.where(dropped, 0.0, c), mask=m)
        elif mode != 0:
            c = _bag_coefficients(splits, low, bags, tl.zeros([BLOCK], dtype=tl.int64), m, mode, o, BLOCK)
            tl.store(coeffs + at, c, mask=m)


@triton.jit
def _bag_coefficients(splits, bag, bags, less, m, mode, o, BLOCK: tl.constexpr):
    """1/c (mode 1) or 1/sqrt(c) (mode 2), c the ids of ``bag`` less ``less`` dropped ones (IEEE division and
    square root: torch's float32 bits)."""
    count = tl.load(splits + bag + 1, mask=m & (bag < bags), other=1) - tl.load(splits + bag, mask=m, other=0) - less
    den = count.to(tl.float32)
    den = tl.where((o * 0 + mode) == 2, tl.sqrt_rn(den), den)
    return tl.div_rn(tl.full([BLOCK], 1.0, tl.float32), den)
