"""Snapshots of a module's tables and slots, and bit-for-bit comparison of two snapshots."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import embtables as et


def snapshot(emb: et.DistributedEmbedding) -> dict[str, Tensor]:
    """Clones of every table and slot, keyed "<table>" and "<table>/<slot>"."""
    return {k: v.detach().clone() for k, v in emb.state_dict().items()}


def assert_same(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    """The same keys, and every tensor bit-identical."""
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def assert_paths_agree(
    make: Callable[[], et.DistributedEmbedding],
    train: Callable[[et.DistributedEmbedding], list[Tensor]],
    fast: et.DistributedEmbedding,
    seen: list[Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> et.DistributedEmbedding:
    """Train ``make()`` by ``train`` on the general native path (the small-batch fast path declining every lookup
    and phase 2) and on the torch reference (the native kernels off), and assert that the activations ``seen`` and
    every table and slot of ``fast`` (trained the same way) are bit-identical to both. Returns the reference."""
    from embtables.kernels import native_library
    from embtables.tables.backends.native_fast_path import NativeFastPath

    with monkeypatch.context() as m:
        m.setattr(NativeFastPath, "lookup", lambda self, *args: None)
        m.setattr(NativeFastPath, "apply", lambda self, *args: False)
        general = make()
        seen_general = train(general)
    native_library.set_enabled(False)
    try:
        reference = make()
        seen_reference = train(reference)
    finally:
        native_library.set_enabled(True)
    for a, b, c in zip(seen, seen_general, seen_reference, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert_same(snapshot(fast), snapshot(general))
    assert_same(snapshot(fast), snapshot(reference))
    return reference
