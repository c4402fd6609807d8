"""The C interface of the native kernels (``csrc/*.c``), declared once: every exported function with its
argument names and ctypes types (in the C order), its result, and what each status code it returns means.

``bind`` gives a loaded library these types (ctypes then converts and checks every argument); ``unchecked``
binds the functions marked ``fast`` a second time with their result type only, for the small-batch fast
path, whose arguments are already ctypes objects of the exact C types. ``decode`` turns a status into its
meaning and ``raise_for`` raises for the meanings that are never the caller's to explain (out of memory, a
buffer or kind the kernels refuse); the others (``not_finite``, ``out_of_range``...) the caller turns into
an error naming the table or feature. ``tests/numerics/test_native_abi.py`` checks every declaration
against the C prototypes.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any


class NativeBufferError(RuntimeError):
    """A buffer handed to a native kernel is not what the kernel reads (an embtables bug, never user input)."""


_P, _I64, _I32, _U32, _F32, _F64 = (
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int32,
    ctypes.c_uint32,
    ctypes.c_float,
    ctypes.c_double,
)
_OPT = _P  # const et_opt * (a pointer to ``native_library.OptParams``)

# Meanings a caller explains itself; every other meaning but "ok" is raised by ``raise_for``.
CALLER_MEANINGS = frozenset({"ok", "not_finite", "out_of_range", "sizes", "count", "step_back", "inconsistent"})


@dataclasses.dataclass(frozen=True)
class CFunction:
    """One exported C function: ``args`` ((name, ctypes type), ...) in the C order, ``result`` (None: void),
    ``statuses`` ((code, meaning), ...) of its result, ``counts``: its other non-negative results are a count
    or a row (``count``), and ``fast``: the fast path calls it unchecked."""

    name: str
    args: tuple[tuple[str, Any], ...]
    result: Any = None
    statuses: tuple[tuple[int, str], ...] = ()
    counts: bool = False
    fast: bool = False

    def meaning(self, code: int) -> str:
        """The meaning of status ``code`` (``unknown`` for a code the C source never returns)."""
        for c, m in self.statuses:
            if c == code:
                return m
        return "count" if self.counts and code >= 0 else "unknown"


def _f(
    name: str,
    args: str,
    result: Any = None,
    statuses: tuple[tuple[int, str], ...] = (),
    *,
    counts: bool = False,
    fast: bool = False,
) -> CFunction:
    """A declaration from ``"name:type name:type ..."`` (types: p, i64, i32, u32, f32, f64, opt)."""
    types = {"p": _P, "i64": _I64, "i32": _I32, "u32": _U32, "f32": _F32, "f64": _F64, "opt": _OPT}
    parsed = tuple((a.split(":")[0], types[a.split(":")[1]]) for a in args.split())
    return CFunction(name, parsed, result, statuses, counts, fast)


_LOOKUP = ((0, "ok"), (1, "out_of_range"), (2, "not_finite"))
_PREPARE = ((0, "ok"), (1, "not_finite"), (2, "out_of_memory"), (3, "out_of_range"))
_APPLY = ((0, "ok"), (1, "not_finite"), (-2, "does_not_fit"), (-3, "out_of_memory"), (-4, "unknown_kind"))
_CHECK = ((-1, "ok"), (-2, "does_not_fit"), (-3, "out_of_memory"), (-4, "unknown_kind"))

FUNCTIONS: dict[str, CFunction] = {
    f.name: f
    for f in (
        _f("et_all_finite", "F:i64 x:p n:p", _I32),
        _f("et_flushes_subnormals", "", _I32),
        _f("et_round_rows", "x:p U:i64 D:i64 rows:p seed:i64 step:i64 table:i64 kind:i32 stochastic:i32 out:p"),
        _f("et_round_path", "vector:i32", _I32),
        _f("et_bounds_path", "lanes:i32", _I32),
        _f(
            "et_lookup_half_many",
            "F:i64 W:p kind:p D:p V:p ids:p N:p offsets:p S:p coeffs:p out:p ld:p nthreads:i32",
            _I32,
            _LOOKUP,
            fast=True,
        ),
        _f(
            "et_apply_half",
            "handle:p W:p S0:p S1:p S2:p wkind:i32 skind:i32 V:i64 D:i64 p:opt grows:p nglobal:i64 seed:i64 "
            "step:i64 table:i64 stochastic:i32 mode:i32 out:p sout:p scratch_rows:i64 nthreads:i32",
            _I64,
            _CHECK,
            counts=True,
        ),
        _f(
            "et_apply_half_many",
            "T:i64 handles:p W:p S0:p S1:p S2:p wkind:p skind:p V:p D:p p:p grows:p nglobal:p seed:p step:i64 "
            "table:p stochastic:p out:p sout:p scratch_rows:p nthreads:i32 bad:p",
            _I64,
            ((0, "ok"), (1, "not_finite"), (-2, "does_not_fit"), (-3, "out_of_memory"), (-4, "unknown_kind")),
            fast=True,
        ),
        _f("et_mark_changed", "T:i64 handles:p changed:p V:p mode:p", fast=True),
        _f(
            "et_split_by_owner",
            "F:i64 ids:p N:p offsets:p S:p coeffs:p strategy:p V:p W:i64 out_ids:p "
            "out_coeffs:p out_offsets:p out_counts:p",
            _I32,
            ((0, "ok"), (1, "out_of_range")),
        ),
        _f(
            "et_lookup_many",
            "F:i64 W:p D:p V:p ids:p N:p offsets:p S:p coeffs:p out:p ld:p nthreads:i32",
            _I32,
            _LOOKUP,
            fast=True,
        ),
        _f(
            "et_prepare_many",
            "T:i64 first:p ids:p nids:p offsets:p nbags:p coeffs:p grads:p ld:p dims:p V:p "
            "nthreads:i32 workspaces:p statuses:p",
            None,
            _PREPARE,
            fast=True,
        ),
        _f("et_prepared_size", "handle:p", _I64),
        _f("et_prepared_values_max", "T:i64 handles:p D:p", _I64, fast=True),
        _f("et_set_dedup_mode", "mode:i32"),
        _f("et_workspace_bytes", "handle:p", _I64),
        _f("et_prepared_gmax", "handle:p", _F32),
        _f("et_prepared_copy", "handle:p rows:p G:p"),
        _f(
            "et_check",
            "handle:p W:p S0:p S1:p S2:p V:i64 D:i64 p:opt dense:i32 nthreads:i32",
            _I64,
            _CHECK,
            counts=True,
        ),
        _f(
            "et_touched_bounds",
            "handle:p W:p S0:p S1:p S2:p V:i64 D:i64 dense:i32 nthreads:i32 hi:p lo:p",
            _I32,
            ((0, "ok"), (-2, "does_not_fit")),
        ),
        _f(
            "et_apply_sequential",
            "rows:p G:p N:i64 W:p S0:p S1:p S2:p V:i64 D:i64 p:opt nthreads:i32",
            _I32,
            ((0, "ok"), (3, "out_of_range"), (4, "unknown_kind")),
        ),
        _f(
            "et_workspace_load",
            "handle:p rows:p G:p U:i64 D:i64 V:i64",
            _I32,
            ((0, "ok"), (2, "out_of_memory"), (3, "out_of_range")),
        ),
        _f(
            "et_apply_many",
            "T:i64 handles:p W:p S0:p S1:p S2:p V:p D:p p:p dense:p measure:p check:p nthreads:i32 "
            "maxabs:p status:p bad:p hi:p lo:p proven:p",
            None,
            _APPLY,
            fast=True,
        ),
        _f("et_prove_update", "p:opt gmax:f64 hi:p lo:p out:p", _I32),
        _f(
            "et_stage_inputs_many",
            "F:i64 ids:p N:p splits:p S:p V:p dst:p cap:i64 status:p single:p combiner:p coef:p coef_cap:i64",
            _I64,
            ((-1, "sizes"),),
            counts=True,
            fast=True,
        ),
        _f("et_workspace_new", "", _P),
        _f("et_workspace_free", "handle:p"),
        _f("et_shm_post", "word:p value:u32"),
        _f(
            "et_offload_rows",
            "fd:i32 size:i64 buf:p row_bytes:i64 rows:p n:i64 op:i32 depth:i32 err:p",
            _I32,
            ((0, "ok"), (1, "io_error"), (2, "sizes")),
        ),
        _f("et_offload_io_engine", "want:i32", _I32),
        _f(
            "et_res_remove",
            "units:p slots:p last:p uses:p n:i64 pos:p e:i64 free_slots:p nfree:i64 cap:i64",
            _I32,
            ((0, "ok"), (2, "sizes")),
        ),
        _f(
            "et_res_insert",
            "units:p slots:p last:p uses:p n:i64 cap:i64 new_units:p new_slots:p k:i64 never:i32",
            _I32,
            ((0, "ok"), (2, "sizes")),
        ),
        _f(
            "et_res_victims",
            "last:p uses:p n:i64 asked:p na:i64 pin_from:i32 step:i32 decay:f32 over:i64 out:p",
            _I64,
            ((-1, "sizes"), (-2, "out_of_memory")),
            counts=True,
        ),
        _f("et_crc32c", "data:p n:i64 crc:u32", _U32),
        _f("et_shm_wait", "word:p target:u32 timeout_s:f64 peer_fd:i32", _I32),
        _f("et_km_new", "V:i64 admit_after:i64 eviction:i32 ttl:i64", _P),
        _f("et_km_free", "handle:p"),
        _f(
            "et_km_train",
            "handle:p keys:p n:i64 s:i64 pin_from:i64 rows:p reset:p",
            _I64,
            ((-1, "step_back"), (-2, "out_of_memory")),
            counts=True,
        ),
        _f("et_km_train_many", "T:i64 handles:p keys:p n:p s:i64 pin_from:i64 rows:p reset:p out:p nthreads:i32"),
        _f("et_km_find", "handle:p keys:p n:i64 rows:p"),
        _f("et_km_stats", "handle:p out:p"),
        _f("et_km_export", "handle:p key:p count:p last:p order:p"),
        _f("et_km_export_pending", "handle:p key:p count:p last:p"),
        _f(
            "et_km_import",
            "handle:p key:p count:p last:p order:p pkey:p pcount:p plast:p np:i64 s:i64",
            _I32,
            ((0, "ok"), (1, "inconsistent")),
        ),
    )
}


# Per function, the listed codes whose meaning the caller explains (``raise_for`` skips them first).
_QUIET = {f.name: frozenset(c for c, m in f.statuses if m in CALLER_MEANINGS) for f in FUNCTIONS.values()}


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give every declared function of ``lib`` its argument and result types; returns ``lib``."""
    for f in FUNCTIONS.values():
        fn = getattr(lib, f.name)
        fn.argtypes = [t for _, t in f.args]
        fn.restype = f.result
    return lib


