"""Triton's CPU interpreter (``TRITON_INTERPRET=1``), which runs the GPU kernels on CPU tensors for the tests
and for ``embtables bench gpu-launches``: ``mend`` fixes what NumPy 2 breaks in it."""

from __future__ import annotations

import os
from typing import Any


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def mend() -> None:
    """Triton's interpreter turns a scalar into an index with ``int(array)``, which NumPy 2 refuses for its
    one-element arrays; loop bounds loaded from memory then fail. Use the element instead. Idempotent; does
    nothing without the interpreter or with a Triton whose interpreter is organised differently."""
    if not interpreting():
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_embtables_mended", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._embtables_mended = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
