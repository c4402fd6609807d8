"""Batch ownership: the engine's own copies of the caller's input tensors.

A caller may write into its input buffers after ``enqueue()`` (a data loader refilling pinned
buffers, numpy views): ids that were validated must never change under the engine. Every input
tensor that shares memory with the caller's inputs is copied into reusable staging buffers, so
owning a batch costs a copy but no fresh allocation per step.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, nest
from embtables.kernels import gpu, native, native_step
from embtables.tables import phase_profile
from embtables.tables.backends.device_checks import DeviceChecks
from embtables.tables.gpu_inputs import convert_many_on_gpu
from embtables.tables.input_nest import flatten_inputs, is_input_leaf
from embtables.tables.inputs import FeatureBatch, InputConverter, convert_many, is_kjt
from embtables.tables.ragged import Ragged

logger = logging.getLogger("embtables")


def storages(x: object) -> set[int]:
    """Data pointers of every storage an input leaf (ids or weights) exposes to its owner."""
    tensors: list[object] = []
    if isinstance(x, Tensor):
        if x.layout == torch.sparse_coo:
            tensors += [x._indices(), x._values()]
        elif x.is_nested:
            if x.layout == torch.jagged:
                tensors += [x.values(), x.offsets(), x.lengths()]  # type: ignore[attr-defined]
            else:
                tensors += list(x.unbind())
        else:
            tensors.append(x)
    elif isinstance(x, Ragged):
        tensors += [x.values, x.row_splits]
    elif is_kjt(x):
        for name in ("values", "lengths", "weights_or_none", "offsets"):
            fn = getattr(x, name, None)
            if callable(fn):
                with contextlib.suppress(Exception):
                    tensors.append(fn())
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, Tensor) and t.layout == torch.strided}


_BATCH_FIELDS = ("ids", "offsets", "coeffs", "seg_", "weights")


class Staging:
    """Reusable buffers for the engine's own copies of input tensors, so owning a batch costs a copy
    but no allocation (fresh pages) per step. A buffer is reused only when no live batch (staged by
    enqueue, or awaiting apply_gradients) still refers to it."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, str], list[Tensor]] = {}
        # buffers holding every fast-path feature's ids and offsets (int64) and coefficients (float32)
        self.arenas: list[Tensor] = []
        self.layouts = native_step.StageLayouts()  # the views of recent layouts in the arenas

    def arena(self, n: int, dtype: torch.dtype, busy: set[int]) -> Tensor:
        """A ``dtype`` buffer of at least ``n`` elements that no pointer in ``busy`` points into."""
        for i, buf in enumerate(self.arenas):
            if buf.dtype != dtype:
                continue
            if busy:
                lo = buf.data_ptr()
                hi = lo + buf.numel() * buf.element_size()
                if any(lo <= p < hi for p in busy):
                    continue
            if buf.numel() < n:
                buf = self.arenas[i] = torch.empty(max(n, 2 * buf.numel()), dtype=dtype)
                self.layouts.forget()  # they hold the old arena
            return buf
        buf = torch.empty(max(n, 1), dtype=dtype)
        self.arenas.append(buf)
        return buf

    def arena_storages(self) -> set[int]:
        """The storage pointers of the arenas: a tensor whose storage is one of them is a copy the engine
        already owns."""
        return {buf.untyped_storage().data_ptr() for buf in self.arenas}

    def copy(self, key: tuple[int, str], t: Tensor, busy: set[int]) -> Tensor:
        """A copy of the 1-D tensor ``t`` in a buffer whose data pointer is not in ``busy``."""
        pool = self.buffers.get(key)
        if pool is None:
            pool = self.buffers[key] = []
        n = t.numel()
        for i, buf in enumerate(pool):
            if buf.data_ptr() in busy or buf.dtype != t.dtype or buf.device != t.device:
                continue
            if buf.numel() < n:
                buf = pool[i] = torch.empty(max(n, 2 * buf.numel()), dtype=t.dtype, device=t.device)
            out = buf[:n]
            out.copy_(t)
            return out
        buf = torch.empty(n, dtype=t.dtype, device=t.device)
        pool.append(buf)
        buf.copy_(t)
        return buf


