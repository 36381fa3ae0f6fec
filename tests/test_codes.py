"""The operator codes are defined once, in device_kernels/common/codes.h (and
the axis roles in layout_roles.h); jax_rope/core/codes.py mirrors them for a
pure-Python install and the compiled extension exports them. All three agree."""

import pathlib
import re

import pytest

from jax_rope.core import codes

COMMON = pathlib.Path(__file__).resolve().parents[1] / "device_kernels" / "common"


def header_tables() -> dict:
    """codes.h and layout_roles.h read as text, in the form of codes.tables()."""
    text = (COMMON / "codes.h").read_text()
    tables = {}
    for enum, table, key in (("Layout", "kLayouts", "layout"),
                             ("RotaryMode", "kRotaryModes", "rotary_mode"),
                             ("SparseMode", "kSparseModes", "sparse_mode")):
        body = re.search(rf"enum class {enum} : int32_t \{{(.*?)\}};", text, re.S).group(1)
        values = {name: int(value) for name, value in re.findall(r"(k\w+) = (-?\d+)", body)}
        entries = re.search(rf"NamedCode<{enum}> {table}\[\] = \{{(.*?)\}};", text, re.S).group(1)
        named = re.findall(rf'\{{"(\w+)", {enum}::(k\w+)\}}', entries)
        assert sorted(member for _, member in named) == sorted(values), (enum, named, values)
        tables[key] = {name: values[member] for name, member in named}
    roles_text = (COMMON / "layout_roles.h").read_text()
    roles = re.findall(r"case Layout::(k\w+): return \{(-?\d+), (-?\d+), (-?\d+), (-?\d+)\};",
                       roles_text)
    layout_values = {f"k{name}": code for name, code in tables["layout"].items()}
    tables["layout_roles"] = {layout_values[member]: tuple(int(x) for x in axes)
                              for member, *axes in roles}
    return tables


def test_header_parses_into_every_code():
    tables = header_tables()
    assert len(tables["layout"]) == 4 and len(tables["rotary_mode"]) == 3
    assert len(tables["sparse_mode"]) == 9 and len(tables["layout_roles"]) == 4


def test_python_mirror_matches_the_header():
    assert codes.tables() == header_tables()


def test_extension_exports_the_header_codes():
    try:
        from jax_rope import _jax_rope_ffi
    except ImportError as error:
        pytest.skip(f"compiled extension not importable ({error})")
    assert _jax_rope_ffi.codes() == codes.tables()
