"""All-to-all exchanges between the ranks of one host through shared memory, not gloo's TCP.

Gloo over localhost sends every byte through the kernel's TCP stack: a copy into the kernel and one
out, on the cores the ranks compute on, and a small message waits 0.3-0.5 ms for its wake-up. On a
2-core machine that is a fifth of a sharded step's time. When every rank of a process
group runs on one host, ``comm`` sends its per-step messages (all_to_all_v, phase headers, agreements)
through a ``ShmChannel`` instead; everything else stays on the process group.

Each rank owns one file in /dev/shm, mapped by every rank of the group. A file is created unnamed
(``O_TMPFILE``), locked shared for its process's lifetime, and only then given its name; the name is
removed as soon as every rank has opened it (nothing is left behind, even when a process is killed
later). A rank killed during the set-up itself can leave a name: the next set-up on the host removes
every embtables channel file that no live process holds locked (``sweep_orphans``). A file holds:

- a control block: a header (magic, world, and the code of the reason this rank broke the channel, 0
  while it has not); per peer p, the sequence number of the last message this rank posted for p, with
  its size and offset; the taken word: the last exchange whose messages this rank copied out, with the
  last exchange in which it refused the sizes it received;
- the outbox: this rank's messages to every peer, side by side. It grows (``ftruncate``) when a
  message does not fit; the peers map the larger file when they see an offset past their mapping.

One exchange, number s on every rank: copy the rows for each peer into the outbox and post s; wait for
every peer's post s, copy its rows out, post taken s; wait until every peer has taken s (the outbox is
free again, and the exchange is complete on every rank). Posting and waiting are futex operations in C
(``csrc/shm_sync.c``); a waiting rank sleeps, and wakes when the peer posts, when the timeout of the
process group passes, or when the peer's process is gone (its shared ``flock`` on its file is released
when it exits).

All or nothing: a rank that cannot finish an exchange (an error, ``KeyboardInterrupt``, a peer gone or
late) publishes why in its header and moves every word its peers may wait on, so every rank raises in
that exchange or its next one, and the channel is broken for good (``comm`` then exchanges through the
process group). Sizes a rank did not expect are refused by every rank in the same exchange, which
leaves the channel in step.

Nothing here imports ``torch.distributed``: ``comm`` sets the channel up over the process group.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from embtables.kernels import native_library

SHM_DIR = Path("/dev/shm")
_LINE = 64  # bytes per control field: each on its own cache line
_MAGIC = 0x6574_7368_6D63_6832  # "etshmch2"
_ALL_MAGICS = {_MAGIC, 0x6574_7368_6D63_6831}  # this layout's and the earlier one's (for sweep_orphans)
_FIRST_CAPACITY = 1 << 20
_MASK = 0xFFFF_FFFF
_BROKEN_WORD = 2  # int64 index in the header line: why this rank broke the channel (0: it has not)

# Why a rank broke the channel, by the code it publishes (each rank raises, naming the rank and reason).
_FAILED, _SHM_FULL, _PEER_LOST, _PEER_FAILED = 1, 2, 3, 4
_REASONS = {
    _FAILED: "failed (an error or an interrupt; its own traceback has the cause)",
    _SHM_FULL: "could not send its message (its shared memory is full)",
    _PEER_LOST: "lost another rank (gone or timed out)",
    _PEER_FAILED: "saw another rank fail",
}


class ChannelError(RuntimeError):
    """The exchange could not complete: a peer is gone, timed out, or sent what this rank did not expect
    (``comm`` re-raises it as ``CollectiveError``)."""


class _Refused(ChannelError):
    """A rank received sizes it did not expect: every rank took its messages and raises this in the same
    exchange, and the channel stays usable."""


def wanted() -> bool:
    """Whether this process may use shared memory at all: Linux, /dev/shm present, the native library
    loaded, and ``EMBTABLES_SHM`` not ``0``."""
    if os.environ.get("EMBTABLES_SHM", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if not SHM_DIR.is_dir() or not os.access(SHM_DIR, os.W_OK):
        return False
    return native_library.library(required=True) is not None


def host_identity() -> str | None:
    """What two processes share when they can map each other's files in /dev/shm and see each other's
    exit: the host (name and boot), the mount and pid namespaces. None when shared memory is not
    wanted here."""
    if not wanted():
        return None
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        mnt, pid = os.readlink("/proc/self/ns/mnt"), os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{socket.gethostname()}|{boot}|{mnt}|{pid}"


def _path(token: str, rank: int) -> Path:
    return SHM_DIR / f"embtables-{token}-{rank}"


def _control_bytes(world: int) -> int:
    """Control block size: a header line, per peer its posted line, then the taken line."""
    return -(-_LINE * (2 + world) // 4096) * 4096


def create_own(token: str, rank: int, world: int) -> int:
    """Create this rank's file (raises ``OSError``): control block plus a first outbox, locked shared
    for this process's lifetime (peers tell that it exited when they can lock it exclusively). The
    file gets its name only once locked, so a name nobody holds locked belongs to a dead process."""
    path = _path(token, rank)
    try:
        fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        named = False
    except (OSError, AttributeError):  # no O_TMPFILE here: the name exists a moment before the lock
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        named = True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        _reserve(fd, _control_bytes(world) + _FIRST_CAPACITY)
        os.pwrite(fd, np.array([_MAGIC, world], dtype=np.int64).tobytes(), 0)
        if not named:  # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N: a directory descriptor selects it
            procfd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.link(str(fd), path, src_dir_fd=procfd, follow_symlinks=True)
            finally:
                os.close(procfd)
    except OSError:
        os.close(fd)
        if named:
            unlink_own(token, rank)
        raise
    return fd


def sweep_orphans() -> list[str]:
    """Remove the channel files in /dev/shm that dead processes left (a rank killed during the set-up):
    the names of this library's channels (``embtables-<16 hex digits>-<rank>``) whose file starts with
    its magic (of this version or the earlier one) and that no process holds locked. Files of live
    processes, of other users and anything else are left alone. Returns the names removed."""
    removed = []
    for path in SHM_DIR.glob("embtables-*-*"):
        token, _, rank = path.name[len("embtables-") :].partition("-")
        if len(token) != 16 or not all(c in "0123456789abcdef" for c in token) or not rank.isdigit():
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            head = os.pread(fd, 8, 0)
            magic = int.from_bytes(head, "little") if len(head) == 8 else None
            if os.fstat(fd).st_uid != os.getuid() or magic not in _ALL_MAGICS:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its process is alive
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    path.unlink()
                    removed.append(path.name)
        finally:
            os.close(fd)
    return removed


def _reserve(fd: int, size: int) -> None:
    """Make the file ``size`` bytes long with its pages allocated (raises ``OSError`` when /dev/shm is
    full): a page that tmpfs cannot provide later would end the process with SIGBUS when written."""
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)


def open_peer(token: str, rank: int, world: int) -> int:
    """Open rank ``rank``'s file (raises ``OSError`` when it is missing or not an embtables channel of
    ``world`` ranks)."""
    fd = os.open(_path(token, rank), os.O_RDWR | os.O_CLOEXEC)
    head = np.frombuffer(os.pread(fd, 16, 0), dtype=np.int64)
    if head.size != 2 or int(head[0]) != _MAGIC or int(head[1]) != world:
        os.close(fd)
        raise OSError(f"{_path(token, rank)} is not an embtables channel of {world} ranks")
    return fd


def unlink_own(token: str, rank: int) -> None:
    """Remove this rank's file name (the mappings stay; idempotent)."""
    with contextlib.suppress(FileNotFoundError):
        _path(token, rank).unlink()


