"""TensorFlow's checkpoint files (the "tensor bundle": ``<prefix>.index`` + ``<prefix>.data-00000-of-00001``)
read and written without TensorFlow.

The index is a LevelDB-format table, sorted by key: key "" holds a ``BundleHeaderProto``, every
other key a ``BundleEntryProto`` (dtype, shape, shard, offset, size, masked CRC-32C) for a tensor
stored raw in the data file. Only what TF's TPU embedding checkpoints use is supported: float32
tensors, and the scalar string tensor ``_CHECKPOINTABLE_OBJECT_GRAPH`` (a serialized
``TrackableObjectGraph``) that object-based restore needs. Protobufs are encoded by hand (a few
varint fields), so neither TensorFlow nor protobuf is needed.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from embtables.checkpoint.owned_dirs import write_atomically
from embtables.kernels import checksums

_MAGIC = 0xDB4775248B80FB57
DT_FLOAT, DT_STRING = 1, 7
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


class BundleError(ValueError):
    """A TensorFlow checkpoint file that cannot be read (or a tensor it cannot hold)."""


# ---------------------------------------------------------------------------------------------- CRC-32C
def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def _fast_crc32c() -> Any:
    """``google_crc32c`` when installed, else None: looked for once (a failed import per call searched every
    ``sys.path`` entry again, megabytes of the import system's caches inside a reader held to a memory bound)."""
    try:
        import google_crc32c  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return google_crc32c


_FAST_CRC32C = _fast_crc32c()


def crc32c(data: bytes | memoryview, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``: the native library's (``kernels/checksums.py``), else
    ``google_crc32c`` when installed, else pure Python (one table lookup a byte)."""
    native = checksums.crc32c(data, crc)
    if native is not None:
        return native
    if _FAST_CRC32C is not None:
        return int(_FAST_CRC32C.extend(crc, bytes(data)))
    return crc32c_python(data, crc)


def crc32c_python(data: bytes | memoryview, crc: int = 0) -> int:
    """CRC-32C in pure Python: what ``crc32c`` falls back to, and what tests compare the others with."""
    c = crc ^ 0xFFFFFFFF
    for b in bytes(data):
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked(crc: int) -> int:
    """LevelDB's masked CRC (what TF stores)."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------- protobuf
def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """A varint at ``pos`` (at most 10 bytes, inside ``data``) and the position after it."""
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise BundleError("a varint runs past its data or is longer than 10 bytes (corrupt file)")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def field_varint(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def field_bytes(number: int, value: bytes) -> bytes:
    return _varint((number << 3) | 2) + _varint(len(value)) + value


def field_fixed32(number: int, value: int) -> bytes:
    return _varint((number << 3) | 5) + struct.pack("<I", value)


def parse(data: bytes) -> dict[int, list[Any]]:
    """A protobuf message as {field number: [values]} (varints as ints, length-delimited as bytes)."""
    out: dict[int, list[Any]] = {}
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, pos = _read_varint(data, pos)
        elif wire == 2:
            n, pos = _read_varint(data, pos)
            if pos + n > len(data):
                raise BundleError("a protobuf field runs past its message (corrupt file)")
            value, pos = data[pos : pos + n], pos + n
        elif wire in (5, 1):
            width = 4 if wire == 5 else 8
            if pos + width > len(data):
                raise BundleError("a protobuf field runs past its message (corrupt file)")
            value, pos = struct.unpack_from("<I" if wire == 5 else "<Q", data, pos)[0], pos + width
        else:
            raise BundleError(f"unsupported protobuf wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


# ---------------------------------------------------------------------------------------------- table
def _block_entries(block: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The (key, value) entries of one table block, every length checked against the block."""
    if len(block) < 4:
        raise BundleError("a checkpoint index block is shorter than its restart count (corrupt file)")
    num_restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    end = len(block) - 4 - 4 * num_restarts
    if end < 0:
        raise BundleError("a checkpoint index block has more restart points than bytes (corrupt file)")
    pos, key = 0, b""
    while pos < end:
        shared, pos = _read_varint(block, pos)
        non_shared, pos = _read_varint(block, pos)
        value_len, pos = _read_varint(block, pos)
        if shared > len(key) or pos + non_shared + value_len > end:
            raise BundleError("a checkpoint index entry runs past its block (corrupt file)")
        key = key[:shared] + block[pos : pos + non_shared]
        pos += non_shared
        yield key, block[pos : pos + value_len]
        pos += value_len


def _checked_block(data: bytes, handle: bytes, what: str) -> bytes:
    """The block a handle (offset, size) points at, after checking that it and its 5-byte trailer lie
    in the file, that it is uncompressed, and its masked CRC-32C."""
    offset, p = _read_varint(handle, 0)
    size, _ = _read_varint(handle, p)
    if offset + size + 5 > len(data) - 48:
        raise BundleError(f"the {what} block lies outside the index file (truncated or corrupt)")
    if data[offset + size] != 0:
        raise BundleError("compressed checkpoint index blocks are not supported")
    stored = struct.unpack_from("<I", data, offset + size + 1)[0]
    if masked(crc32c(data[offset : offset + size + 1])) != stored:
        raise BundleError(f"the {what} block of the index fails its CRC-32C check (the file is corrupt)")
    return data[offset : offset + size]


def _read_table(data: bytes) -> dict[str, bytes]:
    if len(data) < 48 or struct.unpack_from("<Q", data, len(data) - 8)[0] != _MAGIC:
        raise BundleError("not a TensorFlow checkpoint index (bad table magic)")
    footer = data[-48:]
    _, pos = _read_varint(footer, 0)
    _, pos = _read_varint(footer, pos)
    index = _checked_block(data, footer[pos:], "table index")
    entries: dict[str, bytes] = {}
    for _, handle in _block_entries(index):
        for key, value in _block_entries(_checked_block(data, handle, "data")):
            try:
                entries[key.decode()] = value
            except UnicodeDecodeError:
                raise BundleError("a tensor name in the index is not UTF-8 (corrupt file)") from None
    return entries


def _block(entries: list[tuple[bytes, bytes]]) -> bytes:
    """One uncompressed block (a restart point at every entry), with its type byte and masked CRC."""
    body = bytearray()
    restarts = []
    for key, value in entries:
        restarts.append(len(body))
        body += _varint(0) + _varint(len(key)) + _varint(len(value)) + key + value
    for r in restarts:
        body += struct.pack("<I", r)
    body += struct.pack("<I", len(restarts))
    trailer = b"\x00"
    return bytes(body) + trailer + struct.pack("<I", masked(crc32c(trailer, crc32c(bytes(body)))))


def _write_table(entries: list[tuple[bytes, bytes]]) -> bytes:
    entries = sorted(entries)
    data = _block(entries)
    data_size = len(data) - 5
    meta = _block([])
    meta_offset = len(data)
    index = _block([(entries[-1][0] if entries else b"", _varint(0) + _varint(data_size))])
    index_offset = meta_offset + len(meta)
    footer = _varint(meta_offset) + _varint(len(meta) - 5) + _varint(index_offset) + _varint(len(index) - 5)
    footer += b"\x00" * (40 - len(footer)) + struct.pack("<Q", _MAGIC)
    return data + meta + index + footer


# ---------------------------------------------------------------------------------------------- bundle
def _content_crc(blob: bytes, dtype: int) -> int:
    """The CRC-32C TF records for a tensor: of its bytes; for a scalar string, of its length as a
    uint32, the masked CRC of that length, then the string (the stored length is a varint)."""
    if dtype != DT_STRING:
        return crc32c(blob)
    n, pos = _read_varint(blob, 0)
    return crc32c(blob[pos + 4 :], crc32c(blob[pos : pos + 4], crc32c(struct.pack("<I", n))))


def read_bundle(prefix: str | os.PathLike[str]) -> dict[str, Any]:
    """``{key: float32 array | bytes}`` of a TF checkpoint (``prefix`` without ``.index``); every tensor's
    size and CRC-32C are checked."""
    prefix = Path(prefix)
    try:
        index = Path(f"{prefix}.index").read_bytes()
    except OSError as exc:
        raise BundleError(f"{prefix}.index: cannot be read ({exc})") from exc
    try:
        entries = _read_table(index)
    except BundleError as exc:
        raise BundleError(f"{prefix}.index: {exc}") from None
    header = parse(entries.pop("", b""))
    shards = header.get(1, [1])[0]
    if not isinstance(shards, int) or not 1 <= shards <= 100_000:
        raise BundleError(f"{prefix}.index: {shards!r} data shards is not a count a TF writer produces")
    try:
        data = [Path(f"{prefix}.data-{i:05d}-of-{shards:05d}").read_bytes() for i in range(shards)]
    except OSError as exc:
        raise BundleError(f"{prefix}: a data file cannot be read ({exc})") from exc
    out: dict[str, Any] = {}
    for key, raw in entries.items():
        e = parse(raw)
        dtype, shard = e.get(1, [0])[0], e.get(3, [0])[0]
        offset, size = e.get(4, [0])[0], e.get(5, [0])[0]
        if not isinstance(shard, int) or not 0 <= shard < shards:
            raise BundleError(f"{prefix}: tensor {key!r} names data shard {shard!r} of {shards}")
        blob = data[shard][offset : offset + size]
        if len(blob) != size:
            raise BundleError(f"{prefix}: tensor {key!r} is truncated")
        if 6 in e and masked(_content_crc(blob, dtype)) != e[6][0]:
            raise BundleError(f"{prefix}: tensor {key!r} fails its CRC-32C check")
        dims = [parse(d).get(1, [0])[0] for d in parse(e[2][0]).get(2, [])] if 2 in e else []
        if dtype == DT_FLOAT:
            if any(not isinstance(d, int) or d >= 1 << 40 for d in dims) or math.prod(dims) * 4 != size:
                raise BundleError(f"{prefix}: tensor {key!r} has shape {dims} but {size} bytes")
            out[key] = np.frombuffer(blob, dtype="<f4").reshape(dims).copy()
        elif dtype == DT_STRING and not dims:
            n, pos = _read_varint(blob, 0)
            out[key] = blob[pos + 4 : pos + 4 + n]  # [varint length][masked crc of lengths][bytes]
        else:
            raise BundleError(f"{prefix}: tensor {key!r} has dtype {dtype}; only float32 tables are read")
    return out


def write_bundle(
    prefix: str | os.PathLike[str], tensors: dict[str, np.ndarray[Any, Any]], object_graph: bytes | None
) -> None:
    """Write float32 ``tensors`` (and the object graph) as a TF checkpoint at ``prefix``."""
    prefix = Path(prefix)
    data = bytearray()
    entries: list[tuple[bytes, bytes]] = []
    items: list[tuple[str, Any]] = sorted(tensors.items())
    if object_graph is not None:
        items.append((OBJECT_GRAPH_KEY, object_graph))
    for key, value in sorted(items):
        if isinstance(value, bytes):
            length_crc = masked(crc32c(struct.pack("<I", len(value))))
            blob = _varint(len(value)) + struct.pack("<I", length_crc) + value
            dtype, shape = DT_STRING, b""
        else:
            array = np.ascontiguousarray(value, dtype="<f4")
            blob = array.tobytes()
            dtype = DT_FLOAT
            shape = b"".join(field_bytes(2, field_varint(1, int(d))) for d in array.shape)
        entry = field_varint(1, dtype) + field_bytes(2, shape) + field_varint(4, len(data)) + field_varint(5, len(blob))
        entry += field_fixed32(6, masked(_content_crc(blob, dtype)))
        entries.append((key.encode(), entry))
        data += blob
    version = field_varint(1, 1)  # producer 1
    header = field_varint(1, 1) + field_bytes(3, version)
    entries.append((b"", header))
    # Each file whole or not at all, the data first: a writer stopped between the two leaves the old index over
    # the new data, which a reader refuses (each tensor's CRC), never a file cut short.
    index = _write_table(entries)
    write_atomically(Path(f"{prefix}.data-00000-of-00001"), lambda f: f.write(data))
    write_atomically(Path(f"{prefix}.index"), lambda f: f.write(index))
