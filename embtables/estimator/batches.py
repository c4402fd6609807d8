"""Raw batches -> what a step needs: the engine inputs of the feature columns and float32 labels.

``BatchReader`` reads ``input_fn``'s batches and converts them, one at a time or several joined:
up to ``JOINT_BATCHES`` consecutive batches (``JOINT_ROWS`` rows together) whose features are all NumPy
arrays (not object arrays) of the same keys, dtypes and trailing shapes, with NumPy labels alike, are
concatenated, converted in one pass (one set of NumPy calls per column for all of them) and cut back
into batches. Every column converts row by row, so the cut pieces are the ids, bags, weights and labels
each batch gets alone (dense ids [B] where all of the joined rows hold one id in range, row splits
otherwise: the engine trains the same bits either way); what is saved is the per-call overhead, most of
a small batch's conversion (batch 512 of the MovieLens model: 85 -> 50 us a batch).

Errors keep their place: when the joined conversion fails for any reason, each batch of the group is
converted alone, so a bad batch is refused at its own step, after every earlier batch trained; an
exception raised by the iterator is raised at the step that would have read it. Reading ahead stops
at the first batch that cannot be joined, so inputs of other kinds are read one batch at a time, as
before.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from embtables.tables.ragged import Ragged

JOINT_BATCHES = 8  # at most this many batches converted together
JOINT_ROWS = 32768  # ... and no more rows together (above this a batch's own arrays amortize the calls)
END = object()  # what ``BatchReader.next`` returns (as its item) once the input has ended

Convert = Callable[[Mapping[str, Any]], tuple[dict[str, Any], dict[str, Any]]]
Entry = tuple[Any, "PreparedBatch | None", "Exception | None"]  # (raw item, converted, refusal)


@dataclasses.dataclass
class PreparedBatch:
    """A batch after conversion: raw features (for model_fn), engine inputs, labels (float32) or None."""

    features: Mapping[str, Any]
    ids: dict[str, Any]
    weights: dict[str, Any]
    labels: Tensor | None


@dataclasses.dataclass(frozen=True)
class _Raise:
    """An exception to raise at the step that reaches it (the iterator's own, or an unexpected one)."""

    error: Exception


def split_item(batch: Any) -> tuple[Mapping[str, Any], Any]:
    """``(features, labels)`` of one item of ``input_fn`` (a ``(dict, labels)`` pair or a dict)."""
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], Mapping):
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        return batch, None
    raise TypeError(
        f"Estimator: input_fn must yield (features, labels) with features a dict, got {type(batch).__name__}."
    )


def as_labels(labels: Any, device: torch.device) -> Tensor:
    """``labels`` as a float32 tensor; ``ValueError`` when they are not finite numbers."""
    try:
        if isinstance(labels, Tensor):
            y = labels.to(device=device, dtype=torch.float32)
            finite = bool(torch.isfinite(y.sum()))
        else:
            arr = np.asarray(labels, dtype=np.float32)
            finite = bool(np.isfinite(arr.sum()))
            y = torch.as_tensor(arr, device=device)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"Estimator: the labels must be numbers ({exc}); convert a string label column to numbers first. "
            "No table or parameter was changed."
        ) from None
    # A finite sum means every label is finite (a NaN or Inf makes the sum NaN or Inf); a sum that
    # overflowed from finite labels gets the exact check.
    if not finite and not bool(torch.isfinite(y).all()):
        raise ValueError(
            f"Estimator: the labels hold {int((~torch.isfinite(y)).sum())} NaN or Inf value(s); drop or fill those "
            "rows. No table or parameter was changed."
        )
    return y


def shaped_like(y: Tensor, out: Tensor) -> Tensor:
    """Labels ``y`` shaped like the model's output, or a ``ValueError`` saying what differs."""
    if y.numel() != out.numel():
        raise ValueError(
            f"Estimator: the batch has {y.numel()} label value(s) of shape {tuple(y.shape)}, but model_fn returned "
            f"{tuple(out.shape)}; return one prediction per label. No table or parameter was changed."
        )
    return y.reshape(out.shape)


def _join_key(item: Any, keys: tuple[str, ...], need_labels: bool) -> tuple[Any, ...] | None:
    """What batches must share to be converted together (the dtypes and trailing shapes of the features
    ``keys`` the columns read, and of the labels), or None when this one converts alone (a feature
    missing or not a NumPy array, rows that differ between features, labels missing)."""
    if type(item) is tuple and len(item) == 2 and isinstance(item[0], Mapping):
        features, labels = item
    elif isinstance(item, Mapping):
        features, labels = item, None
    else:
        return None
    rows = -1
    key: list[Any] = []
    for k in keys:
        v = features.get(k)
        if type(v) is not np.ndarray or v.dtype.kind == "O" or v.ndim not in (1, 2) or not len(v):
            return None
        if len(v) != rows and rows >= 0:
            return None
        rows = len(v)
        key += (v.dtype, v.shape[1:])
    if labels is None:
        if need_labels:
            return None
    elif type(labels) is np.ndarray and labels.dtype.kind != "O" and len(labels) == rows:
        key += (labels.dtype, labels.shape[1:])
    else:
        return None
    return tuple(key) if key else None


