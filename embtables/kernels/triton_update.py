# ruff: noqa: SIM108  (Triton compiles if/else on constexpr flags; it gets no conditional expressions)
"""The fused sparse update of a group of tables on the GPU (Triton), every optimizer: the C kernels' row math
element by element on [ROWS, BLOCK_D] tiles of distinct keys, each row's table found from its key."""

from __future__ import annotations

import triton
import triton.language as tl

from embtables.kernels.triton_common import (
    F32_INF_BITS,
    K_ADADELTA,
    K_ADAGRAD,
    K_ADAGRAD_MOMENTUM,
    K_ADAM,
    K_CENTERED_RMSPROP,
    K_FTRL,
    K_MOMENTUM,
    K_PROXIMAL_ADAGRAD,
    K_PROXIMAL_YOGI,
    K_RMSPROP,
    K_SGD,
    T_BFLOAT16,
    T_FLOAT16,
    T_FLOAT32,
    powf,
    proximal,
    rounded,
    row_max_bits,
    row_states,
    typed,
    widened,
    z,
)
from embtables.kernels.triton_row_sums import run_sums


@triton.jit
def _row_tables(row, um, bases, T_STEPS: tl.constexpr):
    """The group table of each key ``row`` [ROWS]: the largest j with ``bases[j] <= row`` (a binary search of
    T_STEPS = ceil(log2(T)) steps over the group's T tables)."""
    lo = tl.zeros_like(row)
    hi = lo + (1 << T_STEPS)
    for _ in tl.static_range(T_STEPS):
        mid = (lo + hi) // 2
        go = tl.load(bases + mid, mask=um, other=0) <= row
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _loaded(address, at, dm, TYPE: tl.constexpr, ALIGNED_TABLES: tl.constexpr):
    """The [ROWS, BLOCK_D] values at ``at`` of each row's tensor at ``address`` [ROWS] (storage ``TYPE``) as
    float32, subnormals flushed, and the pointers [ROWS, 1] they were read through."""
    p = typed(address, TYPE)
    if ALIGNED_TABLES:  # every table and slot 16-byte aligned and D % 4 == 0 (checked by the caller)
        p = tl.multiple_of(p, 16)
    p = p[:, None]
    return z(widened(tl.load(p + at, mask=dm, other=0), TYPE)), p


