"""TensorFlow-side fixtures and checks for embtables' TF interop (run with a Python that has TensorFlow;
the test suite does not need it).

    python scripts/tf_fixtures.py write tests/fixtures/tf      # TF's own writer: the committed fixtures
    python scripts/tf_fixtures.py check PREFIX                 # TF restores a checkpoint embtables wrote

The model: TPUEmbeddingForServing with tables "video" (40 x 6, Adagrad: accumulators) and "user"
(9 x 4, Adam: momenta, velocities), every value set to ``value(table, slot)`` below, which the
embtables tests recompute.
"""

from __future__ import annotations

import sys

import numpy as np


def value(table: str, slot: str, shape: tuple[int, int]) -> np.ndarray:
    slots = {"parameters": 0.0, "accumulators": 0.25, "momenta": 0.5, "velocities": 0.75}
    base = {"video": 1.0, "user": 2.0}[table] + slots[slot]
    return (base + np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape) / 1000).astype(np.float32)


def build():  # type: ignore[no-untyped-def]
    import tensorflow as tf

    e = tf.tpu.experimental.embedding
    video = e.TableConfig(vocabulary_size=40, dim=6, name="video", optimizer=e.Adagrad(0.1))
    user = e.TableConfig(vocabulary_size=9, dim=4, name="user", optimizer=e.Adam(0.01))
    features = {"watched": e.FeatureConfig(table=video), "user": e.FeatureConfig(table=user)}
    emb = e.TPUEmbeddingForServing(features, optimizer=e.SGD(0.1))
    emb.build()
    return tf, emb


def main() -> int:
    tf, emb = build()
    if sys.argv[1] == "write":
        for table, variables in emb._variables.items():
            for slot, var in variables.items():
                var.assign(value(table, slot, tuple(var.shape)))
        path = tf.train.Checkpoint(model=emb).write(f"{sys.argv[2]}/tpu_embedding")
        print(path)
        return 0
    status = tf.train.Checkpoint(model=emb).read(sys.argv[2])
    status.assert_existing_objects_matched()
    bad = []
    for table, variables in emb._variables.items():
        for slot, var in variables.items():
            if not np.array_equal(var.numpy(), value(table, slot, tuple(var.shape)) * 2):
                bad.append(f"{table}/{slot}")
    print("TF restored every table and slot" if not bad else f"mismatch: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
