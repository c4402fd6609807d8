"""The native split of bags by owner rank (owner pooling's plan step) against the torch path, and its
checks. One process: the split itself sends nothing."""

from __future__ import annotations

import pytest
import torch

from embtables.kernels import native, native_inputs
from embtables.sharding.owner_pooling import _split_in_torch
from embtables.sharding.plan import TablePlan
from embtables.tables.inputs import FeatureBatch


def _batch(vocab: int, bags: int, gen: torch.Generator, weighted: bool) -> FeatureBatch:
    lengths = torch.randint(0, 6, (bags,), generator=gen)
    offsets = torch.zeros(bags + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    ids = torch.randint(0, vocab, (int(offsets[-1]),), generator=gen)
    coeffs = torch.rand(ids.numel(), generator=gen) if weighted else None
    return FeatureBatch(ids=ids, offsets=offsets, coeffs=coeffs, out_shape=(bags,))


@pytest.mark.parametrize("strategy", ["div", "mod"])
# Uneven blocks, V < W (ranks without rows), powers of two (mod by mask) and larger worlds (the binary
# search over the ranks' first rows).
@pytest.mark.parametrize(
    ("vocab", "world"), [(1000, 2), (1001, 2), (1, 2), (1001, 3), (2, 3), (7, 4), (1003, 8), (10, 16), (99, 7)]
)
@pytest.mark.parametrize("weighted", [False, True])
def test_native_split_equals_the_torch_split(strategy: str, vocab: int, world: int, weighted: bool) -> None:
    gen = torch.Generator().manual_seed(vocab * world)
    batches = [_batch(vocab, 50, gen, weighted) for _ in range(3)]
    plan = TablePlan(strategy, vocab, world, 0)
    parts = [(b.ids, b.offsets, b.coeffs, strategy, vocab) for b in batches]
    got = native_inputs.split_by_owner(parts, world)
    assert got is not None
    for b, (local, coeffs, offsets, counts) in zip(batches, got):
        expected, n_per = _split_in_torch(b, plan, torch.device("cpu"), world)
        assert counts == n_per
        start = 0
        for r, (ids_r, offsets_r, coeffs_r) in enumerate(expected):
            assert torch.equal(local[start : start + counts[r]], ids_r)
            assert torch.equal(offsets[r], offsets_r)
            if weighted:
                assert coeffs is not None and coeffs_r is not None
                assert torch.equal(coeffs[start : start + counts[r]], coeffs_r)
            else:  # unweighted: no coefficients are written or sent (all 1)
                assert coeffs is None and coeffs_r is None
            start += counts[r]


def test_an_id_outside_the_table_or_bad_offsets_is_refused_in_c() -> None:
    offsets = torch.tensor([0, 2], dtype=torch.int64)
    with pytest.raises(native.NativeBufferError, match="outside"):
        native_inputs.split_by_owner([(torch.tensor([0, 10]), offsets, None, "div", 10)], 2)
    with pytest.raises(native.NativeBufferError, match="bad offsets"):
        native_inputs.split_by_owner([(torch.tensor([0, 1]), torch.tensor([0, 3]), None, "div", 10)], 2)
    with pytest.raises(native.NativeBufferError):
        native_inputs.split_by_owner([(torch.tensor([0, 1], dtype=torch.int32), offsets, None, "div", 10)], 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_finds_one_bad_value_anywhere(bad: float) -> None:
    tensors = [torch.randn(7, 3), torch.randn(0), torch.randn(1000)]
    assert native.all_finite(tensors)
    tensors[2][999] = bad
    assert not native.all_finite(tensors)
    assert not native.all_finite([tensors[2].view(10, 100).t()])  # a non-contiguous view takes the torch path
    assert native.all_finite([torch.full((4,), 3.4e38), torch.tensor([-0.0, 1e-45])])
