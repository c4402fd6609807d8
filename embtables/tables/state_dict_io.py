"""``state_dict`` support for ``DistributedEmbedding``: TF-style table keys and validated loads."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from embtables.config import ResolvedTable, TableConfig
from embtables.tables.state import check_loaded_value, storage_dtypes

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


def strict_of_caller(default: bool = True) -> bool:
    """The ``strict`` argument of the ``nn.Module.load_state_dict`` call that is loading us.

    torch passes ``strict=True`` to every ``_load_from_state_dict`` and applies the real flag only
    afterwards, so a module cannot tell a partial load from a strict one; the caller's frame can."""
    frame = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            break
        if frame.f_code.co_name == "load_state_dict" and isinstance(frame.f_locals.get("self"), nn.Module):
            strict = frame.f_locals.get("strict", default)
            return bool(strict)
        frame = frame.f_back  # type: ignore[assignment]
    return default


def validate_state_dict(
    state_dict: Mapping[str, Any],
    prefix: str,
    shapes: dict[str, tuple[int, int]],
    owners: dict[str, tuple[ResolvedTable, str]],
) -> tuple[dict[str, Tensor], list[str], list[str], list[str]]:
    """Check every ``<prefix><table>[/<slot>]`` value against its logical shape [V, D] and its slot's
    domain. Returns the loadable values by key, the errors, the missing and the unexpected keys."""
    present: dict[str, Tensor] = {}
    errors: list[str] = []
    missing = []
    for key, shape in shapes.items():
        full = prefix + key
        if full not in state_dict:
            missing.append(full)
            continue
        value = state_dict[full]
        if not isinstance(value, Tensor):
            errors.append(f"{full!r}: expected a Tensor, got {type(value).__name__}")
        elif tuple(value.shape) != tuple(shape):
            errors.append(
                f"{full!r}: shape {list(value.shape)} in the checkpoint, {list(shape)} in this "
                "model (vocabulary_size, dim); the table configs differ"
            )
        elif not torch.is_floating_point(value):
            errors.append(f"{full!r}: must be floating point, got {value.dtype} (the checkpoint is corrupt)")
        elif (problem := check_loaded_value(*owners[key], value)) is not None:
            errors.append(f"{full!r}: {problem}")
        else:
            present[key] = value
            stored = storage_dtypes(owners[key][0])[1 if owners[key][1] else 0]
            if value.dtype != stored and stored != torch.float32:
                logger.info("%r: %s values loaded into %s storage, rounded to nearest.", full, value.dtype, stored)
    unexpected = [k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] not in shapes]
    return present, errors, missing, unexpected
