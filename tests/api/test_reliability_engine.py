"""Issue 6, engine classes: the engine owns what it validated (1), native buffers are checked and dtype
moves refused (2), copies with a pipelined update pending are exact (3), threads are safe (4), scratch
memory is bounded (9), observing a pipelined module does not change training and partial loads load
(10), and an update never writes NaN/Inf (6, engine side).

Paths that used to crash the interpreter run in a subprocess (``subproc.run_python``).
"""

from __future__ import annotations

import copy
import io
import logging
import math
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from statecheck import assert_same, snapshot
from subproc import run_python
from torch import Tensor

import embtables as et
from embtables.kernels import native
from embtables.tables.backends import native_backend, torch_backend


def ones(acts: dict[str, Tensor], scale: float = 1.0) -> dict[str, Tensor]:
    return {k: torch.full_like(v, scale) for k, v in acts.items()}


# ---------------------------------------------------------------------------------------------
# 1. The engine owns the batch it validated.
# ---------------------------------------------------------------------------------------------
OWNERSHIP_CHILD = """
import torch, embtables as et
from embtables.kernels import native
native.set_enabled({native!r})

def make():
    t = et.TableConfig(50, 8, name="t", initializer=et.Constant(0.1), combiner="sum")
    feats = {{"d": et.FeatureConfig(t), "r": et.FeatureConfig(t), "w": et.FeatureConfig(t)}}
    return et.DistributedEmbedding(feats, et.Adagrad(0.1))

def batch():
    f = {{"d": torch.tensor([[1, 2], [3, 4]]), "r": et.Ragged(torch.tensor([5, 6, 7]), torch.tensor([0, 2, 3])),
          "w": et.Ragged(torch.tensor([8, 9]), torch.tensor([0, 1, 2]))}}
    w = {{"d": None, "r": None, "w": et.Ragged(torch.tensor([1.0, 2.0]), torch.tensor([0, 1, 2]))}}
    return f, w

def grads(acts):
    return {{k: torch.ones_like(v) for k, v in acts.items()}}

ref = make()
f, w = batch()
ref.apply_gradients(grads(ref(f, w)))
expected = ref.state_dict()
ref_acts = make()(*batch())

for bad in (10**12, -5, 7):
    for where in ("after-lookup", "after-enqueue"):
        m = make()
        f, w = batch()
        if where == "after-enqueue":
            m.enqueue(f, w)
        else:
            acts = m(f, w)
        f["d"].numpy()[:] = bad                     # bypasses torch's version counter on purpose
        f["r"].values.fill_(bad)
        f["r"].row_splits.copy_(torch.tensor([0, 3, 3]))
        f["w"].values.fill_(bad)
        w["w"].values.fill_(1e30)
        if where == "after-enqueue":
            acts = m.dequeue()
            for k in acts:
                assert torch.equal(acts[k], ref_acts[k]), (bad, k)
        m.apply_gradients(grads(acts))
        got = m.state_dict()
        for k in expected:
            assert torch.equal(got[k], expected[k]), (bad, where, k)
print("ok")
"""


@pytest.mark.parametrize("path", ["native", "torch"])
def test_input_buffers_written_after_validation_never_reach_the_kernels(path: str) -> None:
    assert "ok" in run_python(OWNERSHIP_CHILD.format(native=path == "native"))


