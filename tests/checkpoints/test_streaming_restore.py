"""Restore in two streaming passes (issue 15, item 6): bounded extra memory, all or nothing kept.

Pass 1 checks every block and records a CRC-32 per piece, pass 2 reads the pieces again and copies them
into place. A file modified between the passes is refused before anything is written; one modified
while pass 2 runs raises ``TornRestore`` and the module refuses to train or save until a restore
succeeds; a file replaced by rename is not seen (both passes read the descriptors pass 1 opened). The
files are changed for real, from the progress callback at the exact byte where each case happens."""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from subproc import run_python

import embtables as et
from embtables.checkpoint import CheckpointError, TornRestore


def _config(rows: int, tables: int = 2) -> dict[str, et.FeatureConfig]:
    return {
        f"f{i}": et.FeatureConfig(
            et.TableConfig(rows, 64, name=f"t{i}", initializer=et.TruncatedNormal(seed=i), optimizer=et.Adagrad(0.1))
        )
        for i in range(tables)
    }


def _trained(rows: int) -> et.DistributedEmbedding:
    emb = et.DistributedEmbedding(_config(rows))
    acts = emb({k: torch.tensor([[0, 5, rows - 1]]) for k in emb.feature_config})
    emb.apply_gradients({k: torch.ones_like(a) for k, a in acts.items()})
    return emb


def _state(emb: et.DistributedEmbedding) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in emb.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rank_file(ckpt: str) -> Path:
    return next(p for p in Path(ckpt).iterdir() if p.suffix == ".safetensors" or p.name.startswith("rank"))


class _At:
    """A progress callback that runs ``action`` once, when the bytes reported so far first exceed ``at``."""

    def __init__(self, at: int, action: object) -> None:
        self.at, self.action, self.seen, self.done = at, action, 0, False

    def __call__(self, n: int) -> None:
        self.seen += n
        if not self.done and self.seen > self.at:
            self.done = True
            self.action()  # type: ignore[operator]


def _flip_byte_in_place(file: Path, offset_from_end: int) -> None:
    with open(file, "r+b") as f:  # the same inode, modified in place
        f.seek(-offset_from_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


ROWS = 20_000  # 5 MiB per slot block: several 4 MiB pieces
STATE_BYTES = 2 * ROWS * 64 * 4 * 2  # 2 tables x (weights + accumulators)


def test_a_file_modified_in_place_between_the_passes_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    ckpt = _trained(ROWS).save(tmp_path)
    fresh = et.DistributedEmbedding(_config(ROWS))
    before = _state(fresh)
    file = _rank_file(ckpt)
    cb = _At(STATE_BYTES - 1, lambda: _flip_byte_in_place(file, 100))  # the last piece of pass 1
    with pytest.raises(CheckpointError, match=r"modified while the checkpoint was being restored; nothing"):
        fresh.restore(ckpt, progress=cb)
    assert cb.done and _same(before, _state(fresh))
    acts = fresh({k: torch.tensor([[1]]) for k in fresh.feature_config})  # still trains
    fresh.apply_gradients({k: torch.ones_like(a) for k, a in acts.items()})


def test_a_file_modified_during_pass_2_raises_torn_and_training_is_refused_until_a_restore_succeeds(
    tmp_path: Path,
) -> None:
    trained = _trained(ROWS)
    expected = _state(trained)
    ckpt = trained.save(tmp_path)
    intact = tmp_path / "intact"
    shutil.copytree(ckpt, intact)
    fresh = et.DistributedEmbedding(_config(ROWS))
    file = _rank_file(ckpt)
    cb = _At(STATE_BYTES, lambda: _flip_byte_in_place(file, 100))  # the first piece of pass 2
    with pytest.raises(TornRestore, match=r"changed while its rows were being copied in.*partly restored"):
        fresh.restore(ckpt, progress=cb)
    batch = {k: torch.tensor([[1]]) for k in fresh.feature_config}
    for refused in (lambda: fresh(batch), lambda: fresh.save(tmp_path / "other")):
        with pytest.raises(CheckpointError, match=r"interrupted half-way"):
            refused()
    assert not (tmp_path / "other").exists()
    fresh.restore(intact)
    assert _same(expected, _state(fresh))
    acts = fresh(batch)
    fresh.apply_gradients({k: torch.ones_like(a) for k, a in acts.items()})


def test_a_file_replaced_by_rename_between_the_passes_is_not_seen(tmp_path: Path) -> None:
    trained = _trained(ROWS)
    expected = _state(trained)
    ckpt = trained.save(tmp_path)
    file = _rank_file(ckpt)

    def replace() -> None:
        other = file.with_name("other.tmp")
        other.write_bytes(b"\0" * file.stat().st_size)
        os.replace(other, file)

    fresh = et.DistributedEmbedding(_config(ROWS))
    fresh.restore(ckpt, progress=_At(STATE_BYTES - 1, replace))
    assert _same(expected, _state(fresh))


MEMORY_PROGRAM = textwrap.dedent(
    """
    import json, sys, tempfile
    from pathlib import Path
    import torch
    import embtables as et

    def rss(field):
        return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                    if l.startswith(field + ":"))

    rows = int(sys.argv[1])
    cfg = {f"f{i}": et.FeatureConfig(et.TableConfig(rows, 64, name=f"t{i}", optimizer=et.Adagrad(0.1),
                                                    initializer=et.TruncatedNormal(seed=i)))
           for i in range(4)}
    with tempfile.TemporaryDirectory() as tmp:
        source = et.DistributedEmbedding(cfg)
        ckpt = source.save(tmp, progress=False)
        expected = {k: v.clone() for k, v in source.state_dict().items()}
        del source
        target = et.DistributedEmbedding({k: et.FeatureConfig(et.TableConfig(rows, 64, name=v.table.name,
                                          optimizer=et.Adagrad(0.1))) for k, v in cfg.items()})
        target.restore(ckpt, progress=False)  # warm-up: imports, first-call allocations
        target = et.DistributedEmbedding({k: et.FeatureConfig(et.TableConfig(rows, 64, name=v.table.name,
                                          optimizer=et.Adagrad(0.1))) for k, v in cfg.items()})
        before = rss("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        target.restore(ckpt, progress=False)
        extra = rss("VmHWM") - before
        same = all(torch.equal(expected[k], v) for k, v in target.state_dict().items())
    print(json.dumps({"state": 4 * rows * 64 * 4 * 2, "extra": extra, "same": same}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_restore_needs_little_extra_memory() -> None:
    import json

    rows = 160_000  # 4 tables x 160k x 64 x (weights + accumulators) = 312 MiB of state
    out = run_python(MEMORY_PROGRAM.replace("int(sys.argv[1])", str(rows)), timeout=300)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["same"]
    limit = max(0.10 * result["state"], 64 << 20)
    said = f"restore took {result['extra'] / 2**20:.1f} MiB extra for {result['state'] / 2**20:.0f} MiB of state"
    print(said, file=sys.stderr)
    assert result["extra"] < limit, said
