"""A model artifact: everything needed to score raw rows, written from an Estimator's checkpoint.

``export_model(checkpoint, out, parts, dtype)`` writes a directory ``out``::

    model.json          what the model reads: the feature columns (``column_codec``), the row transform
                        (``row_transform``: multi-valued cells, numbers, the numeric normalisation), the tensor
                        features the dense program takes, the task and the label
    dense.pt2           the dense model and its ``predictions_fn`` as one ``torch.export`` program:
                        (activations {feature: [B, D] | [B, L, D]}, tensor features {name: [B, ...]}) -> [B]
    weights/step-S.pt   the dense model's weights at table step S (a state dict, read with weights_only=True)
    tables/             the tables' serving export (``checkpoint.export``: float32, float16, bfloat16 or int8),
                        with its serving deltas
    .embtables-model    the marker: this directory was written by export_model (only such a directory is replaced)

No training code is needed to score with it: ``load_model`` (``scoring_model``) rebuilds the columns and the
transform from ``model.json`` and runs the program. ``incremental=True`` keeps the artifact and adds the newer
step: the dense weights first (``weights/step-S.pt``), then the tables' serving delta (its atomic publish is the
commit); a server polling the artifact (``ScoringModel.update``) applies the delta and loads the weights of the
step the tables reached, under one lock, so no response mixes two steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from embtables.checkpoint import export
from embtables.checkpoint.file_names import CheckpointError, contained
from embtables.checkpoint.owned_dirs import publish_over, temp_name, write_atomically, write_json_atomically
from embtables.checkpoint.store import published, read_manifest
from embtables.estimator.column_codec import columns_to_json
from embtables.estimator.dense_file import DENSE_FILE
from embtables.estimator.row_transform import RowTransform

FORMAT = "embtables model"
FORMAT_VERSION = 1
MODEL_FILE = "model.json"
MARKER = ".embtables-model"
PROGRAM = "dense.pt2"
TABLES = "tables"
WEIGHTS = "weights"
WEIGHTS_FILE = re.compile(r"step-(\d{10})\.pt")
KEEP_WEIGHTS = 4  # weight files kept for servers that poll between two updates
TASKS = ("binary", "regression")


@dataclasses.dataclass
class ModelParts:
    """What an artifact is made of besides the tables: the dense ``model`` (called as the Estimator calls it,
    ``model(activations, features)``), the embedding ``columns``, the ``transform`` from raw rows to features
    (None: rows are given as the Estimator's ``input_fn`` gives features), ``predictions_fn`` (e.g.
    ``torch.sigmoid``), the ``task`` ("binary", "regression" or None) and the ``label`` column, and an example of
    the tensor features the model reads (``{name: [B, ...]}``, B >= 2 rows; the batch is dimension 0). Without
    columns (a spec of feature and table dicts), ``engine_features`` names the features whose values are the
    tables' inputs themselves; ``tensor_sources`` maps a tensor feature to the key of the transformed row it is
    read from (e.g. a sequence's lengths)."""

    model: nn.Module
    columns: list[Any]
    transform: RowTransform | None
    predictions_fn: Callable[[Tensor], Tensor] | None
    task: str | None
    label: str | None
    example: dict[str, Tensor]
    engine_features: tuple[str, ...] = ()  # no columns (the dicts form): the features the tables look up
    tensor_sources: dict[str, str] | None = None  # a tensor feature read from another key of the features
    activation_shapes: dict[str, tuple[int, ...]] | None = None  # the dicts form: (D,) or (L, D) per feature


@dataclasses.dataclass(frozen=True)
class ModelExport:
    """Where the artifact is, the table step it serves, and whether this call wrote it whole or added a step."""

    path: str
    step: int
    dtype: str
    incremental: bool


class Scorer(nn.Module):
    """The dense part as the artifact runs it: ``predictions_fn(model(activations, tensors))`` -> [B]."""

    def __init__(self, model: nn.Module, predictions_fn: Callable[[Tensor], Tensor] | None) -> None:
        super().__init__()
        self.model = model
        self.predictions_fn = predictions_fn

    def forward(self, activations: dict[str, Tensor], tensors: dict[str, Tensor]) -> Tensor:
        out = self.model(activations, tensors)
        return self.predictions_fn(out) if self.predictions_fn is not None else out


def _activation_example(columns: list[Any], rows: int) -> dict[str, Tensor]:
    """Zeros shaped as each column's activation: [B, D], or [B, L, D] for a sequence column."""
    out = {}
    for c in columns:
        shape = (rows, c.max_sequence_length, c.dimension) if c.max_sequence_length else (rows, c.dimension)
        out[c.name] = torch.zeros(shape, dtype=torch.float32)
    return out


@contextlib.contextmanager
def torch_quiet(into: io.StringIO) -> Iterator[None]:
    """torch's loggers at ERROR and this process's stdout and stderr written into ``into``: a failed export prints
    its graphs and a warning per guard, a failed load of a damaged program logs its traceback, and the error that
    follows says why in one line. Whoever succeeds writes ``into`` back to stderr."""
    loggers = [lg for n, lg in list(logging.Logger.manager.loggerDict.items())
               if n.split(".")[0] == "torch" and isinstance(lg, logging.Logger)]  # fmt: skip
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(into), contextlib.redirect_stderr(into):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _program(parts: ModelParts) -> torch.export.ExportedProgram:
    """The ``Scorer`` of ``parts`` as a ``torch.export`` program with a dynamic batch dimension."""
    example = {k: v for k, v in parts.example.items() if isinstance(v, Tensor)}
    rows = {int(v.shape[0]) for v in example.values() if v.dim() > 0}
    if len(rows) > 1 or (rows and rows.pop() < 2):
        raise ValueError(f"export_model: the example tensor features must share a batch dimension of >= 2 rows, "
                         f"got {({k: tuple(v.shape) for k, v in example.items()})}.")  # fmt: skip
    if parts.activation_shapes is not None:
        acts = {k: torch.zeros((2, *shape), dtype=torch.float32) for k, shape in parts.activation_shapes.items()}
    else:
        acts = _activation_example(parts.columns, 2)
    example = {k: v[:2] if v.dim() > 0 else v for k, v in example.items()}
    batch = torch.export.Dim("batch", min=1)
    shapes = ({k: {0: batch} for k in acts}, {k: {0: batch} if v.dim() > 0 else None for k, v in example.items()})
    scorer = Scorer(parts.model, parts.predictions_fn).eval()
    said = io.StringIO()  # what torch prints and logs while it exports: the graph of a failure, several times
    try:
        with torch.no_grad(), warnings.catch_warnings(), torch_quiet(said):
            # a model that keeps a training-only tensor as an attribute (the FM's penalty): nothing to serve
            warnings.filterwarnings("ignore", message=".*was assigned during export.*")
            program = torch.export.export(scorer, (acts, example), dynamic_shapes=shapes)
        sys.stderr.write(said.getvalue())  # exported: what torch said is kept
        return program
    except Exception as exc:  # torch.export raises many types (UserError, Unsupported, ...)
        raise ValueError(
            f"export_model: the dense model cannot be exported as a program ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); it must compute with tensors only: the activations and "
            f"the tensor features {sorted(example)} (the example given), the batch in dimension 0."
        ) from None


def _dense_state(checkpoint: Path) -> tuple[int, dict[str, Tensor]]:
    """(table step, the dense model's state dict) of an Estimator checkpoint."""
    _, manifest = read_manifest(checkpoint)
    extra = manifest.get("extra") or {}
    name = extra.get("dense")
    if not isinstance(name, str) or not DENSE_FILE.fullmatch(name):
        raise CheckpointError(f"{checkpoint}: not an Estimator checkpoint (its manifest names no dense model file).")
    for where in (checkpoint.parent, checkpoint):
        path = contained(where, name, f"{checkpoint / 'manifest.json'}'s extra.dense")
        if path.is_file():
            break
    try:
        dense = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types on a damaged file
        raise CheckpointError(f"{path}: the dense model file is missing or unreadable ({exc}).") from exc
    if not isinstance(dense, dict) or not isinstance(dense.get("model"), dict):
        raise CheckpointError(f"{path}: not a dense model file written by the Estimator.")
    step = manifest.get("step")
    if type(step) is not int:
        raise CheckpointError(f"{checkpoint}: its manifest has no step.")
    return step, dense["model"]


def latest_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` when it is a checkpoint, else the newest checkpoint of the model directory ``path``."""
    where = Path(path)
    if (where / "manifest.json").is_file():
        return where
    found = published(where)
    if not found:
        raise CheckpointError(f"{where}: no checkpoint there (train first, or give a checkpoint directory).")
    return Path(found[-1])


def _write_weights(target: Path, step: int, state: Mapping[str, Tensor]) -> None:
    """``weights/step-S.pt`` under ``target``, written atomically (keys as the program names them: ``model.``)."""
    (target / WEIGHTS).mkdir(exist_ok=True)
    weights = {f"model.{k}": v for k, v in state.items()}
    write_atomically(target / WEIGHTS / f"step-{step:010d}.pt", lambda f: torch.save(weights, f))


def state_fits(state: Any, reference: Mapping[str, Tensor]) -> bool:
    """Whether ``state`` is a state dict with ``reference``'s keys, each a tensor of its shape and dtype."""
    return (
        isinstance(state, dict)
        and set(state) == set(reference)
        and all(
            isinstance(state[k], Tensor) and state[k].shape == v.shape and state[k].dtype == v.dtype
            for k, v in reference.items()
        )
    )


def _document(parts: ModelParts, dtype: str, step: int) -> dict[str, Any]:
    if not parts.columns and not parts.engine_features:
        raise ValueError("export_model: give the feature columns, or the engine features of a spec of dicts.")
    sources = parts.tensor_sources or {}
    tensors = {k: sources.get(k, k) for k in sorted(parts.example) if isinstance(parts.example[k], Tensor)}
    if parts.task is not None and parts.task not in TASKS:
        raise ValueError(f"export_model: `task` must be one of {TASKS} or None, got {parts.task!r}.")
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "task": parts.task, "label": parts.label,
        "columns": columns_to_json(parts.columns) if parts.columns else [],
        "engine_features": list(parts.engine_features),
        "transform": None if parts.transform is None else parts.transform.to_json(),
        "tensor_features": tensors,
        "program": PROGRAM, "tables": TABLES, "dtype": dtype, "step": step,
    }  # fmt: skip


def check_target(target: Path) -> bool:
    """True when ``target`` is an artifact export_model wrote (replaceable), False when new or empty; anything
    else is refused untouched (also before a job that exports as it trains, ``--export-to``, starts)."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise CheckpointError(f"export_model: {target} exists and is not a directory; give a new or empty directory.")
    if not target.exists() or not any(target.iterdir()):
        return False
    if not (target / MARKER).is_file():
        raise CheckpointError(
            f"export_model: {target} is not empty and was not written by export_model; give a new or empty directory "
            "(nothing there was changed)."
        )
    return True


def export_model(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    parts: ModelParts,
    dtype: str = "float32",
    *,
    incremental: bool = False,
) -> ModelExport:
    """Write the artifact of ``checkpoint`` (an Estimator checkpoint, or a model directory: its newest) into
    ``out`` (see the module's docstring). ``incremental=True`` with an artifact of the same model at ``out``:
    add this step (the dense weights and a serving delta of the tables), else write it whole."""
    ckpt = latest_checkpoint(checkpoint)
    step, state = _dense_state(ckpt)
    try:
        parts.model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"export_model: {ckpt}'s dense model does not match the model given ({exc}).") from None
    target = Path(out)
    existing = check_target(target)
    doc = _document(parts, dtype, step)
    same = False
    if existing:
        try:
            old = json.loads((target / MODEL_FILE).read_text())
        except (OSError, ValueError):
            old = None
        same = isinstance(old, dict) and all(old.get(k) == doc[k] for k in _SAME_MODEL) and _same_weights(target, state)
        if incremental and same:
            _write_weights(target, step, state)  # first: a server reaching this step finds its weights
            export(ckpt, target / TABLES, dtype=dtype, incremental=True)
            write_json_atomically(target / MODEL_FILE, {**old, "step": step, "dtype": dtype})
            _prune_weights(target)
            return ModelExport(str(target), step, dtype, True)
    program = None if same else _program(parts)  # the same model: its program is kept (exporting takes seconds)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / temp_name("model")
    try:
        tmp.mkdir()
        export(ckpt, tmp / TABLES, dtype=dtype)
        if program is None:
            shutil.copy2(target / PROGRAM, tmp / PROGRAM)
        else:
            torch.export.save(program, str(tmp / PROGRAM))
        _write_weights(tmp, step, state)
        write_json_atomically(tmp / MODEL_FILE, doc)
        write_json_atomically(tmp / MARKER, {"format": FORMAT})
        publish_over(tmp, target, check_target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ModelExport(str(target), step, dtype, False)


_SAME_MODEL = (
    "columns",
    "engine_features",
    "transform",
    "tensor_features",
    "task",
)  # the program's inputs and what is made of its output


def _same_weights(target: Path, state: Mapping[str, Tensor]) -> bool:
    """Whether the artifact's newest weights have the keys, shapes and dtypes of ``state`` (the same dense model)."""
    files = sorted(p for p in (target / WEIGHTS).iterdir() if WEIGHTS_FILE.fullmatch(p.name)) if (
        target / WEIGHTS).is_dir() else []  # fmt: skip
    if not files or not (target / PROGRAM).is_file():
        return False
    try:
        theirs = torch.load(files[-1], map_location="cpu", weights_only=True)
    except Exception:  # torch.load raises many types on a damaged file: not the same, written whole
        return False
    return state_fits(theirs, {f"model.{k}": v for k, v in state.items()})


def _prune_weights(target: Path) -> None:
    """Keep the newest ``KEEP_WEIGHTS`` weight files (only files named as export_model names them)."""
    files = sorted(p for p in (target / WEIGHTS).iterdir() if WEIGHTS_FILE.fullmatch(p.name))
    for p in files[:-KEEP_WEIGHTS]:
        p.unlink(missing_ok=True)


__all__ = [
    "ModelExport", "ModelParts", "Scorer", "check_target", "export_model", "latest_checkpoint", "state_fits",
    "torch_quiet",
]  # fmt: skip
