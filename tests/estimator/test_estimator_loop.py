"""The Estimator loop: training learns, resume from model_dir is exact, metrics files, predict, and
the same loop on two gloo processes."""

from __future__ import annotations

import csv
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mp_world import run_world
from torch import nn

from embtables import estimator as est
from embtables.checkpoint import increments, published, read_manifest

N, USERS, ITEMS = 1200, 40, 60


def _data(seed: int = 0) -> tuple[dict[str, Any], np.ndarray]:
    rng = np.random.default_rng(seed)
    users, items = rng.integers(0, USERS, N), rng.integers(0, ITEMS, N)
    tags = [list(rng.integers(0, 15, rng.integers(0, 4))) for _ in range(N)]
    u, i = rng.normal(size=USERS), rng.normal(size=ITEMS)
    y = (u[users] + i[items] + 0.3 * rng.normal(size=N) > 0).astype(np.float32)
    return {"user": users, "item": [f"i{v}" for v in items], "tags": tags}, y


def _input_fn(features: dict[str, Any], y: np.ndarray, batch: int = 100, shard: tuple[int, int] = (0, 1)) -> Any:
    rank, world = shard

    def fn() -> Any:
        for s in range(rank * batch, N, batch * world):
            yield {k: v[s : s + batch] for k, v in features.items()}, y[s : s + batch]

    return fn


def _spec() -> est.EmbeddingConfigSpec:
    cols = [
        est.embedding_column(est.categorical_column_with_identity("user", USERS), 8),
        est.embedding_column(est.categorical_column_with_hash_bucket("item", 128), 8, combiner="sum"),
        *est.shared_embedding_columns([est.categorical_column_with_identity("tags", 15)], 8),
    ]
    return est.EmbeddingConfigSpec(feature_columns=cols, optimization_parameters=est.AdagradParameters(0.3))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, activations: dict[str, torch.Tensor], features: Any) -> torch.Tensor:
        return self.mlp(torch.cat([activations[k] for k in sorted(activations)], 1)).squeeze(1)


def _estimator(model_dir: Path, **kw: Any) -> est.Estimator:
    torch.manual_seed(0)
    return est.Estimator(
        _Model(),
        _spec(),
        model_dir,
        dense_optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
        loss_fn=nn.functional.binary_cross_entropy_with_logits,
        predictions_fn=torch.sigmoid,
        eval_metrics={"auc": est.auc, "log_loss": est.log_loss},
        log_step_count_steps=4,
        progress=False,
        **kw,
    )


def _state(e: est.Estimator) -> dict[str, torch.Tensor]:
    out = {f"dense/{k}": v.clone() for k, v in e.model.state_dict().items()}
    out.update({k: v.clone() for k, v in e.embedding.state_dict().items()})
    return out


def test_training_learns_and_resume_is_exact(tmp_path: Path) -> None:
    features, y = _data()
    straight = _estimator(tmp_path / "straight")
    straight.train(_input_fn(features, y), steps=12)
    resumed = _estimator(tmp_path / "resumed", save_checkpoints_steps=5)
    resumed.train(_input_fn(features, y), steps=6)
    resumed.close()  # lets another writer train into its model_dir (a second one is refused while it trains)
    again = _estimator(tmp_path / "resumed")  # a new process would do exactly this
    again.train(lambda: (b for i, b in enumerate(_input_fn(features, y)()) if i >= 6), steps=6)
    assert again.global_step == straight.global_step == 12
    a, b = _state(straight), _state(again)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    before = _estimator(tmp_path / "fresh").evaluate(_input_fn(features, y))
    after = straight.evaluate(_input_fn(features, y))
    assert after["loss"] < before["loss"] and after["auc"] > max(0.6, before["auc"] + 0.05)
    assert after["global_step"] == 12.0


def test_incremental_checkpoints_resume_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(increments, "FULL_ABOVE", 1.0)  # small tables: most rows change between saves
    features, y = _data()
    straight = _estimator(tmp_path / "straight")
    straight.train(_input_fn(features, y), steps=12)
    resumed = _estimator(tmp_path / "resumed", save_checkpoints_steps=2, incremental_checkpoints=True)
    resumed.train(_input_fn(features, y), steps=7)
    resumed.close()
    chains = [read_manifest(p)[1].get("chain") for p in published(tmp_path / "resumed")]
    assert chains[0] is None and any(c is not None for c in chains), chains  # a full checkpoint, then increments
    again = _estimator(tmp_path / "resumed", incremental_checkpoints=True)  # restores the chain
    again.train(lambda: (b for i, b in enumerate(_input_fn(features, y)()) if i >= 7), steps=5)
    a, b = _state(straight), _state(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="full_checkpoint_every"):
        _estimator(tmp_path / "bad", full_checkpoint_every=0)


