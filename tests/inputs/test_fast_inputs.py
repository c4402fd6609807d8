"""The fast input path (issue 16): int64 CPU Ragged and dense ids without weights are checked for all
features in one native call. It must give exactly the batches the general path gives, and every input
that breaks a rule must take the general path (so it is dropped or named exactly as before)."""

from __future__ import annotations

import random

import pytest
import torch

import embtables as et
from embtables.config import resolve
from embtables.tables.inputs import FeatureBatch, InputConverter, combiner_coeffs, convert_many


def _converters(combiners: list[str], validate: bool = True, dynamic: bool = False) -> list[InputConverter]:
    policy = et.DynamicVocabulary() if dynamic else None
    features = {
        f"f{i}": et.FeatureConfig(
            et.TableConfig(7, 2, name=f"t{i}", combiner=c, dynamic=policy), validate_weights_and_indices=validate
        )
        for i, c in enumerate(combiners)
    }
    resolved = resolve(features, et.SGD(0.1))
    return [InputConverter(f, resolved.tables[f.table_index]) for f in resolved.features]


def _same(a: FeatureBatch, b: FeatureBatch) -> bool:
    def eq(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))

    return (
        eq(a.ids, b.ids) and eq(a.offsets, b.offsets) and eq(a.coeffs, b.coeffs)
        and a.out_shape == b.out_shape and a.dropped == b.dropped
    )  # fmt: skip


