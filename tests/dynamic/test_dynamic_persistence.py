"""Dynamic tables (spec §11) through everything that keeps state: checkpoints, state dicts, copies;
evaluation lookups; the input rules for keys; capacity limits; and the sharded refusal."""

from __future__ import annotations

import copy
import json
import pickle
import random
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import embtables as et
from embtables.tables.dynamic_vocabularies import VOCABULARY_FIELDS

POOL = [*range(-6, 6), 2**63 - 1, -(2**63), 10**17]


def _module(policy: et.DynamicVocabulary | None = None, capacity: int = 6) -> et.DistributedEmbedding:
    init = et.TruncatedNormal(stddev=0.3, seed=11)  # rows reset alike in every module compared
    policy = policy or et.DynamicVocabulary(admit_after=2, eviction="lfu", ttl_steps=4)
    user = et.TableConfig(capacity, 3, name="user", dynamic=policy, initializer=init)
    item = et.TableConfig(10, 3, name="item")
    features = {"u": et.FeatureConfig(user), "h": et.FeatureConfig(user), "i": et.FeatureConfig(item)}
    return et.DistributedEmbedding(features, et.Adam(0.05))


def _steps(modules: list[et.DistributedEmbedding], seed: int, n: int) -> None:
    """The same n training steps on every module (same inputs, same gradients)."""
    rng = random.Random(seed)
    for _ in range(n):
        u = torch.tensor([rng.choice(POOL) for _ in range(4)])
        h = et.Ragged.from_lists([[rng.choice(POOL) for _ in range(rng.randint(0, 3))] for _ in range(4)])
        i = torch.tensor([rng.randrange(10) for _ in range(4)])
        grads = {k: torch.randn(4, 3) for k in ("u", "h", "i")}
        for m in modules:
            m({"u": u, "h": h, "i": i})
            m.apply_gradients(grads)


def _assert_same(a: et.DistributedEmbedding, b: et.DistributedEmbedding) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    ka, ra = a.vocabulary("user")
    kb, rb = b.vocabulary("user")
    assert torch.equal(ka, kb) and torch.equal(ra, rb)


