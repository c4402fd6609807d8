"""Steps over half-precision and float32 tables together (``TableConfig(dtype=)`` differing between tables).

The small-batch fast path serves them in one native call a phase (``native_half.HalfStep``): every feature's
lookup, float32 tables' bags pooled as the float32 lookup pools them, and every table's update, all or nothing
across the storage types (each half table written in place with its stored rows kept, then the float32 tables
checked; a refusal of either puts every half table back). The bits are those of the general native path and of
the torch reference; a float32 update too large to check in the writing call takes the general phase 2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from statecheck import assert_paths_agree, assert_same, snapshot

import embtables as et
from embtables.kernels import native_half, native_library

# (name, rows, dim, weights' dtype, slots' dtype): bfloat16 and float16 rows (half and float32 slots) between
# float32 tables, widths that do and do not fill a vector
TABLES = [
    ("h0", 40, 8, torch.bfloat16, torch.bfloat16),
    ("f1", 30, 6, None, None),
    ("h2", 50, 5, torch.float16, None),
    ("f3", 60, 16, None, None),
]
B = 7


def _module(concat: bool, rows: dict[str, int] | None = None) -> et.DistributedEmbedding:
    tables = {
        name: et.TableConfig(
            (rows or {}).get(name, v), d, name=name, combiner="sum", initializer=et.TruncatedNormal(seed=i),
            dtype=dtype, slot_dtype=slot_dtype, rounding_seed=5,
        )
        for i, (name, v, d, dtype, slot_dtype) in enumerate(TABLES)
    }  # fmt: skip
    optimizer = et.Adagrad(0.2, initial_accumulator_value=0.1)
    return et.DistributedEmbedding(
        {f"x{name}": et.FeatureConfig(t) for name, t in tables.items()}, optimizer, concat_activations=concat
    )


def _inputs(emb: et.DistributedEmbedding, step: int, batch: int = B) -> tuple[dict[str, Any], dict[str, Any]]:
    """Step ``step``'s ids (one per sample, int64: the fast path's staging) and activation gradients."""
    g = torch.Generator().manual_seed(50 + step)
    ids, grads = {}, {}
    for name, _, d, _, _ in TABLES:
        rows = emb.embedding_tables[name].shape[0]
        ids[f"x{name}"] = torch.randint(0, rows, (batch,), generator=g)
        grads[f"x{name}"] = torch.randn(batch, d, generator=g) * 0.6
    return ids, grads


def _train(emb: et.DistributedEmbedding, steps: int, concat: bool, batch: int = B) -> list[torch.Tensor]:
    seen = []
    for step in range(steps):
        ids, grads = _inputs(emb, step, batch)
        acts = emb(ids)
        if concat:
            seen.append(acts.detach().clone())
            emb.apply_gradients(torch.cat([grads[f"x{n}"] for n, *_ in TABLES], dim=1))
        else:
            seen += [acts[k].detach().clone() for k in sorted(acts)]
            emb.apply_gradients(grads)
    return seen


def _count_one_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """What every ``HalfStep.lookup`` / ``HalfStep.apply`` (the fast path's one call a phase) returns from now on."""
    calls: dict[str, list[Any]] = {"lookup": [], "apply": []}
    for name in calls:
        real = getattr(native_half.HalfStep, name)

        def recorded(*args: Any, _name: str = name, _real: Any = real, **kwargs: Any) -> Any:
            calls[_name].append(_real(*args, **kwargs))
            return calls[_name][-1]

        monkeypatch.setattr(native_half.HalfStep, name, recorded)
    return calls


@pytest.mark.parametrize("concat", [False, True], ids=["per feature", "concatenated"])
def test_half_and_float32_tables_take_one_call_a_phase_with_the_general_paths_bits(
    concat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native_library.library() is None:
        pytest.skip("the native kernels are not built here")
    calls = _count_one_calls(monkeypatch)
    fast = _module(concat)
    seen_fast = _train(fast, 4, concat)
    assert len(calls["lookup"]) == 4 and all(out is not None for out in calls["lookup"])
    assert calls["apply"] == [[-1] * len(TABLES)] * 4  # every table written by the one call, every step

    assert_paths_agree(lambda: _module(concat), lambda emb: _train(emb, 4, concat), fast, seen_fast, monkeypatch)
    assert len(calls["apply"]) == 4  # the general path took none of the one calls


@pytest.mark.parametrize("refusing", ["f1", "h2"])
def test_a_refused_update_of_either_storage_type_leaves_every_table_as_it_was(
    refusing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """f1 (float32) refuses after the half tables were written in place: the call puts them back. h2 (float16)
    refuses before any float32 table is written."""
    if native_library.library() is None:
        pytest.skip("the native kernels are not built here")
    calls = _count_one_calls(monkeypatch)
    emb = _module(False)
    _train(emb, 2, False)
    ids, grads = _inputs(emb, 9)
    # zeroed accumulators (float32 in both) and a zero gradient: 0 / 0 in the refusing table's update
    emb.slot_variables[refusing]["accumulators"].data.zero_()
    grads[f"x{refusing}"] = torch.zeros_like(grads[f"x{refusing}"])
    before = snapshot(emb)
    emb(ids)
    with pytest.raises(ValueError, match=rf"table '{refusing}'.*non-finite"):
        emb.apply_gradients(grads)
    bad = calls["apply"][-1]
    order = [t.name for t in emb._engine.local.backend.fast.resolved.tables]  # the call's tables, in its order
    assert [b >= 0 for b in bad] == [name == refusing for name in order]  # the one call refused that table
    assert_same(before, snapshot(emb))  # and left every table and slot as it was


def test_a_large_float32_update_among_half_tables_takes_the_general_phase_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """f3's update, 2,000 unique rows x 16 values, is past what the writing call checks cheaply: the fast path
    declines phase 2 (the general one measures its bounds on every thread); the lookup stays one call."""
    if native_library.library() is None:
        pytest.skip("the native kernels are not built here")
    calls = _count_one_calls(monkeypatch)
    big = {"f3": 5000}
    emb = _module(False, big)
    seen = _train(emb, 2, False, batch=2000)
    assert len(calls["lookup"]) == 2 and calls["apply"] == []
    native_library.set_enabled(False)
    try:
        reference = _module(False, big)
        seen_reference = _train(reference, 2, False, batch=2000)
    finally:
        native_library.set_enabled(True)
    assert all(torch.equal(a, b) for a, b in zip(seen, seen_reference, strict=True))
    assert_same(snapshot(emb), snapshot(reference))