def _random_input(rng: random.Random) -> object:
    kind = rng.random()
    lengths = [rng.randint(0, 4) for _ in range(rng.randint(0, 5))]
    n = sum(lengths)
    ids = [rng.choice([0, 1, 3, 6, 6, 2]) for _ in range(n)]
    if kind < 0.15 and n:
        ids[rng.randrange(n)] = rng.choice([-1, 7, 100, -(2**62)])  # dropped or refused
    if kind < 0.55:
        splits = torch.cumsum(torch.tensor([0, *lengths]), 0)
        if 0.5 < kind < 0.55 and splits.numel() > 2:
            splits[1] = splits[-1] + 1  # splits that go past the values
        return et.Ragged(torch.tensor(ids, dtype=torch.int64), splits)
    if kind < 0.9:
        rows, cols = rng.randint(1, 3), rng.randint(1, 3)
        values = [rng.choice([0, 1, 3, 6]) for _ in range(rows * cols)]
        if kind < 0.6:
            values[0] = rng.choice([-1, 7])  # dropped or refused
        return torch.tensor(values, dtype=torch.int64).reshape(rows, cols)
    return torch.tensor(ids or [1], dtype=torch.int32)  # another dtype: the general path


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("validate", [True, False])
def test_the_fast_path_gives_the_general_paths_batches_or_its_error(validate: bool, dynamic: bool) -> None:
    rng = random.Random(11)
    convs = _converters(["sum", "mean", "sqrtn"], validate, dynamic)  # dynamic: every int64 is a key
    device = torch.device("cpu")
    fast_used = 0
    for _ in range(600):
        xs = [_random_input(rng) for _ in convs]
        ws = [None] * len(convs)
        expected: list[FeatureBatch] | None
        try:
            expected = [c.convert(x, w, device) for c, x, w in zip(convs, xs, ws)]
            error = None
        except (ValueError, TypeError) as exc:
            expected, error = None, exc
        if expected is None:
            assert error is not None
            with pytest.raises(type(error)) as got:
                convert_many(convs, xs, ws, device)
            assert str(got.value) == str(error)
            continue
        got_batches = convert_many(convs, xs, ws, device)
        assert all(_same(a, b) for a, b in zip(got_batches, expected)), xs
        fast_used += sum(1 for x in xs if isinstance(x, (et.Ragged, torch.Tensor)))
    assert fast_used > 500


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_unweighted_coefficients_from_offsets_equal_the_weighted_path_with_unit_weights(combiner: str) -> None:
    (conv,) = _converters([combiner])
    rng = random.Random(3)
    for _ in range(200):
        choices = [1] if rng.random() < 0.2 else [0, 1, 1, 2, 3, 7, 40]
        lengths = torch.tensor([rng.choice(choices) for _ in range(rng.randint(1, 30))])
        values = torch.zeros(int(lengths.sum()), dtype=torch.int64)
        batch = FeatureBatch(values, torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]), None,
                             (lengths.numel(),))  # fmt: skip
        ones = torch.ones(values.numel(), dtype=torch.float32)
        c = conv.table.config.combiner
        fast, weighted = combiner_coeffs(c, batch, None), combiner_coeffs(c, batch, ones)
        assert weighted is not None
        if fast is None:  # every bag holds one id: every coefficient is exactly 1
            assert bool((lengths == 1).all()) and torch.equal(weighted, ones)
        else:
            assert torch.equal(fast, weighted)  # bit for bit


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_batch_awaiting_its_update_keeps_its_ids_while_the_next_is_staged(pipelined: bool) -> None:
    """The fast path stages ids into reusable arenas: the batch awaiting apply_gradients and the next
    one enqueued (TF's order: enqueue t+1, then apply t) must never share one. Same tables as the
    torch path, which stages nothing."""
    from embtables.kernels import native

    gen = torch.Generator().manual_seed(5)

    def batches() -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for n in (3, 40, 7, 90, 2):  # sizes that grow and shrink the arenas
            lengths = torch.randint(0, 4, (n,), generator=gen)
            ids = torch.randint(0, 30, (int(lengths.sum()),), generator=gen)
            out.append({"a": et.Ragged.from_lengths(ids, lengths), "b": torch.randint(0, 30, (n, 2), generator=gen)})
        return out

    inputs = batches()

    def train() -> dict[str, torch.Tensor]:
        t = et.TableConfig(30, 4, name="t", initializer=et.Constant(0.1), combiner="mean")
        features = {"a": et.FeatureConfig(t), "b": et.FeatureConfig(t)}
        m = et.DistributedEmbedding(features, et.Adagrad(0.1), pipeline_execution_with_tensor_core=pipelined)
        acts = m(inputs[0])
        for batch in inputs[1:]:
            grads = {k: torch.full_like(v, 0.5) for k, v in acts.items()}
            m.enqueue(batch)  # the last lookup's batch is still needed by apply_gradients
            m.apply_gradients(grads)
            acts = m.dequeue()
        m.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
        return {k: v.clone() for k, v in m.state_dict().items()}

    fast = train()
    native.set_enabled(False)
    try:
        reference = train()
    finally:
        native.set_enabled(True)
    assert fast.keys() == reference.keys()
    for k in fast:
        assert torch.equal(fast[k], reference[k]), k


