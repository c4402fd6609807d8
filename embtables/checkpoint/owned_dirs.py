"""Directories embtables writes: temporary names that say who wrote them, atomic replacement, and
cleanup of only what a dead writer of this library left behind.

A writer builds its output in ``<parent>/.embtables-tmp-<kind>-<host>-<pid>-<id>`` and publishes it
with a rename. Leftovers of a killed writer are removed by the next writer only when it can tell
that their writer is dead: the same host, and no live process with that pid. Leftovers from other
hosts (a shared file system) are left alone. Replacing an existing directory exchanges the two
atomically (Linux ``renameat2(RENAME_EXCHANGE)``), so at every moment the target is either the old
complete directory or the new one; where the kernel or file system cannot exchange, the old one is
moved aside first and there is a window of one rename in which the target is absent.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import re
import shutil
import socket
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from embtables.checkpoint.file_names import CheckpointError

_TMP = re.compile(r"\.embtables-tmp-(?P<kind>[a-z]+)-(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-[0-9a-f]+")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:64] or "host"


def temp_name(kind: str) -> str:
    """A fresh temporary name for a writer of ``kind`` (lowercase letters) in this process."""
    return f".embtables-tmp-{kind}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # a live process of another user, or a pid we cannot ask about: leave it
    return True


def clean_dead_leftovers(parent: Path, kind: str, keep: str | None = None) -> list[str]:
    """Remove ``parent``'s temporary directories of ``kind`` whose writer is dead (this host, no such
    pid); returns their names. Everything else is left alone."""
    removed: list[str] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    host = _host()
    for p in entries:
        m = _TMP.fullmatch(p.name)
        if m is None or m["kind"] != kind or p.name == keep or m["host"] != host:
            continue
        if int(m["pid"]) == os.getpid() or _alive(int(m["pid"])):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    return removed


def _libc_renameat2() -> object | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        return libc.renameat2
    except (OSError, AttributeError, TypeError):
        return None


def exchange(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` in one atomic step; False when this system cannot."""
    fn = _libc_renameat2()
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)  # type: ignore[operator]
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def publish(tmp: Path, target: Path) -> Path | None:
    """Move the finished directory ``tmp`` to ``target``. When ``target`` exists (a directory the
    caller has checked it may replace), the two are exchanged atomically and the old one, now at
    ``tmp``'s name, is returned for the caller to remove; None when nothing was replaced."""
    if not target.exists():
        os.replace(tmp, target)
        return None
    if exchange(tmp, target):
        return tmp
    aside = target.parent / temp_name("trash")
    os.replace(target, aside)
    os.replace(tmp, target)
    return aside


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write the file ``path`` whole or not at all: ``write(f)`` into a temporary name beside it, fsynced, renamed
    over ``path``, the directory fsynced (a reader sees the old file or the new one, never a part)."""
    tmp = path.with_name(temp_name("file"))
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_json_atomically(path: Path, doc: Any) -> None:
    """``doc`` as indented JSON in the file ``path``, whole or not at all (``write_atomically``)."""
    write_atomically(path, lambda f: f.write(json.dumps(doc, indent=1).encode()))


def publish_over(tmp: Path, target: Path, still_ours: Callable[[Path], object]) -> None:
    """Publish the finished directory ``tmp`` as ``target``: ``tmp`` fsynced, ``still_ours(target)`` (raises when
    ``target`` may not be replaced) checked just before the atomic exchange, the parent fsynced, and the replaced
    directory removed."""
    fsync_dir(tmp)
    still_ours(target)
    old = publish(tmp, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriterLock:
    """An exclusive writer's lock on a directory: ``<directory>/<name>`` holds the holder's pid, host
    and a token. ``acquire()`` refuses with ``CheckpointError`` while another writer (another process,
    or another object in this one) holds it; a lock left by a dead process on this host is stale and
    taken over. Released by ``release()``, when the owner is garbage-collected, or at exit."""

    def __init__(self, directory: Path, name: str, what: str) -> None:
        self.path = Path(directory) / name
        self.what = what
        self.token = uuid.uuid4().hex
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def _holder(self) -> dict[str, Any] | None:
        try:
            doc = json.loads(self.path.read_text())
            return doc if isinstance(doc, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written right now, or damaged: treated as held

    def acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released meanwhile: try again
                if holder.get("token") == self.token:
                    return
                pid, host = holder.get("pid"), holder.get("host")
                if host == _host() and isinstance(pid, int) and pid != os.getpid() and not _alive(pid):
                    aside = self.path.with_name(f"{self.path.name}.stale-{uuid.uuid4().hex[:8]}")
                    with contextlib.suppress(OSError):
                        os.replace(self.path, aside)
                        os.unlink(aside)
                    continue
                mine = pid == os.getpid() and host == _host()
                who = "this process (another object: close() it or drop it)" if mine else f"process {pid} on {host}"
                raise CheckpointError(
                    f"{self.path.parent} is being written by {who} ({holder.get('what', 'a writer')}, since "
                    f"{holder.get('since', '?')}); a second writer would clobber its checkpoints. Stop the other "
                    f"writer or use another directory. (A lock left by a dead process on this host is taken over "
                    f"by itself; one from another host must be removed by hand: {self.path}.)"
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": _host(), "token": self.token, "what": self.what,
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)  # fmt: skip
            self._finalizer = weakref.finalize(self, _release, self.path, self.token)
            return
        raise CheckpointError(f"{self.path}: could not take the writer's lock (it keeps changing).")

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None


def _release(path: Path, token: str) -> None:
    """Remove the lock file if it is still this holder's."""
    try:
        if json.loads(path.read_text()).get("token") == token:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


__all__ = ["WriterLock", "clean_dead_leftovers", "exchange", "fsync_dir", "publish", "temp_name"]
