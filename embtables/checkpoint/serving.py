"""Export for serving: a lookup-only artifact from a checkpoint, and ``ServingEmbedding``, a CPU
``nn.Module`` with the training module's forward over memory-mapped tables.

``export(checkpoint, out, dtype)`` writes ``out/serving.json`` (the features, their nest and the
tables) and one raw little-endian file per table, ``<table>.bin`` [V, D] in ``dtype``. With "int8",
each row is quantised on its own: ``q = round((w - bias) / scale)`` in [0, 255] with
``bias = min(row)`` and ``scale = (max(row) - min(row)) / 255``, stored in ``<table>.scale.bin``
[V, 2] float32 (scale, bias). A lookup dequantises only the rows it reads. The export streams the
checkpoint's blocks into the output in row order, so no table is ever held in memory whole, and it
reports the measured max abs error per table. The artifact is written to a temporary directory
and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from embtables.checkpoint.store import CheckpointError, _block, read_manifest
from embtables.config import Combiner, FeatureConfig, QuantizationConfig, TableConfig, nest, resolve
from embtables.config.optimizers import SGD
from embtables.kernels import native
from embtables.kernels.lookup import pooled_lookup
from embtables.tables.input_nest import flatten_inputs
from embtables.tables.inputs import InputConverter

FORMAT_VERSION = 1
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": None, "int8": np.uint8}


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """Where the artifact is, and per table the max abs error against the float32 checkpoint (and
    that error relative to the table's max abs weight)."""

    path: str
    dtype: str
    max_abs_error: dict[str, float]
    relative_error: dict[str, float]


def export(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], dtype: str = "float32") -> ExportReport:
    """Write a serving artifact of ``checkpoint``'s tables (no slots) in ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"export: dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    where, manifest = read_manifest(checkpoint)
    config = manifest["config"]
    if "structure" not in config:
        raise CheckpointError(f"{where}: this checkpoint has no feature structure (written by an older embtables).")
    target = Path(out)
    tmp = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    errors: dict[str, float] = {}
    relative: dict[str, float] = {}
    try:
        for name, t in config["tables"].items():
            errors[name], relative[name] = _export_table(where, manifest, name, t, tmp, dtype)
        doc = {"format_version": FORMAT_VERSION, "dtype": dtype, "step": manifest["step"], **config}
        (tmp / "serving.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportReport(str(target), dtype, errors, relative)


def _export_table(
    where: Path, manifest: dict[str, Any], name: str, table: dict[str, Any], out: Path, dtype: str
) -> tuple[float, float]:
    v, d = table["vocabulary_size"], table["dim"]
    store = np.uint16 if dtype == "bfloat16" else DTYPES[dtype]
    data = np.lib.format.open_memmap(out / f"{name}.npy", mode="w+", dtype=store, shape=(v, d)) if v else None
    scales = np.lib.format.open_memmap(out / f"{name}.scale.npy", mode="w+", dtype=np.float32, shape=(v, 2))
    worst = biggest = 0.0
    for entry in manifest["files"]:
        file = where / entry["file"]
        block = entry["tables"][name]
        mm = np.memmap(file, dtype=np.uint8, mode="r") if file.stat().st_size else np.zeros(0, np.uint8)
        rows = _block(mm, block["rows"], np.int64, (block["rows"]["count"],), file, name)
        if rows.size == 0:
            continue
        weights = _block(mm, block[name], np.float32, tuple(block[name]["shape"]), file, name)
        for start in range(0, rows.size, 1 << 16):  # bounded memory: 64k rows at a time
            w = np.asarray(weights[start : start + (1 << 16)])
            r = rows[start : start + (1 << 16)]
            stored, back, scale_bias = _encode(w, dtype)
            assert data is not None
            data[r] = stored
            if scale_bias is not None:
                scales[r] = scale_bias
            worst = max(worst, float(np.abs(back - w).max()) if w.size else 0.0)
            biggest = max(biggest, float(np.abs(w).max()) if w.size else 0.0)
    if data is not None:
        data.flush()
    scales.flush()
    return worst, (worst / biggest if biggest else 0.0)


def _encode(
    w: np.ndarray[Any, Any], dtype: str
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any] | None]:
    """Stored values, their float32 decoding, and (int8) the per-row [scale, bias]."""
    if dtype == "float32":
        return w, w, None
    if dtype == "float16":
        h = w.astype(np.float16)
        return h, h.astype(np.float32), None
    if dtype == "bfloat16":
        b = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)
        return b.view(torch.int16).numpy().view(np.uint16), b.to(torch.float32).numpy(), None
    lo, hi = w.min(axis=1, keepdims=True), w.max(axis=1, keepdims=True)
    scale = ((hi - lo) / np.float32(255)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint((w - lo) / safe), 0, 255).astype(np.uint8)
    back = (q.astype(np.float32) * scale + lo).astype(np.float32)
    return q, back, np.concatenate([scale, lo], axis=1)


def _rebuild(structure: Any, features: list[FeatureConfig]) -> Any:
    kind, body = next(iter(structure.items()))
    if kind == "feature":
        return features[body]
    if kind == "dict":
        return {k: _rebuild(v, features) for k, v in body.items()}
    items = [_rebuild(v, features) for v in body]
    return items if kind == "list" else tuple(items)


class ServingEmbedding(nn.Module):
    """Lookup-only embeddings from an ``export`` artifact: ``forward(features, weights=None)`` takes
    the training module's inputs (every input type) and returns the same activations, in the same
    nest. Tables are memory-mapped read-only; only the rows a batch looks up are read (and, for
    fp16/bf16/int8, decoded to float32)."""

    def __init__(self, doc: dict[str, Any], root: Path) -> None:
        super().__init__()
        self.dtype = doc["dtype"]
        tables: dict[str, TableConfig] = {}
        for name, t in doc["tables"].items():
            q = t.get("quantization")
            quant = None if q is None else QuantizationConfig(int(q[0]), float(q[1]), float(q[2]))
            tables[name] = TableConfig(
                t["vocabulary_size"], t["dim"], combiner=Combiner(t["combiner_value"]), name=name,
                optimizer=SGD(0.1), quantization_config=quant,
            )  # fmt: skip
        features = [
            FeatureConfig(
                tables[f["table"]],
                max_sequence_length=f["max_sequence_length"],
                validate_weights_and_indices=f["validate"],
                name=f["name"],
                output_shape=None if f["output_shape"] is None else tuple(f["output_shape"]),
            )
            for f in doc["feature_list"]
        ]
        self.feature_config = _rebuild(doc["structure"], features)
        self.resolved = resolve(self.feature_config, None)
        self._converters = [InputConverter(f, self.resolved.tables[f.table_index]) for f in self.resolved.features]
        self._data: dict[str, Tensor] = {}
        self._scales: dict[str, Tensor] = {}
        with warnings.catch_warnings():  # read-only memory maps: torch warns that it cannot write them
            warnings.simplefilter("ignore", UserWarning)
            for t in self.resolved.tables:
                data = np.load(root / f"{t.name}.npy", mmap_mode="r")
                self._data[t.name] = torch.from_numpy(data)
                if self.dtype == "int8":
                    self._scales[t.name] = torch.from_numpy(np.load(root / f"{t.name}.scale.npy", mmap_mode="r"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ServingEmbedding:
        root = Path(path)
        try:
            doc = json.loads((root / "serving.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"ServingEmbedding.load: {root / 'serving.json'} is missing or unreadable ({exc})."
            ) from exc
        if doc.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"ServingEmbedding.load: {root}: unknown format_version {doc.get('format_version')!r}.")
        return cls(doc, root)

    def _rows(self, table: str, ids: Tensor) -> Tensor:
        """Float32 rows [U, D] of ``ids`` [U]."""
        data = self._data[table]
        if self.dtype == "float32":
            return data.index_select(0, ids)
        if self.dtype == "float16":
            return data.index_select(0, ids).to(torch.float32)
        if self.dtype == "bfloat16":
            return data.index_select(0, ids).view(torch.int16).view(torch.bfloat16).to(torch.float32)
        sb = self._scales[table].index_select(0, ids)
        return data.index_select(0, ids).to(torch.float32) * sb[:, :1] + sb[:, 1:]

    @torch.no_grad()
    def forward(self, features: Any, weights: Any = None) -> Any:
        flat_x, flat_w = flatten_inputs(self.feature_config, features, weights)
        out = []
        for conv, x, w in zip(self._converters, flat_x, flat_w):
            b = conv.convert(x, w, torch.device("cpu"))
            t = self.resolved.tables[conv.feature.table_index]
            q = t.config.quantization_config
            if self.dtype == "float32" and q is None and native.usable(self._data[t.name], b.ids, b.offsets, b.coeffs):
                (acts,), status = native.lookup_many([(self._data[t.name], b.ids, b.offsets, b.coeffs)])
                if status == 1:
                    raise ValueError(f"feature {conv.feature.name!r}: ids or offsets out of range.")
            else:
                unique, inverse = torch.unique(b.ids, return_inverse=True)
                mini = self._rows(t.name, unique).contiguous()
                quant = None if q is None else (q.num_buckets, float(q.lower), float(q.upper))
                acts = pooled_lookup(mini, inverse, b.seg, b.offsets, b.coeffs, quantization=quant)
            out.append(acts.reshape(*b.out_shape, t.dim))
        return nest.pack_sequence_as(self.feature_config, out)
