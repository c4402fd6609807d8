"""The fused GPU kernels (Triton) against the torch kernels, kernel by kernel.

On a machine with CUDA and Triton they run on the GPU; without CUDA they run on CPU tensors through
Triton's interpreter when Triton is installed (``tests/conftest.py`` then sets ``TRITON_INTERPRET=1``
before Triton is imported); otherwise they skip.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import embtables as et
from embtables.kernels import gpu, gpu_step
from embtables.kernels.clip_decay import effective_weight_decay
from embtables.kernels.lookup import occurrence_gradients, pooled_lookup
from embtables.kernels.segments import dedup_sum, segments_from_offsets
from embtables.kernels.sparse_update import update_rows

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    DEVICE = torch.device("cuda")
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
else:
    DEVICE = None
# Pieces of runs in most long-run cases (``gpu.PIECE`` is read at each launch): the same kernels as the
# library's 128, an eighth of the loop trips through Triton's interpreter
SHORT_PIECE = 16


@pytest.fixture(autouse=True)
def _gpu_kernels() -> Any:
    if DEVICE is None:
        pytest.skip("no CUDA device, and Triton's interpreter is off (TRITON_INTERPRET=1 runs these on the CPU)")
    gpu.set_enabled(True, on_cpu=DEVICE.type == "cpu")
    if not gpu.usable(DEVICE):
        pytest.skip("Triton is not installed")
    yield
    gpu.set_enabled(True)


def _bags(gen: torch.Generator, vocab: int, bags: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.randint(0, max_len + 1, (bags,), generator=gen)
    offsets = torch.zeros(bags + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    ids = torch.randint(0, vocab, (int(offsets[-1]),), generator=gen)
    return ids.to(DEVICE), offsets.to(DEVICE)


def test_lookup_of_every_feature_in_one_launch_matches_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    tables = [torch.randn(v, d, generator=gen).to(DEVICE) for v, d in ((50, 8), (7, 3), (30, 16))]
    parts, expected = [], []
    for i, (table, bags) in enumerate(zip([*tables, tables[0]], (5, 9, 4, 6))):
        ids, offsets = _bags(gen, table.shape[0], bags, 4 if i != 1 else 1)
        coeffs = torch.rand(ids.numel(), generator=gen).to(DEVICE) if i % 2 == 0 else None
        parts.append((table, ids, offsets, coeffs))
        expected.append(pooled_lookup(table, ids, segments_from_offsets(offsets), offsets, coeffs))
    width = sum(t.shape[1] for t, *_ in parts)
    wide = torch.full((parts[0][2].numel() - 1, width), float("nan"), device=DEVICE)
    outs = [torch.full(e.shape, float("nan"), device=DEVICE) for e in expected]
    outs[0] = wide[:, : parts[0][0].shape[1]]  # a column block of a wider output
    status = gpu.lookup_many(parts, outs)
    assert status.tolist() == [0, 0, 0, 0]
    for got, exp in zip(outs, expected):
        torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6)


def test_lookup_flags_ids_outside_the_table_and_broken_offsets_without_reading_them() -> None:
    table = torch.randn(5, 4).to(DEVICE)
    ids = torch.tensor([0, 5, 2, -1], device=DEVICE)
    good = torch.tensor([0, 2, 4], device=DEVICE)
    out = torch.zeros((2, 4), device=DEVICE)
    assert gpu.lookup_many([(table, ids, good, None)], [out]).tolist() == [1]
    broken = torch.tensor([0, 3, 99], device=DEVICE)  # past the 4 ids
    assert gpu.lookup_many([(table, ids[:3].clamp(0, 4), broken, None)], [out]).tolist() == [1]
    big = torch.full((3, 4), 3e38, device=DEVICE)
    flags = gpu.lookup_many([(big, torch.tensor([0, 1], device=DEVICE), good[:2].clone(), None)], [out[:1]])
    assert flags.tolist() == [2]


def test_lookup_refuses_buffers_the_kernel_cannot_read() -> None:
    table = torch.randn(5, 4).to(DEVICE)
    ids, offsets = torch.tensor([0, 1], device=DEVICE), torch.tensor([0, 2], device=DEVICE)
    with pytest.raises(gpu.GpuBufferError, match="ids"):
        gpu.lookup_many([(table, ids.to(torch.int32), offsets, None)], [torch.zeros((1, 4), device=DEVICE)])
    with pytest.raises(gpu.GpuBufferError, match="output"):
        gpu.lookup_many([(table, ids, offsets, None)], [torch.zeros((2, 4), device=DEVICE)])


@pytest.mark.parametrize("multi", [False, True])
def test_row_sums_match_dedup_sum(multi: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    vocab, dim = 40, 5
    parts, all_ids, all_grads = [], [], []
    for f in range(2 if multi else 1):
        ids, offsets = _bags(gen, vocab, 12, 6)
        seg = segments_from_offsets(offsets)
        coeffs = torch.rand(ids.numel(), generator=gen).to(DEVICE) if f == 0 else None
        grad = torch.randn(12, dim, generator=gen).to(DEVICE)
        parts.append((ids, seg, coeffs, grad, 0))
        all_ids.append(ids)
        all_grads.append(occurrence_gradients(grad, seg, coeffs))
    # the CPU reference adds each row's occurrences one by one in occurrence order, as the kernel does
    rows, sums = dedup_sum(torch.cat(all_ids).cpu(), torch.cat(all_grads).cpu())
    got = gpu_step.row_sums(parts, [vocab], dim)
    u, maxbits, bad, longest, *_ = got.stats.tolist()
    assert u == rows.numel() and bad == 0 and longest == int(torch.bincount(torch.cat(all_ids).cpu()).max())
    assert torch.equal(got.rows[:u].cpu(), rows)
    assert torch.equal(got.sums[:u].cpu(), sums), "the same float32 additions in the same order: the same bits"
    assert gpu.bits_to_float([maxbits])[0] == float(sums.abs().max())


def test_stage_inputs_flags_each_broken_rule_per_feature() -> None:
    ids = torch.tensor([0, 4, 2, 3], device=DEVICE)
    good = torch.tensor([0, 1, 4], device=DEVICE)
    parts = [
        (ids, good, 5, 0, False),  # fine
        (ids, None, 5, 0, False),  # dense, fine
        (ids, good, 4, 0, False),  # id 4 outside a table of 4
        (ids, torch.tensor([0, 3, 2, 4], device=DEVICE), 5, 1, False),  # decreasing splits
        (ids, torch.tensor([1, 4], device=DEVICE), 5, 2, False),  # does not start at 0
        (ids, torch.tensor([0, 3], device=DEVICE), 5, 0, False),  # does not end at N
        (torch.tensor([-1], device=DEVICE), None, 5, 0, False),  # negative id
        (torch.zeros(0, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE), 5, 1,
         False),
    ]  # fmt: skip
    refused = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    flags, segs, coeffs = gpu.stage_inputs(parts, refused)
    assert flags.tolist() == [0, 0, 1, 2, 2, 2, 1, 0] and refused.tolist() == [1]
    assert segs[:4].tolist() == [0, 1, 1, 1]  # the bags of the first feature's ids
    for bags, splits in ((12, 6), (1, 1), (300, 3), (4096, 2)):
        gen = torch.Generator().manual_seed(bags)
        ids_, offsets = _bags(gen, 9, bags, splits)
        for mode, combiner in ((1, "mean"), (2, "sqrtn")):
            flags, segs, coeffs = gpu.stage_inputs([(ids_, offsets, 9, mode, False)])
            assert flags.tolist() == [0]
            assert torch.equal(segs.cpu(), segments_from_offsets(offsets.cpu()))
            counts = (offsets[1:] - offsets[:-1]).cpu().to(torch.float32)
            den = counts if combiner == "mean" else torch.sqrt(counts)
            expected = torch.repeat_interleave(torch.reciprocal(den), (offsets[1:] - offsets[:-1]).cpu())
            assert torch.equal(coeffs.cpu(), expected), "torch's float32 division and square root: the same bits"


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_stage_inputs_drops_negative_ids_in_place(mode: int) -> None:
    """A dropping feature's negative ids are no error: rewritten -1, coefficient 0, not counted in their bag;
    ids at V or beyond are still flagged; a feature that does not drop flags them."""
    ids = torch.tensor([3, -1, -7, 2, -2, 1, 0], device=DEVICE)
    splits = torch.tensor([0, 3, 3, 6, 7], device=DEVICE)  # bags [3, -1, -7], [], [2, -2, 1], [0]
    dense = torch.tensor([-4, 2], device=DEVICE)
    parts = [(ids, splits, 5, mode, True), (dense, None, 5, 0, True), (ids.clone(), splits, 5, mode, False)]
    flags, segs, coeffs = gpu.stage_inputs(parts)
    assert flags.tolist() == [0, 0, 1]
    assert ids.tolist() == [3, -1, -1, 2, -1, 1, 0] and dense.tolist() == [-1, 2]
    assert segs[:7].tolist() == [0, 0, 0, 2, 2, 2, 3]
    if mode:
        kept = {1: [1.0, 0.0, 0.0, 0.5, 0.0, 0.5, 1.0], 2: [1.0, 0.0, 0.0, 2**-0.5, 0.0, 2**-0.5, 1.0]}[mode]
        assert torch.equal(coeffs[:7].cpu(), torch.tensor(kept, dtype=torch.float32))
    flags, _, _ = gpu.stage_inputs([(torch.tensor([-1, 5], device=DEVICE), None, 5, 0, True)])
    assert flags.tolist() == [1]  # 5 is outside a table of 5: still an error


def test_row_sums_join_a_hot_row_from_pieces() -> None:
    """A row with 200 occurrences is two pieces (128 + 72), joined in order (within float32 rounding of the
    one-by-one sum); every other row keeps the CPU's bits."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.cat([torch.full((200,), 7), torch.randint(0, 50, (90,), generator=gen)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].to(DEVICE)
    seg = torch.arange(ids.numel(), device=DEVICE)
    grad = torch.randn(ids.numel(), 6, generator=gen).to(DEVICE)
    got = gpu_step.row_sums([(ids, seg, None, grad, 0)], [50], 6)
    rows, sums = dedup_sum(ids.cpu(), grad.cpu())
    u, _, bad, longest, *_ = got.stats.tolist()
    assert torch.equal(got.rows[:u].cpu(), rows) and bad == 0 and longest == int(torch.bincount(ids.cpu()).max())
    exact64 = torch.zeros(50, 6, dtype=torch.float64).index_add_(0, ids.cpu(), grad.cpu().double())[rows]
    torch.testing.assert_close(got.sums[:u].cpu().double(), exact64, rtol=1e-5, atol=1e-5)
    hot = int((rows == 7).nonzero())
    others = torch.arange(u) != hot
    assert torch.equal(got.sums[:u][others].cpu(), sums[others])


