"""What a GPU training step launches and where it waits for the device, counted on the CPU.

The GPU step runs on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported). ``LaunchCounter`` counts, while it is active:

- every Triton kernel launch (``kernel[grid](...)``: one launch, whatever its grid), by kernel name;
- every torch operation a CUDA step would launch a kernel for: each ATen operation that reaches the
  dispatcher, except views (``is_view``) and allocations without a fill (``empty``), which launch nothing;
- every copy of kernel arguments from the host to the device (``gpu.addresses``: a no-op on CPU tensors, a
  ``cudaMemcpyAsync`` on CUDA), as the torch operation ``host_to_device``;
- every host synchronisation a CUDA step would make: ``.item()`` (``_local_scalar_dense``), ``.tolist()``,
  ``.cpu()`` / ``.numpy()``, and the operations whose output size depends on the data (``nonzero``,
  ``unique``, ``masked_select``, ``repeat_interleave`` without ``output_size``).

Operations inside a Triton launch (the interpreter's own copies) are not counted, nor reads of host tensors
(made from Python values with ``torch.tensor``, and their views), which a CUDA step keeps on the host, nor
reads of the host copies of an earlier call's device flags (``DeviceChecks.post``: copied without waiting,
read by the next call, which waits at most for the call before it).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operations that allocate without writing: no kernel launch on CUDA.
_NO_LAUNCH = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "alias", "_to_copy_noop"}
# Operations whose output size depends on the data, or that read a value back: a host synchronisation.
_SYNC = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}


class LaunchCounter(TorchDispatchMode):
    """Counts launches and host synchronisations (see the module docstring) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.triton: collections.Counter[str] = collections.Counter()
        self.torch: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        self._inside = 0  # inside a Triton launch: its own tensor copies are not the step's
        # the storages of tensors made from Python values (host tensors on CUDA too), kept alive while counting
        # so that no device tensor reuses their addresses
        self._host: dict[int, Any] = {}

    @property
    def launches(self) -> int:
        return sum(self.triton.values()) + sum(self.torch.values())

    def record(self) -> dict[str, Any]:
        """The counts as a JSON-ready dict."""
        return {
            "launches": self.launches,
            "triton_launches": sum(self.triton.values()),
            "torch_launches": sum(self.torch.values()),
            "syncs": sum(self.syncs.values()),
            "by_kernel": dict(sorted(self.triton.items())),
            "by_torch_op": dict(sorted(self.torch.items())),
            "by_sync": dict(sorted(self.syncs.items())),
        }

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "lift_fresh" and isinstance(out, torch.Tensor):  # ``torch.tensor(python values)``
            storage = out.untyped_storage()
            self._host[storage.data_ptr()] = storage
        elif not self._inside and not self._on_host(args):
            if name in _SYNC or (name == "repeat_interleave" and kwargs.get("output_size") is None):
                self.syncs[name] += 1
            elif not func.is_view and name not in _NO_LAUNCH:
                self.torch[name] += 1
        return out

    def _on_host(self, args: Any) -> bool:
        """Whether an operation reads only host tensors (made from Python values)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return bool(tensors) and all(self._is_host(t) for t in tensors)

    def _is_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` views the storage of a tensor made from Python values."""
        return tensor.untyped_storage().data_ptr() in self._host

    @contextlib.contextmanager
    def counting(self) -> Iterator[LaunchCounter]:
        """Activate the counter, with Triton's launches and the host reads of tensors hooked."""
        from triton.runtime import interpreter

        grid_call = interpreter.GridExecutor.__call__
        tolist, cpu, numpy = torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy
        counter = self

        def launch(executor: Any, *args: Any, **kwargs: Any) -> Any:
            if not counter._inside:
                counter.triton[getattr(executor.fn, "__name__", "kernel")] += 1
            counter._inside += 1
            try:
                return grid_call(executor, *args, **kwargs)
            finally:
                counter._inside -= 1

        from embtables.tables.backends.device_checks import is_host_copy

        def host_read(name: str, real: Any) -> Any:
            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if not counter._inside and not counter._is_host(tensor) and not is_host_copy(tensor):
                    counter.syncs[name] += 1
                return real(tensor, *args, **kwargs)

            return read

        from embtables.kernels import gpu

        addresses = gpu.addresses

        def copy_addresses(values: Any, device: Any) -> Any:
            if not counter._inside:
                counter.torch["host_to_device"] += 1
            return addresses(values, device)

        gpu.addresses = copy_addresses  # type: ignore[assignment]
        interpreter.GridExecutor.__call__ = launch  # type: ignore[method-assign]
        torch.Tensor.tolist = host_read("tolist", tolist)  # type: ignore[method-assign]
        torch.Tensor.cpu = host_read("cpu", cpu)  # type: ignore[method-assign]
        torch.Tensor.numpy = host_read("numpy", numpy)  # type: ignore[method-assign]
        try:
            with self:
                yield self
        finally:
            interpreter.GridExecutor.__call__ = grid_call  # type: ignore[method-assign]
            gpu.addresses = addresses  # type: ignore[assignment]
            torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy = tolist, cpu, numpy  # type: ignore[method-assign]
