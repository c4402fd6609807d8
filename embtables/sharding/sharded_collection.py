"""``ShardedEmbeddingCollection``: the tables of a resolved config row-sharded over the ranks of a process
group, with the same lookup and update semantics as the single-process ``EmbeddingCollection``.

Each rank holds, per table, the rows its ``TablePlan`` gives it, as an ordinary single-process
collection over those local rows (so the fused update, the native kernels and every check of the
engine apply unchanged). One step:

1. Lookup: each rank deduplicates the ids of its own batch per table, sends each unique id to its
   owner (``all_to_all_v``), the owner answers with the rows, and the rank pools its bags locally from
   those rows. The activations are bit-identical to a single-process lookup.
2. Update: each rank sums its gradients per unique id and sends the sums to the owners, which add the
   contributions of all ranks (in rank order) and run the fused optimizer on their rows. Gradients are
   summed over ranks, not averaged (SPEC 10.7). The sums are grouped per rank first, so tables equal a
   single-process run to float32 rounding of the gradient sums (SPEC 10.8).

Not yet supported (refused at construction): ``use_gradient_accumulation=False``, whose occurrences
need a global order across ranks. The ``DistributedEmbedding`` wiring, pipelining and statistics are
issue 7's remaining work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.errors import InputError
from embtables.kernels import native
from embtables.kernels.lookup import occurrence_gradients, pooled_lookup
from embtables.kernels.segments import dedup_sum
from embtables.sharding import comm
from embtables.sharding.plan import TablePlan
from embtables.tables.collection import EmbeddingCollection, TableGradient
from embtables.tables.initializers import default_initializer
from embtables.tables.inputs import FeatureBatch


@dataclasses.dataclass(frozen=True)
class _Rows:
    """An initializer that returns fixed rows (this rank's slice of the table's initial values)."""

    rows: Tensor

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
        return self.rows.to(dtype)


@dataclasses.dataclass(eq=False)
class _Exchange:
    """What a table's lookup exchange left for its update: unique ids [U] of this rank's batch, each
    feature's ids as positions in them, and the routing of the unique ids to their owners."""

    inverse: list[Tensor]
    order: Tensor  # unique ids sorted by owner rank
    send_counts: list[int]
    recv_local: Tensor  # local rows other ranks asked this rank for, in source-rank order
    recv_counts: list[int]
    num_unique: int


