"""Shared test set-up: the oracle package on sys.path, tolerances, fixtures."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Iterator

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # `import oracle` from any test directory

# Tolerances against the float64 oracle, per optimizer family (float32 engine). spec §1.4 lists TF's own
# parity tolerances (1e-4 Adam, 5e-5/5e-4 FTRL, 1e-3 AdagradMomentum); ours are tighter where we can be.
TOL: dict[str, dict[str, float]] = {
    "default": {"rtol": 1e-5, "atol": 2e-6},
    "Adam": {"rtol": 1e-4, "atol": 1e-5},
    "FTRL": {"rtol": 1e-4, "atol": 1e-5},
    "AdagradMomentum": {"rtol": 1e-4, "atol": 1e-5},
    "RMSProp": {"rtol": 1e-4, "atol": 1e-5},
    "CenteredRMSProp": {"rtol": 1e-4, "atol": 1e-5},
    "Adadelta": {"rtol": 1e-4, "atol": 1e-5},
    "ProximalYogi": {"rtol": 1e-4, "atol": 1e-5},
}


# The device of the tables in the numerics suite: EMBTABLES_TEST_DEVICE=cuda runs it on the GPU (with the
# fused GPU kernels and with the torch kernels); every test skips when that device is missing.
TEST_DEVICE = torch.device(os.environ.get("EMBTABLES_TEST_DEVICE", "cpu"))


def _triton_interpreter_tested() -> bool:
    """The GPU kernels' tests run through the interpreters of Triton 3.6 (scripts/install.sh's, and CUDA
    torch 2.11's) and 3.9; older ones are not tried."""
    try:
        major, minor = (int(p) for p in importlib.metadata.version("triton").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (3, 6)


# Without CUDA, the GPU kernels' own tests (tests/numerics/test_gpu_*.py) run on CPU tensors through
# Triton's interpreter when Triton (3.6 or later) is installed; it must be chosen before Triton is imported.
if not torch.cuda.is_available() and _triton_interpreter_tested():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if TEST_DEVICE.type == "cuda" and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="EMBTABLES_TEST_DEVICE=cuda, but this machine has no CUDA device")
        for item in items:
            item.add_marker(skip)


if os.environ.get("TRITON_INTERPRET") == "1":
    from embtables.kernels.triton_interpreter import mend

    mend()  # NumPy 2 breaks a scalar-to-index conversion in Triton's interpreter


def tol_for(optimizer_name: str) -> dict[str, float]:
    return TOL.get(optimizer_name, TOL["default"])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=["native", "torch", "gpu"])
def kernel_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test on the native C kernels (CPU tables), the pure-torch reference kernels and the fused GPU
    kernels (CUDA tables; CPU tables through Triton's interpreter with TRITON_INTERPRET=1)."""
    from embtables.kernels import gpu, native

    path = str(request.param)
    on_cuda = TEST_DEVICE.type == "cuda"
    if path == "native":
        if on_cuda:
            pytest.skip("the native kernels serve CPU tables only")
        assert native.library() is not None, "the native kernels must build on this machine (gcc is required)"
    if (
        path == "gpu"
        and not on_cuda
        and not (os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("EMBTABLES_TEST_GPU_PATH") == "1")
    ):
        pytest.skip(
            "the fused GPU kernels: no CUDA device (EMBTABLES_TEST_GPU_PATH=1 runs them here through Triton's "
            "interpreter, slowly)"
        )
    native.set_enabled(path == "native")
    gpu.set_enabled(path == "gpu", on_cpu=path == "gpu" and not on_cuda)
    gpu.set_deferred_errors(False)  # errors in the call that finds them, as on the other paths
    if path == "gpu" and not gpu.usable(TEST_DEVICE):
        native.set_enabled(True)
        gpu.set_enabled(True)
        pytest.skip("the fused GPU kernels need Triton")
    try:
        yield path
    finally:
        native.set_enabled(True)
        gpu.set_enabled(True)
        gpu.set_deferred_errors(None)
