"""``python -m embtables stats DIR [--png FILE]``: lookup statistics files as a table (and, for offloaded
tables, their row caches' counters), and a per-shard load chart."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from embtables.checkpoint.owned_dirs import write_atomically
from embtables.cli.job_runner import fail
from embtables.cli.output_files import check_output
from embtables.cli.plotting import pyplot
from embtables.sharding.lookup_stats import read_all

_COLUMNS = ("table", "V", "D", "strategy", "W", "batches", "ids/sample", "unique/batch", "balance", "hottest rows")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="a profile_data_directory")
    p.add_argument("--png", metavar="FILE", help="also draw the ids landing on each shard, per table, into FILE")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --png FILE that is not a PNG image")
    p.add_argument("--top", type=int, default=3, help="hottest rows to list per table (default 3)")


def rows(docs: Sequence[dict[str, Any]], top: int) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for doc in docs:
        t, s = doc["table"], doc["summary"]
        hot = ", ".join(f"{r}x{n}" for r, n in s["hottest_rows"][:top])
        out.append(
            (
                str(t["name"]),
                str(t["vocabulary_size"]),
                str(t["dim"]),
                str(doc["strategy"]),
                str(doc["world_size"]),
                str(doc["counts"]["batches"]),
                "/".join(f"{v:.2f}" for v in s["ids_per_sample"]),
                f"{s['unique_ids_per_batch']:.1f}",
                f"{s['load_balance']:.2f}",
                hot,
            )
        )
    return out


def run(args: argparse.Namespace) -> int:
    if not Path(args.directory).is_dir():
        return fail("embtables stats", f"{args.directory}: no such directory (give a profile_data_directory)")
    if args.png:
        check_output(Path(args.png), "--png", "a PNG image", _png, overwrite=args.overwrite)
    docs = read_all(args.directory)
    if not docs:
        return fail(
            "embtables stats",
            f"no lookup statistics files in {args.directory} (a profile_data_directory holds <table>.json files "
            "after training; the synthetic DLRM job writes them into MODEL_DIR/lookup_stats)",
        )
    _print_table([_COLUMNS, *rows(docs, args.top)])
    offloaded = offload_rows(docs)
    if len(offloaded) > 1:
        print("\noffloaded tables (row cache since the module was built):")
        _print_table(offloaded)
    if args.png:
        return _draw(docs, args.png)
    return 0


_OFFLOAD_COLUMNS = ("table", "hit rate", "rows looked up", "rows read", "MiB read", "MiB written", "disk wait s",
                    "evictions", "cache rows")  # fmt: skip


def offload_rows(docs: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The header and one row a table whose file holds its row cache's counters (an offloaded table)."""
    out: list[tuple[str, ...]] = [_OFFLOAD_COLUMNS]
    for doc in docs:
        s = doc.get("offload")
        if not s:
            continue
        looked = s.get("rows_looked_up", 0)
        out.append(
            (
                str(doc["table"]["name"]),
                f"{s.get('hits', 0) / looked:.1%}" if looked else "-",
                f"{looked:.0f}",
                f"{s.get('rows_read', 0):.0f}",
                f"{s.get('bytes_read', 0) / 2**20:.1f}",
                f"{s.get('bytes_written', 0) / 2**20:.1f}",
                f"{s.get('disk_wait_s', 0):.2f}",
                f"{s.get('evictions', 0):.0f}",
                f"{s.get('cache_rows', 0):.0f}",
            )
        )
    return out


def _print_table(table: Sequence[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell, a rule under the header."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for k, r in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))


def _png(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a PNG image (what ``--png`` writes)."""
    return head.startswith(b"\x89PNG\r\n\x1a\n")


def _draw(docs: Sequence[dict[str, Any]], path: str) -> int:
    plt = pyplot()
    if plt is None:
        print("embtables stats: --png needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    fig, axes = plt.subplots(len(docs), 1, figsize=(7, 1.8 + 1.6 * len(docs)), squeeze=False)
    for ax, doc in zip(axes[:, 0], docs):
        shard = doc["counts"]["ids_per_shard"]
        ax.bar(range(len(shard)), shard, color="#4C72B0")
        ax.set_title(
            f"{doc['table']['name']} ({doc['strategy']}, W={doc['world_size']}): "
            f"load balance {doc['summary']['load_balance']:.2f}",
            fontsize=9,
        )
        ax.set_xticks(range(len(shard)))
        ax.set_xlabel("shard (rank)", fontsize=8)
        ax.set_ylabel("ids looked up", fontsize=8)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, dpi=100, format="png")
    plt.close(fig)
    write_atomically(Path(path), lambda f: f.write(image.getvalue()))
    print(f"wrote {path}")
    return 0
