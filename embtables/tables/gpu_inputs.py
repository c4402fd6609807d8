"""``convert_many`` for tables on a GPU: every feature's common input staged in a fixed number of launches,
whatever the number of features.

The common inputs (int64 ``Ragged`` or dense ids without weights, for non-sequence features of fixed tables
without an ``output_shape``) are copied into one int64 buffer on the device (one copy: the batches hold
the engine's own copy, which the caller cannot change after the call), then one kernel
(``gpu.stage_inputs``) checks every feature's input rules and writes each id's bag and its mean / sqrtn
coefficient; dense inputs share one ``arange`` for their offsets. The rules' flags are read back in one
sync; a feature that breaks a rule, and every other input, goes through ``InputConverter.convert``, which
drops what the rules drop and names what is wrong.

With ``checks`` (a GPU backend's deferred ``DeviceChecks``), the flags are not read here: a broken input
refuses the step on the device (the lookup and every write skip it; the kernels never read outside a
buffer, whatever the flags say) and the next call raises ``convert``'s error for it. A negative id that the
rules drop (``validate_weights_and_indices``) is dropped in place: rewritten -1 in the engine's copy, with
coefficient 0 and not counted in its bag's mean / sqrtn, and skipped by the lookup and phase 1
(``FeatureBatch.dropped_in_place``). Only features the GPU backend serves whole (no
``quantization_config``, gradient accumulation) take this path then.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embtables.config import Combiner
from embtables.kernels import gpu
from embtables.tables.backends.device_checks import DeviceChecks
from embtables.tables.inputs import FeatureBatch, InputConverter, strided_int64
from embtables.tables.ragged import Ragged

_MODES: dict[str, int] = {Combiner.SUM: 0, Combiner.MEAN: 1, Combiner.SQRTN: 2}  # gpu.stage_inputs' modes


def _one_copy(pieces: list[Tensor], device: torch.device) -> Tensor:
    """``pieces`` concatenated into one new int64 tensor on ``device``: one launch (their concatenation on the
    device, or on the host and one copy to the device)."""
    if all(p.device == device for p in pieces):
        return torch.cat(pieces)
    if all(p.is_cpu for p in pieces):
        return torch.cat(pieces).to(device, non_blocking=True)
    return torch.cat([p.to(device, non_blocking=True) for p in pieces])


def convert_many_on_gpu(
    converters: list[InputConverter],
    xs: list[Any],
    ws: list[Any],
    device: torch.device,
    checks: DeviceChecks | None = None,
) -> list[FeatureBatch]:
    """The batches of every feature (see the module docstring)."""
    fast: list[tuple[int, Tensor, Tensor | None]] = []
    for i, (conv, x, w) in enumerate(zip(converters, xs, ws)):
        if w is not None or not conv.fast_path or conv.fast_part[0] == 0:
            continue
        if checks is not None and (
            conv.table.config.quantization_config is not None or not conv.table.optimizer.use_gradient_accumulation
        ):
            continue  # the reference looks it up or updates it: its ids are checked here
        if type(x) is Ragged:
            ids_in, splits_in = x.values, x.row_splits
            if strided_int64(ids_in) and strided_int64(splits_in) and ids_in.dim() == 1 and splits_in.dim() == 1 \
                    and splits_in.numel() >= 1:  # fmt: skip
                fast.append((i, ids_in, splits_in))
        elif strided_int64(x) and x.dim() >= 1:
            fast.append((i, x.reshape(-1), None))
    out: list[FeatureBatch | None] = [None] * len(converters)
    if fast:
        pieces = [p for _, v, s in fast for p in ((v,) if s is None else (v, s))]
        flat = _one_copy(pieces, device)
        views: list[tuple[Tensor, Tensor | None]] = []
        at = 0
        for _, v, s in fast:
            ids = flat[at : at + v.numel()]
            at += v.numel()
            splits = None if s is None else flat[at : at + s.numel()]
            at += 0 if s is None else s.numel()
            views.append((ids, splits))
        modes = [_MODES[converters[i].table.config.combiner] if s is not None else 0 for i, _, s in fast]
        vocabs = [converters[i].fast_part[0] for i, _, _ in fast]
        # deferred: a negative id that the rules drop is dropped in place on the device (no sync to find it)
        drops = [checks is not None and converters[i].feature.config.validate_weights_and_indices for i, _, _ in fast]
        parts = [(ids, splits, v, m, d) for (ids, splits), v, m, d in zip(views, vocabs, modes, drops)]
        flags_t, segs, coeffs = gpu.stage_inputs(parts, None if checks is None else checks.refused)
        longest_dense = max((ids.numel() for ids, splits in views if splits is None), default=-1)
        dense = torch.arange(longest_dense + 1, device=device) if longest_dense >= 0 else None
        if checks is None:
            flags = flags_t.tolist()  # one sync
        else:
            flags = [0] * len(fast)
            named = [(converters[i], ids, splits, () if splits is not None else tuple(xs[i].shape))
                     for (i, _, _), (ids, splits) in zip(fast, views)]  # fmt: skip
            checks.add([flags_t], lambda values: _input_error(named, values, device))
        first = 0
        for (i, _, _), (ids, splits), mode, drop, flag in zip(fast, views, modes, drops, flags):
            n = ids.numel()
            seg, coeff = segs[first : first + n], coeffs[first : first + n] if mode else None
            first += n
            if flag:
                continue  # convert() finds the rule and names it
            if splits is None:  # dense: each element is its own lookup
                assert dense is not None
                out[i] = FeatureBatch(ids=ids, offsets=dense[: n + 1], coeffs=None, out_shape=tuple(xs[i].shape),
                                      seg_=dense[:n], dropped_in_place=drop)  # fmt: skip
            else:
                out[i] = FeatureBatch(ids=ids, offsets=splits, coeffs=coeff, out_shape=(splits.numel() - 1,), seg_=seg,
                                      dropped_in_place=drop)  # fmt: skip
    return [b if b is not None else conv.convert(x, w, device) for b, conv, x, w in zip(out, converters, xs, ws)]


def _input_error(named: list[tuple[InputConverter, Tensor, Tensor | None, tuple[int, ...]]], flags: list[int],
                 device: torch.device) -> Exception | None:  # fmt: skip
    """The error ``convert`` raises for the first feature whose flag is set, from the engine's copy of its input
    (``named``: converter, ids, row splits or None, the shape of the input as given)."""
    for (conv, ids, splits, shape), flag in zip(named, flags):
        if not flag:
            continue
        given = Ragged(ids, splits) if splits is not None else ids.reshape(shape)
        try:
            conv.convert(given, None, device)
        except (ValueError, TypeError) as exc:
            return exc
        return ValueError(f"{conv.who}: its ids or row splits break the input rules (spec 2.2).")
    return None
