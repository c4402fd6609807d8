"""The sharded engine on the GPU backend: pooled bags and gradient sums go through each rank's local
backend (``GpuBackend.pool`` / ``prepare``), so sharded CUDA tables take the fused kernels where one process
does. Run here on CPU tensors through Triton's interpreter, over gloo, against one process on the same
backend: a row-returning table (with a sequence feature) and owner-pooled ones, div and mod."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from mp_world import run_world

import embtables as et
from embtables.kernels import gpu, native
from embtables.kernels.triton_interpreter import mend
from embtables.tables.backends import GpuBackend

BATCH = 4
STEPS = 2


def _gpu_on_cpu() -> bool:
    native.set_enabled(False)
    gpu.set_enabled(True, on_cpu=True)
    return gpu.usable(torch.device("cpu"))


def _config() -> dict[str, et.FeatureConfig]:
    opt = et.Adagrad(0.2)
    ta = et.TableConfig(9, 4, name="ta", combiner="mean", initializer=et.TruncatedNormal(seed=1), optimizer=opt)
    tb = et.TableConfig(7, 2, name="tb", combiner="sum", initializer=et.TruncatedNormal(seed=2), optimizer=opt)
    return {"a": et.FeatureConfig(ta), "s": et.FeatureConfig(ta, max_sequence_length=2), "b": et.FeatureConfig(tb)}


def _inputs(step: int, lo: int, hi: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(30 + step)
    ids = {
        "a": [torch.randint(0, 9, (1 + i % 3,), generator=g).tolist() for i in range(BATCH)],
        "s": [torch.randint(0, 9, (2,), generator=g).tolist() for _ in range(BATCH)],
        "b": [torch.randint(0, 7, (3,), generator=g).tolist() for _ in range(BATCH)],
    }
    return {k: et.Ragged.from_lists(v[lo:hi]) for k, v in ids.items()}


def _grads(step: int, acts: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7 + step)
    return {k: torch.randn((BATCH, *v.shape[1:]), generator=gen)[lo:hi] for k, v in sorted(acts.items())}


def _train(emb: et.DistributedEmbedding, lo: int, hi: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        acts = emb(_inputs(step, lo, hi))
        out.append({k: v.detach().clone() for k, v in acts.items()})
        emb.apply_gradients(_grads(step, acts, lo, hi))
    return out


def _rank(rank: int, world: int, sharding: str, ref_path: str) -> None:
    mend()  # a spawned rank: Triton's interpreter mended as in the test process
    os.environ["EMBTABLES_SHM"] = "0"
    assert _gpu_on_cpu()
    calls = {"pool": 0, "prepare": 0}
    for name in calls:
        real = getattr(GpuBackend, name)

        def counted(self: Any, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls[_name] += 1
            return _real(self, *args, **kw)

        setattr(GpuBackend, name, counted)
    emb = et.DistributedEmbedding(_config(), sharding=sharding)
    assert type(emb._engine.local.backend) is GpuBackend
    assert emb._engine.local.backend.checks.immediate  # sharded: every error raised in its call, on every rank
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    acts = _train(emb, lo, hi)
    assert calls["pool"] > 0 and calls["prepare"] > 0, calls
    ref = torch.load(ref_path)
    for got, want in zip(acts, ref["acts"]):
        for k, v in got.items():
            torch.testing.assert_close(v, want[k][lo:hi], rtol=1e-5, atol=1e-6)
    state = emb.state_dict()
    for k, v in ref["state"].items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("sharding", ["div", "mod"])
def test_sharded_tables_on_the_gpu_backend_equal_one_process(sharding: str, tmp_path: Path) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the GPU kernels on CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    try:
        if not _gpu_on_cpu():
            pytest.skip("Triton is not installed")
        one = et.DistributedEmbedding(_config())
        assert type(one._engine.local.backend) is GpuBackend
        ref = {"acts": _train(one, 0, BATCH), "state": {k: v.clone() for k, v in one.state_dict().items()}}
    finally:
        native.set_enabled(True)
        gpu.set_enabled(True)
    torch.save(ref, tmp_path / "ref.pt")
    run_world(_rank, 2, sharding, str(tmp_path / "ref.pt"), timeout=600)