@triton.jit
def _stored(x, states, column, TYPE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """float32 ``x`` as written into a tensor of storage ``TYPE`` (a half type: rounded, ``rounded``)."""
    if TYPE == T_FLOAT32:
        return x
    else:
        return rounded(x, states, column, TYPE, STOCHASTIC)


@triton.jit
def _written_bits(x, states, column, dm, TYPE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Each row's largest |value| (int32 bits) of ``x`` and of ``x`` as written in storage ``TYPE``: at least
    ``F32_INF_BITS`` when either is not finite (a half type's overflow included)."""
    worst = row_max_bits(x, dm)
    if TYPE == T_BFLOAT16:  # a carry past the largest bfloat16 depends on the random bits
        worst = tl.maximum(worst, row_max_bits(widened(rounded(x, states, column, TYPE, STOCHASTIC), TYPE), dm))
    elif TYPE == T_FLOAT16:  # float16 overflows past a threshold: beyond 65504, or from 65520 rounded to nearest
        if STOCHASTIC:
            over = tl.abs(x) > 65504.0
        else:
            over = tl.abs(x) >= 65520.0
        worst = tl.maximum(worst, tl.max(tl.where(dm & over, F32_INF_BITS, 0), axis=1))
    return worst


@triton.jit
def update_kernel(
    rows,  # int64 [N]: distinct keys (U valid): table j's row r is key bases[j] + r
    stats,  # int64 [STATS]: [0] U; [2] 1 when phase 1 found an id or a bag outside its table or gradient
    bases,  # int64 [2^T_STEPS + 1]: the first key of each table, then the total (repeated to the end)
    tabs,  # int64 [T, 7]: addresses of each table's weights and slots [V_j, D] (ROW_TYPE, SLOT_TYPE; weights 0:
    # not updated here), of its changed-rows flags [V_j] (bool: set for every row written; 0: none) and of its
    # rows' global ids [V_j] (int64; 0: a row's own), and its rounding's hash state after (seed, step, table)
    sums,  # float32 [N, D]: the summed gradient of each key (not INLINE)
    starts,  # INLINE: int64 [N + 2], the first sorted occurrence of each distinct key (run); N past the last
    segs,  # INLINE: the per-row sums' sorted occurrences (``run_sums``), their gradients and pieces
    coeffs,
    feats,
    grad0,
    grad_ld,
    grad_nrows,
    grad_ptrs,
    grad_lds,
    grad_rows,
    pieces,  # INLINE: float32, a run longer than PIECE: its joined sum in slot 2 (first // PIECE) + 1
    refused,  # int64 [1]: nonzero when the step is refused (the write then writes nothing); the dry run sets it
    found,  # int64 [2] (the dry run): min key whose new values are not finite; min key whose gradient is not
    D,
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
    ROW_TYPE: tl.constexpr,  # the storage of the weights (``triton_common.T_*``) and of the slots: a half type's
    SLOT_TYPE: tl.constexpr,  # values are widened as read and rounded as written (spec §12)
    STOCHASTIC: tl.constexpr,  # half values rounded stochastically (else to nearest)
    LIBDEVICE: tl.constexpr,
    WRITE: tl.constexpr,
    INLINE: tl.constexpr,  # sum each row's gradients here (runs of at most PIECE occurrences) instead of reading sums
    HAS_COEFFS: tl.constexpr,
    MULTI: tl.constexpr,
    ALIGNED: tl.constexpr,
    ALIGNED_TABLES: tl.constexpr,
    T_STEPS: tl.constexpr,
    PIECE: tl.constexpr,
    UNROLL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """ROWS distinct keys per program, as a [ROWS, BLOCK_D] tile, of any tables of the group: gradient clip ->
    decay -> optimizer -> weight clip (the C kernels' ``et_row_*``, element by element). Each optimizer's branch
    names its constants as its kernel record does (``constant_names``, in the record's order:
    ``update_parameters`` passes them as ``c0..c5``; ``tests/numerics/test_kernel_records.py`` checks the
    names) and its flags (``FLAG0``/``FLAG1``) in the record's ``flag_names`` order.
    WRITE=False is the dry run: it writes no table or slot, records the first key whose new values (or
    gradient) would not be finite in ``found`` and refuses the step (``refused``) when one would not be, or
    when phase 1 flagged its input. WRITE=True writes only when the step is not refused.
    INLINE: row u's gradient is summed here, in the order and with the additions of ``piece_sums_kernel``
    (the same bits), or read from its joined pieces when its run is longer than PIECE.
    Half storage: the update is computed in float32 from the widened values; the dry run also refuses a value
    whose rounding is not finite (a float16 overflow), and the write stores the rounded values, stochastic
    rounding taking the bits of (seed, step, table, global row, column): weight c is column c, slot k's
    value c column (k + 1) D + c."""
    u = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    um = u < tl.load(stats)
    row = tl.load(rows + u, mask=um, other=-1)
    um = um & (row >= 0)  # key -1: an id outside its table (phase 1 flagged it)
    t = _row_tables(row, um, bases, T_STEPS)
    base = tl.load(bases + t, mask=um, other=0)
    local = row - base
    w_addr = tl.load(tabs + 7 * t, mask=um, other=0)
    live = um & (w_addr != 0) & (local < tl.load(bases + t + 1, mask=um, other=0) - base)
    d = tl.arange(0, BLOCK_D)
    dm = live[:, None] & (d < D)[None, :]
    row_at = local * D
    if ALIGNED_TABLES:
        row_at = tl.multiple_of(row_at, 4)
    at = row_at[:, None] + d[None, :]
    states = tl.zeros([ROWS], dtype=tl.uint32)
    if STOCHASTIC:  # (set only with a half storage)
        g_addr = tl.load(tabs + 7 * t + 5, mask=live, other=0)
        key = tl.load(g_addr.to(tl.pointer_type(tl.int64)) + local, mask=live & (g_addr != 0), other=0)
        states = row_states(tl.load(tabs + 7 * t + 6, mask=live, other=0), tl.where(g_addr != 0, key, local))
    if INLINE:
        first = tl.load(starts + u, mask=live, other=0)
        end = tl.load(starts + u + 1, mask=live, other=0)
        short = live & (end - first <= PIECE)
        g, _ = run_sums(
            first, tl.where(short, end - first, 0), segs, coeffs, feats, grad0, grad_ld, grad_nrows, grad_ptrs,
            grad_lds, grad_rows, d, d < D, HAS_COEFFS, MULTI, ALIGNED, UNROLL, ROWS, BLOCK_D,
        )  # fmt: skip
        long = live & (end - first > PIECE)
        if tl.max(long.to(tl.int32), axis=0) > 0:
            joined = tl.load(
                pieces + ((first // PIECE) * 2 + 1)[:, None] * D + d[None, :], mask=long[:, None] & dm, other=0.0
            )
            g = tl.where(long[:, None], joined, g)
    else:
        g = tl.load(sums + u[:, None] * D + d[None, :], mask=dm, other=0.0)
    gbits = row_max_bits(g, dm)
    # Subnormals (spec §1.5): every operand loaded and every arithmetic result is flushed (``z``), in the C
    # kernels' order of operations, so the bits are theirs on any GPU and in Triton's CPU interpreter.
    g = z(g)
    g = tl.where(g < glo, glo, g)
    g = tl.where(g > ghi, ghi, g)
    x, weights = _loaded(w_addr, at, dm, ROW_TYPE, ALIGNED_TABLES)
    x = z(x - z(decay * x))
    a = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    b = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    c = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    if NSLOTS >= 1:
        a, s0 = _loaded(tl.load(tabs + 7 * t + 1, mask=live, other=0), at, dm, SLOT_TYPE, ALIGNED_TABLES)
    if NSLOTS >= 2:
        b, s1 = _loaded(tl.load(tabs + 7 * t + 2, mask=live, other=0), at, dm, SLOT_TYPE, ALIGNED_TABLES)
    if NSLOTS >= 3:
        c, s2 = _loaded(tl.load(tabs + 7 * t + 3, mask=live, other=0), at, dm, SLOT_TYPE, ALIGNED_TABLES)
    if KIND == K_SGD:
        x = z(x - z(lr * g))
    elif KIND == K_ADAGRAD:
        a = z(a + z(g * g))
        x = z(x - z(tl.div_rn(z(lr * g), tl.sqrt_rn(a))))
    elif KIND == K_ADAGRAD_MOMENTUM:  # FLAG0 use_nesterov, FLAG1 beta2_is_one
        momentum, neg_inv_exponent, beta2, one_minus_beta2, epsilon = c0, c1, c2, c3, c4
        if FLAG1:  # beta2 == 1: a plain sum
            a = z(a + z(g * g))
        else:
            a = z(z(beta2 * a) + z(one_minus_beta2 * z(g * g)))
        scaled = z(z(powf(z(a + epsilon), neg_inv_exponent, LIBDEVICE)) * g)
        b = z(z(momentum * b) + scaled)
        if FLAG0:  # Nesterov
            x = z(x - z(lr * z(z(momentum * b) + scaled)))
        else:
            x = z(x - z(lr * b))
    elif KIND == K_ADAM:  # FLAG0 sum_inside_sqrt
        beta_1, one_minus_beta_1, beta_2, one_minus_beta_2, epsilon_squared, epsilon = c0, c1, c2, c3, c4, c5
        a = z(z(beta_1 * a) + z(one_minus_beta_1 * g))
        b = z(z(beta_2 * b) + z(one_minus_beta_2 * z(g * g)))
        if FLAG0:  # sum_inside_sqrt
            den = tl.sqrt_rn(z(b + epsilon_squared))
        else:
            den = z(tl.sqrt_rn(b) + epsilon)
        x = z(x - z(tl.div_rn(z(lr * a), den)))
    elif KIND == K_FTRL:  # FLAG0 multiply_linear_by_learning_rate, FLAG1 allow_zero_accumulator
        power, l1, beta, two_l2 = c0, c1, c2, c3
        nn = z(a + z(g * g))
        if POW_IS_SQRT:
            pw_new = tl.sqrt_rn(nn)
            pw_old = tl.sqrt_rn(a)
        else:
            pw_new = z(powf(nn, power, LIBDEVICE))
            pw_old = z(powf(a, power, LIBDEVICE))
        if FLAG1:  # allow_zero_accumulator
            pw_new = tl.where(nn == 0.0, 0.0, pw_new)
            pw_old = tl.where(a == 0.0, 0.0, pw_old)
        delta = z(pw_new - pw_old)
        if FLAG0:
            b = z(z(b + z(lr * g)) - z(delta * x))
            den = z(z(pw_new + two_l2) + beta)
        else:
            b = z(z(b + g) - z(z(tl.div_rn(delta, lr + tl.zeros_like(delta))) * x))
            den = z(z(tl.div_rn(z(pw_new + beta), lr + tl.zeros_like(pw_new))) + two_l2)
        numer = z(tl.where(b < -l1, -l1, tl.where(b > l1, l1, b)) - b)
        a = nn
        x = z(tl.div_rn(numer, den))
        if FLAG1:
            x = tl.where(numer == 0.0, 0.0, x)
    elif KIND == K_PROXIMAL_ADAGRAD:
        l1, l2 = c0, c1
        a = z(a + z(g * g))
        lr_t = z(tl.div_rn(lr + tl.zeros_like(a), tl.sqrt_rn(a)))
        x = proximal(z(x - z(lr_t * g)), lr_t, l1, l2)
    elif KIND == K_MOMENTUM:  # FLAG0 use_nesterov
        momentum = c0
        a = z(z(momentum * a) + g)
        if FLAG0:
            x = z(x - z(lr * z(g + z(momentum * a))))
        else:
            x = z(x - z(lr * a))
    elif KIND == K_RMSPROP:
        rho, one_minus_rho, momentum, epsilon = c0, c1, c2, c3
        a = z(z(rho * a) + z(one_minus_rho * z(g * g)))
        b = z(z(momentum * b) + z(tl.div_rn(z(lr * g), tl.sqrt_rn(z(a + epsilon)))))
        x = z(x - b)
    elif KIND == K_CENTERED_RMSPROP:  # slots ms, mom, mg
        rho, one_minus_rho, momentum, epsilon = c0, c1, c2, c3
        a = z(z(rho * a) + z(one_minus_rho * z(g * g)))
        c = z(z(rho * c) + z(one_minus_rho * g))
        b = z(z(momentum * b) + z(tl.div_rn(z(lr * g), tl.sqrt_rn(z(z(a - z(c * c)) + epsilon)))))
        x = z(x - b)
    elif KIND == K_ADADELTA:
        rho, one_minus_rho, epsilon = c0, c1, c2
        a = z(z(rho * a) + z(one_minus_rho * z(g * g)))
        step = z(z(tl.div_rn(tl.sqrt_rn(z(b + epsilon)), tl.sqrt_rn(z(a + epsilon)))) * g)
        b = z(z(rho * b) + z(one_minus_rho * z(step * step)))
        x = z(x - z(lr * step))
    elif KIND == K_PROXIMAL_YOGI:  # slots v, m
        beta_1, one_minus_beta_1, one_minus_beta_2, epsilon, l1, l2 = c0, c1, c2, c3, c4, c5
        g2 = z(g * g)
        b = z(z(beta_1 * b) + z(one_minus_beta_1 * g))
        diff = z(a - g2)
        step = z(one_minus_beta_2 * g2)
        a = tl.where(diff > 0.0, z(a - step), tl.where(diff < 0.0, z(a + step), z(a - z(0.0 * g2))))
        lr_t = z(tl.div_rn(lr + tl.zeros_like(a), z(tl.sqrt_rn(a) + epsilon)))
        x = proximal(z(x - z(lr_t * b)), lr_t, l1, l2)
    else:  # K_FREQUENCY_ESTIMATOR: lr is the global step
        max_delta, outlier_threshold, one_minus_tau, tau = c0, c1, c2, c3
        delta = z(lr - a)
        dc = tl.where(delta > max_delta, max_delta, delta)
        smoothed = z(z(x * one_minus_tau) + z(dc * tau))
        threshold = z(outlier_threshold * x)
        x = tl.where(delta >= threshold, dc, smoothed)
        a = lr + tl.zeros_like(a)
    x = tl.where(x < wlo, wlo, x)
    x = tl.where(x > whi, whi, x)
    if not WRITE:  # the dry run: the first key whose gradient, or new values, would not be finite
        worst = _written_bits(x, states, d, dm, ROW_TYPE, STOCHASTIC)
        if NSLOTS >= 1:
            worst = tl.maximum(worst, _written_bits(a, states, d + D, dm, SLOT_TYPE, STOCHASTIC))
        if NSLOTS >= 2:
            worst = tl.maximum(worst, _written_bits(b, states, d + 2 * D, dm, SLOT_TYPE, STOCHASTIC))
        if NSLOTS >= 3:
            worst = tl.maximum(worst, _written_bits(c, states, d + 3 * D, dm, SLOT_TYPE, STOCHASTIC))
        never = 9223372036854775807
        first_bad = tl.min(tl.where(live & (worst >= F32_INF_BITS), row, never), axis=0)
        first_nan = tl.min(tl.where(live & (gbits >= F32_INF_BITS), row, never), axis=0)
        if first_bad < never:
            tl.atomic_min(found, first_bad)
        if first_nan < never:
            tl.atomic_min(found + 1, first_nan)
        if (first_bad < never) | (first_nan < never):
            tl.atomic_max(refused, 1)
        if (tl.program_id(0) == 0) & (tl.load(stats + 2) != 0):
            tl.atomic_max(refused, 1)
    else:
        wm = dm & (tl.load(refused) == 0)  # a refused step writes nothing
        tl.store(weights + at, _stored(x, states, d, ROW_TYPE, STOCHASTIC), mask=wm)
        if NSLOTS >= 1:
            tl.store(s0 + at, _stored(a, states, d + D, SLOT_TYPE, STOCHASTIC), mask=wm)
        if NSLOTS >= 2:
            tl.store(s1 + at, _stored(b, states, d + 2 * D, SLOT_TYPE, STOCHASTIC), mask=wm)
        if NSLOTS >= 3:
            tl.store(s2 + at, _stored(c, states, d + 3 * D, SLOT_TYPE, STOCHASTIC), mask=wm)
        c_addr = tl.load(tabs + 7 * t + 4, mask=live, other=0)
        marked = live & (c_addr != 0) & (tl.load(refused) == 0)
        tl.store(c_addr.to(tl.pointer_type(tl.int8)) + local, tl.full([ROWS], 1, tl.int8), mask=marked)
