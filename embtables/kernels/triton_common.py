"""What the fused GPU kernels (Triton) share: the optimizer kinds as the kernel records number them, float32
bit constants and the small element-wise helpers (|x| bits, ``powf``, the proximal step, the flush of subnormals)."""

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
def abs_bits(x):
    """|x| as int32 bits: ordered like |x| for every float, NaN above +inf (>= F32_INF_BITS: not finite)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def row_max_bits(x, mask):
    """Each row's largest |x| where ``mask`` holds, as int32 bits ([ROWS] of a [ROWS, BLOCK_D] tile)."""
    return tl.max(tl.where(mask, abs_bits(x), 0), axis=1)


@triton.jit
def powf(x, e, LIBDEVICE: tl.constexpr):
    """``powf(x, e)`` for x >= 0: libdevice on the GPU; in Triton's CPU interpreter (tests), which has no
    libdevice, exp(e log x) in float64, rounded once, and 1 where e is 0 (C's powf(0, 0), where the
    logarithm would give -inf * 0)."""
    if LIBDEVICE:
        return libdevice.pow(x, e + tl.zeros_like(x))
    else:
        e_x = e + tl.zeros_like(x)  # a block: the interpreter's where takes blocks
        return tl.where(e_x == 0.0, 1.0, tl.exp(tl.log(x.to(tl.float64)) * e).to(tl.float32))


@triton.jit
def z(x):
    """``x`` with every subnormal value flushed to a zero of its sign (spec §1.5): the GPU kernels apply it to
    every float32 operand they load and every result they compute, as the CPU's flush-to-zero modes do in the C
    kernels."""
    return tl.where(tl.abs(x) < 1.1754943508222875e-38, x * 0.0, x)


@triton.jit
def proximal(prox, lr_t, l1, l2):
    """sign(prox) max(|prox| - lr_t l1, 0) / (1 + lr_t l2), with C's copysignf; subnormals flushed (``z``)."""
    sh = tl.maximum(z(tl.abs(prox) - z(lr_t * l1)), 0.0)
    signed = (sh.to(tl.int32, bitcast=True) | (prox.to(tl.int32, bitcast=True) & SIGN_BIT)).to(tl.float32, bitcast=True)
    return z(tl.div_rn(signed, z(1.0 + z(lr_t * l2))))
