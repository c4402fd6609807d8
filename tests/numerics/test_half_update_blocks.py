"""The half update (``et_apply_half``) reads its rows in blocks of up to 16 (at most 256 values a block) and runs
the optimizer once over a block, as one row of its values: the row functions are elementwise. Whatever the width
(8, 4 or 1 rows a block), the thread count and where a block's rows lie among the threads' chunks (256 rows a
thread), every stored weight and slot, and every lookup, keeps the torch reference's bits: a bfloat16 table with a
bfloat16 slot rounded stochastically (the loop of its own), float16 rows with two float16 slots, and bfloat16 rows
with float32 slots."""

from __future__ import annotations

import pytest
import torch

import embtables as et
from embtables.kernels import native_library

pytestmark = pytest.mark.skipif(native_library.library() is None, reason="the native kernels are not built here")

V, B = 3000, 700  # about 620 distinct rows a step: three chunks of 256 rows, the last one short
CASES = {
    "adagrad-bf16-bf16": (lambda: et.Adagrad(0.2, initial_accumulator_value=0.1), torch.bfloat16, torch.bfloat16),
    "adam-f16-f16": (lambda: et.Adam(0.05), torch.float16, torch.float16),
    "ftrl-bf16-f32": (lambda: et.FTRL(0.2, l1_regularization_strength=0.01), torch.bfloat16, torch.float32),
}


def _train(case: str, dim: int, rounding: str) -> list[torch.Tensor]:
    """Three steps of a V x dim table: every step's lookups, then the stored weights and slots."""
    opt, dtype, slot_dtype = CASES[case]
    table = et.TableConfig(
        V, dim, name="t", combiner="sum", initializer=et.TruncatedNormal(seed=1), dtype=dtype,
        slot_dtype=slot_dtype, rounding=rounding, rounding_seed=9,
    )  # fmt: skip
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, opt())
    seen = []
    for step in range(3):
        g = torch.Generator().manual_seed(70 + step)
        ids = torch.randint(0, V, (B,), generator=g)
        seen.append(emb({"f": ids})["f"].detach().clone())
        emb.apply_gradients({"f": torch.randn(B, dim, generator=g) * 0.5})
    return seen + [v.detach().clone() for v in emb.state_dict().values()]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim", [24, 60, 200], ids=["8-rows-a-block", "4-rows-a-block", "1-row-a-block"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_block_size_and_thread_count_keeps_the_torch_references_bits(
    case: str, rounding: str, dim: int, threads: int
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native = _train(case, dim, rounding)
        native_library.set_enabled(False)
        try:
            reference = _train(case, dim, rounding)
        finally:
            native_library.set_enabled(True)
    finally:
        torch.set_num_threads(before)
    assert len(native) == len(reference)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(native, reference))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The stored patterns: a half tensor as int16, a float32 one as int32."""
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)
