"""Feature columns in the style of ``tf.feature_column`` + ``tf.tpu.experimental.embedding_column``.

Categorical columns turn a raw feature (see ``raw_inputs``) into ids; ``embedding_column`` and
``shared_embedding_columns`` give them an embedding table. ``EmbeddingConfigSpec`` builds the
engine's tables and features from the embedding columns and converts raw input dicts with
``column.ids(features) -> (ids [N] int64, lengths [B], weights [N] | None)``, vectorised with NumPy.

Hashing (``categorical_column_with_hash_bucket``, vocabulary OOV buckets) is ``hashing.stable_hash``:
stable across runs, processes and machines.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from embtables.config import DynamicVocabulary, Offload
from embtables.config.tables import storage_name
from embtables.errors import ConfigError, InputError
from embtables.estimator.hashing import stable_hash
from embtables.estimator.raw_inputs import flatten_values, single_lengths

Ids = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _check_key(who: str, key: object) -> None:
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{who}: `key` must be a non-empty str, got {key!r}.")


def _check_positive_int(who: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{who}: `{name}` must be an int >= 1, got {value!r}.")


def _raw(features: Mapping[str, Any], key: str, column: str) -> tuple[np.ndarray, np.ndarray]:
    if key not in features:
        raise InputError(
            f"column {column!r}: the input has no feature {key!r} (it has {sorted(features)[:10]}). Add it to the "
            "input dict or fix the column's key."
        )
    return flatten_values(features[key], key)


def _as_int_ids(values: np.ndarray, key: str) -> np.ndarray:
    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    if values.dtype.kind == "f" and np.all(np.floor(values) == values):
        return values.astype(np.int64)
    raise InputError(
        f"feature {key!r}: an identity column needs integer ids, got {values.dtype} values such as "
        f"{values[:3].tolist()!r}. Use categorical_column_with_hash_bucket or _with_vocabulary_list for strings."
    )


def _padded_int_ids(x: np.ndarray, num_buckets: int) -> Ids | None:
    """A NumPy integer column in a few array passes: 1-D (one id per row) or 2-D padded with -1 (the ids of
    each row before, between or after its -1s, in row order). None when an id other than the -1 padding is
    outside [0, num_buckets): the general conversion then drops, maps or refuses it and says which."""
    if x.ndim == 1:
        ids = x.astype(np.int64)
        if ids.min() >= 0 and ids.max() < num_buckets:  # nothing missing (-1), nothing out of range
            return ids, single_lengths(len(ids)), None
        return None
    if x.ndim != 2:
        return None
    keep = x != -1 if x.dtype.kind == "i" else np.ones(x.shape, dtype=bool)
    ids = np.compress(keep.reshape(-1), x.reshape(-1)).astype(np.int64)  # row-major: each row's ids in order
    if ids.size and (ids.min() < 0 or ids.max() >= num_buckets):
        return None
    if x.shape[1] > 32:
        return ids, keep.sum(axis=1, dtype=np.int64), None
    lengths = keep[:, 0].astype(np.int64)  # a column at a time: a row-wise sum of a few columns is ~4x slower
    for j in range(1, x.shape[1]):
        lengths += keep[:, j]
    return ids, lengths, None


@dataclasses.dataclass(frozen=True)
class IdentityCategoricalColumn:
    """Integer ids used as they are; ids outside ``[0, num_buckets)`` become ``default_value`` or raise."""

    key: str
    num_buckets: int
    default_value: int | None = None

    def __post_init__(self) -> None:
        who = f"categorical_column_with_identity({self.key!r})"
        _check_key(who, self.key)
        _check_positive_int(who, "num_buckets", self.num_buckets)
        dv = self.default_value
        if dv is not None and (isinstance(dv, bool) or not isinstance(dv, int) or not 0 <= dv < self.num_buckets):
            raise ConfigError(f"{who}: `default_value` must be None or an int in [0, {self.num_buckets}), got {dv!r}.")

    @property
    def name(self) -> str:
        return self.key

    def ids(self, features: Mapping[str, Any]) -> Ids:
        x = features.get(self.key)
        if type(x) is np.ndarray and x.dtype.kind in "iu" and x.size:  # the common columns
            fast = _padded_int_ids(x, self.num_buckets)
            if fast is not None:
                return fast
        values, lengths = _raw(features, self.key, self.name)
        ids = _as_int_ids(values, self.key)
        bad = (ids < 0) | (ids >= self.num_buckets)
        if bad.any():
            if self.default_value is None:
                raise InputError(
                    f"feature {self.key!r}: id {int(ids[bad][0])} is outside [0, {self.num_buckets}) (num_buckets of "
                    "its identity column). Fix the input, raise num_buckets, or set default_value to map such ids."
                )
            ids = np.where(bad, self.default_value, ids)
        return ids, lengths, None


@dataclasses.dataclass(frozen=True)
class SequenceIdentityCategoricalColumn(IdentityCategoricalColumn):
    """An identity column whose ids form a sequence per sample (use with ``max_sequence_length > 0``)."""

    @property
    def is_sequence(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class HashedCategoricalColumn:
    """Any values (strings or ints) hashed into ``hash_bucket_size`` buckets with ``stable_hash``; with
    ``hash_bucket_size=None`` the whole 64-bit digest is the id, a key for a dynamic table (spec §11)."""

    key: str
    hash_bucket_size: int | None

    def __post_init__(self) -> None:
        who = f"categorical_column_with_hash_bucket({self.key!r})"
        _check_key(who, self.key)
        if self.hash_bucket_size is not None:
            _check_positive_int(who, "hash_bucket_size", self.hash_bucket_size)

    @property
    def name(self) -> str:
        return self.key

    @property
    def num_buckets(self) -> int | None:
        return self.hash_bucket_size

    def ids(self, features: Mapping[str, Any]) -> Ids:
        values, lengths = _raw(features, self.key, self.name)
        return stable_hash(values, self.hash_bucket_size, self.name), lengths, None


@dataclasses.dataclass(frozen=True)
class VocabularyListCategoricalColumn:
    """Values looked up in ``vocabulary_list`` (id = position); out-of-vocabulary values go to one of
    ``num_oov_buckets`` hashed buckets after the vocabulary, or to ``default_value`` (-1: dropped)."""

    key: str
    vocabulary_list: tuple[Any, ...]
    default_value: int = -1
    num_oov_buckets: int = 0

    def __post_init__(self) -> None:
        who = f"categorical_column_with_vocabulary_list({self.key!r})"
        _check_key(who, self.key)
        vocab = tuple(self.vocabulary_list)
        if not vocab:
            raise ConfigError(f"{who}: `vocabulary_list` must not be empty.")
        if len(set(vocab)) != len(vocab):
            raise ConfigError(f"{who}: `vocabulary_list` has duplicates; each value needs one id.")
        object.__setattr__(self, "vocabulary_list", vocab)
        oov = self.num_oov_buckets
        if isinstance(oov, bool) or not isinstance(oov, int) or oov < 0:
            raise ConfigError(f"{who}: `num_oov_buckets` must be an int >= 0, got {self.num_oov_buckets!r}.")
        if self.num_oov_buckets and self.default_value != -1:
            raise ConfigError(f"{who}: set either `default_value` or `num_oov_buckets`, not both (as TF).")
        if not isinstance(self.default_value, int) or not -1 <= self.default_value < len(vocab):
            raise ConfigError(f"{who}: `default_value` must be -1 or an id in [0, {len(vocab)}).")

    @property
    def name(self) -> str:
        return self.key

    @property
    def num_buckets(self) -> int:
        return len(self.vocabulary_list) + self.num_oov_buckets

    @functools.cached_property
    def _sorted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(vocabulary array, the order that sorts it, the sorted vocabulary): built once per column."""
        vocab = np.asarray(self.vocabulary_list)
        order = np.argsort(vocab, kind="stable")
        return vocab, order, vocab[order]

    @functools.cached_property
    def _coded(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """itemsize (4 or 8) -> (sorted codes, their ids): the string vocabulary as the unsigned integers
        that NumPy's 1- and 2-character strings are, filled per width on first use."""
        return {}

    def _ids_by_code(self, x: np.ndarray) -> Ids | None:
        """A 1-D array of 1- or 2-character strings looked up as integers (one array pass each, no string
        compares). None unless every value is in the vocabulary (the general path handles the rest)."""
        size = x.dtype.itemsize
        code = np.dtype(f"<u{size}")
        got = self._coded.get(size)
        if got is None:
            width = size // 4
            fits = [(v, i) for i, v in enumerate(self.vocabulary_list) if isinstance(v, str) and 0 < len(v) <= width]
            codes = np.array([v for v, _ in fits], dtype=f"<U{width}").view(code)  # '' (missing) has code 0
            order = np.argsort(codes, kind="stable")
            got = self._coded[size] = (codes[order], np.array([i for _, i in fits], dtype=np.int64)[order])
        sorted_codes, ids_of = got
        if not len(sorted_codes):
            return None
        keys = x.view(code)
        pos = np.minimum(np.searchsorted(sorted_codes, keys), len(sorted_codes) - 1)
        if not np.array_equal(sorted_codes[pos], keys):
            return None
        return ids_of[pos], single_lengths(len(x)), None

    def ids(self, features: Mapping[str, Any]) -> Ids:
        x = features.get(self.key)
        if (
            type(x) is np.ndarray
            and x.ndim == 1
            and x.dtype.kind == "U"
            and x.dtype.itemsize in (4, 8)
            and x.dtype.byteorder in "<="
            and np.little_endian
            and x.flags.c_contiguous
            and len(x)
        ):
            fast = self._ids_by_code(x)
            if fast is not None:
                return fast
        values, lengths = _raw(features, self.key, self.name)
        vocab, order, sorted_vocab = self._sorted
        if vocab.dtype.kind in "iu":
            values = values.astype(np.int64) if values.dtype.kind in "iuf" else values
        pos = np.clip(np.searchsorted(sorted_vocab, values), 0, len(vocab) - 1)
        found = sorted_vocab[pos] == values if len(values) else np.zeros(0, dtype=bool)
        ids = np.where(found, order[pos], -1).astype(np.int64)
        oov = ~found
        if oov.any():
            if self.num_oov_buckets:
                ids[oov] = len(vocab) + stable_hash(values[oov], self.num_oov_buckets, self.name)
            else:
                ids[oov] = self.default_value
        return ids, lengths, None


@dataclasses.dataclass(frozen=True)
class NumericColumn:
    """A real-valued raw feature (``tf.feature_column.numeric_column``); here only the source of a
    ``bucketized_column`` (the dense model reads numeric features from the raw input itself)."""

    key: str

    def __post_init__(self) -> None:
        _check_key("numeric_column", self.key)

    @property
    def name(self) -> str:
        return self.key


@dataclasses.dataclass(frozen=True)
class BucketizedColumn:
    """A numeric feature cut at ``boundaries`` (sorted, strictly increasing): id 0 for values below
    ``boundaries[0]``, id i for ``boundaries[i-1] <= value < boundaries[i]``, id ``len(boundaries)`` for
    values at or above the last boundary (``tf.feature_column.bucketized_column``'s buckets)."""

    source_column: NumericColumn
    boundaries: tuple[float, ...]

    def __post_init__(self) -> None:
        who = "bucketized_column"
        if not isinstance(self.source_column, NumericColumn):
            got = type(self.source_column).__name__
            raise TypeError(f"{who}: `source_column` must be a numeric_column, got {got}.")
        try:
            bounds = tuple(float(b) for b in self.boundaries)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{who}({self.key!r}): `boundaries` must be a list of numbers ({exc}).") from exc
        if not bounds or not all(np.isfinite(bounds)) or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ConfigError(
                f"{who}({self.key!r}): `boundaries` must be a non-empty list of finite numbers in strictly increasing "
                f"order, got {list(self.boundaries)!r}."
            )
        object.__setattr__(self, "boundaries", bounds)

    @property
    def key(self) -> str:
        return self.source_column.key

    @property
    def name(self) -> str:
        return f"{self.key}_bucketized"

    @property
    def num_buckets(self) -> int:
        return len(self.boundaries) + 1

    def ids(self, features: Mapping[str, Any]) -> Ids:
        values, lengths = _raw(features, self.key, self.name)
        if values.dtype.kind not in "iuf":
            raise InputError(
                f"column {self.name!r}: feature {self.key!r} must be numbers to bucketize, got {values.dtype} values "
                f"such as {values[:3].tolist()!r}."
            )
        x = values.astype(np.float64)
        if not np.isfinite(x).all():
            raise InputError(
                f"column {self.name!r}: feature {self.key!r} has the value {x[~np.isfinite(x)][0]!r}, which falls in "
                "no bucket; fill or drop it first."
            )
        return np.searchsorted(np.asarray(self.boundaries), x, side="right").astype(np.int64), lengths, None


CategoricalColumn = (
    IdentityCategoricalColumn | HashedCategoricalColumn | VocabularyListCategoricalColumn | BucketizedColumn
)


@dataclasses.dataclass(frozen=True)
class WeightedCategoricalColumn:
    """``categorical_column`` with a float weight per id from feature ``weight_feature_key`` (same
    shape as the ids)."""

    categorical_column: CategoricalColumn
    weight_feature_key: str

    def __post_init__(self) -> None:
        if not isinstance(self.categorical_column, _CATEGORICAL):
            raise TypeError(
                "weighted_categorical_column: `categorical_column` must be a categorical column, got "
                f"{type(self.categorical_column).__name__}."
            )
        _check_key("weighted_categorical_column", self.weight_feature_key)

    @property
    def key(self) -> str:
        return self.categorical_column.key

    @property
    def name(self) -> str:
        return f"{self.categorical_column.name}_weighted_by_{self.weight_feature_key}"

    @property
    def num_buckets(self) -> int | None:
        return self.categorical_column.num_buckets

    def ids(self, features: Mapping[str, Any]) -> Ids:
        ids, lengths, _ = self.categorical_column.ids(features)
        weights, w_lengths = _raw(features, self.weight_feature_key, self.name)
        if not np.array_equal(lengths, w_lengths):
            raise InputError(
                f"column {self.name!r}: feature {self.weight_feature_key!r} must give one weight per id of "
                f"{self.key!r} (ids per sample {lengths[:5].tolist()}..., weights {w_lengths[:5].tolist()}...)."
            )
        return ids, lengths, weights.astype(np.float32)


_CATEGORICAL = (IdentityCategoricalColumn, HashedCategoricalColumn, VocabularyListCategoricalColumn, BucketizedColumn)
_ANY_CATEGORICAL = (*_CATEGORICAL, WeightedCategoricalColumn)
AnyCategoricalColumn = CategoricalColumn | WeightedCategoricalColumn


def categorical_column_with_identity(
    key: str, num_buckets: int, default_value: int | None = None
) -> IdentityCategoricalColumn:
    """Integer ids in ``[0, num_buckets)`` used as they are (``tf.feature_column`` name and arguments)."""
    return IdentityCategoricalColumn(key, num_buckets, default_value)


def sequence_categorical_column_with_identity(
    key: str, num_buckets: int, default_value: int | None = None
) -> SequenceIdentityCategoricalColumn:
    """An identity column over a sequence of ids per sample."""
    return SequenceIdentityCategoricalColumn(key, num_buckets, default_value)


def categorical_column_with_hash_bucket(key: str, hash_bucket_size: int | None) -> HashedCategoricalColumn:
    """Values hashed into ``hash_bucket_size`` ids with the module's stable hash; ``None`` keeps the whole
    64-bit digest (int64 keys for a dynamic table: ``embedding_column(..., dynamic=..., capacity=...)``)."""
    return HashedCategoricalColumn(key, hash_bucket_size)


def categorical_column_with_vocabulary_list(
    key: str, vocabulary_list: Sequence[Any], default_value: int = -1, num_oov_buckets: int = 0
) -> VocabularyListCategoricalColumn:
    """Values mapped to their position in ``vocabulary_list``."""
    return VocabularyListCategoricalColumn(key, tuple(vocabulary_list), default_value, num_oov_buckets)


def numeric_column(key: str) -> NumericColumn:
    """A real-valued feature, the source of ``bucketized_column``."""
    return NumericColumn(key)


def bucketized_column(source_column: NumericColumn, boundaries: Sequence[float]) -> BucketizedColumn:
    """``source_column``'s values as ``len(boundaries) + 1`` bucket ids (TF's bucket rule)."""
    return BucketizedColumn(source_column, tuple(boundaries))


def weighted_categorical_column(
    categorical_column: CategoricalColumn, weight_feature_key: str
) -> WeightedCategoricalColumn:
    """Ids of ``categorical_column`` weighted by the values of ``weight_feature_key``."""
    return WeightedCategoricalColumn(categorical_column, weight_feature_key)


def _is_sequence_column(column: object) -> bool:
    inner = column.categorical_column if isinstance(column, WeightedCategoricalColumn) else column
    return isinstance(inner, SequenceIdentityCategoricalColumn)


_COMBINERS = ("mean", "sum", "sqrtn")


def _check_embedding_args(who: str, dimension: object, combiner: object, max_sequence_length: object) -> None:
    _check_positive_int(who, "dimension", dimension)
    if combiner not in _COMBINERS:
        raise ConfigError(f"{who}: `combiner` must be one of {_COMBINERS}, got {combiner!r}.")
    if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int) or max_sequence_length < 0:
        raise ConfigError(f"{who}: `max_sequence_length` must be an int >= 0, got {max_sequence_length!r}.")


