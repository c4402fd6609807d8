"""The stable hash of feature values (hash bucket columns, vocabulary OOV buckets).

``int.from_bytes(blake2b(str(value).encode("utf-8"), digest_size=8).digest(), "little") % buckets``: stable
across runs, processes and machines (Python's ``hash()`` is salted). Integers hash as their decimal string,
like TF's hash bucket column, and so do integral floats, so an integer column that arrives as float64
because of a null hashes the same; non-integral and NaN floats are refused. TF itself uses FarmHash, so
hashed ids differ from TF's. ``buckets=None`` keeps the whole 64-bit digest (keys for a dynamic table).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from embtables.errors import InputError


def _key_text(value: Any, column: str) -> str:
    """The text a value hashes as: integers (and integral floats: a pandas/Arrow integer column with a
    null arrives as float64) as their decimal digits, anything else as ``str(value)``."""
    if isinstance(value, (float, np.floating)):
        if not np.isfinite(value) or value != np.floor(value):
            raise InputError(
                f"column {column!r}: the value {value!r} is not an integer, so it has no stable hash (a null in an "
                "integer column arrives as NaN); drop or fill it, or convert the column to strings."
            )
        return str(int(value))
    if isinstance(value, (np.integer, bool, np.bool_)):
        return str(int(value)) if not isinstance(value, (bool, np.bool_)) else str(bool(value))
    return str(value)


def stable_hash(values: np.ndarray, buckets: int | None, column: str = "?") -> np.ndarray:
    """The documented stable hash of each value into ``[0, buckets)`` (int64 [N]); one blake2b per distinct
    value. An integral float hashes like its integer; a non-integral or non-finite float is refused.
    ``buckets=None``: the whole 64-bit digest, as int64 (two's complement)."""
    if len(values) == 0:
        return np.zeros(0, dtype=np.int64)
    texts: Sequence[str]
    if values.dtype.kind in "iuUS":
        strings = values.astype(str).reshape(-1)  # integers hash as their decimal digits
        digests = _known_digests(strings)
        if digests is not None:
            if buckets is None:
                keys: np.ndarray = digests.view(np.int64)
                return keys
            ids: np.ndarray = (digests % np.uint64(buckets)).astype(np.int64)
            return ids
        uniq, inverse = np.unique(strings, return_inverse=True)  # a fingerprint collision: one by one
        texts = list(uniq)
    elif values.dtype.kind == "f":
        uniq_f, inverse = np.unique(values, return_inverse=True)
        texts = [_key_text(float(u), column) for u in uniq_f]
    else:  # object: mixed Python values, one canonical text per value
        keys = np.array([_key_text(v, column) for v in values.reshape(-1)], dtype=str)
        uniq, inverse = np.unique(keys, return_inverse=True)
        texts = list(uniq)
    if buckets is None:
        full = np.fromiter((_digest(u) for u in texts), dtype=np.uint64, count=len(texts)).view(np.int64)
        return full[inverse.reshape(-1)]
    hashed = np.fromiter((_digest(u) % buckets for u in texts), dtype=np.int64, count=len(texts))
    return hashed[inverse.reshape(-1)]


# Odd 64-bit multipliers of the fingerprint, one per code point position (fixed: the same in every process).
_MULTIPLIERS = np.random.default_rng(0x5EED_F1A6).integers(1, 2**63, 256, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def _fingerprints(strings: np.ndarray) -> np.ndarray:
    """A 64-bit fingerprint of each fixed-width str of ``strings`` [N] (uint64 [N]), vectorised over the N
    strings: ``sum_j code_j * m_j`` modulo 2^64 with odd multipliers m_j, one integer product of the
    [N, width] code points (UCS-4, 0-padded) with [width] (4x faster than a pass per code point at 13
    characters); FNV-1a, a pass per code point, past 256 characters. Equal strings get equal
    fingerprints; distinct ones almost surely differ (``stable_hash`` checks that they do before
    trusting them)."""
    codes = np.ascontiguousarray(strings).view(np.uint32).reshape(len(strings), -1)
    width = codes.shape[1]
    if width <= len(_MULTIPLIERS):
        fp: np.ndarray = codes.astype(np.uint64) @ _MULTIPLIERS[:width]  # wraps modulo 2^64
        return fp
    fp = np.full(len(strings), 0xCBF29CE484222325, dtype=np.uint64)
    prime = np.uint64(0x100000001B3)
    with np.errstate(over="ignore"):
        for j in range(width):
            fp ^= codes[:, j]
            fp *= prime
    return fp


# Texts seen so far, by fingerprint: (fingerprints sorted [K] uint64, their texts [K] str, the texts'
# digests [K] uint64). Replaced whole, never mutated, so a reader on another thread sees one state.
_KNOWN: tuple[np.ndarray, np.ndarray, np.ndarray] = (
    np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=str), np.zeros(0, dtype=np.uint64),
)  # fmt: skip


def _known_digests(strings: np.ndarray) -> np.ndarray | None:
    """The 64-bit digest of every str of ``strings`` [N] (uint64 [N]), found by fingerprint with a few
    vectorised passes; only texts never seen before are hashed in Python. None when two distinct texts
    share a fingerprint (the caller then hashes text by text)."""
    global _KNOWN
    fp = _fingerprints(strings)
    for _ in range(2):  # look up; on a miss, learn the new texts and look up again
        known_fp, known_text, known_digest = _KNOWN
        if len(known_fp):
            pos = np.minimum(np.searchsorted(known_fp, fp), len(known_fp) - 1)
            same_fp = known_fp[pos] == fp
            if (same_fp & (known_text[pos] != strings)).any():
                return None  # a known fingerprint with another text
            if same_fp.all():
                return known_digest[pos]
            missing = ~same_fp
        else:
            missing = np.ones(len(fp), dtype=bool)
        unseen = strings[missing]
        new_fp, first = np.unique(fp[missing], return_index=True)
        new_text = unseen[first]  # one text per new fingerprint (equal texts have equal fingerprints)
        if len(new_text) != len(np.unique(unseen)):
            return None  # two new texts with one fingerprint
        new_digest = np.fromiter((_digest(str(t)) for t in new_text), dtype=np.uint64, count=len(new_text))
        if len(known_fp) + len(new_fp) > _MAX_DIGESTS:
            known_fp, known_text, known_digest = known_fp[:0], known_text[:0], known_digest[:0]
        merged = np.concatenate([known_fp, new_fp])
        order = np.argsort(merged, kind="stable")
        _KNOWN = (merged[order], np.concatenate([known_text, new_text])[order],
                  np.concatenate([known_digest, new_digest])[order])  # fmt: skip
    return None


_DIGESTS: dict[str, int] = {}  # text -> its 64-bit blake2b digest: a column's values repeat every batch
_MAX_DIGESTS = 1 << 20  # about 100 MB at most; then it starts afresh


def _digest(text: str) -> int:
    got = _DIGESTS.get(text)
    if got is None:
        got = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
        if len(_DIGESTS) >= _MAX_DIGESTS:
            _DIGESTS.clear()
        _DIGESTS[text] = got
    return got
