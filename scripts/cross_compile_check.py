"""Compile the native kernels for 64-bit ARM (aarch64-linux-gnu) on a machine without an ARM compiler, and check
that the build sets and restores the FPCR's flush-to-zero bit as docs/spec.md §1.5 says (the ``__aarch64__``
branch of ``csrc/embtables_native.h``, which an x86 build never compiles):

    pip install ziglang                    # Zig's clang, which cross-compiles with its own C library headers
    python scripts/cross_compile_check.py

Every source of ``native_library`` is compiled with its flags (``-march=native`` replaced by ``-mcpu=generic``;
OpenMP against a declaration-only ``omp.h``: an object file, not a library to load), then the objects are
linked into one shared library, and the compiled kernels' instructions are counted: ``mrs xN, fpcr`` (the modes
read) and ``msr fpcr, xN`` (set, then restored). Exits 1 when a source does not compile or link, or when the
kernels hold no FPCR writes. It does not run the code (no ARM machine or emulator here).
"""

from __future__ import annotations

import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from embtables.kernels import native_library

TARGET = "aarch64-linux-gnu"
MRS_FPCR, MSR_FPCR, RT_MASK = 0xD53B4400, 0xD51B4400, 0xFFFFFFE0  # the A64 encodings, register field cleared


def zig() -> list[str] | None:
    try:
        import ziglang  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "ziglang", "cc"]


def fpcr_instructions(path: Path) -> tuple[int, int]:
    """(reads, writes) of the FPCR among the object's 4-byte-aligned words (its code)."""
    data = path.read_bytes()
    reads = writes = 0
    for (word,) in struct.iter_unpack("<I", data[: len(data) // 4 * 4]):
        reads += word & RT_MASK == MRS_FPCR
        writes += word & RT_MASK == MSR_FPCR
    return reads, writes


def main() -> int:
    cc = zig()
    if cc is None:
        print("needs Zig's clang: pip install ziglang", file=sys.stderr)
        return 2
    flags = [f for f in native_library._FLAGS if f not in ("-march=native", "-shared")]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / "omp.h"
        names = ("get_thread_num", "get_num_threads", "get_max_threads")
        stub.write_text("".join(f"int omp_{name}(void);\n" for name in names))
        objects = []
        for source in native_library._SOURCES:
            obj = Path(tmp) / (source.stem + ".o")
            cmd = [*cc, "-target", TARGET, "-mcpu=generic", *flags, f"-I{tmp}", "-c", str(source), "-o", str(obj)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                failed += 1
                print(f"{source.name}: FAILED\n{out.stderr[-3000:]}")
                continue
            objects.append(obj)
            reads, writes = fpcr_instructions(obj)
            size = obj.stat().st_size
            print(f"{source.name}: compiled for {TARGET} ({size} bytes), fpcr reads {reads}, writes {writes}")
            regions = source.read_text().count("ET_FLUSH_SUBNORMALS;")  # each sets the modes and restores them
            if regions and (reads < regions or writes < 2 * regions):
                failed += 1
                print("  the kernels must read the FPCR and write it twice a region (set, restore)")
        if len(objects) == len(native_library._SOURCES):
            lib = Path(tmp) / "libembtables_native.so"
            out = subprocess.run([*cc, "-target", TARGET, "-shared", *map(str, objects), "-o", str(lib)],
                                 capture_output=True, text=True)  # fmt: skip
            print(f"linked: {'ok' if out.returncode == 0 else 'FAILED ' + out.stderr[-2000:]}")
            failed += out.returncode != 0
    print(f"{failed} failures", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
