"""Persistence of one module: checkpoints (``save``/``restore``) and ``state_dict`` loading.

Both go through the step pipeline (``sharding.pipeline``): a held-back update lands (or is kept as
stale rows) before the state is read, and every lookup made on the old tables is forgotten when the
state is replaced. An interrupted restore leaves the module *torn*: it refuses to train or save until a
restore or a complete ``load_state_dict`` succeeds.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from embtables.checkpoint import increments
from embtables.checkpoint.progress import progress_bar
from embtables.checkpoint.store import CheckpointError, agree, restore, save
from embtables.checkpoint.streaming_restore import TornRestore
from embtables.config import ResolvedConfig
from embtables.sharding import comm, dynamic_keys
from embtables.sharding.pipeline import StepPipeline
from embtables.tables.dynamic_vocabularies import VOCABULARY_FIELDS, vocabulary_problem
from embtables.tables.state import LocalShard
from embtables.tables.state_dict_io import strict_of_caller, validate_state_dict

Progress = bool | Callable[[int], None] | None


def _refusal(fn: Callable[[], None]) -> str | None:
    """None when ``fn()`` returns, else its error's message (for every rank to raise, ``store.agree``)."""
    try:
        fn()
    except comm.CollectiveError:
        raise
    except (OSError, ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def _converted_tables(manifest: dict[str, Any], shards: Mapping[str, LocalShard]) -> list[str]:
    """The tables a restore of ``manifest`` converted: a state block stored in another type than the table's
    (a float32 checkpoint into a bfloat16 table, say)."""
    out = []
    for name, shard in shards.items():
        types = {(f"{name}/{slot}" if slot else name): str(t.dtype).removeprefix("torch.") for slot, t in
                 shard.tensors.items()}  # fmt: skip
        for entry in manifest.get("checked_files", []):
            blocks = entry["blocks"].get(name)
            state = getattr(blocks, "state", {}) if blocks is not None else {}
            if any(key in types and block.stored != types[key] for key, block in state.items()):
                out.append(name)
                break
    return out


class Persistence:
    """Save, restore and state-dict I/O for the tables behind ``pipeline``.

    Args:
      resolved: the module's resolved config (written into manifests, checked at restore).
      pipeline: the module's step pipeline (its engine holds the tables).
      settings: module settings that change results, beyond the config (in every manifest).
    """

    def __init__(self, resolved: ResolvedConfig, pipeline: StepPipeline, settings: dict[str, Any]) -> None:
        self.resolved = resolved
        self.pipeline = pipeline
        self.settings = settings
        self.torn: str | None = None  # a restore interrupted half-way: refuse to train or save until one succeeds
        self.last_id: str | None = None  # the checkpoint the changed rows count from (saved or restored)

    def refuse_if_torn(self, what: str) -> None:
        if self.torn is not None:
            raise CheckpointError(
                f"DistributedEmbedding.{what}: refused, the last restore was interrupted half-way and the tables are "
                f"partly restored ({self.torn}). Restore again (or load_state_dict) first."
            )

    def save(
        self,
        path: str | os.PathLike[str],
        keep_last: int | None,
        extra: dict[str, Any] | None,
        progress: Progress,
        *,
        incremental: bool = False,
        full_every: int | None = None,
    ) -> Path:
        """Write ``path/ckpt-<step>`` (see ``DistributedEmbedding.save``); returns the directory."""
        self.refuse_if_torn("save")
        if not isinstance(incremental, bool):
            raise TypeError(f"save: incremental must be True or False, got {incremental!r}.")
        if full_every is not None and (
            isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1
        ):
            raise ValueError(f"save: full_every must be an int >= 1 or None, got {full_every!r}.")
        pipeline = self.pipeline
        # a pending pipelined update lands, keeping its pre-update rows; an offloaded table's rows are read from
        # its files (rows never read: their initial values), not initialized in them first
        shards = pipeline.local_shards(whole=False)
        engine = pipeline.engine
        engine.settle()  # a GPU step's error not raised yet is raised now, not lost behind a checkpoint
        # torn or cut working files of an offloaded table are refused on every rank before anything is written
        refused = _refusal(lambda: engine.offloaded.check_whole("save"))
        pipeline.exchange("save", lambda: agree(refused, engine.group, "save"))
        # Pre-update rows the next training lookup must read (pipelining): saved with global row ids.
        stale = {name: (shards[name].rows[rows.cpu()], old) for name, (rows, old) in pipeline.stale.items()}
        strategies = {n: p.strategy for n, p in engine.plans.items()}
        checkpoint_id = pipeline.exchange("save", lambda: comm.all_gather_object(increments.new_id(), engine.group)[0])
        changed = increments.IncrementalSave(self.last_id, full_every, engine.changed_local) if incremental else None
        with progress_bar(progress, comm.get_rank(engine.group), "save") as tick:
            out = save(
                path, self.resolved, shards, pipeline.training_steps, strategies=strategies, extra=extra,
                keep_last=keep_last, progress=tick, group=engine.group, stale=stale, settings=self.settings,
                vocabularies=engine.vocabulary_shards(), checkpoint_id=checkpoint_id, incremental=changed,
            )  # fmt: skip
        engine.clear_changed()  # the rows changed since this checkpoint start afresh
        self.last_id = checkpoint_id
        return out

    def restore(self, path: str | os.PathLike[str], progress: Progress) -> dict[str, Any]:
        """Load a checkpoint into the tables (see ``DistributedEmbedding.restore``); returns its manifest."""
        pipeline = self.pipeline
        pipeline.drop_prefetch()
        engine = pipeline.engine
        # an offloaded table's rows are all written by the restore (pass 1 checks that every row is in the
        # checkpoint): its blocks are not initialized first, and its files are whole after it (offloaded.restored)
        refused = _refusal(engine.offloaded.before_restore)  # a full disk: every rank refuses, nothing changed
        pipeline.exchange("restore", lambda: agree(refused, engine.group, "restore"))
        shards = engine.local_shards(whole=False)
        with progress_bar(progress, comm.get_rank(engine.group), "restore") as tick:
            try:
                manifest = restore(
                    path, self.resolved, shards, progress=tick, group=engine.group, dynamic=self._key_owners()
                )
            except TornRestore as exc:
                self.torn = str(exc)
                raise
        self.torn = None
        engine.offloaded.restored()
        # The pre-update rows of a pipelined update pending at save are read by the next training lookup
        # of a pipelined module only; a synchronous module reads the tables as they are (updated).
        device, stale = engine.device, manifest.pop("stale")
        if pipeline.pipelined:  # the saved pre-update rows (float32 in the file) in each table's storage type
            types = {n: shards[n].tensors[""].dtype for n in stale}
            pipeline.replaced({n: (r.to(device), v.to(device, types[n])) for n, (r, v) in stale.items()})
        else:
            pipeline.replaced()
        pipeline.training_steps = int(manifest["step"])
        engine.vocabularies.load(manifest.pop("dynamic"), pipeline.training_steps)  # checked in pass 1
        engine.clear_changed()  # the tables are the checkpoint's: nothing changed since it
        self.last_id = increments.manifest_id(manifest)
        converted = _converted_tables(manifest, shards)
        if converted:  # rounded into another storage type: the tables are not the checkpoint's any more
            engine.mark_all_changed()
            self.last_id = None
            increments.full_writes.info(
                "embtables: restore converted the storage type of %s (the checkpoint's values were rounded into the "
                "tables' types): the next save(incremental=True) writes a full checkpoint, and changed_rows() lists "
                "every row.", ", ".join(repr(n) for n in converted),
            )  # fmt: skip
        return manifest

    def state_dict_into(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """``nn.Module._save_to_state_dict``: ``<table>`` and ``<table>/<slot>`` keys, full logical tables,
        and a dynamic table's vocabulary (``<table>/keys``, ``/counts``, ``/age``, ``/order``; spec §11)."""
        for key, t in self.pipeline.full_state().items():
            destination[prefix + key] = t if keep_vars else t.detach()  # gathered copies when sharded
        if not self.pipeline.engine.vocabularies.maps:  # the same config on every rank: all skip, or none
            return
        # gathered when sharded: a collective, so on the exchange thread like every other one
        for name, arrays in self.pipeline.exchange("state read", self.pipeline.engine.vocabulary_state).items():
            for field, values in arrays.items():
                destination[f"{prefix}{name}/{field}"] = values

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """``nn.Module._load_from_state_dict`` (see ``DistributedEmbedding``): every rank loads, or none."""
        strict = strict_of_caller(strict)
        pipeline = self.pipeline
        engine = pipeline.engine
        owners = engine.state_key_owners()
        present, errors, missing, unexpected = validate_state_dict(state_dict, prefix, engine.logical_shapes(), owners)
        vocabularies = self._vocabularies_in(state_dict, prefix, errors, missing)
        if engine.world > 1 and not errors:
            self._keys_to_owners(vocabularies, present, owners, errors)
        unexpected = [k for k in unexpected if not _is_vocabulary_key(k, prefix, engine.vocabularies.maps)]
        if strict:
            unexpected_keys.extend(unexpected)
        missing_keys.extend(missing)
        refuse = bool(errors) or (strict and bool(missing or unexpected))
        if pipeline.exchange("state load", lambda: comm.any_rank(refuse, engine.group)):
            if not refuse:
                error_msgs.append("DistributedEmbedding: another rank refused its state dict; nothing was loaded.")
            refuse = True
        error_msgs.extend(f"DistributedEmbedding: {e}." for e in errors)
        if refuse:
            return
        pipeline.replaced()  # a loaded state replaces any update still held back
        self.torn = None if not missing else self.torn
        engine.load_logical(present)
        if not missing:
            engine.offloaded.restored()
        engine.load_vocabulary_state(vocabularies, pipeline.training_steps)
        engine.mark_all_changed()  # loaded values: every row differs from the last checkpoint
        self.last_id = None

    def _keys_to_owners(
        self,
        vocabularies: dict[str, dict[str, Any]],
        present: dict[str, Tensor],
        owners: Mapping[str, tuple[Any, str]],
        errors: list[str],
    ) -> None:
        """Sharded: move every dynamic table's keys (and their rows of ``present``; ``owners``: each state
        key's table and slot) to rows of the ranks that own them, in place, as ``restore`` does; problems
        go to ``errors``."""
        engine = self.pipeline.engine
        for name, arrays in list(vocabularies.items()):
            keys = [k for k, (t, _) in owners.items() if t.name == name]
            values = {k: present[k] for k in keys if k in present}
            moved = dynamic_keys.keys_to_owners(name, arrays, values, engine.plans[name])
            if isinstance(moved, str):
                errors.append(f"{moved}; nothing was loaded")
            elif moved[0] is not arrays and len(values) < len(keys):
                absent = sorted(set(keys) - set(values))
                errors.append(
                    f"table {name!r}: its keys must move to the ranks that own them here, and {absent} are missing "
                    "from the state dict (a key cannot move without its weights and slots); pass them too"
                )
            else:
                vocabularies[name] = moved[0]
                present.update(moved[1])

    def _key_owners(self) -> dict[str, tuple[int, Callable[[Tensor], Tensor], str]]:
        """Per dynamic table: this process's key map capacity, which keys it owns, its strategy."""
        engine = self.pipeline.engine
        out = {}
        for name, key_map in engine.vocabularies.maps.items():
            plan = engine.plans[name]
            if engine.world == 1:
                owns: Callable[[Tensor], Tensor] = lambda keys: torch.ones(keys.numel(), dtype=torch.bool)  # noqa: E731
            else:
                owns = functools.partial(_owned_by, plan=plan, rank=engine.rank)
            out[name] = (key_map.capacity, owns, plan.strategy)
        return out

    def _vocabularies_in(
        self, state_dict: Mapping[str, Any], prefix: str, errors: list[str], missing: list[str]
    ) -> dict[str, dict[str, Any]]:
        """The complete, checked vocabularies of dynamic tables in ``state_dict``; problems go to
        ``errors``, absent keys to ``missing`` (a table with some of its fields absent keeps its own)."""
        out = {}
        for name in self.pipeline.engine.vocabularies.maps:
            keys = {f: f"{prefix}{name}/{f}" for f in VOCABULARY_FIELDS}
            absent = [k for k in keys.values() if k not in state_dict]
            missing.extend(absent)
            if absent:
                continue
            arrays = {f: state_dict[k] for f, k in keys.items()}
            capacity = self.resolved.tables[self.resolved.table_names.index(name)].vocabulary_size
            problem = vocabulary_problem(name, arrays, capacity)
            if problem is not None:
                errors.append(f"{problem} (the state dict is corrupt or from another model)")
            else:
                out[name] = arrays
        return out


def _owned_by(keys: Tensor, plan: Any, rank: int) -> Tensor:
    return dynamic_keys.key_owners(keys, plan) == rank


def _is_vocabulary_key(key: str, prefix: str, maps: Mapping[str, Any]) -> bool:
    table, _, field = key[len(prefix) :].rpartition("/")
    return table in maps and field in VOCABULARY_FIELDS
