"""How a serving export stores rows (``export``, its deltas and ``ServingEmbedding`` share it): the storage
types, the encoding of float32 rows into each (with its float32 decoding and int8's per-row scale and
bias), and the checked reading of an ``.npy`` file."""

from __future__ import annotations

import os
import tokenize
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embtables.kernels import storage_types

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": None, "int8": np.uint8}
MARKER = ".embtables-export"  # lists every file an export wrote: only such a directory is ever replaced
_LIMITS = {t.name: t.max_finite for t in storage_types.STORAGE_TYPES if t.half}  # finite beyond: served as Inf


def store_dtype(dtype: str) -> Any:
    """The numpy type a table of ``dtype`` is stored in (bfloat16: its bits as uint16)."""
    return np.uint16 if dtype == "bfloat16" else DTYPES[dtype]


def encode_rows(
    w: np.ndarray[Any, Any], dtype: str, table: str, rows: np.ndarray[Any, Any]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any] | None, np.ndarray[Any, Any]]:
    """Stored values, their float32 decoding, (int8) the per-row [scale, bias], and which values are
    finite. Refuses finite values that ``dtype`` cannot hold (they would be served as Inf or NaN)."""
    finite = np.isfinite(w)
    limit = _LIMITS.get(dtype)
    if limit is not None:
        over = finite & (np.abs(w) > limit)
        if over.any():
            r, c = np.argwhere(over)[0]
            raise ValueError(
                f"export: table {table!r}, row {int(rows[r])}: the value {float(w[r, c])!r} exceeds {dtype}'s "
                f"largest value {limit:.6g} and would be served as Inf; export as float32. Nothing was exported."
            )
    if dtype == "float32":
        return w, w, None, finite
    if dtype == "float16":
        h = w.astype(np.float16)
        return h, h.astype(np.float32), None, finite
    if dtype == "bfloat16":
        b = torch.from_numpy(np.array(w, dtype=np.float32)).to(torch.bfloat16)  # a writable copy
        return b.view(torch.int16).numpy().view(np.uint16), b.to(torch.float32).numpy(), None, finite
    lo, hi = w.min(axis=1, keepdims=True), w.max(axis=1, keepdims=True)  # [N, 1] each
    span = hi[:, 0].astype(np.float64) - lo[:, 0].astype(np.float64)  # [N]
    unfit = ~finite.all(axis=1) | (span > 0.99 * float(np.finfo(np.float32).max))  # [N]: q * scale stays finite
    if unfit.shape != (w.shape[0],):
        raise AssertionError(f"export: a per-row mask of shape {unfit.shape} for {w.shape[0]} rows")
    if unfit.any():
        r = int(np.flatnonzero(unfit)[0])
        raise ValueError(
            f"export: table {table!r}, row {int(rows[r])}: its values (from {float(lo[r, 0])!r} to "
            f"{float(hi[r, 0])!r}) cannot be quantised to int8 (not finite, or a range beyond float32); "
            "export as float32. Nothing was exported."
        )
    scale = ((hi - lo) / np.float32(255)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint((w - lo) / safe), 0, 255).astype(np.uint8)
    back = (q.astype(np.float32) * scale + lo).astype(np.float32)
    return q, back, np.concatenate([scale, lo], axis=1), finite


def int8_scales_problem(scales: np.ndarray[Any, Any]) -> str | None:
    """Why int8 per-row [scale, bias] ``scales`` [N, 2] (float32) cannot be served, or None: each must be finite,
    the scale >= 0, and the row's decoded values ``q * scale + bias`` (q in [0, 255]) finite in float32, as
    ``encode_rows`` writes them (a finite scale of 3e38 decodes past float32)."""
    with np.errstate(over="ignore", invalid="ignore"):
        scale, bias = scales[:, 0].astype(np.float32), scales[:, 1].astype(np.float32)
        top = np.float32(255) * scale + bias
        bad = ~(np.isfinite(scale) & np.isfinite(bias) & (scale >= 0) & np.isfinite(top))
    if not bad.any():
        return None
    r = int(np.flatnonzero(bad)[0])
    return (
        f"row {r}'s int8 scale {np.float32(scales[r, 0])!s} and bias {np.float32(scales[r, 1])!s} decode to values "
        "that are not finite float32 (an export never writes them: the file was changed after it)"
    )


def load_array(
    path: Path, dtype: Any, shape: tuple[int, int], mmap: bool, max_rows: int | None = None
) -> np.ndarray[Any, Any]:
    """A ``.npy`` file of exactly ``dtype`` and ``shape`` whose size matches its header (checked
    before a byte of data is read or any memory is allocated). ``shape[0] = -1``: any row count up to
    ``max_rows``."""
    fmt = np.lib.format
    with open(path, "rb") as f:
        version = fmt.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"{path.name}: .npy format version {version} is not one export writes")
        read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        try:  # numpy parses the header as a Python literal: a mangled one raises SyntaxError or TokenError
            got_shape, fortran, got_dtype = read_header(f)
        except (SyntaxError, tokenize.TokenError, TypeError, RecursionError) as exc:
            raise ValueError(f"{path.name}: its .npy header is not readable ({type(exc).__name__})") from None
        start, size = f.tell(), os.fstat(f.fileno()).st_size
    if shape[0] == -1 and len(got_shape) == 2 and 0 <= got_shape[0] <= (max_rows or 0):
        shape = (int(got_shape[0]), shape[1])
    if tuple(got_shape) != shape or np.dtype(got_dtype) != np.dtype(dtype) or fortran:
        wanted = shape if shape[0] != -1 else f"[at most {max_rows}, {shape[1]}]"
        raise ValueError(
            f"{path.name} holds {got_dtype} {tuple(got_shape)}, serving.json says {np.dtype(dtype)} {wanted}"
        )
    if size != start + shape[0] * shape[1] * np.dtype(dtype).itemsize:
        raise ValueError(
            f"{path.name} has {size} bytes, not the {start} + {shape[0]} x {shape[1]} values its header says"
        )
    return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)  # type: ignore[no-any-return]
