"""The write log of an offloaded table (``tables/offload_log.py``, docs/offload.md "The write log"): written-back
records appended as runs, read back from the log while they are there (the newest record of a row), and merged
into the row file a chunk of whole pages at a time, against a plain record of what was written last."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import embtables as et
from embtables.tables.offload_files import ShardFiles
from embtables.tables.offload_log import WriteLog, chunk_bytes


@pytest.mark.parametrize(
    ("dim", "parts", "chunk"),
    [
        (64, {"": torch.float32, "accumulators": torch.float32}, 4096),  # 512-byte records, 8 a page
        (64, {"": torch.float32, "m": torch.float32, "v": torch.float32}, 12288),  # 768: 16 records in 3 pages
        (65, {"": torch.float32, "accumulators": torch.float32}, 528),  # lcm(528, 4096) > 64 KiB: a record
    ],
)
@pytest.mark.parametrize("wide", [False, True])
def test_the_log_reads_back_the_newest_record_and_merges_into_the_row_file(
    dim: int, parts: dict[str, torch.dtype], chunk: int, wide: bool, tmp_path: Path
) -> None:
    rows = 3_000
    files = ShardFiles(str(tmp_path), "t", "w1r0", rows, dim, parts, log_rows=500)
    layout = files.layout
    assert chunk_bytes(layout.nbytes) == chunk and files.nbytes % chunk == 0
    assert files.log is not None
    if wide:  # the log of a shard of more than 2**31 rows keeps its index in int64
        log = files.log
        files.log = WriteLog(log.fd, log.capacity, log.record_bytes, 2**40, files._rows)
        assert files.log.index[0].dtype == torch.int64
    else:
        assert files.log.index[0].dtype == torch.int32
    truth = torch.zeros((rows, layout.nbytes), dtype=torch.uint8)  # the file starts as zeros (sparse)
    g = torch.Generator().manual_seed(0)
    for step in range(12):  # 12 runs of 40-200 rows: the log of 500 fills and merges several times
        k = int(torch.randint(40, 200, (1,), generator=g))
        written = torch.unique(torch.randint(0, rows, (k,), generator=g))
        records = torch.randint(0, 256, (written.numel(), layout.nbytes), dtype=torch.uint8, generator=g)
        files.row_io(written, records, write=True)
        truth[written] = records
        asked = torch.unique(torch.randint(0, rows, (300,), generator=g))
        got = layout.empty(asked.numel())
        files.row_io(asked, got, write=False)
        assert torch.equal(got, truth[asked]), step
    assert files.log.merges >= 2 and files.log.head > 0
    files.compact()
    assert files.log.head == 0 and len(files.log) == 0
    with open(os.path.join(tmp_path, files.name), "rb") as f:
        whole = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    assert torch.equal(whole[: rows * layout.nbytes].view(rows, layout.nbytes), truth)
    assert not bool(whole[rows * layout.nbytes :].any())  # the chunks' tail past the last row stays zero
    files.close()


@pytest.mark.parametrize(("dim", "dtype", "steps"), [(16, None, 20), (5, torch.bfloat16, 12)])
def test_an_offloaded_table_trains_through_its_log_to_the_bits_of_memory(
    dim: int, dtype: torch.dtype | None, steps: int, tmp_path: Path
) -> None:
    """A cache of 64 rows (its log too) over 5,000, Adam: the log merges several times, and every lookup and the
    final state equal the same table in memory; also with bfloat16 rows of width 5 (records of 64 bytes, each
    part padded to 8)."""

    def module(offload: et.Offload | None) -> et.DistributedEmbedding:
        table = et.TableConfig(5_000, dim, name="t", combiner="mean", dtype=dtype, offload=offload)
        return et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adam(0.05))

    torch.manual_seed(0)
    off = module(et.Offload(tmp_path / "rows", 64))
    ref = module(None)
    ref.load_state_dict(off.state_dict())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = {"f": torch.randint(0, 5_000, (8, 3), generator=g)}
        got, want = off(ids)["f"], ref(ids)["f"]
        assert torch.equal(got, want)
        grad = torch.randn(want.shape, generator=g)
        off.apply_gradients({"f": grad})
        ref.apply_gradients({"f": grad})
    log = off._engine.local.offloaded["t"].files.log
    assert log is not None and log.merges >= 2, log.merges
    assert off.offload_statistics()["t"]["log_merges"] == log.merges
    for key, value in ref.state_dict().items():
        assert torch.equal(off.state_dict()[key], value), key


@pytest.mark.parametrize("engine", ["io_uring", "threads"])
def test_reads_and_writes_in_flight_give_the_bytes_of_one_at_a_time(engine: str, tmp_path: Path) -> None:
    """``et_offload_rows`` with its requests in flight from the first run (io_uring where the kernel allows it,
    else threads), against plain ``pread``/``pwrite`` one run at a time: the same bytes written and read back, runs
    of consecutive rows included, and a row past the file refused before anything is done."""
    from embtables.tables import offload_files

    if offload_files.native_library.library() is None:
        pytest.skip("the native library is not built here (gcc is required)")
    files = ShardFiles(str(tmp_path), "t", "w1r0", 4_000, 16, {"": torch.float32, "accumulators": torch.float32})
    layout = files.layout
    g = torch.Generator().manual_seed(3)
    rows = torch.unique(torch.randint(0, 4_000, (700,), generator=g))
    rows = torch.unique(torch.cat([rows, torch.arange(100, 140)]))  # a run of 40 consecutive rows
    records = torch.randint(0, 256, (rows.numel(), layout.nbytes), dtype=torch.uint8, generator=g)
    try:
        used = offload_files.set_io_engine(engine, always=True)
        assert used == engine or (engine == "io_uring" and used == "threads")  # refused: threads
        files._rows(files._fd, files.nbytes, records, layout.nbytes, rows, True)
        back = layout.empty(rows.numel())
        files._rows(files._fd, files.nbytes, back, layout.nbytes, rows, False)
        with pytest.raises(RuntimeError, match="a row outside the file"):
            files._rows(files._fd, files.nbytes, back[:2].clone(), layout.nbytes, torch.tensor([0, 10**9]), False)
    finally:
        offload_files.set_io_engine(offload_files.IO_ENGINE)
    assert torch.equal(back, records)
    with open(os.path.join(tmp_path, files.name), "rb") as f:
        whole = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).view(-1, layout.nbytes)
    assert torch.equal(whole[rows], records)  # what one pread a run reads
    files.close()


def test_a_directory_reused_with_and_without_a_log_keeps_only_files_embtables_lists(tmp_path: Path) -> None:
    """A table larger than its cache has a log; the same table on the same directory with a cache that holds it
    whole has none: the earlier log (listed by the shard's own record) is removed, so a third module finds no
    file it did not write."""
    for cache_rows in (64, 5_000, 64):
        table = et.TableConfig(5_000, 8, name="t", offload=et.Offload(tmp_path, cache_rows))
        emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.SGD(0.1))
        emb({"f": torch.tensor([[1, 2]])})
        names = sorted(p.name for p in tmp_path.iterdir())
        log = ["t.w1r0.log"] if cache_rows < 5_000 else []
        assert names == sorted(["t.w1r0.lock", "t.w1r0.meta.json", "t.w1r0.rows", *log]), names
        emb.close()
