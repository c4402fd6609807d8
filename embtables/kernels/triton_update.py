# ruff: noqa: SIM108  (Triton compiles if/else on constexpr flags; it gets no conditional expressions)
"""The fused sparse update of one table on the GPU (Triton), every optimizer: the C kernels' row math
element by element on [ROWS, BLOCK_D] tiles of distinct rows."""

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
    powf,
    proximal,
    row_max_bits,
)
from embtables.kernels.triton_row_sums import run_sums


@triton.jit
def update_kernel(
    rows,  # int64 [U]: distinct rows
    sums,  # float32 [U, D]: their summed gradients (not INLINE)
    starts,  # INLINE: int64 [N + 2], the first sorted occurrence of each distinct row (run); N past the last
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
    INLINE: tl.constexpr,  # sum each row's gradients here (runs of at most PIECE occurrences) instead of reading sums
    HAS_COEFFS: tl.constexpr,
    MULTI: tl.constexpr,
    ALIGNED: tl.constexpr,
    PIECE: tl.constexpr,
    UNROLL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """ROWS distinct rows per program, as a [ROWS, BLOCK_D] tile: gradient clip -> decay -> optimizer ->
    weight clip (the C kernels' ``et_row_*``, element by element). Each optimizer's branch names its constants
    as its kernel record does (``constant_names``, in the record's order: ``update_parameters`` passes them as
    ``c0..c5``; ``tests/numerics/test_kernel_records.py`` checks the names) and its flags (``FLAG0``/``FLAG1``)
    in the record's ``flag_names`` order. WRITE=False is the dry run: it only finds the first row that would
    not be finite.
    INLINE: row u's gradient is summed here, in the order and with the additions of ``piece_sums_kernel``
    (the same bits), or read from its joined pieces when its run is longer than PIECE."""
    u = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    um = u < U
    row = tl.load(rows + u, mask=um, other=-1)
    d = tl.arange(0, BLOCK_D)
    # rows come from the per-row sums, which checked them: a guard
    dm = (um & (row >= 0) & (row < V))[:, None] & (d < D)[None, :]
    at = row[:, None] * D + d[None, :]
    if INLINE:
        first = tl.load(starts + u, mask=um, other=0)
        end = tl.load(starts + u + 1, mask=um, other=0)
        short = um & (end - first <= PIECE)
        g, _ = run_sums(
            first, tl.where(short, end - first, 0), segs, coeffs, feats, grad0, grad_ld, grad_nrows, grad_ptrs,
            grad_lds, grad_rows, d, d < D, HAS_COEFFS, MULTI, ALIGNED, UNROLL, ROWS, BLOCK_D,
        )  # fmt: skip
        long = um & (end - first > PIECE)
        if tl.max(long.to(tl.int32), axis=0) > 0:
            joined = tl.load(
                pieces + ((first // PIECE) * 2 + 1)[:, None] * D + d[None, :], mask=long[:, None] & dm, other=0.0
            )
            g = tl.where(long[:, None], joined, g)
    else:
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
    elif KIND == K_ADAGRAD_MOMENTUM:  # FLAG0 use_nesterov, FLAG1 beta2_is_one
        momentum, neg_inv_exponent, beta2, one_minus_beta2, epsilon = c0, c1, c2, c3, c4
        if FLAG1:  # beta2 == 1: a plain sum
            a = a + g * g
        else:
            a = beta2 * a + one_minus_beta2 * (g * g)
        scaled = powf(a + epsilon, neg_inv_exponent, LIBDEVICE) * g
        b = momentum * b + scaled
        if FLAG0:  # Nesterov
            x = x - lr * (momentum * b + scaled)
        else:
            x = x - lr * b
    elif KIND == K_ADAM:  # FLAG0 sum_inside_sqrt
        beta_1, one_minus_beta_1, beta_2, one_minus_beta_2, epsilon_squared, epsilon = c0, c1, c2, c3, c4, c5
        a = beta_1 * a + one_minus_beta_1 * g
        b = beta_2 * b + one_minus_beta_2 * (g * g)
        if FLAG0:  # sum_inside_sqrt
            den = tl.sqrt_rn(b + epsilon_squared)
        else:
            den = tl.sqrt_rn(b) + epsilon
        x = x - tl.div_rn(lr * a, den)
    elif KIND == K_FTRL:  # FLAG0 multiply_linear_by_learning_rate, FLAG1 allow_zero_accumulator
        power, l1, beta, two_l2 = c0, c1, c2, c3
        nn = a + g * g
        if POW_IS_SQRT:
            pw_new = tl.sqrt_rn(nn)
            pw_old = tl.sqrt_rn(a)
        else:
            pw_new = powf(nn, power, LIBDEVICE)
            pw_old = powf(a, power, LIBDEVICE)
        if FLAG1:  # allow_zero_accumulator
            pw_new = tl.where(nn == 0.0, 0.0, pw_new)
            pw_old = tl.where(a == 0.0, 0.0, pw_old)
        delta = pw_new - pw_old
        if FLAG0:
            b = b + lr * g - delta * x
            den = pw_new + two_l2 + beta
        else:
            b = b + g - tl.div_rn(delta, lr + tl.zeros_like(delta)) * x
            den = tl.div_rn(pw_new + beta, lr + tl.zeros_like(pw_new)) + two_l2
        numer = tl.where(b < -l1, -l1, tl.where(b > l1, l1, b)) - b
        a = nn
        x = tl.div_rn(numer, den)
        if FLAG1:
            x = tl.where(numer == 0.0, 0.0, x)
    elif KIND == K_PROXIMAL_ADAGRAD:
        l1, l2 = c0, c1
        a = a + g * g
        lr_t = tl.div_rn(lr + tl.zeros_like(a), tl.sqrt_rn(a))
        x = proximal(x - lr_t * g, lr_t, l1, l2)
    elif KIND == K_MOMENTUM:  # FLAG0 use_nesterov
        momentum = c0
        a = momentum * a + g
        if FLAG0:
            x = x - lr * (g + momentum * a)
        else:
            x = x - lr * a
    elif KIND == K_RMSPROP:
        rho, one_minus_rho, momentum, epsilon = c0, c1, c2, c3
        a = rho * a + one_minus_rho * (g * g)
        b = momentum * b + tl.div_rn(lr * g, tl.sqrt_rn(a + epsilon))
        x = x - b
    elif KIND == K_CENTERED_RMSPROP:  # slots ms, mom, mg
        rho, one_minus_rho, momentum, epsilon = c0, c1, c2, c3
        a = rho * a + one_minus_rho * (g * g)
        c = rho * c + one_minus_rho * g
        b = momentum * b + tl.div_rn(lr * g, tl.sqrt_rn(a - c * c + epsilon))
        x = x - b
    elif KIND == K_ADADELTA:
        rho, one_minus_rho, epsilon = c0, c1, c2
        a = rho * a + one_minus_rho * (g * g)
        step = tl.div_rn(tl.sqrt_rn(b + epsilon), tl.sqrt_rn(a + epsilon)) * g
        b = rho * b + one_minus_rho * (step * step)
        x = x - lr * step
    elif KIND == K_PROXIMAL_YOGI:  # slots v, m
        beta_1, one_minus_beta_1, one_minus_beta_2, epsilon, l1, l2 = c0, c1, c2, c3, c4, c5
        g2 = g * g
        b = beta_1 * b + one_minus_beta_1 * g
        diff = a - g2
        step = one_minus_beta_2 * g2
        a = tl.where(diff > 0.0, a - step, tl.where(diff < 0.0, a + step, a - 0.0 * g2))
        lr_t = tl.div_rn(lr + tl.zeros_like(a), tl.sqrt_rn(a) + epsilon)
        x = proximal(x - lr_t * b, lr_t, l1, l2)
    else:  # K_FREQUENCY_ESTIMATOR: lr is the global step
        max_delta, outlier_threshold, one_minus_tau, tau = c0, c1, c2, c3
        delta = lr - a
        dc = tl.where(delta > max_delta, max_delta, delta)
        smoothed = x * one_minus_tau + dc * tau
        threshold = outlier_threshold * x
        x = tl.where(delta >= threshold, dc, smoothed)
        a = lr + tl.zeros_like(a)
    x = tl.where(x < wlo, wlo, x)
    x = tl.where(x > whi, whi, x)
    bits = row_max_bits(x, dm)  # [ROWS]: each row's largest |value|, as bits
    bits_a = row_max_bits(a, dm)
    bits_b = row_max_bits(b, dm)
    bits_c = row_max_bits(c, dm)
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
