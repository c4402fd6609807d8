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
    assert train["by_kernel"]["lookup_kernel"] == 1 and train["by_kernel"]["update_kernel"] == 2
    assert lookup["by_kernel"] == {"lookup_kernel": 1, "validate_kernel": 1}
    assert train["launches"] > lookup["launches"] > 0 and train["syncs"] >= lookup["syncs"] >= 1


def test_a_training_steps_host_syncs_do_not_grow_with_the_table_count() -> None:
    """Phase 2 reads the bounds of every table's update together: a step waits for the device four times
    (input rules, lookup status, phase 1's statistics, the bounds), whatever the number of tables."""
    from benchmarks.bench_gpu_launches import count

    few, many = count(2, 8, 2, "adagrad")[0], count(6, 8, 2, "adagrad")[0]
    assert few["syncs"] == many["syncs"] == 4, (few["by_sync"], many["by_sync"])
