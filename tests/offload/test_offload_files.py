"""An offloaded table's files (docs/offload.md): created sparse and initialized lazily, locked against a
second trainer, never written over another program's files; the memory it keeps is bounded by its cache; what
it cannot do is refused at construction with the rule and the fix; its checkpoints restore anywhere."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from subproc import run_python

import embtables as et


def _module(
    directory: Path, vocabulary_size: int = 30_000, cache_rows: int = 8192, **kw: Any
) -> et.DistributedEmbedding:
    """A 64-wide Adagrad table."""
    offload = et.Offload(directory, cache_rows)
    table = et.TableConfig(vocabulary_size, 64, name="t", combiner="sum", offload=offload, **kw)
    return et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adagrad(0.1))


def test_a_huge_table_is_created_sparse_and_its_rows_initialized_when_first_read(tmp_path: Path) -> None:
    emb = _module(tmp_path, vocabulary_size=50_000_000)  # 12.8 GB of weights and 12.8 GB of accumulators
    files = sorted(p for p in tmp_path.iterdir() if p.name.endswith(".rows"))
    assert [p.stat().st_size for p in files] == [50_000_000 * 64 * 4 * 2]  # one record a row: weights, then slot
    assert sum(p.stat().st_blocks * 512 for p in files) < 1 << 20  # nothing written yet
    acts = emb({"f": torch.tensor([[7, 49_999_999]])})["f"]
    emb.apply_gradients({"f": torch.ones_like(acts)})
    stats = emb.offload_statistics()["t"]
    assert stats["initialized_rows"] == 1024 + 50_000_000 % 1024  # the blocks of 1024 rows of the two ids
    assert stats["init_s"] > 0  # the time it took is counted (docs/offload.md's counters add up)
    assert sum(p.stat().st_blocks * 512 for p in files) < 16 << 20
    assert 0 < acts.abs().max().item() < 1  # TF's truncated normal rows, not the sparse file's zeros


def test_a_directory_with_files_embtables_did_not_write_is_refused_and_left_alone(tmp_path: Path) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("keep me")
    fake = tmp_path / "t.w1r0.rows"  # our name, but no record of ours lists it
    fake.write_bytes(b"x" * 10)
    with pytest.raises(ValueError, match=r"files embtables did not write.*'notes.txt'.*empty directory"):
        _module(tmp_path)
    assert mine.read_text() == "keep me" and fake.read_bytes() == b"x" * 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "t.w1r0.rows"]


def test_a_record_that_is_not_ours_does_not_vouch_for_files(tmp_path: Path) -> None:
    (tmp_path / "t.w1r0.meta.json").write_text('{"magic": "something else", "files": {}, "lock": "x"}')
    with pytest.raises(ValueError, match=r"did not write.*t.w1r0.meta.json"):
        _module(tmp_path)


def test_two_trainers_on_one_table_directory_are_refused(tmp_path: Path) -> None:
    first = _module(tmp_path)
    first({"f": torch.tensor([[1, 2]])})
    with pytest.raises(ValueError, match="in use by another module or process"):
        _module(tmp_path)
    code = f"""
        import embtables as et
        t = et.TableConfig(30_000, 64, name="t", offload=et.Offload({str(tmp_path)!r}, 8192))
        try:
            et.DistributedEmbedding({{"f": et.FeatureConfig(t)}}, et.SGD(0.1))
        except ValueError as exc:
            print("refused:", exc)
    """
    assert "in use by another module or process" in run_python(code)
    before = first.state_dict()["t"].clone()
    del first
    import gc

    gc.collect()
    second = _module(tmp_path)  # the first module is gone: its lock with it; the files start afresh
    assert second.offload_statistics()["t"]["initialized_rows"] == 0
    assert second.offload_statistics()["t"]["init_s"] == 0
    assert before.abs().max() > 0  # a state_dict kept past its module still reads (its file was unlinked)


def test_a_whole_table_access_beyond_the_cache_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``state_dict()`` of a table larger than its cache maps (and first initializes) every row: said once per
    table, with its size and the streaming alternative; a table within its cache says nothing."""
    big, small = _module(tmp_path / "big"), _module(tmp_path / "small", vocabulary_size=4096)
    with caplog.at_level(logging.WARNING, logger="embtables"):
        big({"f": torch.tensor([[1, 2]])})  # one block of 1024 rows initialized
        for _ in range(2):
            assert big.state_dict()["t"].shape == (30_000, 64) and big.embedding_tables["t"].shape == (30_000, 64)
        small.state_dict()
    said = [r.getMessage() for r in caplog.records if "whole-table access" in r.getMessage()]
    assert len(said) == 1, said
    assert "table 't'" in said[0] and "all 30000 rows (0.01 GiB" in said[0] and "cache of 8192 rows" in said[0]
    assert "the 28976 rows never read" in said[0] and "save() streams" in said[0]