@pytest.mark.parametrize(("dim", "multi", "piece"), [(3, False, SHORT_PIECE), (8, True, 128), (64, False, SHORT_PIECE)])
def test_row_sums_pieces_of_long_runs_meet_in_order(
    dim: int, multi: bool, piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long runs side by side (P + 1, P, 2P, 2P + 44, 1, P - 1 and P + 3 occurrences for pieces of P: 129,
    128, 256, 300, 1, 127 and 131 at the library's 128), so that a run's short last piece and the next run's
    whole first piece begin in the same P positions: every run's sum is right, runs of at most P occurrences
    keep the CPU's bits. ``multi``: the occurrences split over two features of the table (their gradients
    apart, the second without coefficients). The piece is a kernel parameter read at each launch: the
    library's in one case, SHORT_PIECE (the same kernels, fewer loop trips) in the others."""
    monkeypatch.setattr(gpu, "PIECE", piece)
    gen = torch.Generator().manual_seed(11)
    p = piece
    lengths = {5: p + 1, 6: p, 9: 2 * p, 11: 2 * p + 44, 12: 1, 20: p - 1, 21: p + 3}
    ids = torch.cat([torch.full((n,), r) for r, n in lengths.items()] + [torch.randint(30, 60, (200,), generator=gen)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].to(DEVICE)
    seg = torch.randint(0, 64, (ids.numel(),), generator=gen).to(DEVICE)
    coeffs = torch.rand(ids.numel(), generator=gen).to(DEVICE)
    grad = torch.randn(64, dim, generator=gen).to(DEVICE)
    if multi:
        half = ids.numel() // 2
        grad2 = torch.randn(64, dim, generator=gen).to(DEVICE)
        parts = [(ids[:half], seg[:half], coeffs[:half], grad, 0), (ids[half:], seg[half:], None, grad2, 0)]
        occ = torch.cat([occurrence_gradients(grad, seg[:half], coeffs[:half]), grad2[seg[half:]]])
        occ64 = torch.cat([grad.cpu().double()[seg[:half].cpu()] * coeffs[:half].cpu().double()[:, None],
                           grad2.cpu().double()[seg[half:].cpu()]])  # fmt: skip
    else:
        parts = [(ids, seg, coeffs, grad, 0)]
        occ = occurrence_gradients(grad, seg, coeffs)
        occ64 = grad.cpu().double()[seg.cpu()] * coeffs.cpu().double()[:, None]
    got = gpu_step.row_sums(parts, [60], dim)
    rows, sums = dedup_sum(ids.cpu(), occ.cpu())
    u, maxbits, bad, longest, *_ = got.stats.tolist()
    assert torch.equal(got.rows[:u].cpu(), rows) and bad == 0 and longest == 2 * p + 44
    exact64 = torch.zeros(60, dim, dtype=torch.float64).index_add_(0, ids.cpu(), occ64)[rows]
    torch.testing.assert_close(got.sums[:u].cpu().double(), exact64, rtol=1e-5, atol=1e-4)
    counts = torch.bincount(ids.cpu(), minlength=60)[rows]
    same = (got.sums[:u].cpu() == sums).all(dim=1)
    assert bool(same[counts <= p].all())
    assert gpu.bits_to_float([maxbits])[0] == float(got.sums[:u].abs().max())


@pytest.mark.parametrize(("dim", "n"), [(300, 40), (2500, 9), (4, 1)])
def test_row_sums_and_update_for_wide_rows_and_tiny_batches(dim: int, n: int) -> None:
    """Tiles of fewer rows for wide tables (300 floats: 4 rows of 512; 2500: one row a program) and a
    batch of one id: the same sums and the same update as the torch kernels."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 7, (n,), generator=gen).to(DEVICE)
    seg = torch.arange(n, device=DEVICE)
    grad = torch.randn(n, dim, generator=gen).to(DEVICE)
    got = gpu_step.row_sums([(ids, seg, None, grad, 0)], [7], dim)
    rows, sums = dedup_sum(ids.cpu(), grad.cpu())
    u = got.stats.tolist()[0]
    assert torch.equal(got.rows[:u].cpu(), rows) and torch.equal(got.sums[:u].cpu(), sums)
    opt = et.Adagrad(0.1)
    weights, slots = _state(opt, gen, 7, dim)
    w_exp, s_exp = update_rows(weights[got.rows[:u]], (slots[0][got.rows[:u]],), got.sums[:u], opt=opt, lr=0.1,
                               clip_gradients=True)  # fmt: skip
    params = gpu_step.update_parameters(opt, 0.1, 0.0)
    refused, found = gpu_step.step_flags(DEVICE)
    gpu_step.update(got, [(weights, slots)], params, write=False, refused=refused, found=found)
    assert found.tolist() == [gpu_step.NEVER] * 2 and refused.tolist() == [0]
    gpu_step.update(got, [(weights, slots)], params, write=True, refused=refused)
    torch.testing.assert_close(weights[got.rows[:u]], w_exp, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(slots[0][got.rows[:u]], s_exp[0], rtol=1e-6, atol=1e-7)


def test_row_sums_of_no_ids() -> None:
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    got = gpu_step.row_sums([(none, none, None, torch.zeros((0, 3), device=DEVICE), 0)], [5], 3)
    assert got.stats.tolist() == [0] * gpu_step.STATS


def test_row_sums_flag_rows_outside_the_table() -> None:
    ids = torch.tensor([3, 9], device=DEVICE)
    got = gpu_step.row_sums(
        [(ids, torch.tensor([0, 1], device=DEVICE), None, torch.ones((2, 2), device=DEVICE), 0)], [5], 2
    )
    assert got.stats.tolist()[2] == 1


def test_row_sums_flag_bags_outside_the_gradient() -> None:
    ids = torch.tensor([3, 1], device=DEVICE)
    got = gpu_step.row_sums(
        [(ids, torch.tensor([0, 2], device=DEVICE), None, torch.ones((2, 2), device=DEVICE), 0)], [5], 2
    )
    assert got.stats.tolist()[2] == 1
    assert torch.equal(got.sums[: got.stats.tolist()[0]].cpu(), torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


OPTIMIZERS: dict[str, Any] = {
    "sgd": lambda: et.SGD(0.1, weight_decay_factor=0.05, clip_weight_min=-0.6, clipvalue=0.4),
    "adagrad": lambda: et.Adagrad(0.2, initial_accumulator_value=0.05, clip_weight_max=0.5),
    "adagrad_momentum": lambda: et.AdagradMomentum(0.05, momentum=0.5, use_nesterov=True, exponent=3, beta2=0.9),
    "adagrad_momentum_sum": lambda: et.AdagradMomentum(0.1, momentum=0.9),
    "adam": lambda: et.Adam(0.05, beta_1=0.8, beta_2=0.95),
    "adam_outside": lambda: et.Adam(0.05, sum_inside_sqrt=False, epsilon=1e-3, weight_decay_factor=0.1),
    "ftrl": lambda: et.FTRL(0.1),
    "ftrl_power": lambda: et.FTRL(
        0.2, learning_rate_power=-0.7, l1_regularization_strength=0.01, l2_regularization_strength=0.02, beta=0.5
    ),
    "ftrl_multiply": lambda: et.FTRL(
        0.2, multiply_linear_by_learning_rate=True, l1_regularization_strength=0.01, beta=0.1
    ),
    "proximal_adagrad": lambda: et.ProximalAdagrad(
        0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.1
    ),
    "momentum": lambda: et.Momentum(0.1, momentum=0.9, use_nesterov=True),
    "rmsprop": lambda: et.RMSProp(0.05, rho=0.8, momentum=0.5, epsilon=1e-3),
    "centered_rmsprop": lambda: et.CenteredRMSProp(0.05, rho=0.9, momentum=0.3, epsilon=1e-2),
    "adadelta": lambda: et.Adadelta(1.0, rho=0.9, epsilon=1e-4),
    "proximal_yogi": lambda: et.ProximalYogi(0.05, l1_regularization_strength=0.01, initial_accumulator_value=0.01),
    "frequency_estimator": lambda: et.FrequencyEstimator(7.0, tau=0.25, max_delta=20.0, outlier_threshold=2.0),
}


def _state(opt: Any, gen: torch.Generator, vocab: int, dim: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    weights = torch.randn(vocab, dim, generator=gen)
    # positive slots, the third (centered RMSProp's mean gradient) small enough that ms - mg^2 > 0
    slots = [
        (torch.rand(vocab, dim, generator=gen) + 0.1) * (0.1 if i == 2 else 1.0) for i in range(len(opt.SLOT_NAMES))
    ]
    return weights.to(DEVICE), [s.to(DEVICE) for s in slots]


def _given(rows: torch.Tensor, sums: torch.Tensor, vocab: int) -> gpu_step.RowSums:
    """Phase 1 of one table as given distinct ``rows`` [U] and their ``sums`` [U, D]."""
    stats = torch.zeros(gpu_step.STATS, dtype=torch.int64, device=DEVICE)
    stats[0] = rows.numel()
    return gpu_step.RowSums(
        rows, sums, stats, [0, vocab], {"n": rows.numel(), "dim": sums.shape[1], "has_coeffs": False}
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_update_matches_the_torch_row_math(name: str) -> None:
    opt = OPTIMIZERS[name]()
    gen = torch.Generator().manual_seed(2)
    vocab, dim = 200, 6
    weights, slots = _state(opt, gen, vocab, dim)
    rows = torch.randperm(vocab, generator=gen)[:70].to(DEVICE)  # 70 rows: three tiles of 32, the last partial
    sums = torch.randn(70, dim, generator=gen).to(DEVICE)
    lr = float(opt.learning_rate)
    decay = effective_weight_decay(opt.weight_decay_factor, opt.weight_decay_multiplied_by_lr, lr)
    w_exp, s_exp = update_rows(weights[rows], tuple(s[rows] for s in slots), sums, opt=opt, lr=lr, clip_gradients=True)
    params = gpu_step.update_parameters(opt, lr, decay)
    before = weights.clone(), [s.clone() for s in slots]
    refused, found = gpu_step.step_flags(DEVICE)
    gpu_step.update(_given(rows, sums, vocab), [(weights, slots)], params, write=False, refused=refused, found=found)
    assert found.tolist() == [gpu_step.NEVER] * 2 and refused.tolist() == [0]
    assert torch.equal(weights, before[0]) and all(torch.equal(a, b) for a, b in zip(slots, before[1]))
    gpu_step.update(_given(rows, sums, vocab), [(weights, slots)], params, write=True, refused=refused)
    # powf: libdevice against torch's pow differ by an ulp or two, and FTRL subtracts two nearby powers
    tol = {"adagrad_momentum": 2e-6, "ftrl_power": 2e-5}.get(name, 1e-6)
    torch.testing.assert_close(weights[rows], w_exp, rtol=tol, atol=1e-7 if tol < 1e-5 else tol)
    for got, exp in zip(slots, s_exp):
        torch.testing.assert_close(got[rows], exp, rtol=tol, atol=1e-7 if tol < 1e-5 else tol)
    untouched = torch.ones(vocab, dtype=torch.bool, device=DEVICE)
    untouched[rows] = False
    assert torch.equal(weights[untouched], before[0][untouched])


def test_fused_update_finds_the_first_row_that_would_overflow_and_a_refused_step_writes_nothing() -> None:
    opt = et.SGD(1e38)
    weights = torch.full((6, 2), -3e38, device=DEVICE)
    rows = torch.tensor([1, 4, 5], device=DEVICE)
    sums = torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]], device=DEVICE)
    params = gpu_step.update_parameters(opt, 1e38, 0.0)
    refused, found = gpu_step.step_flags(DEVICE)
    gpu_step.update(_given(rows, sums, 6), [(weights, [])], params, write=False, refused=refused, found=found)
    assert found.tolist() == [4, gpu_step.NEVER] and refused.tolist() == [1]
    assert torch.equal(weights, torch.full((6, 2), -3e38, device=DEVICE))
    safe = torch.zeros((3, 2), device=DEVICE)  # a finite update, but the step is refused: nothing is written
    sgd = gpu_step.update_parameters(et.SGD(0.1), 0.1, 0.0)
    gpu_step.update(_given(rows, safe, 6), [(weights, [])], sgd, write=True, refused=refused)
    assert torch.equal(weights, torch.full((6, 2), -3e38, device=DEVICE))


def test_fused_update_flags_a_gradient_that_is_not_finite() -> None:
    weights = torch.zeros((5, 2), device=DEVICE)
    rows = torch.tensor([0, 2, 3], device=DEVICE)
    sums = torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [float("inf"), 0.0]], device=DEVICE)
    refused, found = gpu_step.step_flags(DEVICE)
    params = gpu_step.update_parameters(et.SGD(0.1), 0.1, 0.0)
    gpu_step.update(_given(rows, sums, 5), [(weights, [])], params, write=False, refused=refused, found=found)
    assert found.tolist() == [2, 2] and refused.tolist() == [1]


@pytest.mark.parametrize("name", ["adagrad", "adam", "ftrl_power"])
def test_a_group_of_tables_sums_and_updates_like_each_table_alone(name: str) -> None:
    """Three tables of one width (V 30, 7 and 50; one without ids) as one key space: the same distinct rows and
    sums per table, and one update launch writes what three single-table updates write, bit for bit; a table
    left out of the launch (None) keeps its values."""
    opt, dim = OPTIMIZERS[name](), 8
    gen = torch.Generator().manual_seed(23)
    vocabs = [30, 7, 50]
    feats = [(0, 40), (2, 300), (0, 9)]  # (table, ids): table 1 has none
    parts = []
    for j, n in feats:
        ids = torch.randint(0, vocabs[j], (n,), generator=gen).to(DEVICE)
        seg = torch.randint(0, 16, (n,), generator=gen).to(DEVICE)
        coeffs = torch.rand(n, generator=gen).to(DEVICE) if j == 2 else None
        parts.append((ids, seg, coeffs, torch.randn(16, dim, generator=gen).to(DEVICE), j))
    group = gpu_step.row_sums(parts, vocabs, dim)
    assert group.bases == [0, 30, 37, 87]
    lr = float(opt.learning_rate)
    params = gpu_step.update_parameters(opt, lr, 0.0)
    states = [_state(opt, gen, v, dim) for v in vocabs]
    copies = [(w.clone(), [s.clone() for s in ss]) for w, ss in states]
    for j, v in enumerate(vocabs):
        alone = [(*p[:4], 0) for p in parts if p[4] == j]
        rows, sums = group.table_rows(j)
        if not alone:
            assert rows.numel() == 0
            continue
        single = gpu_step.row_sums(alone, [v], dim)
        u = int(single.stats[0])
        assert torch.equal(rows, single.rows[:u]) and torch.equal(sums, single.sums[:u])
        refused, _ = gpu_step.step_flags(DEVICE)
        gpu_step.update(single, [copies[j]], params, write=True, refused=refused)
    lazy = gpu_step.row_sums(parts, vocabs, dim, summed=False)
    refused, found = gpu_step.step_flags(DEVICE)
    gpu_step.update(lazy, states, params, write=False, refused=refused, found=found, inline=True)
    assert found.tolist() == [gpu_step.NEVER] * 2
    gpu_step.update(lazy, states, params, write=True, refused=refused, inline=True)
    for (w, ss), (w2, ss2) in zip(states, copies):
        assert torch.equal(w, w2) and all(torch.equal(a, b) for a, b in zip(ss, ss2))
    kept = states[2][0].clone()
    gpu_step.update(lazy, [states[0], None, None], params, write=True, refused=refused, inline=True)
    assert torch.equal(states[2][0], kept)


def _long_and_short_runs(dim: int, multi: bool) -> tuple[list[Any], int]:
    """Occurrences of one table: runs of ``gpu.PIECE`` + 1, 2 ``gpu.PIECE`` + 44 and ``gpu.PIECE``
    occurrences (129, 300 and 128 at the library's piece) beside short ones, with coefficients; ``multi``:
    split over two features (the second without coefficients)."""
    gen = torch.Generator().manual_seed(17)
    vocab, piece = 60, gpu.PIECE
    ids = torch.cat([torch.full((piece + 1,), 5), torch.full((2 * piece + 44,), 9), torch.full((piece,), 11)])
    ids = torch.cat([ids, torch.randint(20, vocab, (150,), generator=gen)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].to(DEVICE)
    seg = torch.randint(0, 32, (ids.numel(),), generator=gen).to(DEVICE)
    coeffs = (torch.rand(ids.numel(), generator=gen) * 2 - 1).to(DEVICE)
    grad = torch.randn(32, dim, generator=gen).to(DEVICE)
    if not multi:
        return [(ids, seg, coeffs, grad, 0)], vocab
    half = ids.numel() // 2
    grad2 = torch.randn(32, dim, generator=gen).to(DEVICE)
    return [(ids[:half], seg[:half], coeffs[:half], grad, 0), (ids[half:], seg[half:], None, grad2, 0)], vocab


_PHASE_ONE: dict[tuple[bool, int], tuple[Any, ...]] = {}


def _both_phase_ones(multi: bool) -> tuple[Any, ...]:
    """(parts, vocab, summed, lazy) of ``_long_and_short_runs(8, multi)`` at the current ``gpu.PIECE``, made
    once per process (each takes seconds through Triton's interpreter) for every optimizer below: an update
    only reads them (the dry run and the write of one test already read the same ``lazy`` twice; a write
    into it would show there)."""
    key = (multi, gpu.PIECE)
    if key not in _PHASE_ONE:
        parts, vocab = _long_and_short_runs(8, multi)
        summed = gpu_step.row_sums(parts, [vocab], 8)
        lazy = gpu_step.row_sums(parts, [vocab], 8, summed=False)
        _PHASE_ONE[key] = (parts, vocab, summed, lazy)  # parts: the gradients lazy reads by address
    return _PHASE_ONE[key]


@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam", "ftrl_power", "centered_rmsprop"])
def test_inline_sums_update_like_summed_ones_bit_for_bit(
    name: str, multi: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The update that sums each row's gradients itself (runs of at most ``gpu.PIECE`` occurrences; longer
    ones joined in place beforehand) writes exactly what the update of the summed gradients writes, dry run
    included. Runs are cut into pieces of SHORT_PIECE here (the piece is a kernel parameter, read at each
    launch); the library's 128 is the piece of the inline update in
    ``test_sums_left_to_the_update_read_their_own_gradients_once_owned`` and of one row-sums case above."""
    monkeypatch.setattr(gpu, "PIECE", SHORT_PIECE)
    opt, dim = OPTIMIZERS[name](), 8
    _, vocab, summed, lazy = _both_phase_ones(multi)
    assert lazy.sums is None
    u = summed.stats.tolist()[0]
    assert lazy.stats.tolist()[0] == u and torch.equal(lazy.rows[:u], summed.rows[:u])
    gen = torch.Generator().manual_seed(4)
    weights, slots = _state(opt, gen, vocab, dim)
    weights2, slots2 = weights.clone(), [s.clone() for s in slots]
    params = gpu_step.update_parameters(opt, float(opt.learning_rate), 0.0)
    refused, found = gpu_step.step_flags(DEVICE)
    gpu_step.update(lazy, [(weights2, slots2)], params, write=False, refused=refused, found=found, inline=True)
    assert found.tolist() == [gpu_step.NEVER] * 2 and torch.equal(weights2, weights)
    gpu_step.update(summed, [(weights, slots)], params, write=True, refused=refused)
    gpu_step.update(lazy, [(weights2, slots2)], params, write=True, refused=refused, inline=True)
    assert torch.equal(weights2, weights)
    assert all(torch.equal(a, b) for a, b in zip(slots2, slots))
    with pytest.raises(gpu.GpuBufferError, match="inline"):
        gpu_step.update(summed, [(weights, slots)], params, write=True, refused=refused, inline=True)


def test_sums_left_to_the_update_measure_long_runs_and_materialize_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase 1 that leaves the sums to the update still finds the longest run and joins the long ones;
    materializing gives the summed path's bits and its largest |sum|. Pieces of SHORT_PIECE (the library's
    128: the row sums above and the once-owned update below)."""
    monkeypatch.setattr(gpu, "PIECE", SHORT_PIECE)
    parts, vocab = _long_and_short_runs(5, multi=True)
    summed = gpu_step.row_sums(parts, [vocab], 5)
    lazy = gpu_step.row_sums(parts, [vocab], 5, summed=False)
    u, _, bad, longest, *_ = lazy.stats.tolist()
    assert bad == 0 and longest == 2 * SHORT_PIECE + 44
    sums = gpu_step.materialize(lazy)
    assert torch.equal(sums[:u], summed.sums[:u])
    assert lazy.stats.tolist()[1] == summed.stats.tolist()[1]  # the exact largest |sum| now


def test_sums_left_to_the_update_read_their_own_gradients_once_owned() -> None:
    """An update held back (pipelining) owns its gradients: the caller may write into the ones it passed."""
    opt, dim = et.Adagrad(0.1), 4
    assert gpu.PIECE == 128  # the library's piece: the inline update's long runs at full length
    parts, vocab = _long_and_short_runs(dim, multi=True)
    summed = gpu_step.row_sums(parts, [vocab], dim)
    lazy = gpu_step.row_sums(parts, [vocab], dim, summed=False)
    gpu_step.own_gradients(lazy)
    for p in parts:
        p[3].fill_(1e30)
    weights, slots = _state(opt, torch.Generator().manual_seed(1), vocab, dim)
    weights2, slots2 = weights.clone(), [s.clone() for s in slots]
    params = gpu_step.update_parameters(opt, 0.1, 0.0)
    refused, _ = gpu_step.step_flags(DEVICE)
    gpu_step.update(summed, [(weights, slots)], params, write=True, refused=refused)
    gpu_step.update(lazy, [(weights2, slots2)], params, write=True, refused=refused, inline=True)
    assert torch.equal(weights2, weights) and torch.equal(slots2[0], slots[0])
