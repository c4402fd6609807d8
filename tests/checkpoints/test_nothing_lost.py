"""Nothing the library did not write is deleted; names and paths read from files are data, never
paths; checkpoints are ordered by their manifest's step; export checks what it reads and what its
dtype can hold (issues 22 and 15, one process)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import fast_child
import numpy as np
import pytest
import torch
from subproc import ROOT

import embtables as et
from embtables.checkpoint import CheckpointError, published
from embtables.checkpoint.owned_dirs import clean_dead_leftovers, temp_name

NAMES = ["scope/table", "../evil", "Price", "price", "price.scale", "naïve tablé", "with space", "emoji🙂"]


def _emb(names: list[str] = NAMES, v: int = 7, d: int = 3) -> et.DistributedEmbedding:
    feats = {
        f"f{i}": et.FeatureConfig(et.TableConfig(v + i, d, name=n, initializer=et.TruncatedNormal(seed=i)))
        for i, n in enumerate(names)
    }
    return et.DistributedEmbedding(feats, optimizer=et.Adagrad(0.5))


def _train(emb: et.DistributedEmbedding, steps: int = 2) -> None:
    for s in range(steps):
        acts = emb({k: torch.tensor([s % 3, 1, 2]) for k in emb.feature_config})
        emb.apply_gradients({k: torch.full_like(a, 0.5 + s) for k, a in acts.items()})


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- export never deletes
@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    emb = _emb(["video", "user"])
    _train(emb)
    emb.save(tmp_path / "ckpts")
    return tmp_path / "ckpts"


@pytest.mark.parametrize("where", ["cwd_like", "checkpoints", "one_file", "a_file"])
def test_export_refuses_a_directory_it_did_not_write_and_leaves_it_untouched(
    tmp_path: Path, ckpt: Path, where: str
) -> None:
    if where == "cwd_like":  # `embtables export ckpts .` with the user's files in "."
        out = tmp_path / "project"
        (out / "src").mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
    elif where == "checkpoints":  # export(ck, ck)
        out = ckpt
    elif where == "one_file":
        out = tmp_path / "almost_empty"
        out.mkdir()
        (out / ".hidden").write_text("x")
    else:
        out = tmp_path / "file.txt"
        out.write_text("a file, not a directory")
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"not an embtables export|not a directory"):
        et.export(ckpt, out)
    assert _snapshot(tmp_path) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".embtables-tmp")]


def test_export_into_new_or_empty_directory_then_replaces_only_its_own(tmp_path: Path, ckpt: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    et.export(ckpt, empty)
    assert (empty / "serving.json").is_file() and (empty / ".embtables-export").is_file()
    et.export(ckpt, empty, dtype="int8")  # an earlier export: replaced
    assert json.loads((empty / "serving.json").read_text())["dtype"] == "int8"
    (empty / "my_notes.txt").write_text("added by a person")  # now it holds a file export did not write
    with pytest.raises(CheckpointError, match=r"my_notes\.txt"):
        et.export(ckpt, empty)
    assert (empty / "my_notes.txt").read_text() == "added by a person"
    assert et.ServingEmbedding.load(empty).dtype == "int8"


_EXPORT_LOOP = """
import sys, embtables as et
print("ready", flush=True)
while True:
    et.export(sys.argv[1], sys.argv[2], dtype=sys.argv[3])
