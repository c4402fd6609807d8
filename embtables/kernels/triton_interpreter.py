"""Triton's CPU interpreter (``TRITON_INTERPRET=1``), which runs the GPU kernels on CPU tensors for the tests
and for ``embtables bench gpu-launches``: ``mend`` fixes what NumPy 2 breaks in it, takes a quarter of its time off
short launches (builtins scanned once) and about a tenth off every launch (tuple types named when read)."""

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
    _scan_builtins_once(interpreter)
    _tuple_names_when_read(interpreter)


def _scan_builtins_once(interpreter: Any) -> None:
    """Every launch re-patches triton.language's builtins, and finds them by scanning each module's members
    (``inspect.getmembers``, a quarter of a short launch). The builtins of a module or class never change:
    scan each once and patch the ones still original, which is what the scan found each time."""
    is_builtin = getattr(getattr(getattr(interpreter, "tl", None), "core", None), "is_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if not hasattr(interpreter, "_patch_builtin") or is_builtin is None or patch_attr is None:
        return
    import inspect

    found: dict[Any, list[tuple[str, Any]]] = {}  # a module or class -> its builtins (name, original)

    def patch_builtin(pkg: Any, builder: Any, scope: Any) -> None:
        if pkg not in found:
            found[pkg] = [(n, m) for n, m in inspect.getmembers(pkg) if is_builtin(m)]
        for name, member in found[pkg]:
            if getattr(pkg, name, None) is member:  # not patched already in this launch
                patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


def _tuple_names_when_read(interpreter: Any) -> None:
    """Every call of a language function wraps its arguments in a ``tuple_type`` whose ``name`` (a string of
    every member's type) is built at once and almost never read: build it when read instead. The name's text is
    Triton's own; nothing else of the type changes."""
    tuple_type = getattr(getattr(getattr(interpreter, "tl", None), "core", None), "tuple_type", None)
    if tuple_type is None or "name" in vars(tuple_type) or getattr(tuple_type, "_embtables_mended", False):
        return
    original = tuple_type.__init__

    def __init__(self: Any, types: Any, fields: Any = None) -> None:
        self.types = types
        self.fields = fields or [""] * len(types)

    def name(self: Any) -> str:
        return "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + "]"

    # Only where Triton's __init__ sets exactly these three attributes and names a tuple as this does.
    probe = object.__new__(tuple_type)
    original(probe, [interpreter.tl.int32, interpreter.tl.float32], ["a", ""])
    if set(vars(probe)) != {"types", "fields", "name"} or probe.name != name(probe):
        return
    tuple_type.__init__ = __init__
    tuple_type.name = property(name)
    tuple_type._embtables_mended = True
