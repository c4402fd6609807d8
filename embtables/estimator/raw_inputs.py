"""Raw feature values (Python scalars and lists, ragged lists, NumPy arrays, pandas Series, PyArrow
arrays, torch tensors) as one flat NumPy array plus a length per sample, vectorised.

``flatten_values(x) -> (values [N], lengths [B])``: a 1-D column of scalars is one value per sample;
a 2-D array or a column of lists is a list per sample. Missing values (``None``, NaN, pandas NA, an
empty string, and -1 in an integer array, TF's ignore values) are dropped, shortening their sample.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch


def _is_scalar(x: object) -> bool:
    return isinstance(x, (int, float, str, bytes, np.generic)) or x is None


def _from_arrow(x: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """A pyarrow Array / ChunkedArray (list or scalar type), without importing pyarrow."""
    mod = type(x).__module__
    if not mod.startswith("pyarrow"):
        return None
    if hasattr(x, "combine_chunks"):
        x = x.combine_chunks()
    if hasattr(x, "offsets") and hasattr(x, "flatten"):  # a ListArray
        offsets = np.asarray(x.offsets, dtype=np.int64)
        values = x.flatten().to_numpy(zero_copy_only=False)
        return values, np.diff(offsets)
    values = x.to_numpy(zero_copy_only=False)
    return values, np.ones(len(values), dtype=np.int64)


def _missing_mask(values: np.ndarray) -> np.ndarray:
    """True where a value is missing (None, NaN, empty string; -1 for integer arrays)."""
    if values.dtype.kind in "iu":
        return np.asarray(values == -1) if values.dtype.kind == "i" else np.zeros(values.shape, dtype=bool)
    if values.dtype.kind == "f":
        return np.asarray(np.isnan(values))
    if values.dtype.kind in "US":
        return np.asarray(values == values.dtype.type())
    return np.asarray(_IS_MISSING(values), dtype=bool)


def is_missing(v: object) -> bool:
    """Whether one raw value is missing: None, an empty string or bytes, float NaN, pandas NA."""
    return v is None or v == "" or v == b"" or (isinstance(v, float) and v != v) or type(v).__name__ == "NAType"


_IS_MISSING = np.frompyfunc(is_missing, 1, 1)  # one C loop over an object array


_SINGLE: dict[int, np.ndarray] = {}  # B -> read-only int64 ones [B]: the lengths of B single-valued rows


def single_lengths(rows: int) -> np.ndarray:
    """The lengths [B] of B rows of one value each: one shared read-only array per B, so that
    ``is_single_lengths`` can tell them by identity (no pass over them)."""
    got = _SINGLE.get(rows)
    if got is None:
        if len(_SINGLE) > 64:
            _SINGLE.clear()
        got = _SINGLE[rows] = np.ones(rows, dtype=np.int64)
        got.flags.writeable = False
    return got


def is_single_lengths(lengths: np.ndarray) -> bool:
    """Whether ``lengths`` are ``single_lengths(len(lengths))`` (every row one value), by identity."""
    return _SINGLE.get(len(lengths)) is lengths


def flatten_values(x: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values [N], lengths [B])`` of one raw feature (see the module docstring); ``what`` names the
    feature in errors."""
    arrow = _from_arrow(x)
    if arrow is not None:
        values, lengths = arrow
    else:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().numpy()
        elif hasattr(x, "to_numpy") and not isinstance(x, np.ndarray):  # pandas Series / Index
            x = x.to_numpy()
        if _is_scalar(x):
            x = [x]
        if isinstance(x, np.ndarray) and x.dtype != object:
            if x.ndim == 1:
                values, lengths = x, single_lengths(len(x))
            elif x.ndim == 2:
                values, lengths = x.reshape(-1), np.full(x.shape[0], x.shape[1], dtype=np.int64)
            else:
                raise ValueError(f"feature {what!r}: expected 1-D or 2-D values, got shape {x.shape}.")
        else:
            seq = list(x) if not isinstance(x, list) else x
            kinds = {type(v) for v in seq}
            if all(_is_scalar(v) for v in seq):
                flat, lengths = seq, np.ones(len(seq), dtype=np.int64)
            elif kinds <= {list, tuple}:  # the common ragged case, without a per-row conversion
                lengths = np.fromiter(map(len, seq), dtype=np.int64, count=len(seq))
                flat = list(itertools.chain.from_iterable(seq))
            else:
                mapping = next((i for i, v in enumerate(seq) if isinstance(v, (dict, set, frozenset))), None)
                if mapping is not None:
                    raise ValueError(
                        f"feature {what!r}: row {mapping} holds {seq[mapping]!r:.40}; a row's value is a string or a "
                        "number, or a list of them."
                    )
                rows = [[v] if _is_scalar(v) else list(np.asarray(v, dtype=object).reshape(-1)) for v in seq]
                lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
                flat = [v for r in rows for v in r]
            values = np.empty(len(flat), dtype=object)  # missing values are found before any conversion
            values[:] = flat
    values = np.asarray(values)
    if values.dtype == object and len(values):
        natural = np.asarray(values.tolist())  # str / int / float when no None hides in the column
        # strings mixed with float NaN (a CSV's empty cells, as pandas reads them) come out as the string "nan":
        # such a column keeps its objects, so that the NaN is found missing below
        if natural.dtype != object and not (natural.dtype.kind == "U" and (natural == "nan").any()):
            values = natural
    missing = _missing_mask(values)
    if missing.any():
        sample = np.repeat(np.arange(len(lengths)), lengths)
        values = values[~missing]
        lengths = np.bincount(sample[~missing], minlength=len(lengths)).astype(np.int64)
    if values.dtype == object:  # a homogeneous column gets its natural dtype (int64, float64 or str)
        values = np.asarray(values.tolist()) if len(values) else np.zeros(0, dtype=np.int64)
        if values.dtype.kind == "i":
            values = values.astype(np.int64)
    return values, lengths.astype(np.int64, copy=False)
