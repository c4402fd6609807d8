"""Faults of an offloaded table's disk (docs/offload.md): a full filesystem, for real (a 1 MiB tmpfs in a
private mount namespace), refuses the step that needs new rows with nothing changed and leaves the last
checkpoint valid; a write-back that fails tears the working files, and every lookup is refused until a restore."""

from __future__ import annotations

import errno
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from subproc import ROOT, run_on_small_disk

import embtables as et
from embtables.tables.offload_files import ShardFiles

_FULL_DISK = """
import sys, torch, embtables as et
rows_dir, ckpt = sys.argv[1], sys.argv[2]
t = et.TableConfig(30_000, 64, name="t", combiner="sum", offload=et.Offload(rows_dir, 8192))
emb = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adagrad(0.1))
first = {"f": et.Ragged.from_lists([[1, 2], [3]])}
a = emb(first)["f"]
emb.apply_gradients({"f": torch.ones_like(a)})
emb.eval()
before = emb(first)["f"].clone()
emb.train()
try:  # rows 5000-29999 live in blocks never written: 512 KiB each, more than the disk has left
    emb({"f": et.Ragged.from_lists([[5000, 9000, 13000, 17000, 21000, 25000, 29000]])})
except RuntimeError as exc:
    print("refused:", exc)
emb.eval()
assert torch.equal(emb(first)["f"], before), "nothing changed"
emb.train()
a = emb(first)["f"]  # the rows already on disk train on
emb.apply_gradients({"f": torch.ones_like(a)})
mem = et.DistributedEmbedding({"f": et.FeatureConfig(et.TableConfig(30_000, 64, name="t", combiner="sum"))},
                              et.Adagrad(0.1))
mem.restore(ckpt)  # the checkpoint written before the disk filled
print("restored step", mem.restore(ckpt)["step"])
"""


def test_a_full_disk_refuses_the_step_that_needs_new_rows_and_changes_nothing(tmp_path: Path) -> None:
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    torch.manual_seed(0)
    saved = et.DistributedEmbedding(
        {"f": et.FeatureConfig(et.TableConfig(30_000, 64, name="t", combiner="sum"))}, et.Adagrad(0.1)
    )
    ckpt = saved.save(tmp_path / "ckpt")
    proc = run_on_small_disk(_FULL_DISK, rows_dir, str(rows_dir), ckpt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: table 't': writing the initial values of rows" in proc.stdout, proc.stdout
    assert "No space left on device" in proc.stdout and "no table or slot was changed" in proc.stdout
    assert "restored step 0" in proc.stdout


def _two_row_table(tmp_path: Path) -> Any:
    """A 30k x 64 Adagrad table offloaded with two rows in its cache."""
    torch.manual_seed(0)
    offload = et.Offload(tmp_path / "rows", 2)
    table = et.TableConfig(30_000, 64, name="t", combiner="sum", offload=offload)
    return et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adagrad(0.1))


def _failing_at(writes: bool) -> Callable[..., None]:
    """``ShardFiles.row_io`` with an I/O error (EIO) injected into its writes (``writes``) or its reads."""
    real_io = ShardFiles.row_io

    def failing_io(self: ShardFiles, rows: torch.Tensor, records: torch.Tensor, *, write: bool) -> None:
        if write == writes and rows.numel():
            raise OSError(errno.EIO, "Input/output error")
        real_io(self, rows, records, write=write)

    return failing_io


