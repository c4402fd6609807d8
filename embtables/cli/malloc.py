"""Keeping freed memory in the process: glibc's ``mallopt``, as jemalloc and tcmalloc behave.

By default glibc serves blocks over 128 KB-32 MB with ``mmap`` and gives them back to the kernel at
every ``free`` (and trims its heap above 128 KB free), so a training step that allocates the same
[B, D] float32 activations and gradients every time (3 MB each at B = 4096, D = 200) takes fresh page
faults for them at every step: 0.2-0.5 ms a step on a 2-core machine, more than the embedding work at
small batches. ``keep_freed_memory()`` raises both thresholds (no ``mmap`` below 64 MiB, no trim below
256 MiB), so a steady loop reuses its own pages. ``embtables train`` and the benchmarks call it
(``--malloc default`` turns it off). The same from the shell, for any program:
``MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=268435456``.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 256 << 20


def keep_freed_memory() -> str:
    """Ask glibc's malloc to keep freed memory (see the module docstring); returns "kept", or
    "default (...)" saying why not (not glibc, or ``mallopt`` refused). Never raises."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        return f"default (mallopt unavailable: {exc})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return "kept" if ok else "default (mallopt refused)"