class ShardedEmbeddingCollection:
    """Row-sharded tables over ``group`` (the default process group when None).

    Args:
      resolved: the resolved config (identical on every rank).
      device: where the local rows live.
      strategies: table name -> "div", "mod" or "table".
      table_ranks: for "table" tables, the rank that holds the whole table.
    """

    def __init__(
        self,
        resolved: ResolvedConfig,
        device: torch.device,
        strategies: dict[str, str],
        table_ranks: dict[str, int] | None = None,
        group: Any = None,
    ) -> None:
        self.resolved = resolved
        self.group = group
        self.rank, self.world = comm.get_rank(group), comm.get_world_size(group)
        self.plans: dict[str, TablePlan] = {}
        local_tables = []
        for t in resolved.tables:
            if not t.optimizer.use_gradient_accumulation:
                raise NotImplementedError(
                    f"table {t.name!r}: use_gradient_accumulation=False is not sharded yet (its occurrences need "
                    "one global order across ranks). Use gradient accumulation, or one process."
                )
            plan = TablePlan(strategies[t.name], t.vocabulary_size, self.world, (table_ranks or {}).get(t.name, 0))
            self.plans[t.name] = plan
            rows = plan.global_rows(self.rank)
            init = t.config.initializer or default_initializer(t.dim)
            full = init((t.vocabulary_size, t.dim), torch.float32)
            # A rank with no rows of a table keeps one dummy row (never looked up, never gathered).
            local = full.detach()[rows] if rows.numel() else torch.zeros(1, t.dim)
            config = dataclasses.replace(t.config, vocabulary_size=int(local.shape[0]), initializer=_Rows(local))
            local_tables.append(dataclasses.replace(t, config=config))
        self.local = EmbeddingCollection(dataclasses.replace(resolved, tables=tuple(local_tables)), device)
        self._exchanges: dict[str, _Exchange] = {}

    @property
    def device(self) -> torch.device:
        return self.local.device

    def _owned_rows(self, table: ResolvedTable) -> int:
        return self.plans[table.name].shard_sizes()[self.rank]

    # ------------------------------------------------------------------ forward
    def lookup(self, batches: Sequence[FeatureBatch]) -> list[Tensor]:
        """Activations per feature [*out_shape, D] of this rank's batch (validated against the global V)."""
        out: list[Tensor | None] = [None] * len(batches)
        for t in self.resolved.tables:
            plan = self.plans[t.name]
            feats = t.feature_indices
            ids = torch.cat([batches[f].ids for f in feats])
            uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
            owner, local = plan.owner(uniq)
            order = torch.argsort(owner, stable=True)
            send_counts = torch.bincount(owner, minlength=self.world).tolist()
            recv_local, recv_counts = comm.all_to_all_v(local[order], send_counts, self.group)
            weights = self.local.states[t.name].weights
            if recv_local.numel() and int(recv_local.max()) >= self._owned_rows(t):
                raise InputError(f"table {t.name!r}: a rank asked for a row this rank does not hold.")
            answer = weights.index_select(0, recv_local)
            rows_back, _ = comm.all_to_all_v(answer, recv_counts, self.group)
            mini = torch.empty((uniq.numel(), t.dim), dtype=torch.float32, device=weights.device)
            mini[order] = rows_back
            parts = list(torch.split(inverse, [batches[f].ids.numel() for f in feats]))
            self._exchanges[t.name] = _Exchange(parts, order, send_counts, recv_local, recv_counts, uniq.numel())
            q = t.config.quantization_config
            for f, local_ids in zip(feats, parts):
                b = batches[f]
                if q is None and native.usable(mini, local_ids, b.offsets, b.coeffs):
                    (acts,), status = native.lookup_many([(mini, local_ids, b.offsets, b.coeffs)])
                    if status != 0:
                        raise InputError(f"feature {self.resolved.features[f].name!r}: the lookup failed ({status}).")
                else:
                    quant = None if q is None else (q.num_buckets, float(q.lower), float(q.upper))
                    acts = pooled_lookup(mini, local_ids, b.seg, b.offsets, b.coeffs, quantization=quant)
                out[f] = acts.reshape(*b.out_shape, t.dim)
        return [a for a in out if a is not None]

    # ------------------------------------------------------------------ backward
    def check_gradient(self, feature_index: int, batch: FeatureBatch, grad: Any) -> Tensor | None:
        return self.local.check_gradient(feature_index, batch, grad)

    def table_gradients(self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]) -> list[TableGradient]:
        """Each owner's summed gradients for its own rows (every rank takes part in every exchange)."""
        out = []
        bad = False
        for t, local_table in zip(self.resolved.tables, self.local.resolved.tables):
            ex = self._exchanges[t.name]
            per_id = []
            for f, local_ids in zip(t.feature_indices, ex.inverse):
                g, b = grads[f], batches[f]
                if g is None:
                    per_id.append(torch.zeros((local_ids.numel(), t.dim), dtype=torch.float32, device=self.device))
                else:
                    per_id.append(occurrence_gradients(g, b.seg, b.coeffs))
            sums = torch.zeros((ex.num_unique, t.dim), dtype=torch.float32, device=self.device)
            sums.index_add_(0, torch.cat(ex.inverse), torch.cat(per_id))
            received, _ = comm.all_to_all_v(sums[ex.order], ex.send_counts, self.group)
            rows, row_grads = dedup_sum(ex.recv_local, received)
            bad = bad or not bool(torch.isfinite(row_grads).all())
            out.append(TableGradient(local_table, rows, row_grads, accumulated=True))
        if comm.any_rank(bad, self.group):
            raise InputError(
                "a gradient reaching a sharded table has NaN or Inf values (on this or another rank); no table or "
                "slot was changed on any rank."
            )
        return out

    def learning_rates(self) -> dict[str, float]:
        return self.local.learning_rates()

    def apply(self, table_grads: Sequence[TableGradient], lrs: dict[str, float]) -> None:
        """The fused update of this rank's rows; every rank applies or none does."""
        error: Exception | None = None
        try:
            self.local.check(table_grads, lrs)
        except (ValueError, TypeError, RuntimeError) as exc:
            error = exc
        if comm.any_rank(error is not None, self.group):
            if error is not None:
                raise error
            raise InputError("the update was refused on another rank; no table or slot was changed on any rank.")
        self.local.apply(table_grads, lrs)

    # ------------------------------------------------------------------ state
    def full_state(self) -> dict[str, Tensor]:
        """``{"<table>" | "<table>/<slot>": full logical [V, D] tensor}`` gathered on every rank."""
        out = {}
        for t in self.resolved.tables:
            plan = self.plans[t.name]
            n = self._owned_rows(t)
            for slot, tensor in self.local.states[t.name].tensors().items():
                parts = comm.all_gather_v(tensor[:n].contiguous(), self.group)
                full = torch.empty((t.vocabulary_size, t.dim), dtype=tensor.dtype, device=tensor.device)
                for r, part in enumerate(parts):
                    full[plan.global_rows(r).to(full.device)] = part
                out[f"{t.name}/{slot}" if slot else t.name] = full
        return out
