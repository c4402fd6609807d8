"""CRC-32C in the native library (``csrc/checksums.c``): the checksum of TensorFlow's checkpoint bundles,
which ``checkpoint/tf_bundle.py`` computes over every tensor it reads or writes."""

from __future__ import annotations

import ctypes

from embtables.kernels.native_library import library


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int | None:
    """The CRC-32C of ``data`` continuing ``crc`` (0 to start), or None when the native library is not
    available (no compiler, or ``EMBTABLES_NATIVE=0``): the caller computes it another way."""
    lib = library()
    if lib is None:
        return None
    if not 0 <= crc <= 0xFFFFFFFF:
        raise ValueError(f"crc32c: a running CRC is a 32-bit value, got {crc}.")
    view = memoryview(data).cast("B")  # bytes-like of any format, read as its bytes
    n = view.nbytes
    if n == 0:
        return crc
    buf = (ctypes.c_char * n).from_buffer_copy(view) if view.readonly else (ctypes.c_char * n).from_buffer(view)
    return int(lib.et_crc32c(ctypes.addressof(buf), n, crc))
