"""Compile every fused GPU kernel variant the engine launches for an sm_90 GPU (H100/H200) on a machine
without one, and print registers and stack per variant: Triton's compiler errors (which its CPU
interpreter never raises) and register spills show up here before any GPU time is spent.

    python scripts/triton_compile_check.py          # needs Triton (scripts/install.sh installs it)

Arguments are specialized as a launch on aligned tensors would be (pointers and D divisible by 16).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from embtables.kernels import gpu
from embtables.kernels import triton_kernels as k
from embtables.kernels.registry import RECORDS

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
TILES = [(32, 64, 4), (16, 64, 2), (4, 512, 4), (128, 16, 4), (1, 4096, 8)]  # (ROWS, BLOCK_D, warps)
P = "*i64"
F = "*fp32"


def compile_one(fn: Any, types: dict[str, str], consts: dict[str, Any], warps: int, aligned: tuple[str, ...]) -> str:
    sig = dict(types)
    sig.update({c: "constexpr" for c in consts})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        options = {"num_warps": warps, "enable_fp_fusion": False}
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as exc:  # a compiler error: the point of this script
        return "FAIL " + str(exc).splitlines()[0][:160]
    path = "/tmp/embtables_check.cubin"
    with open(path, "wb") as fh:
        fh.write(ck.asm["cubin"])
    out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"regs {found.group(1)} stack {found.group(2)}" if found else "compiled"


def variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int]]:
    out = []
    lookup_types = {n: P for n in ("firsts", "table_ptrs", "types", "dims", "vocabs", "id_ptrs", "id_counts",
                                   "offset_ptrs", "coeff_ptrs", "out_ptrs", "out_lds")}  # fmt: skip
    lookup_types["status"] = "*i32"
    lookup_types["refused"] = P
    # the shapes gpu.lookup_many picks for bags of about ``pool`` ids of ``dim`` columns, F features
    for (pool, dim, features), mixed in itertools.product(
        ((20, 64, 32), (1, 64, 26), (1, 16, 8), (3, 512, 4), (100, 8, 2000), (20, 4096, 5), (4, 2500, 3)),
        (False, True),
    ):
        bags, block_n, block_d, warps = gpu._lookup_shape(pool, dim, features)
        fp = gpu._pow2(features)
        for refuse, storage in itertools.product((False, True), (0, 1, 2, 3)):  # float32, bf16, f16, mixed
            consts = dict(F=features, FP=fp, DIM=0 if mixed else dim, ALIGNED=not mixed and dim % 4 == 0, BAGS=bags,
                          BLOCK_N=block_n, BLOCK_D=block_d, REFUSE=refuse, TYPE=storage)  # fmt: skip
            out.append(("lookup", k.lookup_kernel, lookup_types, consts, warps))
    stage_types = {n: P for n in ("id_ptrs", "id_counts", "vocabs", "split_ptrs", "split_counts", "modes", "drops",
                                  "seg_at", "bag_at", "segs", "negs", "refused")}  # fmt: skip
    stage_types.update({"coeffs": F, "flags": "*i32", "steps": "i64"})
    for refuse, (drops, stage_pass) in itertools.product((False, True), ((False, 0), (True, 0), (True, 1))):
        consts = dict(BLOCK=1024, REFUSE=refuse, DROPS=drops, PASS=stage_pass)
        out.append(("stage", k.stage_kernel, stage_types, consts, 4))
    gather_types = {n: P for n in ("id_ptrs", "seg_ptrs", "coeff_ptrs", "counts", "at", "vocabs", "bases", "segs",
                                   "feats", "stats")}  # fmt: skip
    gather_types["coeffs"] = F
    for key64, hc in itertools.product((False, True), (False, True)):
        types = {**gather_types, "keys": P if key64 else "*i32"}
        out.append(("gather", k.gather_kernel, types, dict(KEY64=key64, HAS_COEFFS=hc, BLOCK=1024), 4))
    grads = {"grad0": F, "grad_ld": "i64", "grad_nrows": "i64", "grad_ptrs": P, "grad_lds": P, "grad_rows": P}
    sums_types = {"runs1": P, "starts": P, "segs": P, "coeffs": F, "feats": P, **grads, "sums": F, "pieces": F,
                  "stats": P, "N": "i64", "D": "i64"}  # fmt: skip
    marks_types = {"sorted_keys": "*i32", "perm": P, "segs": P, "coeffs": F, "feats": P, "sorted_ids": P,
                   "is_start": P, "sorted_segs": P, "sorted_coeffs": F, "sorted_feats": P, "grad_nrows": "i64",
                   "grad_rows": P, "stats": P, "N": "i64", "V": "i64"}  # fmt: skip
    update_types = {"rows": P, "stats": P, "bases": P, "tabs": P, "sums": F, "starts": P, "segs": P, "coeffs": F,
                    "feats": P, **grads, "pieces": F, "refused": P, "found": P, "D": "i64"}  # fmt: skip
    update_types.update({n: "fp32" for n in ("lr", "decay", "glo", "ghi", "wlo", "whi", "c0", "c1", "c2", "c3", "c4",
                                             "c5")})  # fmt: skip
    for hc, multi in itertools.product((False, True), (False, True)):
        out.append(("sort_marks", k.sort_marks_kernel, marks_types, dict(HAS_COEFFS=hc, MULTI=multi, BLOCK=1024), 4))
    for (rows, block_d, warps), (first, long_only), hc, multi in itertools.product(
        TILES, ((True, False), (True, True), (False, False), (False, True)), (False, True), (False, True)
    ):
        consts = dict(HAS_COEFFS=hc, MULTI=multi, ALIGNED=True, FIRST=first, LONG_ONLY=long_only, PIECE=128,
                      UNROLL=4, ROWS=rows, BLOCK_D=block_d)  # fmt: skip
        out.append(("piece_sums", k.piece_sums_kernel, sums_types, consts, warps))
    join_types = {"starts": P, "sums": F, "pieces": F, "stats": P, "N": "i64", "D": "i64"}
    for (rows, block_d, warps), in_place in itertools.product(TILES, (False, True)):
        consts = dict(IN_PLACE=in_place, PIECE=128, UNROLL=8, ROWS=rows, BLOCK_D=block_d)
        out.append(("piece_join", k.piece_join_kernel, join_types, consts, warps))
    # half storage (rows, slots, stochastic): float32; bf16 rows; f16 rows and slots; bf16 rows, f16 slots nearest
    storages = ((0, 0, False), (1, 0, True), (2, 2, True), (1, 2, False))
    for record, (rows, block_d, warps), (inline, hc, multi), write, steps, (row_t, slot_t, sr) in itertools.product(
        RECORDS, TILES[:3], ((False, False, False), (True, False, False), (True, True, True)), (False, True), (0, 6),
        storages,
    ):
        if row_t != 0 and (inline, hc, multi) != (True, False, False):
            continue  # half storage changes the loads and stores only: one sums variant each
        consts = dict(KIND=record.native_kind, NSLOTS=len(record.config.SLOT_NAMES), FLAG0=False, FLAG1=False,
                      POW_IS_SQRT=False, ROW_TYPE=row_t, SLOT_TYPE=slot_t, STOCHASTIC=sr, LIBDEVICE=True,
                      WRITE=write, INLINE=inline, HAS_COEFFS=hc, MULTI=multi, ALIGNED=True, ALIGNED_TABLES=True,
                      T_STEPS=steps, PIECE=128, UNROLL=4, ROWS=rows, BLOCK_D=block_d)  # fmt: skip
        out.append((f"update {record.config.__name__}", k.update_kernel, update_types, consts, warps))
    return out


def main() -> int:
    failed = 0
    for name, fn, types, consts, warps in variants():
        aligned = tuple(n for n, t in types.items() if t.startswith("*")) + tuple(
            n for n in ("D", "grad_ld", "ld") if n in types
        )
        result = compile_one(fn, types, consts, warps, aligned)
        failed += result.startswith("FAIL")
        flags = " ".join(f"{c}={v}" for c, v in consts.items())
        print(f"{name:24s} warps={warps} {flags}: {result}", flush=True)
    print(f"{failed} variants failed to compile", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