NATIVE_CHECKS_CHILD = """
import torch
import embtables as et
from embtables.kernels import native, native_inputs
assert native.library() is not None
table = torch.zeros(10, 4)
ids = torch.tensor([1, 2, 10**9, -3])
offsets = torch.tensor([0, 2, 4])
outs, status = native.lookup_many([(table, ids, offsets, None)])
assert status == 1, status
_, status = native.lookup_many([(table, torch.tensor([1, 2]), torch.tensor([0, 5]), None)])  # offsets past N
assert status == 1, status
_, status = native.lookup_many([(table, torch.tensor([1, 2]), torch.tensor([2, 1]), None)])  # decreasing
assert status == 1, status
ws = native.Workspace(4)
(status,) = native.prepare_many([(ws, 10, [(ids, offsets, None, torch.ones(2, 4))])])
assert status == 3, status
arena = torch.full((64,), -7, dtype=torch.int64)
coef = torch.full((16,), -7.0)
staged = native_inputs.stage_inputs_many(
    [(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3]), 10, 1),   # ok, one id per bag: no coefficients
     (torch.tensor([1, 10]), None, 10, 0),                           # an id out of range
     (torch.tensor([4, 5]), torch.tensor([0, 2, 1]), 10, 0),         # decreasing splits
     (torch.tensor([4, 5, 6]), torch.tensor([0, 2, 3]), 10, 1),      # ok, mean over bags of two and one
     (torch.tensor([6]), None, 7, 0),                                # ok, dense
     (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3, 3, 4]), 10, 2)],  # ok, sqrtn, an empty bag
    arena, coef,
)
assert staged[1] is None and staged[2] is None, staged
assert staged[0][2] and not staged[3][2] and staged[4][2] and staged[0][3] is None
assert staged[0][0].tolist() == [1, 2, 3] and staged[3][1].tolist() == [0, 2, 3] and staged[4][1].tolist() == [0, 1]
assert staged[3][3].tolist() == [0.5, 0.5, 1.0]
third = torch.tensor(3.0).sqrt().reciprocal().item()
assert staged[5][3].tolist() == [third, third, third, 1.0], staged[5][3]
small = torch.full((5,), -7, dtype=torch.int64)
no_coef = torch.zeros(0)
i64 = torch.zeros(8, dtype=torch.int64)
try:
    native_inputs.stage_inputs_many([(torch.tensor([1, 2, 3]), torch.tensor([0, 3]), 10, 0)], small, no_coef)  # 3 + 2
except native.NativeBufferError:
    raise AssertionError("a batch that fits was refused")
for too_big in ([(torch.tensor([1, 2, 3]), None, 10, 0)],                    # needs 3 + 4 = 7 > 5 ids
                [(torch.tensor([1, 2]), torch.tensor([0, 2]), 10, 1)]):     # needs 2 coefficients, has 0
    try:
        native_inputs.stage_inputs_many(too_big, small, no_coef)
    except native.NativeBufferError:
        assert torch.equal(small[:5], torch.tensor([1, 2, 3, 0, 3])), small   # the first call's copy, untouched
    else:
        raise AssertionError("a batch larger than its arenas reached C")
assert ws.load(torch.tensor([1, 1]), torch.ones(2, 4), 10) == 3      # repeated row
assert ws.load(torch.tensor([1, 10]), torch.ones(2, 4), 10) == 3     # row out of range
for bad_call in (
    lambda: native.lookup_many([(table.double(), torch.tensor([1]), torch.tensor([0, 1]), None)]),
    lambda: native.lookup_many([(table.t(), torch.tensor([1]), torch.tensor([0, 1]), None)]),
    lambda: native.lookup_many([(table, torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1]), None)]),
    lambda: native.lookup_many([(table, torch.tensor([1]), torch.tensor([0, 1]), torch.ones(3))]),
    lambda: native.prepare_many([(ws, 10, [(torch.tensor([1]), torch.tensor([0, 1]), None, torch.ones(1, 5))])]),
    lambda: native_inputs.stage_inputs_many([(torch.tensor([1]), None, 10, 0)], i64.int(), coef),
    lambda: native_inputs.stage_inputs_many(
        [(torch.tensor([1]), None, 10, 0)], torch.zeros(16, dtype=torch.int64)[::2], coef
    ),
    lambda: native_inputs.stage_inputs_many([(torch.tensor([[1]]), None, 10, 0)], i64, coef),
    lambda: native_inputs.stage_inputs_many([(torch.tensor([1]), None, 10, 0)], i64, coef.double()),
    lambda: native_inputs.stage_inputs_many([(torch.tensor([1]), None, 10, 3)], i64, coef),
    lambda: native.apply_sequential(torch.tensor([1]), torch.ones(1, 4), table, (torch.ones(9, 4),),
                                    native.opt_params(et.Adagrad(0.1), 0.1, 0.0, clip_gradients=False)),
):
    try:
        bad_call()
    except native.NativeBufferError:
        pass
    else:
        raise AssertionError("a bad buffer reached C")
try:
    native.apply_sequential(torch.tensor([1, 12]), torch.ones(2, 4), table, (),
                            native.opt_params(__import__("embtables").SGD(0.1), 0.1, 0.0, clip_gradients=False))
except native.NativeBufferError:
    pass
else:
    raise AssertionError("an out-of-range row reached the sequential kernel")
assert torch.equal(table, torch.zeros(10, 4))
print("ok")
"""


