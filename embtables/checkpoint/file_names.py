"""The names of the files embtables writes, and the rule for every name it reads back.

A table's name is data, never a path: per-table files are named ``t<index:04d>-<safe>`` where
``<safe>`` keeps only ASCII letters, digits, ``_`` and ``-`` of the name (others become ``_``,
at most 40 of them), so a name cannot leave its directory (``../evil``, ``scope/table``), and two
names never share a file (the index differs even for ``Price`` and ``price`` on a case-insensitive
disk, or ``price`` and ``price.scale``). The real name is kept in the JSON beside the files.

A file name read from a file (a manifest, ``serving.json``) is a stranger's data: ``contained``
accepts only a plain name (no separator, no ``..``, no leading dot, printable ASCII) whose real
path, symlinks resolved, is a direct child of the directory that holds the JSON.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint or export is missing, corrupt, untrusted, or does not match the module it is
    restored into."""


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")


def table_file_stem(index: int, name: str) -> str:
    """The stem of table ``index``'s files: ``t0003-user_age`` for table #3 named ``user/age``."""
    return f"t{index:04d}-{_UNSAFE.sub('_', name)[:40]}"


def contained(root: Path, name: object, what: str) -> Path:
    """``root / name`` for a file name read from a file, after checking that it is a plain name whose
    real path is directly inside ``root``; ``CheckpointError`` naming ``what`` otherwise."""
    if not isinstance(name, str) or not _PLAIN.fullmatch(name) or ".." in name:
        raise CheckpointError(
            f"{root}: {what} names the file {name!r}; only a plain file name inside the directory is accepted "
            "(letters, digits, '_', '-', '.'; no path separator, no '..', no leading dot). The file was not read."
        )
    path = root / name
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.dirname(real) != real_root:
        raise CheckpointError(
            f"{root}: {what} names {name!r}, a link that leads outside the directory (to {real}). "
            "The file was not read."
        )
    return path


__all__ = ["CheckpointError", "contained", "table_file_stem"]
