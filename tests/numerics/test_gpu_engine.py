"""The engine with its tables on the GPU: the fused kernels against the torch kernels on the same device,
errors that change nothing, checkpoints from CUDA into CPU and back, and the NCCL process-group path.

On CUDA (``EMBTABLES_TEST_DEVICE=cuda``) everything runs on the GPU. Without CUDA, the tests that need only
the kernels run on CPU tables through Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` when Triton is installed); the others skip.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TEST_DEVICE

import embtables as et
from embtables.errors import InputError
from embtables.kernels import gpu, native

ON_CUDA = TEST_DEVICE.type == "cuda"


@pytest.fixture(autouse=True)
def _device() -> Any:
    if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs EMBTABLES_TEST_DEVICE=cuda (or TRITON_INTERPRET=1 for the kernels on the CPU)")
    if not ON_CUDA:
        native.set_enabled(False)
    gpu.set_enabled(True, on_cpu=not ON_CUDA)
    gpu.set_deferred_errors(False)  # these tests expect each error in the call that finds it
    if not gpu.usable(TEST_DEVICE):
        pytest.skip("the fused GPU kernels need Triton")
    yield
    gpu.set_enabled(True)
    gpu.set_deferred_errors(None)
    native.set_enabled(True)


def _module(optimizer: et.config.Optimizer, concat: bool = False, device: Any = TEST_DEVICE) -> et.DistributedEmbedding:
    gen = torch.Generator().manual_seed(5)
    inits = {name: torch.randn(v, d, generator=gen) * 0.1 for name, v, d in (("a", 30, 8), ("b", 12, 4))}

    def init(name: str) -> Any:
        return lambda shape, dtype=torch.float32: inits[name].clone().to(dtype)

    a = et.TableConfig(30, 8, initializer=init("a"), combiner="mean", name="a")
    b = et.TableConfig(12, 4, initializer=init("b"), combiner="sqrtn", name="b")
    features = {"x": et.FeatureConfig(a), "y": et.FeatureConfig(a), "z": et.FeatureConfig(b)}
    return et.DistributedEmbedding(features, optimizer, device=device, concat_activations=concat)


def _batch(step: int, batch: int = 6) -> tuple[dict[str, Any], dict[str, Any]]:
    gen = torch.Generator().manual_seed(100 + step)
    feats, weights = {}, {}
    for name, vocab in (("x", 30), ("y", 30), ("z", 12)):
        lists = [
            torch.randint(0, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(0, 4, (batch,), generator=gen)
        ]
        feats[name] = et.Ragged.from_lists(lists)
        weights[name] = (
            None
            if name == "y"
            else et.Ragged.from_lists(
                [torch.rand(len(r), generator=gen).add(0.5).tolist() for r in lists], dtype=torch.float32
            )
        )
    return feats, weights


def _train(emb: et.DistributedEmbedding, steps: int, concat: bool = False) -> list[torch.Tensor]:
    acts_seen = []
    for step in range(steps):
        feats, weights = _batch(step)
        acts = emb(feats, weights)
        out = acts if concat else torch.cat([acts[k] for k in ("x", "y", "z")], dim=1)
        gen = torch.Generator().manual_seed(200 + step)
        g = torch.randn(out.shape, generator=gen).to(out.device)
        (out * g).sum().backward()
        emb.apply_gradients()
        acts_seen.append(out.detach().cpu())
    return acts_seen


OPTIMIZERS = {
    "adagrad": lambda: et.Adagrad(0.3, initial_accumulator_value=0.1),
    "adam_lazy": lambda: et.Adam(0.05),
    "adam_dense": lambda: et.Adam(0.05, lazy_adam=False, weight_decay_factor=0.01),
    "sgd_clips": lambda: et.SGD(0.2, clipvalue=0.3, clip_weight_max=0.25),
    "ftrl": lambda: et.FTRL(0.2, l1_regularization_strength=0.01),
    "rmsprop": lambda: et.CenteredRMSProp(0.05, rho=0.9, momentum=0.3, epsilon=1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("concat", [False, True])
def test_fused_kernels_match_the_torch_kernels_on_the_same_device(name: str, concat: bool) -> None:
    fused = _module(OPTIMIZERS[name](), concat)
    reference = _module(OPTIMIZERS[name](), concat)
    acts_fused = _train(fused, 2, concat)  # the second step reads the rows and slots the first one wrote
    gpu.set_enabled(False)
    acts_ref = _train(reference, 2, concat)
    for a, b in zip(acts_fused, acts_ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
    for table in ("a", "b"):
        torch.testing.assert_close(
            fused.embedding_tables[table].cpu(), reference.embedding_tables[table].cpu(), rtol=2e-6, atol=2e-7
        )
        for slot, value in fused.slot_variables[table].items():
            torch.testing.assert_close(value.cpu(), reference.slot_variables[table][slot].cpu(), rtol=2e-6, atol=2e-7)
        assert fused.embedding_tables[table].device.type == TEST_DEVICE.type


def _snapshot(emb: et.DistributedEmbedding) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in emb.state_dict().items() if isinstance(v, torch.Tensor)}


def _unchanged(emb: et.DistributedEmbedding, before: dict[str, torch.Tensor]) -> None:
    after = _snapshot(emb)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k


def test_a_non_finite_gradient_changes_nothing() -> None:
    emb = _module(et.Adagrad(0.1))
    _train(emb, 1)
    before = _snapshot(emb)
    feats, weights = _batch(7)
    acts = emb(feats, weights)
    grads = {k: torch.zeros_like(v) for k, v in acts.items()}
    grads["z"][0, 1] = float("nan")
    with pytest.raises(InputError, match=r"table 'b'.*NaN or Inf"):
        emb.apply_gradients(grads)
    _unchanged(emb, before)


def test_an_overflowing_update_names_the_row_and_changes_nothing() -> None:
    emb = _module(et.SGD(1e38))
    before = _snapshot(emb)
    feats = {"x": et.Ragged.from_lists([[3]]), "y": et.Ragged.from_lists([[]]), "z": et.Ragged.from_lists([[5]])}
    acts = emb(feats)
    grads = {k: torch.zeros_like(v) for k, v in acts.items()}
    grads["x"][0, 0] = -1e38
    grads["z"][0, 0] = 1.0
    with pytest.raises(InputError, match=r"table 'a'.*row 3"):
        emb.apply_gradients(grads)
    _unchanged(emb, before)


def test_an_id_outside_the_table_is_refused_with_its_feature() -> None:
    emb = _module(et.SGD(0.1))
    with pytest.raises((InputError, ValueError), match="'z'"):
        emb({"x": et.Ragged.from_lists([[1]]), "y": et.Ragged.from_lists([[2]]), "z": et.Ragged.from_lists([[12]])})


def test_pipelined_training_matches_synchronous_training() -> None:
    sync = _module(et.Adagrad(0.3))
    piped = et.DistributedEmbedding(
        sync._feature_config, et.Adagrad(0.3), pipeline_execution_with_tensor_core=True, device=TEST_DEVICE
    )
    piped.load_state_dict(sync.state_dict())
    _train(sync, 3)
    _train(piped, 3)
    piped.flush()
    for table in ("a", "b"):
        torch.testing.assert_close(piped.embedding_tables[table].cpu(), sync.embedding_tables[table].cpu())


@pytest.mark.skipif(not ON_CUDA, reason="moves tables between CUDA and the CPU")
def test_checkpoints_from_cuda_restore_on_the_cpu_and_back(tmp_path: Path) -> None:
    cuda = _module(et.Adam(0.05))
    _train(cuda, 2)
    cuda.save(tmp_path / "from_cuda")
    cpu = _module(et.Adam(0.05), device="cpu")
    cpu.restore(tmp_path / "from_cuda")
    for table in ("a", "b"):
        assert torch.equal(cpu.embedding_tables[table], cuda.embedding_tables[table].cpu())
    acts_cpu, acts_cuda = _train(cpu, 2), _train(cuda, 2)
    for a, b in zip(acts_cpu, acts_cuda):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    cpu.save(tmp_path / "from_cpu")
    back = _module(et.Adam(0.05))
    back.restore(tmp_path / "from_cpu")
    for table in ("a", "b"):
        assert back.embedding_tables[table].device.type == "cuda"
        assert torch.equal(back.embedding_tables[table].cpu(), cpu.embedding_tables[table])
    moved = copy.deepcopy(cpu).to("cuda")
    assert moved.embedding_tables["a"].device.type == "cuda"
    _train(moved, 1)


@pytest.mark.skipif(not ON_CUDA, reason="NCCL needs CUDA")
def test_the_process_group_path_runs_over_nccl() -> None:
    """One GPU: a world of one rank over NCCL, through the sharded engine (EMBTABLES_SHARD_ONE_RANK=1)."""
    from one_rank_world import run_one_rank_world

    assert run_one_rank_world("nccl", "cuda") == "ShardedEmbeddingCollection"


@pytest.mark.parametrize(("second", "finite"), [(-3e38, True), (3e38, False)])
def test_gradients_too_large_for_the_bound_are_summed_exactly(second: float, finite: bool) -> None:
    """Row 4 of table 'b' gets 3e38 from one bag and ``second`` from another: the deferred sums' bound
    (2 x 3e38) proves nothing, so phase 1 sums exactly: 0 updates nothing; inf is refused, nothing changed."""
    emb = _module(et.SGD(0.1))
    before = _snapshot(emb)
    feats = {name: et.Ragged.from_lists([[1], [2]]) for name in ("x", "y")}
    feats["z"] = et.Ragged.from_lists([[4], [4]])
    acts = emb(feats)
    grads = {k: torch.zeros_like(v) for k, v in acts.items()}
    grads["z"][0] = 3e38
    grads["z"][1] = second
    if finite:
        emb.apply_gradients(grads)
        _unchanged(emb, before)
    else:
        with pytest.raises(InputError, match=r"table 'b'.*NaN or Inf"):
            emb.apply_gradients(grads)
        _unchanged(emb, before)