def test_metrics_files_checkpoints_and_predict(tmp_path: Path) -> None:
    features, y = _data()
    e = _estimator(tmp_path, save_checkpoints_steps=4, keep_checkpoint_max=2)
    e.train(_input_fn(features, y), steps=10)
    e.evaluate(_input_fn(features, y), steps=3)
    rows = list(csv.DictReader((tmp_path / "train_metrics.csv").open()))
    assert [int(float(r["step"])) for r in rows] == [4, 8]
    assert {"loss", "steps_per_sec", "examples_per_sec", "elapsed_s"} <= set(rows[0])
    evals = list(csv.DictReader((tmp_path / "eval_metrics.csv").open()))
    assert len(evals) == 1 and {"loss", "auc", "log_loss"} <= set(evals[0])
    ckpts = sorted(p.name for p in tmp_path.glob("ckpt-*"))
    dense = sorted(p.name for p in tmp_path.glob("dense-*.pt"))
    assert len(ckpts) == 2 and len(dense) == 2 and e.latest_checkpoint() is not None
    assert e.latest_checkpoint().endswith("10")  # type: ignore[union-attr]
    preds = list(e.predict(_input_fn(features, y)))
    assert len(preds) == N and all(0.0 < float(p) < 1.0 for p in preds)
    # train() past max_steps does nothing; a finished input ends training early
    e.train(_input_fn(features, y), max_steps=10)
    assert e.global_step == 10


def _two_ranks(rank: int, world: int, model_dir: str) -> None:
    features, y = _data()
    e = _estimator(Path(model_dir))
    e.train(_input_fn(features, y, shard=(rank, world)), steps=6)
    result = e.evaluate(_input_fn(features, y, shard=(rank, world)))
    params = torch.cat([p.detach().reshape(-1) for p in e.model.parameters()])
    from embtables.sharding import comm

    everyone = comm.all_gather_object((result, params), None)
    assert everyone[0][0] == everyone[1][0], "every rank reports the metrics over all ranks' batches"
    assert torch.equal(everyone[0][1], everyone[1][1]), "dense parameters stay identical on every rank"
    assert result["auc"] > 0.6
    resumed = _estimator(Path(model_dir))
    assert resumed.evaluate(_input_fn(features, y, shard=(rank, world)))["loss"] == result["loss"]


def test_estimator_under_two_processes(tmp_path: Path) -> None:
    run_world(_two_ranks, 2, str(tmp_path))


def _uneven(rank: int, world: int, model_dir: str) -> None:
    """Rank 1 has fewer batches than rank 0: every rank stops together instead of hanging."""
    features, y = _data()
    e = _estimator(Path(model_dir))
    batches = list(_input_fn(features, y, shard=(rank, world))())
    mine = batches[: 5 if rank == 0 else 3]
    e.train(lambda: iter(mine))
    assert e.global_step == 3
    result = e.evaluate(lambda: iter(mine))
    assert result["global_step"] == 3.0


def test_uneven_inputs_stop_every_rank_together(tmp_path: Path) -> None:
    run_world(_uneven, 2, str(tmp_path), timeout=120, collective_timeout=30)


def _resumed_as_straight(
    make: Callable[[Path], est.Estimator], tmp_path: Path, features: dict[str, Any], y: np.ndarray, half: int
) -> dict[str, torch.Tensor]:
    """2 x ``half`` steps straight (``make(tmp_path / "a")``), and ``half`` + ``half`` across two estimators on
    ``tmp_path / "b"``: asserts the two end bit for bit the same; returns the straight run's state."""
    straight = make(tmp_path / "a")
    straight.train(_input_fn(features, y), steps=2 * half)
    first = make(tmp_path / "b")
    first.train(_input_fn(features, y), steps=half)
    first.close()
    second = make(tmp_path / "b")
    second.train(lambda: (b for i, b in enumerate(_input_fn(features, y)()) if i >= half), steps=half)
    a, b = _state(straight), _state(second)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    return a


def test_pipelined_training_resumes_bit_for_bit(tmp_path: Path) -> None:
    """pipeline_execution_with_tensor_core=True through the Estimator: the lookups are one step stale,
    and 6 + 6 steps across two estimators equal 12 straight (the pending update's rows are saved)."""
    import dataclasses

    features, y = _data()

    def make(model_dir: Path) -> est.Estimator:
        e = _estimator(model_dir)
        spec = dataclasses.replace(_spec(), pipeline_execution_with_tensor_core=True)
        torch.manual_seed(0)
        return est.Estimator(
            e.model,
            spec,
            model_dir,
            loss_fn=e.loss_fn,
            progress=False,
            dense_optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
        )

    a = _resumed_as_straight(make, tmp_path, features, y, 6)
    synchronous = _estimator(tmp_path / "c")
    synchronous.train(_input_fn(features, y), steps=12)
    assert not torch.equal(_state(synchronous)["user_embedding"], a["user_embedding"]), "pipelining changes the run"


