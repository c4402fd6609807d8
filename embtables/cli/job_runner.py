"""What every ``embtables`` job shares: one-line errors, a model directory checked before any work,
temporary directories removed at exit, and Ctrl-C that saves and says how to resume.

- A routine mistake (a missing file, a bad argument, bad data, a checkpoint of another model) is one
  line on stderr and exit code 2; ``--debug`` or ``EMBTABLES_DEBUG=1`` shows the traceback instead.
- ``--model-dir`` must be a directory embtables can write (checked first, so a job never trains
  for minutes before failing). Without it the job uses a new temporary directory, removed at exit
  unless ``--keep`` is given or the run was interrupted (its checkpoint is then needed to resume).
- Ctrl-C finishes the step in progress, saves a checkpoint, prints the command that resumes, and
  exits with 130.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from embtables.sharding import comm

DEBUG_ENV = "EMBTABLES_DEBUG"
ROUTINE = (ValueError, TypeError, OSError, RuntimeError, ImportError)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``prog: error: message (see prog --help)``) and
    whose help is plain text."""

    def format_help(self) -> str:  # docstrings double as help text: drop their reST literal quotes
        return super().format_help().replace("``", "")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def debugging(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False) or os.environ.get(DEBUG_ENV))


def fail(prog: str, message: object) -> int:
    """Print ``prog: error: message`` as one line on stderr; returns the exit code 2."""
    text = " ".join(str(message).split())
    print(f"{prog}: error: {text}", file=sys.stderr)
    return 2


def check_model_dir(path: str) -> Path:
    """``path`` as a directory that exists (created if needed) and can be written, or ``OSError``
    saying why not; only a probe file of this process's own is created and removed."""
    where = Path(path)
    if where.exists() and not where.is_dir():
        raise OSError(f"--model-dir {where} is a file, not a directory; give a directory")
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".embtables-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OSError(f"--model-dir {where} cannot be written ({exc.strerror or exc})") from None
    return where


def resume_command(argv: Sequence[str], model_dir: Path) -> str:
    """The command line that continues this run: the same arguments with ``--model-dir`` pinned."""
    rest: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--model-dir":
            skip = True
            continue
        if a.startswith("--model-dir="):
            continue
        rest.append(a)
    return shlex.join(["embtables", "train", *rest, "--model-dir", str(model_dir)])


def run_job(
    prog: str, argv: Sequence[str], args: argparse.Namespace, job: Callable[[argparse.Namespace], int],
    chosen_dir: Callable[[], Path],
) -> int:  # fmt: skip
    """Run ``job(args)`` with ``args.model_dir`` set, the errors, cleanup and Ctrl-C rules above."""
    temporary = args.model_dir is None
    try:
        args.model_dir = str(chosen_dir())
    except ROUTINE as exc:
        if debugging(args):
            raise
        return fail(prog, exc)
    interrupted = finished = False
    try:
        code = job(args)
        finished = code != 2  # 2: the job refused its input and said why in one line
        return code
    except KeyboardInterrupt as exc:
        interrupted = True
        where = getattr(exc, "checkpoint", None)
        saved = f"checkpoint saved at {where}" if where else f"the latest checkpoint is in {args.model_dir}"
        print(f"\n{prog}: interrupted; {saved}. Resume with:\n  {resume_command(argv, Path(args.model_dir))}",
              file=sys.stderr)  # fmt: skip
        return 130
    except ROUTINE as exc:
        if debugging(args):
            raise
        return fail(prog, exc)
    finally:
        # Rank 0 made the temporary directory and removes it: under torchrun another rank that finished first
        # removed it while rank 0 still wrote its report.
        if temporary and not interrupted and not getattr(args, "keep", False) and comm.get_rank() == 0:
            shutil.rmtree(args.model_dir, ignore_errors=True)
            if finished:  # after a routine mistake the one-line error stays the only line
                print(
                    f"{prog}: removed the temporary model directory {args.model_dir}; pass --model-dir DIR to keep "
                    "the checkpoint, curves and statistics (for embtables stats / inspect / export).",
                    file=sys.stderr,
                )


def table_storage(embedding: Any) -> dict[str, dict[str, Any]]:
    """Per table of a module (``DistributedEmbedding``): its shape, the storage types of its rows and slots, and
    whether it is offloaded, for a job's summary JSON."""
    out: dict[str, dict[str, Any]] = {}
    for t in embedding.resolved_config.tables:
        entry: dict[str, Any] = {"rows": t.config.storage, "slots": t.config.slot_storage}
        entry.update(vocabulary_size=t.vocabulary_size, dim=t.dim, offload=t.config.offload is not None)
        out[t.name] = entry
    return out


def storage_line(storage: dict[str, dict[str, Any]]) -> str:
    """One log line naming the tables' storage (``table_storage``), tables of the same kind together, e.g.
    ``storage: bfloat16 rows, float32 slots: user, item; float32 rows, float32 slots (offloaded): tags``."""
    kinds: dict[str, list[str]] = {}
    for name, s in storage.items():
        kind = f"{s['rows']} rows, {s['slots']} slots" + (" (offloaded)" if s["offload"] else "")
        kinds.setdefault(kind, []).append(name)
    return "storage: " + "; ".join(f"{kind}: {', '.join(names)}" for kind, names in kinds.items())


__all__ = [
    "Parser", "check_model_dir", "debugging", "fail", "resume_command", "run_job", "storage_line", "table_storage"
]  # fmt: skip
