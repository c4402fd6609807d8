"""The backends of a collection's arithmetic (``interface.py``): torch (the reference), native (C kernels on
CPU tables) and GPU (fused Triton kernels on CUDA tables), each over a ``TableSet``.

``choose`` picks one for where the tables are, once: at construction, after a device move, and after a
process-wide switch of the native or GPU kernels (``set_enabled``, which tests use to compare paths).
"""

from __future__ import annotations

from embtables.kernels import gpu, native_library
from embtables.kernels.native_library import switches
from embtables.tables.backends.gpu_backend import GpuBackend
from embtables.tables.backends.interface import Backend, BagPart, GradientPart, Lookup, Prepared
from embtables.tables.backends.native_backend import NativeBackend
from embtables.tables.backends.table_set import TableSet
from embtables.tables.backends.torch_backend import TorchBackend

__all__ = [
    "Backend",
    "BagPart",
    "GpuBackend",
    "GradientPart",
    "Lookup",
    "NativeBackend",
    "Prepared",
    "TableSet",
    "TorchBackend",
    "choose",
    "switches",
]


def choose(tables: TableSet, *, deferred_errors: bool = True) -> Backend:
    """The backend for the device of ``tables``: the GPU kernels where they run, the native kernels on CPU
    tables when they are built, else the torch reference. ``deferred_errors=False``: the GPU backend raises
    every error in the call that finds it (the sharded engine's local tables: every rank must agree in the
    call). Half-precision tables (spec §12) take the same backends: the GPU and the native kernels read and
    write half rows."""
    weights = tables.weights
    if gpu.usable_for(weights):
        return GpuBackend(tables, immediate=not deferred_errors)
    if weights.is_cpu and native_library.library() is not None:
        return NativeBackend(tables)
    return TorchBackend(tables)