@pytest.mark.parametrize("validate", [True, False])
def test_the_gpu_staging_gives_the_general_paths_batches_or_its_error(validate: bool) -> None:
    """``gpu_inputs.convert_many_on_gpu`` (one copy and one ``stage_kernel`` for every feature, through Triton's
    interpreter on CPU tensors): the general path's batches (their bags too) or its error; with deferred device
    checks, no error at staging, and the checks name the general path's error."""
    import os

    from embtables.kernels import gpu
    from embtables.tables.backends.device_checks import DeviceChecks
    from embtables.tables.gpu_inputs import convert_many_on_gpu

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the GPU kernels on CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    gpu.set_enabled(True, on_cpu=True)
    try:
        if not gpu.usable(torch.device("cpu")):
            pytest.skip("Triton is not installed")
        rng = random.Random(12)
        convs = _converters(["sum", "mean", "sqrtn"], validate)
        device = torch.device("cpu")
        errors = 0
        for _ in range(150):
            xs = [_random_input(rng) for _ in convs]
            ws = [None] * len(convs)
            try:
                expected = [c.convert(x, w, device) for c, x, w in zip(convs, xs, ws)]
            except (ValueError, TypeError) as exc:
                errors += 1
                with pytest.raises(type(exc)) as got:
                    convert_many_on_gpu(convs, xs, ws, device)
                assert str(got.value) == str(exc)
                # deferred: a general-path input raises at staging, a common one at the next call; either way
                # with the general path's error for one of the broken features
                messages = []
                for c, x in zip(convs, xs):
                    try:
                        c.convert(x, None, device)
                    except (ValueError, TypeError) as one:
                        messages.append(str(one))
                checks = DeviceChecks(device, immediate=False)
                try:
                    convert_many_on_gpu(convs, xs, ws, device, checks)
                    checks.post("the lookup")
                    checks.raise_pending()
                except (ValueError, TypeError) as raised:
                    assert any(m in str(raised) for m in messages), (str(raised), messages)
                else:
                    raise AssertionError(f"no error for {xs}: {messages}")
                continue
            got_batches = convert_many_on_gpu(convs, xs, ws, device)
            for a, b in zip(got_batches, expected):
                # a mean / sqrtn feature always has its coefficients on the GPU (finding them all 1 would cost a
                # sync): the general path's None, every coefficient 1
                coeffs = b.coeffs if b.coeffs is not None or a.coeffs is None else torch.ones_like(a.coeffs)
                assert _same(a, FeatureBatch(b.ids, b.offsets, coeffs, b.out_shape, dropped=b.dropped)), xs
                assert torch.equal(a.seg, b.seg)
        assert errors > 10
    finally:
        gpu.set_enabled(True)


def test_batches_built_once_per_layout_carry_nothing_from_an_earlier_step() -> None:
    """Batches staged into the same arena with the same sizes are the same objects step after step (built once,
    ``StagedBags.built``). What the general path derives from one batch's offsets (its segment index, which a
    dynamic table reads to drop keys without a row) must not survive into the next step, and a dense input of
    another shape but as many ids gets batches of its own shape. Against the same steps without native staging."""
    from embtables.kernels import native

    steps = [  # the first and the last have the same sizes and dense shape: one layout, one set of batches
        {"a": et.Ragged.from_lists([[0], [4, 5, 6]]), "b": torch.tensor([1, 2, 3, 4])},  # keys first seen: dropped
        {"a": et.Ragged.from_lists([[0, 4, 5], [6]]), "b": torch.tensor([[1, 2], [3, 4]])},  # seen twice: admitted
        {"a": et.Ragged.from_lists([[7, 0], [4, 9]]), "b": torch.tensor([4, 3, 2, 1])},  # 7 and 9 dropped
    ]

    def train() -> tuple[et.DistributedEmbedding, list[torch.Tensor]]:
        t = et.TableConfig(9, 3, name="t", initializer=et.TruncatedNormal(seed=3), combiner="mean",
                           dynamic=et.DynamicVocabulary(admit_after=2))  # fmt: skip
        u = et.TableConfig(9, 2, name="u", initializer=et.TruncatedNormal(seed=4))
        m = et.DistributedEmbedding({"a": et.FeatureConfig(t), "b": et.FeatureConfig(u)}, et.SGD(0.1))
        seen = []
        for i, features in enumerate(steps):
            acts = m(features)
            seen += [acts["a"].detach().clone(), acts["b"].detach().clone()]
            m.apply_gradients({k: torch.full_like(v, 0.25 * (i + 1)) for k, v in acts.items()})
        return m, seen + list(m.state_dict().values())

    m, fast = train()
    native.set_enabled(False)
    try:
        _, reference = train()
    finally:
        native.set_enabled(True)
    assert len(fast) == len(reference)
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(fast, reference))
    staged = [m._inputs.stage(features, None, torch.device("cpu"), set()) for features in steps]
    assert all(a is b for a, b in zip(staged[0], staged[2]))  # built once: the steps above read them twice
    assert not any(a is b for a, b in zip(staged[0], staged[1]))
