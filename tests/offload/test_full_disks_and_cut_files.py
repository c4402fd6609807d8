"""Reliability of an offloaded table's files (docs/offload.md, 'Faults'), each fault real and each run in a child
process (a crash fails the test instead of killing pytest): a restore or a full load onto a disk that cannot
hold the rows is refused with nothing changed (was SIGBUS: stores through shared maps into holes of sparse
files); a file cut short by another program is refused by every whole-table access and by save (was grown back
with zeros and saved); a read-only directory or a file-size limit names the table and the directory's role; the
cache's size is quoted as the user passed it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from subproc import ROOT, run_on_small_disk, run_python

import embtables as et

_RESTORE_ONTO_FULL_DISK = """
import sys, torch, embtables as et
rows_dir, ckpt = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
t = et.TableConfig(30_000, 64, name="t", combiner="sum", offload=et.Offload(rows_dir, 2048))
emb = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adagrad(0.1))
first = {"f": et.Ragged.from_lists([[1, 2], [3]])}
a = emb(first)["f"]
emb.apply_gradients({"f": torch.ones_like(a)})
emb.eval()
before = emb(first)["f"].clone()
stats = emb.offload_statistics()["t"]
emb.train()
try:  # 30000 x 64 weights and accumulators: 15 MB, on a 4 MiB disk
    emb.restore(ckpt)
    raise SystemExit("restore not refused")
except et.CheckpointError as exc:
    print("restore refused:", exc)
full = {"t": torch.zeros(30_000, 64), "t/accumulators": torch.full((30_000, 64), 0.1)}
try:
    emb.load_state_dict(full)
    raise SystemExit("load not refused")
except RuntimeError as exc:
    print("load refused:", exc)
emb.eval()
assert torch.equal(emb(first)["f"], before), "nothing changed"
emb.train()
a = emb(first)["f"]  # trains on
emb.apply_gradients({"f": torch.ones_like(a)})
assert emb.offload_statistics()["t"]["rows_looked_up"] > stats["rows_looked_up"]
print("trained on")
"""


def test_a_restore_or_full_load_onto_a_full_disk_is_refused_with_nothing_changed(tmp_path: Path) -> None:
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    torch.manual_seed(0)
    saved = et.DistributedEmbedding(
        {"f": et.FeatureConfig(et.TableConfig(30_000, 64, name="t", combiner="sum"))}, et.Adagrad(0.1)
    )
    ckpt = saved.save(tmp_path / "ckpt")
    proc = run_on_small_disk(_RESTORE_ONTO_FULL_DISK, rows_dir, str(rows_dir), str(ckpt), size="4m")
    assert proc.returncode == 0, f"exit {proc.returncode} (-7: SIGBUS)\n{proc.stdout}\n{proc.stderr[-3000:]}"
    for what, said in (("restore", "restore refused"), ("load_state_dict", "load refused")):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(said))
        assert f"table 't': {what} writes all 30000 rows into its files under {str(rows_dir)!r}" in line, line
        assert "No space left on device" in line and "Nothing was changed" in line, line
    assert "trained on" in proc.stdout


_CUT_SHORT = """
import os, sys, json, torch, embtables as et
rows_dir, root = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
t = et.TableConfig(30_000, 16, name="t", combiner="sum", offload=et.Offload(rows_dir, 256))
emb = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adagrad(0.1))
for ids in ([[0, 29000]], [[5000, 9000]]):
    a = emb({"f": et.Ragged.from_lists(ids)})["f"]
    emb.apply_gradients({"f": torch.ones_like(a)})
ckpt = emb.save(root)
want = {k: v.clone() for k, v in emb.state_dict().items()}
manifest = open(os.path.join(ckpt, "manifest.json")).read()
records = [os.path.join(rows_dir, n) for n in os.listdir(rows_dir) if n.endswith(".rows")]
os.truncate(records[0], 4096 * 16)  # another program cuts the file: rows 512 on (128 bytes a record) are past its end
accesses = {
    "state_dict": lambda: emb.state_dict(),
    "embedding_tables": lambda: emb.embedding_tables,
    "slot_variables": lambda: emb.slot_variables,
    "local_shards": lambda: emb.local_shards(),
    "changed_rows": lambda: emb.changed_rows(),
    "save": lambda: emb.save(root),
}
for name, access in accesses.items():
    try:
        access()
        raise SystemExit(f"{name} not refused")
    except (RuntimeError, ValueError) as exc:
        print(f"refused {name}:", type(exc).__name__, exc)
