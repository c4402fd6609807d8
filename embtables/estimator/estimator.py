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

import csv
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from embtables.api import DistributedEmbedding
from embtables.checkpoint.store import published, read_manifest
from embtables.estimator.spec import EmbeddingConfigSpec
from embtables.sharding import comm

logger = logging.getLogger("embtables")

_END = object()
Batch = tuple[Mapping[str, Any], Any]
InputFn = Callable[[], Iterable[Batch]]
Metric = Callable[[np.ndarray, np.ndarray], float]


def _as_tensor(labels: Any, device: torch.device) -> Tensor:
    if isinstance(labels, Tensor):
        return labels.to(device=device, dtype=torch.float32)
    return torch.as_tensor(np.asarray(labels, dtype=np.float32), device=device)


def _labels_like(labels: Any, out: Tensor, device: torch.device) -> Tensor:
    """``labels`` as float32 shaped like the model's output, or a ``ValueError`` saying what differs."""
    y = _as_tensor(labels, device)
    if y.numel() != out.numel():
        raise ValueError(
            f"Estimator: the batch has {y.numel()} label value(s) of shape {tuple(y.shape)}, but model_fn returned "
            f"{tuple(out.shape)}; return one prediction per label. No table or parameter was changed."
        )
    return y.reshape(out.shape)


def _split(batch: Any) -> tuple[Mapping[str, Any], Any]:
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], Mapping):
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        return batch, None
    raise TypeError(
        f"Estimator: input_fn must yield (features, labels) with features a dict, got {type(batch).__name__}."
    )