class _Mapping:
    """One rank's file, mapped: raw bytes (uint8 tensor), the control block as int64 (NumPy) and the
    base address for the C waits."""

    def __init__(self, fd: int, control: int) -> None:
        self.fd, self.control = fd, control
        self.size = 0
        self._map(os.fstat(fd).st_size)

    def _map(self, size: int) -> None:
        self.mm = mmap.mmap(self.fd, size)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.words = np.frombuffer(self.mm, dtype=np.int64, count=self.control // 8)
        self.base = self.bytes.data_ptr()
        self.size = size

    def reach(self, end: int) -> None:
        """Map at least ``end`` bytes of the file (a peer's outbox grew)."""
        if end > self.size:
            size = os.fstat(self.fd).st_size
            if end > size:
                raise ChannelError(f"a message ends at byte {end} of a shared file of {size} bytes")
            self._map(size)

    def grow(self, end: int) -> None:
        """Make this rank's own file hold at least ``end`` bytes."""
        if end > self.size:
            size = -(-max(end + end // 2, self.control + _FIRST_CAPACITY) // 4096) * 4096
            _reserve(self.fd, size)
            self._map(size)


def _copy_bytes(pieces: Sequence[Tensor], lo: int, hi: int, dst: Tensor) -> None:
    """Copy bytes [lo, hi) of the pieces (1-D uint8, read as one buffer) into ``dst`` [hi - lo]."""
    start = 0
    for piece in pieces:
        end = start + int(piece.numel())
        a, b = max(lo, start), min(hi, end)
        if a < b:
            dst[a - lo : b - lo].copy_(piece[a - start : b - start])
        if end >= hi:
            return
        start = end


class ShmChannel:
    """Exchanges between ``world`` ranks of one host; ``fds[r]`` is rank r's file (this rank's own
    included). Thread-safe: one exchange at a time."""

    def __init__(self, rank: int, world: int, fds: list[int], timeout_s: float) -> None:
        lib = native_library.library(required=True)
        if lib is None:
            raise OSError("the native library is needed for shared-memory exchanges")
        self._wait_c, self._post_c = lib.et_shm_wait, lib.et_shm_post
        self.rank, self.world, self.timeout_s = rank, world, float(timeout_s)
        self.fds = list(fds)
        control = _control_bytes(world)
        self.maps = [_Mapping(fd, control) for fd in fds]
        self._seq = 0
        self._lock = threading.Lock()
        self.broken: str | None = None
        self.peers = [(rank + k) % world for k in range(1, world)]

    # Offsets in a control block: the posted word, size and offset (int64 index) of the message for peer
    # p; the taken word (the last exchange whose messages this rank has copied out).
    @staticmethod
    def _posted(p: int) -> int:
        return _LINE * (1 + p)

    def _taken(self) -> int:
        return _LINE * (1 + self.world)

    def _fail(self, why: str, code: int) -> ChannelError:
        """Break the channel on every rank: record ``why`` here, publish ``code`` in this rank's header
        and move every word a peer may wait on past any exchange it can be in, so that each peer wakes,
        reads the code and raises too. The error to raise."""
        if self.broken is None:
            self.broken = why
            own = self.maps[self.rank]
            own.words[_BROKEN_WORD] = code
            poison = (self._seq + (1 << 30)) & _MASK
            for p in self.peers:
                self._post_c(own.base + self._posted(p), poison)
            self._post_c(own.base + self._taken(), poison)
        return ChannelError(f"shared-memory exchange: {self.broken}")

    def _wait(self, peer: int, offset: int, target: int, deadline: float, what: str) -> None:
        """Wait until peer's word at ``offset`` reaches ``target``; raise when the peer broke the channel
        instead (the word moved past ``target``: a peer that posted ``target`` and broke the channel later
        finished this exchange, and this rank finishes it too), is gone, or the timeout passed."""
        where = self.maps[peer]
        left = max(0.0, deadline - time.monotonic())
        rc = self._wait_c(where.base + offset, target, left, self.fds[peer])
        if rc:
            why = "did not arrive within the timeout" if rc == 1 else "is gone (its process exited)"
            raise self._fail(f"rank {peer} {why} during the {what}", _PEER_LOST)
        word = int(where.words[offset // 8]) & _MASK  # the 32-bit word, little-endian in its int64
        if word != target and (word - (1 << 30)) & _MASK != target:  # the poison of a peer past ``target``
            code = int(where.words[_BROKEN_WORD])
            reason = _REASONS.get(code, f"broke the channel (code {code})")
            raise self._fail(f"rank {peer} {reason} during the {what}", _PEER_FAILED)

    def exchange(
        self, send: Sequence[Tensor], send_bytes: list[int], recv_bytes: list[int] | None, what: str
    ) -> tuple[Tensor, list[int]]:
        """Send the bytes of ``send`` (1-D uint8 pieces, read as one buffer: ``send_bytes[r]`` bytes for
        rank r, in rank order; copied straight into the outbox, never concatenated) and return what every
        rank sent this one, concatenated in rank order, with the bytes from each rank. With
        ``recv_bytes`` those sizes are checked: a mismatch on any rank raises ``ChannelError`` on every
        rank in this exchange, and the channel stays in step.

        All or nothing on every rank: an exchange returns only when every rank has copied out what it was
        sent. Anything that stops it on one rank (an error, a peer gone, ``KeyboardInterrupt``) breaks
        the channel on all of them: each raises ``ChannelError`` in this exchange or, at the latest, in its
        next one, and every later call raises at once."""
        if sum(int(t.numel()) for t in send) != sum(send_bytes):
            raise ValueError(f"shared-memory exchange: {sum(send_bytes)} bytes to send, pieces of another size")
        with self._lock:
            if self.broken is not None:
                raise ChannelError(f"shared-memory exchange unusable: {self.broken} earlier")
            try:
                return self._exchange(send, send_bytes, recv_bytes, what)
            except _Refused:  # every rank raises it in the same exchange; the channel stays in step
                raise
            except ChannelError as exc:
                self._fail(str(exc), _FAILED)  # a no-op when it was this rank's own refusal
                raise
            except Exception as exc:
                why = f"rank {self.rank} failed during the {what} ({type(exc).__name__}: {exc})"
                raise self._fail(why, _FAILED) from exc
            except BaseException as exc:  # KeyboardInterrupt, SystemExit: the peers fail too; it goes on up
                self._fail(f"rank {self.rank} was interrupted during the {what} ({type(exc).__name__})", _FAILED)
                raise

    def _exchange(
        self, send: Sequence[Tensor], send_bytes: list[int], recv_bytes: list[int] | None, what: str
    ) -> tuple[Tensor, list[int]]:
        rank, own = self.rank, self.maps[self.rank]
        seq = (self._seq + 1) & _MASK
        deadline = time.monotonic() + self.timeout_s
        starts = np.concatenate([[0], np.cumsum(send_bytes)]).tolist()
        end = own.control + sum(send_bytes[p] for p in self.peers)
        try:  # the outbox is free: every peer took the previous exchange's messages before it returned
            own.grow(end)
        except OSError as exc:  # tell every peer at once, instead of letting them time out
            why = (
                f"rank {rank} could not grow its shared memory to {end} bytes ({exc}); give /dev/shm more room "
                "(docker run --shm-size=...) or set EMBTABLES_SHM=0 to exchange through the process group"
            )
            raise self._fail(why, _SHM_FULL) from exc
        at = own.control
        for p in self.peers:
            n = send_bytes[p]
            _copy_bytes(send, starts[p], starts[p] + n, own.bytes[at : at + n])
            line = self._posted(p) // 8
            own.words[line + 1], own.words[line + 2] = n, at
            at += n
        for p in self.peers:
            self._post_c(own.base + self._posted(p), seq)
        sizes, offsets = [0] * self.world, [0] * self.world  # read once, checked, then used as read
        sizes[rank] = send_bytes[rank]
        for p in self.peers:
            peer = self.maps[p]
            self._wait(p, self._posted(rank), seq, deadline, what)
            line = self._posted(rank) // 8
            n, at = int(peer.words[line + 1]), int(peer.words[line + 2])
            if n < 0 or at < peer.control:
                raise self._fail(f"rank {p} posted a message of {n} bytes at offset {at}", _FAILED)
            peer.reach(at + n)
            sizes[p], offsets[p] = n, at
        refused = recv_bytes is not None and list(recv_bytes) != sizes
        out = torch.empty(0 if refused else sum(sizes), dtype=torch.uint8)
        if not refused:
            out_starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            _copy_bytes(send, starts[rank], starts[rank + 1], out[out_starts[rank] : out_starts[rank + 1]])
            for p in self.peers:
                if sizes[p]:
                    piece = self.maps[p].bytes[offsets[p] : offsets[p] + sizes[p]]
                    out[out_starts[p] : out_starts[p + 1]].copy_(piece)
        own.words[self._taken() // 8 + 1] = seq if refused else -1
        self._post_c(own.base + self._taken(), seq)
        for p in self.peers:  # the exchange is complete once every rank has taken its messages
            self._wait(p, self._taken(), seq, deadline, what)
        self._seq = seq
        if refused:
            raise _Refused(
                f"the ranks disagree on the sizes of the {what}: rank {rank} expected {list(recv_bytes or [])} "
                f"bytes from the ranks and got {sizes}"
            )
        objecting = [p for p in self.peers if int(self.maps[p].words[self._taken() // 8 + 1]) == seq]
        if objecting:
            raise _Refused(
                f"the ranks disagree on the sizes of the {what}: rank {objecting[0]} received sizes it did not "
                f"expect (rank {rank} got {sizes} bytes)"
            )
        self._seq = seq
        return out, sizes

    def close(self) -> None:
        """Release the mappings and files (the lock on this rank's file goes with its descriptor)."""
        with self._lock:
            self.broken = self.broken or "the channel was closed"
            self.maps = []
            for fd in self.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.fds = []
