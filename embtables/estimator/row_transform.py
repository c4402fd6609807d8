"""Raw table rows -> the features a model was trained on: the one transform that both ``embtables train --data``
and a model artifact (``model_artifact``, ``embtables predict`` / ``serve``) run, so a row scores exactly as it
trained.

``RowTransform.apply(columns)`` takes the columns of N rows (``{name: array [N]}``, as ``read_table`` or a pandas
DataFrame gives them) and returns the features dict the feature columns and the dense model read:

- a multi-valued column (``separators``: ``"a|b|c"``, or a list of values, or one value, a number too) becomes a list
  of strings per row (an empty or missing cell: no value);
- a column read as numbers (``numbers``: a bucketized column's source) becomes float32 (NaN where empty);
- an integer column cut into buckets (``buckets``: ``clip((x - offset) // width, low, high)``, int64);
- a string column cut to its first characters (``prefixes``: ``(column, n)``);
- a column of names (``positions``: ``(column, names, separator)``; a cell is a list of names, or one string of
  them joined by the separator) becomes the list of each name's position in ``names`` per row;
- a column of integer ids (``id_lists``: ``(column, separator)``; a cell is one id, a list of ids, or a string of
  them joined by the separator; empty or missing: none) becomes a ``Ragged`` [N, (ids)] (the engine's input of a
  feature of that name) and its lengths [N] int64 under ``column + "#lengths"``;
- the numeric features (``numeric``) become one float32 tensor [N, len(numeric)] under ``numeric_key``: each
  column as float64, ``log1p`` first for ``"log"``, then ``(x - mean) / std`` with the training rows' statistics
  (``"standard"`` and ``"log"``; ``"none"`` as it is), a missing value at 0 (the mean);
- every other column is passed as it is.

Errors are ``InputError`` (a ``ValueError``) naming the column, the rule and the value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from embtables.errors import InputError
from embtables.estimator.raw_inputs import is_missing
from embtables.tables.ragged import Ragged

NORMALIZE = ("standard", "log", "none")


@dataclasses.dataclass(frozen=True)
class NumericStat:
    """One numeric feature: its column, how it is normalised, and the training rows' mean and std (after log1p
    for ``"log"``; 0 and 1 for ``"none"``)."""

    column: str
    normalize: str
    mean: float = 0.0
    std: float = 1.0

    def __post_init__(self) -> None:
        if self.normalize not in NORMALIZE:
            raise InputError(f"numeric feature {self.column!r}: `normalize` must be one of {NORMALIZE}, got "
                             f"{self.normalize!r}.")  # fmt: skip
        for name in ("mean", "std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InputError(f"numeric feature {self.column!r}: `{name}` must be a finite number, got {value!r}.")
        if self.std <= 0:
            raise InputError(f"numeric feature {self.column!r}: `std` must be > 0, got {self.std!r}.")


def _floats(column: np.ndarray, what: str, where: str, fix: str) -> np.ndarray:
    """``column`` as float32 [N] (NaN where empty), or ``InputError`` naming ``what`` and the ``fix``."""
    try:
        return np.asarray(column, dtype=np.float32)
    except (TypeError, ValueError):
        raise InputError(f"the {what} of {where} is not numeric (e.g. {column[0]!r}); {fix}") from None


def numeric_values(column: np.ndarray, name: str, where: str) -> np.ndarray:
    """A numeric feature's column as float32 [N] (NaN where empty), or ``InputError``."""
    x = _floats(column, f"numeric feature {name!r}", where, "give it another type")
    if np.isinf(x).any():
        raise InputError(f"the numeric feature {name!r} of {where} has infinite values")
    return x


def labels_of(column: np.ndarray, name: str, where: str) -> np.ndarray:
    """The label column as float32, or ``InputError`` when it is not numbers or holds NaN."""
    y = _floats(column, f"label column {name!r}", where, "encode it as numbers")
    if not np.isfinite(y).all():
        raise InputError(f"the label column {name!r} of {where} has {int((~np.isfinite(y)).sum())} empty or NaN values")
    return y


