"""Inputs as a nest shaped like ``feature_config``: which leaves are inputs, and flattening them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from embtables.config import nest
from embtables.errors import InputError
from embtables.tables.inputs import is_kjt, split_kjt
from embtables.tables.ragged import Ragged


def is_input_leaf(x: object) -> bool:
    return x is None or isinstance(x, (Tensor, Ragged)) or is_kjt(x)


def flatten_inputs(
    cfg: Any, features: Any, weights: Any, flat: nest.FlatDict | None = None
) -> tuple[list[Any], list[Any]]:
    """The per-feature inputs and weights of a nest (or a whole KJT) shaped like ``cfg``, flattened.
    ``flat``: ``nest.flat_dict(cfg)``, when the caller keeps it (a dict of inputs then takes no walk)."""
    if flat is not None and weights is None:
        leaves = flat.flatten_like(features, is_input_leaf)
        if leaves is not None:
            return leaves, [None] * len(leaves)
    if is_kjt(features):
        if weights is not None:
            raise InputError("weights were given with a KeyedJaggedTensor; put them in the KJT instead.")
        if not isinstance(cfg, Mapping):
            raise InputError(
                "a whole KeyedJaggedTensor can be passed only when feature_config is a dict keyed by "
                f"feature name; feature_config is a {type(cfg).__name__}. Pass a nest of per-feature inputs."
            )
        parts = split_kjt(features)
        missing = [k for k in cfg if k not in parts]
        if missing:
            raise InputError(
                f"the KeyedJaggedTensor has keys {sorted(parts)} but feature_config also needs {missing}. "
                "Give the KJT one key per feature_config key."
            )
        features = {k: parts[k][0] for k in cfg}
        weights = {k: parts[k][1] for k in cfg}
    nest.assert_same_structure(cfg, features, what="features", is_leaf=is_input_leaf)
    flat_x = nest.flatten(features)
    if weights is None:
        flat_w: list[Any] = [None] * len(flat_x)
    else:
        nest.assert_same_structure(cfg, weights, what="weights", is_leaf=is_input_leaf)
        flat_w = nest.flatten(weights)
    return flat_x, flat_w
