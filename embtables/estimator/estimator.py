"""``Estimator``: TPUEstimator's train / evaluate / predict loop, in PyTorch.

The model is split as on TPU: the embedding tables (built from an ``EmbeddingConfigSpec``, trained by
their fused sparse optimizers) and a dense ``torch.nn.Module`` (trained by ``dense_optimizer``).
Each step: raw features -> engine inputs -> activations -> ``model_fn(activations, features)`` ->
``loss_fn(predictions, labels)`` -> backward -> embedding update (gradients multiplied by
``experimental_gradient_multiplier_fn(global_step)``) and dense update.

``model_dir`` holds checkpoints (``ckpt-<step>``: the tables and slots, plus ``dense-<step>.pt``: the
dense model, its optimizer and the global step), restored automatically on the first call; metrics as
CSV (``train_metrics.csv``, ``eval_metrics.csv``) and TensorBoard event files when ``tensorboard`` is
installed. Under ``torchrun`` the tables are sharded over the processes (``partition_strategy``), each
rank reads its own batches, dense gradients are averaged over ranks (as DDP) and embedding gradients
summed (as on TPU); rank 0 writes logs.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from embtables.api import DistributedEmbedding
from embtables.checkpoint.file_names import CheckpointError
from embtables.checkpoint.owned_dirs import WriterLock
from embtables.checkpoint.store import agree, published, read_manifest
from embtables.estimator.batches import END, BatchReader, PreparedBatch, shaped_like
from embtables.estimator.dense_file import DENSE_FILE, DenseOptimizer, read_dense, write_dense
from embtables.estimator.input_pipeline import Prefetched, Probe, prefetched
from embtables.estimator.model_artifact import ModelExport, ModelParts, export_model
from embtables.estimator.row_transform import RowTransform
from embtables.estimator.spec import EmbeddingConfigSpec
from embtables.sharding import comm

logger = logging.getLogger("embtables")

Batch = tuple[Mapping[str, Any], Any]
InputFn = Callable[[], Iterable[Batch]]
Metric = Callable[[np.ndarray, np.ndarray], float]


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``Estimator.train``: the step in progress finished, a checkpoint of it was saved
    (on every rank) at ``checkpoint``, and training stopped."""

    def __init__(self, step: int, checkpoint: str) -> None:
        super().__init__(f"interrupted at global step {step}; checkpoint saved at {checkpoint}")
        self.step, self.checkpoint = step, checkpoint

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (a worker process sends it back)
        return (TrainingInterrupted, (self.step, self.checkpoint))


