"""A deterministic synthetic click-through (CTR) data set with a planted teacher.

The generator holds a hidden *teacher*: one embedding ``E_t`` [V, Dt] per table (features that share
a table share its teacher rows) and a hidden logistic model on the pooled teacher embeddings. Each
sample's label is drawn as ``Bernoulli(sigmoid(teacher_logit))``, so a student model can learn the
task, and ``SyntheticCTR.teacher_logits`` gives the best achievable predictions to compare against.

Ids are drawn Zipf-like (a few hot ids, a long tail) through a fixed random permutation of each
table's vocabulary, so hot ids are scattered over ``[0, V)`` rather than being ``0, 1, 2, ...``.
Multi-hot features give a variable number of ids per sample (possibly zero), so every feature is an
``embtables.Ragged`` [B, (ids)] batch.

Everything is a pure function of ``SyntheticCTRConfig.seed``: the teacher, the id distributions and
every batch (batch ``i`` of a split is drawn from its own seed, independent of the batches before it).

Dimension names: B batch, F features, V vocabulary rows, D embedding dim (Dt for the teacher),
N ids in a batch.

Example::

    data = SyntheticCTR(SyntheticCTRConfig(seed=0))
    emb = embtables.DistributedEmbedding(data.feature_configs(dim=8), optimizer=embtables.Adagrad(0.1))
    for features, labels in data.batches(batch_size=256, num_batches=100):
        acts = emb(features)  # {feature name: [B, D]}
        loss = my_loss(acts, labels)  # e.g. an MLP on the concatenated [B, F*D] and BCE
        loss.backward()
        emb.apply_gradients()

``examples/quickstart.py`` is the complete program.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from embtables.config import Combiner, FeatureConfig, Optimizer, TableConfig
from embtables.errors import ConfigError
from embtables.tables import Ragged, TruncatedNormal

Batch = tuple[dict[str, Ragged], Tensor]
"""``(features, labels)``: ``{feature name: Ragged [B, (ids)]}`` and float32 labels [B] in {0, 1}."""

_SPLITS: dict[str, int] = {"train": 0, "eval": 1}
# Seed streams: SeedSequence([seed, stream, ...]) keeps the teacher, the table initializers and the
# batches of each split independent of one another. Any constants distinct from the split codes.
_TEACHER_STREAM = 7_919
_INIT_STREAM = 7_927


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class CategoricalFeature:
    """One categorical feature of the synthetic data set.

    Attributes:
      name: the feature's name (the key of its ``Ragged`` in every batch).
      vocabulary_size: V, ids are in ``[0, V)``. Features that share a table must agree on V.
      min_ids: the fewest ids a sample holds (0 allows empty samples).
      max_ids: the most ids a sample holds; each sample's count is uniform in
        ``[min_ids, max_ids]``. ``min_ids == max_ids == 1`` is a one-hot feature.
      table: the name of the table (and teacher) the ids index; None means the feature's own
        name. Two features naming the same table share it.
    """

    name: str
    vocabulary_size: int
    min_ids: int = 1
    max_ids: int = 1
    table: str | None = None

    def __post_init__(self) -> None:
        who = f"CategoricalFeature {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"CategoricalFeature: `name` must be a non-empty str, got {self.name!r}.")
        if not _is_int(self.vocabulary_size) or self.vocabulary_size < 1:
            raise ConfigError(f"{who}: `vocabulary_size` must be an int >= 1, got {self.vocabulary_size!r}.")
        if not _is_int(self.min_ids) or not _is_int(self.max_ids) or not 0 <= self.min_ids <= self.max_ids:
            raise ConfigError(
                f"{who}: need ints 0 <= `min_ids` <= `max_ids`, got min_ids={self.min_ids!r}, max_ids={self.max_ids!r}."
            )
        if self.max_ids < 1:
            raise ConfigError(f"{who}: `max_ids` must be >= 1 (a feature with no ids carries no signal).")
        if self.table is not None and (not isinstance(self.table, str) or not self.table):
            raise ConfigError(f"{who}: `table` must be a non-empty str or None, got {self.table!r}.")

    @property
    def table_name(self) -> str:
        """The table this feature's ids index (its own name unless ``table`` is set)."""
        return self.table if self.table is not None else self.name

    @property
    def is_multi_hot(self) -> bool:
        return self.max_ids > 1 or self.min_ids != 1


