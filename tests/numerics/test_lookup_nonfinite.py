"""The lookups' finiteness flag (``et_lookup_many`` and ``et_lookup_half_many`` status 2): the kernels OR each
output value's "not finite" bit into 8 lanes over all bags and reduce them once per thread, so every column of
every width (whole groups of 8 and the columns past the last one), in each output layout, storage type and
thread count, must still raise it, and a finite lookup must never."""

from __future__ import annotations

import pytest
import torch

from embtables.kernels import native, native_half

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the native library (a C compiler)")

CASES = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.float16, False)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("dtype", "shared"), CASES)
@pytest.mark.parametrize("dim", [1, 5, 8, 13, 24, 64, 67])
def test_every_column_of_every_width_flags_a_non_finite_activation(
    dim: int, dtype: torch.dtype, shared: bool, threads: int
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(dim)
        table = torch.randn(6, dim, generator=g).to(dtype)
        other = torch.randn(4, 3, generator=g).to(dtype)
        ids = torch.tensor([0, 3, 3, 5, 1])  # bags [0], [3, 3], [5, 1]: the bad row 5 is read by bag 2
        offsets = torch.tensor([0, 1, 3, 5])
        parts = [(other, torch.tensor([2, 1, 0]), torch.tensor([0, 1, 2, 3]), None), (table, ids, offsets, None)]

        def look() -> tuple[torch.Tensor, int]:
            if dtype != torch.float32:
                outs, status = native_half.lookup_half_many(parts)
                return outs[1], status
            if shared:
                out = torch.empty(3, 3 + dim + 2)  # rows wider than the two blocks: ld > D
                outs, status = native.lookup_many(parts, (out, [0, 3]))
                return outs[0][:, 3 : 3 + dim].clone(), status
            outs, status = native.lookup_many(parts)
            return outs[1], status

        acts, status = look()
        assert status == 0
        rows = table.float()
        assert torch.equal(acts, torch.stack([rows[0], rows[3] + rows[3], rows[5] + rows[1]]))
        for value in (float("inf"), float("-inf"), float("nan")):
            for d in range(dim):
                kept = table[5, d].item()
                table[5, d] = value
                assert look()[1] == 2, (value, d)
                table[5, d] = kept
        assert look()[1] == 0
    finally:
        torch.set_num_threads(before)
