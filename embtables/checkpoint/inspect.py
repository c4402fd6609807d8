"""``python -m embtables inspect CKPT``: what a checkpoint holds, and whether every block is intact."""

from __future__ import annotations

import argparse
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from embtables.checkpoint import increments
from embtables.checkpoint.file_names import CheckpointError
from embtables.checkpoint.store import read_manifest


def _file_status(where: Path, entry: dict[str, Any]) -> str:
    """OK, or what is wrong with one rank file (missing, wrong size, a block failing its CRC-32)."""
    file = where / entry["file"]
    try:
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"BAD (size {size}, expected {entry['bytes']})"
        data = np.memmap(file, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        for table, tb in entry["blocks"].items():
            named = {"rows": tb.rows, **tb.state, "stale_rows": tb.stale_rows, "stale": tb.stale}
            for key, block in named.items():
                if block is None:
                    continue
                piece = data[block.offset : block.offset + block.nbytes]
                if zlib.crc32(np.ascontiguousarray(piece).data) != block.crc32:
                    return f"BAD (table {table!r}, block {key!r})"
    except OSError as exc:
        return f"MISSING ({exc})"
    return "OK"


def summary(path: str) -> dict[str, Any]:
    """Tables (shape, optimizer, slots), step, writer, size on disk and a per-file checksum status."""
    where, manifest = read_manifest(path)
    files = [
        {"file": e["file"], "bytes": e["bytes"], "status": _file_status(where, e)} for e in manifest["checked_files"]
    ]
    tables = {
        name: {
            "shape": [t["vocabulary_size"], t["dim"]],
            "optimizer": t["optimizer"]["type"],
            "slots": t["slots"],
            "strategy": manifest["strategies"].get(name),
            "dynamic": t.get("dynamic"),
            "dtype": str(t.get("dtype", "float32")),  # the storage types of the model that saved it
            "slot_dtype": str(t.get("slot_dtype", "float32")),
        }
        for name, t in manifest["config"]["tables"].items()
    }
    try:
        links = [
            {
                "name": link.name,
                "step": m["step"],
                "kind": "increment" if increments.chain_of(m, link) else "full",
                "rows": sum(int(b["rows"]["count"]) for e in m["files"] for b in e["tables"].values()),
                "bytes": sum(int(e["bytes"]) for e in m["files"]),
            }
            for link, m in increments.resolve_chain(where, manifest, read_manifest)
        ]
        chain: dict[str, Any] = {"links": links, "error": None}
    except CheckpointError as exc:
        chain = {"links": [], "error": str(exc)}
    return {
        "path": str(where),
        "chain": chain,
        "step": manifest["step"],
        "world_size": manifest["world_size"],
        "tables": tables,
        "bytes": sum(f["bytes"] for f in files),
        "files": files,
        "ok": all(f["status"] == "OK" for f in files) and chain["error"] is None,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory, or a root holding ckpt-* directories (the latest)")


def _dynamic(policy: Any) -> str:
    """A dynamic table's policy in one cell (``-`` for a table of fixed ids)."""
    if not isinstance(policy, dict):
        return "-"
    return ", ".join(f"{k}={v}" for k, v in policy.items() if k != "type" and v is not None)


def _aligned(rows: list[list[str]], right: set[int]) -> list[str]:
    """``rows`` of cells as lines with aligned columns (``right``: right-aligned column indices)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]


def run(args: argparse.Namespace) -> int:
    s = summary(args.checkpoint)  # a missing or malformed checkpoint raises CheckpointError: exit code 2
    print(f"{s['path']}: step {s['step']}, written by {s['world_size']} rank(s), {s['bytes'] / 2**20:.1f} MiB")
    rows = [["table", "rows", "dim", "dtype", "optimizer", "slots", "placement", "dynamic"]]
    for name, t in s["tables"].items():
        slots = ", ".join(t["slots"]) or "-"
        stored = t["dtype"] if t["slot_dtype"] == "float32" or not t["slots"] else f"{t['dtype']}/{t['slot_dtype']}"
        rows.append([name, str(t["shape"][0]), str(t["shape"][1]), stored, str(t["optimizer"]), slots,
                     str(t["strategy"]), _dynamic(t["dynamic"])])  # fmt: skip
    for line in _aligned(rows, {1, 2}):
        print(line)
    files = [["file", "MiB", "checksum"]] + [[f["file"], f"{f['bytes'] / 2**20:.1f}", f["status"]] for f in s["files"]]
    for line in _aligned(files, {1}):
        print(line)
    chain = s["chain"]
    if chain["error"] is not None:
        print(f"chain: BROKEN: {chain['error']}")
    elif len(chain["links"]) > 1:
        print("chain (restored in this order):")
        rows = [["checkpoint", "step", "kind", "rows", "MiB"]] + [
            [c["name"], str(c["step"]), c["kind"], str(c["rows"]), f"{c['bytes'] / 2**20:.1f}"] for c in chain["links"]
        ]
        for line in _aligned(rows, {1, 3, 4}):
            print(line)
    print("checksums: OK" if all(f["status"] == "OK" for f in s["files"]) else "checksums: BAD")
    return 0 if s["ok"] else 1


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="embtables inspect")
    add_arguments(p)
    return run(p.parse_args(argv))


__all__ = ["main", "summary"]
