"""CRC-32C in the native library (``csrc/checksums.c``): the checksum of TensorFlow's checkpoint bundles,
which ``checkpoint/tf_bundle.py`` computes over every tensor it reads or writes."""

from __future__ import annotations

import numpy as np

from embtables.kernels.native_library import library


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int | None:
    """The CRC-32C of ``data`` continuing ``crc`` (0 to start), or None when the native library is not
    available (no compiler, or ``EMBTABLES_NATIVE=0``): the caller computes it another way."""
    lib = library()
    if lib is None:
        return None
    if not 0 <= crc <= 0xFFFFFFFF:
        raise ValueError(f"crc32c: a running CRC is a 32-bit value, got {crc}.")
    raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)  # its bytes, not copied (read-only is fine)
    if raw.size == 0:
        return crc
    return int(lib.et_crc32c(raw.ctypes.data, raw.size, crc))  # raw holds the buffer for the call