DEFAULT_FEATURES: tuple[CategoricalFeature, ...] = (
    CategoricalFeature("user", vocabulary_size=2_000),
    CategoricalFeature("item", vocabulary_size=5_000),
    # The items a user clicked before: multi-hot over the same vocabulary, sharing table "item".
    CategoricalFeature("item_history", vocabulary_size=5_000, min_ids=1, max_ids=8, table="item"),
    CategoricalFeature("category", vocabulary_size=50),
    # Free-form tags: multi-hot and sometimes empty (an empty sample gives a zero activation).
    CategoricalFeature("tags", vocabulary_size=500, min_ids=0, max_ids=5),
)


@dataclasses.dataclass(frozen=True)
class SyntheticCTRConfig:
    """What to generate. Every field has a default, so ``SyntheticCTRConfig()`` is a working data set.

    Attributes:
      seed: the one seed everything (teacher, id distributions, batches) derives from.
      features: the F categorical features, in order.
      teacher_dim: Dt, the width of the hidden teacher embeddings.
      zipf_exponent: ids of rank r (0-based) are drawn with probability proportional to
        ``(r + 1) ** -zipf_exponent``; larger is more skewed, 0 is uniform.
      teacher_bias: the teacher's intercept; negative values make clicks the minority class.
      signal_scale: multiplies every teacher term but the bias; larger makes labels less noisy.
      interactions: pairs of feature names whose pooled teacher embeddings enter the logit as a dot
        product (a feature cross that a linear model on the ids cannot represent).
    """

    seed: int = 0
    features: tuple[CategoricalFeature, ...] = DEFAULT_FEATURES
    teacher_dim: int = 4
    zipf_exponent: float = 1.05
    teacher_bias: float = -1.0
    signal_scale: float = 1.0
    interactions: tuple[tuple[str, str], ...] = (("user", "item"),)

    def __post_init__(self) -> None:
        if not _is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"SyntheticCTRConfig: `seed` must be an int >= 0, got {self.seed!r}.")
        features = tuple(self.features)
        object.__setattr__(self, "features", features)
        if not features or not all(isinstance(f, CategoricalFeature) for f in features):
            raise ConfigError("SyntheticCTRConfig: `features` must be a non-empty sequence of CategoricalFeature.")
        names = [f.name for f in features]
        if len(set(names)) != len(names):
            raise ConfigError(f"SyntheticCTRConfig: feature names must be unique, got {names}.")
        vocab: dict[str, int] = {}
        for f in features:
            seen = vocab.setdefault(f.table_name, f.vocabulary_size)
            if seen != f.vocabulary_size:
                raise ConfigError(
                    f"SyntheticCTRConfig: features sharing table {f.table_name!r} must have the same "
                    f"vocabulary_size; feature {f.name!r} has {f.vocabulary_size}, another has {seen}."
                )
        if not _is_int(self.teacher_dim) or self.teacher_dim < 1:
            raise ConfigError(f"SyntheticCTRConfig: `teacher_dim` must be an int >= 1, got {self.teacher_dim!r}.")
        for arg in ("zipf_exponent", "teacher_bias", "signal_scale"):
            value = getattr(self, arg)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(f"SyntheticCTRConfig: `{arg}` must be a finite float, got {value!r}.")
        if self.zipf_exponent < 0:
            raise ConfigError(f"SyntheticCTRConfig: `zipf_exponent` must be >= 0, got {self.zipf_exponent}.")
        pairs = tuple(tuple(p) for p in self.interactions)
        object.__setattr__(self, "interactions", pairs)
        for pair in pairs:
            if len(pair) != 2 or not all(p in names for p in pair):
                raise ConfigError(
                    f"SyntheticCTRConfig: each interaction must be a pair of feature names from {names}, got {pair!r}."
                )

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    @property
    def table_names(self) -> tuple[str, ...]:
        """Distinct table names in order of first appearance over ``features``."""
        return tuple(dict.fromkeys(f.table_name for f in self.features))


