"""Float64 NumPy reference of the whole single-process embedding engine.

Follows docs/spec.md sections 1.1 (pipeline, accumulation, laziness), 2 (lookups) and 10 (binding
decisions: no-accumulation order, id checks, non-finite gradients).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .np_embedding import COMBINERS, Ids, Weights, lookup, occurrences
from .np_optimizers import has_gradient_clip, init_slots, optimizer_name, param, update_row
from .np_subnormals import flush

FeatureInput = tuple[Ids, Weights]
# One occurrence reaching a table: (sample b, feature index, position k, row id, gradient (D,)).
_Occurrence = tuple[int, int, int, int, np.ndarray]


class OracleEngine:
    """Single-process engine: tables, slots, lookup and apply_gradients, all in float64.

    ``tables[name]`` = {"weights": (V, D) array, "combiner": "sum" | "mean" | "sqrtn" (default "mean"),
    "optimizer": opt dict (see np_optimizers), "quantization": None | (num_buckets, lower, upper)}.
    ``features[i]`` = {"table": name, "max_sequence_length": int (default 0), "validate": bool (default True),
    "name": optional str for messages}, in flattened feature order.
    """

    def __init__(self, tables: dict[str, dict[str, Any]], features: list[dict[str, Any]]) -> None:
        self.tables: dict[str, np.ndarray] = {}
        self.slots: dict[str, dict[str, np.ndarray]] = {}
        self.combiners: dict[str, str] = {}
        self.optimizers: dict[str, dict[str, Any]] = {}
        self.quantization: dict[str, tuple[int, float, float] | None] = {}
        for name, cfg in tables.items():
            weights = np.array(cfg["weights"], dtype=np.float64, copy=True)
            if weights.ndim != 2:
                raise ValueError(f"table {name!r}: weights must be 2-D, got shape {weights.shape}")
            combiner = cfg.get("combiner", "mean")  # spec §4.1: TableConfig default combiner
            if combiner not in COMBINERS:
                raise ValueError(f"table {name!r}: unknown combiner {combiner!r}")  # spec §2.1
            opt = dict(cfg["optimizer"])
            optimizer_name(opt)
            accumulate = bool(param(opt, "use_gradient_accumulation"))
            # spec §1.1 step 4 / 10.4: a gradient clip needs accumulation.
            if not accumulate and has_gradient_clip(opt):
                raise ValueError(f"table {name!r}: gradient clipping requires use_gradient_accumulation=True")
            # spec §1.3 Adam: lazy_adam=False together with use_gradient_accumulation=False raises.
            if opt["name"] == "Adam" and not param(opt, "lazy_adam") and not accumulate:
                raise ValueError(f"table {name!r}: lazy_adam=False requires use_gradient_accumulation=True")
            quantization = cfg.get("quantization")
            if quantization is not None and quantization[0] < 2:
                raise ValueError(f"table {name!r}: num_buckets must be >= 2")  # spec §2.1
            V, D = weights.shape
            self.tables[name] = weights
            self.slots[name] = init_slots(opt, V, D)
            self.combiners[name] = combiner
            self.optimizers[name] = opt
            self.quantization[name] = quantization

        self.features: list[dict[str, Any]] = []
        for i, feature in enumerate(features):
            if feature["table"] not in self.tables:
                raise ValueError(f"feature {i}: unknown table {feature['table']!r}")
            self.features.append(
                {
                    "table": feature["table"],
                    "max_sequence_length": int(feature.get("max_sequence_length", 0)),
                    "validate": bool(feature.get("validate", True)),
                    "name": feature.get("name", f"feature_{i}"),
                }
            )

    def _check_inputs(self, inputs: list[FeatureInput]) -> None:
        if len(inputs) != len(self.features):
            raise ValueError(f"expected {len(self.features)} feature inputs, got {len(inputs)}")

    def lookup(self, inputs: list[FeatureInput]) -> list[np.ndarray]:
        """Activations per feature with the current tables (spec §2.1, 2.2)."""
        self._check_inputs(inputs)
        outputs: list[np.ndarray] = []
        for feature, (ids, weights) in zip(self.features, inputs, strict=True):
            table_name = feature["table"]
            try:
                out = lookup(
                    self.tables[table_name],
                    ids,
                    weights,
                    self.combiners[table_name],
                    max_sequence_length=feature["max_sequence_length"],
                    validate=feature["validate"],
                    quantization=self.quantization[table_name],
                )
            except ValueError as e:
                raise ValueError(f"feature {feature['name']!r}, table {table_name!r}: {e}") from e
            outputs.append(out)
        return outputs

    def _collect_occurrences(
        self, inputs: list[FeatureInput], grads: list[np.ndarray | None]
    ) -> dict[str, list[_Occurrence]]:
        """Per table, every occurrence reaching it, in the order of spec §10.2.

        That order is sample-major (sample 0 first), then feature order, then position inside the sample.
        Raises ValueError (before anything changes) on bad ids/weights or a non-finite gradient
        (spec §10.5, 10.6).
        """
        per_table: dict[str, list[_Occurrence]] = {name: [] for name in self.tables}
        for i, (feature, (ids, weights), grad) in enumerate(zip(self.features, inputs, grads, strict=True)):
            table_name = feature["table"]
            D = self.tables[table_name].shape[1]
            B = len(ids)
            M = feature["max_sequence_length"]
            if grad is None:
                # spec §1.1: a None gradient is an explicit zero gradient (the rows are still touched).
                grad = np.zeros((B, M, D) if M > 0 else (B, D), dtype=np.float64)
            try:
                occ = occurrences(
                    ids,
                    weights,
                    self.combiners[table_name],
                    M,
                    grad,
                    validate=feature["validate"],
                    vocab_size=self.tables[table_name].shape[0],
                )
            except ValueError as e:
                raise ValueError(f"feature {feature['name']!r}, table {table_name!r}: {e}") from e
            for b, k, row_id, g in occ:
                if not np.all(np.isfinite(g)):  # spec §10.6
                    raise ValueError(f"table {table_name!r}: non-finite gradient for id {row_id}")
                per_table[table_name].append((b, i, k, row_id, g))
        for occ_list in per_table.values():
            occ_list.sort(key=lambda o: (o[0], o[1], o[2]))  # sample, feature, position (spec §10.2)
        return per_table

    def apply_gradients(
        self, inputs: list[FeatureInput], grads: list[np.ndarray | None], lrs: dict[str, float]
    ) -> None:
        """One training step from the activation gradients of the same inputs (spec §1.1, 10)."""
        self._check_inputs(inputs)
        if len(grads) != len(self.features):
            raise ValueError(f"expected {len(self.features)} gradients, got {len(grads)}")
        per_table = self._collect_occurrences(inputs, grads)

        # Phase 1 (nothing changes yet): accumulated per-row gradients, with the non-finite check.
        accumulated: dict[str, dict[int, np.ndarray]] = {}
        for name, occ_list in per_table.items():
            opt = self.optimizers[name]
            if not param(opt, "use_gradient_accumulation"):
                continue
            # spec §1.1 step 3: sum over all samples and all features sharing the table, one per touched row.
            sums: dict[int, np.ndarray] = {}
            for _, _, _, row_id, g in occ_list:
                if row_id not in sums:
                    sums[row_id] = np.zeros_like(g)
                sums[row_id] = flush(sums[row_id] + g)  # spec §1.5: a subnormal partial sum is zero
            for row_id, g_sum in sums.items():
                if not np.all(np.isfinite(g_sum)):
                    raise ValueError(f"table {name!r}: non-finite accumulated gradient for id {row_id}")
            if opt["name"] == "Adam" and not param(opt, "lazy_adam"):
                # spec §1.3 Adam non-lazy: every row is updated, with g = 0 for untouched rows.
                V, D = self.tables[name].shape
                for row_id in range(V):
                    if row_id not in sums:
                        sums[row_id] = np.zeros(D, dtype=np.float64)
            accumulated[name] = sums

        # Phase 2: compute the new tables and slots on copies, then commit them all.
        new_tables: dict[str, np.ndarray] = {}
        new_slots: dict[str, dict[str, np.ndarray]] = {}
        for name in self.tables:
            opt = self.optimizers[name]
            table = self.tables[name].copy()
            slots = {k: v.copy() for k, v in self.slots[name].items()}
            if name in accumulated:
                updates = [(row_id, g) for row_id, g in sorted(accumulated[name].items())]
            else:
                # spec §10.2: one occurrence at a time, in occurrence order.
                updates = [(row_id, g) for _, _, _, row_id, g in per_table[name]]
            if updates:
                if name not in lrs:
                    raise ValueError(f"no learning rate given for table {name!r}")
                lr = float(lrs[name])
            for row_id, g in updates:
                row_slots = {k: v[row_id] for k, v in slots.items()}
                w_new, row_slots_new = update_row(opt, table[row_id], row_slots, g, lr)
                table[row_id] = w_new
                for k, v in row_slots_new.items():
                    slots[k][row_id] = v
            new_tables[name] = table
            new_slots[name] = slots
        self.tables = new_tables
        self.slots = new_slots
