"""Float64 NumPy reference for docs/spec.md §1.5: float32 subnormals are flushed to zero.

Every float32 operand or result of magnitude below 2^-126 (the smallest normal float32) counts as a zero of
its sign, in every operation. The oracle computes in float64; ``Flushing`` arrays flush every ufunc's result
(and the results of NumPy functions such as ``np.where``), so a formula written on them flushes where a float32
computation with flush-to-zero would, operation by operation, in the order the formula is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SMALLEST_NORMAL = 2.0**-126


def flush(x: Any) -> Any:
    """``x`` (a float or an array) with every value of magnitude below ``SMALLEST_NORMAL`` replaced by a zero
    of its sign; arrays come back as new float64 arrays."""
    if isinstance(x, float | int | np.floating):
        x = float(x)
        return x * 0.0 if abs(x) < SMALLEST_NORMAL else x
    a = np.asarray(x, dtype=np.float64)
    return np.where(np.abs(a) < SMALLEST_NORMAL, a * 0.0, a)


def _plain(x: Any) -> Any:
    if isinstance(x, Flushing):
        return x.view(np.ndarray)
    if isinstance(x, float):
        return flush(x)
    if isinstance(x, list | tuple):
        return type(x)(_plain(v) for v in x)
    return x


def _wrapped(out: Any) -> Any:
    if isinstance(out, np.ndarray) and out.dtype.kind == "f":
        return flush(out).view(Flushing)
    if isinstance(out, np.floating):
        return flush(float(out))
    if isinstance(out, tuple):
        return tuple(_wrapped(v) for v in out)
    return out


class Flushing(np.ndarray):
    """A float64 array whose every arithmetic result is flushed (``flushing(a)`` makes one)."""

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        return _wrapped(getattr(ufunc, method)(*(_plain(x) for x in inputs), **kwargs))

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return _wrapped(func(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()}))


def flushing(x: Any) -> Flushing:
    """``x`` flushed, as a ``Flushing`` array."""
    return flush(np.asarray(x, dtype=np.float64)).view(Flushing)


def plain(x: Any) -> np.ndarray:
    """A ``Flushing`` array (or anything array-like) as a plain float64 array."""
    return np.asarray(x, dtype=np.float64).view(np.ndarray).copy()