@dataclasses.dataclass(frozen=True, eq=False)
class _Teacher:
    """The hidden model: per-table embeddings, per-feature weights, interaction pairs, bias."""

    tables: dict[str, np.ndarray]  # table name -> E_t [V, Dt] float64
    weights: dict[str, np.ndarray]  # feature name -> a_f [Dt]
    interactions: tuple[tuple[str, str], ...]
    bias: float
    scale: float


class SyntheticCTR:
    """Deterministic CTR batches from a planted teacher (see the module docstring).

    Args:
      config: what to generate; ``SyntheticCTRConfig()`` by default.
    """

    def __init__(self, config: SyntheticCTRConfig | None = None) -> None:
        self.config = config if config is not None else SyntheticCTRConfig()
        cfg = self.config
        rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, _TEACHER_STREAM]))
        vocab = {f.table_name: f.vocabulary_size for f in cfg.features}
        dt = cfg.teacher_dim
        # Teacher rows ~ N(0, 1); feature weights ~ N(0, 1/Dt), so each one-hot term <a_f, e> has variance ~1.
        tables = {name: rng.standard_normal((v, dt)) for name, v in vocab.items()}
        weights = {f.name: rng.standard_normal(dt) / math.sqrt(dt) for f in cfg.features}
        self._teacher = _Teacher(tables, weights, cfg.interactions, float(cfg.teacher_bias), float(cfg.signal_scale))
        # Zipf ranks -> ids through a fixed permutation per table; CDFs for inverse-CDF sampling.
        self._rank_to_id: dict[str, np.ndarray] = {}
        self._cdf: dict[str, np.ndarray] = {}
        for name, v in vocab.items():
            p = (np.arange(v, dtype=np.float64) + 1.0) ** -cfg.zipf_exponent
            cdf = np.cumsum(p / p.sum())
            cdf[-1] = 1.0
            self._cdf[name] = cdf
            self._rank_to_id[name] = rng.permutation(v).astype(np.int64)

    # ------------------------------------------------------------------ the embedding config
    def feature_configs(
        self,
        dim: int = 8,
        *,
        optimizer: Optimizer | None = None,
        combiner: Combiner | str = "mean",
    ) -> dict[str, FeatureConfig]:
        """``{feature name: FeatureConfig}`` matching ``batches()``' feature dict.

        One ``TableConfig`` per table name (V from the features, D = ``dim``), named after its
        table; features naming the same table get the *same* ``TableConfig`` object, so
        ``DistributedEmbedding`` shares it (by default "item" and "item_history" share table
        "item"). Tables start from TF's default truncated normal (stddev ``1/sqrt(dim)``), seeded
        from ``config.seed`` so runs are reproducible.

        Args:
          dim: D, the width of every table.
          optimizer: a per-table optimizer for every table; None leaves the choice to the global
            optimizer given to ``DistributedEmbedding``.
          combiner: every table's combiner ("mean", "sum" or "sqrtn").
        """
        tables: dict[str, TableConfig] = {}
        for i, name in enumerate(self.config.table_names):
            v = next(f.vocabulary_size for f in self.config.features if f.table_name == name)
            seed = int(np.random.SeedSequence([self.config.seed, _INIT_STREAM, i]).generate_state(1)[0])
            init = TruncatedNormal(mean=0.0, stddev=1.0 / math.sqrt(dim), seed=seed)
            tables[name] = TableConfig(
                vocabulary_size=v, dim=dim, initializer=init, optimizer=optimizer, combiner=combiner, name=name
            )
        return {f.name: FeatureConfig(table=tables[f.table_name], name=f.name) for f in self.config.features}

    # ------------------------------------------------------------------ batches
    def batch(self, batch_size: int, index: int, *, split: str = "train") -> Batch:
        """Batch number ``index`` of ``split`` ("train" or "eval"): ``(features, labels)``.

        A pure function of ``(config, batch_size, index, split)``; the two splits never share a
        batch seed, so "eval" batches are held out from "train" ones.

        Returns:
          features: ``{feature name: Ragged}`` with B rows each; values int64 [N_f] in
            ``[0, V_f)``, row_splits int64 [B + 1].
          labels: float32 [B], 0.0 or 1.0, drawn from ``sigmoid(teacher_logits(features))``.
        """
        if not _is_int(batch_size) or batch_size < 1:
            raise ConfigError(f"SyntheticCTR.batch: `batch_size` must be an int >= 1, got {batch_size!r}.")
        if not _is_int(index) or index < 0:
            raise ConfigError(f"SyntheticCTR.batch: `index` must be an int >= 0, got {index!r}.")
        if split not in _SPLITS:
            raise ConfigError(f"SyntheticCTR.batch: `split` must be one of {sorted(_SPLITS)}, got {split!r}.")
        rng = np.random.default_rng(np.random.SeedSequence([self.config.seed, _SPLITS[split], index]))
        features: dict[str, Ragged] = {}
        pooled: dict[str, np.ndarray] = {}
        for f in self.config.features:
            lengths = rng.integers(f.min_ids, f.max_ids, size=batch_size, endpoint=True)
            n = int(lengths.sum())
            ranks = np.searchsorted(self._cdf[f.table_name], rng.random(n), side="right")
            ids = self._rank_to_id[f.table_name][np.minimum(ranks, f.vocabulary_size - 1)]
            features[f.name] = Ragged.from_lengths(torch.from_numpy(ids), torch.from_numpy(lengths.astype(np.int64)))
            pooled[f.name] = self._pool(f.table_name, ids, lengths)
        logits = self._logits(pooled)
        labels = (rng.random(batch_size) < _sigmoid(logits)).astype(np.float32)
        return features, torch.from_numpy(labels)

    def batches(self, batch_size: int, num_batches: int, *, split: str = "train", start: int = 0) -> Iterator[Batch]:
        """Batches ``start, ..., start + num_batches - 1`` of ``split``; see ``batch``.

        Each call starts afresh, so two calls with the same arguments yield identical batches.
        """
        if not _is_int(num_batches) or num_batches < 0:
            raise ConfigError(f"SyntheticCTR.batches: `num_batches` must be an int >= 0, got {num_batches!r}.")
        for i in range(start, start + num_batches):
            yield self.batch(batch_size, i, split=split)

    # ------------------------------------------------------------------ the teacher
    def teacher_logits(self, features: dict[str, Ragged]) -> Tensor:
        """The planted model's logits float32 [B] for a batch's ``features`` (the Bayes-optimal score).

        ``logit = bias + scale * (sum_f <a_f, pool_f> + sum_{(f, g)} <pool_f, pool_g>)`` where
        ``pool_f`` [B, Dt] is the mean teacher row over sample b's ids of feature f (zero if empty).
        """
        pooled = {}
        for f in self.config.features:
            if f.name not in features:
                raise ConfigError(f"SyntheticCTR.teacher_logits: feature {f.name!r} is missing from the batch.")
            r = features[f.name]
            ids = r.values.detach().cpu().numpy().astype(np.int64)
            lengths = r.lengths().detach().cpu().numpy().astype(np.int64)
            pooled[f.name] = self._pool(f.table_name, ids, lengths)
        return torch.from_numpy(self._logits(pooled).astype(np.float32))

    def _pool(self, table: str, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Mean teacher row per sample [B, Dt] of ``ids`` [N] grouped by ``lengths`` [B]."""
        rows: np.ndarray = self._teacher.tables[table][ids]
        if bool((lengths == 1).all()):  # one id per sample: its row (a fresh float64 copy) is the mean
            return rows
        sample = np.repeat(np.arange(lengths.size), lengths)
        # per column, the rows of each sample summed in order (what np.add.at gives, bit for bit, faster)
        out = np.stack(
            [np.bincount(sample, weights=rows[:, d], minlength=lengths.size) for d in range(rows.shape[1])], 1
        )
        mean: np.ndarray = out / np.maximum(lengths, 1)[:, None]
        return mean

    def _logits(self, pooled: dict[str, np.ndarray]) -> np.ndarray:
        t = self._teacher
        score = sum(pooled[name] @ a for name, a in t.weights.items())
        for f, g in t.interactions:
            score = score + np.einsum("bd,bd->b", pooled[f], pooled[g])
        return np.asarray(t.bias + t.scale * score, dtype=np.float64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = 1.0 / (1.0 + np.exp(-x))
    return out
