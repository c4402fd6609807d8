"""Small sample files that ship with the package, for the docs, ``embtables train --data`` and tests.

``clicks.csv`` (3,000 rows: ``clicked``, ``user``, ``item``, ``country``, ``liked_items`` with
``|``-separated ids; clicks planted from per-user and per-item effects) and ``clicks.schema.json``,
its schema for ``embtables train --data FILE --schema FILE``.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def sample_path(name: str) -> str:
    """The path of a shipped sample file: ``"clicks.csv"`` or ``"clicks.schema.json"``."""
    path = _HERE / name
    if path.suffix not in (".csv", ".json") or not path.is_file():
        raise FileNotFoundError(f"embtables has no sample file {name!r}; it ships clicks.csv and clicks.schema.json.")
    return str(path)


__all__ = ["sample_path"]
