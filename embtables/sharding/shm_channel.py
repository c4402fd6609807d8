"""All-to-all exchanges between the ranks of one host through shared memory, not gloo's TCP.

Gloo over localhost sends every byte through the kernel's TCP stack: a copy into the kernel and one
out, on the cores the ranks compute on, and a small message waits 0.3-0.5 ms for its wake-up. On a
2-core machine this was a fifth of a sharded step's time (issue 17). When every rank of a process
group runs on one host, ``comm`` sends its per-step messages (all_to_all_v, phase headers, agreements)
through a ``ShmChannel`` instead; everything else stays on the process group.

Each rank owns one file in /dev/shm, mapped by every rank of the group and unlinked as soon as all of
them have opened it (nothing is left behind, even when a process is killed later). A file holds:

- a control block: per peer p, the sequence number of the last message this rank posted for p, with
  its size and offset, and the sequence number of the last message p has taken (acknowledged);
- the outbox: this rank's messages to every peer, side by side. It grows (``ftruncate``) when a
  message does not fit; the peers map the larger file when they see an offset past their mapping.

One exchange, number s on every rank: wait until every peer took message s - 1 from the outbox, copy
the rows for each peer into it, post s; then wait for every peer's post s, copy its rows out and
acknowledge. Posting and waiting are futex operations in C (``csrc/shm_sync.c``); a waiting rank
sleeps, and wakes when the peer posts, when the timeout of the process group passes, or when the
peer's process is gone (its shared ``flock`` on its file is released when it exits). A channel that
timed out or lost a peer is broken: every later call raises at once.

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
_MAGIC = 0x6574_7368_6D63_6831  # "etshmch1"
_FIRST_CAPACITY = 1 << 20
_MASK = 0xFFFF_FFFF


class ChannelError(RuntimeError):
    """The exchange could not complete: a peer is gone, timed out, or sent what this rank did not expect
    (``comm`` re-raises it as ``CollectiveError``)."""


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
    """Control block size: a header line, then per peer its posted line and its acknowledged line."""
    return -(-_LINE * (1 + 2 * world) // 4096) * 4096


def create_own(token: str, rank: int, world: int) -> int:
    """Create this rank's file (raises ``OSError``): control block plus a first outbox, locked shared
    for this process's lifetime (peers tell that it exited when they can lock it exclusively)."""
    fd = os.open(_path(token, rank), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        _reserve(fd, _control_bytes(world) + _FIRST_CAPACITY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.pwrite(fd, np.array([_MAGIC, world], dtype=np.int64).tobytes(), 0)
    except OSError:
        os.close(fd)
        unlink_own(token, rank)
        raise
    return fd


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

    # Offsets in a control block: posted word, size and offset (int64 index) for peer p; acknowledged word.
    @staticmethod
    def _posted(p: int) -> int:
        return _LINE * (1 + p)

    def _acked(self, p: int) -> int:
        return _LINE * (1 + self.world + p)

    def _wait(self, where: _Mapping, offset: int, target: int, peer: int, deadline: float, what: str) -> None:
        left = max(0.0, deadline - time.monotonic())
        rc = self._wait_c(where.base + offset, target, left, self.fds[peer])
        if rc:
            why = "did not arrive within the timeout" if rc == 1 else "is gone (its process exited)"
            self.broken = f"rank {peer} {why} during the {what}"
            raise ChannelError(f"shared-memory exchange: {self.broken}")

    def exchange(
        self, send: Sequence[Tensor], send_bytes: list[int], recv_bytes: list[int] | None, what: str
    ) -> tuple[Tensor, list[int]]:
        """Send the bytes of ``send`` (1-D uint8 pieces, read as one buffer: ``send_bytes[r]`` bytes for
        rank r, in rank order; copied straight into the outbox, never concatenated) and return what every
        rank sent this one, concatenated in rank order, with the bytes from each rank. With
        ``recv_bytes`` those sizes are checked (a mismatch raises ``ChannelError`` after taking every
        message, so the channel stays in step); without it, they are whatever the peers posted."""
        if sum(int(t.numel()) for t in send) != sum(send_bytes):
            raise ValueError(f"shared-memory exchange: {sum(send_bytes)} bytes to send, pieces of another size")
        with self._lock:
            if self.broken is not None:
                raise ChannelError(f"shared-memory exchange unusable: {self.broken} earlier")
            return self._exchange(send, send_bytes, recv_bytes, what)

    def _exchange(
        self, send: Sequence[Tensor], send_bytes: list[int], recv_bytes: list[int] | None, what: str
    ) -> tuple[Tensor, list[int]]:
        rank, own = self.rank, self.maps[self.rank]
        seq = (self._seq + 1) & _MASK
        deadline = time.monotonic() + self.timeout_s
        starts = np.concatenate([[0], np.cumsum(send_bytes)]).tolist()
        for p in self.peers:  # every peer has taken the previous message out of the outbox
            self._wait(own, self._acked(p), (seq - 1) & _MASK, p, deadline, what)
        end = own.control + sum(send_bytes[p] for p in self.peers)
        try:
            own.grow(end)
        except OSError as exc:  # tell every peer at once (a negative size), instead of letting them time out
            for p in self.peers:
                own.words[self._posted(p) // 8 + 1] = -1
                self._post_c(own.base + self._posted(p), seq)
            self.broken = (
                f"rank {rank} could not grow its shared memory to {end} bytes ({exc}); give /dev/shm more room "
                "(docker run --shm-size=...) or set EMBTABLES_SHM=0 to exchange through the process group"
            )
            raise ChannelError(f"shared-memory exchange: {self.broken}") from exc
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
            self._wait(peer, self._posted(rank), seq, p, deadline, what)
            line = self._posted(rank) // 8
            n, at = int(peer.words[line + 1]), int(peer.words[line + 2])
            if n < 0 or at < peer.control:
                why = f"posted a message of {n} bytes at offset {at}"
                self.broken = f"rank {p} could not send its message (its shared memory is full)" if n == -1 else why
                raise ChannelError(f"shared-memory exchange: {self.broken}")
            peer.reach(at + n)
            sizes[p], offsets[p] = n, at
        out = torch.empty(sum(sizes), dtype=torch.uint8)
        out_starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        _copy_bytes(send, starts[rank], starts[rank + 1], out[out_starts[rank] : out_starts[rank + 1]])
        for p in self.peers:
            peer = self.maps[p]
            if sizes[p]:
                out[out_starts[p] : out_starts[p + 1]].copy_(peer.bytes[offsets[p] : offsets[p] + sizes[p]])
            self._post_c(peer.base + self._acked(rank), seq)
        self._seq = seq
        if recv_bytes is not None and list(recv_bytes) != sizes:
            raise ChannelError(
                f"the ranks disagree on the sizes of the {what}: rank {rank} expected {list(recv_bytes)} bytes "
                f"from the ranks and got {sizes}"
            )
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
