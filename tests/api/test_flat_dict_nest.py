"""``nest.FlatDict``: the usual feature_config (a dict of leaves) flattens and packs without walking, with
exactly the walking functions' results, and hands every other input back to them (which name errors)."""

from __future__ import annotations

import random

from embtables.config import nest


def _leaf(x: object) -> bool:
    return not isinstance(x, (dict, list, tuple))


def test_flat_dict_agrees_with_the_walking_functions() -> None:
    rng = random.Random(2)
    for _ in range(300):
        keys = rng.sample(["b", "a", "z", "f10", "f2", "m"], rng.randint(1, 6))
        template = {k: object() for k in keys}
        flat = nest.flat_dict(template)
        assert flat is not None
        got = {k: rng.random() for k in rng.sample(keys, len(keys))}  # same keys, another order
        assert flat.flatten_like(got, _leaf) == nest.flatten(got)
        leaves = [rng.random() for _ in keys]
        packed = flat.pack(leaves)
        assert packed == nest.pack_sequence_as(template, leaves) and list(packed) == list(template)


def test_flat_dict_returns_none_for_what_the_walk_must_judge() -> None:
    flat = nest.flat_dict({"a": 1, "b": 2})
    assert flat is not None
    for got in ({"a": 1}, {"a": 1, "c": 2}, {"a": 1, "b": 2, "c": 3}, {"a": [1, 2], "b": 2}, {"a": {"x": 1}, "b": 2},
                [1, 2], (1, 2), None, 5):  # fmt: skip
        assert flat.flatten_like(got, _leaf) is None, got
    assert nest.flat_dict({"a": {"x": 1}}) is None and nest.flat_dict([1, 2]) is None and nest.flat_dict({}) is None
    assert nest.flat_dict({1: "x", "a": "y"}) is None  # unsortable keys: the walk names them
