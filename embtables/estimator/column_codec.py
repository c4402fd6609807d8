"""Feature columns to JSON and back, for a model artifact (``model_artifact``).

What is written is what turns raw features into the engine's ids: each embedding column's categorical column
(identity, sequence identity, hash, vocabulary list, bucketized, weighted) and its activation's shape (dimension,
combiner, max_sequence_length, the shared table's name, a dynamic table's capacity). Nothing that only training
uses (initializers, learning rates, storage types, offload) is written: the artifact's tables carry the trained
rows. Reading validates every entry through the columns' own constructors, so a malformed file is a
``ValueError`` naming the entry, never a column that converts differently.
"""

from __future__ import annotations

from typing import Any

from embtables.config import DynamicVocabulary
from embtables.estimator.feature_columns import (
    BucketizedColumn,
    EmbeddingColumn,
    HashedCategoricalColumn,
    IdentityCategoricalColumn,
    NumericColumn,
    SequenceIdentityCategoricalColumn,
    SharedEmbeddingColumn,
    VocabularyListCategoricalColumn,
    WeightedCategoricalColumn,
)

_JSON_SCALARS = (str, int, float, bool)


def _categorical_to_json(c: Any) -> dict[str, Any]:
    if isinstance(c, SequenceIdentityCategoricalColumn):
        return {
            "type": "sequence_identity",
            "key": c.key,
            "num_buckets": c.num_buckets,
            "default_value": c.default_value,
        }
    if isinstance(c, IdentityCategoricalColumn):
        return {"type": "identity", "key": c.key, "num_buckets": c.num_buckets, "default_value": c.default_value}
    if isinstance(c, HashedCategoricalColumn):
        return {"type": "hash", "key": c.key, "hash_bucket_size": c.hash_bucket_size}
    if isinstance(c, VocabularyListCategoricalColumn):
        vocab = [v.item() if hasattr(v, "item") else v for v in c.vocabulary_list]  # NumPy scalars as Python's
        if not all(isinstance(v, _JSON_SCALARS) for v in vocab):
            bad = next(v for v in vocab if not isinstance(v, _JSON_SCALARS))
            raise TypeError(f"column {c.key!r}: a vocabulary value {bad!r} has no JSON form; use str or int values.")
        return {
            "type": "vocabulary", "key": c.key, "vocabulary_list": vocab, "default_value": c.default_value,
            "num_oov_buckets": c.num_oov_buckets,
        }  # fmt: skip
    if isinstance(c, BucketizedColumn):
        return {"type": "bucketized", "key": c.key, "boundaries": list(c.boundaries)}
    if isinstance(c, WeightedCategoricalColumn):
        return {
            "type": "weighted", "categorical_column": _categorical_to_json(c.categorical_column),
            "weight_feature_key": c.weight_feature_key,
        }  # fmt: skip
    raise TypeError(f"a model artifact cannot describe a column of type {type(c).__name__}.")


def columns_to_json(columns: list[Any]) -> list[dict[str, Any]]:
    """The embedding columns as JSON-able dicts (see the module's docstring for what is kept)."""
    out = []
    for c in columns:
        entry: dict[str, Any] = {
            "categorical_column": _categorical_to_json(c.categorical_column), "dimension": c.dimension,
            "combiner": c.combiner, "max_sequence_length": c.max_sequence_length,
        }  # fmt: skip
        if isinstance(c, SharedEmbeddingColumn):
            entry["shared_embedding_collection_name"] = c.shared_embedding_collection_name
        if c.dynamic is not None:
            entry["capacity"] = c.vocabulary_size
        out.append(entry)
    return out


def _categorical_from_json(doc: Any) -> Any:
    if not isinstance(doc, dict):
        raise TypeError(f"a categorical column must be an object, got {type(doc).__name__}")
    kind = doc.get("type")
    if kind in ("identity", "sequence_identity"):
        cls = IdentityCategoricalColumn if kind == "identity" else SequenceIdentityCategoricalColumn
        return cls(doc["key"], doc["num_buckets"], doc.get("default_value"))
    if kind == "hash":
        return HashedCategoricalColumn(doc["key"], doc["hash_bucket_size"])
    if kind == "vocabulary":
        vocab = doc["vocabulary_list"]
        if not isinstance(vocab, list) or not all(isinstance(v, _JSON_SCALARS) for v in vocab):
            raise TypeError("vocabulary_list must be a list of strings or numbers")
        return VocabularyListCategoricalColumn(doc["key"], tuple(vocab), doc["default_value"], doc["num_oov_buckets"])
    if kind == "bucketized":
        bounds = doc["boundaries"]
        if not isinstance(bounds, list):
            raise TypeError("boundaries must be a list")
        return BucketizedColumn(NumericColumn(doc["key"]), tuple(bounds))
    if kind == "weighted":
        return WeightedCategoricalColumn(_categorical_from_json(doc["categorical_column"]), doc["weight_feature_key"])
    raise ValueError(f"unknown column type {kind!r:.40}")


def columns_from_json(doc: Any, where: str) -> list[EmbeddingColumn]:
    """The embedding columns ``columns_to_json`` wrote; ``ValueError`` naming ``where`` and the entry when the
    document is malformed."""
    if not isinstance(doc, list) or not doc:
        raise ValueError(f"{where}: `columns` must be a non-empty list.")
    out: list[EmbeddingColumn] = []
    for i, entry in enumerate(doc):
        try:
            if not isinstance(entry, dict):
                raise TypeError(f"an object, got {type(entry).__name__}")
            cat = _categorical_from_json(entry["categorical_column"])
            args = (entry["dimension"], entry["combiner"], None, entry["max_sequence_length"], None)
            capacity = entry.get("capacity")
            dynamic = None if capacity is None else DynamicVocabulary()
            shared = entry.get("shared_embedding_collection_name")
            if shared is not None:
                if not isinstance(shared, str) or not shared:
                    raise TypeError("shared_embedding_collection_name must be a non-empty string")
                out.append(
                    SharedEmbeddingColumn(cat, *args, dynamic, capacity, shared_embedding_collection_name=shared)
                )
            else:
                out.append(EmbeddingColumn(cat, *args, dynamic, capacity))
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            raise ValueError(f"{where}: column {i} is malformed ({type(exc).__name__}: {exc}).") from None
    return out


__all__ = ["columns_from_json", "columns_to_json"]
