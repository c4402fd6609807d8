"""Float64 NumPy reference for lookups, combiners and per-occurrence gradients.

Follows docs/spec.md sections 2.1 (combiners, quantization, backward), 2.2 (input types, sequence
features) and 10.5 (id and weight validation).

A feature input is ``ids: list[list[int]]`` (one list per sample, B samples) and
``weights: list[list[float]] | None`` of the same ragged shape (None = every weight is 1.0).
"""

from __future__ import annotations

import math

import numpy as np

from .np_subnormals import flush

Ids = list[list[int]]
Weights = list[list[float]] | None
Quantization = tuple[int, float, float] | None

COMBINERS: tuple[str, ...] = ("sum", "mean", "sqrtn")


def kept_occurrences(
    ids: Ids,
    weights: Weights,
    validate: bool,
    is_sequence: bool,
    vocab_size: int | None = None,
) -> list[list[tuple[int, int, float]]]:
    """Per sample, the kept occurrences as ``(position k in the sample's original list, id, weight)``.

    spec §10.5 and 2.2:
    - weights must have the same ragged shape as ids; a sequence feature must have no weights;
    - every weight must be finite, and every id must be < vocab_size (checked on ALL occurrences,
      before any dropping, so a bad id/weight raises even where it would otherwise be dropped);
    - validate=True drops occurrences with id < 0 or weight <= 0 (safe_embedding_lookup_sparse);
    - validate=False raises on a negative id and keeps every weight (including weights <= 0).
    """
    if weights is not None:
        if is_sequence:
            raise ValueError("weights specified for a sequence feature")  # spec §2.2
        if len(weights) != len(ids):
            raise ValueError("weights and ids have different numbers of samples")
        for b in range(len(ids)):
            if len(weights[b]) != len(ids[b]):
                raise ValueError(f"sample {b}: weights and ids have different lengths")

    kept: list[list[tuple[int, int, float]]] = []
    for b in range(len(ids)):
        sample: list[tuple[int, int, float]] = []
        for k in range(len(ids[b])):
            row_id = int(ids[b][k])
            weight = 1.0 if weights is None else float(weights[b][k])
            if not math.isfinite(weight):
                raise ValueError(f"sample {b} position {k}: weight {weight} is not finite")
            if vocab_size is not None and row_id >= vocab_size:
                raise ValueError(f"sample {b} position {k}: id {row_id} out of range [0, {vocab_size})")
            if row_id < 0:
                if validate:
                    continue  # dropped
                raise ValueError(f"sample {b} position {k}: negative id {row_id}")
            if validate and weight <= 0.0:
                continue  # dropped
            sample.append((k, row_id, weight))
        kept.append(sample)
    return kept


def combiner_scale(combiner: str, sample_weights: list[float]) -> float:
    """spec §2.1: s_b for one sample from its kept weights; 0 when the denominator is 0."""
    if combiner == "sum":
        return 1.0
    if combiner == "mean":
        denominator = 0.0
        for w in sample_weights:
            denominator += flush(w)
        return 0.0 if denominator == 0.0 else 1.0 / denominator
    if combiner == "sqrtn":
        sum_sq = 0.0
        for w in sample_weights:
            sum_sq += flush(flush(w) * flush(w))
        denominator = math.sqrt(sum_sq)
        return 0.0 if denominator == 0.0 else 1.0 / denominator
    raise ValueError(f"unknown combiner {combiner!r}; expected one of {COMBINERS}")


def quantize(x: np.ndarray, quantization: Quantization) -> np.ndarray:
    """spec §2.1 simulated quantization of one looked-up row value (identity when quantization is None)."""
    if quantization is None:
        return np.array(x, dtype=np.float64)
    num_buckets, lower, upper = quantization
    if num_buckets < 2:
        raise ValueError(f"num_buckets must be >= 2, got {num_buckets}")
    lower = float(lower)
    upper = float(upper)
    x = np.minimum(np.maximum(np.asarray(x, dtype=np.float64), lower), upper)
    q = (upper - lower) / (num_buckets - 1)
    return np.floor((x - lower) / q + 0.5) * q + lower


