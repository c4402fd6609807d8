"""Stochastic rounding to bfloat16 / float16 (docs/spec.md §12), from the spec, in NumPy: the random bits of
(seed, step, table, row, column) and the rounding rule, with the two neighbouring half values computed from the
formats' definitions in float64 (no half type of any library). Imports neither torch nor embtables."""

from __future__ import annotations

import numpy as np

MASK32 = 0xFFFFFFFF
START = 0x243F6A88
# (mantissa bits, smallest normal exponent) of each half type
FORMATS = {"bfloat16": (7, -126), "float16": (10, -14)}
FLOAT16_MAX = 65504.0


def lowbias32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) & MASK32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(MASK32)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(MASK32)
    x ^= x >> np.uint64(16)
    return x


def random_bits(seed: int, step: int, table: int, rows: np.ndarray, dim: int) -> np.ndarray:
    """[U, D] uint64 values in [0, 2^32): the hash chained over the words seed (low, high), step (low, high),
    table, row (low, high), column."""
    h = np.array([START], dtype=np.uint64)
    for value in (seed, step):
        v = value & 0xFFFFFFFFFFFFFFFF
        h = lowbias32(h ^ np.uint64(v & MASK32))
        h = lowbias32(h ^ np.uint64(v >> 32))
    h = lowbias32(h ^ np.uint64(table & MASK32))
    r = rows.astype(np.int64).view(np.uint64)
    h = lowbias32(h ^ (r & np.uint64(MASK32)))
    h = lowbias32(h ^ (r >> np.uint64(32)))
    return lowbias32(h[:, None] ^ np.arange(dim, dtype=np.uint64)[None, :])


def neighbours(x: float, kind: str) -> tuple[float, float]:
    """The half values of ``kind`` around finite ``x``: (toward zero, away from zero), equal when ``x`` is one."""
    mantissa, emin = FORMATS[kind]
    a = abs(float(x))
    e = max(int(np.floor(np.log2(a))) if a > 0 else emin, emin)
    ulp = 2.0 ** (e - mantissa)
    low = np.floor(a / ulp) * ulp
    high = low if low == a else low + ulp
    sign = -1.0 if np.signbit(x) else 1.0
    return sign * low, sign * high


def stochastic_round(x: float, kind: str, bits: int) -> float:
    """``x`` (a float32 value) rounded to ``kind`` with 32 random bits: away from zero when the random
    fraction falls under (|x| - |low|) / gap; bfloat16 reads the fraction from the upper 16 bits, float16 from
    all 32. Float16 values above 65504 in magnitude overflow to an infinity."""
    if kind == "float16" and abs(x) > FLOAT16_MAX:
        return float(np.copysign(np.inf, x))
    low, high = neighbours(x, kind)
    if low == high:
        return low
    fraction = (abs(x) - abs(low)) / abs(high - low)
    u = (bits >> 16) / 2.0**16 if kind == "bfloat16" else bits / 2.0**32
    if kind == "bfloat16":
        return high if u >= 1.0 - fraction else low  # bit for bit: (bits >> 16) + d >= 2^16
    return high if u * abs(high - low) < abs(x) - abs(low) else low