def test_save_restore_continues_exactly(tmp_path: Path) -> None:
    a = _module()
    _steps([a], 0, 12)
    path = Path(a.save(tmp_path))
    b = _module()
    b.restore(tmp_path)
    _assert_same(a, b)
    assert a.vocabulary("user")[0].numel() > 0
    _steps([a, b], 1, 12)  # admissions, evictions and expiry after the restore match the uninterrupted run
    _assert_same(a, b)
    stats = b.vocabulary_statistics()["user"]
    assert stats["admitted"] > 0 and stats["live"] == a.vocabulary_statistics()["user"]["live"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"][0]["tables"]["user"]["vocabulary"]) == set(VOCABULARY_FIELDS)


def test_state_dict_and_copies_continue_exactly() -> None:
    a = _module()
    _steps([a], 2, 10)
    state = a.state_dict()
    assert {"user/keys", "user/counts", "user/age", "user/order", "user/pending_keys"} <= state.keys()
    assert state["user/keys"].dtype == torch.int64 and state["user/keys"].shape == (6,)
    b = _module()  # a fresh module (step 0): ages count back from its own step, so expiry stays in step
    b.load_state_dict(state)
    c, d = copy.deepcopy(a), pickle.loads(pickle.dumps(a))
    _steps([a, b, c, d], 3, 10)
    for other in (b, c, d):
        _assert_same(a, other)


def test_evaluation_lookups_change_nothing() -> None:
    a = _module()
    _steps([a], 4, 6)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    stats = a.vocabulary_statistics()
    keys, rows = a.vocabulary("user")
    a.eval()
    out = a({"u": torch.tensor([int(keys[0]), 123456789]), "h": et.Ragged.from_lists([[int(keys[0])], [99]]),
             "i": torch.tensor([0, 1])})  # fmt: skip
    assert torch.equal(out["u"][0], a.embedding_tables["user"][int(rows[0])])
    assert torch.equal(out["u"][1], torch.zeros(3)) and torch.equal(out["h"][1], torch.zeros(3))
    assert a.vocabulary_statistics() == stats
    for k, v in a.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_keys_take_any_int64_and_keep_the_other_input_rules() -> None:
    user = et.TableConfig(4, 2, name="user", dynamic=et.DynamicVocabulary())
    strict = et.DistributedEmbedding({"u": et.FeatureConfig(user, validate_weights_and_indices=False)}, et.SGD(0.1))
    out = strict({"u": torch.tensor([-1, 2**63 - 1, -(2**63), 4])})  # negative and >= capacity: keys like any other
    assert strict.vocabulary("user")[0].tolist() == [-1, 2**63 - 1, -(2**63), 4]
    strict.apply_gradients({"u": torch.ones_like(out["u"])})
    with pytest.raises(TypeError, match="uint64"):
        strict({"u": torch.tensor([1], dtype=torch.uint64)})
    with pytest.raises(TypeError, match="integer dtype"):
        strict({"u": torch.tensor([1.0])})
    # weights <= 0 are still dropped (validate_weights_and_indices=True): the key is not even counted
    m = et.DistributedEmbedding({"u": et.FeatureConfig(user)}, et.SGD(0.1))
    m({"u": et.Ragged.from_lists([[7, 8]])}, {"u": et.Ragged.from_lists([[1.0, -1.0]], dtype=torch.float32)})
    assert m.vocabulary("user")[0].tolist() == [7]
    with pytest.raises(KeyError, match="not a dynamic table"):
        m.vocabulary("nope")


def test_full_table_without_eviction_is_counted_never_an_error() -> None:
    m = _module(et.DynamicVocabulary(eviction=None), capacity=2)
    acts = m({"u": torch.tensor([1, 2, 3, 4]), "h": et.Ragged.from_lists([[], [], [], []]), "i": torch.zeros(4).long()})
    assert acts["u"][2:].abs().sum() == 0  # keys 3 and 4 found no row: absent from their bags
    m.apply_gradients({k: torch.ones(4, 3) for k in ("u", "h", "i")})
    stats = m.vocabulary_statistics()["user"]
    assert stats["rejected"] == 2 and stats["live"] == 2 and stats["evicted"] == 0


def _vocabulary_field(path: Path, field: str) -> np.ndarray[Any, Any]:
    """A copy of ``field`` of table user's vocabulary in the first rank file of checkpoint ``path``."""
    entry = json.loads((path / "manifest.json").read_text())["files"][0]
    spec = entry["tables"]["user"]["vocabulary"][field]
    data = (path / entry["file"]).read_bytes()
    return np.frombuffer(data[spec["offset"] : spec["offset"] + 8 * spec["count"]], dtype=np.int64).copy()


def _rewrite_vocabulary_field(path: Path, field: str, values: np.ndarray[Any, Any]) -> None:
    """Write ``values`` as that field, with a valid CRC in the manifest: the reader must refuse it on content."""
    manifest_file = path / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    entry = manifest["files"][0]
    spec = entry["tables"]["user"]["vocabulary"][field]
    data = bytearray((path / entry["file"]).read_bytes())
    data[spec["offset"] : spec["offset"] + values.nbytes] = values.tobytes()
    spec["crc32"] = zlib.crc32(values.tobytes())
    (path / entry["file"]).write_bytes(bytes(data))
    manifest_file.write_text(json.dumps(manifest))


def test_restore_refuses_a_corrupt_vocabulary_and_changes_nothing(tmp_path: Path) -> None:
    a = _module()
    _steps([a], 5, 8)
    path = Path(a.save(tmp_path))
    keys = _vocabulary_field(path, "keys")
    live = np.nonzero(_vocabulary_field(path, "counts") > 0)[0]
    assert live.size >= 2
    keys[live[1]] = keys[live[0]]  # one key on two rows, with a valid CRC: the reader must still refuse it
    _rewrite_vocabulary_field(path, "keys", keys)
    b = _module()
    _steps([b], 6, 3)
    before = {k: v.clone() for k, v in b.state_dict().items()}
    with pytest.raises(et.CheckpointError, match="a key holds two rows"):
        b.restore(tmp_path)
    for k, v in b.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_fixed_and_dynamic_checkpoints_do_not_mix(tmp_path: Path) -> None:
    fixed = et.DistributedEmbedding({"u": et.FeatureConfig(et.TableConfig(6, 3, name="user"))}, et.Adam(0.05))
    fixed.save(tmp_path / "fixed")
    dynamic = et.DistributedEmbedding(
        {"u": et.FeatureConfig(et.TableConfig(6, 3, name="user", dynamic=et.DynamicVocabulary()))}, et.Adam(0.05)
    )
    with pytest.raises(et.CheckpointError, match=r"fixed \(ids in \[0, V\)\) in the checkpoint and dynamic"):
        dynamic.restore(tmp_path / "fixed")
    dynamic.save(tmp_path / "dynamic")
    with pytest.raises(et.CheckpointError, match=r"dynamic \(keyed by any id\) in the checkpoint and fixed"):
        fixed.restore(tmp_path / "dynamic")


def test_export_and_serving_look_keys_up(tmp_path: Path) -> None:
    a = _module()
    _steps([a], 7, 8)
    a.save(tmp_path / "ckpt")
    et.export(tmp_path / "ckpt", tmp_path / "serving")
    serving = et.ServingEmbedding.load(tmp_path / "serving")
    keys = a.vocabulary("user")[0].tolist()
    x = {
        "u": torch.tensor([keys[0], 424242, keys[-1], -(2**63)]),
        "h": et.Ragged.from_lists([[keys[0], 99999, keys[1]], [], [424242], keys[:3]]),
        "i": torch.tensor([0, 1, 2, 3]),
    }
    a.eval()
    want = a(x)
    got = serving(x)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert torch.equal(got["u"][1], torch.zeros(3))  # an unknown key is absent


def test_tf_bundles_refuse_key_maps_instead_of_rounding_them(tmp_path: Path) -> None:
    a = _module()
    _steps([a], 8, 2)
    with pytest.raises(ValueError, match="not floating point"):
        et.checkpoint.write_tf_checkpoint(tmp_path / "tf" / "ckpt", a.state_dict())
    floats = {k: v for k, v in a.state_dict().items() if v.is_floating_point()}
    et.checkpoint.write_tf_checkpoint(tmp_path / "tf" / "ckpt", floats)


def test_lookup_statistics_files_report_the_vocabulary(tmp_path: Path) -> None:
    user = et.TableConfig(4, 2, name="user", dynamic=et.DynamicVocabulary(eviction=None))
    m = et.DistributedEmbedding(
        {"u": et.FeatureConfig(user)}, et.SGD(0.1), profile_data_directory=tmp_path, profile_sample_rate=1.0
    )
    for keys in ([1, 2, 3], [4, 5, 6]):
        out = m({"u": torch.tensor(keys)})
        m.apply_gradients({"u": torch.ones_like(out["u"])})
    (path,) = m.flush()
    doc = json.loads(Path(path).read_text())
    assert doc["vocabulary"]["admitted"] == 4 and doc["vocabulary"]["rejected"] == 2 and doc["vocabulary"]["live"] == 4


def test_serving_refuses_a_keys_file_that_breaks_its_rules(tmp_path: Path) -> None:
    a = _module()
    _steps([a], 9, 4)
    a.save(tmp_path / "ckpt")
    et.export(tmp_path / "ckpt", tmp_path / "serving")
    (keys_file,) = (tmp_path / "serving").glob("*.keys.npy")
    good = np.load(keys_file)
    for bad in (np.zeros((7, 2), np.int64), good[::-1].copy(), good.astype(np.int32), np.zeros((3, 3), np.int64)):
        np.save(keys_file, bad)  # more keys than rows, keys not increasing, another dtype, another shape
        with pytest.raises(et.CheckpointError, match="keys"):
            et.ServingEmbedding.load(tmp_path / "serving")
    np.save(keys_file, good)
    et.ServingEmbedding.load(tmp_path / "serving")


def test_restore_and_load_state_dict_refuse_a_negative_lookup_count_alike(tmp_path: Path) -> None:
    """A negative lookup count with a valid CRC: restore dropped that key silently while load_state_dict refused
    the same data. Both apply one validation now."""
    a = _module()
    _steps([a], 5, 8)
    path = Path(a.save(tmp_path))
    counts = _vocabulary_field(path, "counts")
    live = np.nonzero(counts > 0)[0]
    counts[live[0]] = -3
    _rewrite_vocabulary_field(path, "counts", counts)
    b = _module()
    _steps([b], 6, 3)
    before = {k: v.clone() for k, v in b.state_dict().items()}
    with pytest.raises(et.CheckpointError, match="a lookup count is negative"):
        b.restore(tmp_path)
    sd = a.state_dict()
    bad = {k: v.clone() for k, v in sd.items()}
    key = next(k for k in bad if k.endswith("counts") and "pending" not in k)
    bad[key][live[0]] = -3
    with pytest.raises((ValueError, RuntimeError), match="a lookup count is negative"):
        b.load_state_dict(bad)
    for k, v in b.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("field", ["admit_after", "ttl_steps"])
@pytest.mark.parametrize("value", [2**62 + 1, 2**63, 2**64 + 1])
def test_counts_beyond_the_key_map_are_refused_at_the_config(field: str, value: int) -> None:
    """ctypes wrapped them (2**64 + 1 admitted a key at first sight) or raised a misleading MemoryError."""
    with pytest.raises(ValueError, match=rf"`{field}` must be an int from 1 .* 2\*\*62"):
        et.DynamicVocabulary(**{field: value})
    et.DynamicVocabulary(**{field: 2**62})  # the limit itself is accepted
