"""Files the commands write where the user says (``predict --output``, ``stats --png``, the benchmarks' ``--out``):
checked before any work; the commands write them whole or not at all (``owned_dirs.write_atomically``).

A command never replaces a file it could not have written: an existing file is replaced only when it looks like
the command's own output (``looks_ours`` on its first bytes) or with ``--overwrite``, never when it is one of the
command's inputs; a folder, or a file in a folder that does not exist, is refused. The new file goes to a
temporary name beside the target, fsynced, then renamed over it: a full disk or a stopped process leaves the old
file, never a part of the new one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

HEAD_BYTES = 64  # the first bytes of an existing file that ``looks_ours`` sees


def check_output(
    output: Path,
    flag: str,
    what: str,
    looks_ours: Callable[[bytes], bool],
    inputs: Sequence[Path] = (),
    overwrite: bool | None = False,
    folders: Sequence[Path] = (),
) -> None:
    """Refuse ``output`` (given as ``flag``) before anything is computed when it is a folder, sits in a folder
    that does not exist, is one of the files ``inputs``, lies inside one of ``folders`` (a model artifact, whose
    later exports would find a file they did not write), or exists and is not ``what`` (by ``looks_ours``)
    without ``overwrite`` (None: the command has no ``--overwrite``)."""
    for folder in folders:
        if folder.is_dir() and folder.resolve() in output.resolve().parents:
            raise ValueError(f"{flag} {output} is inside {folder}, an input of this command; give a file elsewhere")
    if not output.exists():
        if not output.parent.is_dir():
            raise FileNotFoundError(f"{flag} {output}: its folder {output.parent} does not exist")
        return
    if output.is_dir():
        raise IsADirectoryError(f"{flag} {output} is a folder; give a file name")
    for source in inputs:
        if source.is_file() and os.path.samefile(output, source):
            raise ValueError(f"{flag} {output} is an input of this command: it would be replaced; give another file")
    if overwrite:
        return
    try:
        with open(output, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError as exc:
        head, unreadable = b"", f" (it cannot be read: {exc.strerror})"
    else:
        unreadable = ""
    if unreadable or not looks_ours(head):
        fix = "give another file" + (", or pass --overwrite to replace it" if overwrite is not None else "")
        raise ValueError(f"{flag} {output} exists and is not {what}{unreadable}: {fix}")


__all__ = ["HEAD_BYTES", "check_output"]
