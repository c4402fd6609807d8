"""Half-precision tables (spec §12) on the fused GPU kernels: the Triton lookup widens bfloat16 / float16 rows
as it reads them, and the fused update reads half rows and slots, computes in float32 and writes each value
rounded (stochastically with the bits of (seed, step, table, global row, column), or to nearest), refusing a
value no half value holds (a float16 overflow) in its dry run.

Checked bit for bit against the torch reference (itself checked against the NumPy oracle in
``test_half_tables.py``): the rounding helper on edge values, every optimizer and storage combination through
the engine, tables of three storage types in one lookup, a dynamic table (rows rounded by key), pipelining
and the refusal. Without CUDA the kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` where Triton is installed).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TEST_DEVICE
from mp_world import run_world

import embtables as et
from embtables.errors import InputError
from embtables.kernels import gpu, native
from embtables.kernels.affine_rows import AffineRows
from embtables.kernels.stochastic_rounding import random_bits, round_to, row_states, table_state
from embtables.tables.backends import GpuBackend, TorchBackend

# Triton's CPU interpreter warns where NumPy converts the lanes a mask discards (out of range, never stored)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
ON_CUDA = TEST_DEVICE.type == "cuda"
HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "sgd": lambda: et.SGD(0.3, clipvalue=0.5),
    "adagrad": lambda: et.Adagrad(0.2, initial_accumulator_value=0.1),
    "adam": lambda: et.Adam(0.05),
    "adam_dense": lambda: et.Adam(0.05, lazy_adam=False),  # every row rounded every step
    "ftrl": lambda: et.FTRL(0.2, l1_regularization_strength=0.01),
    "rmsprop": lambda: et.CenteredRMSProp(0.05, rho=0.9, momentum=0.3, epsilon=1e-2),  # three slots
    "momentum": lambda: et.Momentum(0.1, momentum=0.9, use_nesterov=True),
}
V, D, B = 40, 6, 8


def _gpu_path() -> bool:
    """Turn the fused kernels on for this device (CPU tensors: through Triton's interpreter)."""
    if not ON_CUDA:
        native.set_enabled(False)
    gpu.set_enabled(True, on_cpu=not ON_CUDA)
    gpu.set_deferred_errors(False)
    return gpu.usable(TEST_DEVICE)


def _reference_path() -> None:
    gpu.set_enabled(False)
    native.set_enabled(False)


@pytest.fixture(autouse=True)
def _paths() -> Iterator[None]:
    if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs EMBTABLES_TEST_DEVICE=cuda (or TRITON_INTERPRET=1 for the kernels on the CPU)")
    if not _gpu_path():
        gpu.set_enabled(True)
        native.set_enabled(True)
        pytest.skip("the fused GPU kernels need Triton")
    yield
    native.set_enabled(True)
    gpu.set_enabled(True)
    gpu.set_deferred_errors(None)


def _module(opt: str, dtype: Any, slot_dtype: Any = None, *, rounding: str = "stochastic", **kwargs: Any) -> Any:
    table = et.TableConfig(
        V, D, name="t", combiner="sum", initializer=et.TruncatedNormal(seed=1), dtype=dtype, slot_dtype=slot_dtype,
        rounding=rounding, rounding_seed=3,
    )  # fmt: skip
    return et.DistributedEmbedding({"f": et.FeatureConfig(table)}, OPTIMIZERS[opt](), device=TEST_DEVICE, **kwargs)


def _train(emb: Any, steps: int = 4) -> list[torch.Tensor]:
    """The activations of ``steps`` steps, each applied; repeated ids: rows summed from several occurrences."""
    seen = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, V, (B,), generator=g)
        grad = torch.randn(B, D, generator=g) * 0.7
        seen.append(emb({"f": ids.to(TEST_DEVICE)})["f"].detach().cpu().clone())
        emb.apply_gradients({"f": grad.to(TEST_DEVICE)})
    return seen


def _stored(emb: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in emb.state_dict().items() if isinstance(v, torch.Tensor)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# one step of each storage type, relative to the value: where a rounding may go the other way
_STEP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}


