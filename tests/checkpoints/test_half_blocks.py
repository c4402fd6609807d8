"""A half-precision table's checkpoint holds its rows and slots in their own type (docs/checkpoints.md): bfloat16
or float16 blocks (safetensors BF16 / F16, manifest format 3, each block's spec naming its dtype), half the bytes
of float32 blocks, bit for bit the table's storage; restored into any storage type (exactly where the values fit,
rounded to nearest, logged, where they do not), through increments, an offloaded table's streamed save, exports;
a float32 table's checkpoint is unchanged (format 2)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import embtables as et
from embtables.checkpoint import CheckpointError

V, D = 300, 8


def _module(dtype: Any, slot_dtype: Any = None, **table: Any) -> Any:
    config = et.TableConfig(V, D, name="t", combiner="sum", dtype=dtype, slot_dtype=slot_dtype, **table)
    return et.DistributedEmbedding({"f": et.FeatureConfig(config)}, et.Adagrad(0.3))


def _train(emb: Any, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, V, (32,), generator=g)
        emb({"f": ids})
        emb.apply_gradients({"f": torch.randn(32, D, generator=g)})


def _stored(emb: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in emb.state_dict().items()}


def _header(ckpt: Path) -> tuple[dict[str, Any], bytes]:
    """The safetensors header of the only rank file, and the file's bytes after it."""
    (data,) = ckpt.glob("rank-*.safetensors")
    raw = data.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_a_half_tables_blocks_hold_its_own_bits_in_half_the_bytes(kind: str, tmp_path: Path) -> None:
    dtype = getattr(torch, kind)
    half = _module(dtype, dtype)
    _train(half, 3)
    ckpt = Path(half.save(tmp_path / "half"))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format_version"] == 3
    specs = manifest["files"][0]["tables"]["t"]["state"]
    assert {k: s.get("dtype") for k, s in specs.items()} == {"t": kind, "t/accumulators": kind}
    header, body = _header(ckpt)
    tag = {"bfloat16": "BF16", "float16": "F16"}[kind]
    for key, value in _stored(half).items():  # a safetensors reader finds the table's own bits
        entry = header[key]
        assert entry["dtype"] == tag and entry["shape"] == [V, D]
        lo, hi = entry["data_offsets"]
        assert hi - lo == V * D * 2
        assert torch.equal(torch.frombuffer(bytearray(body[lo:hi]), dtype=dtype).view(V, D), value)
    full = _module(None)
    _train(full, 3)
    plain = Path(full.save(tmp_path / "full"))
    assert json.loads((plain / "manifest.json").read_text())["format_version"] == 2  # float32: as before
    assert "dtype" not in json.loads((plain / "manifest.json").read_text())["files"][0]["tables"]["t"]["state"]["t"]

    def state_bytes(where: Path) -> int:
        header = _header(where)[0]
        return sum(header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in ("t", "t/accumulators"))

    assert state_bytes(plain) == 2 * V * D * 4 and state_bytes(ckpt) == 2 * V * D * 2  # exactly half


