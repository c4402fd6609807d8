"""``embtables quickstart``: train a small click-through-rate model on synthetic data in seconds.

    python -m embtables quickstart                      # Adagrad, 2000 steps, ~10 s on 2 CPU cores
    python -m embtables quickstart --optimizer ftrl --steps 500 --seed 1

(``embtables train`` is the full job: a DLRM through the Estimator, MovieLens, your own data.)

The model is the usual recommender shape:

    features (dict of Ragged ids) -> DistributedEmbedding -> {feature: [B, D]} -> concat [B, F*D]
                                  -> MLP -> logit [B] -> BCE loss

The embedding tables are updated by embtables' fused sparse optimizer, exactly as TF's
``TPUEmbedding`` would update them (``loss.backward()`` then ``emb.apply_gradients()``); the MLP is
updated by ``torch.optim.Adam``. The tables are not ``nn.Parameter``s, so ``model.parameters()``
holds only the MLP.

The data come from ``embtables.data.SyntheticCTR``: labels are drawn from a hidden "teacher"
model, so the script can also print the best achievable held-out loss and AUC for comparison.

The script exits with status 1 when the loss did not fall, so it doubles as a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import embtables
from embtables.cli.job_runner import Parser
from embtables.data import SyntheticCTR, SyntheticCTRConfig
from embtables.estimator.metrics import auc

OPTIMIZERS = ("adagrad", "adam", "ftrl", "sgd")


class BiasCorrectedAdamLR:
    """A dynamic learning rate giving textbook (bias-corrected) Adam on top of TPU Adam.

    TPU Adam has no bias correction; ``lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)`` restores it.
    embtables calls a learning-rate callable exactly once per ``apply_gradients`` (and tables that
    share the callable share that one value), so counting calls counts steps.
    """

    def __init__(self, lr: float, beta_1: float, beta_2: float) -> None:
        self.lr, self.beta_1, self.beta_2 = lr, beta_1, beta_2
        self.step = 0

    def __call__(self) -> float:
        self.step += 1
        t = self.step
        return self.lr * math.sqrt(1.0 - self.beta_2**t) / (1.0 - self.beta_1**t)


def make_optimizer(name: str) -> embtables.SGD | embtables.Adagrad | embtables.Adam | embtables.FTRL:
    """The embedding optimizer for ``--optimizer``, with learning rates that suit this task.

    The loss is a mean over the batch and each row's gradient is a sum over its occurrences (as on
    TPU), so per-row gradients are of order 1/B. SGD, which does not normalise them, needs a large
    learning rate; Adagrad gets a small ``initial_accumulator_value`` because TF's default of 0.1
    would dwarf the squared gradients and make it a small-step SGD for thousands of steps.
    """
    if name == "adagrad":
        return embtables.Adagrad(learning_rate=0.1, initial_accumulator_value=1e-4)
    if name == "adam":
        return embtables.Adam(learning_rate=BiasCorrectedAdamLR(0.01, 0.9, 0.999), beta_1=0.9, beta_2=0.999)
    if name == "ftrl":
        return embtables.FTRL(learning_rate=1.0)
    if name == "sgd":
        return embtables.SGD(learning_rate=30.0)
    raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {name!r}.")


class CTRModel(nn.Module):
    """``DistributedEmbedding`` over the features, then an MLP on the concatenated activations.

    Args:
      feature_config: ``{feature name: FeatureConfig}`` (F features, each of width D).
      optimizer: the embedding optimizer for every table.
      hidden: the MLP's hidden widths.
    """

    def __init__(
        self,
        feature_config: dict[str, embtables.FeatureConfig],
        optimizer: embtables.SGD | embtables.Adagrad | embtables.Adam | embtables.FTRL,
        hidden: Sequence[int] = (64, 32),
    ) -> None:
        super().__init__()
        self.embedding = embtables.DistributedEmbedding(feature_config, optimizer=optimizer)
        self.feature_names = sorted(feature_config)  # activations come back in sorted-key order too
        width = sum(feature_config[k].table.dim for k in self.feature_names)
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, features: dict[str, embtables.Ragged]) -> Tensor:
        """Logits [B] for ``features`` ({name: Ragged [B, (ids)]})."""
        acts = self.embedding(features)  # {name: [B, D]}; leaf tensors that require grad in train mode
        x = torch.cat([acts[k] for k in self.feature_names], dim=1)  # [B, F*D]
        logits: Tensor = self.mlp(x).squeeze(1)
        return logits


def roc_auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (``embtables.estimator.auc``: Mann-Whitney U with tied scores
    averaged); 0.5 if one class is absent."""
    value = auc(scores.detach().cpu().double().numpy(), labels.detach().cpu().double().numpy())
    return 0.5 if math.isnan(value) else value


