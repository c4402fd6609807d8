"""The step pipeline: what lives between the TF verbs of one ``DistributedEmbedding``.

``enqueue`` stages a batch, ``dequeue`` looks it up, ``apply_gradients`` updates the tables for the
last training lookup. In between, this module holds the staged batch, the last training lookup, the
update held back by pipelining (spec §6) with the pre-update rows an observer must not change, and,
when sharded and pipelined, the one thread every collective runs on, in program order, with the
work it runs in the background: the early lookup, the gradient exchange and sums of the last
``apply_gradients``, and the landing of the held-back update.

Every method expects the caller (the facade) to hold ``lock``: one thread at a time touches tables,
slots and the native workspaces (ctypes releases the GIL, so two threads could otherwise race in C).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from embtables.errors import InputError
from embtables.sharding.lookup_stats import LookupStatsRecorder
from embtables.tables import phase_profile
from embtables.tables.batch_ownership import batch_pointers, detached
from embtables.tables.engine import Engine
from embtables.tables.inputs import FeatureBatch
from embtables.tables.offloaded_tables import Admission
from embtables.tables.state import LocalShard
from embtables.tables.table_gradient import TableGradient

logger = logging.getLogger("embtables")

_T = TypeVar("_T")


@dataclasses.dataclass(eq=False)
class Staged:
    """An enqueued batch: its features (None when refused), the mode, and, when sharded, this rank's
    validation error (raised on every rank at the lookup) and the lookup started early by pipelining."""

    batches: list[FeatureBatch] | None
    training: bool
    step: int  # the training step it looks up for (its phase header's step)
    refused: BaseException | None = None
    prefetch: concurrent.futures.Future[tuple[list[Tensor], Any, list[FeatureBatch]]] | None = None


@dataclasses.dataclass(eq=False)
class Lookup:
    """What the last training lookup left for ``apply_gradients``: F batches and F activations."""

    batches: list[FeatureBatch]
    activations: list[Tensor]
    context: Any = None


@dataclasses.dataclass(eq=False)
class PendingUpdate:
    """A validated update held back one step by pipelining (spec §6). It is checked as it lands (the program may
    edit the tables before then); sharded, the ranks agree on it there, and a refusal is raised by the next call.
    In one process it was checked at ``apply_gradients`` as well, so its refusal raises there."""

    table_grads: list[TableGradient]
    lrs: dict[str, float]
    step: int = 0  # the training step it belongs to (half-precision tables round with it, spec §12)


# Pre-update values of the rows an observer-triggered flush updated early: {table: (rows [U], weights [U, D])}.
StaleRows = dict[str, tuple[Tensor, Tensor]]


class StepPipeline:
    """The staged batch, the last training lookup and the held-back update of one module's ``engine``.

    Args:
      engine: the tables (one process or sharded).
      pipelined: ``pipeline_execution_with_tensor_core``: the lookup of step t+1 reads the tables
        before the update of step t lands.
      recorder: lookup statistics sampled at training lookups, or None.
      concat: every lookup gives one tensor, the F activations side by side ([B, sum(D)]).
    """

    def __init__(
        self, engine: Engine, pipelined: bool, recorder: LookupStatsRecorder | None = None, concat: bool = False
    ) -> None:
        self.engine = engine
        self.pipelined = pipelined
        self.concat = concat  # lookups give one [B, sum(D)] tensor (concat_activations=True)
        self.recorder = recorder
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None
        if pipelined and engine.background_exchange:  # collectives run on one thread, in program order
            self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embtables-exchange")
        self.training_steps = 0
        self.enqueued: Staged | None = None
        self.last: Lookup | None = None
        self.pending: PendingUpdate | None = None
        # Pipelined and sharded: the exchange and sums of the last apply_gradients, running in the background
        # (the update to hold back, or the error refusing it on every rank), and its training step.
        self.summing: concurrent.futures.Future[PendingUpdate] | None = None
        self.summing_step = 0
        self.summing_reads: tuple[concurrent.futures.Future[PendingUpdate], list[FeatureBatch]] | None = None
        self.landing: concurrent.futures.Future[None] | None = None  # a held-back update applied in the background
        self.stale: StaleRows = {}
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ collectives
    def run(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` where this module's collectives run: on the exchange thread when there is one, so
        every rank issues them in program order; else here."""
        if self.worker is None:
            return fn()
        return self.worker.submit(fn).result()

    def exchange(self, phase: str, fn: Callable[[], _T]) -> _T:
        """An operation's collectives (``run``), preceded by its phase header: ranks out of step raise
        ``CollectiveError`` on every rank before any data moves (in one process, just ``fn()``)."""
        engine, step = self.engine, self.training_steps

        def run() -> _T:
            engine.check_phase(phase, step)
            return fn()

        return self.run(run)

    # ------------------------------------------------------------------ enqueue / dequeue
    def busy_pointers(self) -> set[int]:
        """Data pointers of the staging buffers a live batch still uses (not to be overwritten)."""
        busy = batch_pointers(self.last.batches) if self.last is not None else set()
        if self.summing_reads is not None:  # the batches the background sums still read
            if self.summing_reads[0].done():
                self.summing_reads = None
            else:
                busy |= batch_pointers(self.summing_reads[1])
        if self.enqueued is not None and self.enqueued.batches is not None:
            busy |= batch_pointers(self.enqueued.batches)  # kept until the next batch is valid
        return busy

    def stage(
        self,
        batches: list[FeatureBatch] | None,
        training: bool,
        refused: BaseException | None = None,
        read_ahead: bool = True,
    ) -> None:
        """Stage a batch for ``dequeue`` (or, sharded, this rank's refusal of it). Pipelined and sharded,
        the id exchange and lookup start now, overlapping the caller's dense compute; they read the
        tables before the pending update, as the pipelined lookup must (a refusing rank joins the
        early lookup's agreement round like the others, so every rank's collectives stay in order). An
        update landing in the background is not waited for: the new lookup runs after it, on the same
        thread."""
        self._wait_prefetch()
        if batches is not None and read_ahead:
            self.engine.prefetch_rows(batches)  # an offloaded table's rows start coming in from disk now
        step = self.training_steps + 1 if training else self.training_steps  # eval: the last step trained
        staged = Staged(batches, training, step, refused=refused)
        if self.worker is not None and training:
            staged.prefetch = self.worker.submit(self._lookup, staged)
        self.enqueued = staged

    def dequeue(self) -> list[Tensor]:
        """The F activations of the staged batch (``concat``: one tensor); a training lookup's require
        grad and are kept for ``apply_gradients``."""
        if self.enqueued is None:
            raise RuntimeError("DistributedEmbedding.dequeue: nothing was enqueued. Call enqueue(features) first.")
        staged, self.enqueued = self.enqueued, None
        if not staged.training:
            self.flush(observer=True)  # pipelining affects training lookups only
        if staged.prefetch is not None:
            acts, context, batches = staged.prefetch.result()
        elif self.worker is None:
            acts, context, batches = self._lookup(staged)
        else:
            acts, context, batches = self.run(lambda: self._lookup(staged))
        if not staged.training:
            return acts
        if self.last is not None:
            logger.warning(
                "DistributedEmbedding: a training lookup's gradients were never applied before the next "
                "training lookup; they are dropped. Call apply_gradients() once after each training lookup, "
                "or look up with training=False / module.eval() for inference."
            )
        acts = [a.requires_grad_(True) for a in acts]
        self.last = Lookup(batches, acts, context)
        if self.recorder is not None and self.recorder.should_sample(self.training_steps):
            b = batches
            kept = [x.ids[x.ids >= 0] if x.dropped_in_place else x.ids for x in b]  # -1: dropped on the GPU
            self.recorder.record(
                kept, [x.out_shape[0] if x.out_shape else 1 for x in b],
                [x.dropped + x.ids.numel() - k.numel() for x, k in zip(b, kept)],
            )  # fmt: skip
        self.training_steps += 1
        self._land()  # the pending update of the previous step lands after this step's lookup
        return acts

    def _land(self) -> None:
        """Apply the held-back update of the previous step, now that this step's lookup has read the tables.
        With an exchange thread, the update runs there, after the lookup and before any later collective
        or lookup, overlapping the caller's dense compute; everything that reads or writes the tables on
        this thread waits for it first (``drop_prefetch``). Sharded, the ranks agree on it there."""
        update: Callable[[], PendingUpdate]
        if self.summing is not None:  # summed in the background: done by then, it ran earlier on that thread
            assert self.worker is not None and self.pending is None
            summing, step, self.summing = self.summing, self.summing_step, None
            update = lambda: _refused_in_background(summing, step)  # noqa: E731
        elif self.pending is None:
            return
        elif self.worker is None:
            try:
                self.flush()
            except ValueError as exc:  # sharded, a refusal agreed by every rank: raised by the next call, as when
                if self.engine.world == 1:  # the update lands on the exchange thread
                    raise
                refused: concurrent.futures.Future[None] = concurrent.futures.Future()
                refused.set_exception(exc)
                self.landing = refused
            return
        else:
            pending, self.pending = self.pending, None
            update = lambda: pending  # noqa: E731
        engine = self.engine

        def land() -> None:
            held = update()
            with phase_profile.phase("update"):
                _apply_held(engine, held)

        self.landing = self.worker.submit(land)

    def _lookup(self, staged: Staged) -> tuple[list[Tensor], Any, list[FeatureBatch]]:
        """The lookup of a staged batch (on the exchange thread when pipelining is sharded): its
        activations, the engine's context for the backward, and the batches looked up (a dynamic
        table's keys turned into rows, spec §11; a step staged whole gets its rows written over its keys, which
        are put back first when it is looked up again, so a lookup done again translates again). A training
        lookup never evicts a row the held-back update will write."""
        pin_from = staged.step - 1 if self.pipelined else staged.step
        stale = (
            self._stale_rows_swapped_in(staged.training, Admission(staged.step, pin_from, staged.training))
            if self.stale
            else contextlib.nullcontext()
        )
        with torch.no_grad(), stale, phase_profile.phase("lookup"):
            self.engine.check_phase("lookup" if staged.training else "eval lookup", staged.step)
            batches = self.engine.translate_keys(
                staged.batches or [], staged.training, staged.step, pin_from, staged.refused
            )
            admission = Admission(staged.step, pin_from, staged.training)  # an offloaded table's rows
            acts, context = self.engine.lookup(batches, staged.refused, self.concat, admission)
            return acts, context, batches

    def drop_prefetch(self) -> None:
        """Wait for the work started in the background before the tables are read or changed here, or a
        staged batch is replaced: an update landing (``_land``; an error it raised, such as the refusal
        of an update summed in the background, surfaces here), the sums of the last ``apply_gradients``
        and a lookup started early."""
        self._wait_landing()
        if self.summing is not None:
            concurrent.futures.wait([self.summing])
        self._wait_prefetch()

    def _wait_landing(self) -> None:
        """Wait for an update landing in the background (``_land``); an error it raised surfaces here."""
        landing, self.landing = self.landing, None
        if landing is not None:
            landing.result()

    def _wait_prefetch(self) -> None:
        """Wait for the lookup of the staged batch started early, if any."""
        staged = self.enqueued
        if staged is not None and staged.prefetch is not None:
            concurrent.futures.wait([staged.prefetch])

    # ------------------------------------------------------------------ apply_gradients
    def training_lookup(self) -> Lookup:
        """The last training lookup, which ``apply_gradients`` updates for."""
        if self.last is None:
            raise RuntimeError(
                "DistributedEmbedding.apply_gradients: no training lookup to apply gradients to. Call the "
                "module (in train mode) or enqueue(..., training=True) + dequeue() first; each lookup takes "
                "one apply_gradients."
            )
        return self.last

    def apply_gradients(
        self, flat_g: Sequence[Any], refused: BaseException | None = None, *, checked_blocks: bool = False
    ) -> None:
        """Update the tables for the last training lookup with its F gradients (None: zero): now, or,
        pipelined, checked now (sharded: the gradients now, the rest in the background,
        ``_apply_in_background``) and held back until after the next lookup. On any error nothing
        changes and the lookup stays, to retry with another gradient. ``refused``: this rank's error
        with the gradient, found before (sharded: raised on every rank together). ``checked_blocks``: the
        gradients are the column blocks [B, D_f] of one float32 CPU gradient already checked whole, which
        one process's phase 1 reads as they are (``ConcatLayout.whole_gradient_ok``)."""
        last, engine = self.training_lookup(), self.engine
        try:
            if refused is not None:
                raise refused
            checked: Sequence[Tensor | None]
            if checked_blocks and engine.world == 1:
                checked = flat_g  # read in place (``ColumnBlocks``: no view per feature unless asked for)
            else:
                with phase_profile.phase("backward: check gradients"):
                    checked = engine.check_gradients(last.batches, flat_g)
        except (ValueError, TypeError) as exc:
            if engine.world == 1:
                raise
            refused, checked = exc, [None] * len(flat_g)  # every rank refuses this step together
        if self.pipelined and self.worker is not None:
            self._apply_in_background(last, checked, flat_g, refused)
            return
        self.flush()  # a held-back update lands first: phase 1 below reuses the tables' native workspaces
        with phase_profile.phase("backward"):
            table_grads = self.exchange(
                "apply_gradients", lambda: engine.table_gradients(last.batches, checked, last.context, refused)
            )
        update = PendingUpdate(table_grads, engine.learning_rates(), self.training_steps)
        if self.pipelined:
            if engine.world == 1:
                # One process: checked now too, so that a non-finite update raises here, like in a synchronous run
                # (it is checked again as it lands). Sharded, it is checked once, as it lands, where the ranks
                # agree on it (its refusal raised by the next call, as on the exchange thread).
                engine.check(update.table_grads, update.lrs, step=update.step)
            self.pending = PendingUpdate([tg.owned() for tg in table_grads], update.lrs, update.step)
        else:
            with phase_profile.phase("update"):
                self.run(lambda: engine.apply(update.table_grads, update.lrs, step=update.step))
        self.last = None

    def _apply_in_background(
        self, last: Lookup, checked: Sequence[Tensor | None], given: Sequence[Any], refused: BaseException | None
    ) -> None:
        """Pipelined and sharded ``apply_gradients``: this rank's gradients are checked here (shape, dtype,
        NaN/Inf) and the ranks agree on them in one round, so a bad gradient raises now on every rank
        with the lookup kept for a retry; the exchange, the owners' sums and the update's own check then
        run on the exchange thread, overlapping the caller's next dense compute. A refusal found there
        (a sum or an update that overflows float32) changes nothing on any rank and is raised on every
        rank by the next call that waits for the background (this one, at the next step)."""
        engine = self.engine
        if refused is None and not engine.gradients_finite(last.batches, checked):
            refused = InputError(
                "a gradient reaching a sharded table has NaN or Inf values; no table or slot was changed on any rank."
            )
        self._wait_landing()  # the previous update's refusal, found in the background, raises here
        self.exchange("apply_gradients", lambda: engine.agree_gradients(refused))
        owned = [_owned(g, src) for g, src in zip(checked, given)]  # the caller may reuse its tensors
        lrs, step = engine.learning_rates(), self.training_steps

        def summed() -> PendingUpdate:
            with phase_profile.phase("backward"):
                table_grads = engine.table_gradients(last.batches, owned, last.context)
            return PendingUpdate([tg.owned() for tg in table_grads], lrs, step)  # checked as it lands

        assert self.worker is not None and self.pending is None and self.summing is None
        self.summing, self.summing_step = self.worker.submit(summed), self.training_steps
        self.summing_reads = (self.summing, last.batches)
        self.last = None

    def flush(self, *, observer: bool = False) -> None:
        """Apply a held-back (pipelined) update. ``observer=True`` is a flush forced by reading or
        moving the state before the next training lookup: the pre-update values of the touched rows
        are kept so that lookup still reads them one step stale (observing never changes training).
        A flush that fails (the update would not be finite) drops the update and changes nothing."""
        self.drop_prefetch()  # never write rows an early lookup is reading
        if self.summing is not None:  # summed in the background, not landed yet: lands here
            summing, self.summing = self.summing, None
            self.pending = _refused_in_background(summing, self.summing_step)
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        stale: StaleRows = {}
        staged = self.enqueued
        prefetched = staged is not None and staged.prefetch is not None  # that lookup already read them
        if observer and self.pipelined and not prefetched:
            for tg in pending.table_grads:
                weights = self.engine.states[tg.table.name].weights
                if not tg.table.optimizer.lazy:  # non-lazy Adam touches every row
                    rows = torch.arange(weights.shape[0], device=weights.device)
                else:
                    touched = tg.rows if tg.rows is not None else tg.materialized().rows
                    assert touched is not None
                    rows = torch.unique(touched).to(weights.device)
                old = weights.index_select(0, rows)
                if tg.table.name in self.engine.offloaded:  # kept by row: the cache's slots change
                    rows = self.engine.offloaded.local_rows(tg.table.name, rows)
                stale[tg.table.name] = (rows, old)
        engine = self.engine
        self.run(lambda: _apply_held(engine, pending))  # sharded, the ranks agree on it (on the exchange thread)
        self.stale.update({k: v for k, v in stale.items() if k not in self.stale})

    @contextlib.contextmanager
    def _stale_rows_swapped_in(self, training: bool, admission: Admission) -> Iterator[None]:
        """For the first training lookup after an observer-triggered flush: the tables hold the
        pre-update values of the touched rows during the lookup, and the updated ones afterwards. An
        offloaded table's stale rows (kept by local row) are brought into its cache first, pinned by
        ``admission`` for the lookup, and swapped in its slots."""
        if not training or not self.stale:
            yield
            return
        current, swapped = {}, {}
        offloaded = self.engine.offloaded
        if offloaded:
            offloaded.refresh()  # what was written through the files' maps is taken in before the swap
            names = list(self.stale)
            slots = offloaded.admit_rows([(name, self.stale[name][0]) for name in names], admission)
            self.stale = {name: (rows, self.stale[name][1]) for name, rows in zip(names, slots)}
        with torch.no_grad():
            # everything prepared before any table changes (each table's rows in its storage type and on its
            # device): the swap is all or nothing, and a failure here keeps the stale rows for the next lookup
            for name, (rows, old) in self.stale.items():
                weights = self.engine.states[name].weights
                rows = rows.to(weights.device)
                swapped[name] = (rows, old.to(weights.device, weights.dtype))
                current[name] = weights.index_select(0, rows)
            self.stale = {}
            done = []
            try:
                for name, (rows, old) in swapped.items():
                    self.engine.states[name].weights.index_copy_(0, rows, old)
                    done.append(name)
                yield
            finally:
                for name in done:
                    self.engine.states[name].weights.index_copy_(0, swapped[name][0], current[name])

    # ------------------------------------------------------------------ the state as a whole
    def full_state(self) -> dict[str, Tensor]:
        """``{"<table>": [V, D], "<table>/<slot>": [V, D]}``: the logical state after any held-back
        update (gathered when sharded; every rank calls it)."""
        self.flush(observer=True)
        return self.exchange("state read", self.engine.full_state)

    def local_shards(self, whole: bool = True) -> dict[str, LocalShard]:
        """This rank's rows of every table (live storage), after any held-back update (``whole``: see
        ``OneProcessEngine.local_shards``)."""
        self.flush(observer=True)
        return self.engine.local_shards(whole)

    def replaced(self, stale: StaleRows | None = None) -> None:
        """The tables were replaced (restore, load_state_dict): forget every lookup and update made on
        the old ones (a staged batch is looked up again at dequeue), and keep ``stale``, the
        pre-update rows of an update pending when the new state was saved (pipelined modules only)."""
        with contextlib.suppress(Exception):  # the old tables' background work: its errors no longer matter
            self.drop_prefetch()
        if self.enqueued is not None:
            self.enqueued.prefetch = None
        self.pending, self.summing, self.last = None, None, None
        self.stale = dict(stale) if stale and self.pipelined else {}

    def move(self, fn: Callable[[Tensor], Tensor]) -> None:
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.half()``...): tables, slots and held rows move
        between devices and keep their storage types; a change to another floating type is refused before anything
        moves, naming each table's type, and ``.float()`` leaves half tables half, with a warning."""
        probe = fn(torch.zeros(1, dtype=torch.float32, device=self.engine.device))
        stored = {name: str(state.weights.dtype).removeprefix("torch.") for name, state in self.engine.states.items()}
        listed = ", ".join(f"{name!r} ({dtype})" for name, dtype in stored.items())
        if probe.dtype != torch.float32:
            raise TypeError(
                f"DistributedEmbedding: converting the embedding tables to {probe.dtype} is refused and nothing was "
                f"changed: each table keeps the storage type its TableConfig gave it ({listed}; the optimizers' "
                "arithmetic is float32, as TF's). Choose a table's storage with TableConfig(dtype=torch.bfloat16 or "
                "torch.float16, slot_dtype=...); convert only the dense part of the model (e.g. `model.dense.half()`) "
                "and cast the activations."
            )
        half = [f"{name!r} ({dtype})" for name, dtype in stored.items() if dtype != "float32"]
        if half and probe.dtype == torch.float32 and fn(torch.zeros(1, dtype=torch.float16)).dtype == torch.float32:
            logger.warning(
                "DistributedEmbedding: .float() leaves the half-precision tables %s in their storage type; "
                "TableConfig(dtype=torch.float32) stores a table in float32 (restore() converts a checkpoint).",
                ", ".join(half),
            )
        self.flush(observer=True)
        if self.enqueued is not None and self.enqueued.prefetch is not None:
            self.enqueued.prefetch = None  # looked up on the old device: look up again at dequeue

        def keep(t: Tensor) -> Tensor:  # a half-precision table or slot keeps its storage type (``.float()``)
            moved = fn(t)
            return moved if moved.dtype == t.dtype or not t.is_floating_point() else moved.to(t.dtype)

        self.engine.map_tensors(keep)
        self.stale = {k: (keep(rows), keep(old)) for k, (rows, old) in self.stale.items()}
        if self.last is not None and probe.device != self.last.activations[0].device:
            self.last = None
            logger.warning(
                "DistributedEmbedding: moved between devices after a training lookup; its gradients are dropped. "
                "Call apply_gradients() before moving the module."
            )

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict[str, Any]:
        if self.engine.world > 1:
            raise TypeError(
                "a sharded DistributedEmbedding cannot be copied or pickled: its rows live in several processes. "
                "Use state_dict() (full tables) or local_shards() (this rank's rows) instead."
            )
        state = dict(self.__dict__)
        state["worker"] = None
        del state["lock"]
        staged, last = self.enqueued, self.last
        if staged is not None:  # batches that point into staging buffers get their own storage in the copy
            batches = detached(staged.batches) if staged.batches is not None else None
            state["enqueued"] = dataclasses.replace(staged, batches=batches, prefetch=None)
        if last is not None:
            state["last"] = Lookup(detached(last.batches), last.activations, last.context)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("concat", False)  # pickled before concat_activations existed
        self.__dict__.update(state)
        self.lock = threading.RLock()


