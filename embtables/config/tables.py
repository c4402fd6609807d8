"""TableConfig, FeatureConfig and QuantizationConfig: frozen, validated values (spec §4.1, 4.2, 2.1).

They hold no tensors. A ``TableConfig`` is identified by object identity when a feature config is
resolved (as in TF: two separately built tables are two tables even if their fields are equal).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

from embtables.config.catalogue import OPTIMIZER_TYPES, Optimizer
from embtables.config.dynamic_vocabulary import DynamicVocabulary
from embtables.config.offload import Offload
from embtables.errors import ConfigError

logger = logging.getLogger("embtables")


class Combiner(str, enum.Enum):
    """How the rows of one sample are combined (spec §2.1). Compares equal to its lowercase string."""

    SUM = "sum"
    MEAN = "mean"
    SQRTN = "sqrtn"

    def __str__(self) -> str:
        return self.value


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


STORAGE_TYPES = ("float32", "bfloat16", "float16")  # what a table's rows and slots may be stored as
ROUNDING_MODES = ("stochastic", "nearest")


def storage_name(dtype: object) -> str | None:
    """The name in ``STORAGE_TYPES`` of ``dtype`` (``torch.bfloat16`` or ``"bfloat16"``), or None. The config
    layer imports no torch: a torch dtype is known by its ``str``, ``torch.<name>``."""
    name = dtype if isinstance(dtype, str) else str(dtype) if type(dtype).__name__ == "dtype" else None
    if name is None:
        return None
    name = name.removeprefix("torch.")
    return name if name in STORAGE_TYPES else None


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Simulated quantization of looked-up rows (spec §2.1).

    Each looked-up value is clamped to ``[lower, upper]`` and snapped to one of ``num_buckets``
    evenly spaced levels before the combiner; storage stays float32. The backward pass is
    straight-through.
    """

    num_buckets: int
    lower: float
    upper: float

    def __post_init__(self) -> None:
        if not _is_int(self.num_buckets) or self.num_buckets < 2:
            raise ConfigError(f"QuantizationConfig: `num_buckets` must be an int >= 2, got {self.num_buckets!r}.")
        for arg in ("lower", "upper"):
            v = getattr(self, arg)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise TypeError(f"QuantizationConfig: `{arg}` must be a finite float, got {v!r}.")
        if not self.lower < self.upper:
            raise ConfigError(f"QuantizationConfig: `lower` ({self.lower}) must be < `upper` ({self.upper}).")


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One embedding table of ``vocabulary_size`` rows (V) by ``dim`` columns (D).

    Attributes:
      vocabulary_size: V, the number of rows (>= 1).
      dim: D, the embedding width (>= 1).
      initializer: a callable ``(shape, dtype) -> Tensor``; None means truncated normal with mean 0,
        stddev ``1/sqrt(dim)``, cut at 2 sigma (TF's default).
      optimizer: this table's optimizer; None means the global one given to the embedding layer.
      combiner: "mean" (default), "sum" or "sqrtn"; applies to every feature of this table.
      name: the table's name (state_dict key); None becomes ``table_{i}`` in table order.
      quantization_config: optional simulated quantization of looked-up rows.
      dynamic: a ``DynamicVocabulary`` makes the table keyed by any int64 id, ``vocabulary_size`` being
        its capacity in rows (spec §12); None (default) is a fixed table with ids in [0, V).
      dtype: how the rows are stored: ``torch.float32`` (None, the default: exact to TF), ``torch.bfloat16``
        or ``torch.float16`` (half the memory; lookups and updates compute in float32 and every written
        value is rounded to the type, spec §12).
      slot_dtype: how the optimizer's slots are stored: None (float32, the default) or a half type; only
        with a half ``dtype``.
      rounding: how a half table's written values are rounded: "stochastic" (default; unbiased, seeded by
        ``rounding_seed``, the step, the table, the row and the column) or "nearest" (ties to even).
      rounding_seed: the seed of the stochastic rounding (an int >= 0).
      offload: an ``Offload`` keeps the rows and slots in files under a local directory with at most
        ``cache_rows`` rows in memory (docs/offload.md); None (default) keeps the table in memory.
    """

    vocabulary_size: int
    dim: int
    initializer: Callable[..., Any] | None = None
    optimizer: Optimizer | None = None
    combiner: Combiner | str = "mean"
    name: str | None = None
    quantization_config: QuantizationConfig | None = None
    dynamic: DynamicVocabulary | None = None
    dtype: Any = None
    slot_dtype: Any = None
    rounding: str = "stochastic"
    rounding_seed: int = 0
    offload: Offload | None = None

    @property
    def storage(self) -> str:
        """The rows' storage type, a name in ``STORAGE_TYPES``."""
        return storage_name(self.dtype) or "float32"

    @property
    def slot_storage(self) -> str:
        """The slots' storage type, a name in ``STORAGE_TYPES``."""
        return storage_name(self.slot_dtype) or "float32"

    @property
    def half(self) -> bool:
        """Whether the rows (and maybe the slots) are stored in a half type."""
        return self.storage != "float32"

    def __post_init__(self) -> None:
        who = f"TableConfig {self.name!r}" if self.name is not None else "TableConfig"
        if not _is_int(self.vocabulary_size) or self.vocabulary_size < 1:
            raise ConfigError(f"{who}: `vocabulary_size` must be an int >= 1, got {self.vocabulary_size!r}.")
        if not _is_int(self.dim) or self.dim < 1:
            raise ConfigError(f"{who}: `dim` must be an int >= 1, got {self.dim!r}.")
        if self.initializer is not None and not callable(self.initializer):
            raise ConfigError(
                f"{who}: `initializer` must be a callable (shape, dtype) -> Tensor or None, got {self.initializer!r}."
            )
        if self.optimizer is not None and not isinstance(self.optimizer, OPTIMIZER_TYPES):
            raise ConfigError(
                f"{who}: `optimizer` must be one of {', '.join(c.__name__ for c in OPTIMIZER_TYPES)} "
                f"(embtables.*) or None, got {type(self.optimizer).__name__}."
            )
        combiner = self.combiner.lower() if isinstance(self.combiner, str) else self.combiner
        try:
            object.__setattr__(self, "combiner", Combiner(combiner))
        except ValueError:
            raise ConfigError(
                f"{who}: `combiner` must be one of 'mean', 'sum', 'sqrtn', got {self.combiner!r}."
            ) from None
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ConfigError(f"{who}: `name` must be a non-empty str or None, got {self.name!r}.")
        if self.name is not None and any(unicodedata.category(c) in ("Cc", "Cs") for c in self.name):
            raise ConfigError(
                f"{who}: `name` must not contain control characters (NUL, newline, tab, ...) or lone surrogates; "
                "they cannot be written to checkpoints, logs or serving files. Rename the table."
            )
        if self.quantization_config is not None and not isinstance(self.quantization_config, QuantizationConfig):
            raise ConfigError(f"{who}: `quantization_config` must be a QuantizationConfig or None.")
        if self.dynamic is not None and not isinstance(self.dynamic, DynamicVocabulary):
            raise ConfigError(
                f"{who}: `dynamic` must be an embtables.DynamicVocabulary or None, got {type(self.dynamic).__name__}."
            )
        self._check_storage(who)
        self._check_offload(who)

    def _check_offload(self, who: str) -> None:
        """The rules of ``offload``: an initializer that draws any block of rows on its own."""
        if self.offload is None:
            return
        if not isinstance(self.offload, Offload):
            got = type(self.offload).__name__
            raise ConfigError(f"{who}: `offload` must be an embtables.Offload or None, got {got}.")
        if self.initializer is not None and not callable(getattr(self.initializer, "block", None)):
            raise ConfigError(
                f"{who}: `offload` needs an initializer that can draw any block of rows on its own (rows are "
                f"initialized when first read): embtables.TruncatedNormal, Constant or RowIdInitializer, or an object "
                f"with a `block(start, shape, seed)` method; got {self.initializer!r}."
            )

    def _check_storage(self, who: str) -> None:
        """The rules of ``dtype``, ``slot_dtype``, ``rounding`` and ``rounding_seed``."""
        allowed = "torch.float32, torch.bfloat16 or torch.float16"
        for arg in ("dtype", "slot_dtype"):
            value = getattr(self, arg)
            if value is not None and storage_name(value) is None:
                raise ConfigError(f"{who}: `{arg}` must be {allowed} (or None: float32), got {value!r}.")
        if self.slot_storage != "float32" and not self.half:
            raise ConfigError(
                f"{who}: `slot_dtype={self.slot_storage}` needs half-precision rows: pass `dtype` too (e.g. "
                f"dtype=torch.{self.slot_storage}), or leave `slot_dtype` None."
            )
        if self.rounding not in ROUNDING_MODES:
            raise ConfigError(f"{who}: `rounding` must be 'stochastic' or 'nearest', got {self.rounding!r}.")
        if not _is_int(self.rounding_seed) or not 0 <= self.rounding_seed < 2**63:
            raise ConfigError(f"{who}: `rounding_seed` must be an int in [0, 2^63), got {self.rounding_seed!r}.")
        if self.half and self.quantization_config is not None:
            raise ConfigError(
                f"{who}: `dtype={self.storage}` with `quantization_config`: simulated quantization is for float32 "
                "tables. Drop one of them."
            )


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """One input feature looked up in ``table``.

    Attributes:
      table: the TableConfig to look ids up in; several features may share one table.
      max_sequence_length: M > 0 makes a sequence feature: a [B, L] input gives [B, M, D], one row
        per position, truncated at M and zero-padded; 0 (default) combines each sample into [B, D].
      validate_weights_and_indices: True (default) drops ids < 0 and weights <= 0 like
        ``safe_embedding_lookup_sparse``; False makes a negative id an error.
      output_shape: the activation's shape without D (the batch may be reshaped); None infers it.
      name: used in error messages; None uses the feature's path in the nest.
    """

    table: TableConfig
    max_sequence_length: int = 0
    validate_weights_and_indices: bool = True
    output_shape: tuple[int, ...] | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        who = f"FeatureConfig {self.name!r}" if self.name is not None else "FeatureConfig"
        if not isinstance(self.table, TableConfig):
            raise ConfigError(f"{who}: `table` must be a TableConfig, got {type(self.table).__name__}.")
        if not _is_int(self.max_sequence_length) or self.max_sequence_length < 0:
            raise ConfigError(f"{who}: `max_sequence_length` must be an int >= 0, got {self.max_sequence_length!r}.")
        if not isinstance(self.validate_weights_and_indices, bool):
            raise ConfigError(
                f"{who}: `validate_weights_and_indices` must be a bool, got {self.validate_weights_and_indices!r}."
            )
        if self.output_shape is not None:
            shape = self.output_shape
            if isinstance(shape, int) or not isinstance(shape, Sequence):
                raise ConfigError(f"{who}: `output_shape` must be a sequence of ints, got {shape!r}.")
            shape = tuple(shape)
            if not shape or not all(_is_int(d) and d >= 1 for d in shape):
                raise ConfigError(f"{who}: `output_shape` must be a non-empty sequence of ints >= 1, got {shape!r}.")
            object.__setattr__(self, "output_shape", shape)
        if self.name is not None and not isinstance(self.name, str):
            raise ConfigError(f"{who}: `name` must be a str or None, got {self.name!r}.")

    @property
    def is_sequence(self) -> bool:
        return self.max_sequence_length > 0 and self.output_shape is None
