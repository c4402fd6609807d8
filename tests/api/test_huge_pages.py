"""Large CPU tables and slots live in transparent huge pages (``kernels/huge_pages.py``): the kernel marks
their memory ``hg`` (MADV_HUGEPAGE) before the first write; ``EMBTABLES_HUGE_PAGES=0`` opts out, and the
values are the same either way."""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

import fast_child
import pytest
import torch

import embtables as et
from embtables.kernels import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages available (madvise or always)",
)

_PROBE = """
import hashlib, torch, embtables as et
emb = et.DistributedEmbedding({"f": et.FeatureConfig(et.TableConfig(100_000, 64, name="t",
                              initializer=et.TruncatedNormal(seed=3)))}, optimizer=et.Adagrad(0.1))
state = emb.state_dict()
print(*(hashlib.sha256(state[k].numpy().tobytes()).hexdigest() for k in ("t", "t/accumulators")))
"""


def _vm_flags(t: torch.Tensor) -> set[str]:
    """The VmFlags of the mapping holding the middle of ``t``'s bytes."""
    address = t.data_ptr() + t.numel() * t.element_size() // 2
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= address < hi:
            flags = next(line for line in block.splitlines() if line.startswith("VmFlags:"))
            return set(flags.split()[1:])
    raise AssertionError("no mapping holds the tensor")


def _module() -> et.DistributedEmbedding:
    table = et.TableConfig(100_000, 64, name="t", initializer=et.TruncatedNormal(seed=3))
    return et.DistributedEmbedding({"f": et.FeatureConfig(table)}, optimizer=et.Adagrad(0.1))


def test_a_large_table_and_its_slots_are_advised_into_huge_pages() -> None:
    emb = _module()
    state = emb.state_dict()
    for key in ("t", "t/accumulators"):
        assert "hg" in _vm_flags(state[key]), key
    # a small tensor, or one on another device, keeps ordinary pages
    assert not huge_pages.advise(torch.zeros(1000))
    assert huge_pages.advise(torch.zeros(huge_pages.MIN_BYTES // 4 + 1))


def test_opting_out_keeps_ordinary_pages_and_the_same_values() -> None:
    out = fast_child.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True, text=True, timeout=120, env={**os.environ, "EMBTABLES_HUGE_PAGES": "0"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    state = _module().state_dict()  # the same bytes (a float sum's last digit depends on the thread count)
    want = " ".join(hashlib.sha256(state[k].numpy().tobytes()).hexdigest() for k in ("t", "t/accumulators"))
    assert out.stdout.strip() == want
    probe = "from embtables.kernels import huge_pages; import torch; print(huge_pages.advise(torch.zeros(2**23)))"
    got = fast_child.run(
        [sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=60, env={**os.environ, "EMBTABLES_HUGE_PAGES": "0"},
    )  # fmt: skip
    assert got.stdout.strip() == "False", got.stderr[-2000:]
