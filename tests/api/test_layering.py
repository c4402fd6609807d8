"""Import direction between layers (STYLE section 2, R6), checked on the source with ``ast``.

Layers, bottom to top: config(0) <- kernels(1) <- tables(2) <- sharding(3) <- checkpoint(4) <- top(5).
A module may import only from its own layer or below. ``config/`` never imports torch, and only
``embtables/sharding/comm.py`` may use ``torch.distributed``. A new subpackage or top-level module
fails the test until it is added to ``LAYERS``. Within a layer, modules import each other without a
circle (every import counts, ``TYPE_CHECKING`` and function-level ones included), and no backend
(``tables/backends/``) imports the collection or the engines that drive it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import embtables

PACKAGE = "embtables"
PACKAGE_DIR = Path(embtables.__file__).resolve().parent

TOP = 5
# First component under embtables/ -> layer. Top-level modules are keyed by their module name.
LAYERS: dict[str, int] = {
    "config": 0,
    "errors": 0,
    "_typing": 0,
    "kernels": 1,
    "tables": 2,
    "sharding": 3,
    "checkpoint": 4,
    "api": TOP,
    "estimator": TOP,
    "data": TOP,
    "cli": TOP,
    "__main__": TOP,
    "__init__": TOP,  # embtables/__init__.py, and `import embtables` itself
}
DISTRIBUTED_ALLOWED = {"embtables.sharding.comm"}


def module_name(rel_path: str) -> str:
    """``embtables/kernels/adam.py`` -> ``embtables.kernels.adam``; a package's ``__init__.py`` -> the package."""
    parts = list(Path(rel_path).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """The layer of an ``embtables`` module name; None when the map does not know it."""
    parts = module.split(".")
    assert parts[0] == PACKAGE, module
    if len(parts) == 1:
        return LAYERS["__init__"]
    return LAYERS.get(parts[1])


def _imported_modules(tree: ast.AST, this_module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import anywhere in ``tree`` (including in functions)."""
    package = this_module if is_package else this_module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts)
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target == PACKAGE:
                # `from embtables import errors` imports a layer-0 module; `from embtables import
                # DistributedEmbedding` imports the package root (top layer).
                out.extend(
                    (node.lineno, f"{PACKAGE}.{alias.name}" if alias.name in LAYERS else PACKAGE)
                    for alias in node.names
                )
                continue
            # `from torch import distributed`: a name may be a submodule, so check `target.name` too.
            out.append((node.lineno, target))
            out.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names if alias.name != "*")
    return out


def violations(rel_path: str, source: str) -> list[str]:
    """Every layering rule ``source`` (the file at ``rel_path``, relative to the repo root) breaks."""
    this = module_name(rel_path)
    is_package = rel_path.endswith("__init__.py")
    own = layer_of(this)
    found: list[str] = []
    if own is None:
        found.append(f"{rel_path}: unknown subpackage/module {this.split('.')[1]!r}; add it to LAYERS")
        return found
    in_config = this == "embtables.config" or this.startswith("embtables.config.")
    tree = ast.parse(source, filename=rel_path)
    for line, target in _imported_modules(tree, this, is_package):
        root = target.split(".")[0]
        if root == PACKAGE:
            theirs = layer_of(target)
            if theirs is None:
                found.append(f"{rel_path}:{line}: imports {target}, whose layer is unknown; add it to LAYERS")
            elif theirs > own:
                found.append(f"{rel_path}:{line}: layer {own} module imports {target} (layer {theirs})")
        if in_config and root == "torch":
            found.append(f"{rel_path}:{line}: config/ must not import torch ({target})")
        if (target == "torch.distributed" or target.startswith("torch.distributed.")) and (
            this not in DISTRIBUTED_ALLOWED
        ):
            found.append(f"{rel_path}:{line}: only sharding/comm.py may import torch.distributed ({target})")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
            and this not in DISTRIBUTED_ALLOWED
        ):
            found.append(f"{rel_path}:{node.lineno}: only sharding/comm.py may use torch.distributed")
    return found


def package_files() -> list[Path]:
    return sorted(
        p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts and "_benchmarks" not in p.parts
    )  # _benchmarks links to benchmarks/ (shipped as data), outside the layers


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE_DIR.parent))


def test_package_files_found() -> None:
    rels = {_rel(p) for p in package_files()}
    for expected in ("embtables/__init__.py", "embtables/api.py", "embtables/config/optimizers.py"):
        assert expected in rels


@pytest.mark.parametrize("path", package_files(), ids=_rel)
def test_module_respects_layers(path: Path) -> None:
    assert violations(_rel(path), path.read_text(encoding="utf-8")) == []


def module_edges(this: str, is_package: bool, tree: ast.AST, known: set[str]) -> set[str]:
    """The ``embtables`` modules (of ``known``) that module ``this`` imports. ``from pkg import name``
    depends on the submodule ``pkg.name`` when there is one, else on ``pkg`` (a name it re-exports)."""
    package = this if is_package else this.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                targets.add(sub if sub in known else target)
    out = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != this:
            out.add(target)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(_rel(p)): p for p in package_files()}
    known = set(files)
    return {
        m: module_edges(m, p.name == "__init__.py", ast.parse(p.read_text(encoding="utf-8")), known)
        for m, p in files.items()
    }


def test_the_package_has_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_no_backend_imports_what_drives_it() -> None:
    graph = import_graph()
    drivers = {"embtables.tables.collection", "embtables.tables.engine", "embtables.tables"}
    for module, imports in graph.items():
        if module.startswith("embtables.tables.backends"):
            assert not imports & drivers, (module, sorted(imports & drivers))
            assert not any(i.startswith(("embtables.sharding", "embtables.api")) for i in imports), module


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"x": {"y"}, "y": set()}) == []
    known = {"embtables.tables", "embtables.tables.collection", "embtables.tables.backends.gpu_backend"}
    type_checking = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from embtables.tables.collection import C\n"
    )
    edges = module_edges("embtables.tables.backends.gpu_backend", False, ast.parse(type_checking), known)
    assert edges == {"embtables.tables.collection"}  # a TYPE_CHECKING import counts
    edges = module_edges("embtables.tables.collection", False, ast.parse("from embtables.tables import x\n"), known)
    assert edges == {"embtables.tables"}  # a name the package re-exports: the package itself


# ---------------------------------------------------------------------------------------------
# Self-check: the checker catches what it is meant to catch.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rel_path, source, expected",
    [
        ("embtables/config/x.py", "import torch\n", "must not import torch"),
        ("embtables/config/x.py", "def f():\n    from torch import Tensor\n", "must not import torch"),
        ("embtables/config/x.py", "from embtables.kernels import sgd\n", "layer 0 module imports embtables.kernels"),
        ("embtables/errors.py", "from embtables.tables import Ragged\n", "layer 0 module imports embtables.tables"),
        ("embtables/kernels/x.py", "from embtables.tables.state import TableState\n", "imports embtables.tables"),
        ("embtables/kernels/x.py", "from ..tables import state\n", "imports embtables.tables"),
        ("embtables/kernels/__init__.py", "from ..api import DistributedEmbedding\n", "imports embtables.api"),
        ("embtables/tables/x.py", "from embtables import api\n", "imports embtables.api"),
        ("embtables/tables/x.py", "import embtables\n", "imports embtables (layer 5)"),
        ("embtables/tables/x.py", "from embtables import DistributedEmbedding\n", "imports embtables (layer 5)"),
        ("embtables/tables/x.py", "from embtables.sharding import plan\n", "imports embtables.sharding"),
        ("embtables/sharding/plan.py", "from embtables.checkpoint import io\n", "imports embtables.checkpoint"),
        ("embtables/checkpoint/io.py", "from embtables.estimator import spec\n", "imports embtables.estimator"),
        ("embtables/tables/x.py", "import torch.distributed as dist\n", "torch.distributed"),
        ("embtables/tables/x.py", "from torch import distributed\n", "torch.distributed"),
        ("embtables/sharding/plan.py", "from torch.distributed import all_reduce\n", "torch.distributed"),
        ("embtables/kernels/x.py", "import torch\ntorch.distributed.barrier()\n", "torch.distributed"),
        ("embtables/tables/x.py", "from embtables.newthing import y\n", "unknown"),
        ("embtables/newthing/x.py", "import torch\n", "unknown subpackage"),
    ],
)
def test_checker_catches_bad_imports(rel_path: str, source: str, expected: str) -> None:
    found = violations(rel_path, source)
    assert found, f"no violation found in {rel_path}: {source!r}"
    assert any(expected in v for v in found), found


@pytest.mark.parametrize(
    "rel_path, source",
    [
        ("embtables/config/x.py", "from embtables.errors import ConfigError\nfrom embtables.config import nest\n"),
        ("embtables/config/x.py", "from embtables import errors\nfrom . import nest\nimport math\n"),
        ("embtables/kernels/x.py", "import torch\nfrom embtables.config.optimizers import SGD\n"),
        ("embtables/tables/x.py", "from ..kernels import segments\nfrom embtables.config import resolve\n"),
        ("embtables/sharding/comm.py", "import torch.distributed as dist\nx = torch.distributed.get_rank\n"),
        ("embtables/api.py", "from embtables.checkpoint import io\nfrom embtables.estimator import spec\n"),
        ("embtables/__init__.py", "from embtables.api import DistributedEmbedding\n"),
        ("embtables/estimator/spec.py", "from embtables.api import DistributedEmbedding\n"),
        ("embtables/cli.py", "from embtables.estimator import spec\nimport embtables\n"),
        ("embtables/data/synth.py", "import numpy\nimport torch\n"),
    ],
)
def test_checker_accepts_good_imports(rel_path: str, source: str) -> None:
    assert violations(rel_path, source) == []
