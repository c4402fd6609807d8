"""Evaluation metrics on NumPy arrays (float64): AUC, accuracy, log-loss, RMSE, MAE. ``predictions`` and
``labels`` are [N]; classification metrics take probabilities in (0, 1) and labels in {0, 1}."""

from __future__ import annotations

import numpy as np


def auc(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (the Mann-Whitney statistic; tied scores count one half)."""
    p = np.asarray(predictions, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=np.float64).reshape(-1) > 0.5
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(p, kind="mergesort")
    ranks = np.empty(len(p), dtype=np.float64)
    sorted_p = p[order]
    # average ranks over ties
    starts = np.flatnonzero(np.r_[True, sorted_p[1:] != sorted_p[:-1]])
    ends = np.r_[starts[1:], len(p)]
    avg = (starts + ends - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    """The share of probabilities on the label's side of 0.5 (a probability of exactly 0.5 predicts 1)."""
    p = np.asarray(predictions, dtype=np.float64).reshape(-1) >= 0.5
    y = np.asarray(labels, dtype=np.float64).reshape(-1) > 0.5
    return float(np.mean(p == y)) if len(y) else float("nan")


def log_loss(predictions: np.ndarray, labels: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities ``predictions`` (clipped to [eps, 1 - eps])."""
    p = np.clip(np.asarray(predictions, dtype=np.float64).reshape(-1), eps, 1 - eps)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def rmse(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Root mean squared error."""
    d = np.asarray(predictions, dtype=np.float64).reshape(-1) - np.asarray(labels, dtype=np.float64).reshape(-1)
    return float(np.sqrt(np.mean(d * d)))


def mae(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Mean absolute error."""
    d = np.asarray(predictions, dtype=np.float64).reshape(-1) - np.asarray(labels, dtype=np.float64).reshape(-1)
    return float(np.mean(np.abs(d)))