def test_close_releases_the_files_at_once_and_the_closed_module_refuses_them(tmp_path: Path) -> None:
    """``close()``: the lock goes now, not when Python collects the module (a reference cycle may keep it for a
    while); the closed module refuses every access to its files with the reason and the fix, and what it handed
    out still reads; a second module on the directory trains and restores the first one's checkpoint."""
    first = _module(tmp_path / "rows")
    acts = first({"f": torch.tensor([[1, 2], [3, 40]])})["f"]
    first.apply_gradients({"f": torch.ones_like(acts)})
    saved = first.save(tmp_path / "ckpt")
    handed_out = first.embedding_tables["t"]
    expected = handed_out[[1, 2, 3, 40]].clone()
    keep = first  # a reference the test holds: without close() the lock stays taken
    acts = first({"f": torch.tensor([[1, 2], [3, 40]])})["f"]  # looked up before the close, updated after it
    first.close()
    with pytest.raises(et.ClosedFilesError, match=r"table 't': the module was closed \(close\(\)\)"):
        first.apply_gradients({"f": torch.ones_like(acts)})
    assert torch.equal(handed_out[[1, 2, 3, 40]], expected)  # nothing was written
    first.close()  # again: nothing more to release
    second = _module(tmp_path / "rows")
    for access in (
        lambda: keep({"f": torch.tensor([[1]])}),
        lambda: keep.save(tmp_path / "ckpt2"),  # a CheckpointError carrying the reason
        lambda: keep.state_dict(),
        lambda: keep.restore(saved),
    ):
        with pytest.raises(Exception, match=r"table 't': the module was closed \(close\(\)\).*restore\(\)"):
            access()
    assert not (tmp_path / "ckpt2").exists() or not any((tmp_path / "ckpt2").glob("ckpt-*"))
    assert torch.equal(handed_out[[1, 2, 3, 40]], expected)  # its maps stay readable
    second.restore(saved)
    assert torch.equal(second.embedding_tables["t"][[1, 2, 3, 40]], expected)
    acts = second({"f": torch.tensor([[1, 2]])})["f"]
    second.apply_gradients({"f": torch.ones_like(acts)})
    second.close()
    third = _module(tmp_path / "rows")  # the lock was released without garbage collection
    third.close()


def test_a_batch_whose_rows_do_not_fit_the_cache_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    emb = _module(tmp_path, cache_rows=3)
    emb({"f": et.Ragged.from_lists([[0, 1]])})
    emb.apply_gradients({"f": torch.ones(1, 64)})
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    with pytest.raises(ValueError, match=r"need 4 rows in memory.*cache_rows=3.*Raise cache_rows"):
        emb({"f": et.Ragged.from_lists([[0, 300, 600, 900]])})
    for k, v in emb.state_dict().items():
        assert torch.equal(v, before[k]), k
    emb({"f": et.Ragged.from_lists([[0, 300]])})  # a batch that fits goes on
    emb.apply_gradients({"f": torch.ones(1, 64)})