def batch_pointers(batches: list[FeatureBatch]) -> set[int]:
    return {t.data_ptr() for b in batches for name in _BATCH_FIELDS if isinstance(t := getattr(b, name), Tensor)}


def owned(batch: FeatureBatch, foreign: set[int], staging: Staging, index: int, busy: set[int]) -> FeatureBatch:
    """``batch`` with every tensor that shares memory with the caller's inputs copied, so a caller who
    writes into its input buffers after enqueue() can never change ids the engine already validated."""
    copied = [
        staging.copy((index, name), t.contiguous(), busy)
        if isinstance(t := getattr(batch, name), Tensor) and t.untyped_storage().data_ptr() in foreign
        else t
        for name in _BATCH_FIELDS
    ]
    ids, offsets, coeffs, seg, weights = copied
    assert isinstance(ids, Tensor) and isinstance(offsets, Tensor)
    return FeatureBatch(
        ids=ids,
        offsets=offsets,
        coeffs=coeffs,
        out_shape=batch.out_shape,
        seg_=seg,
        dropped=batch.dropped,
        weights=weights,
    )


def detached(batches: list[FeatureBatch]) -> list[FeatureBatch]:
    """The batches with their tensors cloned out of any shared staging buffer."""
    out = []
    for b in batches:
        fields: dict[str, Any] = {n: t.clone() for n in _BATCH_FIELDS if isinstance(t := getattr(b, n), Tensor)}
        out.append(dataclasses.replace(b, staged=None, **fields))
    return out


def _staged_batch(
    ids: Tensor, offsets: Tensor, coeffs: Tensor | None, out_shape: tuple[int, ...], staged: native_step.StagedBags
) -> FeatureBatch:
    """A ``FeatureBatch`` of staged bags, built without the frozen dataclass's per-field ``__setattr__`` (one
    per feature per step)."""
    batch = FeatureBatch.__new__(FeatureBatch)
    batch.__dict__.update(ids=ids, offsets=offsets, coeffs=coeffs, out_shape=out_shape, seg_=None, dropped=0,
                          weights=None, staged=staged, dropped_in_place=False)  # fmt: skip
    return batch


