"""Incremental checkpoints: a checkpoint that holds only the rows changed since the checkpoint before it
(``save(root, incremental=True)``), and the chain a restore resolves (the last full checkpoint, then every
increment after it, in order).

Every manifest written since increments exist carries an ``id`` (random, 32 hex digits). An increment's
manifest adds ``chain``: the directory name, id and step of the checkpoint it was built on
(``previous``, ``previous_id``, ``previous_step``) and how many increments the chain holds up to it
(``increments``). Its rank files have the usual layout, with only the changed rows of each table (global
row ids, ascending). A chain is read as a stranger's data: a link that is missing, replaced (another id),
out of order, or of another config is refused, naming it, before anything is restored.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from embtables.checkpoint import manifest as manifest_io
from embtables.checkpoint.file_names import CheckpointError, contained

logger = logging.getLogger("embtables")
# Where an incremental save or export says it writes a full one instead, and why (INFO): the command line shows
# it at its normal verbosity (``show_full_writes``); a library user sees it with INFO logging on.
full_writes = logging.getLogger("embtables.full_writes")


class _ToStderr(logging.Handler):
    """Each record's message on the ``sys.stderr`` of the moment it is written."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def show_full_writes() -> None:
    """Show the full-write notices (``full_writes``) at INFO: through the root logger's handlers (a record goes
    to them whatever the root's own level), or on stderr where the root has none."""
    full_writes.setLevel(logging.INFO)
    if not logging.getLogger().handlers and not any(isinstance(h, _ToStderr) for h in full_writes.handlers):
        full_writes.addHandler(_ToStderr())


_ID = re.compile(r"[0-9a-f]{32}")
_MAX_LINKS = 100_000  # a chain longer than this is refused as corrupt (a cycle, say)
FULL_ABOVE = 0.5  # more of the rows changed than this: a full checkpoint (as large, faster to restore)


def new_id() -> str:
    """A fresh checkpoint id (32 hex digits)."""
    return secrets.token_hex(16)


def manifest_id(manifest: dict[str, Any]) -> str | None:
    """The manifest's id, or None (written before ids, or not a well-formed one)."""
    value = manifest.get("id")
    return value if isinstance(value, str) and _ID.fullmatch(value) else None


def chain_of(manifest: dict[str, Any], where: Path) -> dict[str, Any] | None:
    """The checked ``chain`` entry of an increment's manifest (None for a full checkpoint)."""
    chain = manifest.get("chain")
    if chain is None:
        return None
    what = f"{where / manifest_io.MANIFEST}: its 'chain'"
    if not isinstance(chain, dict):
        raise CheckpointError(f"{what} must be a JSON object, got {type(chain).__name__}.")
    previous, previous_id = chain.get("previous"), chain.get("previous_id")
    step, increments = chain.get("previous_step"), chain.get("increments")
    if not isinstance(previous, str) or not isinstance(previous_id, str) or not _ID.fullmatch(previous_id):
        raise CheckpointError(f"{what} must name the checkpoint it builds on and its id, got {chain!r}.")
    for name, value in (("previous_step", step), ("increments", increments)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "increments" else 0):
            raise CheckpointError(f"{what}.{name} must be a non-negative integer, got {value!r}.")
    return {"previous": previous, "previous_id": previous_id, "previous_step": step, "increments": increments}


