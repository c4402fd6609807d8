"""Phase 1's two dedups (``csrc/embtables_native.c``): small tables (at most 65,536 rows, or 4x the step's ids)
find each id's unique row through a direct map [V], the others through a hash of the step's ids. Both give
the same unique rows in first-occurrence order and the same sums, so training is bit for bit the same
through either, also on a table whose steps alternate between them (the map is cleared between steps),
for a non-lazy optimizer, whose dense update looks every row up, and when an update covering a quarter of
the table or more goes through its rows in row order (the map scanned) instead of first-occurrence order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from statecheck import assert_same, snapshot

import embtables as et
from embtables.kernels import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")

AUTO, HASH, DIRECT = 0, 1, 2


def _mode(mode: int) -> Iterator[None]:
    lib = native.library()
    assert lib is not None
    lib.et_set_dedup_mode(mode)
    try:
        yield
    finally:
        lib.et_set_dedup_mode(AUTO)


def _train(mode: int, optimizer: Any, vocab: int, sizes: list[int]) -> dict[str, torch.Tensor]:
    tables = [et.TableConfig(vocab, 5, initializer=et.Constant(0.1), combiner=c, name=f"t{c}") for c in ("sum", "mean")]
    emb = et.DistributedEmbedding({f"f{i}": et.FeatureConfig(t) for i, t in enumerate(tables)}, optimizer)
    rng = np.random.default_rng(0)
    for n in sizes:  # ids per feature this step: few (the hash when automatic) or many (the direct map)
        feats = {}
        for i in range(2):
            lengths = torch.from_numpy(rng.integers(0, 4, n))
            ids = torch.from_numpy(rng.integers(0, min(vocab, 3 * n + 7), int(lengths.sum())))
            feats[f"f{i}"] = et.Ragged.from_lengths(ids, lengths)
        for _ in _mode(mode):
            acts = emb(feats)
            sum(
                ((i + 1) * a * torch.linspace(-1, 1, a.numel()).reshape(a.shape)).sum()
                for i, a in enumerate(acts.values())
            ).backward()
            emb.apply_gradients()
    return snapshot(emb)


@pytest.mark.parametrize(
    "optimizer",
    [et.Adagrad(0.3), et.Adam(0.05, lazy_adam=False), et.FTRL(0.2), et.SGD(0.5)],
    ids=["adagrad", "adam-dense", "ftrl", "sgd"],
)
@pytest.mark.parametrize("vocab", [300, 5000, 100_000])
def test_direct_map_and_hash_train_the_same_bits(optimizer: Any, vocab: int) -> None:
    # 300: small updates (checked in place); 5000: most of the table each step (updated in row order through
    # the map); 100,000: steps that switch between the hash (few ids) and the map (many) when automatic
    sizes = {300: [5, 200, 3, 90, 8], 5000: [20_000, 9000, 3, 12_000], 100_000: [5, 40_000, 3, 30_000, 8]}[vocab]
    runs = {mode: _train(mode, optimizer, vocab, sizes) for mode in (HASH, DIRECT, AUTO)}
    for mode in (DIRECT, AUTO):
        assert_same(runs[HASH], runs[mode])
    assert any(not torch.equal(v, torch.full_like(v, 0.1)) for v in runs[AUTO].values())  # it trained


def test_a_refused_id_leaves_the_direct_map_clean_for_the_next_step() -> None:
    """An id outside [0, V) stops phase 1 midway, with some rows already in the map (the engine's staging
    refuses such ids first; phase 1 checks them again): the next phase 1 on the same workspace must not see
    them. The unique rows come in first-occurrence order, with their float32 sums."""
    grad = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 4.0]])
    good = (torch.tensor([9, 3, 9, 7]), torch.tensor([0, 2, 4]), None, grad)
    fresh = native.Workspace(3)
    assert native.prepare_many([(fresh, 50, [good])]) == [0]
    used = native.Workspace(3)
    for mode in (AUTO, DIRECT, HASH):
        for _ in _mode(mode):
            bad = (torch.tensor([7, 9, 12, 50]), torch.tensor([0, 2, 4]), None, grad)
            assert native.prepare_many([(used, 50, [bad])]) == [3]
            assert native.prepare_many([(used, 50, [good])]) == [0]
        for got, want in zip(used.rows_and_grads(), fresh.rows_and_grads()):
            assert torch.equal(got, want), mode
    rows, sums = fresh.rows_and_grads()
    assert rows.tolist() == [9, 3, 7]
    assert sums.tolist() == [[0.0, 2.5, 7.0], [1.0, 2.0, 3.0], [-1.0, 0.5, 4.0]]  # bags [9, 3] and [9, 7]