def test_native_kernels_check_every_buffer_and_id_in_the_same_call() -> None:
    assert "ok" in run_python(NATIVE_CHECKS_CHILD)


# ---------------------------------------------------------------------------------------------
# 2. dtype moves are refused; device moves work.
# ---------------------------------------------------------------------------------------------
DTYPE_CHILD = """
import torch, embtables as et
from torch import nn
def make():
    t = et.TableConfig(20, 4, name="t", initializer=et.TruncatedNormal(seed=0))
    return et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adagrad(0.1))
m = make()
before = {k: v.clone() for k, v in m.state_dict().items()}
parent = nn.Sequential(m, nn.Linear(4, 1))
for move in (lambda x: x.half(), lambda x: x.bfloat16(), lambda x: x.double(), lambda x: x.to(torch.float16),
             lambda x: parent.half()):
    try:
        move(m)
    except TypeError as exc:
        assert "float32" in str(exc), exc
    else:
        raise AssertionError("a dtype move was accepted")
    for k, v in m.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, before[k]), k
m.to("cpu").float()
acts = m({"f": torch.tensor([[1, 2]])})
m.apply_gradients({"f": torch.ones_like(acts["f"])})
assert not torch.equal(m.state_dict()["t"], before["t"])
print("ok")
"""


def test_dtype_moves_are_refused_and_change_nothing() -> None:
    assert "ok" in run_python(DTYPE_CHILD)


def test_dtype_moves_name_each_tables_storage_type(caplog: pytest.LogCaptureFixture) -> None:
    """With half tables: .half()/.bfloat16()/.double() name every table with its storage type and point to
    TableConfig(dtype=); .float() keeps the half tables half and says so (it was silent)."""
    half = et.TableConfig(20, 4, name="u", dtype=torch.bfloat16)
    m = et.DistributedEmbedding({"f": et.FeatureConfig(half), "g": et.FeatureConfig(et.TableConfig(9, 4, name="v"))},
                                et.SGD(0.1))  # fmt: skip
    for move in (m.half, m.bfloat16, m.double):
        with pytest.raises(TypeError, match=r"\('u' \(bfloat16\), 'v' \(float32\);.*TableConfig\(dtype="):
            move()
    with caplog.at_level(logging.WARNING, logger="embtables"):
        m.float()
    assert "leaves the half-precision tables 'u' (bfloat16) in their storage type" in caplog.text
    assert "TableConfig(dtype=torch.float32)" in caplog.text
    assert m.embedding_tables["u"].dtype == torch.bfloat16 and m.embedding_tables["v"].dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# 3. Copies of a module with a pipelined update pending continue exactly like the original.