class InputStager:
    """Input staging for one module: a call's ``features``/``weights`` nest -> one validated
    ``FeatureBatch`` [per feature, F] that the engine owns (spec §4), through reusable buffers."""

    def __init__(self, feature_config: Any, resolved: ResolvedConfig) -> None:
        self.feature_config = feature_config
        self.flat = nest.flat_dict(feature_config)  # the usual dict config: flattened without walking
        self.converters = [InputConverter(f, resolved.tables[f.table_index]) for f in resolved.features]
        self.staging = Staging()
        self._native_parts()

    def _native_parts(self) -> None:
        """For the native staging of every feature in one call (``stage_every_feature``): whether every
        feature may take it, and their V and combiner codes as the ctypes arrays it reads."""
        self.every_fast = bool(self.converters) and all(c.fast_path for c in self.converters)
        n = len(self.converters)
        self.vocab = (ctypes.c_int64 * n)(*[c.fast_part[0] for c in self.converters])
        self.codes = (ctypes.c_int32 * n)(*[c.fast_part[1] for c in self.converters])

    def stage(
        self, features: Any, weights: Any, device: torch.device, busy: set[int], checks: DeviceChecks | None = None
    ) -> list[FeatureBatch]:
        """The F batches of one call, every input rule checked (``ValueError``/``TypeError`` and nothing
        staged otherwise); no staging buffer whose data pointer is in ``busy`` is written. ``checks``: a GPU
        backend's deferred ``DeviceChecks``, which then checks the rules of the GPU's common inputs on the
        device and raises at the next call (``tables/gpu_inputs.py``)."""
        with phase_profile.phase("enqueue: validate inputs"):
            flat_x, flat_w = flatten_inputs(self.feature_config, features, weights, self.flat)
            staging = self.staging
            if self.every_fast and device.type == "cpu" and native.library() is not None:
                every = self.stage_every_feature(flat_x, flat_w, busy)
                if every is not None:
                    return every  # copies in the engine's own arena
            if gpu.usable(device):
                converted = convert_many_on_gpu(self.converters, flat_x, flat_w, device, checks)
            else:
                converted = convert_many(
                    self.converters, flat_x, flat_w, device, lambda n, dtype: staging.arena(n, dtype, busy)
                )
            ours = staging.arena_storages()
            return [
                b  # the fast path's copy, already the engine's own
                if b.ids.untyped_storage().data_ptr() in ours
                else owned(b, storages(x) | storages(w), staging, i, busy)
                for i, (b, x, w) in enumerate(zip(converted, flat_x, flat_w))
            ]

    def stage_every_feature(self, xs: list[Any], ws: list[Any], busy: set[int]) -> list[FeatureBatch] | None:
        """Every feature's batch from one native staging call (``native_step.stage``), their bags shared as
        ``FeatureBatch.staged``, when every input is unweighted int64 CPU ``Ragged`` or dense ids and keeps
        the input rules; None otherwise (``convert_many`` then converts, and names what is wrong)."""
        values: list[Tensor] = []
        splits: list[Tensor | None] = []
        for x, w in zip(xs, ws):
            if w is not None:
                return None
            if type(x) is Ragged:
                values.append(x.values)
                splits.append(x.row_splits)
            elif type(x) is Tensor and x.dtype is torch.int64 and x.layout is torch.strided and not x.is_nested \
                    and x.is_cpu and x.is_contiguous() and x.dim() >= 1:  # fmt: skip
                values.append(x.view(-1))
                splits.append(None)
            else:
                return None
        staging = self.staging
        bags = native_step.stage(
            values, splits, self.vocab, self.codes, lambda n, t: staging.arena(n, t, busy), staging.layouts
        )
        if bags is None:
            return None
        # the batches over these views, built once per shape of the dense inputs (a bag's ids [N] or [B, L])
        key = tuple(x.shape for x, sp in zip(xs, splits) if sp is None)
        batches: list[FeatureBatch] | None = bags.built.get(key)
        if batches is None:
            if len(bags.built) >= 8:  # as many dense shapes of these sizes: keep the latest few
                bags.built.clear()
            batches = bags.built[key] = [
                _staged_batch(ids, offs, coeffs, (offs.numel() - 1,) if sp is not None else tuple(x.shape), bags)
                for (ids, offs, coeffs), sp, x in zip(bags.views, splits, xs)
            ]
        else:
            for b in batches:
                if b.seg_ is not None:  # derived from an earlier batch's offsets on the general path
                    object.__setattr__(b, "seg_", None)
        return list(batches)

    def flat_gradients(self, gradients: Any, activations: list[Tensor]) -> list[Any]:
        """The F gradients of ``apply_gradients``: ``gradients`` (a nest like ``feature_config``) flattened,
        or, when None, the activations' ``.grad``. A None entry (a zero gradient) is logged."""
        if gradients is None:
            flat_g: list[Any] = [a.grad for a in activations]
            why = "no gradient reached its activation"
        else:
            fast = None if self.flat is None else self.flat.flatten_like(gradients, is_input_leaf)
            if fast is None:
                nest.assert_same_structure(self.feature_config, gradients, what="gradients", is_leaf=is_input_leaf)
                fast = nest.flatten(gradients)
            flat_g, why = fast, "gradient is None"
        for c, g in zip(self.converters, flat_g):
            if g is None:
                logger.warning("feature %r: %s; applying a zero gradient.", c.feature.name, why)
        return flat_g

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "staging": Staging()}  # scratch buffers: a copy owns fresh ones
        for name in ("every_fast", "vocab", "codes"):  # ctypes arrays: rebuilt
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._native_parts()


__all__ = [
    "InputStager",
    "Staging",
    "batch_pointers",
    "detached",
    "flatten_inputs",
    "is_input_leaf",
    "owned",
    "storages",
]
