"""Nests of leaves (dict, list, tuple, namedtuple, arbitrarily nested), as in ``tf.nest``.

Dicts flatten in sorted key order, like ``tf.nest``, so table order and default table names
(``table_{i}``) are the same as TensorFlow's for the same feature config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

Path = tuple[Any, ...]


def _is_namedtuple(x: object) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _children(x: object) -> list[tuple[Any, Any]] | None:
    """``[(key, child), ...]`` for a container, ``None`` for a leaf."""
    if isinstance(x, Mapping):
        try:
            keys = sorted(x)
        except TypeError as exc:
            raise TypeError(f"nest: dict keys must be sortable, got {list(x)!r}.") from exc
        return [(k, x[k]) for k in keys]
    if isinstance(x, (list, tuple)):
        return list(enumerate(x))
    return None


def flatten_with_paths(structure: object) -> list[tuple[Path, Any]]:
    """All leaves of ``structure`` with their paths, in ``tf.nest`` order."""
    out: list[tuple[Path, Any]] = []

    def walk(x: object, path: Path) -> None:
        kids = _children(x)
        if kids is None:
            out.append((path, x))
            return
        for key, child in kids:
            walk(child, (*path, key))

    walk(structure, ())
    return out


def flatten(structure: object) -> list[Any]:
    """The leaves of ``structure`` in ``tf.nest`` order."""
    return [leaf for _, leaf in flatten_with_paths(structure)]


def path_str(path: Path) -> str:
    """``('a', 0)`` -> ``"a/0"``; the empty path (a single leaf) -> ``"<root>"``."""
    return "/".join(str(p) for p in path) if path else "<root>"


def _rebuild(template: object, leaves: Iterator[Any]) -> Any:
    kids = _children(template)
    if kids is None:
        return next(leaves)
    if isinstance(template, Mapping):
        # Children come in sorted (flatten) order; the rebuilt mapping keeps the template's own order.
        built = {k: _rebuild(child, leaves) for k, child in kids}
        pairs = [(k, built[k]) for k in template]
        try:
            return type(template)(pairs)  # type: ignore[call-arg]
        except TypeError:  # mapping types whose constructor takes other arguments (defaultdict, ...)
            return dict(pairs)
    values = [_rebuild(child, leaves) for _, child in kids]
    if _is_namedtuple(template):
        return type(template)(*values)
    return type(template)(values) if isinstance(template, tuple) else values


def pack_sequence_as(structure: object, leaves: Sequence[Any]) -> Any:
    """Build a nest shaped like ``structure`` from ``leaves`` given in flatten order."""
    n = len(flatten(structure))
    if n != len(leaves):
        raise ValueError(f"nest: structure has {n} leaves but {len(leaves)} values were given.")
    return _rebuild(structure, iter(leaves))


class FlatDict:
    """A plain ``dict`` of leaves, one level deep (the usual ``feature_config``): flattening a nest of the
    same keys and packing leaves back are a list lookup, with the results of the walking functions."""

    def __init__(self, template: dict[Any, Any]) -> None:
        self.keys = sorted(template)  # flatten order
        position = {k: i for i, k in enumerate(self.keys)}
        self.template_order = [(k, position[k]) for k in template]

    def flatten_like(self, got: object, is_leaf: Callable[[Any], bool]) -> list[Any] | None:
        """The leaves of ``got`` in flatten order when it is a ``dict`` of the same keys whose values are
        leaves; None otherwise (the caller then walks it, and names what differs)."""
        if type(got) is not dict or len(got) != len(self.keys):
            return None
        try:
            leaves = [got[k] for k in self.keys]
        except (KeyError, TypeError):
            return None
        for leaf in leaves:
            if not is_leaf(leaf) and isinstance(leaf, (Mapping, list, tuple)):
                return None
        return leaves

    def pack(self, leaves: Sequence[Any]) -> dict[Any, Any]:
        """``pack_sequence_as(template, leaves)``."""
        if len(leaves) != len(self.keys):
            raise ValueError(f"nest: structure has {len(self.keys)} leaves but {len(leaves)} values were given.")
        return {k: leaves[i] for k, i in self.template_order}


def flat_dict(structure: object) -> FlatDict | None:
    """A ``FlatDict`` for a plain ``dict`` whose values are all leaves, else None."""
    if type(structure) is not dict or not structure:
        return None
    if any(_children(v) is not None for v in structure.values()):
        return None
    try:
        return FlatDict(structure)
    except TypeError:  # unsortable keys: the walking functions name them
        return None


def assert_same_structure(expected: object, got: object, *, what: str, is_leaf: Callable[[Any], bool]) -> None:
    """Raise ``ValueError`` naming the first path where ``got`` differs from ``expected``.

    ``is_leaf(x)`` tells which objects in ``got`` are leaves even though they may be containers
    themselves (e.g. a ``Ragged`` is a leaf, never a tuple to descend into).
    """

    def walk(e: object, g: object, path: Path) -> None:
        ek = _children(e)
        if ek is None:
            if not is_leaf(g) and _children(g) is not None:
                raise TypeError(
                    f"{what}: expected one value for feature {path_str(path)!r}, got a "
                    f"{type(g).__name__} of {len(g)} entries. Pass one tensor per feature."  # type: ignore[arg-type]
                )
            return
        if is_leaf(g) or _children(g) is None:
            raise ValueError(
                f"{what}: expected a {type(e).__name__} at {path_str(path)} (the structure of "
                f"feature_config), got {type(g).__name__}. Pass {what} in the same nest as feature_config."
            )
        if isinstance(e, Mapping) != isinstance(g, Mapping):
            raise TypeError(
                f"{what}: at {path_str(path)} feature_config has a {type(e).__name__} but {what} has a "
                f"{type(g).__name__}. Pass {what} in the same nest as feature_config."
            )
        gk = _children(g)
        assert gk is not None
        ekeys = [k for k, _ in ek]
        gkeys = [k for k, _ in gk]
        if ekeys != gkeys:
            raise ValueError(
                f"{what}: at {path_str(path)} expected keys/length {ekeys!r} (from feature_config), got "
                f"{gkeys!r}. Pass one entry per feature, in the same nest as feature_config."
            )
        for (k, ec), (_, gc) in zip(ek, gk):
            walk(ec, gc, (*path, k))

    walk(expected, got, ())
