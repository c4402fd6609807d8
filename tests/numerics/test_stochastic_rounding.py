"""Stochastic rounding to half types (``kernels/stochastic_rounding.py``, docs/spec.md §12) against the NumPy
oracle (``tests/oracle/np_rounding.py``): the same random bits of (seed, step, table, row, column), the same
rounded values bit for bit; unbiased (the mean over many draws is the value) and only ever one of the two
neighbouring half values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle import np_rounding

from embtables.kernels import stochastic_rounding as sr

KINDS = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _values(gen: torch.Generator) -> torch.Tensor:
    """Normal values of many magnitudes, float32 subnormals, values below float16's smallest subnormal,
    exact half values, zeros of both signs and float16's largest values."""
    parts = [
        torch.randn(200, generator=gen) * torch.pow(10.0, torch.randint(-6, 5, (200,), generator=gen).float()),
        torch.tensor([1e-39, -3e-40, 1e-45, 2e-8, -5e-9, 1.0, -0.5, 0.0, -0.0, 65504.0, -65503.0, 3.0e-5]),
    ]
    return torch.cat(parts).to(torch.float32)


def test_the_random_bits_are_the_oracles_and_depend_only_on_seed_step_table_row_column() -> None:
    rows = torch.tensor([0, 7, 2**40 + 3, 5, 7])
    got = sr.random_bits(1234, 99, 3, rows, 6)
    want = np_rounding.random_bits(1234, 99, 3, rows.numpy(), 6)
    assert np.array_equal(got.numpy().astype(np.uint64), want)
    assert torch.equal(got[1], got[4])  # the same row, wherever it is in the update
    assert not torch.equal(got, sr.random_bits(1234, 100, 3, rows, 6))  # another step
    assert not torch.equal(got, sr.random_bits(1234, 99, 4, rows, 6))  # another table
    assert not torch.equal(got, sr.random_bits(1235, 99, 3, rows, 6))  # another seed
    assert int(got.min()) >= 0 and int(got.max()) < 2**32


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_rounding_is_the_oracles_bit_for_bit(kind: str) -> None:
    gen = torch.Generator().manual_seed(5)
    x = _values(gen)
    bits = sr.random_bits(7, 3, 1, torch.arange(x.numel()), 1)[:, 0]
    got = sr.round_to(x, KINDS[kind], bits).to(torch.float64)
    for value, b, g in zip(x.tolist(), bits.tolist(), got.tolist()):
        want = np_rounding.stochastic_round(value, kind, b)
        assert g == want or (np.isnan(g) and np.isnan(want)), (kind, value, b, g, want)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_rounding_is_unbiased_and_lands_on_a_neighbour(kind: str) -> None:
    """Over 4000 draws (steps) of every value: each result is one of the two neighbouring half values, and the
    mean is the value within 5 standard errors of the draw."""
    gen = torch.Generator().manual_seed(9)
    x = _values(gen)[:60]
    x = x[(x.abs() < 6e4) & (x != 0)]
    draws = torch.stack([sr.round_to(x, KINDS[kind], sr.random_bits(11, step, 0, torch.arange(x.numel()), 1)[:, 0])
                         for step in range(4000)]).to(torch.float64)  # fmt: skip
    for i, value in enumerate(x.tolist()):
        low, high = np_rounding.neighbours(value, kind)
        column = draws[:, i]
        assert bool(((column == low) | (column == high)).all()), (value, low, high)
        if low == high:
            continue
        p = (abs(value) - abs(low)) / abs(high - low)
        se = abs(high - low) * (p * (1 - p) / len(column)) ** 0.5
        assert abs(float(column.mean()) - value) <= 5 * se + 1e-300, (value, float(column.mean()), se)


def test_nearest_is_the_types_conversion_and_float16_overflow_is_infinite() -> None:
    x = torch.tensor([1.0001, -3.14159, 65504.0, 65505.0, -7e4, float("nan"), float("inf")])
    for dtype in (torch.bfloat16, torch.float16):
        near = sr.round_to(x, dtype, None)
        assert torch.allclose(near.float(), x.to(dtype).float(), equal_nan=True)
    bits = torch.full(x.shape, 2**31, dtype=torch.int64)
    half = sr.round_to(x, torch.float16, bits).float()
    assert half[2] == 65504.0 and half[3] == float("inf") and half[4] == float("-inf")
    assert bool(torch.isnan(half[5])) and half[6] == float("inf")
    b16 = sr.round_to(x, torch.bfloat16, bits).float()
    assert bool(torch.isnan(b16[5])) and b16[6] == float("inf")
    with pytest.raises(TypeError, match="half type"):
        sr.round_to(x, torch.float32, bits)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_c_kernels_round_as_the_torch_reference_bit_for_bit(kind: str) -> None:
    """``native.round_rows`` (``et_round_rows``: the hash and the rules in C, for the native update of half
    tables) gives ``round_to(random_bits(...))``'s bits, NaN and infinities included."""
    from embtables.kernels import native

    gen = torch.Generator().manual_seed(13)
    x = torch.cat([_values(gen), torch.tensor([float("nan"), float("inf"), -float("inf"), 7e4, -65505.0])])
    x = x[: (x.numel() // 4) * 4].reshape(-1, 4).contiguous()
    rows = torch.randint(0, 2**40, (x.shape[0],), generator=gen)
    got = native.round_rows(x, rows, 99, 2**33 + 5, 6, KINDS[kind])
    if got is None:
        pytest.skip("the native library is not built")
    want = sr.round_to(x, KINDS[kind], sr.random_bits(99, 2**33 + 5, 6, rows, 4))
    finite = torch.isfinite(want.float())
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(torch.isnan(got.float()), torch.isnan(want.float()))
    assert torch.equal(got.float()[torch.isinf(want.float())], want.float()[torch.isinf(want.float())])
