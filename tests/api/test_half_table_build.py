"""A half-precision table is built at about its storage: TruncatedNormal (the default initializer) draws its
float32 values a block of rows at a time, rounded into the storage as they come, with the bits of one float32
draw rounded (it drew the whole table in float32 first: 3x the rows' storage at the peak)."""

from __future__ import annotations

import pytest
import torch
from subproc import run_python

import embtables as et
from embtables.tables import initializers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [7, None])
def test_the_block_draw_gives_the_bits_of_one_float32_draw(
    dtype: torch.dtype, seed: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(initializers, "_DRAW_VALUES", 1000)  # blocks of 15 rows of 64: many, and a short last one
    init = et.TruncatedNormal(stddev=0.3, seed=seed)
    torch.manual_seed(1)
    want = init((1003, 64)).to(dtype)
    torch.manual_seed(1)
    got = init((1003, 64), dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_a_module_of_half_tables_starts_as_with_the_whole_draw() -> None:
    torch.manual_seed(3)
    emb = et.DistributedEmbedding(
        {"f": et.FeatureConfig(et.TableConfig(2000, 24, name="t", dtype=torch.bfloat16))}, et.Adagrad(0.1)
    )
    torch.manual_seed(3)
    want = et.TruncatedNormal(stddev=1 / 24**0.5)((2000, 24)).to(torch.bfloat16)
    assert torch.equal(emb.embedding_tables["t"], want)


def test_a_half_table_is_built_at_its_storage() -> None:
    """bfloat16 rows and accumulators, 4M x 64 (1 GiB): the process's peak grows by at most 1.2x that."""
    out = run_python(
        """
        import resource, torch, embtables as et
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = et.TableConfig(4_000_000, 64, name="t", dtype=torch.bfloat16, slot_dtype=torch.bfloat16)
        emb = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adagrad(0.1))
        print("peak", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20)
        """,
        timeout=300,
    )
    peak = float(out.split()[-1])
    storage = 4_000_000 * 64 * 4 / 2**30  # GiB: 2 bytes a row value and 2 a slot value
    assert peak <= 1.2 * storage, (peak, storage)