"""


def test_a_killed_re_export_leaves_a_complete_artifact_and_its_leftovers_are_cleaned(tmp_path: Path) -> None:
    emb = et.DistributedEmbedding(
        {"a": et.FeatureConfig(et.TableConfig(400_000, 16, name="big", initializer=et.Constant(0.5)))},
        optimizer=et.SGD(0.1),
    )
    emb.save(tmp_path / "ck")
    out = tmp_path / "serve"
    et.export(tmp_path / "ck", out, dtype="float16")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    seen = {"float16"}
    for dtype, delay in (("float32", 0.25), ("float32", 0.6), ("int8", 0.4)):
        proc = subprocess.Popen(
            [sys.executable, "-c", _EXPORT_LOOP, str(tmp_path / "ck"), str(out), dtype],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        serving = et.ServingEmbedding.load(out)  # the old artifact or the new one, always complete
        seen.add(dtype)
        assert serving.dtype in seen
        assert float(serving({"a": torch.tensor([0, 399_999])})["a"].sum()) == pytest.approx(16.0, abs=0.01)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".embtables-tmp")]
    et.export(tmp_path / "ck", out)  # the next writer removes what dead writers left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".embtables-tmp")], leftovers


def test_leftovers_of_a_live_writer_or_another_host_are_kept(tmp_path: Path) -> None:
    live = tmp_path / temp_name("export")  # this process: alive
    live.mkdir()
    other_host = tmp_path / ".embtables-tmp-export-otherhost-1-abcdef"
    other_host.mkdir()
    dead = tmp_path / temp_name("export").replace(f"-{os.getpid()}-", "-999999999-")
    dead.mkdir()
    assert clean_dead_leftovers(tmp_path, "export") == [dead.name]
    assert live.exists() and other_host.exists() and not dead.exists()


# ----------------------------------------------------------------------------- names are not paths
def test_any_accepted_table_name_saves_restores_exports_and_serves_bit_for_bit(tmp_path: Path) -> None:
    emb = _emb()
    _train(emb)
    emb.save(tmp_path / "ck")
    fresh = _emb()
    fresh.restore(tmp_path / "ck")
    for n in NAMES:
        assert torch.equal(fresh.embedding_tables[n], emb.embedding_tables[n]), n
    et.export(tmp_path / "ck", tmp_path / "out" / "serve")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out"]  # nothing written outside
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["serve"]
    serving = et.ServingEmbedding.load(tmp_path / "out" / "serve")
    batch = {k: torch.tensor([0, 1, 6]) for k in emb.feature_config}
    got, want = serving(batch), emb.eval()(batch)
    for k in batch:
        assert torch.equal(got[k], want[k]), k
    for dtype in ("float16", "bfloat16", "int8"):
        et.export(tmp_path / "ck", tmp_path / dtype, dtype=dtype)
        quant = et.ServingEmbedding.load(tmp_path / dtype)(batch)
        for k in batch:
            assert torch.allclose(quant[k], want[k], atol=0.02), (dtype, k)


@pytest.mark.parametrize("name", ["", "a\x00b", "tab\tname", "new\nline", "\x7f"])
def test_table_names_that_cannot_work_anywhere_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="name"):
        et.TableConfig(3, 2, name=name)


def test_a_table_name_equal_to_another_tables_row_key_is_refused() -> None:
    with pytest.raises(ValueError, match="row ids of table 'a'"):
        _emb(["a", "a#rows"])


# ----------------------------------------------------------------------------- manifests are data
def _mutate_manifest(ck: Path, fn) -> None:  # type: ignore[no-untyped-def]
    where = published(ck)[-1]
    doc = json.loads((where / "manifest.json").read_text())
    fn(doc)
    (where / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "mutation, message",
    [
        (lambda d: d["files"][0].__setitem__("file", "../../etc/passwd"), "plain file name"),
        (lambda d: d["files"][0].__setitem__("file", "/etc/passwd"), "plain file name"),
        (lambda d: d.__setitem__("step", "12"), "step must be an integer"),
        (lambda d: d.__setitem__("step", -1), "step must be an integer"),
        (lambda d: d["files"][0]["tables"]["video"]["rows"].__setitem__("offset", -8), "offset"),
        (lambda d: d["files"][0]["tables"]["video"]["rows"].__setitem__("count", 1 << 40), "outside its file"),
        (lambda d: d["files"][0]["tables"]["video"]["state"].pop("video"), "no block for 'video'"),
        (lambda d: d["files"][0]["tables"].pop("user"), "tables\\['user'\\]"),
        (lambda d: d["config"]["tables"]["video"].__setitem__("dim", "3"), "dim must be an integer"),
        (lambda d: d.__setitem__("files", {}), "non-empty list"),
        (lambda d: d["files"].append(dict(d["files"][0])), "listed twice"),
    ],
)
def test_a_malformed_manifest_is_refused_before_anything_changes(tmp_path: Path, ckpt: Path, mutation, message) -> None:  # type: ignore[no-untyped-def]
    target = published(ckpt)[-1]  # named directly: a bad step also hides it from the latest-lookup
    _mutate_manifest(ckpt, mutation)
    emb = _emb(["video", "user"])
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    for call in (lambda: emb.restore(target), lambda: et.export(target, tmp_path / "out")):
        with pytest.raises(CheckpointError, match=message):
            call()
    assert all(torch.equal(before[k], v) for k, v in emb.state_dict().items())
    assert emb._pipeline.training_steps == 0
    out = fast_child.run(
        [sys.executable, "-m", "embtables", "inspect", str(target)], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr and message.split("\\")[0][:10] in out.stderr


def test_a_rank_file_that_is_a_link_out_of_the_checkpoint_is_not_read(tmp_path: Path, ckpt: Path) -> None:
    where = published(ckpt)[-1]
    outside = tmp_path / "outside.safetensors"
    shutil.move(where / "rank-00000.safetensors", outside)
    (where / "rank-00000.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="leads outside the directory"):
        _emb(["video", "user"]).restore(ckpt)


def test_row_ids_out_of_range_in_a_rank_file_are_refused(tmp_path: Path, ckpt: Path) -> None:
    where = published(ckpt)[-1]
    doc = json.loads((where / "manifest.json").read_text())
    spec = doc["files"][0]["tables"]["user"]["rows"]
    data = bytearray((where / "rank-00000.safetensors").read_bytes())
    data[spec["offset"] : spec["offset"] + 8] = (10**9).to_bytes(8, "little")  # a row id far out of range
    import zlib

    spec["crc32"] = zlib.crc32(bytes(data[spec["offset"] : spec["offset"] + 8 * spec["count"]]))
    (where / "rank-00000.safetensors").write_bytes(bytes(data))
    (where / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="not ascending ids in"):
        _emb(["video", "user"]).restore(ckpt)


# ----------------------------------------------------------------------------- ordering by step
def test_checkpoints_are_ordered_by_their_manifest_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    emb = _emb(["video"])
    for step in (99_999_999, 100_000_000, 100_000_001):
        emb._pipeline.training_steps = step
        emb.save(tmp_path, keep_last=2)
    names = [p.name for p in published(tmp_path)]
    assert names == ["ckpt-100000000", "ckpt-100000001"]  # keep_last kept the newest, not the shortest names
    shutil.copytree(tmp_path / "ckpt-100000000", tmp_path / "ckpt-best")  # a user's copy
    (tmp_path / "ckpt-junk").mkdir()
    (tmp_path / "ckpt-junk" / "manifest.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="embtables"):
        assert published(tmp_path)[-1].name == "ckpt-100000001"
    assert "ckpt-best" in caplog.text
    fresh = _emb(["video"])
    fresh.restore(tmp_path)
    assert fresh._pipeline.training_steps == 100_000_001
    emb._pipeline.training_steps = 100_000_002
    emb.save(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-100000002", "ckpt-best", "ckpt-junk"]


# ----------------------------------------------------------------------------- export checks what it reads
def test_export_refuses_a_checkpoint_missing_a_ranks_rows(tmp_path: Path) -> None:
    emb = _emb(["video"])
    emb.save(tmp_path / "ck")

    def drop_rows(doc: dict) -> None:  # type: ignore[type-arg]
        block = doc["files"][0]["tables"]["video"]
        block["rows"]["count"] = 3  # the file now claims rows 0..2 only
        block["state"]["video"]["shape"][0] = 3
        block["state"]["video/accumulators"]["shape"][0] = 3
        import zlib

        data = (published(tmp_path / "ck")[-1] / "rank-00000.safetensors").read_bytes()
        for spec, n in ((block["rows"], 24), (block["state"]["video"], 36), (block["state"]["video/accumulators"], 36)):
            spec["crc32"] = zlib.crc32(data[spec["offset"] : spec["offset"] + n])

    _mutate_manifest(tmp_path / "ck", drop_rows)
    with pytest.raises(CheckpointError, match=r"4 of its 7 rows are in no file"):
        et.export(tmp_path / "ck", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _with_values(tmp_path: Path, values: list[float]) -> Path:
    emb = _emb(["t"], v=len(values) - 0, d=1)
    with torch.no_grad():
        emb.embedding_tables["t"].copy_(torch.tensor(values).reshape(-1, 1))
    emb.save(tmp_path / "ck")
    return tmp_path / "ck"


def test_export_refuses_values_its_dtype_cannot_hold(tmp_path: Path) -> None:
    ck = _with_values(tmp_path, [1.0, 70000.0, -2.0, 0.5, 0.0, 1.0, 3.0])
    with pytest.raises(ValueError, match=r"row 1: the value 70000.0 exceeds float16"):
        et.export(ck, tmp_path / "f16", dtype="float16")
    assert et.export(ck, tmp_path / "bf16", dtype="bfloat16").max_abs_error["t"] < 300
    emb = _emb(["t", "u"], v=2, d=2)
    with torch.no_grad():
        emb.embedding_tables["t"].copy_(torch.tensor([[3e38, -3e38], [1.0, 2.0]]))
    emb.save(tmp_path / "ck2")
    with pytest.raises(ValueError, match=r"row 0: .* cannot be quantised to int8"):
        et.export(tmp_path / "ck2", tmp_path / "i8", dtype="int8")
    assert not (tmp_path / "i8").exists() and not (tmp_path / "f16").exists()


def test_non_finite_values_are_counted_never_hidden_in_the_error(tmp_path: Path) -> None:
    ck = _with_values(tmp_path, [1.0, float("nan"), 2.0, float("inf"), 0.0, 0.25, 0.5])
    report = et.export(ck, tmp_path / "f32")
    assert report.nonfinite["t"] == 2 and report.max_abs_error["t"] == 0.0
    report = et.export(ck, tmp_path / "f16", dtype="float16")
    assert report.nonfinite["t"] == 2 and np.isfinite(report.max_abs_error["t"])
    with pytest.raises(ValueError, match="cannot be quantised to int8"):
        et.export(ck, tmp_path / "i8", dtype="int8")


# ----------------------------------------------------------------------------- serving reads strangers' files
def test_serving_refuses_malformed_or_truncated_artifacts(tmp_path: Path, ckpt: Path) -> None:
    et.export(ckpt, tmp_path / "s")
    doc = json.loads((tmp_path / "s" / "serving.json").read_text())
    data = tmp_path / "s" / doc["files"]["video"]["data"]
    for mutate, message in (
        (lambda d: d["files"]["video"].__setitem__("data", "../../x.npy"), "plain file name"),
        (lambda d: d["tables"]["video"].__setitem__("vocabulary_size", 10**15), "holds float32"),
        (lambda d: d["structure"].__setitem__("dict", {"x": {"feature": 99}}), "malformed"),
        (lambda d: d.__setitem__("feature_list", 3), "malformed"),
    ):
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        (tmp_path / "s" / "serving.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=message):
            et.ServingEmbedding.load(tmp_path / "s")
    (tmp_path / "s" / "serving.json").write_text(json.dumps(doc))
    full = data.read_bytes()
    data.write_bytes(full[:-5])
    with pytest.raises(CheckpointError, match="bytes"):
        et.ServingEmbedding.load(tmp_path / "s")
    data.write_bytes(full)
    serving = et.ServingEmbedding.load(tmp_path / "s")  # read into memory: truncating the file later is harmless
    before = serving({"f0": torch.tensor([1, 2]), "f1": torch.tensor([0])})
    with open(data, "r+b") as f:
        f.truncate(64)
    after = serving({"f0": torch.tensor([1, 2]), "f1": torch.tensor([0])})
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_save_into_a_root_another_live_process_is_saving_into_is_refused(tmp_path: Path) -> None:
    from embtables.checkpoint.owned_dirs import _host

    emb = _emb(["video"])
    emb.save(tmp_path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / ".embtables-save.lock"
        lock.write_text(json.dumps({"pid": sleeper.pid, "host": _host(), "token": "x", "what": "save of step 9"}))
        emb._pipeline.training_steps = 1
        with pytest.raises(CheckpointError, match=rf"being written by process {sleeper.pid}"):
            emb.save(tmp_path)
        assert [p.name for p in published(tmp_path)] == ["ckpt-00000000"]
    finally:
        sleeper.kill()
        sleeper.wait()
    emb.save(tmp_path)  # the holder died: its lock is stale and taken over
    assert [p.name for p in published(tmp_path)] == ["ckpt-00000000", "ckpt-00000001"]
    assert not lock.exists()
