"""The half update's refusal (``et_apply_half``, modes 0 and 2): the rows OR their "not finite" bits into lanes
as they are rounded and written, and only when a lane is set are the written rows read back for the largest row
whose update is not finite, over the same rows per thread. Whatever the storage types, the thread count, the
tensor that overflows and where its rows lie among the threads' chunks, the answer is that largest row, and a
finite update reports -1."""

from __future__ import annotations

import pytest
import torch

import embtables as et
from embtables.kernels import native, native_half

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the native library (a C compiler)")

V, D, N = 900, 13, 600  # 600 prepared rows: two threads take chunks of 256 rows each, the first also the last 88
KINDS = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
         (torch.float16, torch.float32)]  # fmt: skip


def _huge(opt: str, weights: torch.dtype, slots: torch.dtype) -> float:
    """A gradient whose update is not finite in the stored type: SGD's weights (lr 10) or Adagrad's g^2 slot."""
    if opt == "sgd":
        return -1e5 if weights == torch.float16 else -3e38
    return 1e3 if slots == torch.float16 else 1e20


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
@pytest.mark.parametrize(("weights", "slots"), KINDS)
@pytest.mark.parametrize("bad_at", [(), (10,), (300,), (550,), (10, 300, 550), (599, 0)])
def test_the_largest_row_whose_update_is_not_finite_is_found(
    bad_at: tuple[int, ...], weights: torch.dtype, slots: torch.dtype, opt: str, in_place: bool, threads: int
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(len(bad_at) + 7 * threads)
        ids = torch.randperm(V, generator=g)[:N]  # prepared in this order: row u is ids[u]
        grads = torch.full((N, D), 0.01)
        for u in bad_at:
            grads[u, (u * 5) % D] = _huge(opt, weights, slots)  # one column, anywhere in the row
        table = torch.full((V, D), 0.5).to(weights)
        state = () if opt == "sgd" else (torch.full((V, D), 0.1).to(slots),)
        stored = [table.clone(), *(s.clone() for s in state)]
        ws = native.Workspace(D)
        assert native.prepare_many([(ws, V, [(ids, torch.arange(N + 1), None, grads)])]) == [0]
        optimizer = et.SGD(10.0) if opt == "sgd" else et.Adagrad(0.1)
        params = native.opt_params(optimizer, optimizer.learning_rate, 0.0, clip_gradients=False)
        update = native_half.HalfUpdate(ws, table, state, params, None, (5, 1, 0, True))
        bad = update.apply_in_place() if in_place else update.compute()
        assert bad == (max(int(ids[u]) for u in bad_at) if bad_at else -1)
        if in_place and bad >= 0:
            update.put_back()
        if bad >= 0 or not in_place:  # refused and put back, or only computed: nothing changed
            assert all(torch.equal(a, b) for a, b in zip(stored, [table, *state]))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("vector", [True, False], ids=["vector", "scalar"])
@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_finite_value_whose_rounding_carries_past_the_largest_bfloat16_is_refused(
    in_place: bool, stochastic: bool, vector: bool
) -> None:
    """float32's largest value is finite, but its dropped 16 bits (0xffff) carry it past bfloat16's largest
    (0x7f7f) into the infinity, to nearest and stochastically alike (but for one draw of 2^16): the rounding's own
    overflow, which no float32 check of the update sees, refuses the update with nothing changed."""
    before = native.rounding_path()
    native.rounding_path(vector)
    try:
        ids = torch.arange(40) * 3  # 40 rows, 16 columns: two whole vectors of 8 a row
        grads = torch.full((40, 16), 0.01)
        largest = torch.tensor([0x7F7FFFFF], dtype=torch.int32).view(torch.float32).item()
        grads[29, 11] = -largest  # SGD, lr 1: 0.5 - g rounds to float32's largest value
        table = torch.full((120, 16), 0.5).to(torch.bfloat16)
        stored = table.clone()
        ws = native.Workspace(16)
        assert native.prepare_many([(ws, 120, [(ids, torch.arange(41), None, grads)])]) == [0]
        params = native.opt_params(et.SGD(1.0), 1.0, 0.0, clip_gradients=False)
        update = native_half.HalfUpdate(ws, table, (), params, None, (5, 1, 0, stochastic))
        bad = update.apply_in_place() if in_place else update.compute()
        assert bad == 87
        if in_place:
            update.put_back()
        assert torch.equal(table.view(torch.int16), stored.view(torch.int16))
    finally:
        native.rounding_path(before)
