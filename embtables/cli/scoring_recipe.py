"""``MODEL_DIR/scoring.json``: what a job writes so that ``embtables export MODEL_DIR OUT --model`` can rebuild
its model for scoring (``model_files``): the job's name, the feature columns (``column_codec``), the row transform
with the training rows' statistics (``row_transform``), the task, the label, and the arguments of the job's
dense model (its weights come from the checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from embtables.checkpoint.file_names import CheckpointError
from embtables.checkpoint.owned_dirs import write_json_atomically
from embtables.estimator.column_codec import columns_from_json, columns_to_json
from embtables.estimator.model_artifact import TASKS
from embtables.estimator.row_transform import RowTransform

SCORING_FILE = "scoring.json"


def write_recipe(
    model_dir: Path,
    job: str,
    columns: list[Any],
    transform: RowTransform | None,
    task: str,
    label: str | None,
    model: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> None:
    """``model_dir/scoring.json`` (replaced atomically); ``model``: the dense model's constructor arguments;
    ``extra``: a spec of dicts' ``engine_features``, ``activation_shapes`` and ``tensor_sources`` (``ModelParts``)."""
    rows = None if transform is None else transform.to_json()
    doc = {
        "job": job,
        "columns": columns_to_json(columns) if columns else [],
        "transform": rows,
        "task": task,
        "label": label,
        "model": model,
        **(extra or {}),
    }
    write_json_atomically(model_dir / SCORING_FILE, doc)


def read_recipe(path: Path) -> tuple[dict[str, Any], str]:
    """The recipe of a model directory (or of a checkpoint inside one) and its file's path; ``CheckpointError``
    when there is none or it is unreadable."""
    for where in (path, path.parent):
        file = where / SCORING_FILE
        if file.is_file():
            try:
                doc = json.loads(file.read_text())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{file} is unreadable ({exc}); train again to rewrite it.") from None
            if (
                not isinstance(doc, dict)
                or not isinstance(doc.get("job"), str)
                or not isinstance(doc.get("model"), dict)
            ):
                raise CheckpointError(f"{file} is not a scoring recipe; train again with this embtables.")
            return doc, str(file)
    raise CheckpointError(
        f"{path} has no {SCORING_FILE}: a model directory of `embtables train` (any job; the synthetic one without "
        "--dynamic-user), or a checkpoint in one, exports as a model; an Estimator of your own exports with "
        "Estimator.export_model."
    )


def recipe_inputs(doc: dict[str, Any], where: str) -> tuple[list[Any], RowTransform | None, str, str | None]:
    """The columns, transform, task and label a recipe records, validated."""
    try:
        columns = [] if doc.get("columns") == [] else columns_from_json(doc.get("columns"), where)
        transform = None if doc.get("transform") is None else RowTransform.from_json(doc["transform"], where)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    task, label = doc.get("task"), doc.get("label")
    if task not in TASKS or (label is not None and not isinstance(label, str)):
        raise CheckpointError(f"{where}: the task must be one of {TASKS} and the label a column name.")
    return columns, transform, str(task), label


__all__ = ["SCORING_FILE", "read_recipe", "recipe_inputs", "write_recipe"]
