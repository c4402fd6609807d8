"""The peers of ``embtables train --dataset adult``: scikit-learn's logistic regression (one-hot
categories, standardised numbers) and histogram gradient boosting (native categories), trained on the
same rows and scored on the same rows as the embedding model, timed in the same run."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from embtables.data.adult import CATEGORICAL, NUMERIC, Adult
from embtables.estimator import accuracy, auc


def _frame(data: Adult, index: np.ndarray) -> Any:
    import pandas as pd  # type: ignore[import-untyped,unused-ignore]

    return pd.DataFrame({k: data.columns[k][index] for k in (*CATEGORICAL, *NUMERIC)})


def peer_results(train: Adult, test: Adult, train_idx: np.ndarray, test_idx: np.ndarray) -> dict[str, dict[str, Any]]:
    """``{peer: {accuracy, auc, seconds}}`` or ``{peer: {skipped: why}}`` when scikit-learn is missing."""
    try:
        from sklearn.compose import make_column_transformer  # type: ignore[import-untyped,unused-ignore]
        from sklearn.ensemble import HistGradientBoostingClassifier  # type: ignore[import-untyped,unused-ignore]
        from sklearn.linear_model import LogisticRegression  # type: ignore[import-untyped,unused-ignore]
        from sklearn.pipeline import make_pipeline  # type: ignore[import-untyped,unused-ignore]
        from sklearn.preprocessing import (  # type: ignore[import-untyped,unused-ignore]
            OneHotEncoder,
            OrdinalEncoder,
            StandardScaler,
        )
    except ImportError as exc:
        why = f"scikit-learn unavailable ({exc}); pip install scikit-learn"
        return {"logistic regression": {"skipped": why}, "gradient boosting": {"skipped": why}}
    x_train, x_test = _frame(train, train_idx), _frame(test, test_idx)
    y_train, y_test = train.label[train_idx], test.label[test_idx]
    models = {
        "logistic regression": make_pipeline(
            make_column_transformer(
                (OneHotEncoder(handle_unknown="ignore"), list(CATEGORICAL)), (StandardScaler(), list(NUMERIC))
            ),
            LogisticRegression(max_iter=2000),
        ),
        "gradient boosting": make_pipeline(
            make_column_transformer(
                (OrdinalEncoder(handle_unknown="use_encoded_value", unknown_value=-1), list(CATEGORICAL)),
                ("passthrough", list(NUMERIC)),
            ),
            HistGradientBoostingClassifier(categorical_features=list(range(len(CATEGORICAL))), random_state=0),
        ),
    }
    out: dict[str, dict[str, Any]] = {}
    for name, model in models.items():
        start = time.perf_counter()
        model.fit(x_train, y_train)
        p = model.predict_proba(x_test)[:, 1]
        out[name] = {"accuracy": accuracy(p, y_test), "auc": auc(p, y_test), "seconds": time.perf_counter() - start}
    return out
