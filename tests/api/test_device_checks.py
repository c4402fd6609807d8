"""When ``DeviceChecks`` reads an earlier call's posted flags (docs/gpu.md, "Errors"): at the start of the next
call when that call's work is already done, else at the end of the next call, after its own work is queued
(waiting for the earlier call only); either way the error is raised by the next call and names the call
that found it. The device's completion is played by a stand-in for the posting's CUDA event (on CUDA the
same path runs in ``test_gpu_deferred_errors.py`` with ``EMBTABLES_TEST_DEVICE=cuda``)."""

from __future__ import annotations

import pytest
import torch

from embtables.tables.backends.device_checks import DeviceChecks


class _Event:
    """A posting's event: ``done`` says whether the device finished the call's work."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.waits = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def _decode(values: list[int]) -> Exception | None:
    return ValueError(f"flag {values[0]}") if values[0] else None


def _post(checks: DeviceChecks, flag: int, what: str, event: _Event | None) -> None:
    checks.add([torch.tensor([flag])], _decode)
    checks.post(what)
    if event is not None:
        host, sizes, name, call, _ = checks._posted[-1]
        checks._posted[-1] = (host, sizes, name, call, event)  # type: ignore[assignment]


def test_flags_still_on_the_device_are_read_at_the_end_of_the_next_call() -> None:
    checks = DeviceChecks(torch.device("cpu"), immediate=False)
    busy = _Event(done=False)
    _post(checks, 1, "apply_gradients", busy)
    checks.raise_pending(wait=False)  # the next call starts: the earlier work is not done, nothing waits
    assert busy.waits == 0 and len(checks._posted) == 1
    with pytest.raises(ValueError, match=r"flag 1 \(Found on the GPU by apply_gradients of call 1"):
        _post(checks, 0, "the lookup", None)  # its work queued: now the earlier call is waited for
    assert busy.waits == 1
    assert checks._posted == []  # the raising call's own flags go too: it wrote nothing (refused)
    _post(checks, 0, "the lookup", None)  # training goes on
    checks.raise_pending()


def test_flags_already_on_the_host_are_read_at_the_start_of_the_next_call_without_waiting() -> None:
    checks = DeviceChecks(torch.device("cpu"), immediate=False)
    done = _Event(done=True)
    _post(checks, 2, "the lookup", done)
    with pytest.raises(ValueError, match="flag 2"):
        checks.raise_pending(wait=False)
    assert done.waits == 0


def test_a_clean_call_leaves_nothing_to_wait_for_and_settle_waits_for_everything() -> None:
    checks = DeviceChecks(torch.device("cpu"), immediate=False)
    first, second = _Event(done=False), _Event(done=False)
    _post(checks, 0, "the lookup", first)
    _post(checks, 0, "apply_gradients", second)  # reads the lookup's flags (waiting), keeps its own
    assert (first.waits, second.waits) == (1, 0) and len(checks._posted) == 1
    checks.settle()  # before a write that does not read ``refused``: everything, now
    assert second.waits == 1 and checks._posted == []
