"""The native library is built from its sources as they were when ``native_library`` was imported, beside the
argument declarations imported with them: a source edited on disk afterwards (an editable install) is never
compiled against the older declarations (that mismatch made a running benchmark pass arguments C did not expect,
and crash). Checked with a stand-in compiler that records what it was given, in a subprocess."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

CHILD = """
import pathlib
from embtables.kernels import native_library as nl
pathlib.Path.read_bytes = lambda self: b"/* edited after import */"  # every file on disk changes now
assert nl._compile() is None  # the stand-in compiler fails, after recording its inputs
"""


def test_the_library_is_compiled_from_the_sources_read_at_import(tmp_path: Path) -> None:
    from embtables.kernels import native_library

    log = tmp_path / "log"
    cc = tmp_path / "cc"
    cc.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in *.c) echo "$a" >> "' + str(log) + '.args"; cat "$a" >> "' + str(log)
        + '.src"; cat "$(dirname "$a")/embtables_native.h" >> "' + str(log) + '.h";; esac; done\nexit 1\n'
    )  # fmt: skip
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "CC": str(cc), "EMBTABLES_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    args = Path(str(log) + ".args").read_text().split()
    assert [Path(a).name for a in args] == [p.name for p in native_library._SOURCES]
    assert all(Path(a).parent != native_library._SOURCES[0].parent for a in args)  # copies, not the package's
    assert Path(str(log) + ".src").read_bytes() == b"".join(p.read_bytes() for p in native_library._SOURCES)
    header = native_library._HEADERS[0].read_bytes()
    assert Path(str(log) + ".h").read_bytes() == header * len(args)  # each source found the header beside it