def test_half_blocks_restore_into_every_storage_type(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bf16 = _module(torch.bfloat16, torch.bfloat16)
    _train(bf16, 3)
    ckpt = Path(bf16.save(tmp_path / "bf16"))
    want = _stored(bf16)
    same = _module(torch.bfloat16, torch.bfloat16)
    same.restore(ckpt)
    assert all(torch.equal(_stored(same)[k], v) for k, v in want.items())  # its own bits
    full = _module(None)
    with caplog.at_level(logging.INFO, logger="embtables"):
        full.restore(ckpt)
    assert "dtype bfloat16 in the checkpoint, float32 here: converted exactly" in caplog.text
    assert all(torch.equal(_stored(full)[k], v.float()) for k, v in want.items())  # bfloat16 values are float32's
    caplog.clear()
    f16 = _module(torch.float16, torch.float16)
    with caplog.at_level(logging.INFO, logger="embtables"):
        f16.restore(ckpt)
    assert "dtype bfloat16 in the checkpoint, float16 here: converted rounded to nearest" in caplog.text
    assert all(torch.equal(_stored(f16)[k], v.to(torch.float16)) for k, v in want.items())
    _train(same, 2, first=3)  # trains on from the restored bits as the writer does
    _train(bf16, 2, first=3)
    assert all(torch.equal(_stored(same)[k], v) for k, v in _stored(bf16).items())


def test_an_increment_of_a_half_table_holds_half_rows(tmp_path: Path) -> None:
    emb = _module(torch.float16)
    _train(emb, 2)
    emb.save(tmp_path, incremental=True)
    _train(emb, 1, first=2)
    inc = Path(emb.save(tmp_path, incremental=True))
    manifest = json.loads((inc / "manifest.json").read_text())
    assert manifest["chain"]["increments"] == 1 and manifest["format_version"] == 3
    specs = manifest["files"][0]["tables"]["t"]["state"]
    assert specs["t"]["dtype"] == "float16" and "dtype" not in specs["t/accumulators"]  # float32 slots
    back = _module(torch.float16)
    back.restore(tmp_path)
    assert all(torch.equal(_stored(back)[k], v) for k, v in _stored(emb).items())


def test_an_offloaded_half_table_streams_half_blocks(tmp_path: Path) -> None:
    torch.manual_seed(0)
    off = _module(torch.bfloat16, offload=et.Offload(tmp_path / "rows", 512))
    _train(off, 3)
    ckpt = Path(off.save(tmp_path / "ckpt"))
    specs = json.loads((ckpt / "manifest.json").read_text())["files"][0]["tables"]["t"]["state"]
    assert specs["t"]["dtype"] == "bfloat16" and "dtype" not in specs["t/accumulators"]
    memory = _module(torch.bfloat16)
    memory.restore(ckpt)
    assert all(torch.equal(_stored(memory)[k], v) for k, v in _stored(off).items())


def test_a_half_checkpoint_exports_and_serves_its_values(tmp_path: Path) -> None:
    emb = _module(torch.float16, torch.float16)
    _train(emb, 2)
    ckpt = Path(emb.save(tmp_path / "ckpt"))
    report = et.export(ckpt, tmp_path / "serve")
    assert report.max_abs_error == {"t": 0.0}  # float16 values are float32 values
    serving = et.ServingEmbedding.load(report.path)
    ids = torch.arange(V)
    assert torch.equal(serving({"f": ids})["f"], emb.embedding_tables["t"].float())


@pytest.mark.parametrize("bad", ["float64", 7, "bfloat16x"])
def test_a_block_dtype_that_is_not_a_state_type_is_refused(bad: Any, tmp_path: Path) -> None:
    emb = _module(torch.bfloat16)
    ckpt = Path(emb.save(tmp_path / "ckpt"))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][0]["tables"]["t"]["state"]["t"]["dtype"] = bad
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    before = _stored(emb)
    with pytest.raises(CheckpointError, match=r"\.dtype must be one of \['bfloat16', 'float16', 'float32'\]"):
        emb.restore(ckpt)
    assert all(torch.equal(_stored(emb)[k], v) for k, v in before.items())


def test_a_corrupt_half_block_fails_its_crc_and_changes_nothing(tmp_path: Path) -> None:
    emb = _module(torch.bfloat16, torch.bfloat16)
    _train(emb, 2)
    ckpt = Path(emb.save(tmp_path / "ckpt"))
    header, _ = _header(ckpt)
    (data,) = ckpt.glob("rank-*.safetensors")
    raw = bytearray(data.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little") + header["t"]["data_offsets"][0]
    raw[start + 5] ^= 0x40
    data.write_bytes(bytes(raw))
    other = _module(torch.bfloat16, torch.bfloat16)
    before = _stored(other)
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        other.restore(ckpt)
    assert all(torch.equal(_stored(other)[k], v) for k, v in before.items())
    assert np.isfinite(before["t"].float().numpy()).all()


@pytest.mark.parametrize("source", ["float32", "bfloat16"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_value_beyond_float16_is_refused_not_restored_as_inf(source: str, dynamic: bool, tmp_path: Path) -> None:
    """A finite value of the checkpoint that float16 cannot hold (|x| > 65504 after rounding) is refused before
    anything is restored into a float16 table, naming the table, the key and the value."""
    extra: dict[str, Any] = {"dynamic": et.DynamicVocabulary(admit_after=1, eviction="lru")} if dynamic else {}
    writer = _module(None if source == "float32" else torch.bfloat16, **extra)
    writer({"f": torch.tensor([3, 7])})  # a dynamic table's keys get rows
    writer.apply_gradients({"f": torch.zeros(2, D)})
    big = writer.state_dict()["t"].clone()
    big[:] = 70_000.0
    writer.load_state_dict({"t": big}, strict=False)
    ckpt = writer.save(tmp_path / "ckpt")
    held = float(writer.state_dict()["t"].float().max())  # 70000, or bfloat16's 70144
    target = _module(torch.float16, **extra)
    before = _stored(target)
    with pytest.raises(CheckpointError, match=rf"table 't': 't' holds {held:g}[ ,].*beyond float16's largest value"):
        target.restore(ckpt)
    assert all(torch.equal(_stored(target)[k], v) for k, v in before.items())
    fits = _module(torch.bfloat16, **extra)
    fits.restore(ckpt)  # bfloat16 holds it
    assert float(fits.state_dict()["t"].float().max()) == float(torch.tensor(held).to(torch.bfloat16))
