"""A progress bar of bytes for long saves and restores (tqdm when installed)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(enabled: bool | Callable[[int], None] | None, rank: int, what: str) -> Iterator[Callable[[int], None]]:
    """A tqdm bar of bytes on rank 0 (default: when stderr is a terminal); yields the update callback.
    ``enabled`` may be the caller's own callback instead, called on every rank with each piece's bytes."""
    if callable(enabled):
        yield enabled
        return
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled or rank != 0:
        yield lambda n: None
        return
    try:
        from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        yield lambda n: None
        return

    with tqdm(desc=f"embtables {what}", unit="B", unit_scale=True, leave=False) as bar:
        yield bar.update
