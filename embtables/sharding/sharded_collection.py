"""``ShardedEmbeddingCollection``: the tables of a resolved config sharded over the ranks of a process
group, with the same lookup and update semantics as the single-process ``EmbeddingCollection``.

Each rank holds, per table, the rows its ``TablePlan`` gives it (a div block, a mod stride, or the
whole table on one rank), as an ordinary single-process collection over those local rows, so the
fused update, the native kernels and every check of the engine apply unchanged. One step:

1. Lookup: each rank deduplicates the ids of its own batch per table, sends each unique id to its
   owner, the owner answers with the rows, and the rank pools its bags locally from those rows
   (``routing``: three messages per step for all tables together). Pooling next to the batch keeps
   the activations bit-identical to a single-process lookup, and sends one row per unique id instead
   of one partial sum per bag and owner.
2. Update: each rank sums its gradients per unique id and sends the sums to the owners, which add
   the contributions of all ranks and run the fused optimizer on their rows. Gradients are summed
   over ranks, not averaged (spec §10.7). Tables without gradient accumulation send every occurrence
   instead, in the order a single process would apply the concatenated global batch (rank-major,
   then spec §10.2's sample-major order), so their updates are bit-identical to it.

Every rank agrees on refusing a step: a bad batch or gradient on one rank raises on all of them
(carried in the exchanges' own messages), and an update that would not be finite on one rank's
rows is refused on all, with no table changed anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from embtables.config import ResolvedConfig, ResolvedTable
from embtables.errors import ConfigError, InputError
from embtables.kernels.lookup import occurrence_gradients, pooled_lookup
from embtables.kernels.segments import dedup_sum
from embtables.kernels.subnormals import flush
from embtables.sharding import comm, dynamic_keys, owner_pooling, routing
from embtables.sharding.fingerprint import describe_config, differences, fingerprint
from embtables.sharding.plan import Placement, TablePlan
from embtables.tables import phase_profile
from embtables.tables.backends.interface import OUT_OF_MEMORY, OUT_OF_RANGE, PREPARED, BagPart
from embtables.tables.collection import CheckedStep, EmbeddingCollection
from embtables.tables.engine import LocalTables
from embtables.tables.initializers import default_initializer
from embtables.tables.inputs import FeatureBatch
from embtables.tables.offload_initial import OffloadShard, table_seed
from embtables.tables.offloaded_tables import Admission, required
from embtables.tables.state import LocalShard
from embtables.tables.table_gradient import TableGradient
from embtables.tables.value_bounds import NonFiniteUpdateError


@dataclasses.dataclass(frozen=True)
class _Rows:
    """An initializer that returns fixed rows (this rank's slice of the table's initial values)."""

    rows: Tensor

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
        return self.rows.to(dtype)


@dataclasses.dataclass(eq=False)
class LookupContext:
    """What a training lookup's exchange left for its update: the routes of the row-returning tables
    and the requests of the tables pooled on their owners."""

    routes: list[routing.TableRoute]
    pooled: owner_pooling.PooledContext | None


class ShardedEmbeddingCollection(LocalTables):
    """Sharded tables over ``group`` (the default process group when None).

    Args:
      resolved: the resolved config (identical on every rank; checked at construction).
      device: where the local rows live.
      placements: table name -> ``Placement`` (strategy, and the rank of a whole table).
    """

    def device_checks(self) -> None:
        """None: a sharded step raises its errors in the call (every rank agrees on them)."""
        return None

    def __init__(
        self,
        resolved: ResolvedConfig,
        device: torch.device,
        placements: dict[str, Placement],
        group: Any = None,
        settings: dict[str, Any] | None = None,
        owner_pooled: set[str] | None = None,
    ) -> None:
        self.resolved = resolved
        self.group = group
        self.rank, self.world = comm.get_rank(group), comm.get_world_size(group)
        self.background_exchange = False  # pipelined: chosen by engine_choice (``exchange_thread.choose``)
        # an offloaded table pools on its owners too (their caches admit the ids asked of them first): the same
        # sums, in the same order, as the same table in memory
        eligible = {t.name for t in resolved.tables if owner_pooling.owner_pooled(t, resolved)}
        pooled = eligible if owner_pooled is None else eligible & set(owner_pooled)
        # Which tables pool on their owners changes the float32 summation order: every rank must agree.
        checked = {**(settings or {}), "owner_pooled": sorted(pooled)}
        digest = _check_same_config_everywhere(resolved, placements, group, checked)
        self.tag = int(digest[:15], 16)  # the tables' fingerprint in every phase header (63 bits)
        for t in resolved.tables:  # every rank holds the same (agreed) config, so every rank raises together
            by_row = placements[t.name].strategy != "table"
            if t.config.dynamic is not None and by_row and t.vocabulary_size < self.world:
                raise ConfigError(
                    f"table {t.name!r}: a dynamic table sharded by row gives every rank rows for the keys it owns, so "
                    f"its capacity (vocabulary_size={t.vocabulary_size}) must be at least the {self.world} ranks. "
                    "Raise vocabulary_size, or place the table whole on one rank."
                )
        self.plans: dict[str, TablePlan] = {}
        local_tables = []
        offload: dict[str, OffloadShard] = {}
        for t in resolved.tables:
            plan = TablePlan.of(placements[t.name], t.vocabulary_size, self.world)
            self.plans[t.name] = plan
            owned = plan.owned_rows(self.rank)
            if t.config.offload is not None:  # its files hold this rank's rows, initialized when first read
                config = dataclasses.replace(t.config, vocabulary_size=max(1, owned))
                shard, seed = f"w{self.world}r{self.rank}", table_seed(t)
                # a div block or a whole table (stride 1), a mod stride (W), or no rows (a one-row placeholder drawn
                # as row 0): no [N] row ids made or kept, so the memory is the cache's
                span = plan.affine_rows(self.rank)
                offload[t.name] = OffloadShard(t, shard, seed, first=span.first if owned else 0, stride=span.stride)
                local_tables.append(dataclasses.replace(t, config=config))
                continue
            if t.config.dynamic is not None:  # rows get their initial values when given to a key (spec §11)
                config = dataclasses.replace(t.config, vocabulary_size=max(1, owned))
                local_tables.append(dataclasses.replace(t, config=config))
                continue
            rows = plan.global_rows(self.rank)
            init = t.config.initializer or default_initializer(t.dim)
            full = init((t.vocabulary_size, t.dim), torch.float32)
            # A rank with no rows of a table keeps one dummy row (never looked up, never gathered).
            local = full.detach()[rows] if rows.numel() else torch.zeros(1, t.dim)
            config = dataclasses.replace(t.config, vocabulary_size=int(local.shape[0]), initializer=_Rows(local))
            local_tables.append(dataclasses.replace(t, config=config))
        # every rank raises the same error in the call that finds it: no error is left for a later call
        self.local = EmbeddingCollection(
            dataclasses.replace(resolved, tables=tuple(local_tables)), device, deferred_errors=False, offload=offload
        )
        # Owned rows per table (local rows may add one placeholder row when a rank owns none).
        self._owned_rows = {t.name: self.plans[t.name].owned_rows(self.rank) for t in resolved.tables}
        # a half-precision table rounds each row's update with the row's global id (spec §12): the same bits
        # for any W and strategy (the placeholder row, never written, gets the id V)
        half = [
            t for t in resolved.tables
            if t.config.half and t.config.dynamic is None and t.name not in self.local.offloaded  # its cache's own
        ]  # fmt: skip
        self.local.set_global_rows({t.name: self.plans[t.name].affine_rows(self.rank) for t in half})
        # A summed gradient of an owner-pooled table overflowed here: ``check`` refuses the update on every rank.
        self._sums_overflow = False
        self.row_tables = [t for t in resolved.tables if t.name not in pooled]
        self.pooled_tables = [t for t in resolved.tables if t.name in pooled]
        self._pooled_features = sorted(f for t in self.pooled_tables for f in t.feature_indices)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a ShardedEmbeddingCollection lives in several processes; it cannot be copied or pickled.")

    def check_phase(self, phase: str, step: int) -> None:
        """Every rank confirms it is in the same operation (``comm.PHASES``) of the same step before the
        operation's first exchange; ranks out of step raise ``CollectiveError`` on every rank."""
        with phase_profile.phase("phase header"):
            comm.check_phase(phase, step, self.tag, self.group)

    # ------------------------------------------------------------------ dynamic tables (spec §11.4)
    def translate_keys(
        self,
        batches: Sequence[FeatureBatch],
        training: bool,
        step: int,
        pin_from: int,
        refused: BaseException | None = None,
    ) -> list[FeatureBatch]:
        """Dynamic features' keys turned into global rows by their owners' key maps (collective; every
        rank raises when any rank refused its batch, before any map changes)."""
        room = None
        if any(t.config.dynamic is not None and t.config.offload is not None for t in self.resolved.tables):
            room = functools.partial(self._agree_room, pin_from=pin_from)
        out, refusing = dynamic_keys.translate_sharded(
            self.resolved, self.plans, self.local.vocabularies, self.local.reset_rows, batches, training, step,
            pin_from, refused is not None, self.group, room,
        )  # fmt: skip
        if refusing:
            self._raise_refused(refused, refusing, "batch")
        return out

    def _agree_room(self, asked: list[tuple[str, Tensor]], pin_from: int) -> None:
        """Raise on every rank when the row cache of any rank's dynamic offloaded table could not hold a row for
        each distinct key asked of it (``keys`` [K] per table) beside the rows still in use: collective, before
        any key map changes (one flag; the reasons only when some rank refused)."""
        mine: InputError | None = None
        try:
            for name, keys in asked:
                cache = self.local.offloaded.get(name)
                if cache is not None and keys.numel():
                    cache.check_room(int(torch.unique(keys).numel()), pin_from)
        except InputError as exc:
            mine = exc
        if comm.any_rank(mine is not None, self.group):
            self._raise_refused(mine, None, "lookup")

    def vocabulary_state(self) -> dict[str, dict[str, Tensor]]:
        """Every dynamic table's logical vocabulary, gathered on every rank (collective)."""
        return dynamic_keys.gather_vocabularies(
            self.resolved, self.plans, self.local.vocabularies, self._owned_rows, self.group
        )

    def load_vocabulary_state(self, values: dict[str, dict[str, Tensor]], step: int) -> None:
        """Keep this rank's part of logical vocabularies (already validated as a whole)."""
        self.local.vocabularies.load(
            dynamic_keys.local_vocabularies(values, self.plans, self.local.vocabularies, self.rank), step
        )

    def prefetch_rows(self, batches: Sequence[FeatureBatch]) -> None:
        """Start reading the rows of this rank's staged batch that this rank owns (an offloaded table's); the
        rows other ranks ask for are known only when the lookup routes them (read then, at admission). A dynamic
        table's batch holds keys, not rows: not read ahead."""
        for t in self.resolved.tables:
            cache = self.local.offloaded.get(t.name)
            if cache is None or not t.feature_indices or t.config.dynamic is not None:
                continue
            ids = torch.cat([batches[f].ids for f in t.feature_indices]).to("cpu", torch.int64)
            ids = ids[(ids >= 0) & (ids < t.vocabulary_size)]
            rank, local = self.plans[t.name].owner(ids)
            cache.prefetch(local[rank == self.rank])

    def offload_statistics(self) -> dict[str, dict[str, float]]:
        """Per offloaded table, every counter summed over the ranks (collective)."""
        everyone = comm.all_gather_object(self.local.offloaded.statistics(), self.group)
        return {name: {k: sum(r[name][k] for r in everyone) for k in everyone[0][name]} for name in everyone[0]}

    def vocabulary_statistics(self) -> dict[str, dict[str, int]]:
        """Per dynamic table, every counter summed over the ranks (collective); ``capacity`` is V."""
        mine = {name: m.stats() for name, m in self.local.vocabularies.maps.items()}
        everyone = comm.all_gather_object(mine, self.group)
        out = {}
        for t in self.resolved.tables:
            if t.config.dynamic is not None:
                summed = {k: sum(r[t.name][k] for r in everyone) for k in mine[t.name]}
                out[t.name] = {**summed, "capacity": t.vocabulary_size}
        return out

    # ------------------------------------------------------------------ forward
    def lookup(
        self,
        batches: Sequence[FeatureBatch],
        refused: BaseException | None = None,
        concat: bool = False,
        admission: Admission | None = None,
    ) -> tuple[list[Tensor], LookupContext]:
        """Activations per feature [*out_shape, D] of this rank's batch (``concat``: one [B, sum(D)]
        tensor), and the routes for its update.

        ``refused`` is this rank's validation error for its batch (its ids then take no part): every
        rank raises when any rank's batch was refused, so all stay in step. ``admission``: the lookup's step,
        pinned steps and mode, with which the rows other ranks ask of this rank's offloaded tables are brought
        into memory (needed when it has offloaded tables)."""
        admit = functools.partial(self._admit_offloaded, admission=admission)
        tables = self.row_tables
        routes: list[routing.TableRoute] = []
        out: list[Tensor | None] = [None] * len(self.resolved.features)
        if tables:  # the row-returning tables (their exchange carries the refusal agreement)
            routes = self._routes(batches, refused)
            for t, route in zip(tables, routes):
                if route.recv_rows.numel() and int(route.recv_rows.max()) >= self._owned_rows[t.name]:
                    raise RuntimeError(f"table {t.name!r}: a rank asked rank {self.rank} for a row it does not hold.")
            # an offloaded table's rows are brought into its cache, then answered and updated in its slots
            slots = admit([(t.name, route.recv_rows) for t, route in zip(tables, routes)])
            routes = [dataclasses.replace(route, recv_rows=s) for route, s in zip(routes, slots)]
            answers = []
            with phase_profile.phase("lookup: answer rows"):
                for t, route in zip(tables, routes):
                    answers.append(self.local.states[t.name].weights.index_select(0, route.recv_rows))
            with phase_profile.phase("lookup: exchange rows"):
                dims = [t.dim for t in tables]
                minis = routing.exchange_rows(answers, routes, dims, self.rank, self.world, self.group)
            with phase_profile.phase("lookup: pool"):
                out = self._pool(batches, routes, minis)
        pooled = None
        if self._pooled_features:
            with phase_profile.phase("lookup: owner pooling"):
                acts, pooled, refusing = owner_pooling.pooled_lookup_exchange(
                    self._pooled_features, batches, self.resolved, self.plans, self.local, self.rank, self.world,
                    self.group, refused=refused is not None and not tables, admit=admit,
                )  # fmt: skip
            if refusing:
                self._raise_refused(refused, refusing, "batch")
            for f, a in acts.items():
                out[f] = a.reshape(*batches[f].out_shape, a.shape[1])
        result = [a for a in out if a is not None]
        with phase_profile.phase("lookup: finite check"):
            self._check_activations(result)
        if concat:
            result = [torch.cat(result, dim=1)]
        return result, LookupContext(routes, pooled)

    def _routes(self, batches: Sequence[FeatureBatch], refused: BaseException | None) -> list[routing.TableRoute]:
        """Each row table's unique ids routed to their owners and exchanged; every rank raises here when
        any rank refused its batch."""
        routed = []
        with phase_profile.phase("lookup: route ids"):
            for t in self.row_tables:
                if refused is None:
                    ids = torch.cat([batches[f].ids for f in t.feature_indices])
                else:
                    ids = torch.empty(0, dtype=torch.int64, device=self.device)
                routed.append(routing.route_ids(ids, self.plans[t.name]))
        wanted = [(r.local, r.send_counts) for r in routed]
        with phase_profile.phase("lookup: exchange ids"):
            asked, refusing = routing.exchange_ids(wanted, refused is not None, self.world, self.group)
        if refusing:
            self._raise_refused(refused, refusing, "batch")
        return [routing.TableRoute(r, recv_rows, recv_counts) for r, (recv_rows, recv_counts) in zip(routed, asked)]

    def _admit_offloaded(self, wanted: Sequence[tuple[str, Tensor]], admission: Admission | None) -> list[Tensor]:
        """Bring the local rows [any] other ranks asked of this rank, per table (``wanted``), into its row caches
        (offloaded tables); every rank raises when any rank's cache refused (one exchange, only with offloaded
        tables)."""
        if not self.local.offloaded:
            return [rows for _, rows in wanted]
        when = required(admission)  # a bug otherwise: every rank raises it here, before the agreement
        error: str | None = None
        slots: list[Tensor] = []
        try:
            slots = self.local.offloaded.admit_rows(wanted, when)
        except (InputError, RuntimeError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        if not comm.any_rank(error is not None, self.group):  # the common case: one flag, not the messages
            return slots
        errors = comm.all_gather_object(error, self.group)
        refusing = [r for r, e in enumerate(errors) if e is not None]
        raise InputError(f"rank {refusing[0]} refused the lookup: {errors[refusing[0]]}")

    def _check_activations(self, result: list[Tensor]) -> None:
        self.local.check_activations(result)

    def _pool(
        self, batches: Sequence[FeatureBatch], routes: list[routing.TableRoute], minis: list[Tensor]
    ) -> list[Tensor | None]:
        """Pool the row-returning tables' bags from their looked-up unique rows (one backend call for all)."""
        out: list[Tensor | None] = [None] * len(batches)
        fast: list[tuple[int, int]] = []
        parts: list[BagPart] = []
        for t, route, mini in zip(self.row_tables, routes, minis):
            positions = torch.split(route.ids.inverse, [batches[f].ids.numel() for f in t.feature_indices])
            for f, local_ids in zip(t.feature_indices, positions):
                b = batches[f]
                q = t.config.quantization_config
                if q is None:
                    fast.append((f, t.dim))
                    parts.append((mini, local_ids, b.offsets, b.coeffs))
                    continue
                quant = (q.num_buckets, float(q.lower), float(q.upper))
                acts = pooled_lookup(mini, local_ids, b.seg, b.offsets, b.coeffs, quantization=quant)
                out[f] = acts.reshape(*b.out_shape, t.dim)
        if fast:
            acts_list, status = self.local.pool(parts)
            if status == OUT_OF_RANGE:
                raise RuntimeError("the sharded lookup produced positions outside the looked-up rows (a bug).")
            for (f, dim), acts in zip(fast, acts_list):
                out[f] = acts.reshape(*batches[f].out_shape, dim)
        return out

    def _raise_refused(self, mine: BaseException | None, refusing: list[int] | None, what: str) -> None:
        """Raise on every rank: this rank's own error, or one naming the rank(s) that refused and why
        (``refusing`` None: the ranks that sent a reason)."""
        messages = comm.all_gather_object(None if mine is None else f"{type(mine).__name__}: {mine}", self.group)
        if mine is not None:
            raise mine
        if refusing is None:
            refusing = [r for r, m in enumerate(messages) if m is not None]
        reasons = "; ".join(f"rank {r}: {messages[r]}" for r in refusing)
        raise InputError(
            f"the {what} of another rank was refused, so this step is refused on every rank and no table or slot "
            f"was changed anywhere ({reasons})."
        )

    # ------------------------------------------------------------------ backward
    def table_gradients(
        self,
        batches: Sequence[FeatureBatch],
        grads: Sequence[Tensor | None],
        context: LookupContext,
        refused: BaseException | None = None,
    ) -> list[TableGradient]:
        """Each owner's gradients for its own rows; every rank takes part in every exchange.

        ``refused`` is this rank's error validating its gradients: every rank then raises."""
        tables = self.row_tables
        bad = refused is not None
        self._sums_overflow = False
        with phase_profile.phase("backward: sums per unique id"):
            sums = self._sums_per_unique_id(batches, grads, context) if not bad else None
        if sums is None:
            bad = True
            sums = [torch.zeros((r.ids.ids.numel(), t.dim), device=self.device) for t, r in zip(tables, context.routes)]
        with phase_profile.phase("backward: finite check"):
            bad = bad or self._gradients_not_finite(batches, grads)
        if bad and refused is None:
            refused = InputError(
                "a gradient reaching a sharded table has NaN or Inf values; no table or slot was changed on any rank."
            )
        received: list[Tensor] = []
        if tables:  # the row tables' exchange carries the refusal agreement; else the pooled one does
            with phase_profile.phase("backward: exchange sums"):
                received, refusing = routing.exchange_sums(
                    sums, context.routes, [t.dim for t in tables], bad, self.rank, self.world, self.group
                )
            if refusing:
                self._raise_refused(refused, refusing, "gradient")
        local_tables = {t.name: t for t in self.local.resolved.tables}
        out = {}
        with phase_profile.phase("backward: owner sums"):
            for t, route, got in zip(tables, context.routes, received):
                if t.optimizer.use_gradient_accumulation:
                    out[t.name] = self._owner_gradient(local_tables[t.name], route, got)
                else:
                    rows, row_grads = self._occurrences_to_owners(t, batches, grads, route)
                    out[t.name] = TableGradient(local_tables[t.name], rows, row_grads, accumulated=False)
        if context.pooled is not None:
            with phase_profile.phase("backward: owner pooling"):
                refusing = self._pooled_gradients(grads, context, local_tables, out, bad and not tables)
            if refusing:
                self._raise_refused(refused, refusing, "gradient")
        return [out[t.name] for t in self.resolved.tables]

    def gradients_finite(self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]) -> bool:
        """True when every gradient value that reaches a table is finite: this rank's whole check, local
        (the occurrences of every row table, the whole gradient of owner-pooled features), for an
        ``apply_gradients`` whose exchange runs in the background (pipelining)."""
        return not self._gradients_not_finite(batches, grads, accumulated_too=True)

    def agree_gradients(self, refused: BaseException | None) -> None:
        """One agreement round on this step's gradients: returns when no rank refused them, else raises on
        every rank (the refusing rank its own error) before anything moves."""
        if comm.any_rank(refused is not None, self.group):
            self._raise_refused(refused, None, "gradient")

    def _gradients_not_finite(
        self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None], accumulated_too: bool = False
    ) -> bool:
        """A NaN/Inf in a gradient that is sent per occurrence (no accumulation) or to the owners' pooling;
        ``accumulated_too``: also in the occurrences of row tables with accumulation (otherwise their
        per-id sums find it)."""
        return any(
            not bool(torch.isfinite(self._occurrence_grads(t, batches, grads)).all())
            for t in self.row_tables
            if accumulated_too or not t.optimizer.use_gradient_accumulation
        ) or not self.local.all_finite([g for g in (grads[f] for f in self._pooled_features) if g is not None])

    def _pooled_gradients(
        self,
        grads: Sequence[Tensor | None],
        context: LookupContext,
        local_tables: dict[str, ResolvedTable],
        out: dict[str, TableGradient],
        refused: bool,
    ) -> list[int]:
        """The owner-pooled tables' gradients into ``out``: d(activation) to the owners (with this rank's
        refusal flag), phase 1 there. Returns the refusing ranks (then nothing is summed). A sum that
        overflowed is remembered: the update's agreement (``check``) refuses it on every rank."""
        assert context.pooled is not None
        with phase_profile.phase("owner pooling: send gradients"):
            served, refusing = owner_pooling.pooled_gradient_exchange(
                self._pooled_features, grads, context.pooled, refused, self.resolved, self.rank, self.world, self.group
            )
        if refusing:
            return refusing
        finite = True
        with phase_profile.phase("owner pooling: owner sums"):
            for t in self.pooled_tables:
                tg, ok = owner_pooling.owner_table_gradient(t, local_tables[t.name], context.pooled, served, self.local)
                out[t.name] = tg
                finite = finite and ok
        self._sums_overflow = not finite
        return []

    def _sums_per_unique_id(
        self, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None], context: LookupContext
    ) -> list[Tensor] | None:
        """Each table's gradient sums per unique id of this rank's batch [U_t, D_t] in owner order
        (zeros for tables without accumulation), or None when a sum is not finite. Phase 1 runs in C
        where it can (dedup and float32 sums without materialising per-occurrence gradients)."""
        out = []
        for t, route in zip(self.row_tables, context.routes):
            s = torch.zeros((route.ids.ids.numel(), t.dim), dtype=torch.float32, device=self.device)
            if not t.optimizer.use_gradient_accumulation:
                if not bool(torch.isfinite(self._occurrence_grads(t, batches, grads)).all()):
                    return None
                out.append(s)
                continue
            parts = [(batches[f].ids, batches[f].offsets, batches[f].coeffs, grads[f]) for f in t.feature_indices]
            prepared = self.local.backend.prepare(t, parts, scratch="send")  # ids of the global table t
            if prepared is not None:
                if prepared.status == OUT_OF_MEMORY:
                    raise MemoryError(f"table {t.name!r}: out of memory while summing gradients.")
                if prepared.status != PREPARED or prepared.gradient is None:
                    return None
                summed = prepared.gradient.materialized()  # distinct rows, in any order
                assert summed.rows is not None and summed.grads is not None
                rows, row_sums = summed.rows, summed.grads
                s.index_copy_(0, route.ids.position[torch.searchsorted(route.ids.unique, rows)], row_sums)
            else:
                s = flush(s.index_add_(0, route.ids.inverse, self._occurrence_grads(t, batches, grads)))
                if not bool(torch.isfinite(s).all()):
                    return None
            out.append(s)
        return out

    def _owner_gradient(self, local_table: ResolvedTable, route: routing.TableRoute, got: Tensor) -> TableGradient:
        """The owner's summed gradient of its rows from every rank's per-id sums ``got`` [M, D] (aligned
        with ``route.recv_rows``), added in source-rank order; prepared by the local backend where it serves."""
        offsets = torch.arange(route.recv_rows.numel() + 1, dtype=torch.int64, device=got.device)
        prepared = self.local.backend.prepare(local_table, [(route.recv_rows, offsets, None, got)])
        if prepared is not None:
            if prepared.status == PREPARED and prepared.gradient is not None:
                return prepared.gradient
            if prepared.status == OUT_OF_MEMORY:
                raise MemoryError(f"table {local_table.name!r}: out of memory while summing gradients.")
        rows, row_grads = dedup_sum(route.recv_rows, got)
        return TableGradient(local_table, rows, row_grads, accumulated=True)

    def _occurrence_grads(
        self, t: ResolvedTable, batches: Sequence[FeatureBatch], grads: Sequence[Tensor | None]
    ) -> Tensor:
        """The gradient of every id occurrence of table ``t`` [N, D], features concatenated."""
        parts = []
        for f in t.feature_indices:
            g, b = grads[f], batches[f]
            if g is None:
                parts.append(torch.zeros((b.ids.numel(), t.dim), dtype=torch.float32, device=self.device))
            else:
                parts.append(occurrence_gradients(g, b.seg, b.coeffs))
        return torch.cat(parts)

    def _occurrences_to_owners(
        self,
        t: ResolvedTable,
        batches: Sequence[FeatureBatch],
        grads: Sequence[Tensor | None],
        route: routing.TableRoute,
    ) -> tuple[Tensor, Tensor]:
        """Without accumulation: every occurrence (local row, gradient) sent to its owner in spec §10.2's
        order, which the owner receives rank by rank: the order of the concatenated global batch."""
        per_id = self._occurrence_grads(t, batches, grads)
        num_features = len(t.feature_indices)
        keys = torch.cat([batches[f].sample_index() * num_features + i for i, f in enumerate(t.feature_indices)])
        order = torch.sort(keys, stable=True).indices
        owner, local = self.plans[t.name].owner(route.ids.ids[route.ids.inverse[order]])
        by_owner = torch.argsort(owner, stable=True)
        counts = [int(c) for c in torch.bincount(owner, minlength=self.world).tolist()]
        rows, recv_counts = comm.all_to_all_v(local[by_owner], counts, self.group)
        row_grads, _ = comm.all_to_all_v(per_id[order][by_owner], counts, self.group, recv_counts=recv_counts)
        return self.local.offloaded.slots(t.name, rows), row_grads  # an offloaded table's: its cache's slots

    def check(self, table_grads: Sequence[TableGradient], lrs: dict[str, float], *, step: int = 0) -> None:
        """Raise on every rank, writing nothing, when the update is refused on any rank's rows."""
        self._agreed(table_grads, lrs, step)

    def _agreed(self, table_grads: Sequence[TableGradient], lrs: dict[str, float], step: int) -> CheckedStep:
        """This rank's update checked (``EmbeddingCollection.checked_step``), and the ranks' agreement on it: raises on
        every rank, writing nothing, when it is refused on any rank's rows."""
        error: Exception | None = None
        checked = None
        if self._sums_overflow:
            error = InputError(
                f"rank {self.rank}: the summed gradient of a row of a sharded table overflows float32; no table or "
                "slot was changed on any rank. Scale the loss or the activation gradients down."
            )
        else:
            try:
                checked = self.local.checked_step(table_grads, lrs, step=step)
            except NonFiniteUpdateError as exc:  # named by its global row
                error = exc
                if exc.table is not None:
                    global_row = self.plans[exc.table.name].affine_rows(self.rank).ids(torch.tensor([exc.row]))
                    error = exc.renamed(int(global_row[0]), f"rank {self.rank}: ")
            except (ValueError, TypeError, RuntimeError) as exc:
                error = exc
        if comm.any_rank(error is not None, self.group):
            if error is not None:
                raise error
            raise InputError("the update was refused on another rank; no table or slot was changed on any rank.")
        assert checked is not None
        return checked

    def apply(self, table_grads: Sequence[TableGradient], lrs: dict[str, float], *, step: int = 0) -> None:
        """The fused update of this rank's rows; every rank applies or none does. The rows are checked once: what
        the check proved is written right after the ranks agree, nothing running in between."""
        with phase_profile.phase("update: agreement"):
            checked = self._agreed(table_grads, lrs, step)
        with phase_profile.phase("update: apply"):
            self.local.write_checked(checked)

    # ------------------------------------------------------------------ state
    def state_key_owners(self) -> dict[str, tuple[ResolvedTable, str]]:
        """``{"<table>" | "<table>/<slot>": (global table, slot)}``."""
        by_name = {t.name: t for t in self.resolved.tables}
        return {key: (by_name[table.name], slot) for key, (table, slot) in self.local.state_key_owners().items()}

    def logical_shapes(self) -> dict[str, tuple[int, int]]:
        """Every state key's full logical shape (V, D)."""
        return {key: (t.vocabulary_size, t.dim) for key, (t, _) in self.state_key_owners().items()}

    def full_state(self) -> dict[str, Tensor]:
        """``{"<table>" | "<table>/<slot>": full logical [V, D] tensor}`` gathered on every rank (collective)."""
        self.local.offloaded.whole()
        out = {}
        for key, (t, slot) in self.state_key_owners().items():
            plan = self.plans[t.name]
            tensor = self.local.whole_tensors(t.name)[slot]
            parts = comm.all_gather_v(tensor[: self._owned_rows[t.name]].contiguous(), self.group)
            full = torch.empty((t.vocabulary_size, t.dim), dtype=tensor.dtype, device=tensor.device)
            for r, part in enumerate(parts):
                full[plan.global_rows(r).to(full.device)] = part.to(full.device)
            out[key] = full
        return out

    def load_logical(self, values: dict[str, Tensor]) -> None:
        """Keep this rank's rows of full logical tables/slots ``{key: [V, D]}`` (already validated)."""
        owners = self.state_key_owners()
        self.local.offloaded.whole(self.rewritten_tables(values))
        with torch.no_grad():
            for key, value in values.items():
                t, slot = owners[key]
                n = self._owned_rows[t.name]
                if n == 0:
                    continue
                rows = self.plans[t.name].global_rows(self.rank).to(value.device)
                target = self.local.whole_tensors(t.name)[slot]
                target[:n].copy_(value.index_select(0, rows).to(target.device, target.dtype))

    def local_shards(self, whole: bool = True) -> dict[str, LocalShard]:
        """``{table: LocalShard}``: this rank's rows with their global row ids, as live storage (``whole``: as
        ``OneProcessEngine.local_shards``)."""
        if whole:
            self.local.offloaded.whole()
        out = {}
        for t in self.resolved.tables:
            n = self._owned_rows[t.name]
            tensors = {slot: x[:n] for slot, x in self.local.whole_tensors(t.name).items()}
            rows = self.plans[t.name].global_rows(self.rank)
            out[t.name] = LocalShard(t.name, t.vocabulary_size, rows, tensors, self.local.offloaded.get(t.name))
        return out


def _check_same_config_everywhere(
    resolved: ResolvedConfig, placements: dict[str, Placement], group: Any,
    settings: dict[str, Any],
) -> str:  # fmt: skip
    """Exchange the hash of the config and the module's settings (pipelining) once; raise on every
    rank, naming the differences, when they differ. Returns the hash (hex)."""
    mine = {**describe_config(resolved, placements), "settings": settings}
    everyone = comm.all_gather_object((fingerprint(mine), mine), group)
    rank = comm.get_rank(group)
    for r, (digest, theirs) in enumerate(everyone):
        if digest != everyone[0][0]:
            other = everyone[0][1] if r != 0 else theirs
            diff = "; ".join(differences(everyone[r][1], other))
            raise ValueError(
                f"DistributedEmbedding (rank {rank}): the ranks were built from different configs; rank {r} differs "
                f"from rank 0: {diff}. Build the module from the same feature_config, optimizer, sharding and "
                "pipeline_execution_with_tensor_core on every rank."
            )
    return str(everyone[0][0])
