"""The kernel records (``embtables/kernels/registry.py``): one per optimizer, in sync with the C source's
kinds and named constants, with the docs table, and the only dispatch there is."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import embtables
from embtables.config import OPTIMIZER_TYPES
from embtables.kernels import native
from embtables.kernels.registry import RECORDS, markdown_table, record_of, record_of_type
from embtables.kernels.sparse_update import get_row_update

C_SOURCE = Path(native.__file__).parent / "csrc" / "optimizer_rows.c"  # each optimizer's row function
C_HEADER = C_SOURCE.with_name("embtables_native.h")  # the optimizer kinds and parameter unions the sources share


def _c_text() -> str:
    return C_HEADER.read_text() + C_SOURCE.read_text()


DOCS = Path(__file__).resolve().parents[2] / "docs" / "optimizers.md"


def _c_union_members(union: str) -> dict[str, tuple[str, ...]]:
    """``{member: (field, ...)}`` of ``typedef union { ... } <union>;`` in the C sources."""
    text = _c_text()
    body = re.search(r"typedef union \{(.*?)\} " + union + ";", text, re.S)
    assert body is not None, union
    members = {}
    for fields, member in re.findall(r"struct \{\s*(?:int32_t|float) ([^;]*);\s*\} (\w+);", body.group(1)):
        members[member] = tuple(f.strip() for f in fields.split(","))
    return members


def test_every_optimizer_has_exactly_one_record() -> None:
    assert {r.config for r in RECORDS} == set(OPTIMIZER_TYPES)
    assert len({r.native_kind for r in RECORDS}) == len(RECORDS)


def test_native_kinds_match_the_c_enum() -> None:
    text = _c_text()
    kinds = {name: int(v) for name, v in re.findall(r"ET_([A-Z_]+) = (\d+)", text)}
    for r in RECORDS:
        c_name = {"SGD": "SGD", "FTRL": "FTRL", "RMSProp": "RMSPROP", "CenteredRMSProp": "CENTERED_RMSPROP"}.get(
            r.config.__name__, re.sub(r"(?<!^)(?=[A-Z])", "_", r.config.__name__).upper()
        )
        assert kinds[c_name] == r.native_kind, r.config.__name__


@pytest.mark.parametrize("union, field", [("et_flags", "flag_names"), ("et_constants", "constant_names")])
def test_named_native_fields_match_the_c_unions(union: str, field: str) -> None:
    members = _c_union_members(union)
    expected = {r.native_name: getattr(r, field) for r in RECORDS if getattr(r, field)}
    assert members == expected


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.config.__name__)
def test_native_parameters_come_from_the_record_by_name(record: object) -> None:
    opt = record.config(learning_rate=0.25)  # type: ignore[attr-defined]
    p = native.opt_params(opt, 0.25, 0.0, clip_gradients=True)
    assert p.kind == record.native_kind  # type: ignore[attr-defined]
    constants = record.native_constants(opt, 0.25)  # type: ignore[attr-defined]
    flags = record.native_flags(opt)  # type: ignore[attr-defined]
    raw_c = list(p.constants.raw)
    raw_f = list(p.flags.raw)
    assert raw_c[: len(constants)] == pytest.approx(list(constants.values()), rel=0, abs=0)
    assert raw_c[len(constants) :] == [0.0] * (8 - len(constants))
    assert raw_f[: len(flags)] == [int(v) for v in flags.values()]
    assert get_row_update(opt) is record.update_rows  # type: ignore[attr-defined]


def test_a_record_must_name_exactly_its_fields() -> None:
    bad = dataclasses.replace(record_of(embtables.Adam(0.1)), constants=lambda opt, lr: {"beta_1": 0.9})
    with pytest.raises(RuntimeError, match="must be"):
        bad.native_constants(embtables.Adam(0.1), 0.1)


def test_an_unknown_optimizer_type_is_an_error_everywhere() -> None:
    @dataclasses.dataclass(frozen=True)
    class MyAdagrad(embtables.Adagrad):
        pass

    opt = MyAdagrad(0.1)
    with pytest.raises(TypeError, match="supported: SGD, Adagrad"):
        record_of(opt)
    with pytest.raises(TypeError, match="No sparse update for optimizer type MyAdagrad"):
        get_row_update(opt)
    with pytest.raises(native.NativeBufferError, match="no native kernel for MyAdagrad"):
        native.opt_params(opt, 0.1, 0.0, clip_gradients=True)


def test_ftrl_accumulator_domain_follows_allow_zero_accumulator() -> None:
    record = record_of(embtables.FTRL(0.1))
    assert record.slot_domains(embtables.FTRL(0.1)) == ("positive", "any")
    allow = embtables.FTRL(0.1, allow_zero_accumulator=True)
    assert record.slot_domains(allow) == ("nonnegative", "any")


def test_the_docs_table_is_the_registry() -> None:
    text = DOCS.read_text()
    begin = text.index("-->\n", text.index("<!-- kernel-table:begin")) + len("-->\n")
    end = text.index("<!-- kernel-table:end -->")
    assert text[begin:end] == markdown_table(), "regenerate the table from embtables.kernels.registry.markdown_table()"


def test_every_v1_class_has_exactly_its_optimizers_own_fields_by_the_records_names() -> None:
    from embtables.estimator import parameters

    shared = set(parameters._OptimizationParameters.__annotations__)
    for v1 in parameters.PARAMETER_TYPES:
        record = record_of_type(v1.OPTIMIZER)
        v1_own = [f.name for f in dataclasses.fields(v1) if f.name not in shared]
        assert sorted(v1_own) == sorted(record.v1_name(f) for f in record.own_fields()), v1.__name__


def test_v1_conversion_carries_every_own_field() -> None:
    from embtables.estimator import AdamParameters, ProximalYogiParameters

    adam = AdamParameters(0.1, beta1=0.5, beta2=0.25, epsilon=1e-3, lazy_adam=False, sum_inside_sqrt=False)
    assert adam.to_optimizer() == embtables.Adam(
        0.1, beta_1=0.5, beta_2=0.25, epsilon=1e-3, lazy_adam=False, sum_inside_sqrt=False
    )
    yogi = ProximalYogiParameters(0.1, beta1=0.5, l1_regularization_strength=0.1, initial_accumulator_value=0.5)
    assert yogi.to_optimizer() == embtables.ProximalYogi(
        0.1, beta_1=0.5, l1_regularization_strength=0.1, initial_accumulator_value=0.5
    )


KERNELS = C_SOURCE.parent.parent
PACKAGE = KERNELS.parent


def _gpu_branches() -> dict[str, tuple[str, ...]]:
    """``{config class name: constant names}`` as each branch of the GPU update kernel unpacks ``c0..c5``."""
    common = (KERNELS / "triton_common.py").read_text()
    kinds = dict(re.findall(r'K_(\w+) = tl\.constexpr\(_KINDS\["(\w+)"\]\)', common))
    source = (KERNELS / "triton_update.py").read_text()
    out = {}
    for branch in re.split(r"\n    (?:el)?if KIND == |\n    else:  # ", source)[1:]:
        kind = re.match(r"K_(\w+)", branch)
        assert kind is not None, branch[:80]
        unpack = re.search(r"\n        ([\w, ]+) = (c\d(?:, c\d)*)\n", branch.split("\n    x = tl.where(x < wlo")[0])
        names = tuple(n.strip() for n in unpack.group(1).split(",")) if unpack else ()
        if unpack:
            assert [c.strip() for c in unpack.group(2).split(",")] == [f"c{i}" for i in range(len(names))], branch[:80]
        out[kinds[kind.group(1)]] = names
    return out


def test_the_gpu_kernel_names_each_constant_as_its_record_does() -> None:
    branches = _gpu_branches()
    assert "Adam" in branches and "FrequencyEstimator" in branches  # the parser found every branch
    for record in RECORDS:
        assert branches[record.config.__name__] == record.constant_names, record.config.__name__
    source = (KERNELS / "triton_update.py").read_text()
    body = source[source.index("    if KIND == K_SGD:") : source.index("    x = tl.where(x < wlo")]
    unpacking = {line for line in body.splitlines() if re.search(r"= c\d", line)}
    assert not re.search(r"\bc\d\b", "\n".join(set(body.splitlines()) - unpacking))  # read by name only


# The package files a new optimizer is named in (docs/architecture.md, "Adding things"): ``config_file`` is
# config/optimizers.py or config/extra_optimizers.py, ``module`` its kernels/<name>.py.
def _footprint(config_file: str, module: str) -> set[str]:
    return {
        "embtables/__init__.py",
        "embtables/config/__init__.py",
        "embtables/config/catalogue.py",
        f"embtables/config/{config_file}",
        "embtables/estimator/__init__.py",
        "embtables/estimator/parameters.py",
        f"embtables/kernels/{module}",
        "embtables/kernels/registry.py",
        "embtables/kernels/csrc/optimizer_rows.c",
        "embtables/kernels/csrc/embtables_native.h",
        "embtables/kernels/triton_common.py",
        "embtables/kernels/triton_update.py",
    }


@pytest.mark.parametrize("name, module", [("adadelta", "adadelta.py"), ("proximal_yogi", "proximal_yogi.py"),
                                          ("rmsprop", "rmsprop.py")])  # fmt: skip
def test_an_optimizer_is_named_in_exactly_the_files_architecture_md_lists(name: str, module: str) -> None:
    """Counted on optimizers with no special role elsewhere (the defaults, SGD, Adagrad, Adam and FTRL, are
    named by the CLI and the docs of shared code)."""
    pattern = re.compile(r"(?<![a-z])" + name.replace("_", "_?") + r"(?:parameters)?(?![a-z])", re.IGNORECASE)
    named = {
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*")
        if path.suffix in (".py", ".c", ".h") and "_benchmarks" not in path.parts and pattern.search(path.read_text())
    }
    assert named == _footprint("extra_optimizers.py", module)
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    assert f"**An optimizer** ({len(named)} package files)" in text
