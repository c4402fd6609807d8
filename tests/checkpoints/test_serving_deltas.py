"""Serving deltas (docs/checkpoints.md, "Serving deltas"): ``export(chain, out, incremental=True)`` writes only
the rows changed since the checkpoint ``out`` serves; ``ServingEmbedding.update`` applies them in place so
that it serves what a full export of the same step serves, bit for bit, in every storage type; a lookup
running during an update sees all of it or none; a missing or out-of-order delta, or an export replaced
since, is refused with nothing changed."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fast_child
import numpy as np
import pytest
import torch

import embtables as et
from embtables.__main__ import main as cli
from embtables.checkpoint import CheckpointError, increments
from embtables.checkpoint.owned_dirs import temp_name
from embtables.checkpoint.serving_codec import MARKER

DTYPES = ["float32", "float16", "bfloat16", "int8"]


@pytest.fixture(autouse=True)
def _always_increments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(increments, "FULL_ABOVE", 1.0)  # small tables: most rows change between saves


def _module() -> et.DistributedEmbedding:
    t = et.TableConfig(400, 8, name="t", initializer=et.TruncatedNormal(seed=1))
    u = et.TableConfig(30, 4, name="u", combiner="sum", initializer=et.TruncatedNormal(seed=2))
    return et.DistributedEmbedding({"a": et.FeatureConfig(t), "b": et.FeatureConfig(u)}, et.Adagrad(0.1))


def _train(emb: et.DistributedEmbedding, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        acts = emb({"a": torch.randint(0, 400, (8,), generator=g), "b": torch.randint(0, 30, (8,), generator=g)})
        emb.apply_gradients({k: torch.randn(v.shape, generator=g) for k, v in acts.items()})


def _save(emb: et.DistributedEmbedding, tmp_path: Path, steps: range) -> None:
    """Train ``steps`` and save an increment of them under ``tmp_path/ckpts``."""
    _train(emb, steps)
    emb.save(tmp_path / "ckpts", incremental=True)


def _exported(tmp_path: Path, dtype: str = "float32") -> tuple[et.DistributedEmbedding, Path, et.ServingEmbedding]:
    """A module trained two steps and saved, its full export at ``tmp_path/serve``, and a server of it."""
    emb = _module()
    _save(emb, tmp_path, range(2))
    out = tmp_path / "serve"
    et.export(tmp_path / "ckpts", out, dtype)
    return emb, out, et.ServingEmbedding.load(out)


QUERY = {"a": torch.arange(400), "b": torch.arange(30)}  # every row of every table


def _served(serving: et.ServingEmbedding) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in serving(QUERY).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_updated_server_serves_what_a_full_export_of_the_same_step_serves(dtype: str, tmp_path: Path) -> None:
    emb = _module()
    _save(emb, tmp_path, range(2))
    out = tmp_path / "serve"
    first = et.export(tmp_path / "ckpts", out, dtype, incremental=True)  # nothing there yet: a full export
    assert first.delta is None and first.max_abs_error
    serving = et.ServingEmbedding.load(out)
    before = _served(serving)
    for lo in (2, 4):
        _save(emb, tmp_path, range(lo, lo + 2))
        report = et.export(tmp_path / "ckpts", out, dtype, incremental=True)
        assert report.delta is not None and Path(report.delta).name == f"delta-{lo + 2:010d}"
    assert et.export(tmp_path / "ckpts", out, dtype, incremental=True).delta is None  # nothing new
    assert _same(_served(serving), before)  # nothing applied until update
    assert serving.update() == 6 and serving.step == 6
    et.export(tmp_path / "ckpts", tmp_path / "full", dtype)
    full = _served(et.ServingEmbedding.load(tmp_path / "full"))
    assert _same(_served(serving), full)
    assert _same(_served(et.ServingEmbedding.load(out)), full)  # a fresh load applies the deltas too
    assert serving.update() == 6  # nothing newer: nothing changes


def test_lookups_during_an_update_see_all_of_it_or_none(tmp_path: Path) -> None:
    emb, out, first = _exported(tmp_path)
    old = _served(first)
    for lo in range(2, 12, 2):
        _save(emb, tmp_path, range(lo, lo + 2))
        et.export(tmp_path / "ckpts", out, incremental=True)
    new = _served(et.ServingEmbedding.load(out))
    assert not _same(old, new)
    for _ in range(5):
        shutil.rmtree(tmp_path / "copy", ignore_errors=True)
        shutil.copytree(out, tmp_path / "copy")
        for delta in (tmp_path / "copy").glob("delta-*"):
            shutil.move(str(delta), tmp_path / delta.name)  # held back: the copy loads as the base export
        serving = et.ServingEmbedding.load(tmp_path / "copy")
        assert _same(_served(serving), old)
        for delta in tmp_path.glob("delta-*"):
            shutil.move(str(delta), tmp_path / "copy" / delta.name)
        seen: list[list[str]] = [[], [], []]  # per reader thread, in the order its lookups returned
        stop = threading.Event()
        threads = [threading.Thread(target=_reader, args=(serving, old, new, mine, stop)) for mine in seen]
        for t in threads:
            t.start()
        _wait_for(seen, 2)  # every reader is running before the update starts
        serving.update()
        _wait_for(seen, max(len(mine) for mine in seen) + 2)  # and goes on after it ends
        stop.set()
        for t in threads:
            t.join()
        for mine in seen:  # never a mix, and once a lookup saw the update none saw the tables before it
            assert mine[0] == "old" and mine[-1] == "new", mine
            assert "mixed" not in mine and "old" not in mine[mine.index("new") :], mine
        assert _same(_served(serving), new)


def _wait_for(seen: list[list[str]], lookups: int) -> None:
    """Until every reader has made ``lookups`` lookups (the readers stopped: an assertion after 60 s)."""
    deadline = time.monotonic() + 60
    while min(len(mine) for mine in seen) < lookups:
        assert time.monotonic() < deadline, "the reader threads stopped"
        time.sleep(0.001)


def _reader(
    serving: et.ServingEmbedding, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], seen: list[str],
    stop: threading.Event,
) -> None:  # fmt: skip
    while not stop.is_set():
        got = _served(serving)
        seen.append("old" if _same(got, old) else "new" if _same(got, new) else "mixed")


def test_a_lookup_waits_while_an_update_writes(tmp_path: Path) -> None:
    _, _, serving = _exported(tmp_path)
    done = threading.Event()
    with serving._lock.write():  # what update holds while it writes rows
        reader = threading.Thread(target=lambda: (serving(QUERY), done.set()))
        reader.start()
        assert not done.wait(0.3)  # the lookup waits for the writer
    assert done.wait(30)
    reader.join()


def test_a_missing_delta_an_export_replaced_or_a_mapped_export_is_refused(tmp_path: Path) -> None:
    emb, out, serving = _exported(tmp_path, "int8")
    before = _served(serving)
    mapped = et.ServingEmbedding.load(out, mmap=True)
    deltas = []
    for lo in (2, 4):
        _save(emb, tmp_path, range(lo, lo + 2))
        deltas.append(Path(str(et.export(tmp_path / "ckpts", out, "int8", incremental=True).delta)))
    with pytest.raises(CheckpointError, match="mmap"):
        mapped.update()
    with pytest.raises(CheckpointError, match="has serving deltas"):
        et.ServingEmbedding.load(out, mmap=True)
    shutil.move(str(deltas[0]), tmp_path / "held")
    with pytest.raises(CheckpointError, match=r"delta-0000000006: a delta from step 4 to 6.*missing or out of order"):
        serving.update()
    assert _same(_served(serving), before) and serving.step == 2
    shutil.move(str(tmp_path / "held"), deltas[0])
    data = deltas[1] / "t0.data.npy"
    raw = data.read_bytes()
    data.write_bytes(raw[:-3])
    with pytest.raises(CheckpointError, match=r"delta-0000000006: table 't'.*bytes"):
        serving.update()
    assert _same(_served(serving), before)  # the first delta was checked, not applied: all or nothing
    data.write_bytes(raw)
    assert serving.update() == 6
    et.export(tmp_path / "ckpts", out, "int8")  # a full export replaces the artifact and its deltas
    assert not list(out.glob("delta-*"))
    with pytest.raises(CheckpointError, match="not the export this module loaded"):
        serving.update()
    other = _module()
    _train(other, range(3))
    other.save(tmp_path / "elsewhere")  # not in the chain of what out serves: a full export, logged
    assert et.export(tmp_path / "elsewhere", out, "int8", incremental=True).delta is None


def test_what_a_killed_delta_writer_leaves_is_cleaned_and_harmless(tmp_path: Path) -> None:
    emb, out, serving = _exported(tmp_path)
    dead = fast_child.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    prefix, _, tail = temp_name("delta").rsplit("-", 2)
    leftover = tmp_path / f"{prefix}-{int(dead.stdout)}-{tail}"  # a delta writer killed half-way: beside the export
    leftover.mkdir()
    (leftover / "t0.data.npy").write_bytes(b"partial")
    marker = json.loads((out / MARKER).read_text())
    marker["files"].append("delta-0000000099")  # killed after listing its delta, before publishing it
    (out / MARKER).write_text(json.dumps(marker))
    _save(emb, tmp_path, range(2, 4))
    assert et.export(tmp_path / "ckpts", out, incremental=True).delta is not None
    assert not leftover.exists()  # a dead writer's directory is removed by the next export
    assert serving.update() == 4
    et.export(tmp_path / "ckpts", out)  # the full export still recognises the directory as its own
    assert not list(out.glob("delta-*"))


def test_the_export_command_writes_deltas(tmp_path: Path, capsys: Any) -> None:
    emb = _module()
    _save(emb, tmp_path, range(2))
    assert cli(["export", str(tmp_path / "ckpts"), str(tmp_path / "serve"), "--incremental"]) == 0
    _save(emb, tmp_path, range(2, 4))
    capsys.readouterr()
    assert cli(["export", str(tmp_path / "ckpts"), str(tmp_path / "serve"), "--incremental"]) == 0
    assert "delta-0000000004" in capsys.readouterr().out


def test_a_malformed_serving_json_or_delta_json_is_refused_or_exported_whole(tmp_path: Path) -> None:
    emb, out, serving = _exported(tmp_path)
    _save(emb, tmp_path, range(2, 4))
    delta = Path(str(et.export(tmp_path / "ckpts", out, incremental=True).delta))
    meta = json.loads((delta / "delta.json").read_text())
    for bad in ({**meta, "tables": {"t": meta["tables"]["t"]}}, {**meta, "to": {"id": 3, "step": "x"}}, [1]):
        (delta / "delta.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=r"delta-0000000004: .*nothing was applied"):
            serving.update()
    (delta / "delta.json").write_text(json.dumps(meta))
    doc = json.loads((out / "serving.json").read_text())
    (out / "serving.json").write_text(json.dumps({**doc, "dtype": "int8"}))
    with pytest.raises(CheckpointError, match="not the export this module loaded"):
        serving.update()
    (out / "serving.json").write_text(json.dumps({**doc, "step": "four"}))
    _save(emb, tmp_path, range(4, 6))
    assert et.export(tmp_path / "ckpts", out, incremental=True).delta is None  # malformed: exported whole


def test_an_int8_delta_whose_scale_decodes_past_float32_is_refused(tmp_path: Path) -> None:
    """A finite scale (3e38) whose decoded values overflow float32: update() refuses the delta, naming it, and
    serves on; a full export so tampered is refused at load (every later lookup of the row raised before)."""
    emb, out, serving = _exported(tmp_path, "int8")
    before = _served(serving)
    _save(emb, tmp_path, range(2, 4))
    delta = Path(str(et.export(tmp_path / "ckpts", out, "int8", incremental=True).delta))
    scales_file = delta / "t0.scale.npy"
    scales = np.load(scales_file)
    scales[0] = (3e38, 0.0)
    np.save(scales_file, scales)
    with pytest.raises(CheckpointError, match=r"delta-0000000004: table 't': row 0's int8 scale 3e\+38 and bias 0.0"):
        serving.update()
    assert _same(_served(serving), before) and serving.step == 2
    whole = tmp_path / "whole"
    et.export(tmp_path / "ckpts", whole, "int8")
    full = next(whole.glob("t0*.scale.npy"))
    scales = np.load(full)
    scales[5] = (1e36, 3.4e38)
    np.save(full, scales)
    with pytest.raises(CheckpointError, match=r"row 5's int8 scale 1e\+36 and bias 3.4e\+38"):
        et.ServingEmbedding.load(whole)
