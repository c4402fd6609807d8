"""The jobs' models as artifacts: ``embtables export MODEL_DIR OUT --model`` and what ``predict`` opens.

A job that can be scored writes ``MODEL_DIR/scoring.json`` (``scoring_recipe``: the columns, the row transform
with the training rows' statistics, the task, the label, and its dense model's arguments); ``DENSE_MODELS`` maps
the job to the function that builds that dense model again. The weights come from the checkpoint, the tables
from its serving export (``model_artifact.export_model``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from embtables.checkpoint.file_names import CheckpointError
from embtables.cli import adult, dlrm, movielens, user_data
from embtables.cli.scoring_recipe import SCORING_FILE, read_recipe, recipe_inputs
from embtables.estimator.model_artifact import MARKER, MODEL_FILE, ModelExport, ModelParts, export_model
from embtables.estimator.scoring_model import ScoringModel, load_model

DenseModel = Callable[[dict[str, Any], str], tuple[nn.Module, Any, dict[str, Tensor]]]
DENSE_MODELS: dict[str, DenseModel] = {
    "data": user_data.scoring_model,
    "adult": adult.scoring_model,
    "movielens-100k": movielens.scoring_model,
    "synthetic": dlrm.scoring_model,
}


def is_artifact(path: Path) -> bool:
    return (path / MODEL_FILE).is_file() and (path / MARKER).is_file()


def model_root(path: Path) -> Path:
    """Where a job's checkpoints and recipe are: ``path``, or its one sub-directory with a recipe (the Adult job's
    ``MODEL_DIR/model``); ``CheckpointError`` naming the choices when there are several (MovieLens' folds)."""
    if (path / SCORING_FILE).is_file() or (path.parent / SCORING_FILE).is_file() or not path.is_dir():
        return path
    found = sorted(p for p in path.iterdir() if (p / SCORING_FILE).is_file())
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise CheckpointError(f"{path} holds {len(found)} models ({', '.join(p.name for p in found)}); give one of "
                              f"them, e.g. {found[0]}.")  # fmt: skip
    return path


def parts_of(path: Path) -> ModelParts:
    """The model of a model directory (or of a checkpoint in one) rebuilt from its recipe, without weights."""
    doc, where = read_recipe(path)
    columns, transform, task, label = recipe_inputs(doc, where)
    build = DENSE_MODELS.get(doc["job"])
    if build is None:
        raise CheckpointError(f"{where}: unknown job {doc['job']!r:.40}; it can be exported by the embtables that "
                              "trained it.")  # fmt: skip
    try:
        model, predictions_fn, example = build(doc["model"], task)
        engine, sources, shapes = (
            doc.get("engine_features", []),
            doc.get("tensor_sources"),
            doc.get("activation_shapes"),
        )
        if not columns and not (isinstance(engine, list) and engine and all(isinstance(n, str) for n in engine)):
            raise TypeError("no feature columns and no engine features")
        if sources is not None and not (isinstance(sources, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in sources.items())):  # fmt: skip
            raise TypeError("tensor_sources must map names to names")
        if shapes is not None:
            if not isinstance(shapes, dict) or not all(
                isinstance(v, list) and v and all(type(d) is int and d > 0 for d in v) for v in shapes.values()
            ):
                raise TypeError("activation_shapes must map features to lists of positive ints")  # fmt: skip
            shapes = {str(k): tuple(v) for k, v in shapes.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: the dense model's arguments are malformed ({exc}).") from None
    return ModelParts(model, columns, transform, predictions_fn, task, label, example, tuple(engine), sources, shapes)


def export_model_dir(path: str, out: str, dtype: str, incremental: bool) -> ModelExport:
    """The artifact of the model directory (or checkpoint) ``path``, written into ``out``."""
    root = model_root(Path(path))
    return export_model(root, out, parts_of(root), dtype, incremental=incremental)


@contextmanager
def opened_model(path: str) -> Iterator[ScoringModel]:
    """An artifact as a ``ScoringModel``; a model directory is exported into a temporary artifact first."""
    where = Path(path)
    if is_artifact(where):
        yield load_model(where)
        return
    if not where.exists():
        raise FileNotFoundError(f"{where}: no such model directory or artifact")
    tmp = Path(tempfile.mkdtemp(prefix="embtables-model-"))
    try:
        export_model_dir(path, str(tmp / "model"), "float32", False)
        yield load_model(tmp / "model")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["DENSE_MODELS", "export_model_dir", "is_artifact", "opened_model", "parts_of"]
