"""The C kernels round half rows through vector loops (8 values at a time, compiled for this CPU's widest integer
vectors) or scalar loops; the vector ones are the default. Both must give the bits of the torch reference
(``kernels/stochastic_rounding.py`` for stochastic rounding, the types' own conversion to nearest): each test
forces each path (``native.rounding_path``) on the same values and compares bit for bit, on values chosen for
every branch of the rules (zeros, float16 subnormals beside normals, ties, overflow, infinities, NaNs) and on
half tables trained for a few steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import embtables as et
from embtables.kernels import native, native_library
from embtables.kernels import stochastic_rounding as sr

pytestmark = pytest.mark.skipif(native_library.library() is None, reason="the native kernels are not built here")
HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
PATHS = {"vector": True, "scalar": False}


@pytest.fixture()
def rounding_path() -> Iterator[Any]:
    """Set the path for the test; the library's own is put back after it."""
    before = native.rounding_path()
    yield native.rounding_path
    native.rounding_path(before)


def _hard_values(gen: torch.Generator, rows: int, dim: int) -> torch.Tensor:
    """[rows, dim] float32: every 8-value group of its own kind, so whole vectors of each case reach the vector
    loops: normals of many magnitudes, ones with zeros of both signs among them, float16 subnormals among
    normals, ties of both types (dropped bits exactly half), float16's edge (65504 and beyond), infinities and
    NaNs, and float32 bit patterns drawn uniformly."""
    n = rows * dim
    mags = torch.pow(10.0, torch.randint(-9, 6, (n,), generator=gen).float())
    normal = torch.randn(n, generator=gen) * mags
    zeros = torch.where(torch.rand(n, generator=gen) < 0.5, torch.randn(n, generator=gen), torch.zeros(n))
    zeros = torch.where(torch.rand(n, generator=gen) < 0.3, -torch.zeros(n), zeros)
    tiny = torch.where(torch.rand(n, generator=gen) < 0.2, torch.randn(n, generator=gen) * 1e-6, torch.randn(n))
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    ties = (bits & ~0xFFFF) | 0x8000  # bfloat16's tie, float16's when the exponent allows
    ties16 = (torch.randint(0x38800000, 0x47800000, (n,), generator=gen).to(torch.int32) & ~0x1FFF) | 0x1000
    edge = torch.tensor([65504.0, 65519.0, 65520.0, 65536.0, -65505.0, 1e30, float("inf"), -float("inf"),
                         float("nan"), 6.1e-5, 3.0e-8, -2.9e-8])[torch.randint(0, 12, (n,), generator=gen)]  # fmt: skip
    kinds = [normal, zeros, tiny, bits.view(torch.float32), ties.view(torch.float32), ties16.view(torch.float32),
             edge.float()]  # fmt: skip
    groups = torch.randint(0, len(kinds), (n // 8 + 1,), generator=gen).repeat_interleave(8)[:n]
    out = torch.empty(n)
    for k, values in enumerate(kinds):
        out = torch.where(groups == k, values, out)
    return out.reshape(rows, dim).contiguous()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal patterns, or both NaN (a NaN's payload is the type's concern, not the rounding's)."""
    nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | nan).all())


@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("kind", sorted(HALF))
def test_both_loops_round_every_kind_of_value_as_the_reference(kind: str, stochastic: bool, rounding_path: Any) -> None:
    gen = torch.Generator().manual_seed(11)
    x = _hard_values(gen, 300, 37)  # 37 columns: four whole vectors and a tail of 5 in every row
    rows = torch.randint(0, 2**40, (300,), generator=gen)
    got = {}
    for name, vector in PATHS.items():
        rounding_path(vector)
        got[name] = native.round_rows(x, rows, 99, 2**33 + 5, 6, HALF[kind], stochastic=stochastic)
    bits = sr.random_bits(99, 2**33 + 5, 6, rows, 37) if stochastic else None
    want = sr.round_to(x, HALF[kind], bits) if stochastic else x.to(HALF[kind])
    assert torch.equal(got["vector"].view(torch.int16), got["scalar"].view(torch.int16))  # NaNs too: one code
    assert _same_bits(got["scalar"], want)


@pytest.mark.parametrize("kind", sorted(HALF))
def test_columns_past_two_to_the_sixteen_round_as_the_reference(kind: str, rounding_path: Any) -> None:
    """The vector loops hash (row, column) from the row's first round, which holds for columns below 2^16 only;
    a row of 70,000 columns (or a slot's columns, (k + 1) * D + c, past it) takes the scalar rules there."""
    gen = torch.Generator().manual_seed(12)
    x = _hard_values(gen, 2, 70_000)
    rows = torch.tensor([3, 2**35 + 1])
    got = {}
    for name, vector in PATHS.items():
        rounding_path(vector)
        got[name] = native.round_rows(x, rows, 7, 11, 2, HALF[kind], stochastic=True)
    want = sr.round_to(x, HALF[kind], sr.random_bits(7, 11, 2, rows, 70_000))
    assert torch.equal(got["vector"].view(torch.int16), got["scalar"].view(torch.int16))
    assert _same_bits(got["vector"], want)


def _train(opt: Any, dtype: torch.dtype, slot_dtype: torch.dtype | None, rounding: str) -> list[torch.Tensor]:
    """Six steps of a 200 x 37 table (lookups of every step, then the stored weights and slots)."""
    table = et.TableConfig(
        200, 37, name="t", combiner="sum", initializer=et.TruncatedNormal(seed=1), dtype=dtype,
        slot_dtype=slot_dtype, rounding=rounding, rounding_seed=5,
    )  # fmt: skip
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, opt)
    seen = []
    for step in range(6):
        g = torch.Generator().manual_seed(50 + step)
        ids = torch.randint(0, 200, (64,), generator=g)
        seen.append(emb({"f": ids})["f"].detach().clone())
        emb.apply_gradients({"f": torch.randn(64, 37, generator=g) * 0.5})
    return seen + [v.detach().clone() for v in emb.state_dict().values()]


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize(
    "opt, dtype, slot_dtype",
    [
        (lambda: et.Adam(0.05), torch.float16, torch.float16),  # zero-started slots: zero lanes, then tiny ones
        (lambda: et.Adagrad(0.2, initial_accumulator_value=0.1), torch.bfloat16, torch.bfloat16),
        (lambda: et.SGD(0.3), torch.float16, None),
    ],
    ids=["adam-f16", "adagrad-bf16", "sgd-f16"],
)
def test_half_tables_train_to_the_same_bits_on_either_path_and_in_torch(
    opt: Any, dtype: torch.dtype, slot_dtype: torch.dtype | None, rounding: str, rounding_path: Any
) -> None:
    runs = {}
    for name, vector in PATHS.items():
        rounding_path(vector)
        runs[name] = _train(opt(), dtype, slot_dtype, rounding)
    native_library.set_enabled(False)
    try:
        runs["torch"] = _train(opt(), dtype, slot_dtype, rounding)
    finally:
        native_library.set_enabled(True)
    for name in ("scalar", "torch"):
        assert all(torch.equal(a, b) for a, b in zip(runs["vector"], runs[name])), name


def test_the_path_is_the_vector_loops_unless_set() -> None:
    before = native.rounding_path()
    assert before is True  # chosen when the library loads
    assert native.rounding_path(False) is True and native.rounding_path() is False
    assert native.rounding_path(before) is False and native.rounding_path() is True
