"""An offloaded table (``TableConfig.offload``, docs/offload.md) trains to the same bits as the same table in
memory: every optimizer, combiner and input type, pipelined or not, float32 and half-precision rows, with a
cache far smaller than the rows a step touches, so rows are written back and read again at every step.

The in-memory reference starts from the offloaded table's initial state (its ``state_dict``), then both take
the same batches and gradients; activations, tables and slots are compared bit for bit after every step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import embtables as et

OPTIMIZERS: dict[str, Any] = {
    "sgd": lambda: et.SGD(0.3),
    "sgd-noacc": lambda: et.SGD(0.3, use_gradient_accumulation=False),
    "adagrad": lambda: et.Adagrad(0.2, clipvalue=1.5),
    "adagrad-noacc": lambda: et.Adagrad(0.2, use_gradient_accumulation=False),
    "adagrad-momentum": lambda: et.AdagradMomentum(0.1, momentum=0.9),
    "adam": lambda: et.Adam(0.05),
    "ftrl": lambda: et.FTRL(0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.01),
    "proximal-adagrad": lambda: et.ProximalAdagrad(0.1, l1_regularization_strength=0.01),
    "momentum": lambda: et.Momentum(0.2, momentum=0.5),
    "rmsprop": lambda: et.RMSProp(0.05, momentum=0.5),
    "centered-rmsprop": lambda: et.CenteredRMSProp(0.05, momentum=0.5),
    "adadelta": lambda: et.Adadelta(1.0),
    "proximal-yogi": lambda: et.ProximalYogi(0.05),
    "decay": lambda: et.Adagrad(0.2, weight_decay_factor=0.01),
}
V, D = 100_000, 64  # a step looks up about 40 distinct rows of "big"; its cache holds 100 (two steps' rows)


def _features(directory: Path | None, opt: Any, dtype: Any = None, cache_rows: int = 100) -> dict[str, Any]:
    offload = et.Offload(directory, cache_rows) if directory is not None else None
    big = et.TableConfig(V, D, name="big", combiner="sum", optimizer=opt, offload=offload, dtype=dtype)
    whole = et.Offload(directory, 512) if directory is not None else None  # all of its 500 rows
    small = et.TableConfig(
        500, 8, name="small", combiner="sqrtn", optimizer=opt, offload=whole, initializer=et.TruncatedNormal(seed=3)
    )
    return {
        "a": et.FeatureConfig(big),  # pooled, weighted
        "b": et.FeatureConfig(big, max_sequence_length=3),  # a sequence feature on the same table
        "c": et.FeatureConfig(small),  # dense [B, 2] input
    }


def _batch(step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    g = torch.Generator().manual_seed(10 + step)
    a = [torch.randint(0, V, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist() for _ in range(8)]
    a[0] += [a[0][0]] if a[0] else [5]  # a duplicate id in one bag
    b = [torch.randint(0, V, (2,), generator=g).tolist() for _ in range(8)]
    c = torch.randint(0, 500, (8, 2), generator=g)
    weights = [[0.5 + 0.25 * k for k in range(len(row))] for row in a]
    feats = {"a": et.Ragged.from_lists(a), "b": et.Ragged.from_lists(b), "c": c}
    return feats, {"a": et.Ragged.from_lists(weights, dtype=torch.float32), "b": None, "c": None}


def _grads(step: int, acts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {k: torch.randn(v.shape, generator=g) for k, v in sorted(acts.items())}


def _same(x: torch.Tensor, y: torch.Tensor, what: object) -> None:
    assert x.dtype == y.dtype and x.shape == y.shape, what
    assert torch.equal(x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32),
                       y.view(torch.int16) if y.element_size() == 2 else y.view(torch.int32)), what  # fmt: skip


def _big_rows(feats: dict[str, Any]) -> torch.Tensor:
    """The distinct rows of "big" a batch of ``_batch`` looks up [U], ascending."""
    return torch.unique(torch.cat([feats["a"].values, feats["b"].values]))


def _offloaded_and_in_memory(
    tmp_path: Path, opt: Callable[[], Any], *, pipelined: bool = False, dtype: Any = None, cache_rows: int = 100
) -> tuple[Any, Any]:
    """The offloaded module and the same tables in memory, starting from the offloaded one's initial rows."""
    torch.manual_seed(0)
    off = et.DistributedEmbedding(
        _features(tmp_path / "off", opt(), dtype, cache_rows), pipeline_execution_with_tensor_core=pipelined
    )
    torch.manual_seed(0)  # a twin with the same seed gives the reference its initial rows: the trained
    twin = et.DistributedEmbedding(_features(tmp_path / "twin", opt(), dtype))  # one reads lazily
    ref = et.DistributedEmbedding(_features(None, opt(), dtype), pipeline_execution_with_tensor_core=pipelined)
    ref.load_state_dict(twin.state_dict())
    return off, ref