def _assert_as_the_reference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The fused kernels' tensors against the torch reference's: bit for bit through Triton's interpreter (the
    same float32 arithmetic); on CUDA, where the reference's torch kernels may round a float32 operation
    differently in the last place (fused multiply-adds), each floating value within one step of its storage type (a
    stochastic rounding that went the other way); keys and counts exactly everywhere."""
    assert got.keys() == want.keys()
    for key in got:
        assert got[key].dtype == want[key].dtype, key
        if ON_CUDA and got[key].is_floating_point():
            step = _STEP[got[key].dtype]
            torch.testing.assert_close(got[key].float(), want[key].float(), rtol=step, atol=1e-6, msg=key)
        else:
            assert torch.equal(got[key], want[key]), key


def _rounding_kernel() -> Any:
    """A kernel that writes ``triton_common.rounded`` of [n, 7] float32 values (columns COL0.. of their rows'
    bits) and each row's hash state (Triton resolves the names it calls in this module's globals)."""
    import triton
    import triton.language as tl

    from embtables.kernels import triton_common

    globals()["triton_common"] = triton_common

    @triton.jit
    def kernel(x_ptr, keys_ptr, out_ptr, states_ptr, n, state, COL0, TYPE: tl.constexpr, STOCHASTIC: tl.constexpr):
        u = tl.program_id(0) * 16 + tl.arange(0, 16)
        d = tl.arange(0, 8)
        m = (u < n)[:, None] & (d < 7)[None, :]
        states = triton_common.row_states(state + u * 0, tl.load(keys_ptr + u, mask=u < n, other=0))
        tl.store(states_ptr + u, states.to(tl.int64), mask=u < n)
        x = tl.load(x_ptr + u[:, None] * 7 + d[None, :], mask=m, other=0.0)
        out = triton_common.rounded(x, states, d + COL0, TYPE, STOCHASTIC)
        tl.store(out_ptr + u[:, None] * 7 + d[None, :], out, mask=m)

    return kernel


def test_the_kernels_rounding_is_the_references_on_edge_values() -> None:
    """``triton_common.rounded`` against ``stochastic_rounding.round_to``: values across float16's subnormals,
    normals and overflow and bfloat16's range, signed zeros, the largest finite values and non-finite ones."""
    kernel = _rounding_kernel()
    g = torch.Generator().manual_seed(0)
    n = 200
    x = torch.randn(n, 7, generator=g) * torch.logspace(-9, 5.2, n)[:, None]  # float16 subnormals to overflow
    edges = [float("inf"), float("nan"), -7e4, 65519.0, 65520.0, 65504.0, -0.0, 1e-30, 3.3e38, -3.4e38, 6e-8, 3e-8]
    x.view(-1)[: len(edges)] = torch.tensor(edges)
    keys = torch.randint(-(2**40), 2**40, (n,), generator=g)
    seed, step, table = 2**40 + 7, 123456789012, 5
    x, keys = x.to(TEST_DEVICE), keys.to(TEST_DEVICE)
    for kind, dtype in HALF.items():
        for stochastic in (True, False):
            out = torch.empty((n, 7), dtype=torch.int16, device=TEST_DEVICE)
            states = torch.empty(n, dtype=torch.int64, device=TEST_DEVICE)
            kernel[(-(-n // 16),)](x, keys, out, states, n, table_state(seed, step, table), 3,
                                   TYPE=1 if kind == "bfloat16" else 2, STOCHASTIC=stochastic)  # fmt: skip
            assert torch.equal(states.cpu(), row_states(seed, step, table, keys.cpu()))
            bits = random_bits(seed, step, table, keys.cpu(), 10)[:, 3:] if stochastic else None
            want = round_to(x.cpu(), dtype, bits)
            got = out.cpu().view(dtype)
            finite = torch.isfinite(want)
            assert torch.equal(torch.isfinite(got), finite), (kind, stochastic)
            assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16)), (kind, stochastic)
            assert bool((got.float() == 65504.0).any() or kind == "bfloat16")  # the largest float16 is reached


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind, slot_kind", [("bfloat16", None), ("float16", "float16"), ("bfloat16", "float16")])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_the_fused_kernels_give_the_references_bits(opt: str, kind: str, slot_kind: str | None, rounding: str) -> None:
    dtypes = HALF[kind], HALF[slot_kind] if slot_kind else None
    fused = _module(opt, *dtypes, rounding=rounding)
    assert isinstance(fused._engine.local.backend, GpuBackend)
    seen = _train(fused, steps=2)  # the second step reads the half rows and slots the first one rounded
    _reference_path()
    reference = _module(opt, *dtypes, rounding=rounding)
    assert isinstance(reference._engine.local.backend, TorchBackend)
    want = _train(reference, steps=2)
    _assert_as_the_reference({str(i): a for i, a in enumerate(seen)}, {str(i): a for i, a in enumerate(want)})
    _assert_as_the_reference(_stored(fused), _stored(reference))
    assert fused.embedding_tables["t"].dtype == dtypes[0]


