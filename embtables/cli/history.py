"""A model directory's history across runs, for the jobs' curves and summaries: a rerun that resumes
(or finds the run finished) reports every step trained so far, not only its own."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any


def metrics_rows(path: Path, upto_step: int) -> list[dict[str, float]]:
    """The rows of an Estimator's ``train_metrics.csv`` / ``eval_metrics.csv`` up to ``upto_step``, one
    per step (a step logged again after a resume keeps its latest row), by step. Rows that are not
    numbers (a file edited by hand, a cut line) are skipped."""
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, float]] = {}
    try:
        with path.open(newline="") as f:
            for raw in csv.DictReader(f):
                try:
                    row = {str(k): float(v) for k, v in raw.items() if k is not None and v is not None}
                except ValueError:
                    continue
                step = row.get("step")
                if step is not None and math.isfinite(step) and 0 <= step <= upto_step:
                    by_step[int(step)] = row
    except (OSError, UnicodeDecodeError, csv.Error):
        return []
    return [by_step[s] for s in sorted(by_step)]


def earlier_runs(summary: Path) -> list[dict[str, Any]]:
    """The ``runs`` recorded in an earlier ``summary.json`` of the model directory ([] when there is none
    or it cannot be read)."""
    try:
        runs = json.loads(summary.read_text()).get("runs", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []


def epoch_curve(model_dir: Path, step: int, steps_per_epoch: int, keys: tuple[str, ...]) -> list[dict[str, float]]:
    """The held-out metrics ``keys`` of every evaluation in ``model_dir``'s ``eval_metrics.csv`` up to
    ``step``, by epoch (``{"epoch": e, key: value, ...}``; an epoch is ``steps_per_epoch`` steps)."""
    return [
        {"epoch": round(row["step"] / max(1, steps_per_epoch)), **{k: row[k] for k in keys}}
        for row in metrics_rows(model_dir / "eval_metrics.csv", step)
        if all(k in row for k in keys)
    ]