def test_a_pipelined_estimator_with_half_tables_saves_and_resumes(tmp_path: Path) -> None:
    """bfloat16 rows and slots, pipelined: train() ends with a save of the pending update's pre-update rows (it
    raised "unsupported ScalarType BFloat16"), and 4 + 4 steps across two estimators equal 8 straight."""
    import dataclasses

    features, y = _data()

    def make(model_dir: Path) -> est.Estimator:
        e = _estimator(model_dir)
        cols = [
            est.embedding_column(
                est.categorical_column_with_identity("user", USERS), 8, dtype=torch.bfloat16, slot_dtype=torch.bfloat16
            ),
            est.embedding_column(est.categorical_column_with_hash_bucket("item", 128), 8, combiner="sum"),
            *est.shared_embedding_columns([est.categorical_column_with_identity("tags", 15)], 8),
        ]
        spec = dataclasses.replace(_spec(), feature_columns=cols, pipeline_execution_with_tensor_core=True)
        torch.manual_seed(0)
        return est.Estimator(e.model, spec, model_dir, loss_fn=e.loss_fn, progress=False)

    a = _resumed_as_straight(make, tmp_path, features, y, 4)
    assert a["user_embedding"].dtype == torch.bfloat16


def test_tensorboard_event_files(tmp_path: Path) -> None:
    """With the tensorboard package installed (the test extra), metrics also go to event files."""
    features, y = _data()
    e = _estimator(tmp_path)
    e.train(_input_fn(features, y), steps=8)
    e.evaluate(_input_fn(features, y), steps=2)
    events = list(tmp_path.glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    # close() closes the event file and its writer thread (a job of five folds left five threads behind)
    assert any(t.name != "MainThread" for t in threading.enumerate() if t.is_alive())
    before = threading.active_count()
    e.close()
    assert threading.active_count() == before - 1
    e.evaluate(_input_fn(features, y), steps=2)  # the next metrics row opens a new event file
    e.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2


def test_bad_batches_are_refused_and_change_nothing(tmp_path: Path) -> None:
    import pytest

    features, y = _data()
    e = _estimator(tmp_path)
    e.train(_input_fn(features, y), steps=2)
    before = _state(e)
    batch = {k: v[:100] for k, v in features.items()}
    with pytest.raises(ValueError, match="99 label value"):
        e.train(lambda: iter([(batch, y[:99])]))
    with pytest.raises(TypeError, match=r"\(features, labels\)"):
        e.train(lambda: iter([[batch, y[:100]]]))
    with pytest.raises(ValueError, match="outside"):
        e.train(lambda: iter([({**batch, "user": np.full(100, USERS + 5)}, y[:100])]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        e.train(lambda: iter([(batch, np.full(100, np.nan, dtype=np.float32))]))
    after = _state(e)
    assert e.global_step == 2
    for k in before:
        assert torch.equal(before[k], after[k]), k


# ----------------------------------------------------------------------------- all or nothing (issue 22)
def test_resume_checks_the_dense_file_before_changing_anything(tmp_path: Path) -> None:
    import pytest

    from embtables.checkpoint import CheckpointError

    features, y = _data()
    _estimator(tmp_path).train(_input_fn(features, y), steps=3)
    dense = tmp_path / "dense-0000000003.pt"
    good = dense.read_bytes()
    for damage in ("truncate", "missing", "other_model"):
        if damage == "truncate":
            dense.write_bytes(good[: len(good) // 2])
        elif damage == "missing":
            dense.unlink()
        else:
            torch.save({"model": {"w": torch.zeros(3)}, "optimizer": {}, "step": 3}, dense)
        fresh = _estimator(tmp_path)
        before = _state(fresh)
        with pytest.raises(CheckpointError, match="dense"):
            fresh.train(_input_fn(features, y), steps=1)
        assert all(torch.equal(before[k], v) for k, v in _state(fresh).items()), damage
        assert fresh.global_step == 0
        dense.write_bytes(good)
        fresh.train(_input_fn(features, y), steps=1)  # a retry after the fix resumes properly
        assert fresh.global_step == 4, damage
        fresh.close()
        for f in tmp_path.glob("ckpt-00000004"):
            import shutil

            shutil.rmtree(f)
        (tmp_path / "dense-0000000004.pt").unlink()


def test_train_and_evaluate_refuse_what_tf_refuses(tmp_path: Path) -> None:
    import pytest

    features, y = _data()
    e = _estimator(tmp_path)
    for steps in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="`steps` must be an int >= 1"):
            e.train(_input_fn(features, y), steps=steps)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="yielded no examples"):
        e.evaluate(lambda: iter(()))
    assert e.global_step == 0


def test_bad_labels_are_refused_before_any_change(tmp_path: Path) -> None:
    import pytest

    features, y = _data()
    e = _estimator(tmp_path)
    before = _state(e)
    bad_nan = y[:100].copy()
    bad_nan[7] = np.nan
    for labels, message in ((bad_nan, "NaN or Inf"), (np.array(["yes"] * 100), "must be numbers")):
        with pytest.raises(ValueError, match=message):
            e.train(lambda labels=labels: iter([({k: v[:100] for k, v in features.items()}, labels)]), steps=1)
    assert all(torch.equal(before[k], v) for k, v in _state(e).items())


def _bad_batch_on_one_rank(rank: int, world: int, model_dir: str) -> None:
    import pytest

    features, y = _data()
    e = _estimator(Path(model_dir))

    def fn() -> Any:
        for s in range(0, 400, 100):
            batch = {k: v[s : s + 100] for k, v in features.items()}
            if s == 200 and rank == 1:
                batch["user"] = np.full(100, USERS + 5)  # ids outside the identity column's buckets
            yield batch, y[s : s + 100]

    with pytest.raises(ValueError, match=r"rank 1|num_buckets|buckets"):
        e.train(fn, steps=10)
    assert e.global_step == 2  # both ranks stopped at the same step


def test_a_bad_batch_on_one_rank_stops_every_rank_with_its_error(tmp_path: Path) -> None:
    run_world(_bad_batch_on_one_rank, 2, str(tmp_path), timeout=120, collective_timeout=30)


_TRAINER = """
import sys, time, numpy as np, torch
sys.path.insert(0, sys.argv[2])
from test_estimator_loop import _data, _estimator, _input_fn
from pathlib import Path
features, y = _data()
e = _estimator(Path(sys.argv[1]))
e.train(_input_fn(features, y), steps=1)
print("training", flush=True)
time.sleep(600)
"""


def test_one_writer_per_model_dir(tmp_path: Path) -> None:
    """Two Estimators (two processes, or two objects in one) training into one model_dir would
    interleave checkpoints: the second is refused, naming the holder; a killed holder's lock is
    taken over (issue 15, item 5)."""
    import os
    import signal
    import subprocess
    import sys

    import pytest

    from embtables.checkpoint import CheckpointError

    features, y = _data()
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tests).parent.parent), str(Path(tests).parent)])}
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, str(tmp_path), tests], stdout=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "training"
        second = _estimator(tmp_path)
        with pytest.raises(CheckpointError, match=rf"being written by process {proc.pid} on"):
            second.train(_input_fn(features, y), steps=1)
        assert second.global_step == 1  # it resumed the other's checkpoint, and wrote nothing
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    second.train(_input_fn(features, y), steps=1)  # the dead holder's lock is stale: taken over
    assert second.global_step == 2
    third = _estimator(tmp_path)
    with pytest.raises(CheckpointError, match="being written by this process"):
        third.train(_input_fn(features, y), steps=1)
    second.close()
    third.train(_input_fn(features, y), steps=1)
    assert third.global_step == 3


