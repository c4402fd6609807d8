"""Stochastic rounding of float32 values to a half type (bfloat16, float16), seeded and reproducible
(docs/spec.md §12): every element's 32 random bits are a hash of (seed, step, table, row, column), so the
same update gives the same bits whatever the thread schedule, the kernel path, the sharding or a restore in
between. Pure tensor functions; the native C and GPU kernels implement the same scheme.

Shapes: U rows of an update, D columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embtables.kernels import storage_types

HALF_TYPES = (torch.bfloat16, torch.float16)
FLOAT16_MAX = storage_types.FLOAT16.max_finite  # a larger |value| is an overflow (not finite)
_MASK32 = 0xFFFFFFFF
_START = 0x243F6A88  # the hash's starting state (pi's first 32 fraction bits)


def lowbias32(x: Tensor) -> Tensor:
    """The 32-bit integer hash of spec §12 on int64 tensors holding values in [0, 2^32): two multiply-xorshift
    rounds (C. Wellons' "lowbias32"), arithmetic modulo 2^32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _words(value: int) -> tuple[int, int]:
    v = value & 0xFFFFFFFFFFFFFFFF
    return v & _MASK32, v >> 32


def _lowbias32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def table_state(seed: int, step: int, table: int) -> int:
    """The hash state (in [0, 2^32)) after (seed, step, table): what every row of the table's update at
    ``step`` continues from (the GPU kernels take it per table)."""
    h = _START
    for word in (*_words(seed), *_words(step), table & _MASK32):
        h = _lowbias32_int(h ^ word)
    return h


def row_states(seed: int, step: int, table: int, rows: Tensor) -> Tensor:
    """The hash state of every row [U] (int64, values in [0, 2^32)) after (seed, step, table, row): the
    prefix every column's bits continue from."""
    r = rows.to(torch.int64)
    h = lowbias32(torch.tensor(table_state(seed, step, table), dtype=torch.int64, device=r.device) ^ (r & _MASK32))
    return lowbias32(h ^ ((r >> 32) & _MASK32))


def random_bits(seed: int, step: int, table: int, rows: Tensor, dim: int) -> Tensor:
    """32 random bits [U, D] (int64 in [0, 2^32)) for column c of row ``rows[u]`` of table ``table`` at
    ``step``: the last hash round of (seed, step, table, row, column)."""
    states = row_states(seed, step, table, rows)
    columns = torch.arange(dim, dtype=torch.int64, device=rows.device)
    return lowbias32(states[:, None] ^ columns[None, :])


def round_to(values: Tensor, dtype: torch.dtype, bits: Tensor | None) -> Tensor:
    """``values`` (float32) in ``dtype`` (bfloat16 or float16): stochastically rounded with ``bits`` (32
    random bits per element, ``random_bits``), or to nearest (ties to even) when ``bits`` is None. Stochastic
    rounding picks one of the two neighbouring values of ``dtype``, the one further away with probability
    (distance to the nearer-to-zero one) / (their gap): unbiased. A non-finite value stays non-finite; a
    float16 value above 65504 in magnitude becomes an infinity (an overflow, refused by the update's check)."""
    if dtype not in HALF_TYPES:
        raise TypeError(f"round_to: {dtype} is not a half type ({', '.join(map(str, HALF_TYPES))}).")
    x = values.to(torch.float32)
    if bits is None:
        return x.to(dtype)
    if bits.shape != x.shape:
        raise ValueError(f"round_to: bits {list(bits.shape)} must have the values' shape {list(x.shape)}.")
    if dtype == torch.bfloat16:
        # bfloat16 is float32's upper half: adding 16 random bits below it carries into it with probability
        # (the dropped bits) / 2^16, exactly
        raw = x.view(torch.int32).to(torch.int64) & _MASK32
        up = ((raw + (bits >> 16)) >> 16) & 0xFFFF
        rounded = (up - ((up & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)
        return torch.where(torch.isfinite(x), rounded, x.to(torch.bfloat16))  # NaN's carry could reach the sign
    nearest = x.to(torch.float16)
    magnitude = x.abs()
    over = nearest.to(torch.float32).abs() > magnitude  # nearest rounded away from zero: step back
    low_bits = nearest.view(torch.int16) - over.to(torch.int16)  # sign-magnitude: -1 is one step toward zero
    low = low_bits.view(torch.float16)
    high = (low_bits + 1).view(torch.float16)  # one step away from zero (0 -> the smallest subnormal)
    gap = (high.to(torch.float64) - low.to(torch.float64)).abs()
    below = (x.to(torch.float64) - low.to(torch.float64)).abs()  # exact: x and low are float32 values
    u = bits.to(torch.float64) * 2.0**-32
    rounded = torch.where(u * gap < below, high, low)
    inf = torch.where(x > 0, float("inf"), float("-inf")).to(torch.float16)
    rounded = torch.where(magnitude > FLOAT16_MAX, inf, rounded)
    return torch.where(torch.isfinite(x), rounded, nearest)
