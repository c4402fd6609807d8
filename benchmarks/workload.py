"""Deterministic benchmark workloads: ids, per-table offsets and the fixed activation gradient.

Standard workload: 8 tables x 1,000,000 rows x dim 64 (float32), batch 4096, 20 ids per sample
(pooling 20, combiner ``sum``), ids Zipf(alpha=1.05) or uniform.

Id distribution choices (documented because they change the numbers):

* **Zipf.** ``numpy.random.zipf`` needs ``a > 1`` and draws from an *unbounded* support; with
  ``a = 1.05`` about 49% of its draws exceed 1,000,000 (P(X > n) ~ n^(1-a) / ((a-1) zeta(a))), so clipping
  into ``[0, rows)`` would pile half of all lookups onto one row. We instead sample the exact
  *truncated* Zipf law p(k) ~ k^-a on ranks k = 1..rows by inverting its CDF (identical in law to
  ``numpy.random.zipf(a)`` conditioned on ``< rows + 1``, i.e. rejection sampling, without the rejection).
* **Hashing.** Rank r (0 = hottest) is mapped to row ``(r * 2654435761 + 7919 * t) mod rows`` for table
  t, a bijection whenever gcd(2654435761, rows) = 1 (2654435761 is prime, so every row count we use),
  with a seeded permutation as fallback. Hot ids are thus spread over the table as hashed feature ids
  are in practice, rather than packed into the first cache lines, and differ per table.
* **Uniform.** ``rng.integers(0, rows)``.

Every sample has exactly ``pooling`` ids, so offsets are ``arange(0, batch*pooling + 1, pooling)``.
``num_batches`` distinct batches are generated and the timed loop cycles through them, so a step never
reuses the previous step's ids (a cache-warm single batch would flatter every implementation).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

HASH_MULT = 2654435761
ZIPF_ALPHA = 1.05


@dataclass(frozen=True)
class Workload:
    """One benchmark configuration; ``name`` labels the variation in the JSON output."""

    name: str = "standard"
    tables: int = 8
    rows: int = 1_000_000
    dim: int = 64
    batch: int = 4096
    pooling: int = 20
    ids: str = "zipf"  # "zipf" | "uniform"
    seed: int = 1234
    num_batches: int = 4

    def with_(self, **kw: object) -> Workload:
        return replace(self, **kw)  # type: ignore[arg-type]

    @property
    def ids_per_step(self) -> int:
        return self.tables * self.batch * self.pooling

    def table_bytes(self) -> int:
        """Bytes of all float32 weight tables (one slot of the same shape costs as much again)."""
        return self.tables * self.rows * self.dim * 4


STANDARD = Workload()

# The variations of the standard workload (applied one at a time).
VARIATIONS: dict[str, dict[str, object]] = {
    "standard": {},
    "dim16": {"dim": 16},
    "dim128": {"dim": 128},
    "dim256": {"dim": 256},
    "pool1": {"pooling": 1},
    "pool100": {"pooling": 100},
    "rows100k": {"rows": 100_000},
    # 8 x 10M x 64 fp32 is 20.5 GB of weights alone: with an Adagrad slot it cannot fit this 24 GiB
    # machine, so the 10M-row case keeps 2 tables (5.1 GB of weights, still far beyond any cache).
    "rows10m": {"rows": 10_000_000, "tables": 2},
    # Small batches, where fixed costs dominate (issue 16): 8 tables of 2000 x 24, one id per bag, batch
    # 512 (``--batch 64`` / ``--batch 2048`` for the other sizes); and 26 tables of 100k x 16 at batch 64.
    "small": {"tables": 8, "rows": 2000, "dim": 24, "pooling": 1, "batch": 512},
    "ctr26": {"tables": 26, "rows": 100_000, "dim": 16, "pooling": 1, "batch": 64},
}


def variation(vname: str, /, ids: str = "zipf", **overrides: object) -> Workload:
    """The standard workload with variation ``vname`` applied; ``overrides`` (e.g. ``name``) win."""
    kw: dict[str, object] = {"name": vname, **VARIATIONS[vname], "ids": ids, **overrides}
    return STANDARD.with_(**kw)


@dataclass
class Batch:
    """One step's input: ``ids[t]`` (int64, length batch*pooling) and the shared ``offsets``."""

    ids: list[np.ndarray]
    offsets: np.ndarray
    unique_rows: list[int] = field(default_factory=list)

    @property
    def total_unique(self) -> int:
        return sum(self.unique_rows)


def _rank_to_row(ranks: np.ndarray, rows: int, table: int, rng: np.random.Generator) -> np.ndarray:
    if math.gcd(HASH_MULT, rows) == 1:
        return ((ranks.astype(np.uint64) * np.uint64(HASH_MULT) + np.uint64(7919 * table)) % np.uint64(rows)).astype(
            np.int64
        )
    perm = rng.permutation(rows)
    return perm[ranks]


def _zipf_cdf(rows: int, alpha: float) -> np.ndarray:
    w = np.arange(1, rows + 1, dtype=np.float64) ** (-alpha)
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    return cdf


def make_batches(wl: Workload) -> list[Batch]:
    """Generate ``wl.num_batches`` deterministic batches (same seed -> same ids, on any machine)."""
    return list(iter_batches(wl))


def iter_batches(wl: Workload) -> Iterator[Batch]:
    """``make_batches``' batches one at a time (the same ids), for runs whose batches would not fit in memory
    together."""
    rng = np.random.default_rng(wl.seed)
    n = wl.batch * wl.pooling
    cdf = _zipf_cdf(wl.rows, ZIPF_ALPHA) if wl.ids == "zipf" else None
    offsets = np.arange(0, n + 1, wl.pooling, dtype=np.int64)
    for _ in range(wl.num_batches):
        ids = []
        for t in range(wl.tables):
            if cdf is not None:
                ranks = np.searchsorted(cdf, rng.random(n), side="right")
                np.minimum(ranks, wl.rows - 1, out=ranks)
                ids.append(_rank_to_row(ranks, wl.rows, t, rng))
            elif wl.ids == "uniform":
                ids.append(rng.integers(0, wl.rows, n, dtype=np.int64))
            else:
                raise ValueError(f"unknown id distribution {wl.ids!r}")
        uniq = [int(np.unique(x).size) for x in ids]
        yield Batch(ids=ids, offsets=offsets, unique_rows=uniq)


def activation_grad(wl: Workload) -> np.ndarray:
    """The fixed random d(loss)/d(acts), shape [batch, tables*dim] (table t at columns t*dim:(t+1)*dim).

    The loss of a training step is ``(acts * grad).sum()``, so ``grad`` is exactly what reaches the
    embedding backward, identically for every implementation.
    """
    rng = np.random.default_rng(wl.seed + 1)
    return rng.standard_normal((wl.batch, wl.tables * wl.dim), dtype=np.float32)


def initial_weights(wl: Workload, table: int) -> np.ndarray:
    """Deterministic initial weights for correctness checks (small workloads only)."""
    rng = np.random.default_rng(wl.seed + 100 + table)
    return rng.uniform(-0.05, 0.05, (wl.rows, wl.dim)).astype(np.float32)