# ----------------------------------------------------------------------------- the input pipeline (issue 16)
def test_prefetched_input_trains_exactly_like_reading_in_place_and_reports_errors_at_their_step(
    tmp_path: Path,
) -> None:
    import threading

    import pytest

    features, y = _data()
    runs = {}
    for depth in (0, 1, 3):
        e = _estimator(tmp_path / f"d{depth}", input_prefetch=depth)
        e.train(_input_fn(features, y), steps=9)
        runs[depth] = _state(e)
        e.close()
    for depth in (1, 3):
        for k in runs[0]:
            assert torch.equal(runs[0][k], runs[depth][k]), (depth, k)

    # A bad batch (the fourth) is refused at its own step, after the three before it were applied; an
    # exception raised by the input itself surfaces at the step that would have read it.
    good = [({k: v[s : s + 100] for k, v in features.items()}, y[s : s + 100]) for s in range(0, 400, 100)]
    bad_batch = ({**good[3][0], "user": np.full(100, USERS + 5)}, good[3][1])
    reference = _estimator(tmp_path / "ref", input_prefetch=0)
    reference.train(lambda: iter(good[:3]))
    for depth in (0, 2):
        e = _estimator(tmp_path / f"bad{depth}", input_prefetch=depth)
        with pytest.raises(ValueError, match="outside"):
            e.train(lambda: iter([*good[:3], bad_batch, good[0]]))
        assert e.global_step == 3
        ref, got = _state(reference), _state(e)
        for k in ref:
            assert torch.equal(ref[k], got[k]), (depth, k)

        def broken() -> Any:
            yield from good[:2]
            raise OSError("the disk went away")

        with pytest.raises(OSError, match="disk went away"):
            e.train(broken)
        assert e.global_step == 5
        e.close()
    # stopping early (steps=) leaves no input thread behind
    e = _estimator(tmp_path / "early", input_prefetch=2)
    e.train(_input_fn(features, y), steps=2)
    assert not [t for t in threading.enumerate() if t.name.startswith("embtables-input")]
    with pytest.raises(ValueError, match="input_prefetch"):
        _estimator(tmp_path / "x", input_prefetch=-1)


