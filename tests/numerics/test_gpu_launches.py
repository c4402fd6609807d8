"""The launch and host-sync counter of ``embtables bench gpu-launches`` (``benchmarks/launch_count.py``): what
it counts on known operations, and the benchmark's records for the GPU step through Triton's interpreter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from embtables.kernels import gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's benchmarks/


@pytest.fixture(autouse=True)
def _interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the counter runs the GPU kernels through Triton's interpreter (TRITON_INTERPRET=1)")
    gpu.set_enabled(True, on_cpu=True)
    if not gpu.usable(torch.device("cpu")):
        pytest.skip("Triton is not installed")
    yield
    gpu.set_enabled(True)


def test_the_counter_counts_launches_and_syncs_of_known_operations() -> None:
    from benchmarks.launch_count import LaunchCounter

    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    table = torch.randn(5, 4)
    ids, offsets = torch.tensor([0, 4, 2]), torch.tensor([0, 2, 3])
    counter = LaunchCounter()
    with counter.counting():
        y = x + 1  # one torch launch
        x.view(4, 3).t()  # views: none
        torch.empty(5)  # an allocation: none
        int(y.sum().item())  # a launch (sum) and a sync (item)
        torch.nonzero(y > 3)  # a launch (gt) and a sync (nonzero: its size depends on the data)
        y.tolist()  # a sync
        flags = gpu.lookup_many([(table, ids, offsets, None)], [torch.empty(2, 4)])  # one Triton launch
        assert gpu.bits_to_float([0x3F800000]) == (1.0,)  # a host tensor made from Python values: no sync
    assert counter.triton == {"lookup_kernel": 1}
    assert counter.torch["host_to_device"] == 1  # the lookup's argument table: a copy to the device on CUDA
    assert counter.torch["add"] == 1 and counter.torch["sum"] == 1 and counter.torch["gt"] == 1
    assert "view" not in counter.torch and "t" not in counter.torch and "empty" not in counter.torch
    assert counter.syncs == {"_local_scalar_dense": 1, "nonzero": 1, "tolist": 1}
    record = counter.record()
    assert record["triton_launches"] == 1 and record["syncs"] == 3
    assert record["launches"] == 1 + sum(counter.torch.values())
    assert flags.tolist() == [0]  # outside the counter: counted nowhere
    assert counter.syncs["tolist"] == 1


def test_the_benchmark_counts_a_training_step_and_an_eval_lookup() -> None:
    from benchmarks.bench_gpu_launches import count

    train, lookup = count(2, 8, 2, "adagrad")
    assert train["what"] == "train_step" and lookup["what"] == "eval_lookup"
    assert train["by_kernel"]["lookup_kernel"] == 1 and train["by_kernel"]["update_kernel"] == 2  # dry run, write
    # two staging passes: the mean of a bag counts its kept ids once the first pass has dropped negative ones
    assert lookup["by_kernel"] == {"lookup_kernel": 1, "stage_kernel": 2}
    assert train["launches"] > lookup["launches"] > 0
    assert train["syncs"] == lookup["syncs"] == 0, (train["by_sync"], lookup["by_sync"])


@pytest.mark.parametrize("errors", ["deferred", "immediate"])
def test_a_steps_launches_and_host_syncs_do_not_grow_with_the_table_count(errors: str) -> None:
    """Every phase runs for all tables at once: 2 or 6 tables (of one width and optimizer) launch the same
    kernels and torch operations, training and eval. A steady-state step never waits for the device when its
    errors are raised at the next call; raised in the call, enqueue (the input rules), the lookup and
    apply_gradients each wait once."""
    from benchmarks.bench_gpu_launches import count

    few, many = count(2, 8, 2, "adagrad", errors), count(6, 8, 2, "adagrad", errors)
    for a, b in zip(few, many):
        assert a["by_kernel"] == b["by_kernel"] and a["by_torch_op"] == b["by_torch_op"], (a, b)
        assert a["syncs"] == b["syncs"], (a["by_sync"], b["by_sync"])
    train, lookup = few
    assert (train["syncs"], lookup["syncs"]) == ((0, 0) if errors == "deferred" else (3, 2))
