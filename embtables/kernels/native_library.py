"""Building and loading the native CPU kernels (``csrc/*.c``): compiled on first use, bound with ctypes.

The C files are compiled once per machine with the system C compiler (``$CC``, else ``cc``/``gcc``)
into ``$EMBTABLES_CACHE_DIR`` (default ``~/.cache/embtables``), keyed by the source, the flags and
the CPU, and loaded with ctypes: no build step at install time, no torch headers, about a second
to compile. Every function is typed from its declaration in ``kernels/native_abi.py``. The library
binds to the OpenMP runtime torch already loaded, so both share one thread pool.

``EMBTABLES_NATIVE=0`` disables it; so does a missing compiler, which is logged once (never a
silent fallback). ``kernels/native.py`` holds the checked wrappers every caller goes through.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from embtables.kernels import native_abi
from embtables.kernels.registry import RECORDS

logger = logging.getLogger("embtables")

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "embtables_native.c",
        "lookups.c",
        "optimizer_rows.c",
        "float32_updates.c",
        "finite_bounds.c",
        "half_tables.c",
        "key_map.c",
        "shm_sync.c",
        "offload_io.c",
        "residency.c",
        "checksums.c",
    )
]
_HEADERS = [Path(__file__).parent / "csrc" / "embtables_native.h"]
# The sources as they are when this module is imported, with the argument declarations imported beside them
# (``native_abi``): the library is built from these bytes, so a source edited on disk later (an editable install)
# can never be compiled against the declarations of an older one, which would pass arguments C does not expect.
_TEXT = {path.name: path.read_bytes() for path in (*_SOURCES, *_HEADERS)}
_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_enabled = os.environ.get("EMBTABLES_NATIVE", "1") != "0"
_switches = 0  # switches of the native or GPU kernels: a backend chosen before a switch is chosen again


def _named_union(name: str, ctype: Any, width: int, field: str) -> type[ctypes.Union]:
    """A ctypes mirror of the C union ``et_<name>``: ``raw`` [width] and one member per kernel record
    (its ``field`` names, in order), as ``csrc/embtables_native.h`` declares it."""
    members: list[tuple[str, Any]] = [("raw", ctype * width)]
    seen = set()
    for record in RECORDS:
        names = getattr(record, field)
        if names and record.native_name not in seen:
            seen.add(record.native_name)
            fields = [(n, ctype) for n in names]
            member = type(f"_{record.native_name}_{name}", (ctypes.Structure,), {"_fields_": fields})
            members.append((record.native_name, member))
    return type(f"_{name}", (ctypes.Union,), {"_fields_": members})


_Flags = _named_union("flags", ctypes.c_int32, 2, "flag_names")
_Constants = _named_union("constants", ctypes.c_float, 8, "constant_names")


class OptParams(ctypes.Structure):
    """Mirrors ``et_opt`` in the C source: the kind, named flags and constants (unions by optimizer),
    learning rate, decay and clip bounds."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("flags", _Flags),
        ("lr", ctypes.c_float),
        ("decay", ctypes.c_float),
        ("glo", ctypes.c_float),
        ("ghi", ctypes.c_float),
        ("wlo", ctypes.c_float),
        ("whi", ctypes.c_float),
        ("constants", _Constants),
    ]


def set_enabled(enabled: bool) -> None:
    """Turn the native kernels on or off for this process (tests run both paths)."""
    global _enabled, _switches
    _enabled = enabled
    _switches += 1


def switches() -> int:
    """How many times the native or the GPU kernels (``gpu.set_enabled``) were switched in this process."""
    return _switches


def count_switch() -> None:
    """Count a switch of other kernels (``gpu.set_enabled``) in ``switches``."""
    global _switches
    _switches += 1


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _compile() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("embtables: no C compiler found; using the slower pure-torch kernels (set CC to enable).")
        return None
    source = b"".join(_TEXT[path.name] for path in (*_SOURCES, *_HEADERS))
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_key().encode() + cc.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("EMBTABLES_CACHE_DIR", Path.home() / ".cache" / "embtables"))
    target = cache / f"embtables_native-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / target.name
            for name, text in _TEXT.items():  # the imported sources, each header beside them
                (Path(tmp) / name).write_bytes(text)
            cmd = [cc, *_FLAGS, *(str(Path(tmp) / path.name) for path in _SOURCES), "-o", str(out), "-lm"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                logger.warning(
                    "embtables: compiling the native kernels failed; using the slower pure-torch kernels.\n%s\n%s",
                    " ".join(cmd),
                    proc.stderr[-2000:],
                )
                return None
            os.replace(out, target)  # atomic: concurrent processes never load a half-written file
        logger.info("embtables: compiled native kernels into %s", target)
    lib = native_abi.bind(ctypes.CDLL(str(target)))
    if not lib.et_flushes_subnormals():
        logger.warning(
            "embtables: the native kernels cannot flush subnormals to zero on this CPU (%s); using the pure-torch "
            "kernels, which do (docs/spec.md §1.5).",
            platform.machine(),
        )
        return None
    return lib


def library(*, required: bool = False) -> ctypes.CDLL | None:
    """The loaded library, compiling it on first call; None when disabled or unavailable.
    ``required``: also when the arithmetic kernels are disabled (``EMBTABLES_NATIVE=0`` or
    ``set_enabled(False)`` select the torch path for those; the key map of a dynamic table has no torch
    path)."""
    global _lib, _tried
    if not _enabled and not required:
        return None
    if _tried:  # loaded (or failed) once: no lock needed to read the result
        return _lib
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _compile()
            except (OSError, subprocess.SubprocessError) as exc:
                logger.warning("embtables: native kernels unavailable (%s); using the pure-torch kernels.", exc)
                _lib = None
    return _lib


def loaded() -> ctypes.CDLL | None:
    """The library if it was loaded already (never compiles; for finalizers)."""
    return _lib
