"""The native kernels' software prefetches survive compilation. A helper made of prefetches alone has no effect
a compiler must keep: GCC 12 marked ``et_prefetch_state`` const and deleted every call to it, so the fused
update and the dry run ran without prefetching (the standard update took about 1.6x as long) while the source said
otherwise. The helpers are always inlined now; this reads the built library's machine code (``objdump``, part
of the binutils every C toolchain brings) and checks that each loop over random rows still prefetches."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from embtables.kernels import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")

# each loop over random rows that prefetches in the source, by the functions its code may end up in (a static
# helper is compiled into its caller or on its own; an OpenMP body is a function named after its own: name.*)
FAMILIES = {
    "the fused float32 update": ("et_apply_rows",),
    "the fused float32 update that measures what it writes": ("et_apply",),
    "the dry run": ("et_check",),
    "the backed-up small update": ("et_apply_many", "et_update_backed_up"),
    "the float32 lookup": ("et_lookup_many", "et_bag"),
    "the bounds pass": ("et_fold_rows",),
    "the half update": ("et_apply_half_rows",),
    "the half lookup": (
        "et_lookup_half_many",
        "et_half_bag_of",
        "et_bag_half",
        "et_bag_bf16_v8",
        "et_bag_bf16_block64",
    ),
    "phase 1's hash": ("et_prepare_many", "et_prepare_one", "et_dedup"),
}


def _prefetches_by_function() -> dict[str, int]:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed: the machine code cannot be read")
    lib = native.library()
    assert lib is not None
    comment = subprocess.run([objdump, "-s", "-j", ".comment", lib._name], capture_output=True, text=True).stdout
    if "GCC:" not in comment or "clang" in comment:  # clang names OpenMP bodies without their function's name
        pytest.skip("the library was not built by GCC: its OpenMP bodies cannot be told apart by name")
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", lib._name], capture_output=True, text=True, check=True)
    counts: dict[str, int] = {}
    function = ""
    for line in text.stdout.splitlines():
        head = re.match(r"^[0-9a-f]+ <([^>@]+)>:$", line)
        if head:
            function = head.group(1)
            counts.setdefault(function, 0)
        elif "prefetch" in line:
            counts[function] = counts.get(function, 0) + 1
    return counts


def test_every_row_loop_that_prefetches_in_the_source_prefetches_in_the_library() -> None:
    counts = _prefetches_by_function()
    assert any(n > 0 for n in counts.values()), "the parser found no prefetch at all"

    def found(names: tuple[str, ...]) -> int:
        return sum(n for f, n in counts.items() if any(f == name or f.startswith(name + ".") for name in names))

    families = dict(FAMILIES)
    if native.bounds_path() == 16:  # built with AVX-512: the bounds pass's 16-lane loop is the one that runs
        families["the 16-lane bounds pass"] = ("et_fold_rows16",)
    missing = [family for family, names in families.items() if found(names) == 0]
    assert not missing, f"compiled without their prefetches: {missing}"