@dataclasses.dataclass(frozen=True)
class EmbeddingColumn:
    """A categorical column with its own table (``tf.tpu.experimental.embedding_column``)."""

    categorical_column: AnyCategoricalColumn
    dimension: int
    combiner: str = "mean"
    initializer: Callable[..., Any] | None = None
    max_sequence_length: int = 0
    learning_rate_fn: Callable[[int], float] | None = None
    dynamic: DynamicVocabulary | None = None
    capacity: int | None = None
    dtype: Any = None
    slot_dtype: Any = None
    offload: Offload | None = None

    def __post_init__(self) -> None:
        who = "embedding_column"
        if self.offload is not None and not isinstance(self.offload, Offload):
            got = type(self.offload).__name__
            raise ConfigError(f"{who}: `offload` must be an embtables.Offload or None, got {got}.")
        for arg in ("dtype", "slot_dtype"):
            value = getattr(self, arg)
            if value is not None and storage_name(value) is None:
                raise ConfigError(
                    f"{who}: `{arg}` must be torch.float32, torch.bfloat16 or torch.float16 (or None: float32), "
                    f"got {value!r}."
                )
        if not isinstance(self.categorical_column, _ANY_CATEGORICAL):
            raise TypeError(
                f"{who}: `categorical_column` must be a categorical column (categorical_column_with_*, "
                f"weighted_categorical_column), got {type(self.categorical_column).__name__}."
            )
        _check_embedding_args(who, self.dimension, self.combiner, self.max_sequence_length)
        if _is_sequence_column(self.categorical_column) and self.max_sequence_length == 0:
            raise ConfigError(
                f"{who}({self.categorical_column.name!r}): a sequence column needs max_sequence_length > 0 (the "
                "activation is [B, max_sequence_length, dimension])."
            )
        if self.learning_rate_fn is not None and not callable(self.learning_rate_fn):
            raise ConfigError(f"{who}: `learning_rate_fn` must be a callable global_step -> float or None.")
        if self.dynamic is not None and not isinstance(self.dynamic, DynamicVocabulary):
            raise ConfigError(f"{who}: `dynamic` must be an embtables.DynamicVocabulary or None.")
        if self.capacity is not None:
            _check_positive_int(who, "capacity", self.capacity)
            if self.dynamic is None:
                raise ConfigError(f"{who}: `capacity` is the row count of a dynamic table; pass `dynamic=` too.")
        if self.categorical_column.num_buckets is None and (self.dynamic is None or self.capacity is None):
            raise ConfigError(
                f"{who}({self.categorical_column.name!r}): the column has no bucket count (hash_bucket_size=None: "
                "64-bit keys), so it needs a dynamic table: pass dynamic=embtables.DynamicVocabulary(...) and "
                "capacity=<rows>."
            )

    @property
    def vocabulary_size(self) -> int:
        """The table's rows: ``capacity`` when given, else the column's bucket count."""
        size = self.capacity if self.capacity is not None else self.categorical_column.num_buckets
        assert size is not None  # checked at construction
        return size

    @property
    def name(self) -> str:
        """The feature name of the activation (TF's column name)."""
        return f"{self.categorical_column.name}_embedding"

    @property
    def table_name(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class SharedEmbeddingColumn(EmbeddingColumn):
    """One of several columns sharing one table (``shared_embedding_columns``)."""

    shared_embedding_collection_name: str = ""

    @property
    def name(self) -> str:
        return f"{self.categorical_column.name}_shared_embedding"

    @property
    def table_name(self) -> str:
        return self.shared_embedding_collection_name


def embedding_column(
    categorical_column: AnyCategoricalColumn,
    dimension: int,
    combiner: str = "mean",
    initializer: Callable[..., Any] | None = None,
    max_sequence_length: int = 0,
    learning_rate_fn: Callable[[int], float] | None = None,
    *,
    dynamic: DynamicVocabulary | None = None,
    capacity: int | None = None,
    dtype: Any = None,
    slot_dtype: Any = None,
    offload: Offload | None = None,
) -> EmbeddingColumn:
    """An embedding of ``categorical_column``: a table of ``num_buckets`` x ``dimension``. A sequence
    column (``max_sequence_length > 0``) gives ``[B, max_sequence_length, dimension]``, else
    ``[B, dimension]`` combined with ``combiner``. ``learning_rate_fn(global_step)`` overrides the
    optimizer's learning rate for this table. ``dynamic`` makes the table keyed by the column's ids
    (spec §11), with ``capacity`` rows (default: the column's bucket count; required for
    ``categorical_column_with_hash_bucket(key, None)``). ``dtype`` / ``slot_dtype``: the table's rows and
    slots in half precision (``TableConfig``'s arguments, spec §12). ``offload``: the table's rows in files
    with a row cache (``TableConfig``'s argument, docs/offload.md)."""
    return EmbeddingColumn(
        categorical_column, dimension, combiner, initializer, max_sequence_length, learning_rate_fn, dynamic, capacity,
        dtype, slot_dtype, offload,
    )  # fmt: skip


def shared_embedding_columns(
    categorical_columns: Sequence[AnyCategoricalColumn],
    dimension: int,
    combiner: str = "mean",
    initializer: Callable[..., Any] | None = None,
    shared_embedding_collection_name: str | None = None,
    max_sequence_lengths: Sequence[int] | None = None,
    learning_rate_fn: Callable[[int], float] | None = None,
    *,
    dtype: Any = None,
    slot_dtype: Any = None,
    offload: Offload | None = None,
) -> list[SharedEmbeddingColumn]:
    """One table shared by every column of ``categorical_columns`` (same ``num_buckets``), one
    activation per column; ``dtype`` / ``slot_dtype`` / ``offload`` as ``embedding_column``'s."""
    columns = list(categorical_columns)
    if not columns:
        raise ConfigError("shared_embedding_columns: `categorical_columns` must not be empty.")
    for c in columns:
        if not isinstance(c, _ANY_CATEGORICAL):
            raise TypeError(f"shared_embedding_columns: every column must be categorical, got {type(c).__name__}.")
    sizes = {c.num_buckets for c in columns}
    if len(sizes) != 1:
        raise ConfigError(
            "shared_embedding_columns: the columns share one table, so they need the same num_buckets, got "
            + ", ".join(f"{c.name}={c.num_buckets}" for c in columns)
            + "."
        )
    lengths = list(max_sequence_lengths) if max_sequence_lengths is not None else [0] * len(columns)
    if len(lengths) != len(columns):
        raise ConfigError(
            f"shared_embedding_columns: `max_sequence_lengths` has {len(lengths)} entries for {len(columns)} columns."
        )
    name = shared_embedding_collection_name or "_".join(sorted(c.name for c in columns)) + "_shared_embedding"
    return [
        SharedEmbeddingColumn(
            c,
            dimension,
            combiner,
            initializer,
            m,
            learning_rate_fn,
            None,
            None,
            dtype,
            slot_dtype,
            offload,
            shared_embedding_collection_name=name,
        )
        for c, m in zip(columns, lengths)
    ]


EMBEDDING_COLUMN_TYPES = (EmbeddingColumn, SharedEmbeddingColumn)
