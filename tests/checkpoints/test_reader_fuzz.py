"""Seeded mutation fuzzing of every reader of a file embtables did not necessarily write (issues 15
and 22): a mutated file must make the reader raise its own error, or load the same content (a
mutation that changes nothing the reader uses) -- never crash, hang, raise a bare KeyError /
IndexError / struct.error, or touch another file. Each case runs in this process, so a crash would
end the suite; the readers validate before they read.

Cases per reader (fixed seeds, ``CASES`` each unless noted): the manifest, rank-file bytes (the
safetensors header included: restore never parses it, the manifest's checked offsets and CRC-32s
decide) and its structured header mutations, the TF index (every byte flipped twice, then random
mutations), the TF data file, serving.json, the serving ``.npy`` files, lookup statistics. Mutations:
bit flips, truncation, splices (a chunk copied elsewhere), huge and negative sizes, wrong types, deep
JSON nesting, long strings. The pure readers (TF bundle, serving.json, lookup statistics) are also held
to a memory bound: Python-heap peak (tracemalloc) at most 16x the file plus 1 MiB.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import embtables as et
from embtables.checkpoint import CheckpointError, published
from embtables.checkpoint.tf_bundle import BundleError, read_bundle
from embtables.sharding.lookup_stats import _read

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tf" / "tpu_embedding"
CASES = 2000
_ODD = [None, True, -1, 0, 1, 2**63, -(2**70), 1.5, float("nan"), "x", "../x", "/etc/passwd", "", [], {}, [1, 2],
        {"a": 1}, "a" * 5000, [[[[[[]]]]]]]  # fmt: skip


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value in a JSON document."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _mutate_json(doc: Any, rng: random.Random) -> Any:
    doc = copy.deepcopy(doc)
    path = rng.choice(_paths(doc)[1:])
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    action = rng.random()
    if action < 0.2 and isinstance(parent, dict):
        del parent[path[-1]]
    elif action < 0.3 and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[path[-1]]))
    else:
        value = parent[path[-1]]
        if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.5:
            parent[path[-1]] = value + rng.choice([-1, 1, 8, -8, 1 << 20, -(1 << 40)])
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(_ODD))
    return doc


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """A bit flip (1-4), a truncation, a splice, or an 8-byte little-endian size overwritten."""
    out = bytearray(data)
    kind = rng.random()
    if kind < 0.25:
        return bytes(out[: rng.randrange(len(out))])
    if kind < 0.45:
        start = rng.randrange(len(out))
        chunk = out[start : start + rng.randint(1, 64)]
        at = rng.randrange(len(out))
        out[at : at + len(chunk)] = chunk
        return bytes(out)
    if kind < 0.6:
        at = rng.randrange(max(1, len(out) - 8))
        out[at : at + 8] = struct.pack("<q", rng.choice([-1, -(2**62), 2**62, 2**31, len(out), len(out) + 1]))
        return bytes(out)
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _bounded(fn: Callable[[], Any], file_bytes: int) -> Any:
    """``fn()`` (a reader: it can run twice), asserting its Python-heap peak stays within 16x the file's size
    plus 1 MiB. tracemalloc counts every thread of the process: a peak over the bound is measured once more, so
    that another thread's allocation during the first call (a test before this one left it running) is not
    blamed on the reader, while a reader over the bound is over it again."""
    bound = 16 * file_bytes + (1 << 20)
    peaks = []
    for _ in range(2):
        tracemalloc.start()
        try:
            result, error = fn(), None
        except Exception as exc:  # a refusal: its peak is bounded too, then it is raised
            result, error = None, exc
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
        if peaks[-1] <= bound:
            if error is not None:
                raise error
            return result
    raise AssertionError(f"peaks {peaks} bytes for a file of {file_bytes} (bound {bound})")


def _deep(n: int) -> Any:
    doc: Any = []
    for _ in range(n):
        doc = [doc]
    return doc


def _model() -> et.DistributedEmbedding:
    t = et.TableConfig(9, 3, name="t", initializer=et.TruncatedNormal(seed=1))
    u = et.TableConfig(5, 2, name="scope/u", initializer=et.TruncatedNormal(seed=2), optimizer=et.Adam(0.1))
    return et.DistributedEmbedding(
        {"a": et.FeatureConfig(t), "b": [et.FeatureConfig(u), et.FeatureConfig(t, max_sequence_length=2)]},
        optimizer=et.Adagrad(0.5),
    )


def _trained(tmp: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    emb = _model()
    acts = emb({"a": torch.tensor([1, 2]), "b": [torch.tensor([0, 4]), et.Ragged.from_lists([[3, 8], [0, 1, 2]])]})
    emb.apply_gradients({"a": torch.ones_like(acts["a"]), "b": [torch.ones_like(a) for a in acts["b"]]})
    emb.save(tmp / "ck")
    return published(tmp / "ck")[-1], {k: v.clone() for k, v in emb.state_dict().items()}


def _untouched(root: Path, before: dict[str, bytes]) -> None:
    after = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    for name, data in before.items():
        assert after.get(name) == data, f"{name} was changed"


def test_manifest_mutations(tmp_path: Path) -> None:
    ck, state = _trained(tmp_path)
    manifest = json.loads((ck / "manifest.json").read_text())
    rank_file = (ck / "rank-00000.safetensors").read_bytes()
    rng = random.Random(1)
    outcomes = {"refused": 0, "loaded": 0}
    emb = _model()  # one module: a refused restore must leave it exactly as it was, a loaded one equal to state
    for case in range(CASES):
        doc = _mutate_json(manifest, rng) if case < CASES - 5 else _deep(100_000 if case == CASES - 1 else 50)
        if case % 7 == 3:
            doc = _mutate_json(doc, rng) if isinstance(doc, dict) else doc  # two mutations at once
        (ck / "manifest.json").write_text(json.dumps(doc) if case < CASES - 1 else "[" * 100_000)
        before = {k: v.clone() for k, v in emb.state_dict().items()}
        try:
            emb.restore(ck)
        except CheckpointError:
            outcomes["refused"] += 1
            assert all(torch.equal(before[k], v) for k, v in emb.state_dict().items()), case
        else:
            outcomes["loaded"] += 1
            assert all(torch.equal(state[k], v) for k, v in emb.state_dict().items()), (case, doc)
        assert (ck / "rank-00000.safetensors").read_bytes() == rank_file
    assert outcomes["refused"] > CASES // 3, outcomes  # the rest changed fields restore does not use


def test_rank_file_byte_mutations(tmp_path: Path) -> None:
    ck, state = _trained(tmp_path)
    path = ck / "rank-00000.safetensors"
    good = path.read_bytes()
    rng = random.Random(2)
    emb = _model()
    refused = 0
    for case in range(CASES):
        path.write_bytes(_mutate_bytes(good, rng))
        before = {k: v.clone() for k, v in emb.state_dict().items()}
        try:
            emb.restore(ck)
        except CheckpointError:
            refused += 1
            assert all(torch.equal(before[k], v) for k, v in emb.state_dict().items()), case
            continue
        assert all(torch.equal(state[k], v) for k, v in emb.state_dict().items()), case  # only the header changed
    assert refused > CASES // 2


def test_safetensors_header_mutations(tmp_path: Path) -> None:
    """The rank file's JSON header rewritten (mutated values, any length): restore reads the blocks the
    manifest names and checks, so it loads the same state or refuses; never a crash."""
    ck, state = _trained(tmp_path)
    path = ck / "rank-00000.safetensors"
    good = path.read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    header, body = json.loads(good[8 : 8 + n]), good[8 + n :]
    rng = random.Random(6)
    emb = _model()
    for case in range(CASES // 2):
        raw = json.dumps(_mutate_json(header, rng)).encode()
        if case % 5 == 0:
            raw = raw[: len(raw) // 2]  # not JSON
        length = len(raw) if case % 3 else rng.choice([len(raw), 0, 2**63 - 1, len(good)])
        path.write_bytes(struct.pack("<Q", length) + raw + body)
        before = {k: v.clone() for k, v in emb.state_dict().items()}
        try:
            emb.restore(ck)
        except CheckpointError:
            assert all(torch.equal(before[k], v) for k, v in emb.state_dict().items()), case
            continue
        assert all(torch.equal(state[k], v) for k, v in emb.state_dict().items()), case


def test_tf_index_every_byte_flipped(tmp_path: Path) -> None:
    good = read_bundle(FIXTURE)
    index = Path(f"{FIXTURE}.index").read_bytes()
    shutil.copy(f"{FIXTURE}.data-00000-of-00001", tmp_path / "t.data-00000-of-00001")
    same = 0
    for pos in range(len(index)):
        for bit in (0, 7):
            data = bytearray(index)
            data[pos] ^= 1 << bit
            (tmp_path / "t.index").write_bytes(bytes(data))
            try:
                got = read_bundle(tmp_path / "t")
            except BundleError:
                continue
            assert got.keys() == good.keys(), pos  # never a tensor renamed or dropped silently
            assert all(np.array_equal(np.asarray(got[k]), np.asarray(good[k])) for k in good), pos
            same += 1
    assert same < len(index) // 4  # almost every flip is caught by a CRC or a bound
    for cut in range(0, len(index), max(1, len(index) // 50)):
        (tmp_path / "t.index").write_bytes(index[:cut])
        with pytest.raises(BundleError):
            read_bundle(tmp_path / "t")
    rng = random.Random(7)
    for case in range(CASES):  # random bit flips, truncations, splices and overwritten sizes
        mutated = _mutate_bytes(index, rng)
        (tmp_path / "t.index").write_bytes(mutated)
        try:
            got = _bounded(lambda: read_bundle(tmp_path / "t"), len(mutated) + len(good_data_bytes()))
        except BundleError:
            continue
        assert got.keys() == good.keys(), case
        assert all(np.array_equal(np.asarray(got[k]), np.asarray(good[k])) for k in good), case


def good_data_bytes() -> bytes:
    return Path(f"{FIXTURE}.data-00000-of-00001").read_bytes()


def test_tf_data_mutations(tmp_path: Path) -> None:
    good = read_bundle(FIXTURE)
    data = good_data_bytes()
    shutil.copy(f"{FIXTURE}.index", tmp_path / "t.index")
    rng = random.Random(3)
    for case in range(CASES):
        mutated = _mutate_bytes(data, rng)
        (tmp_path / "t.data-00000-of-00001").write_bytes(mutated)
        try:
            got = _bounded(lambda: read_bundle(tmp_path / "t"), len(mutated) + (1 << 12))
        except BundleError:
            continue
        assert all(np.array_equal(np.asarray(got[k]), np.asarray(good[k])) for k in good), case


def test_serving_json_mutations(tmp_path: Path) -> None:
    ck, _ = _trained(tmp_path)
    et.export(ck, tmp_path / "serve")
    root = tmp_path / "serve"
    doc = json.loads((root / "serving.json").read_text())
    reference = et.ServingEmbedding.load(root)
    batch = {"a": torch.tensor([1, 2]), "b": [torch.tensor([0, 4]), et.Ragged.from_lists([[3, 8], [0, 1, 2]])]}
    assert reference(batch)["a"].shape == (2, 3)
    files = {p.name: p.read_bytes() for p in root.iterdir() if p.name != "serving.json"}
    outside = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    rng = random.Random(4)
    refused = 0
    for case in range(CASES):
        text = json.dumps(_mutate_json(doc, rng))
        (root / "serving.json").write_text(text)
        try:
            serving = _bounded(lambda: et.ServingEmbedding.load(root), len(text) + sum(map(len, files.values())))
        except CheckpointError:
            refused += 1
            continue
        try:
            got = serving(batch)
        except (ValueError, TypeError):
            continue  # a mutation that changed the features: the batch no longer fits, refused by name
        # Loaded: a mutation of a field the lookup uses legitimately (a combiner, a feature's name) may
        # change the result; the lookup still reads only the checked files, and gives finite values.
        flat = [got[k] for k in got if isinstance(got[k], torch.Tensor)]
        assert all(bool(torch.isfinite(x).all()) for x in flat), case
    _untouched(root, files)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == outside
    assert refused > CASES // 3
    # The table files (.npy): bytes mutated the same ways; load refuses or serves finite values.
    npys = sorted(p for p in root.iterdir() if p.suffix == ".npy")
    (root / "serving.json").write_text(json.dumps(doc))
    for case in range(CASES // 2):
        victim = npys[case % len(npys)]
        victim.write_bytes(_mutate_bytes(files[victim.name], rng))
        try:
            got = et.ServingEmbedding.load(root)(batch)
        except CheckpointError:
            continue
        finally:
            victim.write_bytes(files[victim.name])
        assert all(bool(torch.isfinite(got[k]).all()) for k in got if isinstance(got[k], torch.Tensor)), case


def test_lookup_statistics_mutations(tmp_path: Path) -> None:
    emb = et.DistributedEmbedding(
        {"a": et.FeatureConfig(et.TableConfig(6, 2, name="t"))}, et.SGD(0.1), profile_data_directory=tmp_path,
        profile_sample_rate=1.0,
    )  # fmt: skip
    for _ in range(3):
        emb({"a": torch.tensor([1, 2, 2])})
        emb.apply_gradients()
    (path,) = [Path(p) for p in emb.flush()]
    doc = json.loads(path.read_text())
    rng = random.Random(5)
    for case in range(CASES):
        text = json.dumps(_mutate_json(doc, rng)) if case % 10 else _mutate_bytes(json.dumps(doc).encode(), rng)
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        got = _bounded(lambda: _read(path), len(text))
        assert got is None or isinstance(got["summary"]["ids_per_batch"], float)
        if case % 4:
            continue
        et.DistributedEmbedding(
            {"a": et.FeatureConfig(et.TableConfig(6, 2, name="t"))}, et.SGD(0.1), profile_data_directory=tmp_path,
            sharding="auto",
        )  # fmt: skip
