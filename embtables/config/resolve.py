"""Resolve a nest of FeatureConfig into tables and features, never mutating the caller's objects.

TF's ``TPUEmbedding.__init__`` mutates ``TableConfig`` (filling in the optimizer and the name);
we build new, resolved values instead (STYLE R7).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from embtables.config import nest
from embtables.config.catalogue import OPTIMIZER_TYPES, Optimizer
from embtables.config.tables import FeatureConfig, TableConfig
from embtables.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ResolvedTable:
    """A table after resolution: its final name and optimizer, and which features use it."""

    index: int
    name: str
    config: TableConfig
    optimizer: Optimizer
    feature_indices: tuple[int, ...]

    @property
    def vocabulary_size(self) -> int:
        return self.config.vocabulary_size

    @property
    def dim(self) -> int:
        return self.config.dim


@dataclasses.dataclass(frozen=True)
class ResolvedFeature:
    """A feature after resolution: its path in the nest, display name and table index."""

    index: int
    path: nest.Path
    name: str
    config: FeatureConfig
    table_index: int


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """Tables in order of first appearance, features in ``tf.nest`` flatten order."""

    structure: object
    features: tuple[ResolvedFeature, ...]
    tables: tuple[ResolvedTable, ...]

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables)

    def learning_rate_callables(self) -> tuple[Callable[[], float], ...]:
        """Distinct dynamic learning rates, by identity, in order of first appearance over tables."""
        seen: dict[int, Callable[[], float]] = {}
        for t in self.tables:
            lr = t.optimizer.learning_rate
            if callable(lr) and id(lr) not in seen:
                seen[id(lr)] = lr
        return tuple(seen.values())


def resolve(feature_config: object, optimizer: Optimizer | None) -> ResolvedConfig:
    """Flatten ``feature_config``, collect distinct tables and give each its name and optimizer.

    Raises:
      ValueError: a leaf is not a FeatureConfig, a table ends up with no optimizer or an unknown
        optimizer type, or two distinct tables share a name.
    """
    if optimizer is not None and not isinstance(optimizer, OPTIMIZER_TYPES):
        raise ConfigError(
            f"DistributedEmbedding: `optimizer` must be one of "
            f"{', '.join(c.__name__ for c in OPTIMIZER_TYPES)} (embtables.*), got {type(optimizer).__name__}. "
            "Torch optimizers cannot drive the fused sparse update; use the embtables equivalent."
        )
    leaves = nest.flatten_with_paths(feature_config)
    if not leaves:
        raise ConfigError("DistributedEmbedding: `feature_config` holds no FeatureConfig.")
    table_order: dict[int, int] = {}
    table_objs: list[TableConfig] = []
    table_features: list[list[int]] = []
    features: list[ResolvedFeature] = []
    for i, (path, leaf) in enumerate(leaves):
        if not isinstance(leaf, FeatureConfig):
            raise ConfigError(
                f"DistributedEmbedding: every leaf of `feature_config` must be a FeatureConfig; the one at "
                f"{nest.path_str(path)} is a {type(leaf).__name__}."
            )
        key = id(leaf.table)
        if key not in table_order:
            table_order[key] = len(table_objs)
            table_objs.append(leaf.table)
            table_features.append([])
        t = table_order[key]
        table_features[t].append(i)
        name = leaf.name if leaf.name is not None else nest.path_str(path)
        features.append(ResolvedFeature(index=i, path=path, name=name, config=leaf, table_index=t))

    seen_features: dict[str, int] = {}
    for f in features:
        if f.name in seen_features:
            raise ConfigError(
                f"DistributedEmbedding: two features are named {f.name!r} (features #{seen_features[f.name]} and "
                f"#{f.index} in tf.nest order); error messages and statistics would be ambiguous. Give each "
                "FeatureConfig a distinct `name`."
            )
        seen_features[f.name] = f.index
    tables: list[ResolvedTable] = []
    names: dict[str, int] = {}
    for t, cfg in enumerate(table_objs):
        name = cfg.name if cfg.name is not None else f"table_{t}"
        if name in names:
            raise ConfigError(
                f"DistributedEmbedding: two different tables are named {name!r} (tables #{names[name]} and #{t} "
                "in order of first appearance). Table names must be unique; rename one, or pass the same "
                "TableConfig object to share a table."
            )
        names[name] = t
        opt = cfg.optimizer if cfg.optimizer is not None else optimizer
        if opt is None:
            raise ConfigError(
                f"DistributedEmbedding: table {name!r} has no optimizer. Pass `optimizer=` to "
                "DistributedEmbedding or set TableConfig.optimizer."
            )
        if cfg.half and not opt.use_gradient_accumulation:
            raise ConfigError(
                f"DistributedEmbedding: table {name!r} is stored as {cfg.storage} and its optimizer has "
                "use_gradient_accumulation=False: occurrence-by-occurrence updates of half-precision rows are not "
                "supported (each occurrence would round). Use use_gradient_accumulation=True, or float32 rows."
            )
        tables.append(
            ResolvedTable(index=t, name=name, config=cfg, optimizer=opt, feature_indices=tuple(table_features[t]))
        )
    _check_state_keys(tables)
    return ResolvedConfig(structure=feature_config, features=tuple(features), tables=tuple(tables))


def _check_state_keys(tables: list[ResolvedTable]) -> None:
    """Table names become checkpoint keys ``<table>`` and ``<table>/<slot>`` (TF's names): refuse a name
    that would collide with another table's slot key, or that is ambiguous as a key."""
    slot_keys = {f"{t.name}/{slot}": t.name for t in tables for slot in t.optimizer.slot_names}
    # A rank file also names each table's row ids "<table>#rows" (and "#stale_rows", "#stale").
    slot_keys.update({f"{t.name}#{kind}": t.name for t in tables for kind in ("rows", "stale_rows", "stale")})
    for t in tables:
        if t.name.startswith("/") or t.name.endswith("/") or "//" in t.name:
            raise ConfigError(
                f"DistributedEmbedding: table name {t.name!r} starts or ends with '/' or contains '//'; its "
                "checkpoint keys would be ambiguous. Rename the table."
            )
        owner = slot_keys.get(t.name)
        if owner is not None:
            raise ConfigError(
                f"DistributedEmbedding: table name {t.name!r} is also the key of a slot or the row ids of table "
                f"{owner!r} ('<table>/<slot>', '<table>#rows'), so state_dict() or a checkpoint would hold two tensors "
                "under one key. Rename the table."
            )