_unchecked: tuple[ctypes.CDLL, ctypes.CDLL] | None = None


def unchecked(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The ``fast`` functions of ``lib`` bound a second time with their result type only: ctypes converts no
    argument, which saves about 1 us a call of 12-16 arguments. Every argument must be a ctypes object of
    the C parameter's exact type (an array or ``c_void_p`` for a pointer, ``c_int64``, ``c_int``): a Python
    int would be passed as a C int."""
    global _unchecked
    held = _unchecked
    if held is not None and held[0] is lib:
        return held[1]
    raw = ctypes.CDLL(lib._name)
    for f in FUNCTIONS.values():
        if f.fast:
            getattr(raw, f.name).restype = f.result
    _unchecked = (lib, raw)
    return raw


def decode(function: str, code: int) -> str:
    """The meaning of status ``code`` returned by C function ``function``."""
    return FUNCTIONS[function].meaning(int(code))


def raise_for(function: str, codes: Any, subject: str = "") -> None:
    """Raise for any status of ``codes`` (one code or an iterable of them, from C function ``function``)
    whose meaning the caller does not explain: ``MemoryError`` when out of memory, ``NativeBufferError``
    for a buffer, an optimizer kind or a status the kernels refuse. ``subject`` names what the call was
    about (a table, an optimizer kind), in both errors; nothing is written by a call that returns such a
    status."""
    quiet = _QUIET[function]
    for code in {codes} if isinstance(codes, int) else set(codes):  # a ctypes array iterates by index
        if code in quiet:  # every step: one set lookup per distinct code
            continue
        meaning = decode(function, code)
        if meaning in CALLER_MEANINGS:
            continue
        if meaning == "out_of_memory":
            raise MemoryError(
                f"{subject or 'embtables'}: out of memory in the native kernels ({function}); nothing was written."
            )
        what = {"does_not_fit": "a prepared update does not fit its table", "unknown_kind": "unknown optimizer kind"}
        about = f" ({subject})" if subject else ""
        raise NativeBufferError(f"embtables native kernel {function}: {what.get(meaning, f'status {code}')}{about}.")
