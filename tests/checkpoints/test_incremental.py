"""Incremental checkpoints (docs/checkpoints.md, "Incremental checkpoints"): ``save(root, incremental=True)``
writes only the rows changed since the module's last save or restore, on top of that checkpoint; ``restore``
resolves the chain (the last full checkpoint, then every increment in order) and gives the same bits as the
restore of a full checkpoint of the same step, in one process and into any W and strategy; a missing,
replaced, out-of-order or corrupt link is refused naming it, with nothing changed; ``keep_last`` never
deletes a checkpoint that a kept one builds on."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import fast_child
import pytest
import torch
from mp_world import run_world
from statecheck import assert_same, snapshot
from subproc import kill_while_writing

import embtables as et
from embtables.checkpoint import CheckpointError, increments, published

OPTIMIZERS = {
    "adagrad": lambda: et.Adagrad(0.1),
    "adam_dense": lambda: et.Adam(0.05, lazy_adam=False),  # every row changes every step
    "ftrl": lambda: et.FTRL(0.1, l1_regularization_strength=0.01),
    "sgd": lambda: et.SGD(0.2),
}


def _config(opt: str = "adagrad", seed: int = 1) -> dict[str, et.FeatureConfig]:
    o = OPTIMIZERS[opt]()
    t = et.TableConfig(300, 4, name="t", initializer=et.TruncatedNormal(seed=seed), optimizer=o)
    u = et.TableConfig(40, 3, name="u", combiner="sum", initializer=et.TruncatedNormal(seed=seed + 1), optimizer=o)
    return {"a": et.FeatureConfig(t), "b": et.FeatureConfig(u), "s": et.FeatureConfig(t, max_sequence_length=2)}


def _train(emb: et.DistributedEmbedding, steps: range, lo: int = 0, hi: int = 6) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        batch = {
            "a": torch.randint(0, 300, (6,), generator=g)[lo:hi],
            "b": torch.randint(0, 40, (6,), generator=g)[lo:hi],
            "s": et.Ragged.from_lists(torch.randint(0, 300, (6, 3), generator=g).tolist()[lo:hi]),
        }
        acts = emb(batch)
        emb.apply_gradients({k: 0.5 * v.detach() + (step + 1) * 0.01 for k, v in acts.items()})


def _rows_in(where: str | Path) -> int:
    manifest = json.loads((Path(where) / "manifest.json").read_text())
    return sum(b["rows"]["count"] for f in manifest["files"] for b in f["tables"].values())


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_a_chain_restores_the_bits_of_a_full_checkpoint_of_the_same_step(opt: str, tmp_path: Path) -> None:
    emb = et.DistributedEmbedding(_config(opt))
    chain_root, full_root = tmp_path / "chain", tmp_path / "full"
    paths = []
    for lo in range(0, 9, 3):
        _train(emb, range(lo, lo + 3))
        paths.append(emb.save(chain_root, incremental=True))
    emb.save(full_root)
    manifests = [json.loads((Path(p) / "manifest.json").read_text()) for p in paths]
    assert "chain" not in manifests[0]  # the first one is full
    if opt != "adam_dense":  # a lazy optimizer's increment holds the rows the steps touched, not the tables
        assert [m["chain"]["increments"] for m in manifests[1:]] == [1, 2]
        assert manifests[2]["chain"]["previous"] == Path(paths[1]).name
        assert _rows_in(paths[1]) < _rows_in(paths[0]) == 340
    else:  # every row changes every step: more than half the rows, so full checkpoints
        assert all("chain" not in m for m in manifests) and _rows_in(paths[1]) == 340
    from_chain, from_full = et.DistributedEmbedding(_config(opt, seed=5)), et.DistributedEmbedding(_config(opt, seed=6))
    assert from_chain.restore(chain_root)["step"] == 9
    from_full.restore(full_root)
    assert_same(snapshot(from_full), snapshot(from_chain))
    assert_same(snapshot(emb), snapshot(from_chain))
    middle = et.DistributedEmbedding(_config(opt, seed=7))
    assert middle.restore(paths[1])["step"] == 6  # any link: its own chain
    _train(middle, range(6, 9))
    assert_same(snapshot(emb), snapshot(middle))


def test_a_dense_optimizer_chain_restores_exactly_when_increments_are_forced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(increments, "FULL_ABOVE", 1.0)  # an increment even when every row changed
    emb = et.DistributedEmbedding(_config("adam_dense"))
    for lo in range(0, 6, 2):
        _train(emb, range(lo, lo + 2))
        where = emb.save(tmp_path, incremental=True)
    assert json.loads((Path(where) / "manifest.json").read_text())["chain"]["increments"] == 2
    again = et.DistributedEmbedding(_config("adam_dense", seed=3))
    again.restore(tmp_path)
    assert_same(snapshot(emb), snapshot(again))


def test_a_pipelined_run_saves_increments_that_resume_exactly(tmp_path: Path) -> None:
    straight = et.DistributedEmbedding(_config(), pipeline_execution_with_tensor_core=True)
    _train(straight, range(8))
    emb = et.DistributedEmbedding(_config(), pipeline_execution_with_tensor_core=True)
    _train(emb, range(3))
    emb.save(tmp_path, incremental=True)
    _train(emb, range(3, 5))  # the fifth update is held back at save: it lands first, its old rows kept
    emb.save(tmp_path, incremental=True)
    resumed = et.DistributedEmbedding(_config(seed=4), pipeline_execution_with_tensor_core=True)
    resumed.restore(tmp_path)
    _train(resumed, range(5, 8))
    assert_same(snapshot(straight), snapshot(resumed))


def test_a_full_checkpoint_is_written_where_an_increment_would_be_wrong(tmp_path: Path) -> None:
    emb = et.DistributedEmbedding(_config())
    _train(emb, range(2))
    emb.save(tmp_path / "a", incremental=True)
    _train(emb, range(2, 3))
    elsewhere = emb.save(tmp_path / "b", incremental=True)  # the changed rows count from a/'s checkpoint
    assert "chain" not in json.loads((Path(elsewhere) / "manifest.json").read_text())
    _train(emb, range(3, 4))
    assert "chain" in json.loads((Path(emb.save(tmp_path / "b", incremental=True)) / "manifest.json").read_text())
    other = et.DistributedEmbedding(_config(seed=3))
    other.load_state_dict(emb.state_dict())  # loaded values: no checkpoint to build on
    assert "chain" not in json.loads((Path(other.save(tmp_path / "c", incremental=True)) / "manifest.json").read_text())
    older = et.DistributedEmbedding(_config(seed=3))
    older.restore(tmp_path / "a")  # not the newest under b/
    _train(older, range(5, 6))
    assert "chain" not in json.loads((Path(older.save(tmp_path / "b", incremental=True)) / "manifest.json").read_text())
    again = json.loads((Path(emb.save(tmp_path / "b", incremental=True)) / "manifest.json").read_text())
    assert "chain" not in again  # the same step saved again replaces the newest: never built on itself
    assert et.DistributedEmbedding(_config(seed=3)).restore(tmp_path / "b")["step"] == again["step"]
    cadence = et.DistributedEmbedding(_config())
    kinds = []
    for step in range(5):
        _train(cadence, range(step, step + 1))
        manifest = json.loads(
            (Path(cadence.save(tmp_path / "d", incremental=True, full_every=2)) / "manifest.json").read_text()
        )
        kinds.append(manifest.get("chain", {}).get("increments", 0))
    assert kinds == [0, 1, 2, 0, 1]


def test_a_missing_replaced_out_of_order_or_corrupt_link_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    emb = et.DistributedEmbedding(_config())
    paths = []
    for lo in range(0, 8, 2):
        _train(emb, range(lo, lo + 2))
        paths.append(Path(emb.save(tmp_path / "root", incremental=True)))
    target = et.DistributedEmbedding(_config(seed=9))
    before = snapshot(target)
    data = paths[2] / "rank-00000.safetensors"
    raw = data.read_bytes()
    flipped = bytearray(raw)
    flipped[-5] ^= 0xFF
    data.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"ckpt-00000006/rank-00000\.safetensors.*CRC-32"):
        target.restore(tmp_path / "root")
    assert_same(before, snapshot(target))
    data.write_bytes(raw)
    manifest_file = paths[2] / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    saved_id = manifest["id"]
    manifest["id"] = "0" * 32  # saved again after the next increment was written
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"ckpt-00000008: an incremental checkpoint built on ckpt-00000006, but"):
        target.restore(tmp_path / "root")
    assert_same(before, snapshot(target))
    manifest["id"] = saved_id
    manifest["step"] = 9  # after the increment built on it
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="out of order"):
        target.restore(paths[3])
    manifest["step"] = 6
    manifest_file.write_text(json.dumps(manifest))
    target.restore(tmp_path / "root")  # whole again
    assert_same(snapshot(emb), snapshot(target))
    os.rename(paths[1], tmp_path / "moved")
    fresh = et.DistributedEmbedding(_config(seed=9))
    with pytest.raises(CheckpointError, match=r"built on ckpt-00000004 \(step 4\), which is missing"):
        fresh.restore(tmp_path / "root")
    assert_same(before, snapshot(fresh))
    bad = json.loads((paths[3] / "manifest.json").read_text())
    looped = {**bad, "chain": {**bad["chain"], "previous": paths[3].name, "previous_id": bad["id"], "previous_step": 8}}
    (paths[3] / "manifest.json").write_text(json.dumps(looped))  # built on itself: refused, not followed forever
    with pytest.raises(CheckpointError, match="out of order"):
        fresh.restore(tmp_path / "root")
    bad["chain"]["previous"] = "../moved"
    (paths[3] / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="only a plain file name"):
        fresh.restore(tmp_path / "root")
    assert_same(before, snapshot(fresh))


def test_keep_last_keeps_every_checkpoint_a_kept_one_builds_on(tmp_path: Path) -> None:
    emb = et.DistributedEmbedding(_config())
    for step in range(7):
        _train(emb, range(step, step + 1))
        emb.save(tmp_path, incremental=True, full_every=3, keep_last=2)
    # full at 1 and 5; increments 2-4 build on 1, 6-7 on 5: the two newest need 5 and 6 only
    assert [p.name for p in published(tmp_path)] == ["ckpt-00000005", "ckpt-00000006", "ckpt-00000007"]
    _train(emb, range(7, 8))
    emb.save(tmp_path, incremental=True, full_every=3, keep_last=1)  # 8 builds on 7, 6, 5
    assert [p.name for p in published(tmp_path)] == ["ckpt-00000005", "ckpt-00000006", "ckpt-00000007", "ckpt-00000008"]
    again = et.DistributedEmbedding(_config(seed=2))
    again.restore(tmp_path)
    assert_same(snapshot(emb), snapshot(again))


def test_a_chain_with_a_dynamic_table_restores_and_exports_as_a_full_checkpoint(tmp_path: Path) -> None:
    def module() -> et.DistributedEmbedding:
        policy = et.DynamicVocabulary(admit_after=1, eviction="lru")
        user = et.TableConfig(12, 3, name="user", dynamic=policy, initializer=et.TruncatedNormal(seed=4))
        item = et.TableConfig(200, 3, name="item", initializer=et.TruncatedNormal(seed=5))
        return et.DistributedEmbedding({"u": et.FeatureConfig(user), "i": et.FeatureConfig(item)}, et.Adagrad(0.1))

    def train(emb: et.DistributedEmbedding, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(step)
            users = torch.randint(0, 40, (6,), generator=g) * 10**12  # 40 keys for 12 rows: admissions, evictions
            acts = emb({"u": users, "i": torch.randint(0, 200, (6,), generator=g)})
            emb.apply_gradients({k: torch.randn(v.shape, generator=g) for k, v in acts.items()})

    emb = module()
    for lo in range(0, 12, 4):
        train(emb, range(lo, lo + 4))
        where = Path(emb.save(tmp_path / "chain", incremental=True))
    emb.save(tmp_path / "full")
    stats = emb.vocabulary_statistics()["user"]
    assert stats["admitted"] > 12 and stats["evicted"] > 0  # keys came and went between the saves
    manifest = json.loads((where / "manifest.json").read_text())
    assert manifest["chain"]["increments"] == 2
    tables = manifest["files"][0]["tables"]
    assert tables["user"]["rows"]["count"] == 12 and tables["item"]["rows"]["count"] < 200  # dynamic: whole
    from_chain, from_full = module(), module()
    from_chain.restore(tmp_path / "chain")
    from_full.restore(tmp_path / "full")
    assert_same(snapshot(from_full), snapshot(from_chain))
    for a, b in ((from_chain, from_full), (from_chain, emb)):
        assert all(torch.equal(x, y) for x, y in zip(a.vocabulary("user"), b.vocabulary("user")))
    train(from_chain, range(12, 16))  # admissions and evictions go on as in the uninterrupted run
    train(emb, range(12, 16))
    assert_same(snapshot(emb), snapshot(from_chain))
    et.export(tmp_path / "chain", tmp_path / "e-chain")
    et.export(tmp_path / "full", tmp_path / "e-full")
    for f in sorted((tmp_path / "e-full").glob("*.npy")):
        assert (tmp_path / "e-chain" / f.name).read_bytes() == f.read_bytes(), f.name
    with pytest.raises(ValueError, match="full_every"):
        et.DistributedEmbedding(_config()).save(tmp_path, incremental=True, full_every=0)


_WRITER = """
import sys, torch, embtables as et
t = et.TableConfig(1_000_000, 32, name="big", initializer=et.Constant(0.5), optimizer=et.Adam(0.1, lazy_adam=False))
emb = et.DistributedEmbedding({"a": et.FeatureConfig(t)})
emb.save(sys.argv[1], incremental=True)  # full: the first one
emb({"a": torch.tensor([1, 2])})
emb.apply_gradients({"a": torch.ones(2, 32)})
print("ready", flush=True)  # a dense optimizer changed every row: the increment is as large as the table
emb.save(sys.argv[1], incremental=True)
print("saved", flush=True)
"""


def test_a_writer_killed_during_an_increment_leaves_the_chain_restorable(tmp_path: Path) -> None:
    kill_while_writing(_WRITER, tmp_path)  # killed once its data file is being written
    assert [p.name for p in published(tmp_path)] == ["ckpt-00000000"]
    t = et.TableConfig(
        1_000_000, 32, name="big", initializer=et.Constant(0.25), optimizer=et.Adam(0.1, lazy_adam=False)
    )
    fresh = et.DistributedEmbedding({"a": et.FeatureConfig(t)})
    fresh.restore(tmp_path)
    assert bool((fresh.embedding_tables["big"] == 0.5).all())


def _save_chain(rank: int, world: int, root: str, sharding: str) -> None:
    emb = et.DistributedEmbedding(_config(), sharding=sharding)
    for lo in range(0, 6, 2):
        _train(emb, range(lo, lo + 2), rank * (6 // world), (rank + 1) * (6 // world))
        emb.save(root, incremental=True)
    state = emb.state_dict()
    if rank == 0:
        torch.save(state, os.path.join(root, "expected.pt"))


def _restore_chain(rank: int, world: int, root: str, sharding: str) -> None:
    emb = et.DistributedEmbedding(_config(seed=7), sharding=sharding)
    assert emb.restore(root)["step"] == 6
    expected = torch.load(os.path.join(root, "expected.pt"))
    got = emb.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected), (world, sharding)


def _dynamic_module(sharding: str = "div") -> et.DistributedEmbedding:
    policy = et.DynamicVocabulary(admit_after=1, eviction="lru")
    user = et.TableConfig(16, 3, name="user", dynamic=policy, initializer=et.TruncatedNormal(seed=4))
    item = et.TableConfig(200, 3, name="item", initializer=et.TruncatedNormal(seed=5))
    features = {"u": et.FeatureConfig(user), "i": et.FeatureConfig(item)}
    return et.DistributedEmbedding(features, et.Adagrad(0.1), sharding=sharding)


def _dynamic_steps(emb: et.DistributedEmbedding, steps: range, rank: int, world: int) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step * 10 + rank)
        users = torch.randint(0, 30, (4,), generator=g) * 10**12 + rank  # more keys than rows: keys come and go
        acts = emb({"u": users, "i": torch.randint(0, 200, (4,), generator=g)})
        emb.apply_gradients({k: torch.randn(v.shape, generator=g) for k, v in acts.items()})


def _save_dynamic_chain(rank: int, world: int, root: str) -> None:
    emb = _dynamic_module()
    for lo in range(0, 9, 3):
        _dynamic_steps(emb, range(lo, lo + 3), rank, world)
        emb.save(root, incremental=True)
    state = emb.state_dict()
    keys = torch.sort(emb.vocabulary("user")[0]).values
    emb.eval()  # a lookup of every live key: its row's values, whichever rank and row hold it
    with torch.no_grad():
        served = emb({"u": keys, "i": torch.zeros_like(keys)})["u"]
    if rank == 0:
        torch.save((state, keys, served), os.path.join(root, "expected.pt"))


def _restore_dynamic_chain(rank: int, world: int, root: str) -> None:
    emb = _dynamic_module("mod")
    emb.restore(root)
    state, keys, served = torch.load(os.path.join(root, "expected.pt"))
    assert torch.equal(torch.sort(emb.vocabulary("user")[0]).values, keys)
    emb.eval()
    with torch.no_grad():
        assert torch.equal(emb({"u": keys, "i": torch.zeros_like(keys)})["u"], served)
    got = emb.state_dict()
    assert torch.equal(got["item"], state["item"]) and torch.equal(got["item/accumulators"], state["item/accumulators"])


@pytest.mark.distributed
def test_a_chain_with_a_dynamic_table_written_by_two_ranks_restores_into_another_strategy(tmp_path: Path) -> None:
    root = tmp_path / "dyn"
    run_world(_save_dynamic_chain, 2, str(root))
    assert [json.loads((p / "manifest.json").read_text()).get("chain", {}).get("increments", 0)
            for p in published(root)] == [0, 1, 2]  # fmt: skip
    run_world(_restore_dynamic_chain, 2, str(root))


@pytest.mark.distributed
def test_a_chain_written_by_two_ranks_restores_into_any_world_and_strategy(tmp_path: Path) -> None:
    root = tmp_path / "w2-mod"
    run_world(_save_chain, 2, str(root), "mod")
    manifests = [json.loads((p / "manifest.json").read_text()) for p in published(root)]
    assert [m.get("chain", {}).get("increments", 0) for m in manifests] == [0, 1, 2]
    assert all(len(m["files"]) == 2 for m in manifests)
    run_world(_restore_chain, 2, str(root), "div")
    expected: dict[str, Any] = torch.load(root / "expected.pt")
    single = et.DistributedEmbedding(_config(seed=8))
    single.restore(root)
    assert all(torch.equal(single.state_dict()[k], v) for k, v in expected.items())


def test_inspect_lists_the_chain_or_says_it_is_broken(tmp_path: Path) -> None:
    emb = et.DistributedEmbedding(_config())
    paths = []
    for lo in range(0, 6, 2):
        _train(emb, range(lo, lo + 2))
        paths.append(Path(emb.save(tmp_path, incremental=True)))
    out = fast_child.run([sys.executable, "-m", "embtables", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "chain (restored in this order)" in out.stdout
    assert [line.split()[2] for line in out.stdout.splitlines() if line.strip().startswith("ckpt-")] == [
        "full", "increment", "increment"]  # fmt: skip
    os.rename(paths[0], tmp_path / "gone")
    out = fast_child.run([sys.executable, "-m", "embtables", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 1 and "chain: BROKEN" in out.stdout and "ckpt-00000002" in out.stdout