@contextlib.contextmanager
def _deferred_interrupt() -> Iterator[threading.Event]:
    """While training, a first Ctrl-C (SIGINT) only sets the returned flag: the loop stops after the
    step in progress and saves. A second one interrupts at once. Main thread only (else a no-op)."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        if flag.is_set():
            raise KeyboardInterrupt
        flag.set()
        logger.warning("Estimator: interrupted; saving a checkpoint after this step (Ctrl-C again to stop at once).")

    signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


class Estimator:
    """Train, evaluate and predict with embedding tables and a dense model.

    Args:
      model_fn: an ``nn.Module`` called as ``model_fn(activations, features)``, where ``activations``
        is ``{feature column name: [B, D] or [B, L, D]}`` and ``features`` the raw batch; it returns
        the predictions [B] (or [B, k]).
      embedding_config_spec: the ``EmbeddingConfigSpec`` of the tables.
      model_dir: where checkpoints and metrics go; an existing checkpoint there is resumed.
      dense_optimizer: a ``torch.optim.Optimizer`` over ``model_fn``'s parameters (or any object with its
        ``zero_grad``, ``step``, ``state_dict`` and ``load_state_dict``), or a callable
        ``params -> Optimizer``; default ``Adam(lr=1e-3)``.
      loss_fn: ``(predictions, labels) -> scalar``; default mean squared error.
      eval_metrics: ``{name: fn(predictions [N], labels [N]) -> float}`` computed by ``evaluate``
        (see ``embtables.estimator.metrics``); the mean loss is always reported.
      predictions_fn: maps ``model_fn``'s output to what ``predict`` and the metrics see (e.g.
        ``torch.sigmoid`` for logits); default identity.
      save_checkpoints_steps, keep_checkpoint_max, log_step_count_steps: as TF's ``RunConfig``.
      incremental_checkpoints: the embedding checkpoints after the first hold only the rows changed since the
        one before (``DistributedEmbedding.save(incremental=True)``; the dense file is whole every time);
        ``full_checkpoint_every``: at most that many increments in a row (None: no limit).
      progress: show a progress bar (default: when stderr is a terminal).
      input_prefetch: batches read from ``input_fn`` and converted ahead, on a background thread, while
        the current step trains (0: none, each batch is read when its step starts); ``"auto"`` (default):
        the first 32 steps of training read in place and the next 32 one ahead, timed, and one ahead is
        kept from then on only when it was at least 10% faster (the same, separately, for
        ``evaluate``/``predict``); the results are the same either way, bit for bit.
      after_save: called as ``after_save(global_step, checkpoint)`` on every rank after each checkpoint is
        published (TF's ``CheckpointSaverListener.after_save``), e.g. to export the model for a server.
    """

    def __init__(
        self,
        model_fn: nn.Module,
        embedding_config_spec: EmbeddingConfigSpec,
        model_dir: str | os.PathLike[str],
        dense_optimizer: DenseOptimizer | Callable[[Any], DenseOptimizer] | None = None,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        eval_metrics: Mapping[str, Metric] | None = None,
        predictions_fn: Callable[[Tensor], Tensor] | None = None,
        *,
        device: torch.device | str | None = None,
        save_checkpoints_steps: int | None = 1000,
        keep_checkpoint_max: int = 3,
        log_step_count_steps: int = 100,
        incremental_checkpoints: bool = False,
        full_checkpoint_every: int | None = None,
        progress: bool | None = None,
        process_group: Any = None,
        input_prefetch: int | str = "auto",
        after_save: Callable[[int, str], None] | None = None,
    ) -> None:
        if not isinstance(model_fn, nn.Module):
            raise TypeError(f"Estimator: `model_fn` must be a torch.nn.Module, got {type(model_fn).__name__}.")
        if not isinstance(embedding_config_spec, EmbeddingConfigSpec):
            raise TypeError("Estimator: `embedding_config_spec` must be an embtables.estimator.EmbeddingConfigSpec.")
        for name, value, least in (
            ("log_step_count_steps", log_step_count_steps, 1),
            ("keep_checkpoint_max", keep_checkpoint_max, 1),
            *([] if input_prefetch == "auto" else [("input_prefetch", input_prefetch, 0)]),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                also = ' or "auto"' if name == "input_prefetch" else ""
                raise ValueError(f"Estimator: `{name}` must be an int >= {least}{also}, got {value!r}.")
        if save_checkpoints_steps is not None and (
            not isinstance(save_checkpoints_steps, int) or save_checkpoints_steps < 1
        ):
            raise ValueError(
                f"Estimator: `save_checkpoints_steps` must be None or an int >= 1, got {save_checkpoints_steps!r}."
            )
        if not isinstance(incremental_checkpoints, bool):
            raise TypeError(f"Estimator: `incremental_checkpoints` must be a bool, got {incremental_checkpoints!r}.")
        if full_checkpoint_every is not None and (
            isinstance(full_checkpoint_every, bool)
            or not isinstance(full_checkpoint_every, int)
            or full_checkpoint_every < 1
        ):
            raise ValueError(
                f"Estimator: `full_checkpoint_every` must be None or an int >= 1, got {full_checkpoint_every!r}."
            )
        self.incremental_checkpoints = incremental_checkpoints
        self.full_checkpoint_every = full_checkpoint_every
        self.spec = embedding_config_spec
        self.input_prefetch = input_prefetch
        if after_save is not None and not callable(after_save):
            raise TypeError("Estimator: `after_save` must be a callable (global_step, checkpoint) or None.")
        self.after_save = after_save
        self._probes: dict[str, Probe] = {}  # input_prefetch="auto": per kind of call (train, predict)
        self.model_dir = Path(model_dir)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.model = model_fn.to(self.device)
        self.global_step = 0
        self._group = process_group
        self.rank = comm.get_rank(process_group) if comm.is_distributed(process_group) else 0
        self.embedding: DistributedEmbedding = embedding_config_spec.build(
            lambda: self.global_step, device=self.device, process_group=process_group
        )
        if dense_optimizer is None:
            self.dense_optimizer: DenseOptimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        elif isinstance(dense_optimizer, torch.optim.Optimizer) or not callable(dense_optimizer):
            self.dense_optimizer = dense_optimizer
        else:
            self.dense_optimizer = dense_optimizer(self.model.parameters())
        self.loss_fn = loss_fn or nn.functional.mse_loss
        self.eval_metrics = dict(eval_metrics or {})
        self.predictions_fn = predictions_fn or (lambda x: x)
        self.save_checkpoints_steps = save_checkpoints_steps
        self.keep_checkpoint_max = keep_checkpoint_max
        self.log_step_count_steps = log_step_count_steps
        self.progress = sys.stderr.isatty() if progress is None else progress
        self._restored = False
        self._interrupted = False
        self._saved: tuple[int, str] | None = None  # (step, checkpoint) of this estimator's last save
        self._writer_lock: WriterLock | None = None
        self._writer: Any = None
        self.history: list[dict[str, float]] = []  # the rows of train_metrics.csv, in memory

    # ------------------------------------------------------------------ checkpoints
    def latest_checkpoint(self) -> str | None:
        """The newest complete checkpoint in ``model_dir``, or None."""
        found = published(self.model_dir)
        return str(found[-1]) if found else None

    def restore(self) -> int:
        """Load the latest checkpoint of ``model_dir`` if there is one (train, evaluate and predict do
        this on their first call); returns the global step."""
        self._maybe_restore()
        return self.global_step

    def _maybe_restore(self) -> None:
        """Resume from the latest checkpoint, all or nothing: the dense file is read and checked
        against the model on every rank before the tables are restored (which is itself checked
        and agreed), and the dense state is applied last. Any problem raises ``CheckpointError`` on
        every rank, and nothing changes (a retried call tries again)."""
        if self._restored:
            return
        found = published(self.model_dir)
        latest = found[-1] if found else None
        if comm.is_distributed(self._group):
            paths = comm.all_gather_object(None if latest is None else str(latest), self._group)
            if len(set(paths)) > 1:
                raise CheckpointError(
                    f"Estimator: the ranks see different latest checkpoints in {self.model_dir} ({paths}); every "
                    "rank must see the same model_dir."
                )
        if latest is None:
            self._restored = True
            return
        dense, error = None, None
        try:
            dense = read_dense(latest, self.model_dir, self.model, self.dense_optimizer, self.device)
        except CheckpointError as exc:
            error = str(exc)
        agree(error, self._group, f"Estimator resume from {latest}")
        assert dense is not None
        self.embedding.restore(latest, progress=self.progress)
        self.model.load_state_dict(dense["model"])
        self.dense_optimizer.load_state_dict(dense["optimizer"])
        self.global_step = int(dense["step"])
        self._restored = True
        if self.rank == 0:
            logger.info("Estimator: resumed from %s at global step %d", latest, self.global_step)

    def _take_writer_lock(self) -> None:
        """One Estimator trains into a model_dir at a time (rank 0 holds a lock file with its pid and
        host until ``close()``, garbage collection or exit); a second one, in this process or another,
        is refused on every rank instead of interleaving checkpoints with the first."""
        if self._writer_lock is not None:
            return
        lock, error = WriterLock(self.model_dir, ".embtables-writer.lock", "Estimator.train"), None
        if self.rank == 0:
            try:
                self.model_dir.mkdir(parents=True, exist_ok=True)
                lock.acquire()
            except (CheckpointError, OSError) as exc:
                error = str(exc)
        if comm.is_distributed(self._group):
            error = comm.broadcast_object(error, 0, self._group)
        if error is not None:
            raise CheckpointError(f"Estimator.train: {error}")
        self._writer_lock = lock

    def close(self) -> None:
        """Release ``model_dir`` for another writer (training again takes it back), and close the
        TensorBoard event file and its writer thread (the next metrics row opens a new one)."""
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None
        if self._writer:
            self._writer.close()
            self._writer = None

    def save(self) -> str:
        """Write a checkpoint of the current step into ``model_dir`` (every rank calls it). The dense
        file is written and fsynced first; the embedding checkpoint's atomic publish commits both. A step
        this estimator already saved, still published, is not written again (nothing trains between)."""
        step = self.global_step
        if self._saved is not None and self._saved[0] == step and Path(self._saved[1]).is_dir():
            return self._saved[1]
        dense_name = f"dense-{step:010d}.pt"
        error = None
        if self.rank == 0:
            try:
                write_dense(self.model_dir, dense_name, step, self.model, self.dense_optimizer)
            except OSError as exc:
                error = f"cannot write {self.model_dir / dense_name} ({exc})"
        if comm.is_distributed(self._group):
            error = comm.broadcast_object(error, 0, self._group)
        if error is not None:
            raise CheckpointError(f"Estimator.save: rank 0 {error}; no checkpoint was written.")
        path = self.embedding.save(
            self.model_dir,
            keep_last=self.keep_checkpoint_max,
            extra={"global_step": step, "dense": dense_name},
            progress=self.progress,
            incremental=self.incremental_checkpoints,
            full_every=self.full_checkpoint_every,
        )
        if self.rank == 0:
            keep = set()
            for ckpt in published(self.model_dir):
                with contextlib.suppress(CheckpointError):
                    keep.add((read_manifest(ckpt)[1].get("extra") or {}).get("dense"))
            for f in self.model_dir.iterdir():
                if DENSE_FILE.fullmatch(f.name) and f.name not in keep:
                    f.unlink(missing_ok=True)
        self._saved = (step, path)
        if self.after_save is not None:
            self.after_save(step, path)
        return path

    # ------------------------------------------------------------------ steps
    def _forward(self, batch: PreparedBatch) -> tuple[dict[str, Tensor], Tensor]:
        activations = self.embedding(batch.ids, batch.weights or None)
        return activations, self.model(activations, batch.features)

    def _train_step(self, batch: PreparedBatch) -> float:
        if not (self.embedding.training and self.model.training):  # after evaluate / predict (eval mode)
            self.embedding.train()
            self.model.train()
        activations, out = self._forward(batch)
        assert batch.labels is not None
        loss = self.loss_fn(out, shaped_like(batch.labels, out))
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        fn = self.spec.experimental_gradient_multiplier_fn
        multiplier = float(fn(self.global_step)) if fn is not None else 1.0
        grads = {}
        for name, a in activations.items():
            g = a.grad if a.grad is not None else torch.zeros_like(a)
            grads[name] = g * multiplier if fn is not None else g
        self.embedding.apply_gradients(grads)
        if comm.is_distributed(self._group):
            params = [p.grad for p in self.model.parameters() if p.grad is not None]
            comm.all_reduce_mean_(params, self._group, self.global_step + 1)
        self.dense_optimizer.step()
        self.global_step += 1
        return float(loss.detach())

    def _prepare(self, item: Any, need_labels: bool) -> PreparedBatch:
        """A raw batch converted and checked: engine inputs, labels as float32 (finite)."""
        return self._reader((), need_labels).prepare(item)

    def _reader(self, batches: Iterable[Any], need_labels: bool) -> BatchReader:
        return BatchReader(batches, self.spec.engine_inputs, self.device, need_labels, self.spec.raw_keys())

    def _agreed(
        self, batches: Iterable[Any], need_labels: bool, stop: threading.Event | None = None
    ) -> Iterator[PreparedBatch]:
        """The batches, converted and checked (``batches.BatchReader``: several at once where they can be
        joined), until any rank's input ends (sharded lookups are collective: a rank with no batch left
        would leave the others waiting). A batch refused on any rank (bad ids, labels that are not finite
        numbers) raises on every rank, naming it, before any table or parameter changes. One agreement
        round per batch, as before."""
        reader = self._reader(batches, need_labels)
        distributed = comm.is_distributed(self._group)
        self._interrupted = False

        probe = None
        if self.input_prefetch == "auto":
            probe = self._probes.setdefault("train" if stop is not None else "predict", Probe())
        depth = 0 if probe is not None else int(self.input_prefetch)
        with prefetched(reader.next, depth, probe) as pipeline:
            yield from self._agreement_rounds(pipeline, distributed, stop)

    def _agreement_rounds(
        self, pipeline: Prefetched[Any], distributed: bool, stop: threading.Event | None
    ) -> Iterator[PreparedBatch]:
        while True:
            interrupted = stop is not None and stop.is_set()
            item, prepared, error = (END, None, None) if interrupted else pipeline.next()
            code = 3 if interrupted else 1 if item is END else (2 if error is not None else 0)
            if distributed:
                code = comm.max_over_ranks(code, self._group)
            if code == 3:  # Ctrl-C on any rank: every rank stops here, after the same step
                self._interrupted = True
                return
            if code == 2:
                if distributed:
                    why = comm.all_gather_object(None if error is None else str(error), self._group)
                    if error is None:
                        rank, msg = next((r, m) for r, m in enumerate(why) if m is not None)
                        raise ValueError(f"Estimator: rank {rank}'s batch was refused, so every rank stops: {msg}")
                assert error is not None
                raise error
            if code == 1:
                if item is not END:
                    logger.warning("Estimator: another rank's input ended first; the remaining batches are skipped.")
                return
            assert prepared is not None
            yield prepared

    # ------------------------------------------------------------------ public verbs
    def train(self, input_fn: InputFn, steps: int | None = None, max_steps: int | None = None) -> Estimator:
        """Train on the batches of ``input_fn()`` for ``steps`` more steps (or up to global step
        ``max_steps``, or until the input ends); resumes from ``model_dir`` first. Returns self.
        As TF: ``steps`` and ``max_steps`` are ints >= 1, not both."""
        if steps is not None and max_steps is not None:
            raise ValueError("Estimator.train: give `steps` or `max_steps`, not both (as TF).")
        for name, value in (("steps", steps), ("max_steps", max_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Estimator.train: `{name}` must be an int >= 1 or None (as TF), got {value!r}.")
        self._maybe_restore()
        self._take_writer_lock()
        target = self.global_step + steps if steps is not None else max_steps
        if target is not None and self.global_step >= target:
            logger.info("Estimator.train: global step %d already reached max_steps %d.", self.global_step, target)
            return self
        bar = self._bar(None if target is None else target - self.global_step, "train")
        with contextlib.ExitStack() as stack:
            stop = stack.enter_context(_deferred_interrupt())
            stack.callback(lambda: bar.close() if bar is not None else None)
            self._train_loop(input_fn, target, stop, bar)
        if self._interrupted:
            raise TrainingInterrupted(self.global_step, self.save())
        self.save()
        return self

    def _train_loop(self, input_fn: InputFn, target: int | None, stop: threading.Event, bar: Any) -> None:
        losses: list[float] = []
        t0 = last_t = time.perf_counter()
        last_step, examples = self.global_step, 0
        for batch in self._agreed(input_fn(), need_labels=True, stop=stop):
            losses.append(self._train_step(batch))
            assert batch.labels is not None
            examples += len(batch.labels)
            if bar is not None:
                bar.update(1)
            if self.global_step % self.log_step_count_steps == 0:
                now = time.perf_counter()
                row = {
                    "step": float(self.global_step),
                    "loss": float(np.mean(losses)),
                    "steps_per_sec": (self.global_step - last_step) / max(now - last_t, 1e-9),
                    "examples_per_sec": examples / max(now - last_t, 1e-9),
                    "elapsed_s": now - t0,
                }
                self._log("train", row)
                if bar is not None:
                    bar.set_postfix(loss=f"{row['loss']:.4f}")
                losses, last_t, last_step, examples = [], now, self.global_step, 0
            if self.save_checkpoints_steps and self.global_step % self.save_checkpoints_steps == 0:
                self.save()
            if target is not None and self.global_step >= target:
                break

    def _predict_batches(
        self, input_fn: InputFn, steps: int | None, need_labels: bool = False
    ) -> Iterator[tuple[Tensor, Tensor | None, Tensor]]:
        self._maybe_restore()
        self.embedding.eval()
        self.model.eval()
        with torch.no_grad():
            for i, batch in enumerate(self._agreed(input_fn(), need_labels=need_labels)):
                if steps is not None and i >= steps:
                    break
                _, out = self._forward(batch)
                yield out, batch.labels, self.predictions_fn(out)

    def evaluate(self, input_fn: InputFn, steps: int | None = None) -> dict[str, float]:
        """Mean loss and ``eval_metrics`` over the batches of ``input_fn()`` (all ranks' batches, when
        sharded); appended to ``eval_metrics.csv``. Returns ``{"global_step", "loss", metric...}``."""
        preds, labels, loss_sum, count = [], [], 0.0, 0
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"Estimator.evaluate: `steps` must be an int >= 1 or None (as TF), got {steps!r}.")
        for out, y, p in self._predict_batches(input_fn, steps, need_labels=True):
            assert y is not None
            y_t = shaped_like(y, out)
            loss_sum += float(self.loss_fn(out, y_t)) * len(y_t)
            count += len(y_t)
            preds.append(p.float().cpu().numpy().reshape(-1))
            labels.append(y_t.cpu().numpy().reshape(-1))
        p_all = np.concatenate(preds) if preds else np.zeros(0)
        y_all = np.concatenate(labels) if labels else np.zeros(0)
        if comm.is_distributed(self._group):
            parts = comm.all_gather_object((p_all, y_all, loss_sum, count), self._group)
            p_all = np.concatenate([q[0] for q in parts])
            y_all = np.concatenate([q[1] for q in parts])
            loss_sum, count = sum(q[2] for q in parts), sum(q[3] for q in parts)
        if count == 0:
            raise ValueError("Estimator.evaluate: input_fn yielded no examples (on any rank); nothing to evaluate.")
        result = {"global_step": float(self.global_step), "loss": loss_sum / count}
        for name, fn in self.eval_metrics.items():
            result[name] = float(fn(p_all, y_all))
        self._log("eval", {"step": float(self.global_step), **{k: v for k, v in result.items() if k != "global_step"}})
        return result

    def predict(self, input_fn: InputFn, yield_single_examples: bool = True) -> Iterator[np.ndarray]:
        """Predictions (after ``predictions_fn``) for the batches of ``input_fn()`` (features, or
        (features, labels) pairs): one array per example, or per batch with ``yield_single_examples=False``."""
        for _, _, p in self._predict_batches(input_fn, None):
            arr = p.float().cpu().numpy()
            if yield_single_examples:
                yield from arr
            else:
                yield arr

    def export_model(
        self,
        out: str | os.PathLike[str],
        example: Mapping[str, Any],
        *,
        transform: RowTransform | None = None,
        task: str | None = None,
        label: str | None = None,
        dtype: str = "float32",
        incremental: bool = False,
    ) -> ModelExport:
        """Write a model artifact of ``model_dir``'s newest checkpoint into ``out`` (``model_artifact``):
        ``embtables.load_model(out)`` scores raw rows with it, ``embtables predict`` / ``serve`` too. ``example``:
        a batch of features as ``input_fn`` yields them (its tensor values, batch in dimension 0, show the dense
        program what it reads); ``transform``: the raw rows -> features step, when the features are not the raw
        columns themselves; ``task`` ("binary", "regression") and ``label`` are recorded for the tools.
        ``incremental=True`` adds the newer step to an artifact of this model at ``out``."""
        tensors = {k: v for k, v in example.items() if isinstance(v, Tensor)}
        model = copy.deepcopy(self.model).cpu()  # the checkpoint's weights go into a copy, never the live model
        if self.spec.feature_columns is not None:
            parts = ModelParts(model, list(self.spec.feature_columns), transform, self.predictions_fn, task, label,
                               tensors)  # fmt: skip
        else:  # a spec of dicts: the rows give the tables' inputs by feature name
            features = dict(self.spec.feature_to_config_dict or {})
            shapes: dict[str, tuple[int, ...]] = {
                n: (f.max_sequence_length, f.table.dim) if f.max_sequence_length else (f.table.dim,)
                for n, f in features.items()
            }
            tensors = {k: v for k, v in tensors.items() if k not in features}
            parts = ModelParts(model, [], transform, self.predictions_fn, task, label, tensors, tuple(features),
                               None, shapes)  # fmt: skip
        return export_model(self.model_dir, out, parts, dtype, incremental=incremental)

    # ------------------------------------------------------------------ logging
    def _bar(self, total: int | None, what: str) -> Any:
        if not self.progress or self.rank != 0:
            return None
        try:
            from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            return None
        return tqdm(total=total, desc=f"embtables {what}", unit="step", dynamic_ncols=True)

    def _log(self, split: str, row: dict[str, float]) -> None:
        if split == "train":
            self.history.append(row)
        if self.rank != 0:
            return
        self.model_dir.mkdir(parents=True, exist_ok=True)
        path = self.model_dir / f"{split}_metrics.csv"
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(row))
            if new:
                writer.writeheader()
            writer.writerow(row)
        if split == "eval" or row["step"] % self.log_step_count_steps == 0:
            logger.info(
                "%s step %d: %s",
                split,
                int(row["step"]),
                ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "step"),
            )
        writer_tb = self._tensorboard()
        if writer_tb is not None:
            for k, v in row.items():
                if k != "step":
                    writer_tb.add_scalar(f"{split}/{k}", v, int(row["step"]))
            writer_tb.flush()

    def _tensorboard(self) -> Any:
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            except ImportError:
                self._writer = False
            else:
                self._writer = SummaryWriter(str(self.model_dir))
        return self._writer or None