def _before_statistics(column: np.ndarray, name: str, how: str, where: str) -> np.ndarray:
    """The float64 values [N] the statistics are taken of (log1p for ``"log"``)."""
    x = numeric_values(column, name, where).astype(np.float64)
    if how == "log":
        if (x[np.isfinite(x)] < 0).any():
            raise InputError(f"the numeric feature {name!r} of {where} has negative values: `normalize: log` needs "
                             "values >= 0 (use \"standard\")")  # fmt: skip
        x = np.log1p(x)
    return x


def fit_numeric(
    columns: Mapping[str, np.ndarray], numeric: Mapping[str, str], train_rows: np.ndarray, where: str
) -> tuple[NumericStat, ...]:
    """The statistics of each numeric feature ``{column: normalize}`` over the rows ``train_rows`` [n]."""
    out = []
    for name, how in numeric.items():
        if how not in NORMALIZE:
            raise InputError(f"numeric feature {name!r}: `normalize` must be one of {NORMALIZE}, got {how!r}.")
        if how == "none":
            out.append(NumericStat(name, how))
            continue
        x = _before_statistics(columns[name], name, how, where)
        seen = x[train_rows][np.isfinite(x[train_rows])]
        mean = float(seen.mean()) if seen.size else 0.0
        std = float(seen.std()) if seen.size else 1.0
        out.append(NumericStat(name, how, mean, std if std > 0 else 1.0))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class IntBucket:
    """``clip((x - offset) // width, low, high)`` of an integer column (e.g. an age in years -> its decade)."""

    column: str
    offset: int
    width: int
    low: int
    high: int

    def __post_init__(self) -> None:
        values = (self.offset, self.width, self.low, self.high)
        if not all(type(v) is int for v in values) or self.width < 1 or self.low > self.high:
            raise InputError(f"bucket of column {self.column!r}: offset, width >= 1, low <= high must be integers, got "
                             f"{values}.")  # fmt: skip

    def apply(self, column: np.ndarray, where: str) -> np.ndarray:
        x = np.asarray(column)
        if x.dtype.kind == "f" and np.isfinite(x).all() and (np.floor(x) == x).all():
            x = x.astype(np.int64)
        if x.dtype.kind not in "iu":
            raise InputError(f"the column {self.column!r} of {where} must hold integers (it is cut into buckets), got "
                             f"{x.dtype} values such as {x[:3].tolist()!r}")  # fmt: skip
        return np.clip((x.astype(np.int64) - self.offset) // self.width, self.low, self.high)


def _positions(column: np.ndarray, names: tuple[str, ...], separator: str, name: str, where: str) -> np.ndarray:
    """Each row's names as their positions in ``names``: an object array of lists [N]."""
    index = {n: i for i, n in enumerate(names)}
    out = np.empty(len(column), dtype=object)
    for row, cell in enumerate(column):
        cell = cell.tolist() if isinstance(cell, np.ndarray) else cell
        got = [] if is_missing(cell) else (
            cell.split(separator) if isinstance(cell, str) else list(cell))  # fmt: skip
        try:
            out[row] = [index[g] for g in got]
        except (KeyError, TypeError):
            unknown = next(g for g in got if not isinstance(g, str) or g not in index)
            raise InputError(f"the column {name!r} of {where}: row {row} names {unknown!r}, not one of the model's "
                             f"{len(names)} names ({', '.join(names[:5])}, ...)") from None  # fmt: skip
    return out


def _as_text(value: Any) -> str:
    """One value of a multi-valued cell as the text a CSV cell holds: a string as it is, an integer (or a float
    with an integer value: a column of integers with missing cells reads as floats) in decimal, another float or
    a bool as ``str`` writes it; ``TypeError`` for anything else (a dict, a nested list)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return str(int(value)) if math.isfinite(value) and value == int(value) else str(float(value))
    raise TypeError(f"{value!r}")


def _value_lists(column: Any, separator: str, name: str, where: str) -> np.ndarray:
    """Each row's values of a multi-valued column as a list of strings: an object array of lists [N]. A cell is a
    ``separator``-joined string, a list of values, or one value (a number too: a column whose cells all hold one
    number reads as numbers); empty or missing: no value. Strings, the common cells, take the short way."""
    lists: list[list[str]] = []
    for row, cell in enumerate(column):
        if type(cell) is str:
            lists.append(cell.split(separator) if cell else [])
            continue
        cell = cell.tolist() if isinstance(cell, np.ndarray) else cell
        try:
            if is_missing(cell):
                lists.append([])
            elif isinstance(cell, str):
                lists.append(cell.split(separator))
            elif isinstance(cell, (list, tuple)):
                lists.append([_as_text(v) for v in cell if not is_missing(v)])
            else:
                lists.append([_as_text(cell)])
        except TypeError as exc:
            raise InputError(
                f"the column {name!r} of {where}: row {row} holds {str(exc)[:60]}; a cell of a multi-valued column is "
                f"a {separator!r}-joined string, a list of strings or numbers, or one of them."
            ) from None
    return np.fromiter(lists, dtype=object, count=len(lists))


def _id_lists(column: Any, separator: str, name: str, where: str) -> tuple[Ragged, torch.Tensor]:
    """Each row's integer ids as a ``Ragged`` and their lengths [N]."""
    rows: list[list[int]] = []
    try:
        for cell in column:
            cell = cell.tolist() if isinstance(cell, np.ndarray) else cell
            if is_missing(cell):
                rows.append([])
            elif isinstance(cell, str):
                rows.append([int(v) for v in cell.split(separator)])
            elif isinstance(cell, (list, tuple)):
                rows.append([int(v) for v in cell])
            elif isinstance(cell, (int, np.integer)) or (isinstance(cell, float) and cell == int(cell)):
                rows.append([int(cell)])
            else:
                raise ValueError(f"{cell!r}")
    except (TypeError, ValueError) as exc:
        raise InputError(f"the column {name!r} of {where} must hold integer ids (one, a list, or a "
                         f"{separator!r}-joined string a row), got {str(exc)[:60]}") from None  # fmt: skip
    ragged = Ragged.from_lists(rows)
    return ragged, ragged.lengths()


@dataclasses.dataclass(frozen=True)
class RowTransform:
    """Raw columns -> model features (see the module's docstring)."""

    separators: tuple[tuple[str, str], ...] = ()
    numbers: tuple[str, ...] = ()
    numeric: tuple[NumericStat, ...] = ()
    numeric_key: str = "numeric"
    passed: tuple[str, ...] = ()  # the columns given to the model as they are
    buckets: tuple[IntBucket, ...] = ()
    prefixes: tuple[tuple[str, int], ...] = ()
    positions: tuple[tuple[str, tuple[str, ...], str], ...] = ()
    id_lists: tuple[tuple[str, str], ...] = ()

    @property
    def columns(self) -> tuple[str, ...]:
        """Every raw column the transform reads."""
        return (
            *self.passed, *(c for c, _ in self.separators), *self.numbers, *(s.column for s in self.numeric),
            *(b.column for b in self.buckets), *(c for c, _ in self.prefixes), *(c for c, _, _ in self.positions),
            *(c for c, _ in self.id_lists),
        )  # fmt: skip

    def apply(self, columns: Mapping[str, Any], where: str = "the input") -> dict[str, Any]:
        """The features of the N rows of ``columns`` (``{name: array [N]}``); ``InputError`` names a missing or
        malformed column."""
        missing = [c for c in self.columns if c not in columns]
        if missing:
            raise InputError(f"{where} has no column {missing[0]!r} (the model reads {sorted(set(self.columns))}).")
        n = {len(columns[c]) for c in self.columns}
        if len(n) > 1:
            raise InputError(f"{where}: the columns have different lengths {sorted(n)}; give one value per row each.")
        rows = n.pop() if n else 0
        features: dict[str, Any] = {c: np.asarray(columns[c]) for c in self.passed}
        for name, sep in self.separators:
            cells = columns[name]
            cells = cells if isinstance(cells, (list, tuple)) else np.asarray(cells, dtype=object)
            features[name] = _value_lists(cells, sep, name, where)
        for name in self.numbers:
            features[name] = numeric_values(np.asarray(columns[name]), name, where)
        for b in self.buckets:
            features[b.column] = b.apply(columns[b.column], where)
        for name, width in self.prefixes:
            features[name] = np.array([v[:width] if isinstance(v, str) else v for v in np.asarray(columns[name])],
                                      dtype=object)  # fmt: skip
        for name, names, separator in self.positions:
            features[name] = _positions(np.asarray(columns[name], dtype=object), names, separator, name, where)
        for name, separator in self.id_lists:
            cells = columns[name]
            cells = cells if isinstance(cells, (list, tuple)) else np.asarray(cells, dtype=object)
            features[name], features[f"{name}#lengths"] = _id_lists(cells, separator, name, where)
        cols = []
        for s in self.numeric:
            x = _before_statistics(np.asarray(columns[s.column]), s.column, s.normalize, where)
            if s.normalize != "none":
                x = (x - s.mean) / s.std
            cols.append(np.where(np.isfinite(x), x, 0.0))
        if self.numeric:
            features[self.numeric_key] = torch.from_numpy(np.stack(cols, 1).astype(np.float32))
        elif self.numeric_key:
            features[self.numeric_key] = torch.zeros((rows, 0), dtype=torch.float32)
        return features

    def to_json(self) -> dict[str, Any]:
        return {
            "separators": [list(p) for p in self.separators], "numbers": list(self.numbers),
            "numeric": [dataclasses.asdict(s) for s in self.numeric], "numeric_key": self.numeric_key,
            "passed": list(self.passed), "buckets": [dataclasses.asdict(b) for b in self.buckets],
            "prefixes": [list(p) for p in self.prefixes], "positions": [[c, list(n), s] for c, n, s in self.positions],
            "id_lists": [list(p) for p in self.id_lists],
        }  # fmt: skip

    @classmethod
    def from_json(cls, doc: Any, where: str) -> RowTransform:
        """What ``to_json`` wrote; ``ValueError`` naming ``where`` when it is malformed."""
        try:
            if not isinstance(doc, dict):
                raise TypeError(f"an object, got {type(doc).__name__}")

            def strings(value: Any, what: str) -> tuple[str, ...]:
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise TypeError(f"`{what}` must be a list of strings")
                return tuple(value)

            pairs = doc["separators"]
            if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                raise TypeError("`separators` must be a list of [column, separator] pairs")
            separators = tuple((p[0], p[1]) for p in pairs)
            for c, s in separators:
                if not isinstance(c, str) or not isinstance(s, str) or not s:
                    raise TypeError("a separator entry must be [column, non-empty string]")
            stats = doc["numeric"]
            if not isinstance(stats, list) or not all(isinstance(s, dict) for s in stats):
                raise TypeError("`numeric` must be a list of objects")
            numeric = tuple(NumericStat(s["column"], s["normalize"], s["mean"], s["std"]) for s in stats)
            key = doc["numeric_key"]
            if not isinstance(key, str):
                raise TypeError("`numeric_key` must be a string")
            buckets = doc.get("buckets", [])
            if not isinstance(buckets, list) or not all(isinstance(b, dict) for b in buckets):
                raise TypeError("`buckets` must be a list of objects")
            cuts = tuple(IntBucket(b["column"], b["offset"], b["width"], b["low"], b["high"]) for b in buckets)
            prefixes = doc.get("prefixes", [])
            if not isinstance(prefixes, list) or not all(
                    isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is int and p[1] > 0
                    for p in prefixes):  # fmt: skip
                raise TypeError("`prefixes` must be a list of [column, length >= 1] pairs")
            positions = doc.get("positions", [])
            if not isinstance(positions, list) or not all(
                    isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and isinstance(p[2], str) and p[2]
                    for p in positions):  # fmt: skip
                raise TypeError("`positions` must be a list of [column, names, separator] entries")
            named = tuple((p[0], strings(p[1], "positions' names"), p[2]) for p in positions)
            lists = doc.get("id_lists", [])
            if not isinstance(lists, list) or not all(
                    isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], str) and p[1]
                    for p in lists):  # fmt: skip
                raise TypeError("`id_lists` must be a list of [column, separator] pairs")
            return cls(
                separators, strings(doc["numbers"], "numbers"), numeric, key, strings(doc["passed"], "passed"), cuts,
                tuple((p[0], p[1]) for p in prefixes), named, tuple((p[0], p[1]) for p in lists),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: the row transform is malformed ({type(exc).__name__}: {exc}).") from None


__all__ = ["NORMALIZE", "IntBucket", "NumericStat", "RowTransform", "fit_numeric", "labels_of", "numeric_values"]
