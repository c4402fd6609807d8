"""float16 rows are widened to float32 eight values at a time (``et_f16_widen8`` in ``csrc/half_tables.c``: the
exponent rebased, subnormals by an exact subtraction) wherever the C kernels read them: the lookups of one id a
bag, the pooled lookups and the half update. Every one of float16's 65,536 patterns must come out as torch's
conversion gives it, bit for bit, in the vector loop and in a row's tail; every infinity and NaN must be seen as
not finite."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import embtables as et
from embtables.kernels import native, native_half

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the native library (a C compiler)")


def _patterns(finite: bool) -> Tensor:
    """Every float16 pattern that is finite (63,488 of them, zeros of both signs and subnormals included), or
    every infinity and NaN (2,048)."""
    h = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return h[torch.isfinite(h) == finite]


def _rows(dim: int) -> Tensor:
    """The finite patterns as a [V, dim] float16 table, the last row padded with ones."""
    h = _patterns(True)
    pad = (-h.numel()) % dim
    return torch.cat([h, torch.ones(pad, dtype=torch.float16)]).reshape(-1, dim)


def _bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.int32)


@pytest.mark.parametrize("dim", [8, 13])  # 13: a vector of 8 and a tail of 5 a row
def test_lookups_widen_every_finite_pattern_as_torch(dim: int) -> None:
    table = _rows(dim)
    v = table.shape[0]
    ids = torch.arange(v)
    (one,), status = native_half.lookup_half_many([(table, ids, torch.arange(v + 1), None)])
    assert status == 0
    assert torch.equal(_bits(one), _bits(table.float() + 0.0))  # one id a bag: 0 + the row (-0 comes back +0)
    pairs = torch.stack([ids, ids.roll(1)], 1).reshape(-1)  # bags of two ids, coefficients of 1: the general loop
    (two,), status = native_half.lookup_half_many([(table, pairs, torch.arange(0, 2 * v + 1, 2), torch.ones(2 * v))])
    assert status == 0
    assert torch.equal(_bits(two), _bits((0.0 + table.float()) + table.float().roll(1, 0)))


@pytest.mark.parametrize("pooled", [False, True])
def test_every_infinity_and_nan_is_not_finite_in_either_lookup(pooled: bool) -> None:
    for k, p in enumerate(_patterns(False)):
        table = torch.ones(2, 13, dtype=torch.float16)
        table[1, k % 13] = p  # in the vector loop or the tail
        ids = torch.tensor([1, 0]) if pooled else torch.tensor([1])
        coeffs = torch.ones(2) if pooled else None
        _, status = native_half.lookup_half_many([(table, ids, torch.tensor([0, ids.numel()]), coeffs)])
        assert status == 2, (k, p)


@pytest.mark.parametrize("dim", [8, 13])
def test_the_update_reads_every_finite_pattern_as_torch(dim: int) -> None:
    """SGD with a zero gradient writes (w - 0 * w) - 1 * 0 = w, but for -0, which the weight-decay term's
    subtraction makes +0: the rows widened and rounded back (stochastically: no dropped bits, so no carry) must
    be the stored patterns, every other one."""
    table = _rows(dim)
    v = table.shape[0]
    stored = table.clone()
    ws = native.Workspace(dim)
    ids = torch.arange(v)
    assert native.prepare_many([(ws, v, [(ids, torch.arange(v + 1), None, torch.zeros(v, dim))])]) == [0]
    params = native.opt_params(et.SGD(1.0), 1.0, 0.0, clip_gradients=False)
    update = native_half.HalfUpdate(ws, table, (), params, None, (5, 1, 0, True))
    assert update.apply_in_place() == -1
    want = stored.view(torch.int16).clone()
    want[want == -32768] = 0  # -0 - 0 * -0 is +0
    assert torch.equal(table.view(torch.int16), want)