# ---------------------------------------------------------------------------------------------
COPY_CHILD = """
import copy, io, torch, embtables as et
from embtables.kernels import native
native.set_enabled({native!r})
opts = [et.Adagrad(0.1), et.Adam(0.05, lazy_adam=False), et.FTRL(0.1, l1_regularization_strength=0.01),
        et.SGD(0.1, use_gradient_accumulation=False), et.AdagradMomentum(0.1, momentum=0.9)]
gen = torch.Generator().manual_seed(0)
batches = [{{"f": torch.randint(0, 30, (8, 3), generator=gen)}} for _ in range(6)]
grads = [torch.randn(8, 3, 4, generator=gen) for _ in range(6)]
for opt in opts:
    t = et.TableConfig(30, 4, name="t", initializer=et.TruncatedNormal(seed=1))
    m = et.DistributedEmbedding({{"f": et.FeatureConfig(t)}}, opt, pipeline_execution_with_tensor_core=True)
    def step(mod, i):
        acts = mod(batches[i])
        mod.apply_gradients({{"f": grads[i]}})
        return acts["f"].detach()
    for i in range(2):
        step(m, i)
    buf = io.BytesIO()
    torch.save(m, buf)
    copies = [copy.deepcopy(m), torch.load(io.BytesIO(buf.getvalue()), weights_only=False)]
    for i in range(2, 6):
        a = step(m, i)
        for c in copies:
            assert torch.equal(step(c, i), a), (type(opt).__name__, i)
    for c in copies:
        for k, v in m.state_dict().items():
            assert torch.equal(c.state_dict()[k], v), (type(opt).__name__, k)
    torch.save(m, "{path}_" + type(opt).__name__)
print("ok")
"""

LOAD_WITHOUT_NATIVE_CHILD = """
import torch, embtables as et
from embtables.kernels import native
assert native.library() is None
for name in ("Adagrad", "Adam", "FTRL", "SGD", "AdagradMomentum"):
    m = torch.load("{path}_" + name, weights_only=False)
    acts = m({{"f": torch.tensor([[1, 2, 3]])}})
    m.apply_gradients({{"f": torch.ones_like(acts["f"])}})
    assert all(bool(torch.isfinite(v).all()) for v in m.state_dict().values())
print("ok")
"""


@pytest.mark.parametrize("path", ["native", "torch"])
def test_copies_with_a_pending_pipelined_update_are_exact(path: str, tmp_path: Any) -> None:
    prefix = str(tmp_path / "m")
    assert "ok" in run_python(COPY_CHILD.format(native=path == "native", path=prefix))
    # A module pickled with an update pending loads and trains where the native kernels are off.
    assert "ok" in run_python(LOAD_WITHOUT_NATIVE_CHILD.format(path=prefix), env={"EMBTABLES_NATIVE": "0"})


# ---------------------------------------------------------------------------------------------
# 4. Threads.
# ---------------------------------------------------------------------------------------------
THREADS_CHILD = """
import threading, logging, torch, embtables as et
logging.disable(logging.WARNING)
tables = [et.TableConfig(200, 16, name=f"t{i}") for i in range(3)]
feats = {f"f{i}": et.FeatureConfig(tables[i]) for i in range(3)}
m = et.DistributedEmbedding(feats, et.Adam(0.01, lazy_adam=False))
errors = []
def train(seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(40):
        try:
            acts = m({k: torch.randint(0, 200, (64, 4), generator=gen) for k in feats})
            m.apply_gradients({k: torch.randn(v.shape, generator=gen) for k, v in acts.items()})
        except RuntimeError as exc:   # another thread consumed the lookup: a clear error, never a crash
            assert "apply_gradients" in str(exc), exc
        except Exception as exc:
            errors.append(repr(exc))
def observe():
    for _ in range(40):
        sd = m.state_dict()
        assert all(bool(torch.isfinite(v).all()) for v in sd.values())
threads = [threading.Thread(target=train, args=(s,)) for s in range(3)] + [threading.Thread(target=observe)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
assert all(bool(torch.isfinite(v).all()) for v in m.state_dict().values())
print("ok")
"""


def test_threads_training_one_module_never_crash() -> None:
    assert "ok" in run_python(THREADS_CHILD, timeout=240)