def lookup(
    table: np.ndarray,
    ids: Ids,
    weights: Weights,
    combiner: str,
    max_sequence_length: int = 0,
    validate: bool = True,
    quantization: Quantization = None,
) -> np.ndarray:
    """Activations of one feature: [B, D] pooled (max_sequence_length == 0) or [B, M, D] sequence."""
    table = flush(table)  # spec §1.5: subnormal rows read as zero, subnormal activations written as zero
    V, D = table.shape
    B = len(ids)
    M = int(max_sequence_length)
    if combiner not in COMBINERS:
        raise ValueError(f"unknown combiner {combiner!r}; expected one of {COMBINERS}")
    kept = kept_occurrences(ids, weights, validate, is_sequence=M > 0, vocab_size=V)

    if M > 0:
        # spec §2.2 sequence feature: position j is the plain lookup of the id at column j of the input;
        # columns >= M are truncated, missing (or dropped) positions are zero vectors, no combiner.
        out = np.zeros((B, M, D), dtype=np.float64)
        for b in range(B):
            for k, row_id, _ in kept[b]:
                if k < M:
                    out[b, k] = quantize(table[row_id], quantization)
        return flush(out)

    # spec §2.1 pooled feature: a_b = s_b * sum_k w_k * T[id_k]; zero vector when the denominator is 0.
    out = np.zeros((B, D), dtype=np.float64)
    for b in range(B):
        s_b = combiner_scale(combiner, [w for _, _, w in kept[b]])
        total = np.zeros(D, dtype=np.float64)
        for _, row_id, w in kept[b]:
            total = flush(total + flush(flush(s_b * flush(w)) * quantize(table[row_id], quantization)))
        out[b] = total
    return out


def occurrences(
    ids: Ids,
    weights: Weights,
    combiner: str,
    max_sequence_length: int,
    grad_out: np.ndarray,
    validate: bool = True,
    vocab_size: int | None = None,
) -> list[tuple[int, int, int, np.ndarray]]:
    """Every kept occurrence as ``(sample b, position k, row id, gradient (D,))``, sample-major then position.

    Pooled (spec §2.1 backward): the gradient is s_b * w_k * g_b, with s_b a constant (no gradient through the
    weights). The quantization is straight-through, so it plays no part here.
    Sequence (spec §2.2): the gradient of position k < M is grad_out[b, k]; truncated positions (k >= M)
    contribute nothing. ``grad_out`` is [B, D] (pooled) or [B, M, D] (sequence).
    ``vocab_size`` (optional) turns on the id >= vocab_size check of spec §10.5.
    """
    grad_out = np.asarray(grad_out, dtype=np.float64)
    B = len(ids)
    M = int(max_sequence_length)
    if combiner not in COMBINERS:
        raise ValueError(f"unknown combiner {combiner!r}; expected one of {COMBINERS}")
    if M > 0:
        if grad_out.ndim != 3 or grad_out.shape[0] != B or grad_out.shape[1] != M:
            raise ValueError(f"sequence grad_out must have shape [{B}, {M}, D], got {grad_out.shape}")
    elif grad_out.ndim != 2 or grad_out.shape[0] != B:
        raise ValueError(f"pooled grad_out must have shape [{B}, D], got {grad_out.shape}")
    kept = kept_occurrences(ids, weights, validate, is_sequence=M > 0, vocab_size=vocab_size)

    result: list[tuple[int, int, int, np.ndarray]] = []
    for b in range(B):
        if M > 0:
            for k, row_id, _ in kept[b]:
                if k < M:
                    result.append((b, k, row_id, grad_out[b, k].copy()))
        else:
            s_b = combiner_scale(combiner, [w for _, _, w in kept[b]])
            for k, row_id, w in kept[b]:
                result.append((b, k, row_id, flush(flush(s_b * flush(w)) * flush(grad_out[b]))))
    return result
