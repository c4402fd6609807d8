"""The jobs' models as artifacts: ``embtables export MODEL_DIR OUT --model`` and what ``predict`` / ``serve`` open.

A job that can be scored writes ``MODEL_DIR/scoring.json`` (its recipe: which job, and what it needs to rebuild
its dense model, feature columns and row transform, with the training rows' statistics); ``RECIPES`` maps the job
to the function that rebuilds its ``ModelParts``. The weights come from the checkpoint, the tables from its
serving export (``model_artifact.export_model``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from embtables.checkpoint.file_names import CheckpointError
from embtables.cli import user_data
from embtables.estimator.model_artifact import MARKER, MODEL_FILE, ModelExport, ModelParts, export_model
from embtables.estimator.scoring_model import ScoringModel, load_model

RECIPES: dict[str, Callable[[dict[str, Any], str], ModelParts]] = {"data": user_data.model_parts}
SCORING_FILE = user_data.SCORING_FILE


def is_artifact(path: Path) -> bool:
    return (path / MODEL_FILE).is_file() and (path / MARKER).is_file()


def recipe_of(path: Path) -> tuple[dict[str, Any], str]:
    """The recipe of a model directory (or of a checkpoint inside one) and its file's path."""
    for where in (path, path.parent):
        file = where / SCORING_FILE
        if file.is_file():
            try:
                doc = json.loads(file.read_text())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{file} is unreadable ({exc}); train again to rewrite it.") from None
            if not isinstance(doc, dict) or doc.get("job") not in RECIPES:
                raise CheckpointError(f"{file}: unknown job {doc.get('job') if isinstance(doc, dict) else None!r:.40}.")
            return doc, str(file)
    raise CheckpointError(
        f"{path} has no {SCORING_FILE}: only a model directory of `embtables train --data` (or a checkpoint in one) "
        "can be exported as a model here; an Estimator of your own exports with Estimator.export_model."
    )


def export_model_dir(path: str, out: str, dtype: str, incremental: bool) -> ModelExport:
    """The artifact of the model directory (or checkpoint) ``path``, written into ``out``."""
    recipe, where = recipe_of(Path(path))
    parts = RECIPES[recipe["job"]](recipe, where)
    return export_model(path, out, parts, dtype, incremental=incremental)


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


__all__ = ["RECIPES", "export_model_dir", "is_artifact", "opened_model", "recipe_of"]
