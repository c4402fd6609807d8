"""Checkpoints (issue 8, items 1-4 and 7): save/restore round trips, resume exactness, any-to-any
restore across world sizes and strategies with real gloo processes, crash safety with a writer
killed by SIGKILL, corruption detection that changes nothing, keep_last, and the inspect CLI."""

from __future__ import annotations

import os
import re
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
from embtables.checkpoint import CheckpointError, published

OPTIMIZERS = {
    "sgd": lambda: et.SGD(0.2),
    "adagrad": lambda: et.Adagrad(0.1),
    "momentum": lambda: et.AdagradMomentum(0.1, momentum=0.9),
    "adam": lambda: et.Adam(0.05),
    "ftrl": lambda: et.FTRL(0.1, l1_regularization_strength=0.01),
}


def _config(opt: str = "adagrad", seed: int = 1, v: int = 13) -> dict[str, et.FeatureConfig]:
    o = OPTIMIZERS[opt]()
    t = et.TableConfig(v, 4, name="t", initializer=et.TruncatedNormal(seed=seed), optimizer=o)
    u = et.TableConfig(5, 3, name="u", combiner="sum", initializer=et.TruncatedNormal(seed=seed + 1), optimizer=o)
    return {"a": et.FeatureConfig(t), "b": et.FeatureConfig(u), "s": et.FeatureConfig(t, max_sequence_length=2)}


def _batch(step: int, lo: int = 0, hi: int = 6) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "a": torch.randint(0, 13, (6,), generator=g)[lo:hi],
        "b": torch.randint(0, 5, (6,), generator=g)[lo:hi],
        "s": et.Ragged.from_lists(torch.randint(0, 13, (6, 3), generator=g).tolist()[lo:hi]),
    }


def _train(emb: et.DistributedEmbedding, steps: range, lo: int = 0, hi: int = 6) -> None:
    for step in steps:
        acts = emb(_batch(step, lo, hi))
        gen = torch.Generator().manual_seed(50 + step)
        # The gradient depends on the activations, so a lookup that reads other rows changes the run.
        noise = {k: torch.randn((6, *v.shape[1:]), generator=gen)[lo:hi] for k, v in sorted(acts.items())}
        emb.apply_gradients({k: noise[k] + 0.5 * v.detach() for k, v in acts.items()})


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_round_trip_and_resume_are_bit_identical(opt: str, tmp_path: Path) -> None:
    straight = et.DistributedEmbedding(_config(opt))
    _train(straight, range(4))
    first = et.DistributedEmbedding(_config(opt))
    _train(first, range(2))
    where = first.save(tmp_path, extra={"note": "half way"})
    assert Path(where).name == "ckpt-00000002"
    resumed = et.DistributedEmbedding(_config(opt, seed=9))  # other initial values: all overwritten
    manifest = resumed.restore(tmp_path)
    assert manifest["step"] == 2 and manifest["extra"] == {"note": "half way"}
    assert_same(snapshot(first), snapshot(resumed))
    _train(resumed, range(2, 4))
    assert_same(snapshot(straight), snapshot(resumed))


def test_a_pipelined_run_resumes_exactly_with_its_update_pending_at_save(tmp_path: Path) -> None:
    straight = et.DistributedEmbedding(_config(), pipeline_execution_with_tensor_core=True)
    _train(straight, range(6))
    first = et.DistributedEmbedding(_config(), pipeline_execution_with_tensor_core=True)
    _train(first, range(3))  # the third update is still held back at save
    first.save(tmp_path)
    resumed = et.DistributedEmbedding(_config(seed=4), pipeline_execution_with_tensor_core=True)
    resumed.restore(tmp_path)
    assert_same(snapshot(first), snapshot(resumed))
    _train(resumed, range(3, 6))  # step 4's lookup still reads the rows before step 3's update
    assert_same(snapshot(straight), snapshot(resumed))


def test_corrupt_or_truncated_files_are_named_and_nothing_changes(tmp_path: Path) -> None:
    emb = et.DistributedEmbedding(_config())
    _train(emb, range(2))
    where = Path(emb.save(tmp_path))
    target = et.DistributedEmbedding(_config(seed=3))
    before = snapshot(target)
    data = where / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors.*CRC-32"):
        target.restore(where)
    assert_same(before, snapshot(target))
    data.write_bytes(bytes(raw[:100]))
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors: 100 bytes"):
        target.restore(where)
    assert_same(before, snapshot(target))
    out = fast_child.run([sys.executable, "-m", "embtables", "inspect", str(where)], capture_output=True, text=True)
    assert out.returncode == 1 and "BAD" in out.stdout
    with pytest.raises(CheckpointError, match="no checkpoint"):
        target.restore(tmp_path / "nowhere")