def _train_side_by_side(
    tmp_path: Path,
    opt_name: str,
    *,
    pipelined: bool = False,
    dtype: Any = None,
    state_every_step: bool = False,
    cache_rows: int = 100,
) -> Any:
    off, ref = _offloaded_and_in_memory(
        tmp_path, OPTIMIZERS[opt_name], pipelined=pipelined, dtype=dtype, cache_rows=cache_rows
    )
    for step in range(4):
        feats, weights = _batch(step)
        got, want = off(feats, weights), ref(feats, weights)
        for k in want:
            _same(got[k], want[k], (opt_name, step, k))
        grads = _grads(step, want)
        off.apply_gradients(grads)
        ref.apply_gradients(grads)
        if state_every_step:  # a whole-table read: the cache writes everything back and starts empty
            for key, value in ref.state_dict().items():
                _same(off.state_dict()[key], value, (opt_name, step, key))
    for key, value in ref.state_dict().items():
        _same(off.state_dict()[key], value, (opt_name, "end", key))
    return off


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_an_offloaded_table_trains_to_the_bits_of_the_table_in_memory(opt_name: str, tmp_path: Path) -> None:
    off = _train_side_by_side(tmp_path, opt_name)
    stats = off.offload_statistics()["big"]
    assert stats["evictions"] > 0 and stats["rows_written"] > 0 and stats["rows_read"] > 0, stats
    assert stats["resident_rows"] <= stats["cache_rows"] <= 100, stats
    assert stats["rows_prefetched"] == 0, stats  # module(features): the lookup follows at once, nothing read ahead


def test_reading_the_whole_table_between_steps_changes_nothing(tmp_path: Path) -> None:
    off = _train_side_by_side(tmp_path, "ftrl", state_every_step=True)
    assert off.offload_statistics()["big"]["rows_written"] > 0


