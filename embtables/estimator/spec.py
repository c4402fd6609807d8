"""``EmbeddingConfigSpec``: TPUEstimator's embedding configuration (spec §4.4), and how it builds a
``DistributedEmbedding`` and converts raw input dicts for it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from embtables.api import DistributedEmbedding
from embtables.config import OPTIMIZER_TYPES, SGD, FeatureConfig, FrequencyEstimator, Optimizer, TableConfig
from embtables.config.optimizers import _check_number
from embtables.errors import ConfigError
from embtables.estimator.feature_columns import EMBEDDING_COLUMN_TYPES, EmbeddingColumn, WeightedCategoricalColumn
from embtables.estimator.parameters import PARAMETER_TYPES, FrequencyEstimatorParameters
from embtables.estimator.raw_inputs import is_single_lengths
from embtables.tables import Ragged

_PARTITION_STRATEGIES = ("div", "mod")


@dataclasses.dataclass(frozen=True, eq=False)
class _StepLearningRate:
    """A column's ``learning_rate_fn(global_step)`` as the zero-argument learning rate of its table."""

    fn: Callable[[int], float]
    global_step: Callable[[], int]

    def __call__(self) -> float:
        return float(self.fn(self.global_step()))


@dataclasses.dataclass(frozen=True)
class EmbeddingConfigSpec:
    """The embedding part of an estimator model, with TF's arguments and rules:

    - ``feature_columns``: embedding columns (``embedding_column`` / ``shared_embedding_columns``), or
    - ``feature_to_config_dict`` ({feature: FeatureConfig}) and ``table_to_config_dict``
      ({table name: TableConfig}) together; one of the two forms is required (``ValueError``).
    - ``optimization_parameters``: a v1 ``*Parameters`` for every table (``ValueError`` for anything
      else; an embtables optimizer is accepted too). With the dicts, a table's own ``optimizer`` wins.
    - ``clipping_limit``: symmetric clip of each accumulated row gradient (the tighter of it and the
      optimizer's own clip wins, spec §10.4).
    - ``experimental_gradient_multiplier_fn(global_step) -> float`` scales every embedding gradient.
    - ``partition_strategy``: "div" or "mod" (``ValueError`` otherwise), the row layout when sharded.
    - ``pipeline_execution_with_tensor_core``, ``profile_data_directory``: as ``DistributedEmbedding``.
    """

    feature_columns: Sequence[EmbeddingColumn] | None = None
    optimization_parameters: Any = None
    clipping_limit: float | None = None
    pipeline_execution_with_tensor_core: bool = False
    experimental_gradient_multiplier_fn: Callable[[int], float] | None = None
    feature_to_config_dict: Mapping[str, FeatureConfig] | None = None
    table_to_config_dict: Mapping[str, TableConfig] | None = None
    partition_strategy: str = "div"
    profile_data_directory: str | None = None

    def __post_init__(self) -> None:
        who = "EmbeddingConfigSpec"
        dicts = self.feature_to_config_dict is not None and self.table_to_config_dict is not None
        if not self.feature_columns and not dicts:
            raise ConfigError(
                f"{who}: give `feature_columns` (embedding_column / shared_embedding_columns), or both "
                "`feature_to_config_dict` and `table_to_config_dict`."
            )
        if self.feature_columns:
            columns = list(self.feature_columns)
            for c in columns:
                if not isinstance(c, EMBEDDING_COLUMN_TYPES):
                    raise TypeError(
                        f"{who}: every feature column must come from embedding_column or shared_embedding_columns, "
                        f"got {type(c).__name__} ({c!r:.80})."
                    )
            names = [c.name for c in columns]
            if len(set(names)) != len(names):
                raise ConfigError(f"{who}: two feature columns have the same name: {sorted(names)}.")
            object.__setattr__(self, "feature_columns", tuple(columns))
        opt = self.optimization_parameters
        if not isinstance(opt, PARAMETER_TYPES + OPTIMIZER_TYPES):
            allowed = ", ".join(c.__name__ for c in PARAMETER_TYPES)
            raise ConfigError(
                f"{who}: `optimization_parameters` must be one of {allowed} (embtables.estimator), got "
                f"{type(opt).__name__}."
            )
        if self.clipping_limit is not None:
            _check_number(who, "clipping_limit", self.clipping_limit)
            if self.clipping_limit <= 0:
                raise ConfigError(
                    f"{who}: `clipping_limit` must be > 0 (an absolute value), got {self.clipping_limit}."
                )
        if self.partition_strategy not in _PARTITION_STRATEGIES:
            raise ConfigError(f"{who}: `partition_strategy` must be 'div' or 'mod', got {self.partition_strategy!r}.")
        fn = self.experimental_gradient_multiplier_fn
        if fn is not None and not callable(fn):
            raise ConfigError(f"{who}: `experimental_gradient_multiplier_fn` must be a callable global_step -> float.")
        if not isinstance(self.pipeline_execution_with_tensor_core, bool):
            raise TypeError(f"{who}: `pipeline_execution_with_tensor_core` must be a bool.")

    # ------------------------------------------------------------------ the engine
    def optimizer(self, global_step: Callable[[], int]) -> Optimizer:
        """The optimizer of every table, with ``clipping_limit`` folded in."""
        opt = self.optimization_parameters
        if isinstance(opt, FrequencyEstimatorParameters):
            out: Optimizer = opt.to_optimizer(lambda: float(global_step()))
        elif isinstance(opt, PARAMETER_TYPES):
            out = opt.to_optimizer()
        else:
            out = opt
        return self._for_engine(out, global_step)

    def _for_engine(self, opt: Optimizer, global_step: Callable[[], int]) -> Optimizer:
        """``opt`` as a table trains with it: a FrequencyEstimator's rate becomes the global step, and
        ``clipping_limit`` is folded into the gradient clip."""
        if isinstance(opt, FrequencyEstimator) and not callable(opt.learning_rate):
            opt = dataclasses.replace(opt, learning_rate=lambda: float(global_step()))
        limit = self.clipping_limit
        if limit is None:
            return opt
        lo, hi = opt.gradient_clip_bounds
        lo = -float(limit) if lo is None else max(lo, -float(limit))
        hi = float(limit) if hi is None else min(hi, float(limit))
        changes: dict[str, Any] = {"clipvalue": (lo, hi)}
        if not opt.use_gradient_accumulation:
            if not isinstance(opt, SGD):
                raise ConfigError(
                    f"EmbeddingConfigSpec: `clipping_limit` clips the accumulated gradient, but {type(opt).__name__} "
                    "has use_gradient_accumulation=False. Turn accumulation on or drop clipping_limit."
                )
            changes["use_gradient_accumulation"] = True  # as TF v1 does for SGD with a clip
        return dataclasses.replace(opt, **changes)

    def feature_config(self, global_step: Callable[[], int], base: Optimizer | None = None) -> dict[str, FeatureConfig]:
        """``{feature name: FeatureConfig}`` for ``DistributedEmbedding`` (the estimator's global step
        drives ``learning_rate_fn`` and FrequencyEstimator); ``base`` is ``optimizer(global_step)``
        when the caller has it already."""
        base = self.optimizer(global_step) if base is None else base
        if self.feature_columns is None:
            assert self.feature_to_config_dict is not None and self.table_to_config_dict is not None
            known = {id(t) for t in self.table_to_config_dict.values()}
            for name, f in self.feature_to_config_dict.items():
                if id(f.table) not in known:
                    raise ConfigError(
                        f"EmbeddingConfigSpec: feature {name!r} uses a table that is not in table_to_config_dict."
                    )
            renamed = {
                id(t): dataclasses.replace(
                    t,
                    name=t.name or key,
                    optimizer=None if t.optimizer is None else self._for_engine(t.optimizer, global_step),
                )
                for key, t in self.table_to_config_dict.items()
            }
            return {
                name: dataclasses.replace(f, table=renamed[id(f.table)], name=f.name or name)
                for name, f in self.feature_to_config_dict.items()
            }
        tables: dict[str, TableConfig] = {}
        out = {}
        rates: dict[int, _StepLearningRate] = {}  # one per distinct learning_rate_fn: evaluated once a step, as TF
        for c in self.feature_columns:
            table = tables.get(c.table_name)
            if table is None:
                opt = base
                if c.learning_rate_fn is not None:
                    fn = c.learning_rate_fn
                    rate = rates.setdefault(id(fn), _StepLearningRate(fn, global_step))
                    opt = dataclasses.replace(base, learning_rate=rate)
                table = TableConfig(
                    c.vocabulary_size,
                    c.dimension,
                    initializer=c.initializer,
                    optimizer=opt,
                    combiner=c.combiner,
                    name=c.table_name,
                    dynamic=c.dynamic,
                    dtype=c.dtype,
                    slot_dtype=c.slot_dtype,
                    offload=c.offload,
                )
                tables[c.table_name] = table
            elif table.dim != c.dimension or table.vocabulary_size != c.vocabulary_size:
                raise ConfigError(f"EmbeddingConfigSpec: shared table {c.table_name!r} is used with different sizes.")
            out[c.name] = FeatureConfig(table, max_sequence_length=c.max_sequence_length, name=c.name)
        return out

    def build(
        self,
        global_step: Callable[[], int],
        *,
        device: torch.device | str | None = None,
        process_group: Any = None,
        timeout: float | None = None,
    ) -> DistributedEmbedding:
        """The ``DistributedEmbedding`` of this spec (sharded over ``process_group`` when one is up)."""
        base = self.optimizer(global_step)  # one object: the tables share its learning-rate callable
        return DistributedEmbedding(
            self.feature_config(global_step, base),
            base,
            pipeline_execution_with_tensor_core=self.pipeline_execution_with_tensor_core,
            device=device,
            sharding=self.partition_strategy,
            process_group=process_group,
            timeout=timeout,
            profile_data_directory=self.profile_data_directory,
        )

    # ------------------------------------------------------------------ inputs
    def raw_keys(self) -> frozenset[str] | None:
        """The raw features the feature columns read (ids, and weights of weighted columns); None in the
        dicts form (the input holds the engine's inputs themselves)."""
        if self.feature_columns is None:
            return None
        keys = set()
        for c in self.feature_columns:
            cat = c.categorical_column
            keys.add(cat.key)
            if isinstance(cat, WeightedCategoricalColumn):
                keys.add(cat.weight_feature_key)
        return frozenset(keys)

    def engine_inputs(self, features: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Raw input dict -> ``(ids, weights)`` nests for ``DistributedEmbedding`` (feature-column form):
        ``{column name: Ragged}`` and, when any column is weighted, ``{column name: Ragged | None}``
        (else ``{}``). With the dicts form, ``features`` must already hold the engine's inputs by
        feature name."""
        if self.feature_columns is None:
            return {k: features[k] for k in self.feature_to_config_dict or {}}, {}
        return engine_inputs(self.feature_columns, features)


def engine_inputs(
    columns: Sequence[EmbeddingColumn], features: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Raw input dict -> ``(ids, weights)`` nests of the embedding ``columns`` (``EmbeddingConfigSpec.engine_inputs``
    of the feature-column form; a model artifact converts its rows with it too)."""
    ids_out: dict[str, Any] = {}
    weights_out: dict[str, Any] = {}
    cache: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}
    for c in columns:
        cat = c.categorical_column
        got = cache.get(cat.name)
        if got is None:
            got = cache[cat.name] = cat.ids(features)
        ids, lengths, weights = got
        if weights is None and is_single_lengths(lengths) and c.max_sequence_length == 0 and c.dynamic is None:
            # one id per row: dense ids [B] are the same B bags of one id, without row splits
            ids_out[c.name] = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
            weights_out[c.name] = None
            continue
        splits = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=splits[1:])
        row_splits = torch.from_numpy(splits)
        ids_out[c.name] = Ragged(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)), row_splits)
        weights_out[c.name] = (
            None if weights is None else Ragged(torch.from_numpy(np.ascontiguousarray(weights)), row_splits)
        )
    if all(w is None for w in weights_out.values()):
        weights_out = {}  # no weighted column: the engine's default (every weight 1)
    return ids_out, weights_out
