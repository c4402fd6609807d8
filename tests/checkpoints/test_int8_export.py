"""int8 export: per-row masks stay per row (linear time and memory), a row that cannot be quantised is named
correctly, and only int8 exports write per-row scale files."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

import embtables as et
from embtables.checkpoint import serving_codec


def test_the_int8_mask_is_one_entry_per_row() -> None:
    """A broadcast of [N] with [N, 1] made an [N, N] mask (4.3 GB per 65,536-row chunk)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4096, 8)).astype(np.float32)
    tracemalloc.start()
    stored, back, scale_bias, finite = serving_codec.encode_rows(w, "int8", "t", np.arange(4096))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert stored.shape == (4096, 8) and stored.dtype == np.uint8
    assert scale_bias is not None and scale_bias.shape == (4096, 2)
    assert finite.shape == (4096, 8)
    assert np.abs(back - w).max() <= (w.max(axis=1) - w.min(axis=1)).max() / 255
    # an [N, N] bool mask alone would be 16 MiB; the chunk's own arrays are well under 1 MiB
    assert peak < 2 * 1024 * 1024, peak


def _checkpoint(tmp: Path, weights: torch.Tensor) -> str:
    v, d = weights.shape
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(et.TableConfig(v, d, name="big"))}, et.SGD(0.1))
    emb.load_state_dict({"big": weights})
    return emb.save(tmp / "ckpts")


def test_a_row_whose_range_overflows_float32_is_named(tmp_path: Path) -> None:
    """Legal weights of +-2e38 in one row: max - min overflows float32. The export refuses it cleanly, naming the
    table and that row (it raised IndexError while formatting the refusal)."""
    weights = torch.zeros(100_000, 4)
    weights[70_123, 0], weights[70_123, 1] = 2e38, -2e38
    ckpt = _checkpoint(tmp_path, weights)
    with pytest.raises(ValueError, match=r"table 'big', row 70123: .*cannot be quantised to int8"):
        et.export(ckpt, tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_large_table_exports_to_int8_in_linear_memory(tmp_path: Path) -> None:
    """200k rows (four chunks): the export's peak Python-side memory stays a few chunk sizes, not N^2."""
    weights = torch.randn(200_000, 8)
    ckpt = _checkpoint(tmp_path, weights)
    tracemalloc.start()
    et.export(ckpt, tmp_path / "out", dtype="int8")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024 * 1024, peak  # one [65536, 65536] mask is 4 GiB
    served = et.ServingEmbedding.load(tmp_path / "out")
    got = served({"f": torch.tensor([0, 199_999])})["f"]
    want = weights[[0, 199_999]]
    span = (want.max(dim=1).values - want.min(dim=1).values).max()
    assert float((got - want).abs().max()) <= float(span) / 255 + 1e-6


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_only_int8_writes_scale_files(tmp_path: Path, dtype: str) -> None:
    ckpt = _checkpoint(tmp_path, torch.randn(50, 4))
    et.export(ckpt, tmp_path / "out", dtype=dtype)
    assert not list((tmp_path / "out").glob("*.scale.npy"))
    served = et.ServingEmbedding.load(tmp_path / "out")
    assert served({"f": torch.tensor([3])})["f"].shape == (1, 4)