def test_a_checkpoint_of_another_model_is_refused_with_the_differences(tmp_path: Path) -> None:
    emb = et.DistributedEmbedding(_config())
    emb.save(tmp_path)
    other = et.DistributedEmbedding(_config(opt="adam", v=14))
    before = snapshot(other)
    with pytest.raises(CheckpointError, match=r"vocabulary_size 13 in the checkpoint, 14 here.*Adagrad"):
        other.restore(tmp_path)
    assert_same(before, snapshot(other))


def test_keep_last_and_inspect(tmp_path: Path) -> None:
    emb = et.DistributedEmbedding(_config())
    for step in range(4):
        _train(emb, range(step, step + 1))
        emb.save(tmp_path, keep_last=2)
    assert [p.name for p in published(tmp_path)] == ["ckpt-00000003", "ckpt-00000004"]
    out = fast_child.run([sys.executable, "-m", "embtables", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "step 4" in out.stdout and re.search(r" 13 +4 +float32 +Adagrad +accumulators ", out.stdout), out.stdout
    assert "checksums: OK" in out.stdout


_WRITER = """
import sys, torch, embtables as et
t = et.TableConfig(2_000_000, 32, name="big", initializer=et.Constant(0.5), optimizer=et.Adagrad(0.1))
emb = et.DistributedEmbedding({"a": et.FeatureConfig(t)})
print("ready", flush=True)
emb.save(sys.argv[1])
print("saved", flush=True)
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    small = et.TableConfig(2_000_000, 32, name="big", initializer=et.Constant(0.25), optimizer=et.Adagrad(0.1))
    emb = et.DistributedEmbedding({"a": et.FeatureConfig(small)})
    emb.save(tmp_path)  # step 0, published
    os.utime(tmp_path)
    kill_while_writing(_WRITER, tmp_path)  # killed once its data file is being written
    assert [p.name for p in published(tmp_path)] == ["ckpt-00000000"]
    fresh = et.DistributedEmbedding({"a": et.FeatureConfig(small)})
    with torch.no_grad():
        fresh.embedding_tables["big"].fill_(1.0)
    fresh.restore(tmp_path)
    assert bool((fresh.embedding_tables["big"] == 0.25).all())
    emb.save(tmp_path)  # the next save cleans up the killed one's leftovers
    assert not list(tmp_path.glob(".embtables-tmp-ckpt-*"))


def _save_sharded(rank: int, world: int, root: str, sharding: str) -> None:
    emb = et.DistributedEmbedding(_config(), sharding=sharding)
    _train(emb, range(3), rank * (6 // world), (rank + 1) * (6 // world))
    state = emb.state_dict()
    emb.save(root)
    if rank == 0:
        torch.save(state, os.path.join(root, "expected.pt"))


def _restore_sharded(rank: int, world: int, root: str, sharding: str) -> None:
    emb = et.DistributedEmbedding(_config(seed=7), sharding=sharding)
    manifest = emb.restore(root)
    expected = torch.load(os.path.join(root, "expected.pt"))
    got = emb.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected), (world, sharding)
    assert manifest["step"] == 3


@pytest.mark.distributed
def test_any_to_any_restore_across_world_sizes_and_strategies(tmp_path: Path) -> None:
    # W=2 mod -> W=3 table, W=1 (no process group) and W=2 div; W=3 div -> W=2 mod and W=1.
    for writer, strategy, readers in ((2, "mod", ((3, "table"), (2, "div"))), (3, "div", ((2, "mod"),))):
        root = tmp_path / f"w{writer}-{strategy}"
        run_world(_save_sharded, writer, str(root), strategy)
        expected = torch.load(root / "expected.pt")
        for world, sharding in readers:
            run_world(_restore_sharded, world, str(root), sharding)
        single = et.DistributedEmbedding(_config(seed=8))
        single.restore(root)
        assert all(torch.equal(single.state_dict()[k], v) for k, v in expected.items())


def test_rank_files_are_safetensors_files(tmp_path: Path) -> None:
    """The safetensors layout read by hand: 8-byte header size, JSON header, contiguous raw data."""
    import itertools
    import json

    import numpy as np

    emb = et.DistributedEmbedding(_config())
    _train(emb, range(1))
    raw = (Path(emb.save(tmp_path)) / "rank-00000.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no holes, as safetensors requires
    state = emb.state_dict()
    for key in ("t", "t/accumulators", "u", "u/accumulators"):
        spec = header[key]
        assert spec["dtype"] == "F32"
        lo, hi = spec["data_offsets"]
        values = np.frombuffer(data[lo:hi], dtype=np.float32).reshape(spec["shape"])
        assert np.array_equal(values, state[key].numpy())
    assert header["t#rows"]["dtype"] == "I64" and header["t#rows"]["shape"] == [13]
