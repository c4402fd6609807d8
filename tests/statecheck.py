"""Snapshots of a module's tables and slots, and bit-for-bit comparison of two snapshots."""

from __future__ import annotations

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