def _mixed(device: Any, **kwargs: Any) -> Any:
    tables = [
        et.TableConfig(
            V, D, name=name, combiner="mean", initializer=et.TruncatedNormal(seed=i), dtype=dtype, slot_dtype=slot
        )
        for i, (name, dtype, slot) in enumerate(
            (("w", None, None), ("b", torch.bfloat16, torch.bfloat16), ("h", torch.float16, None))
        )
    ]
    features = {f"f{t.name}": et.FeatureConfig(t) for t in tables}
    return et.DistributedEmbedding(features, et.Adagrad(0.2), device=device, **kwargs)


def _mixed_batch(step: int, lo: int = 0, hi: int = B) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Bags lo..hi-1 of step ``step``'s batch of B bags of 0 to 3 ids a feature, and their gradients."""
    g = torch.Generator().manual_seed(7 + step)
    feats, grads = {}, {}
    for name in ("fw", "fb", "fh"):
        lists = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(0, 4, (B,), generator=g)]
        feats[name] = et.Ragged.from_lists(lists[lo:hi])
        grads[name] = torch.randn(B, D, generator=g)[lo:hi].to(TEST_DEVICE)
    return feats, grads


@pytest.mark.parametrize("pipelined", [False, True])
def test_tables_of_three_storage_types_share_the_lookup_and_the_update(pipelined: bool) -> None:
    """One lookup launch reads a float32, a bfloat16 and a float16 table (each feature's own storage); their
    updates are launched per storage type. Pipelined, an update held back a step rounds with its own step."""
    calls = {"lookups": 0}
    real = gpu.lookup_many

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["lookups"] += 1
        return real(*args, **kwargs)

    def run(emb: Any) -> list[dict[str, torch.Tensor]]:
        seen = []
        for step in range(3):
            feats, grads = _mixed_batch(step)
            seen.append({k: v.detach().cpu().clone() for k, v in emb(feats).items()})
            emb.apply_gradients(grads)
        return seen

    kwargs = {"pipeline_execution_with_tensor_core": True} if pipelined else {}
    fused = _mixed(TEST_DEVICE, **kwargs)
    gpu.lookup_many = counted  # type: ignore[assignment]
    try:
        seen = run(fused)
    finally:
        gpu.lookup_many = real  # type: ignore[assignment]
    assert calls["lookups"] == 3  # every feature of every storage type in one launch a step
    _reference_path()
    reference = _mixed(TEST_DEVICE, **kwargs)
    want = run(reference)
    for a, b in zip(seen, want):
        for k in a:  # the mean's division: the reference sums a bag in order, the kernel as a tree
            torch.testing.assert_close(a[k], b[k], rtol=2e-6, atol=2e-7)
    got, ref = _stored(fused), _stored(reference)
    assert got.keys() == ref.keys()
    for k in got:
        assert got[k].dtype == ref[k].dtype
        torch.testing.assert_close(got[k].float(), ref[k].float(), rtol=2e-6, atol=2e-7)


def test_a_half_tables_lookup_is_a_float32_tables_of_the_same_values() -> None:
    """Rows widened exactly and pooled in float32: the same bits as a float32 table holding the widened
    values, on the same kernels (bags of several ids, with weights)."""
    for dtype in HALF.values():
        half = _module("sgd", dtype)
        full = _module("sgd", None)
        full.load_state_dict({"t": half.embedding_tables["t"].float()}, strict=False)
        g = torch.Generator().manual_seed(1)
        lists = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(0, 6, (B,), generator=g)]
        ids = et.Ragged.from_lists(lists)
        weights = et.Ragged.from_lists([torch.rand(len(r), generator=g).tolist() for r in lists], dtype=torch.float32)
        assert torch.equal(half({"f": ids}, {"f": weights})["f"], full({"f": ids}, {"f": weights})["f"])


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_a_float16_overflow_is_refused_with_nothing_written(rounding: str) -> None:
    """Row 2 holds 65504, float16's largest value; the float32 updates are finite, only their rounding
    overflows. 65504 + 0.15 is beyond 65504, an overflow stochastically rounded, and 65504 rounded to
    nearest; 65504 + 30 overflows either way. The dry run refuses an overflow with nothing written."""
    table = et.TableConfig(V, D, name="t", combiner="sum", dtype=torch.float16, rounding=rounding)
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.SGD(0.3), device=TEST_DEVICE)
    rows = torch.full((V, D), 1.0)
    rows[2] = 65504.0
    emb.load_state_dict({"t": rows}, strict=False)
    for gradient in (-0.5, -100.0):
        before = _stored(emb)
        emb({"f": torch.tensor([1, 2], device=TEST_DEVICE)})
        step = {"f": torch.full((2, D), gradient, device=TEST_DEVICE)}
        if rounding == "nearest" and gradient == -0.5:
            emb.apply_gradients(step)  # rounds back to 65504
            assert bool((emb.embedding_tables["t"][2] == 65504.0).all())
            continue
        with pytest.raises(InputError, match=r"row 2 .*float16 overflow \(\|value\| > 65504\)"):
            emb.apply_gradients(step)
        assert _same(before, _stored(emb))