def test_resident_memory_stays_bounded_by_the_cache(tmp_path: Path) -> None:
    """A 400k x 64 Adagrad table (205 MB of rows and slots) with an 8192-row cache (4 MB): every step reads
    and writes back new rows; the process's resident memory grows by far less than the table."""
    code = f"""
        import torch, embtables as et
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
        t = et.TableConfig(400_000, 64, name="t", combiner="sum", offload=et.Offload({str(tmp_path / "rows")!r}, 8192))
        emb = et.DistributedEmbedding({{"f": et.FeatureConfig(t)}}, et.Adagrad(0.1))
        g = torch.Generator().manual_seed(0)
        for step in range(3):  # warm up the allocator and the step's buffers
            a = emb({{"f": torch.randint(0, 400_000, (8, 2), generator=g)}})["f"]
            emb.apply_gradients({{"f": torch.ones_like(a)}})
        start = rss()
        for step in range(300):  # 38400 rows looked up: once the cache is full, as many read and written back
            a = emb({{"f": torch.randint(0, 400_000, (64, 2), generator=g)}})["f"]
            emb.apply_gradients({{"f": torch.ones_like(a)}})
        s = emb.offload_statistics()["t"]
        grown = (rss() - start) >> 20
        path = emb.save({str(tmp_path / "ckpt")!r})  # streamed from the files
        saved = (rss() - start) >> 20
        emb.restore(path)  # written piece by piece, each piece written back and dropped
        restored = (rss() - start) >> 20
        print(grown, saved, restored, s["resident_rows"], s["rows_written"], s["evictions"])
    """
    out = run_python(code, timeout=300).split()
    grown_mb, saved_mb, restored_mb, resident, written, evictions = (int(float(x)) for x in out)
    assert resident <= 8192 and written > 20_000 and evictions > 20_000
    assert grown_mb < 40, grown_mb  # the table is 205 MB: the pages touched would show without eviction
    assert saved_mb < 60 and restored_mb < 60, (saved_mb, restored_mb)  # not the table's 205 MB either


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"initializer": lambda shape, dtype: torch.zeros(shape)}, "draw any block of rows on its own"),
    ],
)
def test_what_an_offloaded_table_cannot_do_is_refused_at_table_config(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        et.TableConfig(10, 4, offload=et.Offload("/tmp/x", 100), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "match"),
    [(("", 10), "non-empty path"), (("/tmp/x", 0), "cache_rows"), (("/tmp/x", True), "cache_rows")],
)
def test_offload_arguments_are_validated(args: tuple[object, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        et.Offload(*args)  # type: ignore[arg-type]


def test_the_estimators_embedding_columns_take_offload(tmp_path: Path) -> None:
    from embtables.errors import ConfigError
    from embtables.estimator import EmbeddingConfigSpec, categorical_column_with_identity, embedding_column

    offload = et.Offload(tmp_path / "rows", 256)
    col = embedding_column(categorical_column_with_identity("x", 10_000), 64, offload=offload)
    spec = EmbeddingConfigSpec(feature_columns=[col], optimization_parameters=et.Adagrad(0.1))
    (table,) = {f.table.name: f.table for f in spec.feature_config(lambda: 0).values()}.values()
    assert table.offload == offload
    with pytest.raises(ConfigError, match=r"`offload` must be an embtables\.Offload or None, got str"):
        embedding_column(categorical_column_with_identity("x", 10), 4, offload=str(tmp_path))  # type: ignore[arg-type]


def test_non_lazy_adam_gpu_tables_and_copies_are_refused(tmp_path: Path) -> None:
    table = et.TableConfig(100, 64, name="t", offload=et.Offload(tmp_path / "a", 256))
    with pytest.raises(ValueError, match="lazy_adam=True"):
        et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adam(0.1, lazy_adam=False))
    with pytest.raises(ValueError, match="lives on the CPU"):
        et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.SGD(0.1), device="meta")
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.SGD(0.1))
    with pytest.raises(ValueError, match="stays on the CPU"):
        emb.to("meta")
    import copy

    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copy.deepcopy(emb)
    assert os.listdir(tmp_path / "a")  # the module still works after the refusals
    emb({"f": torch.tensor([[1]])})