def test_pipelined_training_of_an_offloaded_table_is_exact(tmp_path: Path) -> None:
    _train_side_by_side(tmp_path, "adagrad", pipelined=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_on_disk_are_exact(dtype: torch.dtype, tmp_path: Path) -> None:
    off = _train_side_by_side(tmp_path, "adam", dtype=dtype)  # rows evicted and read again: rounded by global id
    assert off.embedding_tables["big"].dtype == dtype
    records = next(p for p in (tmp_path / "off").iterdir() if p.name.startswith("big.") and p.name.endswith(".rows"))
    slots = off.slot_variables["big"]  # Adam's m and v (float32 here: the table's slots_dtype)
    record = D * 2 + sum(D * s.element_size() for s in slots.values())  # no padding: D * 2 % 8 == 0
    assert records.stat().st_size == V * record  # the file holds half-precision rows


def test_the_initial_rows_do_not_depend_on_the_cache_or_the_order_rows_are_first_read(tmp_path: Path) -> None:
    """Row r's initial values are the initializer's draw for its block, from the table's seed."""
    states = []
    for k, (cache, first) in enumerate([(1024, [V - 1, 17]), (4096, [17, 1500, V - 1])]):
        torch.manual_seed(0)
        emb = et.DistributedEmbedding(_features(tmp_path / str(k), et.Adagrad(0.1), cache_rows=cache), et.SGD(0.1))
        emb({"a": torch.tensor([first]), "b": et.Ragged.from_lists([[0]]), "c": torch.tensor([[0, 1]])})
        states.append(emb.state_dict())
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key
    weights = states[0]["big"]
    assert weights.std().item() == pytest.approx(1 / D**0.5 * 0.88, rel=0.05)  # TF's truncated normal
    assert not torch.equal(weights[:1024], weights[1024:2048])  # every block its own draw
    torch.manual_seed(1)  # another global seed: other values
    other = et.DistributedEmbedding(_features(tmp_path / "other", et.Adagrad(0.1)), et.SGD(0.1))
    assert not torch.equal(other.state_dict()["big"], weights)
    assert torch.equal(other.state_dict()["small"], states[0]["small"])  # its initializer has its own seed


def test_the_next_batch_enqueued_before_the_update_is_read_ahead_and_changes_nothing(tmp_path: Path) -> None:
    """``enqueue(next)`` before ``apply_gradients()``: the next batch's rows on disk start coming in (the page
    cache) while the step finishes; the results are the same bits."""
    off, ref = _offloaded_and_in_memory(tmp_path, lambda: et.Adagrad(0.2))
    off.enqueue(*_batch(0))
    for step in range(6):
        got = off.dequeue()
        want = ref(*_batch(step))
        for k in want:
            _same(got[k], want[k], (step, k))
        if step + 1 < 6:
            off.enqueue(*_batch(step + 1))  # read ahead while this step's update runs
        grads = _grads(step, want)
        off.apply_gradients(grads)
        ref.apply_gradients(grads)
    for key, value in ref.state_dict().items():
        _same(off.state_dict()[key], value, key)
    stats = off.offload_statistics()["big"]
    assert stats["rows_prefetched"] > 0 and stats["rows_read_ahead"] > 0, stats  # taken, not read again


def test_without_the_native_library_the_row_io_is_done_in_python_with_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from embtables.tables import offload_files

    monkeypatch.setattr(offload_files.native_library, "library", lambda **_: None)
    off = _train_side_by_side(tmp_path, "adagrad")
    stats = off.offload_statistics()["big"]
    assert stats["evictions"] > 0 and stats["rows_written"] > 0, stats


def _batch_rows() -> int:
    """The most distinct rows of "big" one batch of ``_batch`` looks up (steps 0-3)."""
    most = 0
    for step in range(4):
        feats, _ = _batch(step)
        most = max(most, int(_big_rows(feats).numel()))
    return most


@pytest.mark.parametrize(("batches", "pipelined"), [(1, False), (2, False), (2, True), (3, True)])
def test_caches_of_one_to_three_batches_train_exactly(batches: int, pipelined: bool, tmp_path: Path) -> None:
    """A cache of exactly one batch's distinct rows trains (a pipelined step keeps the previous batch's too: two
    batches); every step evicts, writes back and reads again, and the bits are the table in memory's."""
    cache = batches * _batch_rows()
    off = _train_side_by_side(tmp_path, "adagrad", pipelined=pipelined, cache_rows=cache)
    stats = off.offload_statistics()["big"]
    assert stats["evictions"] > 0 and stats["rows_written"] > 0 and stats["cache_rows"] == cache, stats


def test_a_pipelined_module_whose_state_is_read_every_step_stays_exact(tmp_path: Path) -> None:
    """Reading the state between pipelined steps lands the held-back update and keeps its rows' pre-update values
    for the next lookup (by row: the cache's slots may change); the offloaded table gives the in-memory bits."""
    off = _train_side_by_side(tmp_path, "adagrad", pipelined=True, state_every_step=True)
    assert off.offload_statistics()["big"]["rows_written"] > 0


def test_an_edit_through_a_tensor_handed_out_is_seen_by_the_next_lookup(tmp_path: Path) -> None:
    """``embedding_tables`` of an offloaded table are its files' maps: an in-place edit made before the next lookup
    is what that lookup and its update compute on, as for the table in memory."""
    off, ref = _offloaded_and_in_memory(tmp_path, lambda: et.Adagrad(0.2))
    for step in (0, 0, 1, 1, 2):  # a batch again: its rows are in the cache when they are edited
        feats, weights = _batch(step)
        ids = _big_rows(feats)
        for emb in (off, ref):  # rows of this batch edited in place
            with torch.no_grad():
                emb.embedding_tables["big"][ids[::2]] += 0.5
        got, want = off(feats, weights), ref(feats, weights)
        for k in want:
            _same(got[k], want[k], (step, k))
        grads = _grads(step, want)
        off.apply_gradients(grads)
        ref.apply_gradients(grads)
    for key, value in ref.state_dict().items():
        _same(off.state_dict()[key], value, key)


def test_a_staged_batch_read_ahead_is_dropped_when_the_files_change_before_its_lookup(tmp_path: Path) -> None:
    """``enqueue(next)`` reads the next batch's missing rows in the background; an in-place edit through
    ``embedding_tables`` before its lookup writes the files those rows were read from, so the lookup reads them
    again: the bits are those of the table in memory given the same edit."""
    off, ref = _offloaded_and_in_memory(tmp_path, lambda: et.Adagrad(0.2))
    off.enqueue(*_batch(0))
    for step in range(4):
        got = off.dequeue()
        want = ref(*_batch(step))
        for k in want:
            _same(got[k], want[k], (step, k))
        grads = _grads(step, want)
        off.apply_gradients(grads)
        ref.apply_gradients(grads)
        if step + 1 < 4:
            off.enqueue(*_batch(step + 1))  # read ahead: the next batch's rows not in the cache
            feats, _ = _batch(step + 1)
            ids = _big_rows(feats)
            for emb in (off, ref):  # then written through the files' maps before the lookup
                with torch.no_grad():
                    emb.embedding_tables["big"][ids] *= 0.5
    for key, value in ref.state_dict().items():
        _same(off.state_dict()[key], value, key)


@pytest.mark.parametrize("opt_name", ["adagrad", "adam"])
def test_tables_that_admit_at_once_train_to_the_same_bits(
    opt_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where an admission is large (``PARALLEL_IDS``, lowered here to every admission) the tables admit on
    threads at once: the slots each gets back are its own, so the bits are still those of memory; a cache too
    small is refused naming its table, as one table at a time."""
    from embtables.tables import offloaded_tables

    monkeypatch.setattr(offloaded_tables, "PARALLEL_IDS", 1)
    off = _train_side_by_side(tmp_path / "fits", opt_name)
    assert off._engine.offloaded._executor is not None  # the tables admitted on the pool
    stats = off.offload_statistics()["big"]
    assert stats["evictions"] > 0 and stats["rows_read"] > 0, stats
    off.close()
    small, _ = _offloaded_and_in_memory(tmp_path / "small", OPTIMIZERS[opt_name], cache_rows=8)
    feats, weights = _batch(0)
    with pytest.raises(et.InputError, match=r"table 'big'.*Offload\(cache_rows=8\)"):
        small(feats, weights)
