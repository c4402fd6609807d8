"""TensorFlow interop without TensorFlow (issue 8, item 6).

The fixture ``tests/fixtures/tf/tpu_embedding`` was written by TF 2.20's own writer
(``scripts/tf_fixtures.py write``): ``TPUEmbeddingForServing`` with tables "video" (Adagrad) and
"user" (Adam). TF restores what ``write_tf_checkpoint`` writes: ``scripts/tf_fixtures.py check``
(run with TensorFlow installed) restores it into the same model and checks every value.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import embtables as et
from embtables.checkpoint.tf_bundle import OBJECT_GRAPH_KEY, parse, read_bundle
from embtables.checkpoint.tf_interop import read_tf_checkpoint, write_tf_checkpoint

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tf" / "tpu_embedding"
BASE = {"video": 1.0, "user": 2.0}
SLOT = {"": 0.0, "accumulators": 0.25, "momenta": 0.5, "velocities": 0.75}


def _expected(key: str, shape: tuple[int, ...]) -> np.ndarray:
    table, _, slot = key.partition("/")
    return (BASE[table] + SLOT[slot] + np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) / 1000).astype(
        np.float32
    )


def _module() -> et.DistributedEmbedding:
    video = et.TableConfig(40, 6, name="video", optimizer=et.Adagrad(0.1))
    user = et.TableConfig(9, 4, name="user", optimizer=et.Adam(0.01))
    return et.DistributedEmbedding({"watched": et.FeatureConfig(video), "user": et.FeatureConfig(user)})


def test_a_tf_tpu_embedding_checkpoint_loads_tables_and_slots() -> None:
    state = read_tf_checkpoint(FIXTURE)
    assert sorted(state) == ["user", "user/momenta", "user/velocities", "video", "video/accumulators"]
    emb = _module()
    emb.load_state_dict(state)
    for key, value in emb.state_dict().items():
        assert np.array_equal(value.numpy(), _expected(key, tuple(value.shape))), key


def test_written_checkpoints_have_tfs_keys_and_object_graph(tmp_path: Path) -> None:
    emb = _module()
    emb.load_state_dict(read_tf_checkpoint(FIXTURE))
    write_tf_checkpoint(tmp_path / "ckpt", {k: v * 2 for k, v in emb.state_dict().items()})
    ours, theirs = read_bundle(tmp_path / "ckpt"), read_bundle(FIXTURE)
    assert sorted(ours) == sorted(theirs)  # the same checkpoint keys as TF's own writer
    for key, value in theirs.items():
        if key != OBJECT_GRAPH_KEY:
            assert np.array_equal(ours[key], value * 2), key
    nodes = [parse(n) for n in parse(ours[OBJECT_GRAPH_KEY])[1]]
    model = [parse(c) for c in nodes[1][1]]
    names = sorted(c[2][0].decode() for c in model)
    assert names == ["user", "user/momenta", "user/velocities", "video", "video/accumulators"]
    round_trip = read_tf_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(round_trip[k], v * 2) for k, v in emb.state_dict().items())
    # written again over itself: each file replaced whole (a temporary name renamed), nothing left beside them
    write_tf_checkpoint(tmp_path / "ckpt", emb.state_dict())
    assert all(torch.equal(read_tf_checkpoint(tmp_path / "ckpt")[k], v) for k, v in emb.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.data-00000-of-00001", "ckpt.index"]


def test_a_corrupt_tf_checkpoint_is_refused(tmp_path: Path) -> None:
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(f"{FIXTURE}{suffix}", tmp_path / f"c{suffix}")
    data = tmp_path / "c.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="CRC-32C"):
        read_tf_checkpoint(tmp_path / "c")
    with pytest.raises(ValueError, match="cannot be read"):
        read_tf_checkpoint(tmp_path / "missing")


def test_every_crc32c_gives_the_castagnoli_checksum(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native CRC-32C (SSE 4.2 or its table), google_crc32c when installed and the pure-Python one agree,
    pieces chained included; the bundle reader checks the fixture's CRCs with each."""
    import random

    from embtables.checkpoint import tf_bundle
    from embtables.kernels import checksums

    rng = random.Random(11)
    samples = [b"", b"123456789", bytearray(b"\x00" * 33), memoryview(bytes(range(256)))]
    samples += [bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 300))) for _ in range(40)]
    assert tf_bundle.crc32c_python(b"123456789") == 0xE3069283  # the check value of CRC-32C
    for data in samples:
        expected = tf_bundle.crc32c_python(data)
        assert checksums.crc32c(data) == expected
        cut = len(bytes(data)) // 3
        head = checksums.crc32c(bytes(data)[:cut])
        assert head is not None and checksums.crc32c(bytes(data)[cut:], head) == expected
    assert checksums.crc32c(b"x", 7) == tf_bundle.crc32c_python(b"x", 7)
    with pytest.raises(ValueError, match="32-bit"):
        checksums.crc32c(b"x", -1)
    good = read_bundle(FIXTURE)
    monkeypatch.setattr(checksums, "library", lambda: None)  # no native library: the other ways
    assert checksums.crc32c(b"123456789") is None
    assert tf_bundle.crc32c(b"123456789") == 0xE3069283
    again = read_bundle(FIXTURE)
    assert again.keys() == good.keys() and all(np.array_equal(np.asarray(again[k]), np.asarray(good[k])) for k in good)