def test_checkpoints_of_an_offloaded_table_restore_in_memory_and_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save writes the table's blocks together, each row's record read once (not once a block: the weights and
    the accumulators); the checkpoint restores into memory and into another offloaded module, bit for bit."""
    from embtables.tables.offload_cache import OffloadedRows

    read: list[int] = []
    real = OffloadedRows.read_records

    def counted(self: OffloadedRows, lo: int, hi: int) -> torch.Tensor:
        read.append(hi - lo)
        return real(self, lo, hi)

    monkeypatch.setattr(OffloadedRows, "read_records", counted)
    torch.manual_seed(0)
    off = _module(tmp_path / "rows", cache_rows=1024)
    for _ in range(3):
        a = off({"f": torch.randint(0, 30_000, (16, 3))})["f"]
        off.apply_gradients({"f": torch.randn(a.shape)})
    path = off.save(tmp_path / "ckpt")
    assert sum(read) == 30_000, read  # once for both blocks
    from embtables.checkpoint.blocks import OffloadedGroup

    alone = OffloadedGroup(off._engine.local.offloaded["t"], 30_000).block("accumulators")  # a block read alone
    pieces = torch.cat([torch.from_numpy(p) for p in alone.pieces(1 << 20)])
    assert torch.equal(pieces, off.slot_variables["t"]["accumulators"])
    mem = et.DistributedEmbedding(
        {"f": et.FeatureConfig(et.TableConfig(30_000, 64, name="t", combiner="sum"))}, et.Adagrad(0.1)
    )
    mem.restore(path)
    want = off.state_dict()
    for k, v in mem.state_dict().items():
        assert torch.equal(v, want[k]), k
    again = _module(tmp_path / "rows2", cache_rows=512)
    again.restore(path)  # written piece by piece, each written back and dropped; no block initialized first
    stats = again.offload_statistics()["t"]
    assert stats["initialized_rows"] == 30_000 and stats["resident_rows"] == 0, stats
    for k, v in again.state_dict().items():
        assert torch.equal(v, want[k]), k
    ids = torch.randint(0, 30_000, (8, 3))
    assert torch.equal(again({"f": ids})["f"], mem({"f": ids})["f"])


def test_a_save_streams_from_the_files_without_writing_rows_never_read(tmp_path: Path) -> None:
    """``save`` reads an offloaded table from its files a piece at a time: rows never read go into the checkpoint
    as their initial values without being written into the working files, and nothing is mapped."""
    torch.manual_seed(0)
    off = _module(tmp_path / "rows", vocabulary_size=500_000, cache_rows=2048, dtype=torch.bfloat16)
    for _ in range(3):
        a = off({"f": torch.randint(0, 500_000, (16, 3))})["f"]
        off.apply_gradients({"f": torch.randn(a.shape)})
    touched = off.offload_statistics()["t"]["initialized_rows"]
    path = off.save(tmp_path / "ckpt")
    assert off.offload_statistics()["t"]["initialized_rows"] == touched <= 144 * 1024  # none by the save
    files = [p for p in (tmp_path / "rows").iterdir() if p.name.endswith(".rows")]
    assert sum(p.stat().st_blocks * 512 for p in files) < 500_000 * 64 * 6 * 0.4  # still mostly sparse
    mem = et.DistributedEmbedding(
        {"f": et.FeatureConfig(et.TableConfig(500_000, 64, name="t", combiner="sum", dtype=torch.bfloat16))},
        et.Adagrad(0.1),
    )
    mem.restore(path)
    want = off.state_dict()  # initializes every row in the files: the values the checkpoint holds
    for k, v in mem.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_the_native_row_io_checks_every_row_before_it_touches_one(tmp_path: Path) -> None:
    """``et_offload_rows`` trusts no row index: one outside the file refuses the whole call, nothing read or
    written; rows up to the file's last one are read."""
    from embtables.kernels import native_library

    if native_library.library() is None:
        pytest.skip("the native library is not built here (gcc is required)")
    emb = _module(tmp_path)
    files = emb._engine.local.offloaded["t"].files  # the table's files, as the cache drives them
    layout = files.layout
    assert layout.nbytes == 2 * 64 * 4 and layout.offsets == {"": 0, "accumulators": 256}
    last = 30_000 - 1
    before = files.tensors[""][0].clone(), files.tensors["accumulators"][0].clone()
    for bad in ([0, last + 1], [-1, 0], [1, 2**40]):
        records = layout.pack({"": torch.full((2, 64), 7.0), "accumulators": torch.full((2, 64), 8.0)})
        with pytest.raises(RuntimeError, match="a row outside the file"):
            files.row_io(torch.tensor(bad), records, write=True)  # refused before the log or the file
        past = files.nbytes // layout.nbytes  # the native call's own check: a row past the file's end
        for rows in ([0, past], [-1, 0]):
            with pytest.raises(RuntimeError, match="a row outside the file"):
                files._rows(files._fd, files.nbytes, records, layout.nbytes, torch.tensor(rows), True)
    files.compact()
    assert torch.equal(files.tensors[""][0], before[0]) and torch.equal(files.tensors["accumulators"][0], before[1])
    records = layout.empty(2)
    files.row_io(torch.tensor([0, last]), records, write=False)
    for part, values in layout.unpack(records).items():
        assert torch.equal(values, files.tensors[part][[0, last]]), part
    written = layout.pack({"": torch.full((1, 64), 3.0), "accumulators": torch.full((1, 64), 4.0)})
    files.row_io(torch.tensor([last]), written, write=True)  # one record: the row's weights and its slot, logged
    assert not bool((files.tensors[""][last] == 3.0).all())  # in the log, not yet in the row file
    again = layout.empty(1)
    files.row_io(torch.tensor([last]), again, write=False)  # read from the log
    assert torch.equal(again, written)
    files.compact()  # merged: the row file holds it
    assert bool((files.tensors[""][last] == 3.0).all()) and bool((files.tensors["accumulators"][last] == 4.0).all())


