"""Issue 16, item 1: the small-batch fast path (``kernels/native_step.py``, ``tables/backends/native_fast_path.py``).

A step whose every input is int64 (``Ragged`` or dense) is staged by one native call and looked up,
prepared and applied through the fast calls; int32 ids of the same values take the general path. Both
must give the same bits, raise the same errors and leave the tables as they were after a refused step.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from statecheck import assert_same, snapshot
from torch import Tensor

import embtables as et
from embtables.errors import InputError
from embtables.kernels import native, native_half, native_step

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")


def make(
    combiners: tuple[str, ...],
    shared: bool,
    concat: bool,
    optimizer: Any,
    pipelined: bool = False,
    dtype: torch.dtype | None = None,
) -> Any:
    tables = [
        et.TableConfig(
            50 + 7 * i,
            4 + 2 * i,
            initializer=et.Constant(0.02 * (i + 1)),
            combiner=c,
            name=f"t{i}",
            dtype=dtype,
            slot_dtype=dtype,
        )
        for i, c in enumerate(combiners)
    ]
    tables[-1] = dataclasses.replace(tables[-1], optimizer=et.SGD(0.25))  # a table's own optimizer block
    features = {f"f{i}": et.FeatureConfig(t) for i, t in enumerate(tables)}
    if shared:  # a second feature of the first table, after the others in feature order (not grouped by table)
        features["g"] = et.FeatureConfig(tables[0])
    return et.DistributedEmbedding(
        features, optimizer, concat_activations=concat, pipeline_execution_with_tensor_core=pipelined
    )


def batch(emb: Any, step: int, dtype: torch.dtype, dense: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    out: dict[str, Any] = {}
    resolved = emb.resolved_config
    for feature in resolved.features:
        name, vocab = feature.name, resolved.tables[feature.table_index].vocabulary_size
        if dense:
            out[name] = torch.randint(0, vocab, (6,), generator=g).to(dtype)
        else:
            lengths = torch.randint(0, 4, (6,), generator=g)
            values = torch.randint(0, vocab, (int(lengths.sum()),), generator=g).to(dtype)
            out[name] = et.Ragged.from_lengths(values, lengths)
    return out


def train(emb: Any, steps: int, dtype: torch.dtype, dense: bool, scale: float = 1.0) -> list[Tensor]:
    acts_seen = []
    for step in range(steps):
        acts = emb(batch(emb, step, dtype, dense))
        flat = [acts] if isinstance(acts, Tensor) else [acts[k] for k in sorted(acts)]
        loss = sum((a * (scale * (1 + torch.arange(a.numel(), dtype=torch.float32)).reshape(a.shape) / a.numel())).sum()
                   for a in flat)  # fmt: skip
        loss.backward()
        emb.apply_gradients()
        acts_seen += [a.detach().clone() for a in flat]
    return acts_seen


CASES = [
    (("sum", "sum", "sum"), False, True, False),
    (("mean", "sqrtn", "sum"), False, False, False),
    (("sum", "mean"), True, False, False),
    (("sqrtn", "sum"), True, True, True),
    (("sum", "sum"), False, True, True),
]


@pytest.mark.parametrize("combiners, shared, concat, dense", CASES)
@pytest.mark.parametrize("opt", ["adagrad", "adam", "ftrl", "sgd"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_fast_path_equals_general_path_bit_for_bit(
    combiners: tuple[str, ...], shared: bool, concat: bool, dense: bool, opt: str, pipelined: bool
) -> None:
    if dense and any(c != "sum" for c in combiners):
        pytest.skip("dense ids: one id per bag, every combiner gives the same")
    optimizers = {
        "adagrad": lambda: et.Adagrad(0.1, initial_accumulator_value=0.1),
        "adam": lambda: et.Adam(0.01),
        "ftrl": lambda: et.FTRL(0.1, l1_regularization_strength=0.01),
        "sgd": lambda: et.SGD(0.5),
    }
    fast = make(combiners, shared, concat, optimizers[opt](), pipelined)
    general = make(combiners, shared, concat, optimizers[opt](), pipelined)
    acts_fast = train(fast, 5, torch.int64, dense)
    acts_general = train(general, 5, torch.int32, dense)  # int32 ids never take the native staging
    assert fast._engine.local.backend.fast._arrays is not None  # the fast path served the int64 steps
    assert general._engine.local.backend.fast._arrays is None
    for a, b in zip(acts_fast, acts_general, strict=True):
        assert torch.equal(a, b)
    assert_same(snapshot(fast), snapshot(general))


@pytest.mark.parametrize("combiners, shared, concat, dense", [c for c in CASES if c[2]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_tables_concatenated_take_the_fast_lookup_and_equal_the_general_path(
    combiners: tuple[str, ...], shared: bool, concat: bool, dense: bool, dtype: torch.dtype, monkeypatch: Any
) -> None:
    """Half tables with concatenated activations: the fast path's one lookup call writes every feature's column
    block of the shared output (rows the output's width apart), with the bits of the general path's."""
    fast = make(combiners, shared, concat, et.Adagrad(0.1, initial_accumulator_value=0.1), dtype=dtype)
    general = make(combiners, shared, concat, et.Adagrad(0.1, initial_accumulator_value=0.1), dtype=dtype)
    into_calls = []
    lookup = native_half.HalfStep.lookup

    def seen(self: Any, bags: Any, into: Tensor | None = None, starts: Any = None) -> Any:
        into_calls.append(into is not None)
        return lookup(self, bags, into, starts)

    monkeypatch.setattr(native_half.HalfStep, "lookup", seen)
    acts_fast = train(fast, 5, torch.int64, dense)
    acts_general = train(general, 5, torch.int32, dense)
    served = fast._engine.local.backend.fast
    assert served._arrays is not None and served._half is not None and served._half[1] is not None
    assert into_calls == [True] * 5  # every lookup of the fast module wrote the shared output in one call
    assert general._engine.local.backend.fast._arrays is None
    for a, b in zip(acts_fast, acts_general, strict=True):
        assert a.shape[1] == sum(4 + 2 * i for i in range(len(combiners))) + (4 if shared else 0)
        assert torch.equal(a, b)
    assert_same(snapshot(fast), snapshot(general))


def test_staged_batches_share_one_staging_and_only_serve_themselves() -> None:
    emb = make(("sum", "mean"), True, False, et.SGD(0.1))
    staged = emb._inputs.stage(batch(emb, 0, torch.int64, False), None, torch.device("cpu"), set())
    bags = staged[0].staged
    assert bags is not None and all(b.staged is bags for b in staged)
    assert set(vars(staged[0])) == {f.name for f in dataclasses.fields(staged[0])}  # built field by field
    assert bags.serves(staged)
    assert not bags.serves(staged[:-1])
    moved = [*staged[:-1], type(staged[-1])(staged[-1].ids.clone(), staged[-1].offsets, None, staged[-1].out_shape)]
    assert not bags.serves(moved)  # a batch with other ids (a copy, a dynamic table's rows) is not served
    general = emb._inputs.stage(batch(emb, 0, torch.int32, False), None, torch.device("cpu"), set())
    assert all(b.staged is None for b in general)


def test_arrays_notice_a_replaced_or_resized_tensor() -> None:
    emb = make(("sum", "sum"), False, True, et.Adagrad(0.1))
    train(emb, 1, torch.int64, False)
    fast = emb._engine.local.backend.fast
    first = fast.arrays()
    assert first is not None and fast.arrays() is first
    state = emb._engine.local.states["t0"]
    state.slots["accumulators"] = state.slots["accumulators"].clone()  # another tensor: new arrays
    second = fast.arrays()
    assert second is not None and second is not first
    assert not second.current([t.clone() for t in second.tensors])
    weights = state.weights
    resized = [t if t is not weights else weights for t in second.tensors]
    weights.resize_(weights.shape[0] - 1, weights.shape[1])  # same object, fewer rows: never written past
    assert not second.current(resized)
    with pytest.raises(InputError, match=r"table 't0': its weights are now a float32 \[\d+, \d+\] tensor"):
        fast.arrays()  # a table resized under the kernels: refused, named (and the general path refuses it too)


def test_a_changed_arena_is_refused_before_c_reads_it() -> None:
    emb = make(("sum",), False, False, et.SGD(0.1))
    staged = emb._inputs.stage(batch(emb, 0, torch.int64, False), None, torch.device("cpu"), set())
    bags = staged[0].staged
    assert bags is not None
    bags.check()
    bags.arena = torch.empty(0, dtype=torch.int64)
    with pytest.raises(native.NativeBufferError, match="staging arena"):
        bags.check()


def test_bad_ids_and_non_finite_updates_raise_as_on_the_general_path() -> None:
    emb = make(("sum", "sum"), False, True, et.SGD(1.0))
    train(emb, 2, torch.int64, False)
    before = snapshot(emb)
    bad = batch(emb, 3, torch.int64, False)
    values = bad["f1"].values.clone()
    if values.numel() == 0:
        values = torch.tensor([0])
        bad["f1"] = et.Ragged.from_lengths(values, torch.tensor([1, 0, 0, 0, 0, 0]))
    values[0] = 10_000
    bad["f1"] = et.Ragged(values, bad["f1"].row_splits)
    with pytest.raises(ValueError, match=r"'f1'.*out of range"):
        emb(bad)
    acts = emb(batch(emb, 4, torch.int64, False))
    acts.sum().backward()
    with pytest.raises(ValueError, match=r"not finite|overflow"):
        emb.apply_gradients(torch.full_like(acts, 3e38))
    assert_same(snapshot(emb), before)  # nothing written by the refused update
    emb.apply_gradients(torch.ones_like(acts))  # the lookup stays: a good gradient applies
    assert emb._engine.local.backend.fast._arrays is not None


def test_updates_past_the_scratch_limit_take_the_general_update() -> None:
    # 2 tables of dim 64 with 1100 ids each (about 900 unique): > STAGED_MAX_VALUES, so phase 2 is the general one
    tables = [et.TableConfig(5000, 64, initializer=et.Constant(0.01), name=f"t{i}") for i in range(2)]
    features = {f"f{i}": et.FeatureConfig(t) for i, t in enumerate(tables)}
    fast = et.DistributedEmbedding(features, et.Adagrad(0.1), concat_activations=True)
    general = et.DistributedEmbedding(features, et.Adagrad(0.1), concat_activations=True)
    assert native_step.STAGED_MAX_VALUES < 800 * 64
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = {k: torch.randint(0, 5000, (1100,), generator=g) for k in features}
        for emb, dtype in ((fast, torch.int64), (general, torch.int32)):
            acts = emb({k: v.to(dtype) for k, v in ids.items()})
            (acts * acts).sum().backward()
            emb.apply_gradients()
    assert fast._engine.local.backend.fast._small is False
    assert_same(snapshot(fast), snapshot(general))


def test_an_overflowing_table_leaves_the_tables_written_before_it_as_they_were() -> None:
    # phase 2 writes the small updates in place with a backup: table t0 is written first, t1 overflows, and t0
    # must be put back (the general path, run again, then names t1 and its row)
    emb = make(("sum", "sum"), False, True, et.SGD(1.0))
    train(emb, 1, torch.int64, False)
    sd = emb.state_dict()
    sd["t1"] = torch.full_like(sd["t1"], 3e38)
    emb.load_state_dict(sd)
    before = snapshot(emb)
    ids = {"f0": torch.tensor([1, 2, 3]), "f1": torch.tensor([4, 5, 6])}
    acts = emb(ids)
    grad = torch.ones_like(acts)
    grad[:, 4:] = -3e38  # t1's columns (dim 4 + 2): 3e38 + 3e38 overflows; t0's update is finite
    with pytest.raises(ValueError, match=r"table 't1'.*row [456]"):
        emb.apply_gradients(grad)
    assert_same(snapshot(emb), before)
    emb.apply_gradients(torch.ones_like(acts))
    assert emb._engine.local.backend.fast._small  # the fast path served the step
    assert not torch.equal(snapshot(emb)["t0"], before["t0"])


def test_staging_layouts_are_reused_for_the_same_sizes_and_hold_each_new_batch() -> None:
    emb = make(("sum", "mean"), True, False, et.SGD(0.1))
    stager, cpu = emb._inputs, torch.device("cpu")
    first = stager.stage(batch(emb, 0, torch.int64, False), None, cpu, set())
    bags = first[0].staged
    assert bags is not None
    kept = [(b.ids.clone(), b.offsets.clone()) for b in first]
    again_input = batch(emb, 0, torch.int64, False)  # the same sizes, other ids
    again_input = {k: et.Ragged(torch.flip(v.values, [0]), v.row_splits) for k, v in again_input.items()}
    again = stager.stage(again_input, None, cpu, set())
    assert again[0].staged is bags  # the same layout: its views and addresses reused
    for b, x, name in zip(again, kept, sorted(again_input)):
        assert torch.equal(b.ids, again_input[name].values)  # the views hold the new batch
        assert torch.equal(b.offsets, x[1])
    other = stager.stage(batch(emb, 1, torch.int64, False), None, cpu, set())
    assert other[0].staged is not bags  # other sizes: another layout
    busy = {bags.base}  # the arena is in use (a batch awaiting apply_gradients): another arena, another layout
    elsewhere = stager.stage(again_input, None, cpu, busy)
    assert elsewhere[0].staged is not bags and elsewhere[0].staged.base != bags.base
    assert len(stager.staging.layouts.layouts) == 3
    big = {k: et.Ragged.from_lengths(torch.zeros(4000, dtype=torch.int64), torch.full((1000,), 4)) for k in again_input}
    stager.stage(big, None, cpu, set())  # an arena grows: the layouts holding the old one are forgotten
    assert len(stager.staging.layouts.layouts) == 1


def test_a_column_block_gradient_is_read_in_place_and_checked_whole() -> None:
    from embtables.kernels.column_blocks import ColumnBlocks

    emb = make(("sum", "sum", "sum"), False, True, et.Adagrad(0.1))
    acts = emb(batch(emb, 0, torch.int64, True))
    acts.sum().backward()
    coll, last = emb._engine.local, emb._pipeline.last
    arrays, bags = coll.backend.fast.arrays(), last.batches[0].staged
    layout = emb._concat
    grad = torch.randn(acts.shape, generator=torch.Generator().manual_seed(3))
    blocks = layout.blocks(grad)
    assert isinstance(blocks, ColumnBlocks) and blocks._views is None
    assert native_step.prepare(arrays, bags, blocks) == [0, 0, 0]
    assert blocks._views is None  # read through the whole gradient's address: no view was cut
    via_blocks = [ws.num_rows for ws in arrays.workspaces]
    assert native_step.prepare(arrays, bags, list(torch.split_with_sizes(grad, layout.dims, 1))) == [0, 0, 0]
    assert [ws.num_rows for ws in arrays.workspaces] == via_blocks
    assert [torch.equal(a, b) for a, b in zip(blocks, grad.split(layout.dims, 1))] == [True] * 3  # cut on demand
    bad = [
        (grad.double(), layout.starts, "float32"),
        (grad[:-1], layout.starts, "do not fit"),  # fewer rows than the features' bags
        (grad[:, :-1], layout.starts, "do not fit"),  # the last block runs past the columns
        (grad.t().contiguous().t(), layout.starts, "laid out"),  # column stride B
        (grad, (0, 4, 40), "do not fit"),
        (grad, (0, 4), "laid out"),  # a start per feature is needed
    ]
    for whole, starts, match in bad:
        with pytest.raises(native.NativeBufferError, match=match):
            native_step.prepare(arrays, bags, ColumnBlocks(whole, starts, layout.dims[: len(starts)]))


def test_updates_fit_checking_asks_for_the_largest_update_of_every_table() -> None:
    emb = make(("sum", "sum"), False, True, et.Adagrad(0.1))
    acts = emb(batch(emb, 0, torch.int64, True))
    acts.sum().backward()
    emb.apply_gradients()
    arrays = emb._engine.local.backend.fast.arrays()
    largest = max(ws.num_rows * ws.dim for ws in arrays.workspaces)
    assert largest > 0
    saved = native_step.STAGED_MAX_VALUES
    try:
        for limit, fits in ((largest, True), (largest - 1, False)):
            native_step.STAGED_MAX_VALUES = limit
            assert native_step.updates_fit_checking(arrays) is fits
    finally:
        native_step.STAGED_MAX_VALUES = saved


def test_the_untyped_calls_refuse_arrays_that_are_not_one_per_feature() -> None:
    """The fast calls convert no argument (``native_abi.unchecked``), so what C indexes per feature is checked
    against the feature count first: staging arrays, the staged bags against the tables' features, the outputs."""
    from embtables.kernels.native_abi import FUNCTIONS, unchecked

    lib = native.library()
    raw = unchecked(lib)
    assert unchecked(lib) is raw
    fast = [f for f in FUNCTIONS.values() if f.fast]
    assert {f.name for f in fast} == {"et_stage_inputs_many", "et_lookup_many", "et_prepare_many", "et_apply_many",
                                      "et_prepared_values_max", "et_mark_changed", "et_lookup_half_many",
                                      "et_apply_half_many"}  # fmt: skip
    for f in fast:
        assert getattr(raw, f.name).argtypes is None and getattr(raw, f.name).restype is f.result
    emb = make(("sum", "sum", "sum"), False, False, et.SGD(0.1))
    stager = emb._inputs
    inputs = batch(emb, 0, torch.int64, False)
    values = [inputs[k].values for k in sorted(inputs)]
    splits = [inputs[k].row_splits for k in sorted(inputs)]
    arena = lambda n, dtype: torch.empty(n, dtype=dtype)  # noqa: E731
    with pytest.raises(native.NativeBufferError, match="one split"):
        native_step.stage(values[:2], splits[:2], stager.vocab, stager.codes, arena)
    with pytest.raises(native.NativeBufferError, match="one split"):
        native_step.stage(values, splits[:2], stager.vocab, stager.codes, arena)
    bags = native_step.stage(values, splits, stager.vocab, stager.codes, arena)
    assert bags is not None
    arrays = emb._engine.local.backend.fast.arrays()
    outs = [torch.empty(6, d) for d in (4, 6, 8)]
    assert native_step.lookup(arrays, bags, outs, None) == 0
    with pytest.raises(native.NativeBufferError, match="one output per staged feature"):
        native_step.lookup(arrays, bags, outs[:2], None)
    two = ((ctypes.c_int64 * 2)(*stager.vocab[:2]), (ctypes.c_int32 * 2)(*stager.codes[:2]))
    fewer = native_step.stage(values[:2], splits[:2], *two, arena)
    assert fewer is not None
    with pytest.raises(native.NativeBufferError, match="one per feature of the tables"):
        native_step.lookup(arrays, fewer, outs[:2], None)
    with pytest.raises(native.NativeBufferError, match="one per feature of the tables"):
        native_step.prepare(arrays, fewer, [None, None])


def test_the_half_calls_refuse_arrays_that_are_not_one_per_feature_or_table() -> None:
    """The fast path's half calls (``native_half.HalfStep``) are untyped too: the staged bags are checked
    against the tables' features, the row maps and rounding against the tables, before C reads them."""
    from embtables.kernels.native_half import HalfStep

    tables = [et.TableConfig(50 + 7 * i, 4 + 2 * i, name=f"t{i}", dtype=torch.bfloat16) for i in range(3)]
    emb = et.DistributedEmbedding({f"f{i}": et.FeatureConfig(t) for i, t in enumerate(tables)}, et.SGD(0.1))
    train(emb, 1, torch.int64, False)
    fast = emb._engine.local.backend.fast
    arrays = fast.arrays()
    assert arrays is not None and arrays.half
    half = fast._half_step(arrays)
    assert isinstance(half, HalfStep)
    stager = emb._inputs
    inputs = batch(emb, 1, torch.int64, False)
    values = [inputs[k].values for k in sorted(inputs)]
    splits = [inputs[k].row_splits for k in sorted(inputs)]
    arena = lambda n, dtype: torch.empty(n, dtype=dtype)  # noqa: E731
    bags = native_step.stage(values, splits, stager.vocab, stager.codes, arena)
    assert bags is not None
    outs = half.lookup(bags)
    assert outs is not None and [tuple(o.shape) for o in outs] == [(6, 4), (6, 6), (6, 8)]
    two = ((ctypes.c_int64 * 2)(*stager.vocab[:2]), (ctypes.c_int32 * 2)(*stager.codes[:2]))
    fewer = native_step.stage(values[:2], splits[:2], *two, arena)
    assert fewer is not None
    with pytest.raises(native.NativeBufferError, match="one per feature of the tables"):
        half.lookup(fewer)
    with pytest.raises(native.NativeBufferError, match="one row map"):
        half.apply(native_step.param_array(arrays, fast._rates[1]), [None, None], 0)
    with pytest.raises(native.NativeBufferError, match="global rows"):
        half.apply(native_step.param_array(arrays, fast._rates[1]), [None, torch.zeros(3, dtype=torch.int64), None], 0)
    with pytest.raises(native.NativeBufferError, match="one rounding per table"):
        HalfStep(arrays, [(0, 0, True)])


def test_features_of_one_width_share_one_output_block_and_stay_separate_leaves() -> None:
    """Every feature [S, D] alike: the fast lookup writes one [F, S, D] block in one call; each activation is
    a contiguous leaf that requires grad, gets its own ``.grad``, and trains the general path's bits."""

    def alike() -> Any:
        tables = [et.TableConfig(40 + i, 4, initializer=et.Constant(0.01 * (i + 1)), name=f"t{i}") for i in range(3)]
        features = {f"f{i}": et.FeatureConfig(t) for i, t in enumerate(tables)}
        return et.DistributedEmbedding(features, et.Adagrad(0.1, initial_accumulator_value=0.1))

    fast, general = alike(), alike()
    acts = fast(batch(fast, 0, torch.int64, False))
    flat = [acts[k] for k in sorted(acts)]
    assert all(a._base is not None and a._base is flat[0]._base for a in flat)  # one block
    assert all(a.is_leaf and a.requires_grad and a.is_contiguous() and a.shape == (6, 4) for a in flat)
    sum((a * (i + 1)).sum() for i, a in enumerate(flat)).backward()
    for i, a in enumerate(flat):
        assert torch.equal(a.grad, torch.full((6, 4), float(i + 1)))
    flat[0].data.fill_(7.0)  # the caller's own activations: another feature's block is untouched
    assert not torch.equal(flat[1], flat[0])
    fast.apply_gradients()
    general(batch(general, 0, torch.int32, False))
    general.apply_gradients({k: torch.full((6, 4), float(i + 1)) for i, k in enumerate(sorted(acts))})
    assert_same(snapshot(fast), snapshot(general))
    seen_fast, seen_general = train(fast, 4, torch.int64, False), train(general, 4, torch.int32, False)
    assert all(torch.equal(a, b) for a, b in zip(seen_fast, seen_general, strict=True))
    assert_same(snapshot(fast), snapshot(general))

    # the block is checked in the call that hands it to C: its F, S and D
    inputs = batch(fast, 9, torch.int64, False)
    stager = fast._inputs
    keys = sorted(inputs)
    arena = lambda n, dtype: torch.empty(n, dtype=dtype)  # noqa: E731
    bags = native_step.stage([inputs[k].values for k in keys], [inputs[k].row_splits for k in keys], stager.vocab,
                             stager.codes, arena)  # fmt: skip
    assert bags is not None and bags.alike_bags == 6
    arrays = fast._engine.local.backend.fast.arrays()
    assert native_step.lookup(arrays, bags, [torch.empty(3, 6, 4)], None) == 0
    for wrong in (torch.empty(2, 6, 4), torch.empty(3, 6, 5), torch.empty(3, 5, 4), torch.empty(3, 6, 4).double()):
        with pytest.raises(native.NativeBufferError):
            native_step.lookup(arrays, bags, [wrong], None)


def _c_proof(opt: Any, lr: float, decay: float, gmax: float, hi: list[float], lo: list[float]) -> list[float] | None:
    params = native.opt_params(opt, lr, decay, clip_gradients=True)
    arr = ctypes.c_double * 4
    out = arr()
    proven = native.library().et_prove_update(ctypes.byref(params), gmax, arr(*hi), arr(*lo), out)
    return list(out)[: len(hi)] if proven else None


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_the_native_proof_agrees_with_the_finiteness_guard(kind: str) -> None:
    """csrc ``et_prove_update`` proves exactly what ``finite_guard.update_bounds`` proves for SGD, Adagrad and Adam,
    with the same bounds (never more: a proven update is written without a check)."""
    import math
    import random

    from embtables.kernels.finite_guard import update_bounds

    rng = random.Random(7)
    values = [0.0, 1e-30, 1e-3, 0.1, 1.0, 3.0, 1e3, 1e14, 1e15, 1e16, 1e29, 1e31, 3e38, math.inf, math.nan]
    slots = {"sgd": 0, "adagrad": 1, "adam": 2}[kind]
    agreed = proven = 0
    for case in range(3000):
        clip = rng.choice([None, (-1.0, 2.0), (None, 5.0)])
        lr = rng.choice([0.0, 1e-3, 0.1, 1.0, 1e3, 1e29])
        f32 = lambda x: float(np.float32(x))  # noqa: E731 - the C block holds float32 values
        if kind == "adam":  # float32 epsilons: the C block holds epsilon as float32, the config as given
            eps = f32(rng.choice([1e-7, 1e-3, 0.5, 2e-19]))
            opt: Any = et.Adam(lr, epsilon=eps, sum_inside_sqrt=rng.choice([True, False]), clipvalue=clip)
        else:
            opt = (et.SGD if kind == "sgd" else et.Adagrad)(lr, clipvalue=clip)
        opt = dataclasses.replace(opt, clip_weight_min=-2.0) if case % 5 == 0 else opt
        decay = f32(rng.choice([0.0, 0.01, 0.5]))
        gmax = rng.choice(values[:-2]) if case % 7 else rng.choice(values)
        hi = [rng.choice(values) for _ in range(1 + slots)]
        lo = [-h for h in hi]
        if slots:  # Adagrad's accumulators, Adam's velocities: their least value matters
            lo[-1] = rng.choice([0.0, 1e-30, 0.1, 1.0, -1.0, math.nan])
        ours = _c_proof(opt, f32(lr), decay, gmax, hi, lo)
        theirs = update_bounds(opt, f32(lr), decay, gmax, hi, lo)
        assert (ours is None) == (theirs is None), (case, kind, lr, decay, gmax, hi, lo, clip, ours, theirs)
        if ours is not None:
            assert theirs is not None
            expected = [max(theirs[0], 2.0) if case % 5 == 0 else theirs[0], *theirs[1:]]  # a clamp to -2 bounds it
            assert ours == pytest.approx(expected, rel=1e-9)
            proven += 1
        agreed += 1
    assert proven > 200 and agreed - proven > 200  # both answers were exercised


@pytest.mark.parametrize("opt", ["adagrad", "adam", "ftrl"])
def test_small_updates_proven_finite_skip_the_check_and_train_the_same_bits(opt: str) -> None:
    optimizers = {
        "adagrad": lambda: et.Adagrad(0.1, initial_accumulator_value=0.1),
        "adam": lambda: et.Adam(0.01),
        "ftrl": lambda: et.FTRL(0.1),  # no proof in C: checked with the backup
    }
    fast = make(("sum", "mean"), False, True, optimizers[opt]())
    general = make(("sum", "mean"), False, True, optimizers[opt]())
    train(fast, 4, torch.int64, False)
    train(general, 4, torch.int32, False)
    arrays = fast._engine.local.backend.fast._arrays
    # t0 the optimizer above, t1 its own SGD block (make): proven tables are written without a check
    assert list(arrays.proven) == [int(opt != "ftrl"), 1]
    assert_same(snapshot(fast), snapshot(general))