def resolve_chain(
    where: Path, manifest: dict[str, Any], read: Callable[[Path], tuple[Path, dict[str, Any]]]
) -> list[tuple[Path, dict[str, Any]]]:
    """The checkpoints a restore of ``where`` (its checked ``manifest``) reads, oldest first: the last full
    checkpoint and every increment after it, ``where`` last (a full checkpoint: itself alone). ``read`` reads
    and checks a manifest. ``CheckpointError`` naming the link for a missing, replaced or out-of-order one."""
    links = [(where, manifest)]
    while True:
        here, current = links[-1]
        chain = chain_of(current, here)
        if chain is None:
            break
        if len(links) > _MAX_LINKS:
            raise CheckpointError(f"{where}: its chain of increments is longer than {_MAX_LINKS} (corrupt).")
        name = chain["previous"]
        previous = contained(here.parent, name, f"the chain of {here.name}")
        if not (previous / manifest_io.MANIFEST).is_file():
            raise CheckpointError(
                f"{here}: an incremental checkpoint built on {name} (step {chain['previous_step']}), which is missing "
                f"from {here.parent}. A restore needs the whole chain: the last full checkpoint and every increment "
                "after it. Nothing was restored."
            )
        _, before = read(previous)
        if manifest_id(before) != chain["previous_id"]:
            raise CheckpointError(
                f"{here}: an incremental checkpoint built on {name}, but {previous} is another checkpoint (its id "
                f"differs: it was saved again after this increment was written). Nothing was restored."
            )
        if int(before["step"]) != chain["previous_step"] or int(before["step"]) >= int(current["step"]):
            raise CheckpointError(
                f"{here}: an incremental checkpoint of step {current['step']} built on {name}, whose step is "
                f"{before['step']} (expected {chain['previous_step']}, before its own): the chain is out of order. "
                "Nothing was restored."
            )
        links.append((previous, before))
    return links[::-1]


def needed(kept: list[Path], read: Callable[[Path], tuple[Path, dict[str, Any]]]) -> set[Path]:
    """Every checkpoint that the checkpoints ``kept`` need (themselves and their chains); a chain that cannot
    be resolved keeps every checkpoint it names that exists."""
    out: set[Path] = set()
    for path in kept:
        out.add(path)
        here = path
        seen = {path}
        for _ in range(_MAX_LINKS):
            try:
                _, current = read(here)
                chain = chain_of(current, here)
            except CheckpointError:
                break
            if chain is None:
                break
            try:
                here = contained(here.parent, chain["previous"], f"the chain of {here.name}")
            except CheckpointError:
                break
            if here in seen:  # a cycle (a corrupt chain): what it names is kept, once
                break
            seen.add(here)
            out.add(here)
    return out


def previous_for_increment(
    latest: Path | None,
    last_id: str | None,
    full_every: int | None,
    read: Callable[[Path], tuple[Path, dict[str, Any]]],
    step: int,
) -> dict[str, Any] | None:
    """The ``chain`` entry of an increment of ``step`` built on ``latest`` (the newest checkpoint under the
    root), or None (a full checkpoint; why is logged): the module's changed rows count from its last save or
    restore (``last_id``), so an increment is only correct on top of that very checkpoint, and of a later
    step (a save of the same step replaces it); ``full_every``: at most that many increments in a row."""
    chain, why = _previous(latest, last_id, full_every, read, step)
    if chain is None:
        full_writes.info("embtables: save(incremental=True) writes a full checkpoint: %s.", why)
    return chain


def _previous(
    latest: Path | None,
    last_id: str | None,
    full_every: int | None,
    read: Callable[[Path], tuple[Path, dict[str, Any]]],
    step: int,
) -> tuple[dict[str, Any] | None, str]:
    """``previous_for_increment``'s answer, and why when it is None."""
    if latest is None:
        return None, "no checkpoint under the root yet"
    if last_id is None:
        return None, "this module has not saved or restored a checkpoint since its tables were set"
    try:
        _, manifest = read(latest)
        chain = chain_of(manifest, latest)
    except CheckpointError as exc:
        return None, f"the newest checkpoint cannot be read ({exc})"
    if manifest_id(manifest) != last_id:
        return None, f"the newest checkpoint, {latest.name}, is not the one this module last saved or restored"
    if int(manifest["step"]) >= step:
        return None, f"the newest checkpoint, {latest.name}, is of step {manifest['step']}: this save replaces it"
    increments = 1 + (0 if chain is None else int(chain["increments"]))
    if full_every is not None and increments > full_every:
        return None, f"{full_every} increments in a row (full_every={full_every})"
    entry = {"previous": latest.name, "previous_id": last_id, "previous_step": int(manifest["step"])}
    return {**entry, "increments": increments}, ""


@dataclasses.dataclass(frozen=True)
class IncrementalSave:
    """What ``store.save`` needs to write an increment: the id of the checkpoint the tables' changed rows count
    from (None: none yet), at most ``full_every`` increments in a row (None: no limit), and ``changed_rows()``:
    each table's changed local rows [R] (ascending)."""

    base_id: str | None
    full_every: int | None
    changed_rows: Callable[[], dict[str, torch.Tensor]]
