"""``python -m embtables inspect CKPT``: what a checkpoint holds, and whether every block is intact."""

from __future__ import annotations

import argparse
import zlib
from pathlib import Path
from typing import Any

import numpy as np

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
        }
        for name, t in manifest["config"]["tables"].items()
    }
    return {
        "path": str(where),
        "step": manifest["step"],
        "world_size": manifest["world_size"],
        "tables": tables,
        "bytes": sum(f["bytes"] for f in files),
        "files": files,
        "ok": all(f["status"] == "OK" for f in files),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory, or a root holding ckpt-* directories (the latest)")


def run(args: argparse.Namespace) -> int:
    s = summary(args.checkpoint)  # a missing or malformed checkpoint raises CheckpointError: exit code 2
    print(f"{s['path']}: step {s['step']}, written by {s['world_size']} rank(s), {s['bytes'] / 2**20:.1f} MiB")
    for name, t in s["tables"].items():
        print(f"  {name:24s} {t['shape'][0]} x {t['shape'][1]}  {t['optimizer']} {t['slots']}  ({t['strategy']})")
    for f in s["files"]:
        print(f"  {f['file']:24s} {f['bytes'] / 2**20:9.1f} MiB  {f['status']}")
    print("checksums: OK" if s["ok"] else "checksums: BAD")
    return 0 if s["ok"] else 1


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="embtables inspect")
    add_arguments(p)
    return run(p.parse_args(argv))


__all__ = ["main", "summary"]
