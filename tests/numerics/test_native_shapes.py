"""The native lookups and phase 1 check the shapes they are handed in the call that reads through them
(``et_shapes_ok``, ``et_offsets_ok``, ``et_prepare_many``'s feature ranges): a negative count of features or
bags, a negative vocabulary (which would let every id through the range test), a negative width, or output and
gradient rows closer together than a row's width (rows that overlap, or start before the buffer). Each such call
returns its out-of-range status and writes nothing; the same call with a shape that fits succeeds, so each case
fails if its check is removed. The Python wrappers never pass such shapes: these calls go to C directly, the
refused ones in a child process (without its check, such a call reads or writes outside its buffers)."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from subproc import run_python

from embtables.kernels import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the native library (a C compiler)")

V, D = 10, 4
_VP, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


def _arr(kind: Any, values: list[Any]) -> Any:
    return (kind * len(values))(*values)


def _lookup(half: bool, *, F: int = 1, ld: int = D, vocab: int = V, dim: int = D, bags: int = 1) -> tuple[int, Any]:
    """One feature, one bag of id 5 (inside the table whatever vocab says), into a [1, 8] output of 7.0:
    the status and the output afterwards."""
    table = torch.arange(V * D, dtype=torch.float32).reshape(V, D) / 8
    if half:
        table = table.to(torch.bfloat16)
    ids = torch.tensor([5], dtype=torch.int64)
    offsets = torch.tensor([0, 1], dtype=torch.int64)
    out = torch.full((1, 2 * D), 7.0)
    lib = native.library()
    assert lib is not None
    common = (
        _arr(_I64, [dim]), _arr(_I64, [vocab]), _arr(_VP, [ids.data_ptr()]), _arr(_I64, [1]),
        _arr(_VP, [offsets.data_ptr()]), _arr(_I64, [bags]), _arr(_VP, [None]), _arr(_VP, [out.data_ptr()]),
        _arr(_I64, [ld]), 1,
    )  # fmt: skip
    if half:
        status = lib.et_lookup_half_many(F, _arr(_VP, [table.data_ptr()]), _arr(_I32, [0]), *common)
    else:
        status = lib.et_lookup_many(F, _arr(_VP, [table.data_ptr()]), *common)
    return int(status), (out, table)


@pytest.mark.parametrize("half", [False, True], ids=["float32", "bfloat16"])
def test_a_lookup_that_fits_reads_its_row(half: bool) -> None:
    status, (out, table) = _lookup(half)
    assert status == 0
    assert torch.equal(out[0, :D], table[5].float())
    assert torch.equal(out[0, D:], torch.full((D,), 7.0))


def _prepare(*, first: list[int] | None = None, ld: int = D, vocab: int = V) -> tuple[int, int]:
    """Phase 1 of one table, one feature, one bag of id 5 with gradient row ones: (status, unique rows)."""
    ids = torch.tensor([5], dtype=torch.int64)
    offsets = torch.tensor([0, 1], dtype=torch.int64)
    grad = torch.ones(1, 2 * D)
    ws = native.Workspace(D)
    lib = native.library()
    assert lib is not None
    statuses = (_I32 * 1)()
    lib.et_prepare_many(
        1, _arr(_I64, first if first is not None else [0, 1]), _arr(_VP, [ids.data_ptr()]), _arr(_I64, [1]),
        _arr(_VP, [offsets.data_ptr()]), _arr(_I64, [1]), _arr(_VP, [None]), _arr(_VP, [grad.data_ptr()]),
        _arr(_I64, [ld]), _arr(_I64, [D]), _arr(_I64, [vocab]), 1, _arr(_VP, [ws.handle]), statuses,
    )  # fmt: skip
    return int(statuses[0]), ws.num_rows


def test_phase_one_that_fits_prepares_its_row() -> None:
    assert _prepare() == (0, 1)
    assert _prepare(ld=2 * D) == (0, 1)  # a column block of a wider gradient


LOOKUP_REFUSALS = {
    "ld-below-width": {"ld": D - 1},  # the next row would overlap this one
    "negative-ld": {"ld": -D},  # rows before the buffer
    "negative-vocab": {"vocab": -1},  # every id would pass (uint64) id < V
    "negative-width": {"dim": -1},
    "negative-features": {"F": -1},
    "negative-bags": {"bags": -1},  # offsets[-1] would be read
}
PREPARE_REFUSALS = {
    "ld-below-width": {"ld": D - 1},
    "negative-ld": {"ld": -D},
    "negative-vocab": {"vocab": -1},
    "features-before-the-arrays": {"first": [-1, 0]},
    "features-decreasing": {"first": [1, 0]},
}


def refusals() -> dict[str, Any]:
    """Every refused call's outcome: (status, whether the output kept its 7.0s) for the lookups, (status,
    unique rows) for phase 1."""
    out: dict[str, Any] = {}
    for half in (False, True):
        for name, shape in LOOKUP_REFUSALS.items():
            status, (got, _) = _lookup(half, **shape)
            out[f"lookup-{'bfloat16' if half else 'float32'}-{name}"] = [status, bool((got == 7.0).all())]
    for name, shape in PREPARE_REFUSALS.items():
        out[f"prepare-{name}"] = list(_prepare(**shape))
    return out


def test_the_calls_refuse_shapes_that_do_not_fit_and_write_nothing() -> None:
    child = f"""
        import importlib.util, json
        spec = importlib.util.spec_from_file_location("shapes", {str(Path(__file__))!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        print(json.dumps(mod.refusals()))
    """
    got = json.loads(run_python(child).strip().splitlines()[-1])
    expected = {f"lookup-{kind}-{name}": [1, True] for kind in ("float32", "bfloat16") for name in LOOKUP_REFUSALS}
    expected.update({f"prepare-{name}": [3, 0] for name in PREPARE_REFUSALS})
    assert got == expected
