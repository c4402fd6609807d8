"""Shared test set-up: the oracle package on sys.path, tolerances, fixtures."""

from __future__ import annotations

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


def tol_for(optimizer_name: str) -> dict[str, float]:
    return TOL.get(optimizer_name, TOL["default"])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=["native", "torch"])
def kernel_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test on the native C kernels and on the pure-torch reference kernels."""
    from embtables.kernels import native

    if request.param == "native":
        assert native.library() is not None, "the native kernels must build on this machine (gcc is required)"
    native.set_enabled(request.param == "native")
    try:
        yield str(request.param)
    finally:
        native.set_enabled(True)
