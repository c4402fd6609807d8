"""Export for serving: a lookup-only artifact from a checkpoint, and ``ServingEmbedding``, a CPU
``nn.Module`` with the training module's forward over memory-mapped tables.

``export(checkpoint, out, dtype)`` writes ``out/serving.json`` (the features, their nest, the tables
and, per table, its file names) and one ``.npy`` file per table, ``t<index>-<safe name>.npy`` [V, D]
in ``dtype`` (file names never come from table names: see ``file_names``). With "int8", each row is
quantised on its own: ``q = round((w - bias) / scale)`` in [0, 255] with ``bias = min(row)`` and
``scale = (max(row) - min(row)) / 255``, stored in ``t<index>-<safe name>.scale.npy`` [V, 2] float32
(scale, bias). A lookup dequantises only the rows it reads. The export streams the checkpoint's
blocks into the output in row order, so no table is ever held in memory whole, checks that they
cover every row, and reports the measured max abs error per table. The artifact is built in a
temporary directory and published atomically; ``out`` must be new, empty, or an earlier export
(recognised by its marker file ``.embtables-export``), and anything else is refused untouched.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from embtables.checkpoint import increments, serving_deltas
from embtables.checkpoint.blocks import open_rank_files, read_block, row_ids
from embtables.checkpoint.file_names import CheckpointError, contained, table_file_stem
from embtables.checkpoint.owned_dirs import clean_dead_leftovers, publish_over, temp_name
from embtables.checkpoint.serving_codec import (
    DTYPES,
    MARKER,
    encode_rows,
    int8_scales_problem,
    load_array,
    store_dtype,
)
from embtables.checkpoint.store import read_manifest
from embtables.config import Combiner, DynamicVocabulary, FeatureConfig, QuantizationConfig, TableConfig, nest, resolve
from embtables.config.optimizers import SGD
from embtables.kernels import native
from embtables.kernels.lookup import pooled_lookup
from embtables.tables.dynamic_vocabularies import with_rows
from embtables.tables.input_nest import flatten_inputs
from embtables.tables.inputs import InputConverter

logger = logging.getLogger("embtables")
FORMAT_VERSION = 2  # 2: files named by table index (serving.json maps names to files); 1 is still read
_CHUNK_ROWS = 1 << 16


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """Where the artifact is, and per table the max abs error against the float32 checkpoint over its
    finite values (and that error relative to the table's max abs weight), and how many values of
    the checkpoint were not finite (NaN or Inf: exported as they are, never hidden in a maximum)."""

    path: str
    dtype: str
    max_abs_error: dict[str, float]
    relative_error: dict[str, float]
    nonfinite: dict[str, int] = dataclasses.field(default_factory=dict)
    delta: str | None = None  # ``incremental=True``: the delta written (None: a full export, or nothing new)


def _check_out(target: Path) -> None:
    """Refuse an ``out`` that export may not replace: anything but a new or empty directory, or a
    directory that an earlier export wrote (its marker lists every entry there)."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise CheckpointError(f"export: {target} exists and is not a directory; give a new or empty directory.")
    if not target.exists():
        return
    entries = sorted(p.name for p in target.iterdir())
    if not entries:
        return
    written: set[str] = set()
    try:
        doc = json.loads((target / MARKER).read_text())
        written = {str(f) for f in doc["files"]} | {MARKER}
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    foreign = [e for e in entries if e not in written]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise CheckpointError(
            f"export: {target} is not empty and is not an embtables export (it holds {shown}). export replaces "
            "only a directory it wrote itself and never deletes anything else; give a new or empty directory."
        )


def export(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    dtype: str = "float32",
    *,
    incremental: bool = False,
) -> ExportReport:
    """Write a serving artifact of ``checkpoint``'s tables (no slots) in ``dtype`` into ``out``: a new
    or empty directory, or an earlier export, which is replaced atomically (anything else is refused
    and left untouched). ``incremental=True``: when ``out`` is an export in ``dtype`` of a checkpoint in
    ``checkpoint``'s chain, only a delta of the rows changed since (``serving_deltas``; nothing when
    there are none), applied by ``ServingEmbedding.update``; else a full export, logged."""
    if dtype not in DTYPES:
        raise ValueError(f"export: dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    where, manifest = read_manifest(checkpoint)
    config = manifest["config"]
    if "structure" not in config:
        raise CheckpointError(f"{where}: this checkpoint has no feature structure (written by an older embtables).")
    chain = increments.resolve_chain(where, manifest, read_manifest)  # an increment: its full checkpoint first
    dynamic = [name for name, t in config["tables"].items() if t.get("dynamic") is not None]
    # every rank file of every link checked against its manifest, once
    links = [(link, m, open_rank_files(link, m)) for link, m in chain]
    maps = links[-1][2]
    target = Path(out)
    _check_out(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for kind in ("export", "trash", "delta"):  # left beside the export by writers that died
        clean_dead_leftovers(target.parent, kind)
    if incremental:
        base, why = _export_to_extend(target, dtype)
        if dynamic:  # its keys move between rows: served from a whole export
            base, why = None, f"table {dynamic[0]!r} is dynamic, and serving deltas hold rows of fixed tables only"
        if base is not None:
            current, _ = serving_deltas.version(base, target)
            ids = [increments.manifest_id(m) for _, m, _ in links]
            if current in ids:
                delta = serving_deltas.write(target, base, links, ids.index(current), config["tables"], dtype)
                return ExportReport(str(target), dtype, {}, {}, {}, None if delta is None else str(delta))
            why = f"the export at {target} serves a checkpoint that is not in the chain of {where}"
        increments.full_writes.info("embtables: export(incremental=True) writes a full export: %s.", why)
    tmp = target.parent / temp_name("export")
    try:
        tmp.mkdir()
    except OSError as exc:
        raise CheckpointError(f"export: cannot write beside {target} ({exc}).") from exc
    errors: dict[str, float] = {}
    relative: dict[str, float] = {}
    nonfinite: dict[str, int] = {}
    files: dict[str, dict[str, str]] = {}
    try:
        for index, (name, t) in enumerate(config["tables"].items()):
            stem = table_file_stem(index, name)
            files[name] = {"data": f"{stem}.npy"}
            if dtype == "int8":  # the per-row [scale, bias]; no other dtype has any
                files[name]["scales"] = f"{stem}.scale.npy"
            if t.get("dynamic") is not None:  # a dynamic table's live keys and their rows (spec §11)
                files[name]["keys"] = f"{stem}.keys.npy"
                _export_keys(where, manifest, maps, name, int(t["vocabulary_size"]), tmp / files[name]["keys"])
            errors[name], relative[name], nonfinite[name] = _export_table(links, name, t, tmp, files[name], dtype)
        doc = {
            "format_version": FORMAT_VERSION, "dtype": dtype, "step": manifest["step"], "files": files, **config,
            "export_id": increments.new_id(), "checkpoint_id": increments.manifest_id(manifest),
        }  # fmt: skip
        _write_synced(tmp / "serving.json", json.dumps(doc, indent=1, sort_keys=True))
        written = ["serving.json", *(f for pair in files.values() for f in pair.values())]
        _write_synced(tmp / MARKER, json.dumps({"format": "embtables serving export", "files": written}))
        publish_over(tmp, target, _check_out)  # still ours to replace: checked just before the exchange
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportReport(str(target), dtype, errors, relative, nonfinite)


def _export_to_extend(target: Path, dtype: str) -> tuple[dict[str, Any] | None, str]:
    """The ``serving.json`` of the export at ``target`` when a delta may extend it, else None and why."""
    try:
        doc = json.loads((target / "serving.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None, f"no readable export at {target}"
    if not isinstance(doc, dict) or not isinstance(doc.get("export_id"), str):
        return None, f"the export at {target} was written before serving deltas"
    if type(doc.get("step")) is not int or not isinstance(doc.get("tables"), dict):
        return None, f"the serving.json of {target} is malformed"
    if doc.get("dtype") != dtype:
        return None, f"the export at {target} is in {doc.get('dtype')!r:.20}, not {dtype}"
    return doc, ""


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _export_table(
    links: list[tuple[Path, dict[str, Any], dict[str, np.ndarray[Any, Any]]]], name: str, table: dict[str, Any],
    out: Path, files: dict[str, str], dtype: str,
) -> tuple[float, float, int]:  # fmt: skip
    """Stream one table's blocks into its files; returns (max abs error, relative error, non-finite count).
    ``links``: the checkpoints of a chain, oldest first (one for a full checkpoint), each (directory, checked
    manifest, rank file maps); every row is read from the newest link that holds it."""
    v, d = int(table["vocabulary_size"]), int(table["dim"])
    store = store_dtype(dtype)
    data = np.lib.format.open_memmap(out / files["data"], mode="w+", dtype=store, shape=(v, d))
    scales = None
    if "scales" in files:
        scales = np.lib.format.open_memmap(out / files["scales"], mode="w+", dtype=np.float32, shape=(v, 2))
    filled = np.zeros(v, dtype=bool)
    worst = biggest = 0.0
    bad = 0
    where = links[-1][0]
    for rows, weights, newest in serving_deltas.newest_blocks(links, name, v, filled):  # a newer link's row wins
        for start in range(0, rows.size, _CHUNK_ROWS):  # bounded memory: 64k rows at a time
            keep = newest[start : start + _CHUNK_ROWS]
            if not keep.any():
                continue
            w = np.asarray(weights[start : start + _CHUNK_ROWS])[keep]
            r = rows[start : start + _CHUNK_ROWS][keep]
            stored, back, scale_bias, finite = encode_rows(w, dtype, name, r)
            data[r] = stored
            if scale_bias is not None and scales is not None:
                scales[r] = scale_bias
            bad += int(finite.size - np.count_nonzero(finite))
            if finite.any():
                worst = max(worst, float(np.abs(back[finite] - w[finite]).max()))
                biggest = max(biggest, float(np.abs(w[finite]).max()))
    if not filled.all():
        missing = np.flatnonzero(~filled)
        raise CheckpointError(
            f"{where}: table {name!r}: {missing.size} of its {v} rows are in no file of the checkpoint (first: "
            f"{missing[:5].tolist()}); a rank's file is missing from the manifest. Nothing was exported."
        )
    data.flush()
    if scales is not None:
        scales.flush()
    del data, scales
    for f in files.values():
        with open(out / f, "rb+") as fh:
            os.fsync(fh.fileno())
    return worst, (worst / biggest if biggest else 0.0), bad


def _export_keys(
    where: Path, manifest: dict[str, Any], maps: dict[str, np.ndarray[Any, Any]], name: str, v: int, out: Path
) -> None:
    """A dynamic table's live keys with their rows, ``[L, 2]`` int64 sorted by key, from every rank file."""
    parts = []
    for entry in manifest["checked_files"]:
        file, mm = where / entry["file"], maps[entry["file"]]
        blocks = entry["blocks"][name]
        if blocks.vocabulary is None:
            raise CheckpointError(f"{file}: table {name!r} is dynamic but the file holds no vocabulary for it.")
        rows = row_ids(mm, blocks.rows, file, name, v)
        keys = read_block(mm, blocks.vocabulary["keys"], file, f"{name}#keys")
        live = read_block(mm, blocks.vocabulary["counts"], file, f"{name}#counts") > 0
        parts.append(np.stack([keys[live], rows[live]], axis=1))
    pairs = np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)
    pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]
    if pairs.shape[0] > 1 and not bool((np.diff(pairs[:, 0]) > 0).all()):
        raise CheckpointError(f"{where}: table {name!r}: a key holds two rows (the checkpoint is corrupt).")
    np.save(out, pairs.astype(np.int64))


def _rebuild(structure: Any, features: list[FeatureConfig], used: set[int]) -> Any:
    """The feature nest from its JSON form, every node checked (each feature index used once)."""
    if not isinstance(structure, dict) or len(structure) != 1:
        raise ValueError(f"a structure node must be an object with one key, got {structure!r:.80}")
    kind, body = next(iter(structure.items()))
    if kind == "feature":
        if isinstance(body, bool) or not isinstance(body, int) or not 0 <= body < len(features) or body in used:
            raise ValueError(f"feature index {body!r} is out of range or used twice")
        used.add(body)
        return features[body]
    if kind == "dict" and isinstance(body, dict):
        return {str(k): _rebuild(v, features, used) for k, v in body.items()}
    if kind in ("list", "tuple") and isinstance(body, list):
        items = [_rebuild(v, features, used) for v in body]
        return items if kind == "list" else tuple(items)
    raise ValueError(f"unknown structure node {kind!r:.40}")


def _table_configs(doc: dict[str, Any]) -> dict[str, TableConfig]:
    tables: dict[str, TableConfig] = {}
    for name, t in doc["tables"].items():
        q = t.get("quantization")
        if q is not None and (not isinstance(q, list) or len(q) != 3):
            raise ValueError(f"table {name!r}: quantization must be [num_buckets, lower, upper], got {q!r:.80}")
        quant = None if q is None else QuantizationConfig(q[0], float(q[1]), float(q[2]))
        dynamic = None if t.get("dynamic") is None else DynamicVocabulary()  # serving only reads its keys
        tables[name] = TableConfig(
            t["vocabulary_size"], t["dim"], combiner=Combiner(t["combiner_value"]), name=name,
            optimizer=SGD(0.1), quantization_config=quant, dynamic=dynamic,
        )  # fmt: skip
    return tables


def _feature_configs(doc: dict[str, Any], tables: dict[str, TableConfig]) -> list[FeatureConfig]:
    out = []
    for f in doc["feature_list"]:
        shape = f["output_shape"]
        out.append(
            FeatureConfig(
                tables[f["table"]],
                max_sequence_length=f["max_sequence_length"],
                validate_weights_and_indices=f["validate"],
                name=f["name"],
                output_shape=None if shape is None else tuple(shape),
            )
        )
    return out


def _file_names(doc: dict[str, Any], root: Path) -> dict[str, dict[str, Path]]:
    """Per table, its data and scales files: named in ``serving.json`` (format 2) or, format 1, after
    the table; either way checked to be plain names inside ``root``."""
    out = {}
    for name in doc["tables"]:
        if doc["format_version"] == 1:
            pair = {"data": f"{name}.npy", "scales": f"{name}.scale.npy"}
        else:
            pair = doc["files"][name]
            if not isinstance(pair, dict):
                raise ValueError(f"files[{name!r}] must be an object, got {pair!r:.80}")
        kinds = ["data"] + (["scales"] if doc["dtype"] == "int8" else [])
        if doc["tables"][name].get("dynamic") is not None:
            kinds.append("keys")
        out[name] = {k: contained(root, pair[k], f"serving.json's files[{name!r}][{k!r}]") for k in kinds}
    return out


def _require_finite(data: Tensor, scales: Tensor | None, dtype: str) -> None:
    """Raise ValueError when a stored float (an int8 table's per-row scale and bias, else its values) is not
    finite: a table that embtables exported never holds one, so the file was changed since (one pass)."""
    floats = scales if scales is not None else data.view(torch.bfloat16) if dtype == "bfloat16" else data
    if floats.numel() and not bool(torch.isfinite(floats).all()):
        raise ValueError("it holds a value that is not finite (NaN or Inf): the file was changed after the export")
    problem = int8_scales_problem(scales.numpy()) if scales is not None and scales.numel() else None
    if problem is not None:
        raise ValueError(problem)


def _load_keys(path: Path, vocabulary_size: int) -> tuple[Tensor, Tensor]:
    """A dynamic table's keys file: its keys [L] (strictly increasing) and their rows [L] (in [0, V))."""
    pairs = load_array(path, np.int64, (-1, 2), mmap=False, max_rows=vocabulary_size)
    keys, rows = pairs[:, 0], pairs[:, 1]
    if (keys.size > 1 and not bool((np.diff(keys) > 0).all())) or (
        rows.size and (int(rows.min()) < 0 or int(rows.max()) >= vocabulary_size)
    ):
        raise ValueError(f"{path.name}: keys are not increasing, or a row is outside [0, {vocabulary_size})")
    return torch.from_numpy(keys.copy()), torch.from_numpy(rows.copy())


class ServingEmbedding(nn.Module):
    """Lookup-only embeddings from an ``export`` artifact: ``forward(features, weights=None)`` takes
    the training module's inputs (every input type) and returns the same activations, in the same
    nest. ``load`` reads the tables into memory, or with ``mmap=True`` maps them read-only so that
    only the rows a batch looks up are read (for tables larger than RAM; the files must then not be
    changed in place while served). fp16/bf16/int8 rows are decoded to float32 as they are read."""

    def __init__(self, doc: dict[str, Any], root: Path, mmap: bool = False) -> None:
        super().__init__()
        self.dtype, self.mmap, self.root = doc["dtype"], mmap, root
        self._lock = serving_deltas.ReadWriteLock()  # lookups read, update writes
        self.export_id = doc.get("export_id") if isinstance(doc.get("export_id"), str) else None
        self.version = doc.get("checkpoint_id") if isinstance(doc.get("checkpoint_id"), str) else None
        self.step = int(doc["step"]) if type(doc.get("step")) is int else 0
        try:
            tables = _table_configs(doc)
            features = _feature_configs(doc, tables)
            used: set[int] = set()
            self.feature_config = _rebuild(doc["structure"], features, used)
            if len(used) != len(features):
                raise ValueError("the structure does not place every feature")
            files = _file_names(doc, root)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, RecursionError, AttributeError) as exc:
            raise CheckpointError(
                f"ServingEmbedding.load: {root / 'serving.json'} is malformed ({type(exc).__name__}: {exc}); "
                "export the checkpoint again."
            ) from exc
        self.resolved = resolve(self.feature_config, None)
        self._converters = [InputConverter(f, self.resolved.tables[f.table_index]) for f in self.resolved.features]
        self._data: dict[str, Tensor] = {}
        self._scales: dict[str, Tensor] = {}
        self._keys: dict[str, tuple[Tensor, Tensor]] = {}  # dynamic tables: sorted keys [L], their rows [L]
        store = store_dtype(self.dtype)
        with warnings.catch_warnings():  # read-only memory maps: torch warns that it cannot write them
            warnings.simplefilter("ignore", UserWarning)
            for t in self.resolved.tables:
                paths = files[t.name]
                try:
                    self._data[t.name] = torch.from_numpy(
                        load_array(paths["data"], store, (t.vocabulary_size, t.dim), mmap)
                    )
                    if self.dtype == "int8":
                        scales = load_array(paths["scales"], np.float32, (t.vocabulary_size, 2), mmap)
                        self._scales[t.name] = torch.from_numpy(scales)
                    if not mmap:  # a mapped table is not read at load; its lookups check what they serve
                        _require_finite(self._data[t.name], self._scales.get(t.name), self.dtype)
                    if "keys" in paths:
                        self._keys[t.name] = _load_keys(paths["keys"], t.vocabulary_size)
                except (OSError, ValueError, EOFError) as exc:
                    raise CheckpointError(
                        f"ServingEmbedding.load: {root}: table {t.name!r}: {exc}. Export the checkpoint again."
                    ) from exc

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, mmap: bool = False) -> ServingEmbedding:
        """The artifact ``export`` wrote to ``path``; ``CheckpointError`` when it is missing or malformed."""
        root = Path(path)
        try:
            doc = json.loads((root / "serving.json").read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(
                f"ServingEmbedding.load: {root / 'serving.json'} is missing or unreadable ({exc})."
            ) from exc
        version = doc.get("format_version") if isinstance(doc, dict) else None
        if type(version) is not int or version not in (1, FORMAT_VERSION):
            raise CheckpointError(f"ServingEmbedding.load: {root}: unknown format_version {version!r:.40}.")
        if not isinstance(doc.get("dtype"), str) or doc["dtype"] not in DTYPES:
            raise CheckpointError(f"ServingEmbedding.load: {root}: unknown dtype {doc.get('dtype')!r:.40}.")
        emb = cls(doc, root, mmap=mmap)
        if emb.export_id is not None and any(p.is_dir() for p in root.glob("delta-*")):
            if mmap:
                raise CheckpointError(
                    f"ServingEmbedding.load: {root} has serving deltas, which a memory-mapped export cannot take in "
                    "(its files are served as they are): load it without mmap, or export fully (incremental=False)."
                )
            emb.update()  # the export and every delta after it
        return emb

    def update(self, until: int | None = None) -> int:
        """Apply the export's deltas newer than what this module serves (``export(..., incremental=True)``; with
        ``until``, only those that reach at most that step), in order, all of them at once for lookups: a lookup
        running alongside sees the tables before this call or after it, never a mix (it waits while the rows are
        written). Every delta is checked before
        any row is written; a missing, out-of-order or malformed delta, or an export replaced by a full one,
        raises ``CheckpointError`` and changes nothing. Rows are written in place: no second copy of a
        table. Returns the step now served."""
        if self.mmap:
            raise CheckpointError(
                f"ServingEmbedding.update: {self.root} is served memory-mapped (mmap=True), and its files are never "
                "changed in place; load it without mmap to take updates."
            )
        try:
            doc = json.loads((self.root / "serving.json").read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(
                f"ServingEmbedding.update: {self.root / 'serving.json'} is unreadable ({exc})."
            ) from exc
        if (
            not isinstance(doc, dict)
            or self.export_id is None
            or doc.get("export_id") != self.export_id
            or doc.get("dtype") != self.dtype
            or not isinstance(doc.get("tables"), dict)
        ):
            raise CheckpointError(
                f"ServingEmbedding.update: {self.root} is not the export this module loaded any more (a full export "
                "replaced it, or it was written before serving deltas); load it again. Nothing was applied."
            )
        shapes = {t.name: (t.vocabulary_size, t.dim) for t in self.resolved.tables}
        deltas = serving_deltas.pending(self.root, doc, self.version, self.step, shapes)
        if until is not None:
            deltas = [d for d in deltas if d.to_step <= until]  # a chain in step order: a prefix of it
        if not deltas:
            return self.step
        with self._lock.write():
            for delta in deltas:
                for name, d in delta.tables.items():
                    self._data[name].numpy()[d.rows] = d.data
                    if d.scales is not None:
                        self._scales[name].numpy()[d.rows] = d.scales
                self.version, self.step = delta.to_id, delta.to_step
        return self.step

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._lock = serving_deltas.ReadWriteLock()

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
    def extra_repr(self) -> str:
        """What ``repr`` shows: where the artifact is, its storage type, and each table (V x D, dynamic)."""
        tables = ", ".join(
            f"{t.name}: {t.vocabulary_size} x {t.dim}{' dynamic' if t.name in self._keys else ''}"
            for t in self.resolved.tables
        )
        features = ", ".join(f.name for f in self.resolved.features)
        return f"{str(self.root)!r}, dtype={self.dtype}, mmap={self.mmap}, tables=[{tables}], features=[{features}]"

    def forward(self, features: Any, weights: Any = None) -> Any:
        with self._lock.read():  # a concurrent update applies whole, before or after this lookup
            return self._forward(features, weights)

    def _forward(self, features: Any, weights: Any) -> Any:
        flat_x, flat_w = flatten_inputs(self.feature_config, features, weights)
        out = []
        for conv, x, w in zip(self._converters, flat_x, flat_w):
            b = conv.convert(x, w, torch.device("cpu"))
            t = self.resolved.tables[conv.feature.table_index]
            if t.name in self._keys:  # keys to rows; unknown keys are absent from their bags (spec §11)
                known, rows = self._keys[t.name]
                pos = torch.searchsorted(known, b.ids).clamp(max=max(known.numel() - 1, 0))
                hit = known[pos] == b.ids if known.numel() else torch.zeros_like(b.ids, dtype=torch.bool)
                found = rows[pos] if known.numel() else b.ids
                b = with_rows(b, torch.where(hit, found, torch.full_like(b.ids, -1)), t)
            q = t.config.quantization_config
            if self.dtype == "float32" and q is None and native.usable(self._data[t.name], b.ids, b.offsets, b.coeffs):
                (acts,), status = native.lookup_many([(self._data[t.name], b.ids, b.offsets, b.coeffs)])
                if status == 1:
                    raise ValueError(f"feature {conv.feature.name!r}: ids or offsets out of range.")
                finite = status != 2
            else:
                unique, inverse = torch.unique(b.ids, return_inverse=True)
                mini = self._rows(t.name, unique).contiguous()
                quant = None if q is None else (q.num_buckets, float(q.lower), float(q.upper))
                acts = pooled_lookup(mini, inverse, b.seg, b.offsets, b.coeffs, quantization=quant)
                finite = bool(torch.isfinite(acts).all())
            if not finite:
                raise ValueError(
                    f"feature {conv.feature.name!r} (table {t.name!r}): the served activations are not finite: the "
                    "table's file holds NaN or Inf (changed after the export), or a sum of its rows overflows float32."
                )
            out.append(acts.reshape(*b.out_shape, t.dim))
        return nest.pack_sequence_as(self.feature_config, out)