def test_a_name_read_from_a_record_never_leads_outside_the_directory(tmp_path: Path) -> None:
    """A record of ours whose lock names a path elsewhere: that path is never created or locked."""
    rows = tmp_path / "rows"
    rows.mkdir()
    outside = tmp_path / "outside.lock"
    (rows / "t.w1r0.meta.json").write_text('{"magic": "embtables-offload-v1", "files": {}, "lock": "../outside.lock"}')
    emb = _module(rows)
    emb({"f": torch.tensor([[1]])})
    assert not outside.exists()
    assert (rows / "t.w1r0.lock").exists()


def test_an_offloaded_table_exports_from_its_checkpoint_and_serves_memory_mapped(tmp_path: Path) -> None:
    """Export streams a checkpoint's blocks (64k rows at a time), never a module's tables; ``ServingEmbedding``
    with ``mmap=True`` maps the exported rows read-only: a table larger than memory is served from its pages."""
    torch.manual_seed(0)
    off = _module(tmp_path / "rows", vocabulary_size=200_000, cache_rows=8192)
    for _ in range(3):
        a = off({"f": torch.randint(0, 200_000, (16, 3))})["f"]
        off.apply_gradients({"f": torch.randn(a.shape)})
    et.export(off.save(tmp_path / "ckpt"), tmp_path / "serve")
    serving = et.ServingEmbedding.load(tmp_path / "serve", mmap=True)
    off.eval()
    ids = {"f": torch.randint(0, 200_000, (64, 3))}
    assert torch.equal(serving(ids)["f"], off(ids)["f"])


def test_the_cache_keeps_the_rows_used_most_not_the_last_used(tmp_path: Path) -> None:
    """Eviction by use, decayed: a row looked up ten times a step ago stays, a row looked up once since then
    goes (least-recently-used eviction would drop the first)."""
    table = et.TableConfig(30_000, 64, name="t", combiner="sum", offload=et.Offload(tmp_path / "rows", 2))
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.SGD(0.1))  # 2 rows in memory

    def step(ids: list[int]) -> None:
        acts = emb({"f": et.Ragged.from_lists([ids])})["f"]
        emb.apply_gradients({"f": torch.ones_like(acts)})

    step([0] * 10)  # row 0, ten ids
    step([16])  # row 16, one id, later
    step([32])  # row 32 needs a place: row 16 is the least used
    hits = emb.offload_statistics()["t"]["hits"]
    step([0])
    assert emb.offload_statistics()["t"]["hits"] == hits + 1  # row 0 stayed
    step([16])
    assert emb.offload_statistics()["t"]["hits"] == hits + 1  # row 16 was dropped


def test_a_row_and_its_slots_are_one_record_padded_to_8_bytes(tmp_path: Path) -> None:
    """A bfloat16 table of width 5 with Adam: the record is the weights (10 bytes, padded to 16), then m and v
    (20 bytes each, padded to 24): 64 bytes a row, the padding zero; the row file is whole pages. (It trains to
    the bits of memory: ``test_offload_log.py``.)"""
    from embtables.tables.offload_files import RecordLayout

    layout = RecordLayout.of(5, {"": torch.bfloat16, "m": torch.float32, "v": torch.float32})
    assert layout.offsets == {"": 0, "m": 16, "v": 40} and layout.nbytes == 64
    packed = layout.pack({"": torch.ones(3, 5), "m": torch.full((3, 5), 2.0), "v": torch.full((3, 5), 3.0)})
    assert packed.shape == (3, 64) and not bool(packed[:, 10:16].any()) and not bool(packed[:, 36:40].any())
    assert torch.equal(layout.unpack(packed)["v"], torch.full((3, 5), 3.0))
    table = et.TableConfig(5_000, 5, name="t", dtype=torch.bfloat16, offload=et.Offload(tmp_path / "rows", 64))
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adam(0.05))
    assert (tmp_path / "rows" / "t.w1r0.rows").stat().st_size == -(-5_000 * 64 // 4096) * 4096
    emb.close()
