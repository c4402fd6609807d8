"""Half-precision tables (``TableConfig(dtype=, slot_dtype=)``, docs/spec.md §12): rows (and slots) stored in
bfloat16 / float16, lookups and updates computed in float32, every written value rounded to the storage type,
stochastically with the bits of (rounding_seed, step, table, global row, column).

Checked against the NumPy oracle (``tests/oracle``): each written value is one of the two half values around
the oracle's update of the stored row, and exactly ``np_rounding.stochastic_round`` of it wherever the float32
update is not within float32 error of a rounding boundary. Reproducible bit for bit: twice, pipelined or not,
after a save/restore in the middle, with the C or the torch rounding, and sharded over W = 2.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mp_world import run_world
from oracle import np_rounding
from oracle.np_optimizers import update_row

import embtables as et
from embtables.errors import ConfigError, InputError
from embtables.kernels import native_library
from embtables.kernels.affine_rows import AffineRows

HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIMIZERS: dict[str, tuple[Any, dict[str, Any]]] = {
    # (the module's optimizer, the oracle's optimizer dict; the learning rate is LR)
    "sgd": (lambda: et.SGD(0.3), {"name": "SGD"}),
    "adagrad": (
        lambda: et.Adagrad(0.2, initial_accumulator_value=0.1),
        {"name": "Adagrad", "initial_accumulator_value": 0.1},
    ),
    "adam": (lambda: et.Adam(0.05), {"name": "Adam"}),
    "ftrl": (
        lambda: et.FTRL(0.2, l1_regularization_strength=0.01),
        {"name": "FTRL", "l1_regularization_strength": 0.01},
    ),
}
V, D, B = 40, 6, 8


def _module(
    opt: str, dtype: Any, slot_dtype: Any = None, *, rounding: str = "stochastic", seed: int = 3, **kwargs: Any
) -> Any:
    table = et.TableConfig(
        V, D, name="t", combiner="sum", initializer=et.TruncatedNormal(seed=1), dtype=dtype, slot_dtype=slot_dtype,
        rounding=rounding, rounding_seed=seed,
    )  # fmt: skip
    return et.DistributedEmbedding({"f": et.FeatureConfig(table)}, OPTIMIZERS[opt][0](), **kwargs)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (B,), generator=g)
    grad = torch.randn(B, D, generator=g) * 0.7
    return ids, grad


def _step(emb: Any, step: int) -> None:
    ids, grad = _batch(step)
    emb({"f": ids})
    emb.apply_gradients({"f": grad})


def _lookups_of_steps(emb: Any, steps: int) -> list[torch.Tensor]:
    """The activations of ``steps`` training steps (``_batch``), each step applied."""
    seen = []
    for step in range(steps):
        ids, grad = _batch(step)
        seen.append(emb({"f": ids})["f"].detach().clone())
        emb.apply_gradients({"f": grad})
    return seen


def _stored(emb: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in emb.state_dict().items()}


def _record_half_step_applies(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """What every ``HalfStep.apply`` (the fast path's one update call) returns from now on, in call order."""
    from embtables.kernels import native_half

    results: list[list[int]] = []
    real_apply = native_half.HalfStep.apply

    def recorded(*args: Any, **kwargs: Any) -> list[int]:
        results.append(real_apply(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(native_half.HalfStep, "apply", recorded)
    return results


def test_the_config_refuses_what_half_tables_cannot_do() -> None:
    with pytest.raises(ConfigError, match=r"`dtype` must be torch\.float32, torch\.bfloat16 or torch\.float16"):
        et.TableConfig(4, 2, dtype=torch.int8)
    with pytest.raises(ConfigError, match="`slot_dtype=bfloat16` needs half-precision rows"):
        et.TableConfig(4, 2, slot_dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="`rounding` must be"):
        et.TableConfig(4, 2, dtype=torch.bfloat16, rounding="up")
    with pytest.raises(ConfigError, match="`rounding_seed`"):
        et.TableConfig(4, 2, dtype=torch.bfloat16, rounding_seed=-1)
    with pytest.raises(ConfigError, match="quantization_config"):
        et.TableConfig(4, 2, dtype=torch.float16, quantization_config=et.QuantizationConfig(4, 0.0, 1.0))
    table = et.TableConfig(4, 2, dtype="bfloat16")
    with pytest.raises(ConfigError, match="use_gradient_accumulation=False"):
        et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.SGD(0.1, use_gradient_accumulation=False))
    assert table.storage == "bfloat16" and table.slot_storage == "float32" and et.TableConfig(4, 2).storage == "float32"


@pytest.mark.parametrize("slot", [None, "same"])
def test_storage_takes_half_the_bytes(slot: str | None) -> None:
    full = _module("adagrad", None)
    half = _module("adagrad", torch.bfloat16, torch.bfloat16 if slot else None)
    sizes = {k: v.numel() * v.element_size() for k, v in half.state_dict().items()}
    full_sizes = {k: v.numel() * v.element_size() for k, v in full.state_dict().items()}
    assert half.embedding_tables["t"].dtype == torch.bfloat16
    assert sizes["t"] * 2 == full_sizes["t"]
    assert sizes["t/accumulators"] * (2 if slot else 1) == full_sizes["t/accumulators"]
    # the initial values are the float32 table's rounded to nearest
    assert torch.equal(half.embedding_tables["t"], full.embedding_tables["t"].to(torch.bfloat16))


def _oracle_step(
    opt: str, kind: str, slot_kind: str | None, before: dict[str, torch.Tensor], ids: torch.Tensor,
    grad: torch.Tensor, step: int, seed: int,
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:  # fmt: skip
    """The oracle's float64 update of every touched row from the stored (half) values ``before``: per row, the
    weights and slots (concatenated) it gives, and the random bits of their columns."""
    oracle_opt = OPTIMIZERS[opt][1]
    slot_names = [k.split("/", 1)[1] for k in before if "/" in k]
    sums: dict[int, np.ndarray] = {}
    for i, r in enumerate(ids.tolist()):
        sums[r] = sums.get(r, 0.0) + grad[i].double().numpy()
    out, bits = {}, {}
    for r, g in sums.items():
        w = before["t"][r].double().numpy()
        slots = {n: before[f"t/{n}"][r].double().numpy() for n in slot_names}
        w_new, s_new = update_row(oracle_opt, w, slots, g.astype(np.float32).astype(np.float64), 0.0 + _lr(opt))
        out[r] = np.concatenate([w_new, *[s_new[n] for n in slot_names]])
        bits[r] = np_rounding.random_bits(seed, step, 0, np.array([r]), D * (1 + len(slot_names)))[0]
    return out, bits


LR = {"sgd": 0.3, "adagrad": 0.2, "adam": 0.05, "ftrl": 0.2}


def _lr(opt: str) -> float:
    return float(np.float32(LR[opt]))


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind, slot_kind", [("bfloat16", None), ("float16", None), ("bfloat16", "bfloat16")])
def test_every_written_value_is_the_oracles_update_rounded(opt: str, kind: str, slot_kind: str | None) -> None:
    seed = 11
    emb = _module(opt, HALF[kind], HALF[slot_kind] if slot_kind else None, seed=seed)
    exact = checked = 0
    for step in range(1, 5):
        before = _stored(emb)
        ids, grad = _batch(step)
        emb({"f": ids})
        emb.apply_gradients({"f": grad})
        after = _stored(emb)
        want, bits = _oracle_step(opt, kind, slot_kind, before, ids, grad, step, seed)
        keys = ["t", *[k for k in after if "/" in k]]
        for r in range(V):
            got = np.concatenate([after[k][r].double().numpy() for k in keys])
            if r not in want:
                assert np.array_equal(got, np.concatenate([before[k][r].double().numpy() for k in keys]))
                continue
            for c, (g, x) in enumerate(zip(got, want[r])):
                col_kind = kind if c < D else (slot_kind or "float32")
                if col_kind == "float32":
                    assert g == pytest.approx(x, rel=1e-5, abs=1e-6)
                    continue
                lo, hi = np_rounding.neighbours(float(np.float32(x)), col_kind)
                tol = 4e-7 * abs(x) + 1e-30  # the float32 update against the float64 oracle
                around = {*np_rounding.neighbours(x - tol, col_kind), *np_rounding.neighbours(x + tol, col_kind)}
                assert g in around | {lo, hi}, (step, r, c, g, x)
                x32 = float(np.float32(x))
                if np_rounding.neighbours(x - tol, col_kind) == np_rounding.neighbours(x + tol, col_kind):
                    # no rounding boundary within float32 error: the stochastic choice itself is checked
                    assert g == np_rounding.stochastic_round(x32, col_kind, int(bits[r][c])), (step, r, c)
                    exact += 1
                checked += 1
    assert checked > 100 and exact > 0.5 * checked


def test_rounding_to_nearest_is_the_types_own_conversion_of_the_update() -> None:
    a = _module("sgd", torch.bfloat16, rounding="nearest")
    f = _module("sgd", None)
    f.load_state_dict({"t": a.embedding_tables["t"].float()})
    for step in range(3):
        _step(a, step)
        _step(f, step)
        assert torch.equal(a.embedding_tables["t"], f.embedding_tables["t"].to(torch.bfloat16))
        f.load_state_dict({"t": a.embedding_tables["t"].float()})  # SGD: the next update starts from it


@pytest.mark.parametrize(
    "kind, dim, combiner", [("float16", 6, "sum"), ("bfloat16", 64, "mean"), ("bfloat16", 70, "sqrtn")]
)
def test_lookups_pool_half_rows_in_float32_as_a_float32_table_of_the_same_values(
    kind: str, dim: int, combiner: str
) -> None:
    def make(dtype: Any) -> Any:
        table = et.TableConfig(V, dim, name="t", combiner=combiner, initializer=et.TruncatedNormal(seed=1), dtype=dtype)
        return et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adagrad(0.1))

    half, full = make(HALF[kind]), make(None)
    full.load_state_dict({"t": half.embedding_tables["t"].float()}, strict=False)
    ids = et.Ragged.from_lengths(torch.randint(0, V, (60,)), torch.tensor([3, 0, 5, 2, 4, 6, 20, 20]))
    half.eval()
    full.eval()
    got, want = half({"f": ids})["f"], full({"f": ids})["f"]
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("slot", [None, torch.bfloat16])
def test_the_same_seed_gives_the_same_bits_and_another_seed_other_bits(slot: Any) -> None:
    a, b, c = (_module("adagrad", torch.bfloat16, slot, seed=s) for s in (5, 5, 6))
    for step in range(4):
        for m in (a, b, c):
            _step(m, step)
    assert all(torch.equal(x, y) for x, y in zip(_stored(a).values(), _stored(b).values()))
    assert not torch.equal(a.embedding_tables["t"], c.embedding_tables["t"])


def test_pipelined_training_rounds_with_each_updates_own_step() -> None:
    plain = _module("adam", torch.bfloat16, torch.bfloat16)
    piped = _module("adam", torch.bfloat16, torch.bfloat16, pipeline_execution_with_tensor_core=True)
    for step in range(5):
        _step(plain, step)
        _step(piped, step)
    assert all(torch.equal(x, y) for x, y in zip(_stored(plain).values(), _stored(piped).values()))


def test_a_save_and_restore_in_the_middle_gives_the_same_bits(tmp_path: Path) -> None:
    straight = _module("adagrad", torch.float16, torch.float16)
    first = _module("adagrad", torch.float16, torch.float16)
    for step in range(3):
        _step(straight, step)
        _step(first, step)
    first.save(tmp_path)
    second = _module("adagrad", torch.float16, torch.float16)
    second.restore(tmp_path)
    for step in range(3, 6):
        _step(straight, step)
        _step(second, step)
    assert all(torch.equal(x, y) for x, y in zip(_stored(straight).values(), _stored(second).values()))


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind, slot_kind", [("bfloat16", None), ("float16", "float16"), ("bfloat16", "float16")])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("path", ["one call", "per table"])
def test_the_native_kernels_and_the_torch_reference_give_the_same_bits(
    opt: str, kind: str, slot_kind: str | None, rounding: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both native paths: the fast path's one call for every half table's lookup and one for every update
    (``HalfStep``), and the general path's (``lookup_half_many``; ``HalfUpdate`` a table), which every step the
    fast path declines takes."""
    if native_library.library() is None:
        pytest.skip("the native kernels are not built here")
    from embtables.kernels import native_half
    from embtables.tables.backends.native_fast_path import NativeFastPath

    calls = {"lookup_half_many": 0, "HalfUpdate": 0, "lookup": 0, "apply": 0}

    def counting(name: str, real: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return counted

    for name in ("lookup_half_many", "HalfUpdate"):
        monkeypatch.setattr(native_half, name, counting(name, getattr(native_half, name)))
    for name in ("lookup", "apply"):
        monkeypatch.setattr(native_half.HalfStep, name, counting(name, getattr(native_half.HalfStep, name)))
    if path == "per table":
        monkeypatch.setattr(NativeFastPath, "lookup", lambda self, *args: None)
        monkeypatch.setattr(NativeFastPath, "apply", lambda self, *args: False)
    dtypes = HALF[kind], HALF[slot_kind] if slot_kind else None
    with_c = _module(opt, *dtypes, rounding=rounding)
    seen_c = _lookups_of_steps(with_c, 4)
    one_call = path == "one call"
    expected = {"lookup": 4, "apply": 4, "lookup_half_many": 0, "HalfUpdate": 0} if one_call else \
        {"lookup": 0, "apply": 0, "lookup_half_many": 4, "HalfUpdate": 4}  # fmt: skip
    assert calls == expected  # one lookup and one update a step, on the path asked for
    arrays = with_c._engine.local.backend.fast._arrays  # phase 1 took the fast path's one call
    assert arrays is not None and arrays.half
    native_library.set_enabled(False)
    try:
        without = _module(opt, *dtypes, rounding=rounding)
        seen_torch = _lookups_of_steps(without, 4)
    finally:
        native_library.set_enabled(True)
    assert calls == expected
    assert all(torch.equal(a, b) for a, b in zip(seen_c, seen_torch))
    assert all(torch.equal(x, y) for x, y in zip(_stored(with_c).values(), _stored(without).values()))


def test_a_float16_overflow_is_refused_with_nothing_written() -> None:
    emb = _module("sgd", torch.float16)
    before = _stored(emb)
    ids = torch.tensor([1, 2])
    emb({"f": ids})
    with pytest.raises(InputError, match=r"float16 overflow \(\|value\| > 65504\)"):
        emb.apply_gradients({"f": torch.full((2, D), -1e6)})  # w - 0.3 * (-1e6) > 65504
    assert all(torch.equal(x, y) for x, y in zip(before.values(), _stored(emb).values()))
    with pytest.raises(RuntimeError, match="must be finite float16 values"):
        emb.load_state_dict({"t": torch.full((V, D), 7e4)}, strict=False)
    assert torch.equal(before["t"], emb.embedding_tables["t"])


@pytest.mark.parametrize("refusing", ["first", "second"])
def test_one_call_over_several_half_tables_refuses_all_or_nothing(
    refusing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path updates every half table in one native call, each in place as it is checked: when either
    table's update overflows float16, the tables it wrote are put back (in C) and the step raises naming it."""
    if native_library.library() is None:
        pytest.skip("the native kernels are not built here")
    results = _record_half_step_applies(monkeypatch)
    tables = [
        et.TableConfig(V, D, name=n, combiner="sum", initializer=et.Constant(0.5), dtype=torch.float16,
                       slot_dtype=torch.float16)
        for n in ("a", "b")
    ]  # fmt: skip
    emb = et.DistributedEmbedding({n: et.FeatureConfig(t) for n, t in zip("ab", tables)}, et.Adagrad(0.3))
    for _ in range(2):  # ordinary steps first: the rows hold updated values
        emb({"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])})
        emb.apply_gradients({"a": torch.full((2, D), 0.1), "b": torch.full((2, D), 0.2)})
    assert results == [[-1, -1], [-1, -1]]  # the one call wrote both tables
    before = _stored(emb)
    emb({"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])})
    name = "a" if refusing == "first" else "b"
    big = {n: torch.full((2, D), 1e4 if n == name else 0.3) for n in "ab"}
    with pytest.raises(InputError, match=f"table '{name}'.*float16 overflow"):
        emb.apply_gradients(big)  # g^2 = 1e8 overflows the float16 accumulator
    assert results[-1] == ([2, -1] if refusing == "first" else [-1, 4])  # the call's own refusal, nothing kept
    assert all(torch.equal(x, y) for x, y in zip(before.values(), _stored(emb).values()))


def test_checkpoints_convert_between_storage_types(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    full = _module("adagrad", None)
    _step(full, 0)
    full.save(tmp_path / "f32")
    half = _module("adagrad", torch.bfloat16, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="embtables"):
        half.restore(tmp_path / "f32")
    assert "dtype float32 in the checkpoint, bfloat16 here: converted rounded to nearest" in caplog.text
    for key, value in _stored(full).items():
        assert torch.equal(_stored(half)[key], value.to(torch.bfloat16))
    _step(half, 1)
    half.save(tmp_path / "bf16")
    back = _module("adagrad", None)
    back.restore(tmp_path / "bf16")  # bfloat16 values are float32 values: exact
    for key, value in _stored(half).items():
        assert torch.equal(_stored(back)[key], value.float())


def test_module_float_keeps_half_storage() -> None:
    emb = _module("adagrad", torch.bfloat16).float()
    assert emb.embedding_tables["t"].dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------- sharded, W = 2
def _distinct_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of 2B distinct ids: every row's summed gradient is one occurrence's, exact on any W."""
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randperm(V, generator=g)[: 2 * B]
    return ids, torch.randn(2 * B, D, generator=g)


def _sharded(rank: int, world: int, sharding: str, want_path: str, ckpt: str) -> None:
    from embtables.kernels import native_half

    want = torch.load(want_path)
    calls = {"lookup_half_many": 0, "HalfUpdate": 0}
    for name in calls:
        real = getattr(native_half, name)
        setattr(native_half, name, lambda *a, _r=real, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1)
                or _r(*a, **k))  # fmt: skip
    emb = _module("adagrad", torch.bfloat16, torch.bfloat16, sharding=sharding)
    lo, hi = rank * 2 * B // world, (rank + 1) * 2 * B // world
    for step in range(3):
        ids, grad = _distinct_batch(step)
        emb({"f": ids[lo:hi]})
        emb.apply_gradients({"f": grad[lo:hi]})
    got = emb.state_dict()
    for key, value in want.items():
        assert torch.equal(got[key], value), (rank, sharding, key)
    # each rank's rows are rounded by their global ids, held as the block or stride, not an id a row
    held = emb._engine.local._tables.global_rows["t"]
    assert isinstance(held, AffineRows) and torch.equal(held.tensor(), emb._engine.plans["t"].global_rows(rank))
    # the owners pooled and updated in C, each update computed once (checked at the ranks' agreement, then
    # written as computed, not computed again)
    assert calls["lookup_half_many"] == 3 and calls["HalfUpdate"] == 3, calls
    emb.save(ckpt)  # restored into the other strategy: each rank's rows read from the other layout
    other = _module("adagrad", torch.bfloat16, torch.bfloat16, sharding="mod" if sharding == "div" else "div")
    other.restore(ckpt)
    for key, value in other.state_dict().items():
        assert torch.equal(value, want[key]), (rank, sharding, key)


@pytest.mark.parametrize("sharding", ["div", "mod"])
def test_sharded_training_gives_one_processs_bits(sharding: str, tmp_path: Path) -> None:
    one = _module("adagrad", torch.bfloat16, torch.bfloat16)
    for step in range(3):
        ids, grad = _distinct_batch(step)
        one({"f": ids})
        one.apply_gradients({"f": grad})
    path = tmp_path / "want.pt"
    torch.save(_stored(one), path)
    run_world(_sharded, 2, sharding, str(path), str(tmp_path / "ckpt"))


@pytest.mark.parametrize("kind", sorted(HALF))
def test_a_half_table_exports_as_itself_and_serves_what_it_trained(kind: str, tmp_path: Path) -> None:
    emb = _module("adagrad", HALF[kind])
    for step in range(3):
        _step(emb, step)
    emb.save(tmp_path / "ckpts")
    et.export(tmp_path / "ckpts", tmp_path / "serve", kind)  # the table's own type: exact
    served = et.ServingEmbedding.load(tmp_path / "serve")
    query = {"f": torch.arange(V)}
    emb.eval()
    assert torch.equal(served(query)["f"], emb(query)["f"])
    et.export(tmp_path / "ckpts", tmp_path / "serve32")  # converted to float32: exact too
    assert torch.equal(et.ServingEmbedding.load(tmp_path / "serve32")(query)["f"], emb(query)["f"])


def test_the_estimators_embedding_columns_take_the_storage_types() -> None:
    from embtables.estimator import EmbeddingConfigSpec, categorical_column_with_identity, embedding_column

    col = embedding_column(categorical_column_with_identity("x", 10), 4, dtype=torch.bfloat16, slot_dtype="bfloat16")
    spec = EmbeddingConfigSpec(feature_columns=[col], optimization_parameters=et.Adagrad(0.1))
    (table,) = {f.table.name: f.table for f in spec.feature_config(lambda: 0).values()}.values()
    assert table.storage == "bfloat16" and table.slot_storage == "bfloat16"
    with pytest.raises(ConfigError, match="`dtype` must be"):
        embedding_column(categorical_column_with_identity("x", 10), 4, dtype=torch.float64)


def test_a_dynamic_half_table_trains_and_restores(tmp_path: Path) -> None:
    def make() -> Any:
        table = et.TableConfig(20, 4, name="u", combiner="sum", dtype=torch.bfloat16, slot_dtype=torch.bfloat16,
                               initializer=et.Constant(0.3),  # a reused row starts alike in both
                               dynamic=et.DynamicVocabulary(admit_after=1, eviction="lru"))  # fmt: skip
        return et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adagrad(0.1))

    emb = make()
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # keys beyond the 20 rows: rows are reused
        emb({"f": torch.randint(0, 10**12, (8,), generator=g)})
        emb.apply_gradients({"f": torch.randn(8, 4, generator=g)})
    assert emb.vocabulary_statistics()["u"]["evicted"] > 0
    emb.save(tmp_path)
    back = make()
    back.restore(tmp_path)
    assert all(torch.equal(x, y) for x, y in zip(_stored(emb).values(), _stored(back).values()))
    assert back.embedding_tables["u"].dtype == torch.bfloat16
    for _ in range(5):  # the restored table rounds with the same keys' bits as the one that went on
        ids, grad = torch.randint(0, 10**12, (8,), generator=g), torch.randn(8, 4, generator=g)
        for m in (emb, back):
            m({"f": ids})
            m.apply_gradients({"f": grad})
    assert all(torch.equal(x, y) for x, y in zip(_stored(emb).values(), _stored(back).values()))


@pytest.mark.parametrize("refusing", ["half", "float32"])
def test_a_refusal_by_either_table_leaves_both_as_they_were(refusing: str) -> None:
    """The half table is written in place as it is checked; a refusal by the float32 table written after it
    (its dry run in the same call) puts the half table's rows back."""
    half = et.TableConfig(V, D, name="h", combiner="sum", initializer=et.Constant(0.5), dtype=torch.float16)
    full = et.TableConfig(V, D, name="w", combiner="sum", initializer=et.Constant(0.5))
    emb = et.DistributedEmbedding({"a": et.FeatureConfig(half), "b": et.FeatureConfig(full)}, et.SGD(0.3))
    emb.load_state_dict({"w": torch.full((V, D), 3e38)}, strict=False)
    for _ in range(2):  # ordinary steps first: the rows hold updated values
        emb({"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])})
        emb.apply_gradients({"a": torch.full((2, D), 0.1), "b": torch.zeros(2, D)})
    before = _stored(emb)
    emb({"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])})
    big_a = torch.full((2, D), -1e6 if refusing == "half" else 0.25)
    big_b = torch.full((2, D), -3e38 if refusing == "float32" else 0.0)
    with pytest.raises(InputError, match=f"table '{'h' if refusing == 'half' else 'w'}'"):
        emb.apply_gradients({"a": big_a, "b": big_b})
    assert all(torch.equal(x, y) for x, y in zip(before.values(), _stored(emb).values()))


def test_a_tf_bundle_of_a_half_table_holds_its_values_as_float32(tmp_path: Path) -> None:
    from embtables.checkpoint import read_tf_checkpoint, write_tf_checkpoint

    emb = _module("adagrad", torch.bfloat16, torch.bfloat16)
    _step(emb, 0)
    write_tf_checkpoint(tmp_path / "tf" / "ckpt", emb.state_dict())
    back = read_tf_checkpoint(tmp_path / "tf" / "ckpt")
    for key, value in _stored(emb).items():
        assert back[key].dtype == torch.float32 and torch.equal(back[key], value.float())


def _dynamic_half() -> Any:
    table = et.TableConfig(200, D, name="u", combiner="sum", dtype=torch.bfloat16, slot_dtype=torch.bfloat16,
                           initializer=et.Constant(0.3),  # a new key's row starts alike on any W
                           dynamic=et.DynamicVocabulary(admit_after=1, eviction="lru"))  # fmt: skip
    return et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adagrad(0.2))


def _dynamic_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """2B distinct keys from a space far larger than the table: every key's summed gradient is one occurrence's."""
    g = torch.Generator().manual_seed(300 + step)
    keys = torch.unique(torch.randint(0, 10**15, (4 * B,), generator=g))[: 2 * B]
    return keys[torch.randperm(keys.numel(), generator=g)], torch.randn(2 * B, D, generator=g)


def _by_key(emb: Any) -> dict[int, tuple[list[int], ...]]:
    """Each live key's stored bits: {key: (weights row bits, accumulator row bits)}."""
    sd = emb.state_dict()
    live = sd["u/counts"] > 0
    keys = sd["u/keys"][live].tolist()
    w, a = sd["u"][live].view(torch.int16), sd["u/accumulators"][live].view(torch.int16)
    return {k: (w[i].tolist(), a[i].tolist()) for i, k in enumerate(keys)}


def _dynamic_sharded(rank: int, world: int, want_path: str) -> None:
    want = torch.load(want_path)
    emb = _dynamic_half()
    lo, hi = rank * 2 * B // world, (rank + 1) * 2 * B // world
    for step in range(3):
        keys, grad = _dynamic_batch(step)
        emb({"f": keys[lo:hi]})
        emb.apply_gradients({"f": grad[lo:hi]})
    got = _by_key(emb)
    assert got.keys() == want.keys(), rank
    for key, bits in want.items():
        assert got[key] == bits, (rank, key)


def test_a_dynamic_half_table_rounds_by_key_the_same_bits_on_any_world_size(tmp_path: Path) -> None:
    """A dynamic table's rows are numbered differently on W = 1 and W = 2 (each owner its own key map): the
    rounding's bits come from each row's key (spec §12.1), so every key's stored values are the same bits."""
    one = _dynamic_half()
    for step in range(3):
        keys, grad = _dynamic_batch(step)
        one({"f": keys})
        one.apply_gradients({"f": grad})
    want = _by_key(one)
    assert len(want) == 3 * 2 * B
    path = tmp_path / "want.pt"
    torch.save(want, path)
    run_world(_dynamic_sharded, 2, str(path))


def _accumulators_after(rounding: str, slot_dtype: Any, steps: int = 400) -> torch.Tensor:
    table = et.TableConfig(64, 8, name="t", combiner="sum", initializer=et.Constant(0.5), dtype=torch.bfloat16,
                           slot_dtype=slot_dtype, rounding=rounding)  # fmt: skip
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adagrad(0.001, initial_accumulator_value=0.1))
    ids, grad = torch.arange(64), torch.full((64, 8), 0.01)
    for _ in range(steps):
        emb({"f": ids})
        emb.apply_gradients({"f": grad})
    return emb.slot_variables["t"]["accumulators"].float()


def test_a_bfloat16_accumulator_stalls_rounded_to_nearest_and_grows_rounded_stochastically() -> None:
    """spec §12.1, half slots: g^2 = 1e-4 is below half a bfloat16 ulp of 0.1 (2.4e-4), so round-to-nearest
    never moves the accumulator; stochastic rounding adds 1e-4 per step in expectation, as float32 does."""
    exact = _accumulators_after("stochastic", None)  # float32 slots
    assert exact.mean().item() == pytest.approx(0.14, rel=1e-3)
    nearest = _accumulators_after("nearest", torch.bfloat16)
    assert torch.equal(nearest, torch.full_like(nearest, float(torch.tensor(0.1).bfloat16())))  # stalled
    stochastic = _accumulators_after("stochastic", torch.bfloat16)
    assert stochastic.mean().item() == pytest.approx(0.14, rel=0.01)
    assert stochastic.std().item() < 0.01  # 0.0049 measured


def test_the_one_call_update_grows_its_scratch_as_steps_prepare_more_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HalfStep`` keeps each table's scratch between steps and grows it when a step prepares more rows than the
    smallest scratch holds (one C call says whether any does): steps of 1, 5, 30, 2 and 40 rows all take the one
    call and train the torch reference's bits."""
    if native_library.library() is None:
        pytest.skip("the native kernels are not built here")
    applied = _record_half_step_applies(monkeypatch)

    def train() -> dict[str, torch.Tensor]:
        emb = _module("adagrad", torch.bfloat16, torch.bfloat16)
        for n in (1, 5, 30, 2, 40):
            emb({"f": torch.arange(n)})
            emb.apply_gradients({"f": torch.full((n, D), 0.1)})
        return _stored(emb)

    with_c = train()
    assert applied == [[-1]] * 5  # every step's update in the one call
    native_library.set_enabled(False)
    try:
        without = train()
    finally:
        native_library.set_enabled(True)
    assert all(torch.equal(x, y) for x, y in zip(with_c.values(), without.values()))
