"""``DistributedEmbedding``: the TPUEmbedding programming model as a ``torch.nn.Module``.

    emb = DistributedEmbedding(feature_config, optimizer=embtables.Adagrad(0.1))
    acts = emb(features)               # or emb.enqueue(features); acts = emb.dequeue()
    loss(acts).backward()
    emb.apply_gradients()              # or emb.apply_gradients(d_loss_d_acts)

Tables and slots are not ``nn.Parameter``s: like on a TPU they are updated only by the fused
sparse optimizer, so a ``torch.optim`` over ``model.parameters()`` never touches them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from embtables.config import Optimizer, ResolvedConfig, TableConfig, nest, resolve
from embtables.errors import InputError
from embtables.tables.collection import EmbeddingCollection, TableGradient
from embtables.tables.inputs import FeatureBatch, InputConverter, is_kjt, split_kjt
from embtables.tables.ragged import Ragged
from embtables.tables.state import LocalShard

logger = logging.getLogger("embtables")


class TableDict(dict[str, Any]):
    """``{table name: value}`` that also accepts the ``TableConfig`` object as a key, as TF's
    ``embedding_tables[table_config]`` does (resolved by identity to the table's name)."""

    def __init__(self, data: dict[str, Any], names_by_config: dict[int, str]) -> None:
        super().__init__(data)
        self._names = names_by_config

    def _key(self, key: object) -> str:
        if isinstance(key, TableConfig):
            return self._names.get(id(key), f"<TableConfig {key.name!r} not in this module>")
        return key  # type: ignore[return-value]  # a str, or a bad key that dict lookup rejects

    def __getitem__(self, key: object) -> Any:
        return super().__getitem__(self._key(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(self._key(key))

    def get(self, key: object, default: Any = None) -> Any:
        return super().get(self._key(key), default)


def _is_input_leaf(x: object) -> bool:
    return x is None or isinstance(x, (Tensor, Ragged)) or is_kjt(x)


@dataclasses.dataclass(eq=False)
class _Lookup:
    """What the last training lookup left for ``apply_gradients``."""

    batches: list[FeatureBatch]
    activations: list[Tensor]


@dataclasses.dataclass(eq=False)
class _PendingUpdate:
    """A validated update held back one step by pipelining (SPEC 6)."""

    table_grads: list[TableGradient]
    lrs: dict[str, float]


class DistributedEmbedding(nn.Module):
    """Embedding tables with TF ``TPUEmbedding`` semantics (one process; sharding comes later).

    Args:
      feature_config: a nest (dict, list, tuple, nested) of ``FeatureConfig``. Activations come back
        in the same nest. Features (and so tables, in order of first appearance) are flattened in
        ``tf.nest`` order, i.e. dict keys sorted; unnamed tables become ``table_{i}`` in that order.
      optimizer: the global optimizer for tables whose ``TableConfig.optimizer`` is None.
      pipeline_execution_with_tensor_core: when True, the lookup of step t+1 reads the tables before
        the update of step t is applied (one step stale, SPEC 6); updates still apply in order.
      device: where tables, slots and activations live (default CPU).
    """

    def __init__(
        self,
        feature_config: Any,
        optimizer: Optimizer | None = None,
        pipeline_execution_with_tensor_core: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(pipeline_execution_with_tensor_core, bool):
            raise TypeError(
                "DistributedEmbedding: `pipeline_execution_with_tensor_core` must be a bool, got "
                f"{pipeline_execution_with_tensor_core!r}."
            )
        self._resolved: ResolvedConfig = resolve(feature_config, optimizer)
        self._feature_config = feature_config
        self.pipeline_execution_with_tensor_core = pipeline_execution_with_tensor_core
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self._engine = EmbeddingCollection(self._resolved, dev)
        self._converters = [InputConverter(f, self._resolved.tables[f.table_index]) for f in self._resolved.features]
        self._names_by_config = {id(t.config): t.name for t in self._resolved.tables}
        self._built = False
        self._enqueued: tuple[list[FeatureBatch], bool] | None = None
        self._last: _Lookup | None = None
        self._pending: _PendingUpdate | None = None

    # ------------------------------------------------------------------ properties
    @property
    def feature_config(self) -> Any:
        return self._feature_config

    @property
    def resolved_config(self) -> ResolvedConfig:
        """Tables (with final names and optimizers) and features, as resolved at construction."""
        return self._resolved

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def embedding_tables(self) -> dict[str, Tensor]:
        """``{table name: weights [V, D]}`` (live tensors, after any pipelined update); the
        ``TableConfig`` object works as a key too, as in TF."""
        self._flush()
        return TableDict({name: s.weights for name, s in self._engine.states.items()}, self._names_by_config)

    @property
    def slot_variables(self) -> dict[str, dict[str, Tensor]]:
        """``{table name: {slot name: [V, D]}}`` with TF's slot names (live tensors); the
        ``TableConfig`` object works as a key too."""
        self._flush()
        return TableDict({name: dict(s.slots) for name, s in self._engine.states.items()}, self._names_by_config)

    def build(self, per_replica_input_shapes: Any = None, per_replica_batch_size: int | None = None) -> None:
        """TF compatibility: tables are created at construction, so this only checks TF's rules
        (both arguments together raise ``ValueError``; a second call logs a warning)."""
        if per_replica_input_shapes is not None and per_replica_batch_size is not None:
            raise ValueError(
                "DistributedEmbedding.build: pass `per_replica_input_shapes` or `per_replica_batch_size`, not both."
            )
        if self._built:
            logger.warning("DistributedEmbedding.build: already built; this call does nothing.")
        self._built = True

    # ------------------------------------------------------------------ forward
    def _flatten_inputs(self, features: Any, weights: Any) -> tuple[list[Any], list[Any]]:
        cfg = self._feature_config
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
        nest.assert_same_structure(cfg, features, what="features", is_leaf=_is_input_leaf)
        flat_x = nest.flatten(features)
        if weights is None:
            flat_w: list[Any] = [None] * len(flat_x)
        else:
            nest.assert_same_structure(cfg, weights, what="weights", is_leaf=_is_input_leaf)
            flat_w = nest.flatten(weights)
        return flat_x, flat_w

    def enqueue(self, features: Any, weights: Any = None, training: bool = True) -> None:
        """Validate and stage a batch (TF ``enqueue``); ``training=False`` is a forward-only lookup.

        ``features`` / ``weights`` follow the nest of ``feature_config``; see ``embtables.Ragged``
        for the accepted input types. Raises (and stages nothing) on any invalid input.
        """
        flat_x, flat_w = self._flatten_inputs(features, weights)
        device = self.device
        batches = [conv.convert(x, w, device) for conv, x, w in zip(self._converters, flat_x, flat_w)]
        self._enqueued = (batches, bool(training))

    def dequeue(self) -> Any:
        """The activations of the last enqueued batch, in the nest of ``feature_config``.

        In training mode each activation is a leaf tensor that requires grad, so ``loss.backward()``
        leaves d(loss)/d(activation) in its ``.grad`` for ``apply_gradients()``.
        """
        if self._enqueued is None:
            raise RuntimeError("DistributedEmbedding.dequeue: nothing was enqueued. Call enqueue(features) first.")
        batches, training = self._enqueued
        self._enqueued = None
        if not training:
            self._flush()  # pipelining affects training lookups only
        with torch.no_grad():
            acts = self._engine.lookup(batches)
        if training:
            if self._last is not None:
                logger.warning(
                    "DistributedEmbedding: a training lookup's gradients were never applied before the next "
                    "training lookup; they are dropped. Call apply_gradients() once after each training lookup, "
                    "or look up with training=False / module.eval() for inference."
                )
            acts = [a.requires_grad_(True) for a in acts]
            self._last = _Lookup(batches, acts)
            self._flush()  # the pending update of the previous step lands after this step's lookup
        return nest.pack_sequence_as(self._feature_config, acts)

    def forward(self, features: Any, weights: Any = None) -> Any:
        """``enqueue(features, weights, training=self.training)`` then ``dequeue()``."""
        self.enqueue(features, weights, training=self.training)
        return self.dequeue()

    # ------------------------------------------------------------------ backward
    def apply_gradients(self, gradients: Any = None) -> None:
        """Apply the fused sparse update for the last training lookup.

        Args:
          gradients: None to use the activations' ``.grad`` left by ``loss.backward()``, or a nest
            (same structure as ``feature_config``) of d(loss)/d(activation) tensors shaped like the
            activations; a ``None`` entry is a zero gradient (its rows are still "touched").

        Raises ``ValueError``/``TypeError`` for a bad gradient (wrong shape, dtype, NaN/Inf reaching
        a table) and ``RuntimeError`` when there is no training lookup to apply to; in every case no
        table or slot changes.
        """
        if self._last is None:
            raise RuntimeError(
                "DistributedEmbedding.apply_gradients: no training lookup to apply gradients to. Call the "
                "module (in train mode) or enqueue(..., training=True) + dequeue() first; each lookup takes "
                "one apply_gradients."
            )
        last = self._last
        if gradients is None:
            flat_g: list[Any] = [a.grad for a in last.activations]
            for f, g in zip(self._resolved.features, flat_g):
                if g is None:
                    logger.warning("feature %r: no gradient reached its activation; applying a zero gradient.", f.name)
        else:
            nest.assert_same_structure(self._feature_config, gradients, what="gradients", is_leaf=_is_input_leaf)
            flat_g = nest.flatten(gradients)
            for f, g in zip(self._resolved.features, flat_g):
                if g is None:
                    logger.warning("feature %r: gradient is None; applying a zero gradient.", f.name)
        checked = [self._engine.check_gradient(i, b, g) for i, (b, g) in enumerate(zip(last.batches, flat_g))]
        self._flush()  # a held-back update lands first: phase 1 below reuses the tables' native workspaces
        table_grads = self._engine.table_gradients(last.batches, checked)
        lrs = self._engine.learning_rates()
        self._last = None
        update = _PendingUpdate(table_grads, lrs)
        if self.pipeline_execution_with_tensor_core:
            self._pending = update
        else:
            self._engine.apply(update.table_grads, update.lrs)

    def _flush(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._engine.apply(pending.table_grads, pending.lrs)

    def local_shards(self) -> dict[str, LocalShard]:
        """``{table name: LocalShard}``: the rows this process owns, with their global row ids, as
        live storage (after any pipelined update). In one process every table is one whole shard."""
        self._flush()
        out = {}
        for t in self._resolved.tables:
            state = self._engine.states[t.name]
            rows = torch.arange(t.vocabulary_size, dtype=torch.int64)
            out[t.name] = LocalShard(t.name, t.vocabulary_size, rows, state.tensors())
        return out

    # ------------------------------------------------------------------ nn.Module integration
    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> DistributedEmbedding:
        self._flush()
        self._engine.map_tensors(fn)
        return super()._apply(fn, recurse)  # type: ignore[no-untyped-call,no-any-return]

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self._flush()
        for key, t in self._engine.state_keys().items():
            destination[prefix + key] = t if keep_vars else t.detach()

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load ``<table>`` and ``<table>/<slot>`` keys; all-or-nothing for this module."""
        expected = self._engine.state_keys()
        present: dict[str, Tensor] = {}
        errors: list[str] = []
        missing = []
        for key, current in expected.items():
            full = prefix + key
            if full not in state_dict:
                missing.append(full)
                continue
            value = state_dict[full]
            if not isinstance(value, Tensor):
                errors.append(f"{full!r}: expected a Tensor, got {type(value).__name__}")
            elif tuple(value.shape) != tuple(current.shape):
                errors.append(
                    f"{full!r}: shape {list(value.shape)} in the checkpoint, {list(current.shape)} in this "
                    "model (vocabulary_size, dim); the table configs differ"
                )
            elif not torch.is_floating_point(value) or not bool(torch.isfinite(value).all()):
                errors.append(f"{full!r}: must be finite floating point values (the checkpoint is corrupt)")
            else:
                present[key] = value
        unexpected = [k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] not in expected]
        if strict:
            unexpected_keys.extend(unexpected)
        missing_keys.extend(missing)
        if errors:
            error_msgs.extend(f"DistributedEmbedding: {e}." for e in errors)
            return
        if strict and (missing or unexpected):
            return
        self._pending = None  # a restored state replaces any update still held back
        self._last = None
        with torch.no_grad():
            for key, value in present.items():
                expected[key].copy_(value.to(expected[key].dtype))

    def extra_repr(self) -> str:
        tables = ", ".join(
            f"{t.name}: {t.vocabulary_size}x{t.dim} {type(t.optimizer).__name__}" for t in self._resolved.tables
        )
        return f"tables=[{tables}], features={len(self._resolved.features)}"
