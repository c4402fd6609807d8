"""Error types and message helpers.

Every error raised by embtables says who (feature or table), which rule was broken, what was
received and how to fix it. The classes subclass the builtin types users already catch.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value breaks a documented rule."""


class InputError(ValueError):
    """A batch of ids, weights or gradients breaks a documented rule; nothing was changed."""


class TornFilesError(RuntimeError):
    """An offloaded table's working files no longer hold it (a write-back or read failed, or something else
    cut a file short): its lookups, whole-table reads and saves are refused until ``restore()`` of a
    checkpoint or ``load_state_dict()`` of the whole state; the last checkpoint is untouched."""


class ClosedFilesError(RuntimeError):
    """An offloaded table's files were released (``close()``): nothing reads or writes them any more."""
