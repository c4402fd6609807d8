"""The C interface declared once (``kernels/native_abi.py``) against the C source: every exported function's
argument names, types and result as the prototypes in ``csrc/*.c`` spell them, and every status decoding."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import pytest

from embtables.kernels import native, native_abi, native_library

CSRC = Path(native.__file__).parent / "csrc"
_PROTOTYPE = re.compile(r"^(?!static)([A-Za-z_][\w ]*?\**)\s*\b(et_\w+)\(([^)]*)\)\s*\{", re.MULTILINE)


def c_type(decl: str) -> Any:
    """The ctypes type a C parameter or result declaration is bound with."""
    decl = decl.strip()
    if "*" in decl:
        return ctypes.c_void_p
    base = decl.replace("const ", "").split()[0]
    return {
        "int64_t": ctypes.c_int64,
        "int": ctypes.c_int32,
        "int32_t": ctypes.c_int32,
        "uint32_t": ctypes.c_uint32,
        "double": ctypes.c_double,
        "float": ctypes.c_float,
        "void": None,
    }[base]


def prototypes() -> dict[str, tuple[Any, list[tuple[str, Any]]]]:
    """Every exported ``et_*`` function of the C sources: its result type and (name, type) parameters."""
    out = {}
    header = (CSRC / "embtables_native.h").read_text()  # functions the sources share, hidden from the library
    hidden = set(re.findall(r'visibility\("hidden"\)\)\)[^;(]*?\b(et_\w+)\(', header))
    assert {"et_row_function", "et_reserve", "et_touched_bounds_of"} <= hidden  # the parser works
    for path in sorted(CSRC.glob("*.c")):
        text = re.sub(r"/\*.*?\*/|//[^\n]*|^#[^\n]*", " ", path.read_text(), flags=re.DOTALL | re.MULTILINE)
        text = re.sub(r"\s+", " ", text)
        for m in re.finditer(r"\b(et_\w+) ?\(([^()]*)\) ?\{", text):
            name, params = m.group(1), m.group(2).strip()
            result = re.split(r"[;{}]", text[: m.start()])[-1].strip()
            if "static" in result.split() or name in hidden:
                continue  # not exported
            args = []
            if params and params != "void":
                for param in params.split(","):
                    pname = re.findall(r"\w+", param)[-1]
                    args.append((pname, c_type(param[: param.rindex(pname)])))
            out[name] = (c_type(result + ("*" if "*" in result else "")), args)
    return out


def test_every_declaration_matches_its_c_prototype() -> None:
    found = prototypes()
    assert "et_apply_many" in found and "et_km_train" in found and "et_shm_wait" in found  # the parser works
    for name, decl in native_abi.FUNCTIONS.items():
        assert name in found, f"{name} is declared but not exported by csrc/"
        result, args = found[name]
        assert [a for a, _ in decl.args] == [a for a, _ in args], name
        assert [t for _, t in decl.args] == [t for _, t in args], name
        assert decl.result == result, name


def test_every_exported_function_that_python_calls_is_declared() -> None:
    package = Path(native.__file__).parent.parent
    called = set()
    for path in package.rglob("*.py"):
        called |= set(re.findall(r"\.(et_\w+)\(", path.read_text()))
    assert called, "no C call found: the scan is broken"
    assert called <= set(native_abi.FUNCTIONS), sorted(called - set(native_abi.FUNCTIONS))


def test_the_bound_library_carries_the_declared_types() -> None:
    lib = native_library.library()
    if lib is None:
        pytest.skip("the native kernels are not built here")
    for name, decl in native_abi.FUNCTIONS.items():
        fn = getattr(lib, name)
        assert list(fn.argtypes) == [t for _, t in decl.args] and fn.restype == decl.result, name
    fast = native_abi.unchecked(lib)
    assert fast is native_abi.unchecked(lib)  # bound once per library
    assert fast.et_apply_many.argtypes is None and fast.et_lookup_many.restype is ctypes.c_int32


@pytest.mark.parametrize(
    "function, code, meaning",
    [
        ("et_lookup_many", 1, "out_of_range"),
        ("et_prepare_many", 2, "out_of_memory"),
        ("et_apply_many", -4, "unknown_kind"),
        ("et_check", -1, "ok"),
        ("et_check", 17, "count"),
        ("et_km_train", 5, "count"),
        ("et_km_train", -1, "step_back"),
        ("et_prepare_many", 9, "unknown"),
    ],
)
def test_statuses_decode_once(function: str, code: int, meaning: str) -> None:
    assert native_abi.decode(function, code) == meaning


def test_raise_for_raises_only_what_callers_do_not_explain() -> None:
    native_abi.raise_for("et_apply_many", [0, 1, 0])  # written, and not finite: the caller's to explain
    native_abi.raise_for("et_check", 12)  # a row
    with pytest.raises(MemoryError, match="table 't': out of memory"):
        native_abi.raise_for("et_apply_many", [0, -3], "table 't'")
    with pytest.raises(native.NativeBufferError, match="does not fit"):
        native_abi.raise_for("et_touched_bounds", -2)
    with pytest.raises(native.NativeBufferError, match="status 7"):
        native_abi.raise_for("et_lookup_many", 7)
    with pytest.raises(native.NativeBufferError, match=r"unknown optimizer kind \(optimizer kind 99\)"):
        native_abi.raise_for("et_check", -4, "optimizer kind 99")
