"""The checked small update of float32 tables (``et_update_backed_up``: an update no bound proves finite, FTRL's or
Momentum's, of at most a few thousand values) copies a block of rows at a time (up to 16 rows, at most 256 values)
into its backup and into a block of scratch, runs the optimizer once over the block and writes the block into
the rows. Whatever the width (8, 4 or 1 rows a block) and the thread count, every lookup and every stored weight
and slot keeps the torch reference's bits; an update refused in a late block leaves every row of every block
(and every table) as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import embtables as et
from embtables.kernels import native_library

pytestmark = pytest.mark.skipif(native_library.library() is None, reason="the native kernels are not built here")

V, B = 3000, 64  # about 63 distinct rows a step: 8 blocks of 8 rows at width 24, one a block at width 200
OPTIMIZERS = {
    "ftrl": lambda: et.FTRL(0.2, l1_regularization_strength=0.01),
    "momentum": lambda: et.Momentum(0.1, momentum=0.9),
    "rmsprop": lambda: et.RMSProp(0.01),
    "momentum-lr-1": lambda: et.Momentum(1.0, momentum=0.9),  # the refusal's: -3e38 - (0.9 m + 3e38) is -inf
}


def _module(opt: str, dim: int) -> Any:
    tables = [
        et.TableConfig(V, dim, name=f"t{t}", combiner="sum", initializer=et.TruncatedNormal(seed=1 + t))
        for t in range(2)
    ]
    return et.DistributedEmbedding(
        {f"f{t}": et.FeatureConfig(table) for t, table in enumerate(tables)}, OPTIMIZERS[opt](), concat_activations=True
    )


def _batch(step: int, dim: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(40 + step)
    ids = {f"f{t}": torch.randint(0, V, (B,), generator=g) for t in range(2)}
    return ids, torch.randn(B, 2 * dim, generator=g) * 0.5


def _train(opt: str, dim: int) -> list[torch.Tensor]:
    """Three steps: every step's activations, then the stored weights and slots."""
    emb = _module(opt, dim)
    seen = []
    for step in range(3):
        ids, grad = _batch(step, dim)
        seen.append(emb(ids).detach().clone())
        emb.apply_gradients(grad)
    return seen + [v.detach().clone() for v in emb.state_dict().values()]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim", [24, 60, 200], ids=["8-rows-a-block", "4-rows-a-block", "1-row-a-block"])
@pytest.mark.parametrize("opt", ["ftrl", "momentum", "rmsprop"])
def test_every_block_size_keeps_the_torch_references_bits(opt: str, dim: int, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native = _train(opt, dim)
        native_library.set_enabled(False)
        try:
            reference = _train(opt, dim)
        finally:
            native_library.set_enabled(True)
    finally:
        torch.set_num_threads(before)
    assert len(native) == len(reference)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(native, reference))


@pytest.mark.parametrize("dim", [24, 200])
@pytest.mark.parametrize("bad_bag", [B - 1, B // 2])
def test_an_update_refused_in_a_late_block_leaves_every_block_as_it_was(bad_bag: int, dim: int) -> None:
    emb = _module("momentum-lr-1", dim)
    ids, grad = _batch(0, dim)
    emb(ids)
    emb.apply_gradients(grad * 1e-3)  # accumulators that are not zero
    state = emb.state_dict()
    state["t1"] = torch.full_like(state["t1"], -3e38)
    emb.load_state_dict(state)
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    ids, _ = _batch(1, dim)
    ids["f1"] = torch.where(ids["f1"] == V - 1, V - 2, ids["f1"])
    ids["f1"][bad_bag] = V - 1  # a row of its own, among the last of the table's rows to be written
    acts = emb(ids)
    grad = torch.full_like(acts, 1e-3)
    grad[:, dim:] = -1e-3  # t1's other rows stay finite: -3e38 + 1e-3
    grad[bad_bag, dim:] = 3e38
    with pytest.raises(ValueError, match=rf"table 't1'.*row {V - 1}"):
        emb.apply_gradients(grad)
    after = emb.state_dict()
    assert all(torch.equal(before[k].view(torch.int32), after[k].view(torch.int32)) for k in before)
    emb.apply_gradients(torch.full_like(acts, 1e-3))
    assert emb._engine.local.backend.fast._small  # the fast path's checked small update served the steps
