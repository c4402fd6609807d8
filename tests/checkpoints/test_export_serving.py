"""Export for serving (issue 8, item 5): ``embtables.export`` and ``ServingEmbedding``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import fast_child
import pytest
import torch
from mp_world import run_world
from scenarios import DuckKJT

import embtables as et


def _config() -> dict[str, Any]:
    video = et.TableConfig(40, 6, name="video", combiner="mean", initializer=et.TruncatedNormal(seed=1))
    user = et.TableConfig(9, 4, name="user", combiner="sqrtn", initializer=et.TruncatedNormal(seed=2))
    q = et.TableConfig(
        12, 3, name="q", combiner="sum", initializer=et.TruncatedNormal(seed=3),
        quantization_config=et.QuantizationConfig(num_buckets=8, lower=-0.5, upper=0.5),
    )  # fmt: skip
    return {
        "watched": et.FeatureConfig(video),
        "history": et.FeatureConfig(video, max_sequence_length=3),  # shared table, sequence feature
        "nested": [et.FeatureConfig(user), (et.FeatureConfig(q),)],
    }


def _inputs(step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    g = torch.Generator().manual_seed(step)
    rows = [torch.randint(0, 40, (int(n),), generator=g).tolist() for n in torch.randint(0, 5, (4,), generator=g)]
    lengths = torch.tensor([len(r) for r in rows])
    values = torch.tensor([x for r in rows for x in r], dtype=torch.int64)
    user = torch.randint(-1, 9, (4, 3), generator=g)  # dense input; -1 ids are dropped
    sp_idx = torch.tensor([[0, 0, 2, 3], [0, 1, 0, 2]])
    sparse = torch.sparse_coo_tensor(sp_idx, torch.randint(0, 12, (4,), generator=g), (4, 3))
    features = {
        "watched": DuckKJT(["watched"], values, lengths, torch.rand(values.numel(), generator=g) + 0.5),
        "history": torch.nested.nested_tensor([torch.tensor(r, dtype=torch.int64) for r in rows], layout=torch.jagged),
        "nested": [et.Ragged.from_lists(user.tolist()), (sparse,)],
    }
    return features, {"watched": None, "history": None, "nested": [None, (None,)]}


def _trained(tmp: Path) -> et.DistributedEmbedding:
    emb = et.DistributedEmbedding(_config(), optimizer=et.Adagrad(0.5))
    for step in range(3):
        acts = emb(*_inputs(step))
        flat = {k: v for k, v in acts.items() if k != "nested"}
        grads = {k: torch.ones_like(v) for k, v in flat.items()}
        grads["nested"] = [torch.ones_like(acts["nested"][0]), (torch.ones_like(acts["nested"][1][0]),)]
        emb.apply_gradients(grads)
    emb.save(tmp / "ckpt")
    return emb.eval()


def _flat(acts: Any) -> list[torch.Tensor]:
    return [acts["history"], acts["nested"][0], acts["nested"][1][0], acts["watched"]]


def test_float32_serving_equals_the_training_modules_eval_forward(tmp_path: Path) -> None:
    emb = _trained(tmp_path)
    report = et.export(tmp_path / "ckpt", tmp_path / "serve")
    assert report.max_abs_error == {"video": 0.0, "user": 0.0, "q": 0.0}
    serving = et.ServingEmbedding.load(tmp_path / "serve")
    for step in range(4, 7):
        want, got = emb(*_inputs(step)), serving(*_inputs(step))
        assert isinstance(got["nested"], list) and isinstance(got["nested"][1], tuple)
        for a, b in zip(_flat(want), _flat(got)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_smaller_dtypes_stay_within_the_reported_error(dtype: str, tmp_path: Path) -> None:
    emb = _trained(tmp_path)
    report = et.export(tmp_path / "ckpt", tmp_path / dtype, dtype=dtype)
    assert all(0 < e < 0.05 for e in report.max_abs_error.values()), report
    serving = et.ServingEmbedding.load(tmp_path / dtype)
    want, got = emb(*_inputs(9)), serving(*_inputs(9))
    # mean / sqrtn / sequence activations move by at most the row error times the bag's coefficients.
    bound = max(report.max_abs_error.values()) * 4
    for a, b in zip(_flat(want)[:2], _flat(got)[:2]):
        assert float((a - b).abs().max()) <= bound


def test_export_and_serving_errors_are_clear(tmp_path: Path) -> None:
    _trained(tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        et.export(tmp_path / "ckpt", tmp_path / "x", dtype="int4")
    with pytest.raises(ValueError, match=r"serving\.json is missing"):
        et.ServingEmbedding.load(tmp_path / "nothing")
    et.export(tmp_path / "ckpt", tmp_path / "serve")
    serving = et.ServingEmbedding.load(tmp_path / "serve")
    features, weights = _inputs(1)
    features["nested"][0] = et.Ragged.from_lists([[9], [], [], []])
    with pytest.raises(ValueError, match=r"nested/0.*out of range"):
        serving(features, weights)


def _save_mod(rank: int, world: int, root: str) -> None:
    emb = et.DistributedEmbedding(_config(), optimizer=et.SGD(0.3), sharding="mod")
    acts = emb(*_inputs(rank))
    grads = {"watched": torch.ones_like(acts["watched"]), "history": torch.ones_like(acts["history"])}
    grads["nested"] = [torch.ones_like(acts["nested"][0]), (torch.ones_like(acts["nested"][1][0]),)]
    emb.apply_gradients(grads)
    state = emb.state_dict()
    emb.save(root)
    if rank == 0:
        torch.save(state, os.path.join(root, "expected.pt"))


@pytest.mark.distributed
def test_a_mod_sharded_checkpoint_serves_like_one_process(tmp_path: Path) -> None:
    run_world(_save_mod, 2, str(tmp_path / "ckpt"))
    single = et.DistributedEmbedding(_config(), optimizer=et.SGD(0.3))
    single.load_state_dict(torch.load(tmp_path / "ckpt" / "expected.pt"))
    single.eval()
    et.export(tmp_path / "ckpt", tmp_path / "serve")
    serving = et.ServingEmbedding.load(tmp_path / "serve")
    for a, b in zip(_flat(single(*_inputs(3))), _flat(serving(*_inputs(3)))):
        assert torch.equal(a, b)


_LOAD_BIG = """
import sys, torch, embtables as et
def rss():
    return int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) // 1024
before = rss()
s = et.ServingEmbedding.load(sys.argv[1], mmap=True)
acts = s({"a": torch.tensor([0, 5, 3_999_999])})
print(rss() - before, float(acts["a"].sum()))
"""


def test_mmap_load_maps_tables_instead_of_reading_them(tmp_path: Path) -> None:
    t = et.TableConfig(4_000_000, 16, name="big", initializer=et.Constant(0.5), optimizer=et.SGD(0.1))
    emb = et.DistributedEmbedding({"a": et.FeatureConfig(t)})  # 256 MB of weights
    emb.save(tmp_path / "ckpt")
    del emb
    et.export(tmp_path / "ckpt", tmp_path / "serve")
    out = fast_child.run([sys.executable, "-c", _LOAD_BIG, str(tmp_path / "serve")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    grew_mb, total = out.stdout.split()
    assert int(grew_mb) < 64 and float(total) == 0.5 * 16 * 3