# ---------------------------------------------------------------------------------------------
# 9. Memory: workspaces shrink back; the torch-path non-lazy update works in chunks.
# ---------------------------------------------------------------------------------------------
def test_native_workspace_shrinks_after_a_huge_step() -> None:
    assert native.library() is not None
    ws = native.Workspace(8)
    n = 2_000_000
    big = torch.randint(0, 1_000_000, (n,))
    (status,) = native.prepare_many([(ws, 1_000_000, [(big, torch.tensor([0, n]), None, torch.ones(1, 8))])])
    assert status == 0
    huge = ws.nbytes
    assert huge > 100 * 2**20
    small = torch.tensor([1, 2, 3])
    (status,) = native.prepare_many([(ws, 1_000_000, [(small, torch.tensor([0, 3]), None, torch.ones(1, 8))])])
    assert status == 0
    assert ws.nbytes < 4 * 2**20, ws.nbytes


def test_torch_path_non_lazy_adam_runs_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(chunk_elements: int) -> dict[str, Tensor]:
        monkeypatch.setattr(torch_backend, "_DENSE_CHUNK_ELEMENTS", chunk_elements)
        t = et.TableConfig(37, 4, name="t", initializer=et.TruncatedNormal(seed=3))
        m = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adam(0.1, lazy_adam=False))
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            m({"f": torch.randint(0, 37, (5, 2), generator=gen)})
            m.apply_gradients({"f": torch.randn(5, 2, 4, generator=gen)})
        return snapshot(m)

    native.set_enabled(False)
    seen: list[int] = []
    real = torch_backend.update_rows

    def spy(w: Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(int(w.shape[0]))
        return real(w, *args, **kwargs)

    try:
        whole = run(1 << 22)
        monkeypatch.setattr(torch_backend, "update_rows", spy)
        chunked = run(40)  # 10 rows of D=4 per chunk: 4 chunks
    finally:
        native.set_enabled(True)
    assert seen and max(seen) <= 10
    assert_same(whole, chunked)


# ---------------------------------------------------------------------------------------------
# 10. Observing a pipelined module does not change training; partial loads load.
# ---------------------------------------------------------------------------------------------
def _pipelined_run(observe: Any) -> tuple[dict[str, Tensor], list[Tensor]]:
    ta = et.TableConfig(12, 4, name="ta", initializer=et.TruncatedNormal(seed=0))
    tb = et.TableConfig(9, 3, name="tb", initializer=et.TruncatedNormal(seed=1))
    feats = {"a": et.FeatureConfig(ta), "b": et.FeatureConfig(tb), "s": et.FeatureConfig(ta, max_sequence_length=2)}
    m = et.DistributedEmbedding(feats, et.Adagrad(0.5), pipeline_execution_with_tensor_core=True)
    tb_adam = {
        "b": et.FeatureConfig(
            et.TableConfig(
                9, 3, name="tc", optimizer=et.Adam(0.1, lazy_adam=False), initializer=et.TruncatedNormal(seed=2)
            )
        )
    }
    m2 = et.DistributedEmbedding(tb_adam, pipeline_execution_with_tensor_core=True)
    gen = torch.Generator().manual_seed(5)
    acts_seen = []
    for _ in range(5):
        ids = torch.randint(0, 9, (4, 2), generator=gen)  # heavy reuse of rows across steps
        batch = {"a": ids, "b": ids, "s": et.Ragged.from_lists([[1, 2, 3], [2], [], [1]])}
        for mod, b in ((m, batch), (m2, {"b": ids})):
            acts = mod(b)
            acts_seen += [a.detach().clone() for a in acts.values()]
            mod.apply_gradients({k: torch.full_like(v, 0.7) for k, v in acts.items()})
            observe(mod)
    return {**snapshot(m), **snapshot(m2)}, acts_seen


OBSERVERS = {
    "state_dict": lambda m: m.state_dict(),
    "embedding_tables": lambda m: m.embedding_tables,
    "slot_variables": lambda m: m.slot_variables,
    "to_cpu": lambda m: m.to("cpu"),
    "local_shards": lambda m: m.local_shards(),
    "eval_lookup": lambda m: (
        m.eval(),
        m({k: et.Ragged.from_lists([[1, 2]]) for k in m.feature_config}),
        m.train(),
    ),
}


@pytest.mark.parametrize("observer", sorted(OBSERVERS))
def test_observing_a_pipelined_module_does_not_change_training(observer: str, kernel_path: str) -> None:
    quiet_state, quiet_acts = _pipelined_run(lambda m: None)
    seen_state, seen_acts = _pipelined_run(OBSERVERS[observer])
    assert_same(quiet_state, seen_state)
    assert len(quiet_acts) == len(seen_acts)
    for a, b in zip(quiet_acts, seen_acts):
        assert torch.equal(a, b)


def test_partial_load_with_strict_false_loads_the_keys_present() -> None:
    def make() -> et.DistributedEmbedding:
        ta = et.TableConfig(10, 4, name="ta", initializer=et.Constant(0.0))
        tb = et.TableConfig(6, 3, name="tb", initializer=et.Constant(0.0))
        return et.DistributedEmbedding({"a": et.FeatureConfig(ta), "b": et.FeatureConfig(tb)}, et.Adagrad(0.1))

    donor = {k: v + 1.0 for k, v in make().state_dict().items()}
    m = make()
    before = snapshot(m)
    partial = {k: v for k, v in donor.items() if k != "tb/accumulators"}
    partial["unknown/table"] = torch.zeros(2)
    result = m.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["tb/accumulators"]
    after = snapshot(m)
    for key in donor:
        expected = before[key] if key == "tb/accumulators" else donor[key]
        assert torch.equal(after[key], expected), key
    # strict=True stays all-or-nothing.
    m2 = make()
    with pytest.raises(RuntimeError, match="tb/accumulators"):
        m2.load_state_dict(partial)
    assert_same(snapshot(m2), before)


# ---------------------------------------------------------------------------------------------
# 6 (engine side). An update or a lookup never produces NaN/Inf: it raises and changes nothing.
# ---------------------------------------------------------------------------------------------
def _two_tables(opt_a: et.config.Optimizer, opt_b: et.config.Optimizer) -> et.DistributedEmbedding:
    ta = et.TableConfig(10, 4, name="ta", initializer=et.Constant(0.5), optimizer=opt_a, combiner="sum")
    tb = et.TableConfig(10, 4, name="tb", initializer=et.Constant(0.5), optimizer=opt_b, combiner="sum")
    return et.DistributedEmbedding({"a": et.FeatureConfig(ta), "b": et.FeatureConfig(tb)})


NON_FINITE_CASES = {
    # (optimizer of table tb, gradient scale for tb): a finite gradient whose update overflows float32.
    "adagrad-accumulator": (et.Adagrad(0.1), 1e20),
    "sgd-step": (et.SGD(1e30), 1e10),
    "sgd-no-accumulation": (et.SGD(1e30, use_gradient_accumulation=False), 1e10),
    "adam-non-lazy": (et.Adam(0.1, lazy_adam=False), 1e20),
    "ftrl-accumulator": (et.FTRL(0.1), 1e20),
    "momentum": (et.AdagradMomentum(0.1, momentum=0.9), 1e20),
}


@pytest.fixture(params=["dry-run", "proof"])
def finiteness_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Small native updates are checked by the exact dry run inside the writing call; larger ones are proven
    finite first (``native_backend.SMALL_UPDATE_ELEMENTS``): run a test both ways."""
    if request.param == "proof":
        monkeypatch.setattr(native_backend, "SMALL_UPDATE_ELEMENTS", -1)
    return str(request.param)


@pytest.mark.parametrize("case", sorted(NON_FINITE_CASES))
def test_an_update_that_would_overflow_raises_and_changes_nothing(
    case: str, kernel_path: str, finiteness_check: str
) -> None:
    opt_b, scale = NON_FINITE_CASES[case]
    m = _two_tables(et.Adagrad(0.1), opt_b)
    before = snapshot(m)
    acts = m({"a": torch.tensor([[1, 2]]), "b": torch.tensor([[1, 2, 2]])})
    with pytest.raises(ValueError, match=r"table 'tb'.*(non-finite|NaN or Inf).*no table or slot was changed"):
        m.apply_gradients({"a": torch.ones_like(acts["a"]), "b": torch.full_like(acts["b"], scale)})
    assert_same(snapshot(m), before)  # table 'ta' (valid gradient) did not move either
    acts = m({"a": torch.tensor([[1, 2]]), "b": torch.tensor([[1, 2]])})
    m.apply_gradients(ones(acts))  # still usable
    assert all(bool(torch.isfinite(v).all()) for v in m.state_dict().values())


def test_an_overflowing_lookup_raises_naming_the_feature(kernel_path: str) -> None:
    m = _two_tables(et.SGD(0.1), et.SGD(0.1))
    sd = m.state_dict()
    sd["tb"] = torch.full((10, 4), 3e38)
    m.load_state_dict(sd)
    before = snapshot(m)
    m.eval()
    with pytest.raises(ValueError, match=r"feature 'b'.*overflow"):
        m({"a": torch.tensor([[1]]), "b": et.Ragged.from_lists([[1, 2]])})
    assert_same(snapshot(m), before)


def test_huge_but_finite_values_take_the_exact_check_and_still_train(kernel_path: str) -> None:
    """Values the cheap bound cannot clear (1e31 weights) are checked exactly; a finite update proceeds."""
    m = _two_tables(et.SGD(0.1), et.SGD(0.1))
    sd = m.state_dict()
    sd["tb"] = torch.full((10, 4), 1e31)
    m.load_state_dict(sd)
    acts = m({"a": torch.tensor([[1]]), "b": torch.tensor([[3]])})
    m.apply_gradients(ones(acts))
    tb = m.state_dict()["tb"]
    assert torch.equal(tb[3], torch.full((4,), 1e31) - 0.1)
    assert torch.equal(tb[0], torch.full((4,), 1e31))


OPTIMIZERS = st.sampled_from(
    [
        et.SGD(0.5),
        et.Adagrad(0.3, initial_accumulator_value=0.01),
        et.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True, beta2=0.9),
        et.Adam(0.2, epsilon=1e-7),
        et.Adam(0.2, sum_inside_sqrt=False),
        et.FTRL(0.2, l1_regularization_strength=0.1, l2_regularization_strength=0.1, beta=0.1),
        et.FTRL(0.2, multiply_linear_by_learning_rate=True, learning_rate_power=-0.7),
        et.FTRL(0.2, allow_zero_accumulator=True),
        et.Adam(0.2, epsilon=1e-15),
        et.AdagradMomentum(0.1, momentum=0.5, epsilon=1e-30),
        et.FTRL(1e-6, beta=0.0),
        et.ProximalAdagrad(0.2, l1_regularization_strength=0.1, l2_regularization_strength=0.1),
        et.Momentum(0.1, momentum=0.9, use_nesterov=True),
        et.RMSProp(0.1, momentum=0.9, epsilon=1e-7),
        et.RMSProp(0.1, rho=0.5, epsilon=1e-30),
        et.CenteredRMSProp(0.1, momentum=0.5),
        et.Adadelta(1.0, rho=0.9, epsilon=1e-6),
        et.Adadelta(1.0, epsilon=1e-30),
        et.ProximalYogi(0.1, l1_regularization_strength=0.1, l2_regularization_strength=0.1),
        et.ProximalYogi(0.1, epsilon=1e-30),
        et.FrequencyEstimator(tau=0.5, max_delta=1e30, outlier_threshold=1e30),
    ]
)


@settings(max_examples=300, deadline=None, derandomize=True)
@example(opt=et.Adam(0.2, epsilon=1e-15), w_exp=0.0, s_exp=[25.0, -30.0], g_exp=-30.0, lr_exp=0.0, decay=0.0)
@example(opt=et.Adagrad(0.3), w_exp=30.0, s_exp=[-1.0, 0.0], g_exp=0.0, lr_exp=8.0, decay=10.0)
@example(opt=et.FTRL(1e-6), w_exp=20.0, s_exp=[10.0, 20.0], g_exp=10.0, lr_exp=-6.0, decay=0.0)
@example(
    opt=et.AdagradMomentum(0.1, momentum=0.5, epsilon=1e-30), w_exp=0.0, s_exp=[-30, 0], g_exp=10, lr_exp=5, decay=0
)
@given(
    opt=OPTIMIZERS,
    w_exp=st.floats(-30, 36),
    s_exp=st.lists(st.floats(-30, 36), min_size=2, max_size=2),
    g_exp=st.floats(-30, 25),
    lr_exp=st.floats(-8, 8),
    decay=st.sampled_from([0.0, 0.01, 10.0]),
)
def test_the_finiteness_proof_is_sound(
    opt: et.config.Optimizer, w_exp: float, s_exp: list[float], g_exp: float, lr_exp: float, decay: float
) -> None:
    """Whenever ``update_is_finite`` says True, the float32 update really writes only finite values."""
    from embtables.kernels.finite_guard import update_is_finite
    from embtables.kernels.sparse_update import update_rows

    gen = torch.Generator().manual_seed(int(abs(w_exp * 1000 + g_exp)))
    proven.append(0)
    rows = 16
    w = (torch.rand(rows, 4, generator=gen) * 2 - 1) * 10.0**w_exp
    slots = []
    for name, exp in zip(opt.slot_names, s_exp):
        s = torch.rand(rows, 4, generator=gen) * 10.0**exp
        if name in ("momenta", "linears", "mom", "m", "mg"):
            s = s * 2 - 10.0**exp
        if name == "accumulators" and not isinstance(opt, et.AdagradMomentum):
            s = s + float(opt.slot_initial_values()[0])
        slots.append(s.float())
    g = (torch.randn(rows, 4, generator=gen) * 10.0**g_exp).float()
    if not (bool(torch.isfinite(w).all()) and all(bool(torch.isfinite(s).all()) for s in slots)):
        return
    lr = float(torch.tensor(10.0**lr_exp, dtype=torch.float32))
    hi = [float(t.abs().max()) for t in (w, *slots)]
    lo = [float(t.min()) for t in (w, *slots)]
    gmax = float(g.abs().max())
    if not update_is_finite(opt, lr, decay * lr, gmax, hi, lo):
        return
    proven[-1] = 1
    opt = dataclasses_replace(
        opt, weight_decay_factor=decay or None, multiply_weight_decay_factor_by_learning_rate=True
    )
    w_new, s_new = update_rows(w.float(), tuple(slots), g, opt=opt, lr=lr, clip_gradients=True)
    for t in (w_new, *s_new):
        assert bool(torch.isfinite(t).all()), (type(opt).__name__, w_exp, s_exp, g_exp, lr_exp)


proven: list[int] = []


def test_the_finiteness_proof_clears_most_ordinary_updates() -> None:
    """The soundness test above is not vacuous: the proof said "finite" for a good share of its cases."""
    if not proven:
        test_the_finiteness_proof_is_sound()
    assert sum(proven) >= 0.3 * len(proven), (sum(proven), len(proven))


def dataclasses_replace(opt: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(opt, **changes)


def test_copy_module_helpers_are_public_api_only() -> None:
    """deepcopy of a module with no pending update is a plain copy (regression guard for __getstate__)."""
    m = _two_tables(et.Adagrad(0.1), et.SGD(0.1))
    c = copy.deepcopy(m)
    buf = io.BytesIO()
    torch.save(m, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    for other in (c, loaded):
        assert_same(snapshot(other), snapshot(m))
        acts = other({"a": torch.tensor([[1]]), "b": torch.tensor([[2]])})
        other.apply_gradients(ones(acts))
    assert math.isfinite(float(m.state_dict()["ta"].sum()))
