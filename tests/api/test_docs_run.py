"""Every Python block in README.md and docs/*.md runs as copied (issue 22, item 8).

A file's blocks run in order in one fresh process (a reader copies them in order), in an empty
directory. A block that starts a process group (``init_process_group``) is a whole program and runs as
``torchrun --nproc_per_node=2`` runs it: two processes with the environment torchrun gives its workers
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), forked from ``fast_child``'s
preloaded server (torchrun itself, launcher and exit, is run by ``test_sharded_example.py`` and
``test_ranks_agree.py``'s clean-exit test). Blocks of TensorFlow code (first line ``# TensorFlow``) are
the other side of a comparison and are not run; a block importing a package that is not installed
here (TorchRec) is skipped only when that package is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import fast_child
import pytest
from subproc import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)
_OPTIONAL = {"torchrec": "torchrec", "tensorflow": "tensorflow"}


def python_blocks(path: Path) -> list[str]:
    return [textwrap.dedent(m.group(2)) for m in _BLOCK.finditer(path.read_text())]


def _needs_missing_package(block: str) -> str | None:
    for module in _OPTIONAL:
        if re.search(rf"^\s*(from|import) {module}\b", block, re.M) and importlib.util.find_spec(module) is None:
            return module
    return None


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_every_doc_has_its_blocks_found() -> None:
    counts = {p.name: len(python_blocks(p)) for p in DOCS}
    assert counts["README.md"] >= 3 and counts["porting_from_tf.md"] >= 15 and counts["optimizers.md"] >= 6, counts


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_the_python_blocks_of_a_doc_run_as_copied(doc: Path, tmp_path: Path) -> None:
    blocks = python_blocks(doc)
    inline, programs, skipped = [], [], []
    for i, block in enumerate(blocks):
        if block.lstrip().startswith("# TensorFlow"):
            continue
        if _needs_missing_package(block):
            skipped.append(i)
            continue
        (programs if "init_process_group" in block else inline).append((i, block))
    if inline:
        runner = (
            "import json, sys\nns = {'__name__': '__main__'}\n"
            f"blocks = json.loads({json.dumps(json.dumps(inline))})\n"
            "for i, src in blocks:\n"
            f"    exec(compile(src, {doc.name!r} + f' block #{{i}}', 'exec'), ns)\n"
        )
        out = fast_child.run(
            [sys.executable, "-c", runner], capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300
        )
        assert out.returncode == 0, f"{doc.name}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        assert "Sparse invariant checks are implicitly disabled" not in out.stderr, "torch's SEGFAULT warning"
    for i, program in programs:
        outs = fast_child.run_as_torchrun_workers(
            [sys.executable, "-c", program], 2, capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300
        )
        for rank, out in enumerate(outs):  # a rank that failed first: the other may then time out waiting
            if not isinstance(out, BaseException):
                assert out.returncode == 0, (
                    f"{doc.name} block #{i}, rank {rank} of 2:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
                )
        for out in outs:
            if isinstance(out, BaseException):
                raise out


ALONE = ("Half-precision tables", "Tables larger than memory", "Checkpoints and serving", "Serving")


def _section_blocks(title: str) -> list[str]:
    """The Python blocks of the README section whose heading starts with ``title``."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 4)
    return [textwrap.dedent(m.group(2)) for m in _BLOCK.finditer(text[start : end if end > 0 else len(text)])]


@pytest.mark.parametrize("title", ALONE)
def test_these_readme_sections_run_alone_in_a_fresh_directory(title: str, tmp_path: Path) -> None:
    """A reader copies one section's blocks, not the whole README: they import and build what they use."""
    blocks = _section_blocks(title)
    assert blocks, title
    for i, block in enumerate(blocks):
        where = tmp_path / f"block{i}"
        where.mkdir()
        out = fast_child.run(
            [sys.executable, "-c", block], capture_output=True, text=True, cwd=where, env=_env(), timeout=300
        )
        assert out.returncode == 0, f"{title} block #{i}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"


def test_the_main_job_numbers_in_the_readme_match_the_recorded_runs() -> None:
    """Every number README.md quotes (main jobs, benchmarks against the peers, sharded steps, checkpoint
    throughput, oracle errors, clean exits, the suite's time) equals the result its run recorded in
    docs/results/ (scripts/readme_numbers.py --measure ...), and the DLRM teacher's metrics equal a
    fresh computation."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readme_numbers.py"), "--check"],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
