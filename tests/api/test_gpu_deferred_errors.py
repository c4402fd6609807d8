"""The GPU step's error contract (docs/gpu.md, "Errors"): a steady-state step never waits for the device, so
what its kernels find (a broken input, an id outside its table, a non-finite activation, gradient or update)
is raised at the next call, naming the call that found it; the step that found it wrote nothing, nor did
anything after it, and training goes on normally once it is raised. ``EMBTABLES_GPU_ERRORS=immediate`` raises
in the call itself. The GPU kernels run on CPU tensors through Triton's interpreter, or on CUDA with
``EMBTABLES_TEST_DEVICE=cuda`` (``scripts/gpu_check.sh``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import TEST_DEVICE

import embtables as et
from embtables.kernels import gpu, native

ON_CUDA = TEST_DEVICE.type == "cuda"


@pytest.fixture(autouse=True)
def _gpu_kernels() -> Iterator[None]:
    if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the GPU kernels on CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    native.set_enabled(False)
    gpu.set_enabled(True, on_cpu=not ON_CUDA)
    gpu.set_deferred_errors(None)  # the default: deferred
    try:
        if not gpu.usable(TEST_DEVICE):
            pytest.skip("Triton is not installed")
        yield
    finally:
        native.set_enabled(True)
        gpu.set_enabled(True)
        gpu.set_deferred_errors(None)


def _module(optimizer: Any, *, accumulate_b: bool = True) -> et.DistributedEmbedding:
    b_opt = None if accumulate_b else et.SGD(0.1, use_gradient_accumulation=False)
    features = {
        "a": et.FeatureConfig(et.TableConfig(20, 4, name="ta", initializer=et.TruncatedNormal(seed=1))),
        "b": et.FeatureConfig(et.TableConfig(9, 4, name="tb", initializer=et.TruncatedNormal(seed=2), optimizer=b_opt)),
    }
    return et.DistributedEmbedding(features, optimizer, device=TEST_DEVICE)


def _batch(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    return {"a": et.Ragged.from_lists(a), "b": et.Ragged.from_lists(b)}


GOOD = _batch([[1, 2], [3]], [[0], [4, 5]])


def _tables(emb: et.DistributedEmbedding) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in emb.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _step(emb: et.DistributedEmbedding, batch: dict[str, Any], scale: float = 1.0) -> None:
    acts = emb(batch)
    (scale * sum(a.sum() for a in acts.values())).backward()
    emb.apply_gradients()


def test_the_backend_defers_by_default_and_immediate_is_a_choice() -> None:
    emb = _module(et.Adagrad(0.1))
    assert emb._engine.device_checks() is not None
    gpu.set_deferred_errors(False)
    assert emb._engine.device_checks() is None  # chosen again after the switch


def test_an_overflowing_update_is_raised_at_the_next_call_and_wrote_nothing() -> None:
    emb = _module(et.SGD(1e38))
    _step(emb, GOOD)
    changed = {k: v.tolist() for k, v in emb.changed_rows().items()}
    assert changed == {"ta": [1, 2, 3], "tb": [0, 4, 5]}  # marked by the write kernel
    before = _tables(emb)
    _step(emb, _batch([[9], [3]], [[8], [4]]), scale=1e30)  # returns: the dry run's finding is on the device
    assert _same(_tables(emb), before), "a refused step writes nothing"
    assert {k: v.tolist() for k, v in emb.changed_rows().items()} == changed, "and marks nothing"
    with pytest.raises(ValueError, match=r"table 't[ab]'.*non-finite.*apply_gradients of call \d+"):
        emb(GOOD)
    assert _same(_tables(emb), before)
    _step(emb, _batch([[10], [11]], [[7], [8]]), scale=1e-30)  # raised once: the next steps train again
    emb(GOOD)
    assert not _same(_tables(emb), before)


def test_an_id_outside_its_table_is_refused_on_the_device_and_raised_by_apply_gradients() -> None:
    emb = _module(et.Adagrad(0.1))
    _step(emb, GOOD)
    before = _tables(emb)
    acts = emb(_batch([[1, 2], [99]], [[0], [4]]))  # no sync at enqueue: the input rules are checked on the device
    sum(a.sum() for a in acts.values()).backward()
    with pytest.raises(ValueError, match=r"feature 'a'.*99"):  # convert()'s own message for the rule
        emb.apply_gradients()
    assert _same(_tables(emb), before)
    _step(emb, GOOD)
    assert not _same(_tables(emb), before)


def test_an_eval_lookup_raises_a_broken_input_at_the_next_lookup() -> None:
    emb = _module(et.Adagrad(0.1))
    emb.eval()
    with torch.no_grad():
        emb(_batch([[1, 2], [3]], [[0], [40]]))
        with pytest.raises(ValueError, match=r"feature 'b'.*40.*the lookup of call \d+"):
            emb(GOOD)
        emb(GOOD)  # raised once


def test_deferred_and_immediate_errors_train_the_same_bits() -> None:
    """Negative ids included, which the rules drop: deferred, the staging drops them in place on the device
    (rewritten -1, coefficient 0, not counted in the bag's mean); immediate, the general path removes them."""
    got = []
    for deferred in (True, False):
        gpu.set_deferred_errors(deferred)
        emb = _module(et.Adam(0.05))
        for s in range(3):
            _step(emb, _batch([[s, -1, 2], [3, s + 1]], [[0, s], [-5]]))
        got.append(_tables(emb))
    assert _same(got[0], got[1])


def test_a_step_with_writes_of_the_reference_reads_the_device_checks_first() -> None:
    """A table without gradient accumulation is written by the reference, which does not read the device's
    refusal: the step reads the GPU's checks (one sync) before anything is written, and raises in the call."""
    emb = _module(et.SGD(1e38), accumulate_b=False)
    _step(emb, GOOD)
    before = _tables(emb)
    acts = emb(GOOD)
    (1e30 * sum(a.sum() for a in acts.values())).backward()
    with pytest.raises(ValueError, match=r"table 'ta'.*non-finite"):
        emb.apply_gradients()
    assert _same(_tables(emb), before)


def test_a_pending_error_is_raised_before_the_tables_move() -> None:
    emb = _module(et.SGD(1e38))
    _step(emb, GOOD)
    _step(emb, GOOD, scale=1e30)
    with pytest.raises(ValueError, match=r"non-finite.*apply_gradients of call"):
        emb.to(TEST_DEVICE)  # a device move builds a new backend: the old one's finding is raised first


def test_tables_of_one_width_with_their_own_optimizers_train_as_the_torch_kernels() -> None:
    """Tables of one width: the lazy ones one group of phase 1, the non-lazy ones another; their optimizers (two
    SGD settings, Adagrad; two non-lazy Adam settings) split phase 2 into one launch pair each, every launch
    leaving the others' tables alone, the non-lazy group's updates over every row of its two tables."""

    def build() -> et.DistributedEmbedding:
        opts = [
            et.SGD(0.1),
            et.SGD(0.3),
            et.Adagrad(0.2),
            et.Adam(0.05, lazy_adam=False),
            et.Adam(0.02, lazy_adam=False),
        ]
        tables = [
            et.TableConfig(15 + i, 4, name=f"t{i}", initializer=et.TruncatedNormal(seed=i), optimizer=o)
            for i, o in enumerate(opts)
        ]
        features = {f"f{i}": et.FeatureConfig(t) for i, t in enumerate(tables)}
        return et.DistributedEmbedding(features, et.Adam(0.01), device=TEST_DEVICE)

    def train(emb: et.DistributedEmbedding) -> dict[str, torch.Tensor]:
        for s in range(3):
            batch = {f"f{i}": et.Ragged.from_lists([[s, i, 2], [3 + i], [s + 1, s + 1]]) for i in range(5)}
            _step(emb, batch, scale=1.0 + s)
        return _tables(emb)

    on_gpu = build()
    gpu_tables = train(on_gpu)
    assert on_gpu._engine.local.backend.name == "gpu"
    gpu.set_enabled(False)
    torch_tables = train(build())
    assert gpu_tables.keys() == torch_tables.keys()
    for k in gpu_tables:
        torch.testing.assert_close(gpu_tables[k], torch_tables[k], rtol=2e-6, atol=1e-7)


def test_pipelined_training_defers_too_and_loses_no_error() -> None:
    """Pipelined, a step's update lands after the next lookup (two calls posted before the host reads either):
    the same tables as synchronous training, and an overflow is still raised, with nothing written."""
    sync, piped = _module(et.Adagrad(0.3)), _module(et.Adagrad(0.3))
    piped = et.DistributedEmbedding(piped._feature_config, et.Adagrad(0.3), pipeline_execution_with_tensor_core=True,
                                    device=TEST_DEVICE)  # fmt: skip
    for s in range(3):
        batch = _batch([[s, 2], [3]], [[0], [4, s + 1]])
        _step(sync, batch)
        _step(piped, batch)
    piped.flush()
    assert _same(_tables(piped), _tables(sync))
    bad = et.DistributedEmbedding(piped._feature_config, et.SGD(1e38), pipeline_execution_with_tensor_core=True,
                                  device=TEST_DEVICE)  # fmt: skip
    _step(bad, GOOD)
    with pytest.raises(ValueError, match="non-finite"):
        for _ in range(3):
            _step(bad, GOOD, scale=1e30)


def test_save_raises_a_pending_error_before_it_writes(tmp_path: Any) -> None:
    emb = _module(et.SGD(1e38))
    _step(emb, GOOD)
    _step(emb, GOOD, scale=1e30)  # the last step of a loop: no later call would raise it
    with pytest.raises(ValueError, match=r"non-finite.*apply_gradients of call"):
        emb.save(tmp_path / "ckpts")
    assert not (tmp_path / "ckpts").exists() or not any((tmp_path / "ckpts").iterdir())
    emb.save(tmp_path / "ckpts")  # raised once: saved now
