"""The Estimator's dense file: the dense model's and its optimizer's state for one checkpoint step,
written atomically beside the embedding checkpoint that names it, and read back only after every key,
shape, dtype and parameter group was checked against the model (nothing is applied here)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from embtables.checkpoint.file_names import CheckpointError, contained
from embtables.checkpoint.owned_dirs import fsync_dir
from embtables.checkpoint.store import read_manifest

DENSE_FILE = re.compile(r"dense-\d{10}\.pt")  # the dense files the Estimator writes (and only those it removes)


class DenseOptimizer(Protocol):
    """What the Estimator uses of its dense optimizer: ``torch.optim.Optimizer``'s four methods."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def step(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def read_dense(
    ckpt: Path, model_dir: Path, model: nn.Module, optimizer: DenseOptimizer, device: torch.device
) -> dict[str, Any]:
    """The dense file a checkpoint names, checked against this model (keys, shapes, dtypes, the
    optimizer's parameter groups) and the checkpoint's step; nothing is applied."""
    _, manifest = read_manifest(ckpt)
    extra = manifest.get("extra") or {}
    name, step = extra.get("dense"), extra.get("global_step")
    if (
        not isinstance(name, str)
        or not DENSE_FILE.fullmatch(name)
        or isinstance(step, bool)
        or not isinstance(step, int)
    ):
        raise CheckpointError(f"{ckpt}: its manifest does not name a dense file and a global step of an Estimator.")
    path = contained(model_dir, name, f"{ckpt / 'manifest.json'}'s extra.dense")
    try:
        dense = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # torch.load raises many types on a damaged file
        raise CheckpointError(f"{path}: the dense model file is missing or unreadable ({exc}).") from exc
    if not isinstance(dense, dict) or {"model", "optimizer", "step"} - set(dense):
        raise CheckpointError(f"{path}: not a dense model file written by the Estimator.")
    if dense["step"] != step:
        raise CheckpointError(f"{path}: holds step {dense['step']!r}, the checkpoint step {step}.")
    mine = model.state_dict()
    theirs = dense["model"]
    if not isinstance(theirs, dict) or set(theirs) != set(mine):
        missing, extra_keys = sorted(set(mine) - set(theirs or {})), sorted(set(theirs or {}) - set(mine))
        raise CheckpointError(
            f"{path}: the dense model does not match model_fn (missing {missing[:5]}, unexpected {extra_keys[:5]})."
        )
    for key, value in mine.items():
        other = theirs[key]
        if not isinstance(other, Tensor) or other.shape != value.shape or other.dtype != value.dtype:
            got = tuple(other.shape) if isinstance(other, Tensor) else type(other).__name__
            raise CheckpointError(
                f"{path}: dense parameter {key!r} is {got} in the checkpoint, {tuple(value.shape)} in model_fn "
                "(was the model changed, e.g. a different --dim?). Use a new model_dir for a different model."
            )
    opt = dense["optimizer"]
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    mine_groups = optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != [
        len(g["params"]) for g in mine_groups
    ]:
        raise CheckpointError(f"{path}: the dense optimizer state does not match dense_optimizer's parameters.")
    return dense


def write_dense(model_dir: Path, name: str, step: int, model: nn.Module, optimizer: DenseOptimizer) -> None:
    """Write the dense model and optimizer state for ``step`` as ``model_dir/name``, atomically and fsynced."""
    model_dir.mkdir(parents=True, exist_ok=True)
    tmp = model_dir / f".{name}.{os.getpid()}.tmp"
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, model_dir / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(model_dir)