def test_a_failed_write_back_tears_the_files_until_a_restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk refuses a write-back (an I/O error from pwrite, injected at the files' ``row_io``): the lookup that
    evicted raises, every later lookup (training or not) is refused, a restore makes the table whole again."""
    emb = _two_row_table(tmp_path)
    a = emb({"f": et.Ragged.from_lists([[0, 300]])})["f"]
    emb.apply_gradients({"f": torch.ones_like(a)})
    ckpt = emb.save(tmp_path / "ckpt")
    want = {k: v.clone() for k, v in emb.state_dict().items()}
    real_io = ShardFiles.row_io
    a = emb({"f": et.Ragged.from_lists([[0, 300]])})["f"]
    emb.apply_gradients({"f": torch.ones_like(a)})  # rows 0 and 300 now written in the cache
    monkeypatch.setattr(ShardFiles, "row_io", _failing_at(writes=True))
    with pytest.raises(RuntimeError, match=r"writing rows back to disk failed .*Input/output error.*torn"):
        emb({"f": et.Ragged.from_lists([[5000, 9000]])})  # evicts the dirty rows
    monkeypatch.setattr(ShardFiles, "row_io", real_io)
    emb.eval()
    with pytest.raises(et.TornFilesError, match=r"working files are torn.*restore"):
        emb({"f": et.Ragged.from_lists([[0]])})
    emb.train()
    with pytest.raises(et.TornFilesError, match="working files are torn"):
        emb({"f": et.Ragged.from_lists([[1]])})
    with pytest.raises(et.CheckpointError, match=r"save refused: its working files .* are torn"):
        emb.save(tmp_path / "not-written")  # a save's refusal, carrying the reason
    emb.restore(ckpt)
    for k, v in emb.state_dict().items():
        assert torch.equal(v, want[k]), k
    a = emb({"f": et.Ragged.from_lists([[5000, 9000]])})["f"]  # trains again
    emb.apply_gradients({"f": torch.ones_like(a)})


def test_a_failed_read_tears_the_files_until_a_restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk refuses a read (an I/O error from pread, injected at the files' ``row_io``): the lookup that needed
    the rows raises naming the table and the error (a read through the maps would have been a SIGBUS), every
    later lookup is refused, a restore makes the table whole again."""
    emb = _two_row_table(tmp_path)
    for ids in ([[0, 300]], [[5000, 9000]]):  # rows 0 and 300 trained, then evicted to disk
        a = emb({"f": et.Ragged.from_lists(ids)})["f"]
        emb.apply_gradients({"f": torch.ones_like(a)})
    ckpt = emb.save(tmp_path / "ckpt")
    want = {k: v.clone() for k, v in emb.state_dict().items()}
    real_io = ShardFiles.row_io
    monkeypatch.setattr(ShardFiles, "row_io", _failing_at(writes=False))
    with pytest.raises(RuntimeError, match=r"table 't': reading rows from disk failed \(Input/output error\)"):
        emb({"f": et.Ragged.from_lists([[0, 300]])})
    monkeypatch.setattr(ShardFiles, "row_io", real_io)
    with pytest.raises(et.TornFilesError, match=r"working files are torn \(reading rows.*restore"):
        emb({"f": et.Ragged.from_lists([[0]])})
    emb.restore(ckpt)
    for k, v in emb.state_dict().items():
        assert torch.equal(v, want[k]), k
    a = emb({"f": et.Ragged.from_lists([[0, 300]])})["f"]  # trains again
    emb.apply_gradients({"f": torch.ones_like(a)})


_CUT_SHORT = """
import os, sys, torch, embtables as et
rows_dir, ckpt = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
t = et.TableConfig(30_000, 64, name="t", combiner="sum", offload=et.Offload(rows_dir, 2))
emb = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adagrad(0.1))
for ids in ([[0, 29000]], [[5000, 9000]]):  # rows 0 and 29000 trained, then evicted to disk
    a = emb({"f": et.Ragged.from_lists(ids)})["f"]
    emb.apply_gradients({"f": torch.ones_like(a)})
emb.save(ckpt)
want = {k: v.clone() for k, v in emb.state_dict().items()}
a = emb({"f": et.Ragged.from_lists([[5000]])})["f"]  # only the low rows in memory
emb.apply_gradients({"f": torch.ones_like(a)})
records = [os.path.join(rows_dir, n) for n in os.listdir(rows_dir) if n.endswith(".rows")]
os.truncate(records[0], 4096 * 64)  # something else cuts the file: rows 512 on (512 bytes a record) are past its end
for ids in ([[29000]], [[1]]):
    try:
        emb({"f": et.Ragged.from_lists(ids)})
        raise SystemExit("not refused")
    except RuntimeError as exc:
        print("refused:", exc)
emb.restore(ckpt)  # grows the file back and writes every row
got = emb.state_dict()
assert all(torch.equal(got[k], v) for k, v in want.items()), "the restore gives the checkpoint's rows"
a = emb({"f": et.Ragged.from_lists([[29000, 1]])})["f"]
emb.apply_gradients({"f": torch.ones_like(a)})
print("trained on")
"""


def test_a_file_cut_short_behind_its_back_is_refused_not_a_crash(tmp_path: Path) -> None:
    """A rows file truncated by another program (a real short file: touching its map past the end would be a
    SIGBUS): the next lookup raises naming the file and both sizes, every later one is refused, a restore grows
    the file back and trains on. In a child process, so that a crash fails the test instead of killing pytest."""
    proc = subprocess.run(
        [sys.executable, "-c", _CUT_SHORT, str(tmp_path / "rows"), str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=120, cwd=str(ROOT),
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    refusals = [line for line in proc.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 2, proc.stdout
    assert "files were cut short by something else" in refusals[0]
    assert "t.w1r0.rows: 262144 bytes of 15360000" in refusals[0] and "torn" in refusals[0]
    assert "working files are torn (files were cut short" in refusals[1]
    assert "trained on" in proc.stdout


def test_a_refused_update_names_the_table_row_not_its_cache_slot(tmp_path: Path) -> None:
    """A NaN put into row 900 through the table's files (``embedding_tables``) between the lookup and
    ``apply_gradients``: the refusal names row 900, not the cache slot holding it, and changes nothing."""
    t = et.TableConfig(1000, 4, name="t", optimizer=et.Adagrad(0.1), initializer=et.Constant(0.1),
                       offload=et.Offload(str(tmp_path), cache_rows=64))  # fmt: skip
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(t)})
    for i in range(3):  # rows 5 and 898-900 take cache slots 0-3 in some order
        acts = emb({"f": torch.tensor([[900 - i], [5]])})
        emb.apply_gradients({"f": torch.ones_like(acts["f"])})
    acts = emb({"f": torch.tensor([[900], [5]])})
    emb.embedding_tables["t"][900] = float("nan")
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    with pytest.raises(ValueError, match=r"table 't': the update of row 900 would write a non-finite value"):
        emb.apply_gradients({"f": torch.ones_like(acts["f"])})
    after = emb.state_dict()
    assert all(torch.equal(v.nan_to_num(), before[k].nan_to_num()) for k, v in after.items())
