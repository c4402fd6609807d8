"""Markdown table and PNG chart from the benchmark's JSON records.

    python3 benchmarks/report.py results.jsonl [--out bench_out]

For each workload the table lists every impl's steps/s, ids/s, useful GB/s, the fraction of the
probe's bandwidth, peak memory, and embtables' speed-up over each peer measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

KEY = ("bench", "name", "ids", "optimizer", "tables", "rows", "dim", "batch", "pooling")


def probe_bandwidth(records: Iterable[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """``{dim: (gather GB/s, read-modify-write GB/s)}`` from the probe's records (best per dim)."""
    out: dict[int, tuple[float, float]] = {}
    for r in records:
        bench = str(r.get("bench", ""))
        if not bench.startswith("membw_") or "GBps" not in r:
            continue
        dim = int(r.get("row_bytes", 256)) // 4
        g, w = out.get(dim, (0.0, 0.0))
        if bench == "membw_gather":
            g = max(g, float(r["GBps"]))
        elif bench == "membw_rmw":
            w = max(w, float(r["GBps"]))
        out[dim] = (g, w)
    return out


def probe_time_ms(r: dict[str, Any], probe: dict[int, tuple[float, float]]) -> float | None:
    """The probe's time for the step's useful bytes: gathers at gather speed, row updates at RMW speed."""
    g, w = probe.get(int(r["dim"]), (0.0, 0.0))
    if not g:
        return None
    row = int(r["dim"]) * 4
    gathered = int(r["tables"]) * int(r["batch"]) * int(r["pooling"]) * row
    updated = max(0.0, float(r["useful_GBps"]) * float(r["median_ms"]) / 1e3 * 1e9 - gathered)
    if r["bench"] == "lookup" or not w:
        return gathered / (g * 1e9) * 1e3
    return (gathered / (g * 1e9) + updated / (w * 1e9)) * 1e3


def markdown(records: list[dict[str, Any]]) -> str:
    probe = probe_bandwidth(records)
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("bench") in ("train_step", "lookup") and "median_ms" in r:
            base_opt = r.get("optimizer") if r["bench"] == "train_step" else None
            key = (
                r["bench"],
                r["workload"],
                r["ids"],
                (base_opt or "").replace("_rowwise", ""),
                r["tables"],
                r["rows"],
                r["dim"],
                r["batch"],
                r["pooling"],
            )
            groups[key].append(r)
    lines = []
    for key, rs in groups.items():
        bench, name, ids, opt, tables, rows, dim, batch, pooling = key
        title = (
            f"{bench} · {name} · {opt or 'lookup only'} · ids {ids} · {tables}x{rows:,}x{dim}, B={batch}, L={pooling}"
        )
        lines += [
            f"#### {title}",
            "",
            "| impl | optimizer | median ms | steps/s | Mids/s | useful GB/s | % of probe | peak RSS GB "
            "| embtables speed-up |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        ours = next((r for r in rs if r["impl"] == "embtables"), None)
        for r in sorted(rs, key=lambda r: float(r["median_ms"])):
            pt = probe_time_ms(r, probe)
            frac = f"{pt / float(r['median_ms']) * 100:.0f}%" if pt else "n/a"
            speed = f"{float(r['median_ms']) / float(ours['median_ms']):.2f}x" if ours and r is not ours else "—"
            lines.append(
                f"| {r['impl']} | {r.get('optimizer') or '-'} | {float(r['median_ms']):.1f} | "
                f"{float(r['steps_per_s']):.2f} | "
                f"{float(r['ids_per_s']) / 1e6:.1f} | {float(r['useful_GBps']):.2f} | {frac} | "
                f"{float(r['peak_rss_MB']) / 1024:.2f} | {speed} |"
            )
        lines.append("")
    checks = [r for r in records if r.get("bench") == "oracle_check" and "max_abs_err" in r]
    if checks:
        lines += [
            "#### One step against the float64 oracle (2 tables x 1000 x 8, Zipf ids)",
            "",
            "| impl | optimizer | max abs error | max update | ok |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in checks:
            lines.append(
                f"| {r['impl']} | {r['optimizer']} | {r['max_abs_err']:.2e} | {r['max_update']:.2e} | "
                f"{'yes' if r['ok'] else 'NO'} |"
            )
        lines.append("")
    skips = [r for r in records if r.get("skipped")]
    if skips:
        lines += ["#### Skipped", ""]
        lines += [f"- {r.get('bench')} {r.get('impl')} {r.get('optimizer') or ''}: {r['skipped']}" for r in skips]
        lines.append("")
    return "\n".join(lines)


def chart(records: list[dict[str, Any]], path: Path) -> bool:
    """A bar chart of steps/s per impl for each training workload; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in records if r.get("bench") in ("train_step", "lookup") and "steps_per_s" in r]
    if not rows:
        return False

    def case(r: dict[str, Any]) -> tuple[str, str, str, str]:
        """Row-wise Adagrad is drawn beside the other Adagrad bars (a different optimizer, same workload)."""
        return (r["bench"], r["workload"], r["ids"], (r.get("optimizer") or "lookup").replace("_rowwise", ""))

    cases = sorted(
        {case(r) for r in rows},
        key=lambda c: (c[0] != "train_step", c[1], c[3], c[2]),
    )
    impls = sorted({r["impl"] for r in rows}, key=lambda i: (not i.startswith("embtables"), i))
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(cases)), 5))
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        vals = []
        for c in cases:
            r = next((r for r in rows if case(r) == c and r["impl"] == impl), None)
            vals.append(float(r["steps_per_s"]) if r else 0.0)
        ax.bar([i + k * width for i in range(len(cases))], vals, width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels(["\n".join((c[1], c[3], c[2])) for c in cases], fontsize=8)
    ax.set_ylabel("steps / s (higher is better)")
    ax.set_title("Embedding training steps per second, one process, same run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(records: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown(records))
    chart(records, out / "chart.png")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    with open(args.jsonl) as f:
        records = [json.loads(line) for line in f if line.strip().startswith("{")]
    write_report(records, Path(args.out))
    print(os.path.join(args.out, "report.md"))


if __name__ == "__main__":
    main()
