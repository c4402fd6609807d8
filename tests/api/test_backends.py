"""The backend of a collection (``tables/backends/``): chosen once for the tables' device, chosen again after
a device move or a switch of the kernels, never per step; a copy or a pickle chooses its own; the torch
reference serves what a backend leaves, with the same bits where the native kernels are bit-exact."""

from __future__ import annotations

import copy
import pickle

import torch

import embtables as et
from embtables.kernels import native
from embtables.tables.backends import NativeBackend, TorchBackend


def _module(**kw: object) -> et.DistributedEmbedding:
    ta = et.TableConfig(20, 4, name="ta", initializer=et.TruncatedNormal(seed=1))
    tq = et.TableConfig(9, 3, name="tq", initializer=et.TruncatedNormal(seed=2),
                        quantization_config=et.QuantizationConfig(num_buckets=256, lower=-1.0, upper=1.0))  # fmt: skip
    return et.DistributedEmbedding({"a": et.FeatureConfig(ta), "q": et.FeatureConfig(tq)}, et.Adagrad(0.1), **kw)


def _step(emb: et.DistributedEmbedding, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    acts = emb({"a": et.Ragged.from_lists([[1, 2], [3]]), "q": et.Ragged.from_lists([[0], [4, 5]])})
    emb.apply_gradients({k: torch.randn(v.shape, generator=g) for k, v in acts.items()})
    return {k: v.detach().clone() for k, v in acts.items()}


def test_the_backend_is_chosen_once_and_again_after_a_switch() -> None:
    emb = _module()
    coll = emb._engine.local
    first = coll.backend
    assert isinstance(first, NativeBackend)
    _step(emb, 0)
    assert coll.backend is first  # the same object every step
    native.set_enabled(False)
    try:
        assert isinstance(coll.backend, TorchBackend)
        _step(emb, 1)  # prepared nowhere natively: the reference serves every table
    finally:
        native.set_enabled(True)
    assert isinstance(coll.backend, NativeBackend) and coll.backend is not first
    coll.map_tensors(lambda t: t.clone())  # a device move replaces the tensors: chosen again
    assert coll.backend is not first and coll.backend.tables.states["ta"].weights is coll.states["ta"].weights


def test_a_quantized_feature_is_left_to_the_reference_with_the_same_bits() -> None:
    native_run, torch_run = _module(), _module()
    acts_native = [_step(native_run, s) for s in range(3)]
    native.set_enabled(False)
    try:
        acts_torch = [_step(torch_run, s) for s in range(3)]
    finally:
        native.set_enabled(True)
    for a, b in zip(acts_native, acts_torch):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(v, torch_run.state_dict()[k]) for k, v in native_run.state_dict().items())


def test_a_copy_or_a_pickle_chooses_its_own_backend_and_trains_the_same() -> None:
    emb = _module()
    _step(emb, 0)
    for other in (copy.deepcopy(emb), pickle.loads(pickle.dumps(emb))):
        coll = other._engine.local
        assert coll.backend is not emb._engine.local.backend
        assert coll.backend.tables.states is coll.states
        assert torch.equal(_step(other, 1)["a"], _step(copy.deepcopy(emb), 1)["a"])


def test_a_collection_pickled_without_a_table_set_loads() -> None:
    """A pickle from before the backends: native scratch under other names, no TableSet."""
    emb = _module()
    _step(emb, 0)
    coll = emb._engine.local
    old = {k: v for k, v in coll.__getstate__().items() if k not in ("_switches",)}
    old.update({"_workspaces": {}, "_param_blocks": {}, "_fast": None})
    fresh = type(coll).__new__(type(coll))
    fresh.__setstate__(old)
    assert isinstance(fresh.backend, NativeBackend) and fresh.states is old["states"]
    assert not hasattr(fresh, "_fast") and not hasattr(fresh, "_workspaces")
