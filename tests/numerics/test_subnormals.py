"""Subnormal float32 values are flushed to zero, as TF's CPU kernels and TPUs do (docs/spec.md §1.5): a
subnormal operand reads as zero and a subnormal result is written as zero, in lookups, gradient sums, updates
and derived constants, on every kernel path (the C kernels with the CPU's FTZ/DAZ modes, the torch path in
software, the GPU kernels in their code) and in the float64 oracle.

Tables, gradients and weights here mix subnormals, normal values near the smallest normal (whose updates land in
the subnormal range) and ordinary values; each test also checks that its data would give other values without
the flush, so it fails if a path stops flushing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE, tol_for
from oracle.np_engine import OracleEngine
from oracle.np_optimizers import _update_row, update_row
from oracle.np_subnormals import SMALLEST_NORMAL
from scenarios import oracle_optimizer

import embtables as et
from embtables.kernels import native

OPTIMIZERS: dict[str, Any] = {
    "SGD": lambda: et.SGD(0.5),
    "Adagrad": lambda: et.Adagrad(0.5),
    "AdagradMomentum": lambda: et.AdagradMomentum(0.1, momentum=0.9),
    "Adam": lambda: et.Adam(0.1),
    "FTRL": lambda: et.FTRL(0.1, l2_regularization_strength=0.1),
    "ProximalAdagrad": lambda: et.ProximalAdagrad(0.1, l2_regularization_strength=0.1),
    "Momentum": lambda: et.Momentum(0.5, momentum=0.5),
    "RMSProp": lambda: et.RMSProp(0.05, momentum=0.5),
    "CenteredRMSProp": lambda: et.CenteredRMSProp(0.05, momentum=0.5, epsilon=1e-3),
    "Adadelta": lambda: et.Adadelta(1.0),
    "ProximalYogi": lambda: et.ProximalYogi(0.05),
    "SGD_no_accumulation": lambda: et.SGD(0.5, use_gradient_accumulation=False),
}
V, D = 12, 4

# rows 0-3 subnormal, 4-7 normal near 2^-126 (their updates land in the subnormal range), 8-11 ordinary
TABLE = np.array(
    [[1e-39, -5e-41, 1.1e-38, -1e-45]] * 4 + [[2e-38, -2e-38, 3e-38, 1.5e-38]] * 4 + [[0.5, -0.25, 0.125, 1.0]] * 4,
    dtype=np.float32,
)
# one id per sample; rows 0, 4 and 8 twice (their two gradients are summed)
IDS = [[0], [1], [2], [4], [5], [6], [8], [9], [0], [4], [8]]
GRADS = np.array(
    [
        [1e-39, -3e-40, 0.3, 1e-20],  # row 0: subnormal, subnormal, ordinary, g^2 subnormal
        [3e-38, 1e-39, -1e-20, 0.0],
        [1e-39, 1e-39, 1e-39, 1e-39],
        [3e-38, -3e-38, 4e-38, 2e-38],  # row 4: SGD's w - 0.5 g is subnormal
        [1e-39, 1e-20, 0.25, -0.5],
        [-2e-38, 2e-38, 1e-39, 0.0],
        [1e-39, 1e-20, -0.3, 0.2],
        [2e-38, -1.9e-38, 0.0, 0.1],
        [-2e-39, 3e-40, 0.1, 1e-20],  # row 0 again: partial sums of subnormals
        [-1.5e-38, 1.4e-38, 0.0, 0.0],  # row 4 again: the sum of two normals is subnormal
        [0.1, 1e-20, 0.0, 1e-39],
    ],
    dtype=np.float32,
)
TOUCHED = sorted({i for ids in IDS for i in ids})


def _engine(opt: Any) -> et.DistributedEmbedding:
    init = TABLE.copy()
    table = et.TableConfig(
        V, D, name="t", combiner="sum", initializer=lambda shape, dtype=torch.float32: torch.from_numpy(init).to(dtype)
    )
    return et.DistributedEmbedding({"f": et.FeatureConfig(table)}, opt, device=TEST_DEVICE)


def _oracle(opt: Any) -> OracleEngine:
    tables = {"t": {"weights": TABLE.astype(np.float64), "combiner": "sum", "optimizer": oracle_optimizer(opt)}}
    return OracleEngine(tables, [{"table": "t"}])


def _step(emb: et.DistributedEmbedding) -> torch.Tensor:
    acts = emb({"f": et.Ragged.from_lists(IDS)})["f"].detach().cpu()
    emb.apply_gradients({"f": torch.from_numpy(GRADS.copy()).to(TEST_DEVICE)})
    return acts


def _assert_flushed_close(actual: torch.Tensor, expected: np.ndarray, rtol: float, what: str) -> None:
    """Relative closeness with no absolute slack: where the oracle flushed to zero, the engine must hold 0."""
    a = actual.detach().double().cpu().numpy()
    written = a if a.shape[0] != V else a[TOUCHED]  # a row no update touches keeps what it held
    assert not np.any((np.abs(written) < SMALLEST_NORMAL) & (written != 0)), f"{what}: a subnormal value was written"
    np.testing.assert_allclose(a, expected, rtol=rtol, atol=0, err_msg=what)


@pytest.fixture
def path(kernel_path: str) -> str:
    """The native C kernels, the torch path and the fused GPU kernels (``conftest.kernel_path``)."""
    return kernel_path


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_updates_flush_subnormal_operands_and_results_as_the_oracle_does(name: str, path: str) -> None:
    opt = OPTIMIZERS[name]()
    emb, oracle = _engine(opt), _oracle(opt)
    rtol = max(tol_for(type(opt).__name__)["rtol"], 2e-6)
    for step in range(2):
        acts = _step(emb)
        (expected,) = oracle.lookup([(IDS, None)])
        _assert_flushed_close(acts, expected, rtol, f"{name} step {step} activations")
        oracle.apply_gradients([(IDS, None)], [GRADS.astype(np.float64)], {"t": float(np.float32(opt.learning_rate))})
        _assert_flushed_close(emb.embedding_tables["t"], oracle.tables["t"], rtol, f"{name} step {step} weights")
        for slot, value in emb.slot_variables["t"].items():
            _assert_flushed_close(value, oracle.slots["t"][slot], rtol, f"{name} step {step} {slot}")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_data_needs_the_flush(name: str) -> None:
    """The oracle's first update of the touched rows without the flush differs from the one with it: the
    comparison above fails for a path that stops flushing."""
    opt = oracle_optimizer(OPTIMIZERS[name]())
    lr = float(np.float32(OPTIMIZERS[name]().learning_rate))
    init = OracleEngine({"t": {"weights": TABLE, "optimizer": opt}}, [{"table": "t"}]).slots["t"]
    differs = 0
    for r in TOUCHED:
        g = sum(GRADS[k].astype(np.float64) for k, ids in enumerate(IDS) if ids == [r])
        slots = {k: v[r] for k, v in init.items()}
        raw_w, raw_s = _update_row(opt, TABLE[r].astype(np.float64), slots, g, lr)
        w, s = update_row(opt, TABLE[r].astype(np.float64), slots, g, lr)
        differs += int(np.sum(raw_w != w)) + sum(int(np.sum(raw_s[k] != s[k])) for k in s)
    assert differs >= 4, differs


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_native_and_torch_paths_flush_the_same_bits(name: str) -> None:
    results = []
    for enabled in (True, False):
        native.set_enabled(enabled)
        try:
            emb = _engine(OPTIMIZERS[name]())
            acts = [_step(emb) for _ in range(3)]
            results.append((acts, emb.embedding_tables["t"].clone(), dict(emb.slot_variables["t"])))
        finally:
            native.set_enabled(True)
    (a_native, w_native, s_native), (a_torch, w_torch, s_torch) = results
    for x, y in zip(a_native, a_torch):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    assert torch.equal(w_native.view(torch.int32), w_torch.view(torch.int32))
    for k in s_native:
        assert torch.equal(s_native[k].view(torch.int32), s_torch[k].view(torch.int32)), k


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_lookups_and_weighted_combiners_flush(combiner: str, path: str) -> None:
    init = TABLE.copy()
    table = et.TableConfig(
        V,
        D,
        name="t",
        combiner=combiner,
        initializer=lambda shape, dtype=torch.float32: torch.from_numpy(init).to(dtype),
    )
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.SGD(0.1), device=TEST_DEVICE)
    ids = [[0, 8], [4, 5], [4], [9, 1], [2]]
    weights = [[1.0, 2e-39], [0.5, 0.25], [0.5], [3e-38, 1e-39], [1e-39]]
    acts = emb({"f": et.Ragged.from_lists(ids)}, {"f": et.Ragged.from_lists(weights, dtype=torch.float32)})["f"]
    tables = {"t": {"weights": TABLE.astype(np.float64), "combiner": combiner, "optimizer": {"name": "SGD"}}}
    (expected,) = OracleEngine(tables, [{"table": "t"}]).lookup([(ids, weights)])
    _assert_flushed_close(acts, expected, 2e-6, f"{combiner} activations")
    assert np.all(expected[4] == 0), "a subnormal row with a subnormal weight pools to zero"
    zeros = [True, True, False, True] if combiner == "sum" else [False] * 4  # 0.5 * row 4 (mean, sqrtn: 1 * row 4)
    assert (expected[2] == 0).tolist() == zeros


def test_a_subnormal_accumulator_edited_in_place_is_not_proven_positive(path: str) -> None:
    """An Adagrad accumulator written as a subnormal through the tensor the module hands out reads as zero: its
    update divides by zero, so the step is refused with nothing written (never a silent infinity)."""
    emb = _engine(et.Adagrad(0.5))
    emb.slot_variables["t"]["accumulators"].data[8] = 1e-39  # the table stays otherwise ordinary
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    emb({"f": et.Ragged.from_lists([[8], [9]])})
    with pytest.raises(Exception, match="finite"):
        emb.apply_gradients({"f": torch.tensor([[1e-20, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1]], device=TEST_DEVICE)})
    for k, v in emb.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_half_tables_read_bfloat16_subnormals_as_zero_and_keep_float16_subnormals(path: str) -> None:
    rows = torch.tensor([[1e-39, -2e-39, 0.5, 0.0], [2e-38, 1e-38, 0.25, 0.0]])
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        table = et.TableConfig(2, D, name="t", combiner="sum", dtype=dtype, rounding="nearest")
        emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.SGD(0.5), device=TEST_DEVICE)
        emb.load_state_dict({"t": rows if dtype is torch.bfloat16 else torch.tensor([[1e-6, -3e-7, 0.5, 0.0]] * 2)})
        acts = emb({"f": torch.tensor([0, 1])})["f"].detach()
        emb.apply_gradients({"f": torch.tensor([[0.0, 0.0, 0.0, 1e-6], [0.0, 0.0, 0.0, 0.0]], device=TEST_DEVICE)})
        out[dtype] = (acts.cpu(), emb.embedding_tables["t"].float().cpu())
    acts, stored = out[torch.bfloat16]
    assert acts[0, :2].tolist() == [0.0, 0.0] and acts[1, 1].item() == 0.0  # bfloat16 subnormals read as zero
    assert acts[1, 0].item() == pytest.approx(2e-38, rel=1e-2)
    assert stored[0, :2].tolist() == [0.0, 0.0] and stored[1, 1].item() == 0.0  # and written back as zero
    acts, stored = out[torch.float16]
    assert acts[0, 0].item() == pytest.approx(1e-6, rel=0.05)  # a float16 subnormal is a normal float32
    assert stored[0, 3].item() == pytest.approx(-5e-7, rel=0.1)  # 0 - 0.5 * 1e-6: kept as a float16 subnormal
