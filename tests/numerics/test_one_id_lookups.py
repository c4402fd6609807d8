"""Lookups whose bags hold one id each (``et_one_id_bags``: offsets ``base, base + 1, ..., base + S``) and no
coefficients take a loop of their own in ``et_lookup_many`` and ``et_lookup_half_many``: each output row is
``0 + W[id]`` read straight from the feature's ids, its non-finite lanes taken from the registers it stores. It
must give the bits the general bag loop gives (the same bags with coefficients of 1 take that loop), in every
width, output layout, storage type and thread count, with offsets that start past 0, bad ids, non-finite rows,
negative zeros and subnormals; offsets that merely add up to one id a bag (an empty bag beside a bag of two)
must not take it."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from embtables.kernels import native, native_half

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the native library (a C compiler)")

CASES = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.float16, False)]
WIDTHS = [1, 5, 8, 13, 24, 64, 67]


def _threads(n: int) -> int:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def _look(parts: list[tuple[Tensor, Tensor, Tensor, Tensor | None]], dtype: torch.dtype, shared: bool):
    """The activations of every part and the status; ``shared``: column blocks of one wider output."""
    if dtype != torch.float32:
        return native_half.lookup_half_many(parts)
    if shared:
        rows = parts[0][2].numel() - 1
        starts, at = [], 2
        for table, *_ in parts:
            starts.append(at)
            at += table.shape[1] + 1  # a gap column between blocks: ld > D
        out = torch.full((rows, at + 1), 7.0)
        outs, status = native.lookup_many(parts, (out, starts))
        return [outs[0][:, s : s + t.shape[1]].clone() for s, (t, *_) in zip(starts, parts)], status
    return native.lookup_many(parts)


def _table(rows: int, dim: int, dtype: torch.dtype, seed: int) -> Tensor:
    """Random rows with a negative zero, the smallest subnormal of both signs and a large value planted."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, dim, generator=g) * 3
    t[0, 0] = -0.0
    t[1, dim - 1] = -0.0
    tiny = torch.finfo(dtype).smallest_normal / 4 if dtype != torch.float32 else 1e-40
    t[2, 0] = tiny
    t[2, dim - 1] = -tiny
    t[3, dim // 2] = 6e4 if dtype == torch.float16 else 1e30
    return t.to(dtype)


def _bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.int32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("dtype", "shared"), CASES)
@pytest.mark.parametrize("dim", WIDTHS)
def test_one_id_bags_give_the_general_loops_bits(dim: int, dtype: torch.dtype, shared: bool, threads: int) -> None:
    before = _threads(threads)
    try:
        g = torch.Generator().manual_seed(100 + dim)
        table = _table(40, dim, dtype, dim)
        other = _table(9, 3, dtype, dim + 1)
        bags = 300  # past ET_LOOKUP_PF and past one thread's chunk
        ids = torch.randint(0, 40, (bags + 3,), generator=g)
        ids[3:8] = torch.tensor([0, 1, 2, 3, 0])  # the planted rows, early
        other_ids = torch.randint(0, 9, (bags,), generator=g)
        offsets = torch.arange(3, bags + 4)  # one id a bag, from id 3 on: the first three ids are never read
        parts = [(other, other_ids, torch.arange(bags + 1), None), (table, ids, offsets, None)]
        ones = [(t, i, o, torch.ones(i.numel())) for t, i, o, _ in parts]  # the same bags, the general loop

        acts, status = _look(parts, dtype, shared)
        general, general_status = _look(ones, dtype, shared)
        assert status == general_status == 0
        for a, b in zip(acts, general):
            assert torch.equal(_bits(a), _bits(b))
        # 0 + the row read as float32: a negative zero comes back +0; subnormals as the general loop leaves them
        expected = table.float()[ids[3:]] + 0.0
        normal = expected.abs() >= torch.finfo(torch.float32).smallest_normal
        assert torch.equal(_bits(acts[1])[normal | (expected == 0)], _bits(expected)[normal | (expected == 0)])
        assert not torch.signbit(acts[1][expected == 0]).any()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("dtype", "shared"), CASES)
@pytest.mark.parametrize("dim", WIDTHS)
def test_one_id_bags_flag_every_non_finite_column_and_bad_id(
    dim: int, dtype: torch.dtype, shared: bool, threads: int
) -> None:
    before = _threads(threads)
    try:
        table = _table(6, dim, dtype, dim)
        ids = torch.tensor([0, 3, 5, 1, 2])
        parts = [(table, ids, torch.arange(6), None)]
        assert _look(parts, dtype, shared)[1] == 0
        for value in (float("inf"), float("-inf"), float("nan")):
            for d in range(dim):
                kept = table[5, d].item()
                table[5, d] = value
                assert _look(parts, dtype, shared)[1] == 2, (value, d)
                table[5, d] = kept
        for bad in (6, -1, 2**40):
            wrong = ids.clone()
            wrong[3] = bad
            assert _look([(table, wrong, torch.arange(6), None)], dtype, shared)[1] == 1, bad
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dim", [13, 67])
@pytest.mark.parametrize(("dtype", "shared"), CASES)
def test_offsets_that_only_add_up_to_one_id_a_bag_take_the_general_loop(
    dtype: torch.dtype, shared: bool, dim: int
) -> None:
    table = _table(8, dim, dtype, 3)
    table[0] = -0.0  # a bag of negative zeros sums to +0, as 0 + row does
    ids = torch.tensor([4, 5, 6, 7, 0, 0])
    offsets = torch.tensor([0, 0, 2, 3, 4, 6])  # bags [], [4, 5], [6], [7], [0, 0]: not one id each
    acts, status = _look([(table, ids, offsets, None)], dtype, shared)
    assert status == 0
    rows = table.float()
    zeros = torch.zeros(dim)
    expected = torch.stack([zeros, rows[4] + rows[5], rows[6] + 0.0, rows[7] + 0.0, zeros])
    assert torch.equal(_bits(acts[0]), _bits(expected))
