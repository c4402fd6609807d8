"""Turn one feature's input (dense, sparse COO, Ragged, nested jagged, KeyedJaggedTensor) into a
canonical ``FeatureBatch``, applying every input rule of spec §2.2 and 10.5.

Canonical form: ``ids`` [N] int64, a non-decreasing segment index ``seg`` [N] into S output rows,
``offsets`` [S+1] and per-id coefficients ``coeffs`` [N] (``s_b * w_k``; None means all 1), plus
the output shape (without D). Pooled samples, sequence positions and dense elements are all
segments, so one lookup kernel and one gradient rule serve every input type.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
from torch import Tensor

from embtables.config import Combiner, ResolvedFeature, ResolvedTable
from embtables.errors import InputError
from embtables.kernels import native, native_inputs
from embtables.kernels.native_step import StagedBags
from embtables.kernels.segments import offsets_from_segments, segment_sum, segments_from_offsets
from embtables.kernels.subnormals import flush
from embtables.tables.ragged import Ragged

logger = logging.getLogger("embtables")

# uint16/uint32 convert to int64 exactly; uint64 can hold ids above 2**63 - 1 that no table can have.
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32)


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureBatch:
    """One feature's batch in canonical form (see module docstring)."""

    ids: Tensor
    offsets: Tensor
    coeffs: Tensor | None
    out_shape: tuple[int, ...]
    seg_: Tensor | None = None
    dropped: int = 0  # ids of the input not looked up: negative, weight <= 0, or past max_sequence_length
    weights: Tensor | None = None  # [N]: a dynamic table's input weights, to combine over admitted keys (§11)
    staged: StagedBags | None = None  # every feature's bags staged in one native call (it holds this batch's views)
    # the GPU's deferred staging: negative ids left in place as -1 (coefficient 0), which every GPU kernel
    # skips, and not counted in ``dropped``
    dropped_in_place: bool = False

    @property
    def num_segments(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def seg(self) -> Tensor:
        """The segment index of every id [N], derived from ``offsets`` on first use (the native
        kernels need only the offsets, so the common path never builds it)."""
        if self.seg_ is None:
            object.__setattr__(self, "seg_", segments_from_offsets(self.offsets, self.ids.numel()))
        assert self.seg_ is not None
        return self.seg_

    def sample_index(self) -> Tensor:
        """The sample (leading output index) of every id [N]; segments are row-major over out_shape."""
        if not self.out_shape or self.num_segments == 0:
            return torch.zeros_like(self.ids)
        return torch.div(self.seg, self.num_segments // self.out_shape[0], rounding_mode="floor")


@dataclasses.dataclass(frozen=True, eq=False)
class _Jagged:
    """Intermediate form of every non-dense input: values [N] in row-major order with their row
    (flattened leading index) and column (position inside the row)."""

    values: Tensor
    lead_shape: tuple[int, ...]
    weights: Tensor | None
    splits: Tensor | None = None  # [B+1] for ragged-like inputs; rows/cols then derive from it
    rows_: Tensor | None = None
    cols_: Tensor | None = None

    def rows_cols(self) -> tuple[Tensor, Tensor]:
        if self.rows_ is None or self.cols_ is None:
            assert self.splits is not None
            rows = segments_from_offsets(self.splits)
            cols = torch.arange(self.values.numel(), device=self.values.device) - self.splits[rows]
            object.__setattr__(self, "rows_", rows)
            object.__setattr__(self, "cols_", cols)
        assert self.rows_ is not None and self.cols_ is not None
        return self.rows_, self.cols_


def is_kjt(x: object) -> bool:
    """Duck-typed check for a TorchRec ``KeyedJaggedTensor`` (no torchrec import)."""
    return all(hasattr(x, a) for a in ("keys", "values", "lengths", "weights_or_none", "stride"))


def split_kjt(kjt: Any) -> dict[str, tuple[Ragged, Ragged | None]]:
    """A KeyedJaggedTensor as ``{key: (ids, weights or None)}`` with one Ragged per key.

    Keys must be distinct. A variable-batch KJT (``variable_stride_per_key()``) is split with each
    key's own batch size (``stride_per_key()``); the lengths must add up to exactly that."""
    keys = list(kjt.keys())
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise InputError(
            f"the KeyedJaggedTensor has duplicate keys {duplicates}; each key must appear once (the values of a "
            "repeated key would be ambiguous). Merge the ids of a repeated key into one entry."
        )
    lengths = kjt.lengths().to(torch.int64)
    values = kjt.values()
    weights = kjt.weights_or_none()
    variable = bool(getattr(kjt, "variable_stride_per_key", lambda: False)())
    strides = [int(s) for s in kjt.stride_per_key()] if variable else [int(kjt.stride())] * len(keys)
    if len(strides) != len(keys) or sum(strides) != lengths.numel():
        raise InputError(
            f"the KeyedJaggedTensor has {lengths.numel()} lengths for keys {keys} with batch sizes {strides} "
            f"(sum {sum(strides)}); they must match. For a different batch size per key build the KJT with "
            "stride_per_key_per_rank (variable batch)."
        )
    if int(lengths.sum()) != values.numel() or bool((lengths < 0).any()):
        raise InputError(
            f"the KeyedJaggedTensor's lengths sum to {int(lengths.sum())} but it holds {values.numel()} values "
            "(or a length is negative); they must match."
        )
    out: dict[str, tuple[Ragged, Ragged | None]] = {}
    start = 0
    first = 0
    for key, stride in zip(keys, strides):
        lens = lengths[first : first + stride]
        first += stride
        n = int(lens.sum().item())
        ids = Ragged.from_lengths(values[start : start + n], lens)
        w = None if weights is None else Ragged(weights[start : start + n], ids.row_splits)
        out[key] = (ids, w)
        start += n
    return out


class InputConverter:
    """Converts inputs of one feature; holds what the rules need (names, V, combiner, M)."""

    def __init__(self, feature: ResolvedFeature, table: ResolvedTable) -> None:
        self.feature = feature
        self.table = table
        self.who = f"feature {feature.name!r} (table {table.name!r})"
        cfg = feature.config
        # for convert_many's fast path: may unweighted ids take it, and (V, combiner code) when they do
        self.dynamic = table.config.dynamic is not None  # ids are keys: any int64 (spec §11)
        self.fast_path = not cfg.is_sequence and cfg.output_shape is None
        # (V, combiner code) for the native staging; V = 0 checks no range (a dynamic table's keys)
        code = native_inputs.COMBINER_CODES[table.config.combiner]
        self.fast_part = (0 if self.dynamic else table.vocabulary_size, code)

    def fail(self, rule: str, fix: str, exc: type[Exception] = InputError) -> Exception:
        return exc(f"{self.who}: {rule} {fix}")

    # ------------------------------------------------------------------ parsing per input type
    def _check_ids_dtype(self, values: Tensor, what: str) -> None:
        if values.dtype == torch.uint64:
            raise self.fail(
                f"{what} have dtype torch.uint64, which can hold ids above 2**63 - 1 that no table has.",
                "Cast the ids to int64 (ids.to(torch.int64)) after checking they are below vocabulary_size.",
                TypeError,
            )
        if values.dtype not in _INT_DTYPES:
            raise self.fail(
                f"{what} must have an integer dtype, got {values.dtype}.",
                "Cast the ids with .long().",
                TypeError,
            )

    def _ragged_parts(self, x: Ragged, what: str) -> tuple[Tensor, Tensor]:
        if not isinstance(x.values, Tensor) or not isinstance(x.row_splits, Tensor):
            raise self.fail(f"{what}: Ragged.values and Ragged.row_splits must be tensors.", "", TypeError)
        if x.values.dim() != 1 or x.row_splits.dim() != 1 or x.row_splits.numel() < 1:
            raise self.fail(
                f"{what}: Ragged needs 1-D values and 1-D row_splits of length B+1, got shapes "
                f"{tuple(x.values.shape)} and {tuple(x.row_splits.shape)}.",
                "Build it with Ragged.from_lengths(values, lengths).",
            )
        if x.row_splits.dtype not in _INT_DTYPES:
            raise self.fail(f"{what}: row_splits must be integers, got {x.row_splits.dtype}.", "", TypeError)
        splits = x.row_splits.to(torch.int64)
        n = x.values.numel()
        if int(splits[0]) != 0 or int(splits[-1]) != n or bool((splits[1:] < splits[:-1]).any()):
            raise self.fail(
                f"{what}: row_splits must start at 0, never decrease and end at len(values)={n}, got "
                f"{splits.tolist()[:8]}{'...' if splits.numel() > 8 else ''}.",
                "Build it with Ragged.from_lengths(values, lengths).",
            )
        return x.values, splits

    def _as_ragged(self, x: Any, what: str) -> Ragged | None:
        """Nested jagged tensors and single-key KJTs become Ragged; other inputs give None."""
        if isinstance(x, Ragged):
            return x
        if isinstance(x, Tensor) and x.is_nested:
            if x.dim() != 2:
                raise self.fail(f"{what}: a nested tensor must be 2-D [B, j], got {x.dim()}-D.", "")
            if x.layout == torch.jagged:
                values, offsets = x.values(), x.offsets()  # type: ignore[attr-defined]
                lengths = x.lengths()  # type: ignore[attr-defined]
                if lengths is None:
                    return Ragged(values, offsets)
                # A narrowed view ("holes"): row b is values[offsets[b] : offsets[b] + lengths[b]] only.
                lengths = lengths.to(torch.int64)
                starts = offsets[: lengths.numel()].to(torch.int64)
                if bool((lengths < 0).any()) or bool((starts + lengths > values.numel()).any()):
                    raise self.fail(f"{what}: the nested tensor's offsets and lengths point outside its values.", "")
                seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
                base = torch.repeat_interleave(starts - torch.cumsum(lengths, 0) + lengths, lengths)
                index = base + torch.arange(seg.numel(), device=lengths.device)
                return Ragged.from_lengths(values[index], lengths)
            parts = list(x.unbind())
            lengths = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
            values = torch.cat(parts) if parts else torch.zeros(0, dtype=x.dtype)
            return Ragged.from_lengths(values, lengths)
        return None

    def _jagged(self, x: Any, w: Any) -> _Jagged:
        """Parse any non-dense input (and its weights) into a ``_Jagged``."""
        if isinstance(x, Tensor) and x.layout == torch.sparse_coo:
            return self._from_sparse(x, w)
        rx = self._as_ragged(x, "ids")
        if rx is None:
            raise self.fail(
                f"unsupported input type {type(x).__name__}.",
                "Pass a dense integer Tensor, a 2-D torch.sparse_coo_tensor, an embtables.Ragged, a "
                "torch.nested jagged tensor or a TorchRec KeyedJaggedTensor.",
                TypeError,
            )
        values, splits = self._ragged_parts(rx, "ids")
        self._check_ids_dtype(values, "ids")
        weights = None
        if w is not None:
            rw = self._as_ragged(w, "weights")
            if rw is None:
                raise self.fail(
                    f"weights must be the same kind as the ids ({type(x).__name__}), got {type(w).__name__}.",
                    "Pass weights as a Ragged/nested tensor with the ids' row_splits.",
                )
            wv, wsplits = self._ragged_parts(rw, "weights")
            if wsplits.shape != splits.shape or not torch.equal(wsplits.cpu(), splits.cpu()):
                raise self.fail(
                    "weights must have exactly the row_splits of the ids.",
                    "Build ids and weights with the same lengths.",
                )
            weights = wv
        return _Jagged(values, (splits.numel() - 1,), weights, splits=splits)

    def _from_sparse(self, x: Tensor, w: Any) -> _Jagged:
        if x.dense_dim() != 0 or x.sparse_dim() < 2:
            raise self.fail(
                f"a sparse input must be a sparse_coo_tensor of rank >= 2 with scalar values, got sparse_dim="
                f"{x.sparse_dim()}, dense_dim={x.dense_dim()}.",
                "Use shape [B, L] (batch, position).",
            )
        self._check_ids_dtype(x._values(), "ids")
        shape = tuple(int(d) for d in x.shape)
        order, linear = self._sparse_order(x, "ids")
        values = x._values()[order]
        weights = None
        if w is not None:
            if not (isinstance(w, Tensor) and w.layout == torch.sparse_coo) or tuple(w.shape) != shape:
                raise self.fail(
                    "weights for a sparse input must be a sparse_coo_tensor with the same shape and indices.",
                    f"Got {type(w).__name__} of shape {tuple(getattr(w, 'shape', ()))} for ids of shape {shape}.",
                )
            worder, wlinear = self._sparse_order(w, "weights")
            if not torch.equal(wlinear, linear):
                raise self.fail(
                    "weights for a sparse input must have exactly the indices of the ids.",
                    "Build both sparse tensors from the same indices.",
                )
            weights = w._values()[worder]
        last = shape[-1]
        rows = torch.div(linear, last, rounding_mode="floor")
        cols = linear - rows * last
        if len(shape) > 2 and self.feature.config.is_sequence:
            logger.warning(
                "%s: max_sequence_length is ignored for a rank-%d sparse input; it is combined over its last dim.",
                self.who,
                len(shape),
            )
        return _Jagged(values, shape[:-1], weights, rows_=rows, cols_=cols)

    def _sparse_order(self, x: Tensor, what: str) -> tuple[Tensor, Tensor]:
        """Row-major order of a COO tensor's entries; raises on duplicate indices."""
        idx = x._indices()
        shape = tuple(int(d) for d in x.shape)
        if idx.numel():
            limits = torch.tensor(shape, dtype=idx.dtype, device=idx.device).unsqueeze(1)
            outside = (idx < 0) | (idx >= limits)
            if bool(outside.any()):
                k = int(torch.nonzero(outside.any(0))[0, 0])
                raise self.fail(
                    f"the sparse {what} tensor has index {idx[:, k].tolist()} outside its shape {list(shape)} "
                    "(torch does not check this by default).",
                    "Fix the indices, or build the tensor with check_invariants=True to catch this at creation.",
                )
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        linear = sum((idx[i] * strides[i] for i in range(len(shape))), torch.zeros_like(idx[0]))
        linear_sorted, order = torch.sort(linear, stable=True)
        if linear_sorted.numel() > 1 and bool((linear_sorted[1:] == linear_sorted[:-1]).any()):
            raise self.fail(
                f"the sparse {what} tensor has duplicate indices (two values at one [row, position]).",
                "Give each position one id; to count an id twice, put it at two positions.",
            )
        return order, linear_sorted

    # ------------------------------------------------------------------ the rules
    def convert(self, x: Any, w: Any, device: torch.device) -> FeatureBatch:
        """Validate and convert ``x`` (and weights ``w``) for this feature, on ``device``."""
        if is_kjt(x):
            if len(list(x.keys())) != 1:
                raise self.fail(
                    f"a KeyedJaggedTensor given for one feature must have exactly one key, got {list(x.keys())}.",
                    "Pass the whole KeyedJaggedTensor as `features` (feature_config must then be a dict keyed "
                    "by the KJT's keys), or one single-key KJT per feature.",
                )
            if w is not None:
                raise self.fail(
                    "weights were given separately for a KeyedJaggedTensor input.",
                    "Put them in the KJT (its `weights`).",
                )
            x, w = next(iter(split_kjt(x).values()))
        if isinstance(x, Tensor) and not x.is_nested and x.layout == torch.strided:
            dense = self._convert_dense(x, w, device)
            return (
                dense
                if dense.ids.numel() == x.numel()
                else dataclasses.replace(dense, dropped=x.numel() - dense.ids.numel())
            )
        j = self._jagged(x, w)
        out = self._convert_jagged(j, device)
        n = j.values.numel()
        return out if out.ids.numel() == n else dataclasses.replace(out, dropped=n - out.ids.numel())

    def _convert_jagged(self, j: _Jagged, device: torch.device) -> FeatureBatch:
        cfg = self.feature.config
        values = j.values.to(device=device, dtype=torch.int64)
        weights = None if j.weights is None else self._check_weights(j.weights, values.shape).to(device)
        batch = math.prod(j.lead_shape)
        if cfg.is_sequence and len(j.lead_shape) == 1:
            if weights is not None:
                raise self.fail(
                    "weights were given, but this is a sequence feature (max_sequence_length="
                    f"{cfg.max_sequence_length}); sequence positions are looked up one id each, unweighted.",
                    "Drop the weights, or set max_sequence_length=0 to combine the ids with weights.",
                )
            m = cfg.max_sequence_length
            values, keep, _ = self._check_ids(values, None)  # every id is range-checked, even truncated ones
            rows, cols = (t.to(device) for t in j.rows_cols())
            if keep is not None:
                rows, cols = rows[keep], cols[keep]
            within = cols < m
            seg = (rows * m + cols)[within]
            return self._finish(values[within], seg, batch * m, (batch, m), None)
        values, keep, weights = self._check_ids(values, weights)
        out_shape = self._output_shape(j.lead_shape, batch)
        if keep is None and j.splits is not None:
            # Nothing dropped from a ragged input: its row_splits are the offsets, no segment index needed.
            offsets = j.splits.to(device=device, dtype=torch.int64)
            batch_ = FeatureBatch(ids=values, offsets=offsets, coeffs=None, out_shape=out_shape)
        else:
            rows = j.rows_cols()[0].to(device)
            seg = rows if keep is None else rows[keep]
            batch_ = self._finish(values, seg, batch, out_shape, None)
        coeffs = combiner_coeffs(self.table.config.combiner, batch_, weights)
        return dataclasses.replace(batch_, coeffs=coeffs, weights=weights if self.dynamic else None)

    def _convert_dense(self, x: Tensor, w: Any, device: torch.device) -> FeatureBatch:
        cfg = self.feature.config
        if w is not None:
            raise self.fail(
                "weights were given for a dense input; each element of a dense input is its own lookup, "
                "so weights are not allowed.",
                "Drop the weights, or pass the ids as a sparse/Ragged input to combine them with weights.",
            )
        if cfg.is_sequence:
            raise self.fail(
                f"a dense input was given for a sequence feature (max_sequence_length={cfg.max_sequence_length}).",
                "Pass a 2-D sparse_coo_tensor or a Ragged [B, L] for sequence features, or set max_sequence_length=0.",
            )
        self._check_ids_dtype(x, "ids")
        flat = x.reshape(-1).to(device=device, dtype=torch.int64)
        n = flat.numel()
        out_shape = self._output_shape(tuple(int(d) for d in x.shape), n)
        values, keep, _ = self._check_ids(flat, None)
        if keep is None:
            offsets = torch.arange(n + 1, device=device)
            return FeatureBatch(ids=values, offsets=offsets, coeffs=None, out_shape=out_shape)
        seg = torch.arange(n, device=device)[keep]
        return self._finish(values, seg, n, out_shape, None)

    def _output_shape(self, natural: tuple[int, ...], num_segments: int) -> tuple[int, ...]:
        given = self.feature.config.output_shape
        if given is None:
            return natural
        if math.prod(given) != num_segments:
            raise self.fail(
                f"output_shape {list(given)} holds {math.prod(given)} outputs but the input gives "
                f"{num_segments} (natural shape {list(natural)}).",
                "Fix FeatureConfig.output_shape or the batch size.",
            )
        return given

    def _check_weights(self, w: Tensor, shape: torch.Size) -> Tensor:
        if not torch.is_floating_point(w):
            raise self.fail(f"weights must be floating point, got {w.dtype}.", "Cast them with .float().", TypeError)
        if w.shape != shape:
            raise self.fail(f"weights have shape {tuple(w.shape)} but ids have {tuple(shape)}.", "")
        w = w.to(torch.float32)
        bad = ~torch.isfinite(w)
        if bool(bad.any()):
            first = int(torch.nonzero(bad)[0, 0])
            raise self.fail(
                f"weights must be finite; weight #{first} is {float(w[first])}.",
                "Remove or replace NaN/Inf weights.",
            )
        return w

    def _check_ids(self, ids: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Range rules: ids >= V always raise; ids < 0 (and weights <= 0) are dropped when
        validate_weights_and_indices, else a negative id raises. Returns the kept ids, the keep mask
        (None when every id is kept) and the kept weights."""
        vocab = self.table.vocabulary_size
        validate = self.feature.config.validate_weights_and_indices
        if self.dynamic:  # keys: every int64 is one; only weights <= 0 are dropped
            if weights is None or not validate or not bool((weights <= 0).any()):
                return ids, None, weights
            keep = weights > 0
            return ids[keep], keep, weights[keep]
        lowest, highest = (int(v) for v in torch.aminmax(ids)) if ids.numel() else (0, -1)
        drop_weights = weights is not None and validate and bool((weights <= 0).any())
        if highest < vocab and lowest >= 0 and not drop_weights:
            return ids, None, weights  # the common case: one pass over the ids
        keep = torch.ones_like(ids, dtype=torch.bool)
        if ids.numel():
            too_big = ids >= vocab
            if bool(too_big.any()):
                bad = int(ids[too_big].max())
                raise self.fail(
                    f"id {bad} is out of range: ids must be in [0, {vocab}) (vocabulary_size={vocab}); "
                    f"{int(too_big.sum())} id(s) are >= {vocab}.",
                    "Hash or clip ids into the vocabulary, or raise vocabulary_size.",
                )
            negative = ids < 0
            if bool(negative.any()):
                if not self.feature.config.validate_weights_and_indices:
                    raise self.fail(
                        f"id {int(ids[negative].min())} is negative and validate_weights_and_indices=False.",
                        "Remove negative ids, or set validate_weights_and_indices=True to drop them.",
                    )
                keep = ~negative
        if weights is not None and validate:
            keep = keep & (weights > 0)
        return ids[keep], keep, None if weights is None else weights[keep]

    def _finish(
        self, ids: Tensor, seg: Tensor, num_segments: int, out_shape: tuple[int, ...], coeffs: Tensor | None
    ) -> FeatureBatch:
        offsets = offsets_from_segments(seg, num_segments)
        return FeatureBatch(ids=ids, offsets=offsets, coeffs=coeffs, out_shape=out_shape, seg_=seg)


def combiner_coeffs(combiner: Combiner | str, batch: FeatureBatch, weights: Tensor | None) -> Tensor | None:
    """``s_b * w_k`` per id (spec §2.1) for ``batch``'s bags and the ids' ``weights`` [N] (None: 1 each);
    a zero denominator gives s_b = 0. Subnormal weights, squares, sums and products are flushed to zero (spec
    §1.5)."""
    if weights is None:  # unweighted: the denominators are the bag sizes, no segment index needed
        return None if combiner == Combiner.SUM else _unweighted_coeffs(batch.offsets, combiner)
    weights = flush(weights)
    if combiner == Combiner.SUM:
        return weights
    seg, num_segments = batch.seg, batch.num_segments
    if combiner == Combiner.MEAN:
        den = flush(segment_sum(weights, seg, num_segments))
    else:
        den = flush(torch.sqrt(flush(segment_sum(flush(weights * weights), seg, num_segments))))
    scale = torch.where(den != 0, 1.0 / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(den))
    return flush(weights * flush(scale).index_select(0, seg))


def _unweighted_coeffs(offsets: Tensor, combiner: str) -> Tensor | None:
    """Mean or sqrtn coefficients of unit weights from the offsets [S+1] alone: 1/c or 1/sqrt(c) for
    every id of a bag of c ids. The same float32 operations as the weighted path with w = 1 (a float32
    sum of c ones is exactly c), so the same bits. None (every coefficient 1, exactly) when every bag
    holds one id, the common case of single-valued columns."""
    counts = offsets[1:] - offsets[:-1]
    if bool((counts == 1).all()):
        return None
    return _unit_coeffs(counts, combiner, None)


def strided_int64(t: object) -> TypeGuard[Tensor]:
    """``t`` is a plain (strided, not nested) int64 tensor, on any device."""
    # identity tests: this runs twice per feature per step
    return isinstance(t, Tensor) and t.dtype is torch.int64 and t.layout is torch.strided and not t.is_nested


def _plain_int64(t: object) -> TypeGuard[Tensor]:
    """``t`` is a contiguous int64 CPU tensor (``is_cpu``: no device object)."""
    return strided_int64(t) and t.is_cpu and t.is_contiguous()


def convert_many(
    converters: list[InputConverter],
    xs: list[Any],
    ws: list[Any],
    device: torch.device,
    arena: Callable[[int, torch.dtype], Tensor] | None = None,
) -> list[FeatureBatch]:
    """Every feature's input converted (``InputConverter.convert`` each), with the common inputs on the
    fast path: int64 CPU ``Ragged`` or dense ids without weights, for non-sequence features without an
    ``output_shape``. Those are copied into one int64 buffer (``arena(n, dtype)`` gives one of at least n
    elements; fresh ones when None), their mean / sqrtn coefficients written into one float32 buffer, and
    their input rules (ids in [0, V), row splits that start at 0,
    never decrease and end at len(values)) checked there, for all features in one native call: the
    batch holds the copy that was checked. A feature whose input breaks a rule, or that is not on the
    fast path, goes through ``convert``, which drops what the rules drop and names what is wrong. Both
    paths give the same batches. Tables on a GPU take ``gpu_inputs.convert_many_on_gpu`` instead."""
    fast: list[tuple[int, Tensor, Tensor | None]] = []
    values: Tensor
    splits: Tensor | None
    if device.type == "cpu" and native.library() is not None:
        for i, (conv, x, w) in enumerate(zip(converters, xs, ws)):
            if w is not None or not conv.fast_path:
                continue
            if type(x) is Ragged:
                values, splits = x.values, x.row_splits
                if _plain_int64(values) and _plain_int64(splits) and values.dim() == 1 and splits.dim() == 1 \
                        and splits.numel() >= 1:  # fmt: skip
                    fast.append((i, values, splits))
            elif _plain_int64(x) and x.dim() >= 1:
                fast.append((i, x.reshape(-1), None))
    out: list[FeatureBatch | None] = [None] * len(converters)
    if fast:
        parts = [(v, s, *converters[i].fast_part) for i, v, s in fast]
        ints, floats = native_inputs.staged_size(parts)
        make = arena if arena is not None else (lambda n, dtype: torch.empty(n, dtype=dtype))
        staged_all = native_inputs.stage_inputs_many(parts, make(ints, torch.int64), make(floats, torch.float32))
        for (i, _, splits), staged in zip(fast, staged_all):
            if staged is None:
                continue
            ids, offsets, _, coeffs = staged  # coeffs None: every coefficient 1 (what combiner_coeffs gives)
            if splits is None:  # dense: each element is its own lookup
                out[i] = FeatureBatch(ids=ids, offsets=offsets, coeffs=None, out_shape=tuple(xs[i].shape))
            else:
                out[i] = FeatureBatch(ids=ids, offsets=offsets, coeffs=coeffs, out_shape=(offsets.numel() - 1,))
    return [b if b is not None else conv.convert(x, w, device) for b, conv, x, w in zip(out, converters, xs, ws)]


def _unit_coeffs(counts: Tensor, combiner: str, num_ids: int | None) -> Tensor:
    """1/c or 1/sqrt(c) for every id of a bag of c ids (``counts`` [S], never negative), every one even where
    all are 1; ``num_ids`` (N, when known) spares a CUDA device the sync that sizes the result. An empty
    bag's scale (1/0) is repeated no time, so it never reaches a coefficient: no guard is needed, and the
    step launches four kernels a feature (five for sqrtn)."""
    den = counts.to(torch.float32)
    if combiner != Combiner.MEAN:
        den = torch.sqrt(den)
    return torch.repeat_interleave(torch.reciprocal(den), counts, output_size=num_ids)