@dataclasses.dataclass(frozen=True)
class Evaluation:
    loss: float
    auc: float
    accuracy: float


def evaluate(logits: Tensor, labels: Tensor) -> Evaluation:
    loss = float(F.binary_cross_entropy_with_logits(logits, labels))
    accuracy = float(((logits > 0).float() == labels).float().mean())
    return Evaluation(loss=loss, auc=roc_auc(logits, labels), accuracy=accuracy)


@torch.no_grad()
def evaluate_model(model: CTRModel, features: dict[str, embtables.Ragged], labels: Tensor) -> Evaluation:
    """Held-out loss/AUC/accuracy; eval mode makes the lookup forward-only (no update pending)."""
    model.eval()
    try:
        return evaluate(model(features), labels)
    finally:
        model.train()


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What ``train`` measured; ``fell`` is the smoke-test verdict."""

    losses: list[float]
    first_loss: float  # mean training loss over the first window of steps
    last_loss: float  # mean training loss over the last window of steps
    eval_before: Evaluation
    eval_after: Evaluation
    teacher: Evaluation
    seconds: float

    @property
    def fell(self) -> bool:
        return self.last_loss < self.first_loss and self.eval_after.loss < self.eval_before.loss


def _progress(total: int, enabled: bool) -> tuple[Any, Callable[[str], None]]:
    """A tqdm bar on stderr (or None) and a ``log`` that prints lines on stdout without breaking it."""
    if enabled:
        try:
            from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            pass
        else:
            bar = tqdm(total=total, file=sys.stderr, unit="step", dynamic_ncols=True, leave=False)
            return bar, lambda line: bar.write(line, file=sys.stdout)
    return None, lambda line: print(line, flush=True)


def train(args: argparse.Namespace) -> TrainResult:
    """Build the model and data from ``args`` (see ``parse_args``), train, and measure."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = SyntheticCTR(SyntheticCTRConfig(seed=args.seed))
    feature_config = data.feature_configs(dim=args.dim)
    model = CTRModel(feature_config, make_optimizer(args.optimizer)).to(args.device)
    dense_opt = torch.optim.Adam(model.parameters(), lr=args.dense_lr)  # the MLP only: tables are not Parameters

    bar, log = _progress(args.steps, args.progress)
    resolved = model.embedding.resolved_config  # tables with their final names, and who uses them
    tables = ", ".join(
        f"{t.name} {t.vocabulary_size}x{t.dim} <- {[resolved.features[i].name for i in t.feature_indices]}"
        for t in resolved.tables
    )
    log(
        f"embtables {embtables.__version__} quickstart: optimizer={args.optimizer} steps={args.steps} "
        f"batch={args.batch_size} seed={args.seed} device={args.device}"
    )
    log(f"tables: {tables}")

    eval_features, eval_labels = data.batch(args.eval_size, 0, split="eval")
    teacher = evaluate(data.teacher_logits(eval_features), eval_labels)
    eval_features = {k: v.to(args.device) for k, v in eval_features.items()}
    eval_labels = eval_labels.to(args.device)
    before = evaluate_model(model, eval_features, eval_labels)
    log(
        f"held-out before training: loss {before.loss:.4f}  auc {before.auc:.4f}  "
        f"(teacher, the best possible: loss {teacher.loss:.4f}  auc {teacher.auc:.4f})"
    )

    losses: list[float] = []
    start = time.perf_counter()
    window_start, window_steps = start, 0
    after = before
    for step, (features, labels) in enumerate(data.batches(args.batch_size, args.steps), start=1):
        features = {k: v.to(args.device) for k, v in features.items()}
        logits = model(features)
        loss = F.binary_cross_entropy_with_logits(logits, labels.to(args.device))
        dense_opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call,unused-ignore]  # MLP .grad and d(loss)/d(activation)
        dense_opt.step()
        model.embedding.apply_gradients()  # the fused sparse update of every table
        losses.append(loss.item())
        window_steps += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        if step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            after = evaluate_model(model, eval_features, eval_labels)
            recent = losses[-window_steps:]
            log(
                f"step {step:5d}  loss {sum(recent) / len(recent):.4f}  held-out loss {after.loss:.4f}  "
                f"auc {after.auc:.4f}  acc {after.accuracy:.4f}  {window_steps / (now - window_start):7.1f} steps/s"
            )
            window_start, window_steps = time.perf_counter(), 0
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    k = max(1, min(20, len(losses) // 5))
    return TrainResult(
        losses=losses,
        first_loss=sum(losses[:k]) / k,
        last_loss=sum(losses[-k:]) / k,
        eval_before=before,
        eval_after=after,
        teacher=teacher,
        seconds=seconds,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = Parser(prog="embtables quickstart", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adagrad", help="embedding optimizer (default adagrad)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the tables and the MLP (default 0)")
    p.add_argument("--batch-size", type=int, default=256, help="samples per step (default 256)")
    p.add_argument("--dim", type=int, default=16, help="embedding width D of every table (default 16)")
    p.add_argument("--dense-lr", type=float, default=3e-3, help="torch.optim.Adam learning rate of the MLP")
    p.add_argument("--eval-size", type=int, default=4096, help="held-out samples (default 4096)")
    p.add_argument("--log-every", type=int, default=200, help="steps between log lines (default 200)")
    p.add_argument("--device", default="cpu", help="torch device for tables, slots and the MLP (default cpu)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the ops are small; more threads buy little and suffer on a busy machine)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm progress bar")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "dim", "eval_size", "log_every", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (math.isfinite(args.dense_lr) and args.dense_lr >= 0):
        p.error(f"--dense-lr must be a finite number >= 0, got {args.dense_lr}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device!r} is not a torch device (e.g. cpu, cuda, cuda:1)")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch has no CUDA device (torch {torch.__version__}); use --device cpu")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: embtables runs on cpu or cuda")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Train, print the log and a summary; 0 when the loss fell, 1 when it did not."""
    args = parse_args(argv)
    r = train(args)
    k = max(1, min(20, len(r.losses) // 5))
    print(
        f"summary: training loss {r.losses[0]:.4f} at step 1 -> {r.losses[-1]:.4f} at step {len(r.losses)}; "
        f"mean of first {k} steps {r.first_loss:.4f} -> mean of last {k} steps {r.last_loss:.4f}"
    )
    print(
        f"summary: held-out loss {r.eval_before.loss:.4f} -> {r.eval_after.loss:.4f} (teacher {r.teacher.loss:.4f}), "
        f"auc {r.eval_before.auc:.4f} -> {r.eval_after.auc:.4f} (teacher {r.teacher.auc:.4f})"
    )
    print(f"summary: {len(r.losses)} steps in {r.seconds:.1f} s ({len(r.losses) / r.seconds:.1f} steps/s)")
    if r.fell:
        print("PASS: the loss fell.")
        return 0
    print("FAIL: the loss did not fall (training and held-out loss must both go down).")
    return 1


if __name__ == "__main__":
    sys.exit(main())
