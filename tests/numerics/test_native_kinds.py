"""An optimizer kind the native kernels do not know is an error, in Python and in C (issue 20): before,
the C dispatch ended in ``default: return et_row_ftrl`` and would have run FTRL."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import embtables as et
from embtables.kernels import native


def _prepared(dim: int = 3) -> native.Workspace:
    ws = native.Workspace(dim)
    assert ws.load(torch.tensor([1, 4]), torch.ones(2, dim), 6) == 0
    return ws


def test_python_refuses_an_optimizer_without_a_native_kernel() -> None:
    @dataclasses.dataclass(frozen=True)
    class MyAdagrad(et.Adagrad):
        pass

    with pytest.raises(native.NativeBufferError, match="no native kernel for MyAdagrad"):
        native.opt_params(MyAdagrad(0.1), 0.1, 0.0, clip_gradients=True)


@pytest.mark.skipif(native.library() is None, reason="needs the native kernels (a C compiler)")
def test_c_refuses_an_unknown_kind_and_writes_nothing() -> None:
    weights, acc = torch.ones(6, 3), torch.full((6, 3), 0.1)
    before = (weights.clone(), acc.clone())
    params = native.opt_params(et.Adagrad(0.1), 0.1, 0.0, clip_gradients=True)
    params.kind = 99
    ws = _prepared()
    with pytest.raises(native.NativeBufferError, match="unknown optimizer kind"):
        ws.apply(weights, (acc,), params, dense=False)
    with pytest.raises(native.NativeBufferError, match="unknown optimizer kind"):
        ws.check(weights, (acc,), params, dense=False)
    good = native.opt_params(et.Adagrad(0.1), 0.1, 0.0, clip_gradients=True)
    other = _prepared()
    w2, a2 = torch.ones(6, 3), torch.full((6, 3), 0.1)
    with pytest.raises(native.NativeBufferError, match="unknown optimizer kind"):
        native.apply_many([(other, w2, (a2,), good, False, False), (ws, weights, (acc,), params, False, False)])
    assert torch.equal(w2, torch.ones(6, 3))  # the good table was not written either: all checked first
    with pytest.raises(native.NativeBufferError, match="unknown optimizer kind"):
        native.apply_sequential(torch.tensor([1]), torch.ones(1, 3), weights, (acc,), params)
    assert torch.equal(weights, before[0]) and torch.equal(acc, before[1])


@pytest.mark.skipif(native.library() is None, reason="needs the native kernels (a C compiler)")
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_phase_1_on_one_thread_and_on_several_gives_the_same_bits(combiner: str) -> None:
    """On one thread phase 1 scatters the occurrences in order; on several it groups them by row and sums
    each row in parallel. Both add the same float32 terms in the same order: the same tables, and the same
    as the torch reference path."""

    def train(threads: int, native_on: bool) -> dict[str, torch.Tensor]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        native.set_enabled(native_on)
        try:
            table = et.TableConfig(50, 6, name="t", initializer=et.TruncatedNormal(seed=5), combiner=combiner)
            emb = et.DistributedEmbedding(
                {"a": et.FeatureConfig(table)}, et.Adagrad(0.3)
            )  # one table: threads split rows
            gen = torch.Generator().manual_seed(7)
            for step in range(4):
                lengths = torch.randint(0, 30, (40,), generator=gen)
                ids = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
                weights = torch.rand(ids.numel(), generator=gen) * 3
                acts = emb({"a": et.Ragged.from_lengths(ids, lengths)}, {"a": et.Ragged.from_lengths(weights, lengths)})
                grad = torch.randn(acts["a"].shape, generator=gen) * (10.0 ** (step - 2))
                emb.apply_gradients({"a": grad if step != 1 else None})  # step 1: a zero gradient
            return {k: v.clone() for k, v in emb.state_dict().items()}
        finally:
            native.set_enabled(True)
            torch.set_num_threads(before)

    one, several, reference = train(1, True), train(2, True), train(1, False)
    for key in reference:
        assert torch.equal(one[key], several[key]), key
        assert torch.equal(one[key], reference[key]), key


def test_native_argument_arrays_are_reused_only_for_equal_values() -> None:
    import ctypes

    from embtables.kernels.native_args import array

    a = array("test.site", ctypes.c_int64, [1, 2, 3])
    assert list(a) == [1, 2, 3]
    assert array("test.site", ctypes.c_int64, [1, 2, 3]) is a  # the same values: the same array
    b = array("test.site", ctypes.c_int64, [1, 2, 4])
    assert b is not a and list(b) == [1, 2, 4] and list(a) == [1, 2, 3]  # a built array never changes
    c = array("test.site", ctypes.c_int32, [1, 2, 4])
    assert c is not b and c._type_ is ctypes.c_int32
    d = array("test.site", ctypes.c_int32, [1, 2])
    assert len(d) == 2 and list(d) == [1, 2]
    assert array("test.other", ctypes.c_int32, [1, 2]) is not d  # sites are separate


# distinct rows padding a step past the one-thread sums' L2 size (ET_SUMS_IN_CACHE: 65,536 floats; x 8 columns)
PAST_L2 = 9000


def _padded(
    ids: list[torch.Tensor], offsets: list[torch.Tensor], grads: list[torch.Tensor | None], extra: int, vocab: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]]:
    """The parts plus one of ``extra`` distinct rows from ``vocab`` on, one bag each, gradients [extra, 8]."""
    if not extra:
        return ids, offsets, grads
    pad = torch.Generator().manual_seed(extra)
    extra_grads = torch.randn(extra, 8, generator=pad)
    return [*ids, torch.arange(vocab, vocab + extra)], [*offsets, torch.arange(extra + 1)], [*grads, extra_grads]


@pytest.mark.skipif(native.library() is None, reason="needs the native kernels (a C compiler)")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("extra", [0, PAST_L2])
def test_phase_1_sums_start_from_positive_zero(threads: int, direct: bool, extra: int) -> None:
    """Every row's sum starts from +0 as the reference's index_add_ into zeros does, so -0 gradients sum to
    +0 (0.0f + -0.0f). On one thread, past L2, each row's first occurrence sets its sum with no clearing pass
    before, and must keep that; a zero gradient (None) sums to +0 too. Sums of several terms keep their order."""
    ids = [torch.tensor([4, 4, 5, 1, 4, 9]), torch.tensor([7, 2, 2])]
    offsets = [torch.tensor([0, 2, 3, 6]), torch.tensor([0, 1, 3])]
    grads: list[torch.Tensor | None] = [torch.full((3, 8), -0.0), None]
    grads[0][2] = torch.arange(8.0) - 3.5  # bag 2: rows 1, 4 and 9 get nonzero sums
    ids, offsets, grads = _padded(ids, offsets, grads, extra, 10)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    lib = native.library()
    assert lib is not None
    lib.et_set_dedup_mode(2 if direct else 1)  # the direct map or the hash
    try:
        ws = native.Workspace(8)
        parts = [(i, o, None, g) for i, o, g in zip(ids, offsets, grads)]
        (status,) = native.prepare_many([(ws, 10 + extra, parts)])
        (again,) = native.prepare_many([(ws, 10 + extra, parts)])  # the sums of the step before are not kept
    finally:
        lib.et_set_dedup_mode(0)
        torch.set_num_threads(before)
    assert status == again == 0
    rows, sums = ws.rows_and_grads()
    expected = torch.zeros(10 + extra, 8)
    for i, o, g in zip(ids, offsets, grads):
        per_id = (g if g is not None else torch.zeros(len(o) - 1, 8)).repeat_interleave(o.diff(), dim=0)
        for k in range(i.numel()):
            expected[i[k]] += per_id[k]  # in occurrence order, from +0
    assert rows.tolist()[:6] == [4, 5, 1, 9, 7, 2]
    assert torch.equal(sums.view(torch.int32), expected[rows].view(torch.int32))
    assert not bool(torch.signbit(sums[1]).any())  # row 5: one -0 term, from +0: +0


@pytest.mark.skipif(native.library() is None, reason="needs the native kernels (a C compiler)")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("extra", [0, PAST_L2])
def test_phase_1_refuses_sums_that_overflow_and_bounds_the_others(threads: int, extra: int) -> None:
    """Past L2 (and on several threads), phase 1 reads the sums again only when a bound on them (the most
    occurrences of one row x the largest |coefficient| x the largest |gradient|) reaches 1e37; in L2 on one
    thread it scans them exactly. Either way sums of finite gradients that overflow float32, and a NaN gradient,
    are refused, and the bound it reports covers every |sum|."""
    ids, offsets = [torch.tensor([1, 1, 2, 1])], [torch.tensor([0, 1, 2, 3, 4])]

    def step(grads: torch.Tensor) -> int:
        parts = _padded(ids, offsets, [grads], extra, 10)
        (status,) = native.prepare_many([(ws, 10 + extra, list(zip(parts[0], parts[1], [None] * 2, parts[2])))])
        return status

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ws = native.Workspace(8)
        overflow = step(torch.full((4, 8), 2e38))
        nan = torch.ones(4, 8)
        nan[3, 2] = float("nan")
        not_a_number = step(nan)
        grads = torch.zeros(4, 8)
        grads[:, :4] = torch.tensor(
            [[3.0, -1.0, 0.5, 2.0], [-7.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [2.5, -4.0, 1.0, 0.0]]
        )
        fine = step(grads)
    finally:
        torch.set_num_threads(before)
    assert (overflow, not_a_number, fine) == (1, 1, 0)
    _, sums = ws.rows_and_grads()
    assert float(sums.abs().max()) <= ws.gradient_max_abs <= 3 * 7.0 * 1.001  # 3 occurrences of row 1, |g| <= 7