class Estimator:
    """Train, evaluate and predict with embedding tables and a dense model.

    Args:
      model_fn: an ``nn.Module`` called as ``model_fn(activations, features)``, where ``activations``
        is ``{feature column name: [B, D] or [B, L, D]}`` and ``features`` the raw batch; it returns
        the predictions [B] (or [B, k]).
      embedding_config_spec: the ``EmbeddingConfigSpec`` of the tables.
      model_dir: where checkpoints and metrics go; an existing checkpoint there is resumed.
      dense_optimizer: a ``torch.optim.Optimizer`` over ``model_fn``'s parameters, or a callable
        ``params -> Optimizer``; default ``Adam(lr=1e-3)``.
      loss_fn: ``(predictions, labels) -> scalar``; default mean squared error.
      eval_metrics: ``{name: fn(predictions [N], labels [N]) -> float}`` computed by ``evaluate``
        (see ``embtables.estimator.metrics``); the mean loss is always reported.
      predictions_fn: maps ``model_fn``'s output to what ``predict`` and the metrics see (e.g.
        ``torch.sigmoid`` for logits); default identity.
      save_checkpoints_steps, keep_checkpoint_max, log_step_count_steps: as TF's ``RunConfig``.
      progress: show a progress bar (default: when stderr is a terminal).
    """

    def __init__(
        self,
        model_fn: nn.Module,
        embedding_config_spec: EmbeddingConfigSpec,
        model_dir: str | os.PathLike[str],
        dense_optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        eval_metrics: Mapping[str, Metric] | None = None,
        predictions_fn: Callable[[Tensor], Tensor] | None = None,
        *,
        device: torch.device | str | None = None,
        save_checkpoints_steps: int | None = 1000,
        keep_checkpoint_max: int = 3,
        log_step_count_steps: int = 100,
        progress: bool | None = None,
        process_group: Any = None,
    ) -> None:
        if not isinstance(model_fn, nn.Module):
            raise TypeError(f"Estimator: `model_fn` must be a torch.nn.Module, got {type(model_fn).__name__}.")
        if not isinstance(embedding_config_spec, EmbeddingConfigSpec):
            raise TypeError("Estimator: `embedding_config_spec` must be an embtables.estimator.EmbeddingConfigSpec.")
        for name, value in (
            ("log_step_count_steps", log_step_count_steps),
            ("keep_checkpoint_max", keep_checkpoint_max),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Estimator: `{name}` must be an int >= 1, got {value!r}.")
        if save_checkpoints_steps is not None and (
            not isinstance(save_checkpoints_steps, int) or save_checkpoints_steps < 1
        ):
            raise ValueError(
                f"Estimator: `save_checkpoints_steps` must be None or an int >= 1, got {save_checkpoints_steps!r}."
            )
        self.spec = embedding_config_spec
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
            self.dense_optimizer: torch.optim.Optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        elif isinstance(dense_optimizer, torch.optim.Optimizer):
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
        if self._restored:
            return
        self._restored = True
        if self.latest_checkpoint() is None:
            return
        manifest = self.embedding.restore(self.model_dir, progress=self.progress)
        extra = manifest.get("extra") or {}
        dense = torch.load(self.model_dir / extra["dense"], map_location=self.device, weights_only=True)
        self.model.load_state_dict(dense["model"])
        self.dense_optimizer.load_state_dict(dense["optimizer"])
        self.global_step = int(extra["global_step"])
        if self.rank == 0:
            logger.info("Estimator: resumed from %s at global step %d", self.latest_checkpoint(), self.global_step)

    def save(self) -> str:
        """Write a checkpoint of the current step into ``model_dir`` (every rank calls it)."""
        step = self.global_step
        dense_name = f"dense-{step:010d}.pt"
        if self.rank == 0:
            self.model_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.model_dir / f".{dense_name}.tmp"
            state = {"model": self.model.state_dict(), "optimizer": self.dense_optimizer.state_dict(), "step": step}
            torch.save(state, tmp)
            os.replace(tmp, self.model_dir / dense_name)  # the embedding checkpoint's publish commits both
        path = self.embedding.save(
            self.model_dir,
            keep_last=self.keep_checkpoint_max,
            extra={"global_step": step, "dense": dense_name},
            progress=self.progress,
        )
        if self.rank == 0:
            keep = set()
            for ckpt in published(self.model_dir):
                keep.add((read_manifest(ckpt)[1].get("extra") or {}).get("dense"))
            for f in self.model_dir.glob("dense-*.pt"):
                if f.name not in keep:
                    f.unlink(missing_ok=True)
        return path

    # ------------------------------------------------------------------ steps
    def _forward(self, features: Mapping[str, Any]) -> tuple[dict[str, Tensor], Tensor]:
        ids, weights = self.spec.engine_inputs(features)
        activations = self.embedding(ids, weights or None)
        return activations, self.model(activations, features)

    def _train_step(self, features: Mapping[str, Any], labels: Any) -> float:
        self.embedding.train()
        self.model.train()
        activations, out = self._forward(features)
        loss = self.loss_fn(out, _labels_like(labels, out, self.device))
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        fn = self.spec.experimental_gradient_multiplier_fn
        multiplier = float(fn(self.global_step)) if fn is not None else 1.0
        grads = {}
        for name, a in activations.items():
            g = a.grad if a.grad is not None else torch.zeros_like(a)
            grads[name] = g * multiplier if fn is not None else g
        self.embedding.apply_gradients(grads)
        params = [p.grad for p in self.model.parameters() if p.grad is not None]
        comm.all_reduce_mean_(params, self._group)
        self.dense_optimizer.step()
        self.global_step += 1
        return float(loss.detach())

    def _agreed(self, batches: Iterable[Any]) -> Iterator[Any]:
        """The batches, until any rank's input ends (sharded lookups are collective: a rank with no
        batch left would leave the others waiting). One process: all of them."""
        it = iter(batches)
        distributed = comm.is_distributed(self._group)
        while True:
            batch = next(it, _END)
            if distributed and comm.any_rank(batch is _END, self._group):
                if batch is not _END:
                    logger.warning("Estimator: another rank's input ended first; the remaining batches are skipped.")
                return
            if batch is _END:
                return
            yield batch

    # ------------------------------------------------------------------ public verbs
    def train(self, input_fn: InputFn, steps: int | None = None, max_steps: int | None = None) -> Estimator:
        """Train on the batches of ``input_fn()`` for ``steps`` more steps (or up to global step
        ``max_steps``, or until the input ends); resumes from ``model_dir`` first. Returns self."""
        if steps is not None and max_steps is not None:
            raise ValueError("Estimator.train: give `steps` or `max_steps`, not both (as TF).")
        self._maybe_restore()
        target = self.global_step + steps if steps is not None else max_steps
        if target is not None and self.global_step >= target:
            return self
        bar = self._bar(None if target is None else target - self.global_step, "train")
        losses: list[float] = []
        t0 = last_t = time.perf_counter()
        last_step, examples = self.global_step, 0
        try:
            for batch in self._agreed(input_fn()):
                features, labels = _split(batch)
                if labels is None:
                    raise TypeError("Estimator.train: input_fn must yield (features, labels); got no labels.")
                losses.append(self._train_step(features, labels))
                examples += len(labels)
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
        finally:
            if bar is not None:
                bar.close()
        self.save()
        return self

    def _predict_batches(self, input_fn: InputFn, steps: int | None) -> Iterator[tuple[Tensor, Any, Tensor]]:
        self._maybe_restore()
        self.embedding.eval()
        self.model.eval()
        with torch.no_grad():
            for i, batch in enumerate(self._agreed(input_fn())):
                if steps is not None and i >= steps:
                    break
                features, labels = _split(batch)
                _, out = self._forward(features)
                yield out, labels, self.predictions_fn(out)

    def evaluate(self, input_fn: InputFn, steps: int | None = None) -> dict[str, float]:
        """Mean loss and ``eval_metrics`` over the batches of ``input_fn()`` (all ranks' batches, when
        sharded); appended to ``eval_metrics.csv``. Returns ``{"global_step", "loss", metric...}``."""
        preds, labels, loss_sum, count = [], [], 0.0, 0
        for out, y, p in self._predict_batches(input_fn, steps):
            y_t = _labels_like(y, out, self.device)
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
        result = {"global_step": float(self.global_step), "loss": loss_sum / count if count else math.nan}
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
