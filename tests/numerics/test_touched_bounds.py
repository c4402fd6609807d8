"""The bounds the finiteness proof reads (``Workspace.touched_bounds``, ``et_touched_bounds`` in
``csrc/finite_bounds.c``): the largest |value| of the weights and each slot and the smallest value of each slot
(the weights' is not measured: -inf, no proof reads it) over exactly the rows the prepared update touches (every
row when dense), on one thread and on several, for widths that are and are not a multiple of the lanes, on each
path the library has (``native.bounds_path``: 8 lanes, and 16 where it is built with AVX-512, whose columns past
the last multiple of 16 are read with a mask). Compared with NumPy over the same rows; rows the update does not
touch hold values that would change either bound if they were read."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from embtables.kernels import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")


@pytest.fixture(params=[8, 16])
def lanes(request: pytest.FixtureRequest) -> Iterator[int]:
    """Each path of the bounds pass, forced for the test and restored after it."""
    before = native.bounds_path()
    assert before in (8, 16)
    if native.bounds_path(request.param) != before or native.bounds_path() != request.param:
        native.bounds_path(before)
        pytest.skip(f"the library has no {request.param}-lane bounds pass (built without AVX-512)")
    yield request.param
    native.bounds_path(before)


def _prepared(vocab: int, dim: int, touched: np.ndarray) -> native.Workspace:
    ws = native.Workspace(dim)
    assert ws.load(torch.from_numpy(touched), torch.ones(touched.size, dim), vocab) == 0
    return ws


@pytest.mark.parametrize("dim", [16, 13, 5, 64, 24, 33, 1])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dense", [False, True])
def test_bounds_are_the_touched_rows_largest_magnitude_and_smallest_value(
    dim: int, threads: int, dense: bool, lanes: int
) -> None:
    rng = np.random.default_rng(dim * 10 + threads)
    vocab = 12_000  # x 64 columns: past the size from which the pass splits over threads
    touched = rng.choice(vocab, size=5000, replace=False)
    others = np.setdiff1d(np.arange(vocab), touched)
    tensors = []
    for i in range(4):  # weights and three slots, each with its extremes in a random row and column
        x = rng.normal(size=(vocab, dim)).astype(np.float32) * (i + 1)
        r, c = rng.choice(touched), rng.integers(dim)
        x[r, c] = np.float32(-40.0 * (i + 1))  # the smallest value and the largest magnitude
        if not dense:  # a row the update does not touch: read, it would change both bounds
            x[rng.choice(others), rng.integers(dim)] = np.float32(-1e6)
        tensors.append(x)
    ws = _prepared(vocab, dim, touched)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        hi, lo = ws.touched_bounds(
            torch.from_numpy(tensors[0]), tuple(torch.from_numpy(x) for x in tensors[1:]), dense=dense
        )
    finally:
        torch.set_num_threads(before)
    rows = np.arange(vocab) if dense else touched
    assert hi == [float(np.abs(x[rows]).max()) for x in tensors]
    assert lo == [float("-inf")] + [float(x[rows].min()) for x in tensors[1:]]


@pytest.mark.parametrize("dim", [16, 13, 24, 40])
@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf])
def test_a_non_finite_touched_value_makes_its_bound_infinite(dim: int, bad: float, lanes: int) -> None:
    vocab = 50
    touched = np.array([3, 17, 41])
    weights, acc = np.ones((vocab, dim), np.float32), np.full((vocab, dim), 0.5, np.float32)
    acc[17, dim - 1] = bad  # in the last column: past the lanes when dim is not a multiple of them
    weights[5, 0] = np.inf  # untouched
    hi, lo = _prepared(vocab, dim, touched).touched_bounds(
        torch.from_numpy(weights), (torch.from_numpy(acc),), dense=False
    )
    assert hi == [1.0, float("inf")]
    assert lo[0] == float("-inf")
    assert not lo[1] > 0.5  # NaN, -inf or 0.5: never a bound a proof could use above the true one
    weights[41, 2] = bad  # the weights' own
    hi, _ = _prepared(vocab, dim, touched).touched_bounds(
        torch.from_numpy(weights), (torch.from_numpy(np.full((vocab, dim), 0.5, np.float32)),), dense=False
    )
    assert hi[0] == float("inf")


def test_an_update_of_no_rows_has_zero_bounds(lanes: int) -> None:
    ws = native.Workspace(8)
    assert ws.load(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 8), 10) == 0
    hi, lo = ws.touched_bounds(torch.ones(10, 8), (torch.ones(10, 8),), dense=False)
    assert hi == [0.0, 0.0] and lo == [0.0, 0.0]


@pytest.mark.parametrize("dim", [5, 13, 24, 33])
def test_a_positive_slots_smallest_value_is_its_own_not_a_lane_past_the_row(dim: int, lanes: int) -> None:
    """Accumulators are positive, and a proof needs their smallest value above zero: the lanes past the last
    column (read as 0 by a masked read) must not take part."""
    rng = np.random.default_rng(dim)
    vocab = 64
    touched = np.array([2, 9, 30, 63])
    weights = rng.normal(size=(vocab, dim)).astype(np.float32)
    acc = rng.uniform(0.25, 2.0, size=(vocab, dim)).astype(np.float32)
    negative = -rng.uniform(0.25, 2.0, size=(vocab, dim)).astype(np.float32)
    hi, lo = _prepared(vocab, dim, touched).touched_bounds(
        torch.from_numpy(weights), (torch.from_numpy(acc), torch.from_numpy(negative)), dense=False
    )
    assert lo[1] == float(acc[touched].min()) > 0
    assert hi[1] == float(acc[touched].max())
    assert lo[2] == float(negative[touched].min()) and hi[2] == float(np.abs(negative[touched]).max())