def test_prefetching_shortens_the_gil_switch_interval_and_restores_it() -> None:
    from embtables.estimator.input_pipeline import SWITCH_INTERVAL_S, prefetched

    before = sys.getswitchinterval()
    assert before > SWITCH_INTERVAL_S  # CPython's default, 5 ms
    with prefetched(lambda: 1, 0):
        assert sys.getswitchinterval() == before  # no thread, nothing to hand over
    with pytest.raises(KeyError), prefetched(lambda: 1, 2) as p:
        assert p.next() == 1
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S
        raise KeyError("a step failed")
    assert sys.getswitchinterval() == before


def test_a_pipeline_changing_depth_returns_every_fetch_once_in_order() -> None:
    from embtables.estimator.input_pipeline import prefetched

    counter = iter(range(1000))
    with prefetched(lambda: next(counter), 3) as p:
        got = [p.next() for _ in range(5)]
        p.set_depth(0)  # the three queued fetches come back first, then fetches in place
        got += [p.next() for _ in range(5)]
        p.set_depth(2)
        got += [p.next() for _ in range(5)]
        p.set_depth(1)
        got += [p.next() for _ in range(5)]
    assert got == list(range(20))


def test_auto_prefetch_probes_both_ways_keeps_one_and_trains_exactly_like_reading_in_place(tmp_path: Path) -> None:
    from embtables.estimator.input_pipeline import PROBE_STEPS, Probe, prefetched

    probe = Probe(steps=4)
    counter = iter(range(1000))
    got = []
    for _ in range(3):  # over several calls: 4 timed steps in place, then 4 one ahead, then the choice
        with prefetched(lambda: next(counter), 0, probe) as p:
            got += [p.next() for _ in range(5)]
    assert got == list(range(15)) and probe.chosen in (0, 1)
    assert len(probe.in_place) == 4 and len(probe.ahead) == 4
    with prefetched(lambda: next(counter), 0, probe) as p:
        assert p.depth == probe.chosen and p.next() == 15

    features, y = _data()
    steps = 2 * PROBE_STEPS + 4  # past the choice
    starts = [(25 * i) % (N - 25) for i in range(steps)]
    batches = [({k: v[s : s + 25] for k, v in features.items()}, y[s : s + 25]) for s in starts]
    runs = {}
    for mode in (0, "auto"):
        e = _estimator(tmp_path / f"m{mode}", input_prefetch=mode)
        e.train(lambda: iter(batches))
        runs[mode] = _state(e)
        if mode == "auto":
            assert e._probes["train"].chosen in (0, 1)
            e.evaluate(lambda: iter(batches))
            assert set(e._probes) == {"train", "predict"}
        e.close()
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs["auto"][k]), k
    for bad in ("fast", -1, True, 1.5):
        with pytest.raises(ValueError, match=r'`input_prefetch` must be an int >= 0 or "auto"'):
            _estimator(tmp_path / "bad", input_prefetch=bad)


def test_auto_prefetch_keeps_reading_ahead_only_for_a_clear_gain() -> None:
    from embtables.estimator.input_pipeline import AHEAD_GAIN, Probe

    for ahead, chosen in ((0.95, 0), (1.2, 0), (AHEAD_GAIN, 1), (0.5, 1)):
        probe = Probe(steps=3)
        for _ in range(3):
            assert probe.depth() == 0
            probe.record(0, 1.0)
        for _ in range(3):
            assert probe.depth() == 1
            probe.record(1, ahead)
        assert probe.chosen == chosen and probe.depth() == chosen, ahead
