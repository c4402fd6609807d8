"""An optimizer kind the native kernels do not know is an error, in Python and in C (issue 20): before,
the C dispatch ended in ``default: return et_row_ftrl`` and would have run FTRL."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import embtables as et
from embtables.kernels import native


def _prepared(dim: int = 3) -> native.Workspace:
    ws = native.Workspace(dim)
    assert ws.load(torch.tensor([1, 4]), torch.ones(2, dim), 6) == 0
    return ws


def test_python_refuses_an_optimizer_without_a_native_kernel() -> None:
    @dataclasses.dataclass(frozen=True)
    class MyAdagrad(et.Adagrad):
        pass

    with pytest.raises(native.NativeBufferError, match="no native kernel for MyAdagrad"):
        native.opt_params(MyAdagrad(0.1), 0.1, 0.0, clip_gradients=True)


@pytest.mark.skipif(native.library() is None, reason="needs the native kernels (a C compiler)")
def test_c_refuses_an_unknown_kind_and_writes_nothing() -> None:
    weights, acc = torch.ones(6, 3), torch.full((6, 3), 0.1)
    before = (weights.clone(), acc.clone())
    params = native.opt_params(et.Adagrad(0.1), 0.1, 0.0, clip_gradients=True)
    params.kind = 99
    ws = _prepared()
    with pytest.raises(native.NativeBufferError, match="unknown optimizer kind"):
        ws.apply(weights, (acc,), params, dense=False)
    with pytest.raises(native.NativeBufferError, match="unknown optimizer kind"):
        ws.check(weights, (acc,), params, dense=False)
    good = native.opt_params(et.Adagrad(0.1), 0.1, 0.0, clip_gradients=True)
    other = _prepared()
    w2, a2 = torch.ones(6, 3), torch.full((6, 3), 0.1)
    with pytest.raises(native.NativeBufferError, match="unknown optimizer kind"):
        native.apply_many(
            [(other, w2, (a2,), good, False, False, False), (ws, weights, (acc,), params, False, False, False)]
        )
    assert torch.equal(w2, torch.ones(6, 3))  # the good table was not written either: all checked first
    with pytest.raises(native.NativeBufferError, match="unknown optimizer kind"):
        native.apply_sequential(torch.tensor([1]), torch.ones(1, 3), weights, (acc,), params)
    assert torch.equal(weights, before[0]) and torch.equal(acc, before[1])
