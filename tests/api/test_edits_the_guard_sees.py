"""A legal call never writes NaN/Inf, whatever a user legally did to a tensor the module handed out.

The finiteness proof reads bounds measured over the rows each update touches, in the step that writes
(``tables/value_bounds.py``), so every way of changing a table or slot is seen: an in-place torch edit,
``tensor.data`` (which does not move torch's version counter), a NumPy view, ``load_state_dict``,
``restore``, and any of them between a pipelined observer's flush and the next training lookup. Each case
here wrote NaN or Inf into the table before; now the step is refused and nothing changes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from statecheck import assert_same, snapshot

import embtables as et

# (rows in the table, dim, ids per step): the path a step takes
PATHS = {
    "fast": (50, 4, 6),  # int64 ids, a small update: the small-batch fast path (one native call per phase)
    "general-small": (50, 4, 6),  # int32 ids: the general path, checked exactly in the writing call
    "general-proof": (6000, 16, 5000),  # an update too large to check cheaply: proven from bounds
}


def _module(path: str, optimizer: Any, pipelined: bool = False) -> et.DistributedEmbedding:
    rows, dim, _ = PATHS[path]
    table = et.TableConfig(rows, dim, name="t", initializer=et.Constant(0.5), combiner="sum")
    return et.DistributedEmbedding(
        {"f": et.FeatureConfig(table)}, optimizer, pipeline_execution_with_tensor_core=pipelined
    )


def _ids(path: str) -> torch.Tensor:
    rows, _, n = PATHS[path]
    ids = torch.arange(n) % rows
    return ids.to(torch.int32) if path == "general-small" else ids


def _step(emb: et.DistributedEmbedding, path: str, grad_value: float) -> None:
    acts = emb({"f": _ids(path)})["f"]
    emb.apply_gradients({"f": torch.full_like(acts, grad_value)})


def _zero(t: torch.Tensor, how: str) -> None:
    if how == "in-place":
        t.zero_()
    elif how == "data":
        t.data.zero_()
    elif how == "numpy":
        t.numpy()[:] = 0.0
    else:
        raise AssertionError(how)


def _edit_accumulators(emb: et.DistributedEmbedding, how: str) -> None:
    """Set every Adagrad accumulator of table t to 0 (a zero gradient then divides 0 by 0). ``load_state_dict``
    refuses accumulators below 2^-126 outright (``restore`` loads a checkpoint's values as saved); the writes
    below are the ones it cannot refuse."""
    if how == "state_dict-view":
        _zero(emb.state_dict()["t/accumulators"].data, "data")
    else:
        _zero(emb.slot_variables["t"]["accumulators"], how)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("how", ["in-place", "data", "numpy", "state_dict-view"])
def test_zeroed_accumulators_are_seen_however_they_were_written(path: str, how: str) -> None:
    emb = _module(path, et.Adagrad(0.1, initial_accumulator_value=0.1))
    for _ in range(3):  # bounds from these steps (min accumulator > 0) would prove the next update finite
        _step(emb, path, 1.0)
    _edit_accumulators(emb, how)
    before = snapshot(emb)
    with pytest.raises(ValueError, match=r"table 't'.*non-finite"):
        _step(emb, path, 0.0)
    assert_same(snapshot(emb), before)
    # a legal update of the same state still trains
    _step(emb, path, 1.0)
    assert all(bool(torch.isfinite(v).all()) for v in emb.state_dict().values())


def _adam_state_that_overflows(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adam momenta of 3e38 over velocities of 0: legal values (finite, velocities >= 0) whose next update
    divides 3e38 by epsilon."""
    return {**state, "t/momenta": torch.full_like(state["t/momenta"], 3e38),
            "t/velocities": torch.zeros_like(state["t/velocities"])}  # fmt: skip


def _edit_adam(emb: et.DistributedEmbedding, how: str, tmp: Path, path: str, pipelined: bool = False) -> None:
    slots = emb.slot_variables["t"]
    if how == "in-place":
        slots["momenta"].fill_(3e38)
        slots["velocities"].zero_()
    elif how == "data":
        slots["momenta"].data.fill_(3e38)
        slots["velocities"].data.zero_()
    elif how == "numpy":
        slots["momenta"].numpy()[:] = 3e38
        slots["velocities"].numpy()[:] = 0.0
    elif how == "load_state_dict":
        emb.load_state_dict(_adam_state_that_overflows(emb.state_dict()))
    elif how == "restore":
        other = _module(path, et.Adam(0.5), pipelined=pipelined)
        other.load_state_dict(_adam_state_that_overflows({k: v.clone() for k, v in emb.state_dict().items()}))
        emb.restore(other.save(tmp / "ckpts"))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("how", ["in-place", "data", "numpy", "load_state_dict", "restore"])
def test_adam_slots_that_overflow_are_seen_however_they_were_written(path: str, how: str, tmp_path: Path) -> None:
    emb = _module(path, et.Adam(0.5))
    for _ in range(2):
        _step(emb, path, 1.0)
    _edit_adam(emb, how, tmp_path, path)
    before = snapshot(emb)
    with pytest.raises(ValueError, match=r"table 't'.*non-finite"):
        _step(emb, path, 1.0)
    assert_same(snapshot(emb), before)


@pytest.mark.parametrize("observe", ["slot_variables", "embedding_tables", "state_dict"])
@pytest.mark.parametrize("how", ["in-place", "data", "restore"])
@pytest.mark.parametrize("path", ["general-small", "general-proof"])
def test_pipelined_edits_after_an_observer_are_seen(observe: str, how: str, path: str, tmp_path: Path) -> None:
    """Pipelined: an observer applies the held-back update and keeps the pre-update rows for the next training
    lookup, which swaps them in and out; an edit made after the observer (Adam momenta 3e38 over velocities 0,
    in place, through ``.data`` or by ``restore``) must be seen by the next update's proof."""
    emb = _module(path, et.Adam(0.5), pipelined=True)
    for _ in range(3):
        _step(emb, path, 1.0)
    observers: dict[str, Callable[[], Any]] = {
        "slot_variables": lambda: emb.slot_variables,
        "embedding_tables": lambda: emb.embedding_tables,
        "state_dict": emb.state_dict,
    }
    observers[observe]()
    _edit_adam(emb, how, tmp_path, path, pipelined=True)
    acts = emb({"f": _ids(path)})["f"]
    before = snapshot(emb)
    with pytest.raises(ValueError, match=r"table 't'.*non-finite"):
        emb.apply_gradients({"f": torch.full_like(acts, 1.0)})
    assert_same(snapshot(emb), before)
    assert all(bool(torch.isfinite(v).all()) for v in emb.state_dict().values())


@pytest.mark.parametrize("how", ["in-place", "numpy"])
def test_edits_are_seen_on_the_gpu_kernels(how: str) -> None:
    """The GPU step's dry run computes every table's update from the values it reads now: zeroed accumulators
    and overflowing Adam slots are seen there too (CPU tensors through Triton's interpreter)."""
    import os

    from embtables.kernels import gpu, native

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the GPU kernels on CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    native.set_enabled(False)
    gpu.set_enabled(True, on_cpu=True)
    gpu.set_deferred_errors(False)  # raised in the call that finds it (tests/api/test_gpu_deferred_errors.py: later)
    try:
        if not gpu.usable(torch.device("cpu")):
            pytest.skip("Triton is not installed")
        emb = _module("general-small", et.Adagrad(0.1, initial_accumulator_value=0.1))
        for _ in range(2):
            _step(emb, "general-small", 1.0)
        _edit_accumulators(emb, how)
        before = snapshot(emb)
        with pytest.raises(ValueError, match=r"table 't'.*non-finite"):
            _step(emb, "general-small", 0.0)
        assert_same(snapshot(emb), before)
        adam = _module("general-small", et.Adam(0.5))
        _step(adam, "general-small", 1.0)
        _edit_adam(adam, how, Path("."), "general-small")
        before = snapshot(adam)
        with pytest.raises(ValueError, match=r"table 't'.*non-finite"):
            _step(adam, "general-small", 1.0)
        assert_same(snapshot(adam), before)
    finally:
        native.set_enabled(True)
        gpu.set_enabled(True)
        gpu.set_deferred_errors(None)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "replacement, what",
    [
        (lambda t: t.double(), "float64"),
        (lambda t: t.to(torch.bfloat16), "bfloat16"),
        (lambda t: t[:-1].clone(), "one row short"),  # the shape is named
    ],
    ids=["float64", "bfloat16", "shorter"],
)
@pytest.mark.parametrize("tensor", ["weights", "accumulators"])
def test_a_table_tensor_replaced_through_data_is_refused_naming_the_table(
    path: str, replacement: Any, what: str, tensor: str
) -> None:
    """``.data = other`` replaces the storage a table's kernels read: another dtype or shape (torch refuses another
    device there) is refused by the next lookup (weights) or update (weights and slots) with the table's name,
    and nothing changes; put back, training goes on. (A non-contiguous float32 tensor of the same shape is served
    as it is.)"""
    emb = _module(path, et.Adagrad(0.1))
    _step(emb, path, 0.5)
    held = emb.embedding_tables["t"] if tensor == "weights" else emb.slot_variables["t"]["accumulators"]
    original = held.data
    before = snapshot(emb)
    held.data = replacement(original)
    if what == "one row short":
        what = rf"\[{original.shape[0] - 1}, "
    name = "weights" if tensor == "weights" else "slot 'accumulators'"
    refused = rf"table 't': its {name} are now a .*{what}"
    try:
        emb({"f": _ids(path)})
        assert tensor != "weights", "a lookup reads the weights: it must refuse them"
    except et.errors.InputError as error:  # a general-path lookup checks the slots too (the fast one reads none)
        assert re.search(refused, str(error)), error
    held.data = original
    assert_same(snapshot(emb), before)
    acts = emb({"f": _ids(path)})["f"]
    held.data = replacement(original)
    with pytest.raises(et.errors.InputError, match=refused):
        emb.apply_gradients({"f": torch.full_like(acts, 0.5)})
    held.data = original
    assert_same(snapshot(emb), before)
    emb.apply_gradients({"f": torch.full_like(acts, 0.5)})
    assert not torch.equal(emb.embedding_tables["t"], before["t"])