def test_a_dynamic_half_table_rounds_by_key_as_the_reference_does() -> None:
    """A dynamic table's rows round with the key each row holds (its global row ids change as keys come and
    go): the kernel reads them from the device copy of the row keys, made again when they change."""

    def make() -> Any:
        dynamic = et.DynamicVocabulary(admit_after=1, eviction="lru")
        table = et.TableConfig(20, 4, name="u", combiner="sum", dtype=torch.bfloat16, slot_dtype=torch.bfloat16,
                               initializer=et.Constant(0.3), dynamic=dynamic)  # fmt: skip
        return et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adagrad(0.1), device=TEST_DEVICE)

    def run(emb: Any) -> None:
        g = torch.Generator().manual_seed(0)
        for _ in range(8):  # keys beyond the 20 rows: rows are reused by other keys
            emb({"f": torch.randint(0, 10**12, (8,), generator=g).to(TEST_DEVICE)})
            emb.apply_gradients({"f": torch.randn(8, 4, generator=g).to(TEST_DEVICE)})

    fused = make()
    assert isinstance(fused._engine.local.backend, GpuBackend)
    run(fused)
    assert fused.vocabulary_statistics()["u"]["evicted"] > 0
    _reference_path()
    reference = make()
    run(reference)
    _assert_as_the_reference(_stored(fused), _stored(reference))


def _sharded_rank(rank: int, world: int, want_path: str) -> None:
    from embtables.kernels.triton_interpreter import mend

    mend()  # a spawned rank: Triton's interpreter mended as in the test process
    os.environ["EMBTABLES_SHM"] = "0"
    assert _gpu_path()
    emb = _mixed(TEST_DEVICE, sharding="mod")
    assert type(emb._engine.local.backend) is GpuBackend
    for step in range(3):
        feats, grads = _mixed_batch(step, rank * B // world, (rank + 1) * B // world)
        emb(feats)
        emb.apply_gradients(grads)
    want = torch.load(want_path)
    got = _stored(emb)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        torch.testing.assert_close(got[k].float(), v.float(), rtol=2e-6, atol=2e-7)


@pytest.mark.distributed
def test_sharded_half_tables_on_the_gpu_backend_equal_one_process(tmp_path: Path) -> None:
    if ON_CUDA:
        pytest.skip("the ranks run the kernels on CPU tensors through Triton's interpreter")
    one = _mixed(TEST_DEVICE)
    for step in range(3):
        feats, grads = _mixed_batch(step)
        one(feats)
        one.apply_gradients(grads)
    torch.save(_stored(one), tmp_path / "want.pt")
    run_world(_sharded_rank, 2, str(tmp_path / "want.pt"), timeout=600)


def test_a_row_map_the_kernel_cannot_read_as_it_is_is_copied_once_per_version() -> None:
    """The update reads each row's global id from an int64 tensor on the tables' device: the mapping itself
    when it is one, else a copy, made again only when the mapping is another tensor or was changed in place."""
    emb = _module("adagrad", torch.bfloat16)
    backend = emb._engine.local.backend
    table = emb._engine.local._tables.tables[0]
    rows = emb._engine.local._tables.global_rows
    same = torch.arange(V, dtype=torch.int64, device=TEST_DEVICE)
    rows["t"] = same
    assert backend._global_rows(table) is same
    narrow = torch.arange(V, dtype=torch.int32)  # not int64: copied
    rows["t"] = narrow
    first = backend._global_rows(table)
    assert first.dtype == torch.int64 and first.device.type == torch.device(TEST_DEVICE).type
    assert torch.equal(first.cpu(), narrow.long())
    assert backend._global_rows(table) is first  # unchanged: the same copy
    narrow[3] = 99  # changed in place: copied again
    again = backend._global_rows(table)
    assert again is not first and int(again[3]) == 99
    rows["t"] = narrow.clone()  # another tensor with the same values: copied again
    assert backend._global_rows(table) is not again
    rows["t"] = AffineRows(3, 2, V)  # a sharded table's block or stride: its ids made once on the device
    made = backend._global_rows(table)
    assert torch.equal(made.cpu(), torch.arange(V) * 2 + 3) and backend._global_rows(table) is made
    del rows["t"]
    assert backend._global_rows(table) is None
