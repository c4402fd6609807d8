"""``DeviceChecks``: the errors a GPU step finds on the device, raised without making the host wait.

The kernels of a step record what they find in small flag tensors on the device (an input that breaks a
rule, an id outside its table, a non-finite activation, a gradient or an update that would not be finite)
and set one sticky cell, ``refused``, that every kernel that writes a table or slot reads first: while it
is set nothing is written, in this step or any later one. At the end of a call (a lookup, or the writes of
``apply_gradients``) the flags are copied to host memory without waiting (``post``: one concatenation and
one non-blocking copy, with an event). The next call reads that copy: at its start when the earlier work
is already done (``raise_pending(wait=False)``), else at its end, once its own work is queued behind the
earlier call's (``post`` waits for the earlier calls only, so the device never idles for it). When a flag
is set it clears ``refused`` and raises the error, naming the call that found it. So a steady-state step
makes no host synchronisation of its own, and an error keeps its meaning: the step that raised it wrote
nothing, nor did any step between it and the raise.

``immediate`` (``EMBTABLES_GPU_ERRORS=immediate``, or ``gpu.set_deferred_errors(False)``): every call reads
its own flags before it returns (one sync per call) and raises there, as the CPU backends do.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# A decoder turns the values (Python ints) of the flags it was added with into the error to raise, or None
Decoder = Callable[[list[int]], "Exception | None"]

_HOST_COPIES: weakref.WeakSet[Tensor] = weakref.WeakSet()


def is_host_copy(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a host copy of posted flags (reading it waits for no work of its own call)."""
    return any(tensor.untyped_storage().data_ptr() == c.untyped_storage().data_ptr() for c in _HOST_COPIES)


class DeviceChecks:
    """The flags of the calls of one GPU backend on ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device, *, immediate: bool) -> None:
        self.device = device
        self.immediate = immediate
        self.refused = torch.zeros(1, dtype=torch.int64, device=device)
        self.calls = 0
        self._pending: list[tuple[Tensor, Decoder]] = []
        # posted calls not read yet, oldest first (two when a pipelined update lands after the next lookup)
        self._posted: list[tuple[Tensor, list[tuple[int, Decoder]], str, int, torch.cuda.Event | None]] = []

    def add(self, flags: Sequence[Tensor], decode: Decoder) -> None:
        """Record ``flags`` (integer tensors on the device, unread) of the current call, decoded together by
        ``decode``."""
        flat = [f.reshape(-1) for f in flags]
        self._pending.append((flat[0] if len(flat) == 1 else torch.cat(flat), decode))

    def post(self, what: str) -> None:
        """End of a call: copy its flags to the host without waiting (``immediate``: read them and raise),
        then raise what the earlier calls' flags hold (waiting for those calls, whose work ran before this
        one's)."""
        self.calls += 1
        before = len(self._posted)
        self._flush(what, self.calls, immediate=self.immediate)
        self._read(keep=len(self._posted) - before)  # this call's posting stays for the next call

    def _flush(self, what: str, call: int, *, immediate: bool) -> None:
        """The pending flags of ``call``: read and raised now (``immediate``), else copied to the host
        without waiting, for ``raise_pending``."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        flat = pending[0][0] if len(pending) == 1 else torch.cat([f for f, _ in pending])
        if flat.dtype != torch.int64:
            flat = flat.to(torch.int64)
        sizes, at = [], 0
        for f, decode in pending:
            sizes.append((at, decode))
            at += f.numel()
        if immediate:
            self._raise(what, call, flat.tolist(), sizes, deferred=False)  # the call's one sync
            return
        host = torch.empty(flat.shape, dtype=torch.int64, pin_memory=flat.is_cuda)
        _HOST_COPIES.add(host)
        host.copy_(flat, non_blocking=True)
        event = None
        if flat.is_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        self._posted.append((host, sizes, what, call, event))

    def raise_pending(self, *, wait: bool = True) -> None:
        """Raise what the earlier calls' flags hold, the oldest first, waiting for those calls; with
        ``wait=False`` (the start of a call) only what is already on the host (``post`` reads the rest)."""
        self._read(keep=0, wait=wait)

    def _read(self, *, keep: int, wait: bool = True) -> None:
        """Read and raise the posted calls' flags, oldest first, all but the newest ``keep``."""
        while len(self._posted) > keep:
            host, sizes, what, call, event = self._posted[0]
            if event is not None and not event.query():  # type: ignore[no-untyped-call]
                if not wait:
                    return
                event.synchronize()
            self._posted.pop(0)
            try:
                self._raise(what, call, host.tolist(), sizes, deferred=True)
            except BaseException:
                self._posted.clear()  # one error a raise: the later calls wrote nothing (refused)
                raise

    def settle(self) -> None:
        """Raise now what the current call found so far and what earlier calls did (one sync): before a
        write that does not read ``refused`` (the reference's, a pipelined check)."""
        self.raise_pending()
        self._flush("this call", self.calls + 1, immediate=True)  # the call goes on: not counted yet

    def _raise(
        self, what: str, call: int, values: list[int], sizes: Sequence[tuple[int, Decoder]], *, deferred: bool
    ) -> None:
        bounds = [*(at for at, _ in sizes[1:]), len(values)]
        for (at, decode), end in zip(sizes, bounds):
            error = decode(values[at:end])
            if error is not None:
                self.refused.zero_()  # raised: the next step is not refused
                if deferred:
                    error = type(error)(
                        f"{error} (Found on the GPU by {what} of call {call} and raised at the next call; nothing was "
                        "written since. EMBTABLES_GPU_ERRORS=immediate raises in the call itself.)"
                    )
                raise error