assert open(os.path.join(ckpt, "manifest.json")).read() == manifest, "the last checkpoint is untouched"
assert sorted(os.listdir(root)) == [os.path.basename(ckpt)], os.listdir(root)
emb.restore(ckpt)
got = emb.state_dict()
assert all(torch.equal(got[k], v) for k, v in want.items()), "the restore gives the checkpoint's rows"
a = emb({"f": et.Ragged.from_lists([[29000, 1]])})["f"]
emb.apply_gradients({"f": torch.ones_like(a)})
emb.save(root)
print("trained on")
"""


def test_a_file_cut_short_is_refused_by_every_whole_table_access_and_by_save(tmp_path: Path) -> None:
    """Each whole-table access names the torn files (it grew them back with zeros before); save refuses,
    naming the table and the fix, and the checkpoint of the same step is left as it was; a restore trains on."""
    proc = subprocess.run(
        [sys.executable, "-c", _CUT_SHORT, str(tmp_path / "rows"), str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    refusals = [x for x in proc.stdout.splitlines() if x.startswith("refused ")]
    assert len(refusals) == 6, proc.stdout
    assert (
        "files were cut short by something else" in refusals[0] and "bytes of 3842048" in refusals[0]
    )  # whole 4 KiB chunks
    for line in refusals:
        assert "table 't'" in line and "are torn" in line and "restore()" in line, line
    assert refusals[-1].startswith("refused save: CheckpointError table 't': save refused"), refusals[-1]
    assert "trained on" in proc.stdout


def test_a_save_of_the_same_step_with_other_values_keeps_the_earlier_checkpoint(tmp_path: Path) -> None:
    """The same step saved again with other contents (a load_state_dict, a refused step): the earlier checkpoint
    is kept beside it, with a warning, never replaced silently; saved again unchanged, it is simply replaced."""
    torch.manual_seed(0)
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(et.TableConfig(50, 4, name="t"))}, et.Adagrad(0.1))
    first = Path(emb.save(tmp_path))
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    emb.save(tmp_path)  # the same values: replaced, nothing kept
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [first.name]
    emb.load_state_dict({"t": torch.ones(50, 4), "t/accumulators": torch.full((50, 4), 0.5)})
    emb.save(tmp_path)  # step 0 again, other values
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(f"{first.name}-replaced-")]
    assert len(kept) == 1, list(tmp_path.iterdir())
    emb.restore(kept[0])
    assert all(torch.equal(emb.state_dict()[k], v) for k, v in before.items())
    emb.restore(tmp_path)  # the newest is the new one
    assert torch.equal(emb.state_dict()["t"], torch.ones(50, 4))


def test_the_cache_size_is_quoted_as_passed(tmp_path: Path) -> None:
    """cache_rows=2 rows: the statistics and the refusal quote it, and say how many rows the lookup needs."""
    t = et.TableConfig(1000, 16, name="t", offload=et.Offload(tmp_path, 2))
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.SGD(0.1))
    assert emb.offload_statistics()["t"]["cache_rows"] == 2
    with pytest.raises(ValueError, match=r"need 3 rows in memory .*more than Offload\(cache_rows=2\) holds"):
        emb({"f": et.Ragged.from_lists([[0, 500, 999]])})
    emb.close()


def test_a_read_only_directory_or_a_file_size_limit_names_the_table_and_the_directory(tmp_path: Path) -> None:
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    code = """
    import sys, resource, embtables as et
    if sys.argv[2] == "limit":
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    t = et.TableConfig(100_000, 16, name="users", offload=et.Offload(sys.argv[1], 1024))
    try:
        et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.SGD(0.1))
    except ValueError as exc:
        print("refused:", type(exc).__name__, exc)
    """
    out = run_python(code.replace("sys.argv[1]", repr(str(rows_dir))).replace("sys.argv[2]", '"limit"'))
    assert "refused: ConfigError table 'users': cannot create its working files in its offload directory" in out
    assert "File too large" in out and "ulimit -f" in out and "6467584 bytes" in out  # whole chunks, and the log
    proc = run_on_small_disk(code, rows_dir, str(rows_dir), "ro", read_only=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: ConfigError table 'users': cannot create its working files" in proc.stdout, proc.stdout
    assert "Read-only file system" in proc.stdout, proc.stdout
