"""Checkpoints of half-precision tables where the storage type meets the pipeline and the increments: a pipelined
module with bfloat16/float16 tables saves its pending update's pre-update rows (they went through ``.numpy()``,
which has no bfloat16); a pipelined checkpoint restored into a pipelined module swaps those rows into each table
in its own type and trains on bit for bit (the swap failed half-way, leaving float32 tables with stale rows); a
restore that rounds a float32 checkpoint into a half table is not the base of the next increment."""

from __future__ import annotations

from pathlib import Path

import torch

import embtables as et


def _config(dtype: torch.dtype) -> dict[str, et.FeatureConfig]:
    half = et.TableConfig(60, 8, name="half", combiner="sum", dtype=dtype, slot_dtype=dtype)
    full = et.TableConfig(40, 8, name="full", combiner="mean")
    return {"a": et.FeatureConfig(half), "b": et.FeatureConfig(full), "c": et.FeatureConfig(half)}


def _batch(step: int) -> dict[str, et.Ragged]:
    g = torch.Generator().manual_seed(step)
    return {
        "a": et.Ragged.from_lists([torch.randint(0, 60, (3,), generator=g).tolist() for _ in range(4)]),
        "b": et.Ragged.from_lists([torch.randint(0, 40, (2,), generator=g).tolist() for _ in range(4)]),
        "c": et.Ragged.from_lists([torch.randint(0, 60, (1,), generator=g).tolist() for _ in range(4)]),
    }


def _train(emb: et.DistributedEmbedding, steps: range) -> None:
    for step in steps:
        out = emb(_batch(step))
        emb.apply_gradients({k: torch.full_like(v, 0.25) * (step + 1) for k, v in out.items()})


def _module(dtype: torch.dtype, seed: int = 0) -> et.DistributedEmbedding:
    torch.manual_seed(seed)
    return et.DistributedEmbedding(_config(dtype), et.Adagrad(0.1), pipeline_execution_with_tensor_core=True)


def test_a_pipelined_half_table_saves_and_restores_into_a_pipelined_module_bit_for_bit(tmp_path: Path) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        trained = _module(dtype)
        _train(trained, range(3))  # an update pending: its pre-update rows go into the checkpoint
        ckpt = trained.save(tmp_path / str(dtype))
        restored = _module(dtype, seed=1)
        restored.restore(ckpt)
        _train(trained, range(3, 6))
        _train(restored, range(3, 6))  # the first lookup reads the saved pre-update rows, in each table's type
        want, got = trained.state_dict(), restored.state_dict()
        assert want.keys() == got.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (dtype, key)


def test_a_converting_restore_makes_the_next_incremental_save_full(tmp_path: Path) -> None:
    """A float32 checkpoint restored into a bfloat16 module (rounded): the next incremental save writes a full
    checkpoint (an increment would build on float32 values the module never held), and changed_rows() lists
    every row; the chain restores and exports the module's values."""
    torch.manual_seed(0)
    f32 = et.DistributedEmbedding({"a": et.FeatureConfig(et.TableConfig(100, 8, name="t"))}, et.Adagrad(0.1))
    base = f32.save(tmp_path / "f32")
    half = et.DistributedEmbedding(
        {"a": et.FeatureConfig(et.TableConfig(100, 8, name="t", dtype=torch.bfloat16))}, et.Adagrad(0.1)
    )
    half.restore(base)
    assert half.changed_rows()["t"].numel() == 100
    out = half({"a": et.Ragged.from_lists([[1, 2]])})["a"]
    half.apply_gradients({"a": torch.ones_like(out)})
    ckpt = Path(half.save(tmp_path / "f32", incremental=True))
    assert ckpt.name == "ckpt-00000001"
    assert '"chain"' not in (ckpt / "manifest.json").read_text(), "a full checkpoint, not an increment on float32"
    again = et.DistributedEmbedding(
        {"a": et.FeatureConfig(et.TableConfig(100, 8, name="t", dtype=torch.bfloat16))}, et.Adagrad(0.1)
    )
    again.restore(tmp_path / "f32")
    for key, value in half.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    # restored without conversion: an increment again
    out = again({"a": et.Ragged.from_lists([[3]])})["a"]
    again.apply_gradients({"a": torch.ones_like(out)})
    assert '"chain"' in (Path(again.save(tmp_path / "f32", incremental=True)) / "manifest.json").read_text()
