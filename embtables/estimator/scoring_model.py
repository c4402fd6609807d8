"""``load_model(path)``: a model artifact (``model_artifact``) as a module that scores raw rows.

``ScoringModel.predict(rows)`` takes N raw rows (a dict of columns ``{name: array [N]}`` or a pandas DataFrame,
strings and missing values as the training job read them; extra columns, the label included, are ignored) and
returns the predictions [N] (a probability for a binary task, the value for a regression), computed as the
Estimator's ``predict`` computes them: the row transform, the feature columns' ids, the served tables' lookup,
the dense program. ``update()`` takes in what the artifact gained since it was loaded (the tables' serving
deltas and the dense weights of their step, or a whole new export) while other threads score: a prediction
sees the model before an update or after it, never a mix.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from embtables.checkpoint import ServingEmbedding, serving_deltas
from embtables.checkpoint.file_names import CheckpointError
from embtables.checkpoint.serving_deltas import ReadWriteLock
from embtables.estimator.column_codec import columns_from_json
from embtables.estimator.model_artifact import (
    FORMAT,
    FORMAT_VERSION,
    MODEL_FILE,
    PROGRAM,
    TABLES,
    TASKS,
    WEIGHTS,
    state_fits,
    torch_quiet,
)
from embtables.estimator.row_transform import RowTransform
from embtables.estimator.spec import engine_inputs

logger = logging.getLogger("embtables")
CHUNK_ROWS = 8192  # rows scored at once by predict


def as_columns(rows: Any) -> dict[str, Any]:
    """N raw rows as ``{column: array [N]}``: a pandas DataFrame's columns, or a mapping's values as arrays."""
    if hasattr(rows, "columns") and hasattr(rows, "to_numpy") and hasattr(rows, "__getitem__"):  # a DataFrame
        return {str(c): rows[c].to_numpy() for c in rows.columns}
    if not isinstance(rows, Mapping):
        raise TypeError(f"rows must be a dict of columns or a pandas DataFrame, got {type(rows).__name__}.")
    out: dict[str, Any] = {}
    for k, v in rows.items():
        if isinstance(v, (np.ndarray, Tensor)):
            out[str(k)] = v
        elif isinstance(v, (list, tuple)):
            if {type(x) for x in v} <= {int, float}:
                out[str(k)] = np.asarray(v)
            else:  # strings, missing values, lists: one object a row (the columns find each one's type)
                out[str(k)] = np.empty(len(v), dtype=object)
                out[str(k)][:] = v
        else:
            out[str(k)] = np.asarray(v)
    return out


def _read_document(root: Path) -> dict[str, Any]:
    try:
        doc = json.loads((root / MODEL_FILE).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"load_model: {root / MODEL_FILE} is missing or unreadable ({exc}).") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"load_model: {root} is not a model artifact of this embtables (format "
                              f"{doc.get('format') if isinstance(doc, dict) else None!r:.40}).")  # fmt: skip
    return doc


class ScoringModel(nn.Module):
    """Raw rows -> predictions with an artifact's tables, transform and dense program (see the module)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        doc = _read_document(root)
        where = str(root / MODEL_FILE)
        engine = doc.get("engine_features")
        if not isinstance(engine, list) or not all(isinstance(n, str) for n in engine):
            raise CheckpointError(f"load_model: {where}: `engine_features` must be a list of names.")
        self.engine_features: list[str] = engine
        self.columns = columns_from_json(doc.get("columns"), where) if not engine or doc.get("columns") else []
        transform = doc.get("transform")
        self.transform = None if transform is None else RowTransform.from_json(transform, where)
        tensors = doc.get("tensor_features")
        if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in tensors.items()
        ):
            raise CheckpointError(
                f"load_model: {where}: `tensor_features` must map names to the keys they are read from."
            )
        self.tensor_features: dict[str, str] = tensors
        task = doc.get("task")
        if task is not None and task not in TASKS:
            raise CheckpointError(f"load_model: {where}: unknown task {task!r:.40}.")
        self.task: str | None = task
        self.label = doc.get("label") if isinstance(doc.get("label"), str) else None
        if doc.get("program") != PROGRAM or doc.get("tables") != TABLES:
            raise CheckpointError(f"load_model: {where}: unexpected file names; export the model again.")
        self.dense = _load_program(root / PROGRAM)
        self._lock = ReadWriteLock()  # predictions read, update writes
        self.tables = ServingEmbedding.load(root / TABLES)
        self._load_weights(self.tables.step)

    @property
    def step(self) -> int:
        """The training step served (the tables' and the dense weights')."""
        return self.tables.step

    def _weights(self, step: int) -> dict[str, Tensor]:
        path = self.root / WEIGHTS / f"step-{step:010d}.pt"
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch.load raises many types on a damaged file
            raise CheckpointError(f"load_model: {path}: the dense weights of step {step} are missing or unreadable "
                                  f"({exc}).") from exc  # fmt: skip
        if not isinstance(state, dict):
            raise CheckpointError(f"load_model: {path} is not a state dict.")
        return state

    def _load_weights(self, step: int) -> None:
        self.dense.load_state_dict(self._checked_weights(step), strict=True)

    def _checked_weights(self, step: int) -> dict[str, Tensor]:
        """The dense weights of ``step``, checked against the program (keys, shapes, dtypes) before anything uses
        them: loading them cannot fail half way."""
        state = self._weights(step)
        if not state_fits(state, self.dense.state_dict()):
            raise CheckpointError(f"load_model: {self.root}: the weights of step {step} do not fit the program; "
                                  "export the model again.")  # fmt: skip
        return state

    def update(self) -> int:
        """Take in the artifact's newer step, if any, and return the step now served: the tables' deltas up to the
        step they reach now and the dense weights of that step (read and checked first), or a whole new export
        (loaded beside and swapped in). A failure raises ``CheckpointError`` and the module keeps serving exactly
        what it served; a prediction sees the model before an update or after it."""
        try:
            doc = json.loads((self.root / TABLES / "serving.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"ScoringModel.update: {self.root / TABLES} is unreadable ({exc}).") from exc
        if isinstance(doc, dict) and doc.get("export_id") == self.tables.export_id:
            target = serving_deltas.version(doc, self.root / TABLES)[1]
            if target <= self.tables.step:
                return self.tables.step
            state = self._checked_weights(target)  # missing or unfit: nothing applied
            with self._lock.write():
                step = self.tables.update(until=target)
                self.dense.load_state_dict(state, strict=True)
        else:  # a whole export replaced the tables: load it and its weights beside, swap below
            fresh = ServingEmbedding.load(self.root / TABLES)
            state = self._checked_weights(fresh.step)
            with self._lock.write():
                self.tables, step = fresh, fresh.step
                self.dense.load_state_dict(state, strict=True)
        logger.info("ScoringModel: %s now serves step %d", self.root, step)
        return step

    def _features(self, rows: Any) -> dict[str, Any]:
        columns = as_columns(rows)
        return self.transform.apply(columns) if self.transform is not None else dict(columns)

    def forward(self, rows: Any) -> Tensor:
        """The predictions [N] of the N raw ``rows`` (one batch)."""
        return self.score(rows)[0]

    @torch.no_grad()
    def score(self, rows: Any) -> tuple[Tensor, int]:
        """The predictions [N] of the N raw ``rows`` (one batch) and the step that computed them (the tables and
        the dense weights are read under one lock: an update is taken in before or after, never during)."""
        features = self._features(rows)
        if self.columns:
            ids, weights = engine_inputs(self.columns, features)
        else:  # a spec of dicts: the rows' features are the tables' inputs themselves
            missing = [n for n in self.engine_features if n not in features]
            if missing:
                raise ValueError(f"the rows give no feature {missing[0]!r} (the model reads {self.engine_features}).")
            ids, weights = {n: features[n] for n in self.engine_features}, {}
        tensors = {}
        for name, source in self.tensor_features.items():
            value = features.get(source)
            if value is None:
                raise ValueError(f"the rows give no tensor feature {name!r}, which the model reads.")
            if not isinstance(value, Tensor):  # e.g. a JSON list of numbers a row: float32 [B, ...]
                try:
                    value = torch.from_numpy(np.asarray(value.tolist() if hasattr(value, "tolist") else value,
                                                        dtype=np.float32))  # fmt: skip
                except (TypeError, ValueError) as exc:
                    raise ValueError(
                        f"the tensor feature {name!r} is not numbers of one shape a row ({exc})."
                    ) from None
            tensors[name] = value
        with self._lock.read():
            acts = self.tables(ids, weights or None)
            out: Tensor = self.dense(acts, tensors)
            return out, self.tables.step

    def predict(self, rows: Any, batch_size: int = CHUNK_ROWS, progress: bool = False) -> np.ndarray:
        """The predictions [N] of ``rows`` as float32, scored ``batch_size`` rows at a time."""
        columns = as_columns(rows)
        n = {len(v) for v in columns.values()}
        if len(n) > 1:
            raise ValueError(f"the columns have different lengths {sorted(n)}; give one value per row each.")
        total = n.pop() if n else 0
        out = [p for p in self._chunks(columns, total, batch_size, progress)]
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def _chunks(self, columns: dict[str, Any], total: int, size: int, progress: bool) -> Iterator[np.ndarray]:
        bar = None
        if progress:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

                bar = tqdm(total=total, desc="embtables predict", unit="row", dynamic_ncols=True)
            except ImportError:
                bar = None
        try:
            for s in range(0, total, size):
                piece = {k: v[s : s + size] for k, v in columns.items()}
                try:
                    yield self(piece).float().reshape(-1).numpy()
                except ValueError as exc:
                    raise ValueError(f"rows {s}-{min(s + size, total) - 1}: {exc}") from None
                if bar is not None:
                    bar.update(min(size, total - s))
        finally:
            if bar is not None:
                bar.close()


def _load_program(path: Path) -> nn.Module:
    """The dense program at ``path``; ``CheckpointError`` for a missing or damaged file, in one line (torch logs a
    damaged archive's traceback as a warning before it raises: ``torch_quiet``)."""
    said = io.StringIO()
    try:
        with torch_quiet(said):
            module: nn.Module = torch.export.load(str(path)).module()
    except Exception as exc:  # torch.export.load raises many types on a damaged file
        raise CheckpointError(f"load_model: {path} is missing or unreadable ({exc}).") from exc
    sys.stderr.write(said.getvalue())  # loaded: what torch said is kept
    return module


def load_model(path: str | os.PathLike[str]) -> ScoringModel:
    """The model artifact at ``path`` (``embtables export --model`` / ``export_model``) as a ``ScoringModel``."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"load_model: {root} is not a directory (give what `embtables export --model` wrote).")
    return ScoringModel(root)


__all__ = ["ScoringModel", "as_columns", "load_model"]
