"""A module is freed when its last reference goes, not at a later garbage collection: none of its parts (the
native backend and its fast path, the tables, an offloaded table's cache and files) hold it or each other in a
reference cycle, so a loop that builds modules (a search over configurations) keeps the memory of one."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

import embtables as et


@pytest.mark.parametrize("offloaded", [False, True])
@pytest.mark.parametrize("pipelined", [False, True])
def test_a_trained_module_is_freed_when_its_last_reference_goes(
    offloaded: bool, pipelined: bool, tmp_path: Path
) -> None:
    offload = et.Offload(tmp_path, 256) if offloaded else None
    table = et.TableConfig(5_000, 8, name="t", offload=offload)
    emb = et.DistributedEmbedding(
        {"f": et.FeatureConfig(table)}, et.Adagrad(0.1), pipeline_execution_with_tensor_core=pipelined
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # the general path, then the small-batch fast path once its tables are staged
        a = emb({"f": torch.randint(0, 5_000, (16, 2), generator=g)})["f"]
        emb.apply_gradients({"f": torch.ones_like(a)})
    weights = weakref.ref(emb.embedding_tables["t"]) if not offloaded else None
    alive = weakref.ref(emb)
    gc.collect()
    gc.disable()
    try:
        del emb, a
        assert alive() is None, "the module is held by a reference cycle"
        assert weights is None or weights() is None, "its table is held by a reference cycle"
    finally:
        gc.enable()