def _owned(checked: Tensor | None, given: Any) -> Tensor | None:
    """A checked gradient the background may read after ``apply_gradients`` returns: a copy when it still
    shares the caller's storage (which the caller may overwrite), else itself."""
    if checked is None or not isinstance(given, Tensor):
        return checked
    if checked.untyped_storage().data_ptr() != given.untyped_storage().data_ptr():
        return checked
    return checked.clone(memory_format=torch.contiguous_format)


def _refused_in_background(summing: concurrent.futures.Future[PendingUpdate], step: int) -> PendingUpdate:
    """The update summed in the background for training step ``step``, or its refusal, raised again
    with the step named (the ranks agreed on it there, so every rank raises it at the same call)."""
    try:
        return summing.result()
    except ValueError as exc:  # a refusal (others, e.g. a lost peer's CollectiveError, are raised as they are)
        raise _late_refusal(step, exc) from exc


def _apply_held(engine: Engine, held: PendingUpdate) -> None:
    """Land a held-back update, checked as it is written (sharded: and agreed on by the ranks; a refusal is then
    raised with its step named, every rank raising it at the same call)."""
    try:
        engine.apply(held.table_grads, held.lrs, step=held.step)
    except ValueError as exc:
        if engine.world == 1:
            raise
        raise _late_refusal(held.step, exc) from exc


def _late_refusal(step: int, exc: ValueError) -> InputError:
    return InputError(
        f"the pipelined update of training step {step} was refused after apply_gradients() returned (a sharded "
        f"pipelined update is summed, checked and agreed on by the ranks as it lands, after the next lookup): {exc} "
        f"Nothing of step {step} was applied on any rank; the later lookups read the tables without it."
    )
