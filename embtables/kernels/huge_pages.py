"""Table storage in transparent huge pages, where the kernel offers them on request.

A training step reads and writes rows all over tables of hundreds of MiB to many GiB. With 4 KiB pages
nearly every row touched is a TLB miss; with 2 MiB pages the same rows need 512 times fewer page
translations. Linux gives huge pages to memory marked ``MADV_HUGEPAGE`` when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (a common default) or ``always``. On the
2-core benchmark machine (``madvise``) the W = 2 sharded step took 9% less time this way.

``empty_float32`` allocates a CPU tensor and marks the 2 MiB-aligned part of its own bytes before
anything is written to it, so the first writes fault in huge pages. It is advice: where the kernel
has no transparent huge pages, the call fails, or ``EMBTABLES_HUGE_PAGES=0``, the tensor is the same,
in ordinary pages. Values never depend on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20  # bytes: x86-64 and arm64 (4 KiB base pages)
MIN_BYTES = 4 * HUGE_PAGE  # smaller tensors keep ordinary pages
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.lru_cache(maxsize=1)
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``madvise``, or None off Linux or when opted out."""
    if not sys.platform.startswith("linux") or os.environ.get("EMBTABLES_HUGE_PAGES", "1") == "0":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise(t: Tensor) -> bool:
    """Ask for huge pages for the whole 2 MiB pages inside ``t``'s own bytes (a contiguous CPU tensor of
    at least ``MIN_BYTES``). True when the kernel accepted the advice."""
    madvise = _madvise()
    nbytes = t.numel() * t.element_size()
    if madvise is None or t.device.type != "cpu" or not t.is_contiguous() or nbytes < MIN_BYTES:
        return False
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # inward: never advise bytes that are not t's
    end = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    return int(madvise(start, end - start, _MADV_HUGEPAGE)) == 0


def empty_float32(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised tensor of ``shape`` on ``device`` (float32, or ``dtype``: a table's storage type); on
    the CPU, large ones in huge pages (``advise``) before their first write."""
    out = torch.empty(shape, dtype=dtype, device=device)
    advise(out)
    return out