def _cut(nest: dict[str, Any], r0: int, r1: int, splits: dict[int, np.ndarray]) -> dict[str, Any]:
    """Rows [r0, r1) of converted engine inputs (dense ids [B], ``Ragged`` rows, or None)."""
    out: dict[str, Any] = {}
    for name, v in nest.items():
        if isinstance(v, Ragged):
            s = splits.get(id(v.row_splits))
            if s is None:
                s = splits[id(v.row_splits)] = v.row_splits.numpy()
            s0, s1 = int(s[r0]), int(s[r1])
            out[name] = Ragged(v.values[s0:s1], torch.from_numpy(s[r0 : r1 + 1] - s0))
        else:
            out[name] = None if v is None else v[r0:r1]
    return out


class BatchReader:
    """``next()`` -> ``(item, PreparedBatch | None, refusal | None)`` for each item of ``batches`` in order,
    then ``(END, None, None)``. A refusal is the ``ValueError``/``TypeError`` its conversion raised; any
    other exception (the iterator's included) is raised by the ``next()`` that reaches its item.

    ``convert``: features -> ``(ids, weights)`` engine inputs (``EmbeddingConfigSpec.engine_inputs``);
    ``join``: the features ``convert`` reads, when it converts row by row (feature columns) so that
    batches may be converted together (only these are joined); None: one batch at a time."""

    def __init__(
        self,
        batches: Iterable[Any],
        convert: Convert,
        device: torch.device,
        need_labels: bool,
        join: frozenset[str] | None,
    ) -> None:
        self.it = iter(batches)
        self.convert, self.device, self.need_labels = convert, device, need_labels
        self.join = None if join is None else tuple(sorted(join))
        self.pending: collections.deque[Entry | _Raise] = collections.deque()
        self.ended = False

    def next(self) -> Entry:
        if not self.pending:
            self._read()
        entry = self.pending.popleft()
        if isinstance(entry, _Raise):
            raise entry.error
        return entry

    def prepare(self, item: Any) -> PreparedBatch:
        """One batch converted and checked: engine inputs, labels as float32 (finite)."""
        features, labels = split_item(item)
        if self.need_labels and labels is None:
            raise TypeError("Estimator: input_fn must yield (features, labels) for train and evaluate; got no labels.")
        ids, weights = self.convert(features)
        y = None if labels is None else as_labels(labels, self.device)
        return PreparedBatch(features, ids, weights, y)

    def _read(self) -> None:
        """Read the next group of batches (one, unless they can be joined) and queue their entries."""
        if self.ended:
            self.pending.append((END, None, None))
            return
        items: list[Any] = []
        keys: list[tuple[Any, ...] | None] = []
        rows = 0
        while True:
            try:
                item = next(self.it, END)
            except Exception as exc:  # raised at the step that would have read it
                self._queue(items, keys)
                self.pending.append(_Raise(exc))
                self.ended = True
                return
            if item is END:
                self.ended = True
                break
            key = None if self.join is None else _join_key(item, self.join, self.need_labels)
            items.append(item)
            keys.append(key)
            if key is None or key != keys[0] or len(items) >= JOINT_BATCHES:
                break
            assert self.join is not None  # a key means the batch can be joined
            rows += len(split_item(item)[0][self.join[0]])
            if rows >= JOINT_ROWS:
                break
        self._queue(items, keys)
        if not items:
            self.pending.append((END, None, None))

    def _queue(self, items: list[Any], keys: list[tuple[Any, ...] | None]) -> None:
        start = 0
        while start < len(items):
            stop = start + 1
            while keys[start] is not None and stop < len(items) and keys[stop] == keys[start]:
                stop += 1
            entries = self._joined(items[start:stop]) if stop - start > 1 else None
            for item in items[start:stop] if entries is None else []:
                entry = self._alone(item)
                self.pending.append(entry)
                if isinstance(entry, _Raise):
                    return
            self.pending.extend(entries or [])
            start = stop

    def _alone(self, item: Any) -> Entry | _Raise:
        try:
            return item, self.prepare(item), None
        except (ValueError, TypeError) as exc:  # refused: every rank stops at this step
            return item, None, exc
        except Exception as exc:
            return _Raise(exc)

    def _joined(self, items: list[Any]) -> list[Entry] | None:
        """The entries of ``items`` converted together, or None when that fails (then each goes alone)."""
        assert self.join is not None
        pairs = [split_item(item) for item in items]
        try:
            features = {k: np.concatenate([f[k] for f, _ in pairs]) for k in self.join}
            ids, weights = self.convert(features)
            labels = None if pairs[0][1] is None else as_labels(np.concatenate([y for _, y in pairs]), self.device)
        except Exception:
            return None
        out: list[Entry] = []
        splits: dict[int, np.ndarray] = {}
        r0 = 0
        for item, (f, _) in zip(items, pairs):
            r1 = r0 + len(f[self.join[0]])
            y = None if labels is None else labels[r0:r1]
            out.append((item, PreparedBatch(f, _cut(ids, r0, r1, splits), _cut(weights, r0, r1, splits), y), None))
            r0 = r1
        return out
