"""The registry of optimizer kernels: one ``KernelRecord`` per optimizer config class, from each
optimizer's own kernel module. Every dispatch on an optimizer goes through ``record_of``."""

from __future__ import annotations

from typing import Any

from embtables.kernels import (
    adadelta,
    adagrad,
    adagrad_momentum,
    adam,
    frequency_estimator,
    ftrl,
    momentum,
    proximal_adagrad,
    proximal_yogi,
    rmsprop,
    sgd,
)
from embtables.kernels.record import KernelRecord

RECORDS: tuple[KernelRecord, ...] = (
    sgd.RECORD,
    adagrad.RECORD,
    adagrad_momentum.RECORD,
    adam.RECORD,
    ftrl.RECORD,
    proximal_adagrad.RECORD,
    momentum.RECORD,
    rmsprop.RECORD,
    rmsprop.CENTERED_RECORD,
    adadelta.RECORD,
    proximal_yogi.RECORD,
    frequency_estimator.RECORD,
)
_BY_CONFIG = {r.config: r for r in RECORDS}
if len(_BY_CONFIG) != len(RECORDS) or len({r.native_kind for r in RECORDS}) != len(RECORDS):
    raise RuntimeError("embtables: two kernel records share a config class or a native kind.")


def record_of(opt: object) -> KernelRecord:
    """The kernel record of ``opt``'s exact type; ``TypeError`` listing the supported types otherwise."""
    record = _BY_CONFIG.get(type(opt))
    if record is None:
        supported = ", ".join(r.config.__name__ for r in RECORDS)
        raise TypeError(f"No sparse update for optimizer type {type(opt).__name__}; supported: {supported}.")
    return record


def markdown_table() -> str:
    """The kernel table of ``docs/optimizers.md`` (checked by ``tests/numerics/test_kernel_records.py``)."""
    lines = [
        "| optimizer | slots (domain kept) | native kind | native constants (float32, derived) | finiteness |",
        "|---|---|---|---|---|",
    ]
    for r in RECORDS:
        slots = r.config.SLOT_NAMES
        domains = r.slot_domains(_example(r))
        slot_text = ", ".join(f"`{s}` ({d})" for s, d in zip(slots, domains)) or "none"
        named = ", ".join(f"`{n}`" for n in r.flag_names + r.constant_names) or "none"
        proof = "exact dry run" if r.bounds is None else "proven from bounds"
        lines.append(f"| `{r.config.__name__}` | {slot_text} | {r.native_kind} | {named} | {proof} |")
    return "\n".join(lines) + "\n"


def _example(record: KernelRecord) -> object:
    """A default instance of the record's config (for its slot domains with default arguments)."""
    return record.config(learning_rate=0.1)


def record_of_type(config: type[Any]) -> KernelRecord:
    """The kernel record of the optimizer config class ``config``."""
    record = _BY_CONFIG.get(config)
    if record is None:
        raise TypeError(f"No kernel record for optimizer type {config.__name__}.")
    return record
