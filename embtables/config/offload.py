"""Offload: a table whose rows and slots live in files on local disk behind a bounded row cache
(docs/offload.md). A frozen, validated value; it holds no tensors and touches no file."""

from __future__ import annotations

import dataclasses
import os

from embtables.errors import ConfigError

# The largest cache a process can address (rows); more is a typo.
CACHE_ROWS_LIMIT = 1 << 40


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where an offloaded table's files live and how many of its rows may be in memory at once.

    Attributes:
      directory: a local directory for the table's working files (created when missing). It may hold
        other offloaded tables' files, never files embtables did not write (refused, never touched).
      cache_rows: at most this many rows (with their slots) are in memory at once. The cache holds whole
        4 KiB pages of the files, so it counts the rows of the pages it holds; the rows of the current
        and the previous batch are never evicted and must fit.
    """

    directory: str | os.PathLike[str]
    cache_rows: int

    def __post_init__(self) -> None:
        directory = self.directory
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ConfigError(f"Offload: `directory` must be a non-empty path (str or os.PathLike), got {directory!r}.")
        path = os.fspath(directory)
        if not isinstance(path, str) or "\x00" in path:
            raise ConfigError(f"Offload: `directory` must be a text path without NUL characters, got {directory!r}.")
        object.__setattr__(self, "directory", path)
        rows = self.cache_rows
        if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= CACHE_ROWS_LIMIT:
            raise ConfigError(
                f"Offload: `cache_rows` must be an int from 1 to 2**40 (the rows held in memory at once), got {rows!r}."
            )
