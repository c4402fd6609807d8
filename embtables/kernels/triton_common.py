"""What the fused GPU kernels (Triton) share: the optimizer kinds as the kernel records number them, float32
bit constants and the small element-wise helpers (|x| bits, ``powf``, the proximal step, the flush of subnormals)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from embtables.kernels import storage_types
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


# Storage types of a table's rows or slots (``ROW_TYPE`` / ``SLOT_TYPE`` of the update, ``TYPE`` of the lookup):
# half values are read and written as their 16 bits (int16), widened to float32 exactly.
T_FLOAT32 = tl.constexpr(storage_types.FLOAT32.gpu_code)
T_BFLOAT16 = tl.constexpr(storage_types.BFLOAT16.gpu_code)
T_FLOAT16 = tl.constexpr(storage_types.FLOAT16.gpu_code)
FLOAT16_INF_BITS = tl.constexpr(0x7C00)


@triton.jit
def typed(address, TYPE: tl.constexpr):
    """The int64 ``address`` as a pointer to values of storage ``TYPE``: float32, or the 16 bits of a half value."""
    if TYPE == T_FLOAT32:
        return address.to(tl.pointer_type(tl.float32))
    else:
        return address.to(tl.pointer_type(tl.int16))


@triton.jit
def widened(v, TYPE: tl.constexpr):
    """Loaded values ``v`` of storage ``TYPE`` as float32, exactly (bfloat16: float32's upper 16 bits)."""
    if TYPE == T_FLOAT32:
        return v
    elif TYPE == T_BFLOAT16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def lowbias32(x):
    """The 32-bit hash of spec §12 on uint32 values: two multiply-xorshift rounds, products modulo 2^32."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def row_states(prefix, key):
    """Each row's hash state [ROWS] (uint32): ``prefix`` (the state after seed, step and table, one per row)
    continued with the low and the high 32 bits of the row's global id ``key`` (int64)."""
    h = lowbias32(prefix.to(tl.uint32) ^ (key & 0xFFFFFFFF).to(tl.uint32))
    return lowbias32(h ^ ((key >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def rounded(x, states, column, TYPE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """float32 ``x`` [ROWS, BLOCK_D] as the 16 bits (int16) of storage ``TYPE``, rounded stochastically with
    the bits of (``states`` [ROWS], ``column`` [BLOCK_D]) or to nearest (ties to even), as
    ``kernels/stochastic_rounding.round_to`` rounds: the same bits for every finite value (a value no half
    value holds becomes an infinity, refused by the dry run; a non-finite one stays non-finite)."""
    raw = x.to(tl.uint32, bitcast=True)
    if TYPE == T_BFLOAT16:
        if STOCHASTIC:
            r = lowbias32(states[:, None] ^ column[None, :].to(tl.uint32))
            up = (raw + (r >> 16)) >> 16
        else:
            up = (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16
        up = tl.where(abs_bits(x) < F32_INF_BITS, up, raw >> 16)  # a NaN's carry could reach the sign
        return up.to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        nearest = x.to(tl.float16)  # to nearest, ties to even
        near = nearest.to(tl.int16, bitcast=True)
        if STOCHASTIC:
            r = lowbias32(states[:, None] ^ column[None, :].to(tl.uint32))
            over = tl.abs(nearest.to(tl.float32)) > tl.abs(x)  # rounded away from zero: one step back
            low = near - over.to(tl.int16)  # sign-magnitude: -1 is one step toward zero
            high = low + 1
            low64 = low.to(tl.float16, bitcast=True).to(tl.float32).to(tl.float64)
            gap = tl.abs(high.to(tl.float16, bitcast=True).to(tl.float32).to(tl.float64) - low64)
            below = tl.abs(x.to(tl.float64) - low64)  # exact: x and low are float32 values
            out = tl.where(r.to(tl.float64) * 2.3283064365386963e-10 * gap < below, high, low)
            inf = (((raw >> 16) & 0x8000) | FLOAT16_INF_BITS).to(tl.uint16).to(tl.int16, bitcast=True)
            out = tl.where(tl.abs(x) > 65504.0, inf, out)
            return tl.where(abs_bits(x) < F32_INF_BITS, out, near)
        else:
            return near
